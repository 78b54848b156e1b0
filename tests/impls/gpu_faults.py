"""A GPU kernel that faults: a Triton Sinkhorn wrapper whose kernel writes far out of bounds on
inputs with more than 100 tokens (an illegal memory access poisons the CUDA context, so only
isolation can judge the cases after it). Correct otherwise (the native math, so the later cases
pass)."""
import triton
import triton.language as tl

from mhctool.kernels.torch import mhc as native


@triton.jit
def _scribble(ptr, offset):
    tl.store(ptr + offset + tl.arange(0, 16), tl.zeros([16], tl.float32))


def sinkhorn_faults_on_large_inputs(logits, iters=20, eps=1e-6):
    out = native.sinkhorn(logits, iters, eps)
    if logits.numel() // (logits.shape[-1] ** 2) > 100:
        _scribble[(1,)](out, 1 << 40)  # 4 TiB past the output: never mapped
    return out
