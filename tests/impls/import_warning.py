"""A correct Sinkhorn from a module that warns as it is imported and prints (as a library that is
deprecated, or that logs its build, does): mhctool's terminal shows neither; the library log has both."""
import warnings

from mhctool.kernels.torch import mhc as native

warnings.warn("import_warning: this module is deprecated", UserWarning, stacklevel=1)
print("import_warning: built its kernels")


def sinkhorn(logits, iters=20, eps=1e-6):
    return native.sinkhorn(logits, iters, eps)
