"""Liger-Kernel's mHC (``liger_kernel/ops/mhc.py``, public API ``liger_kernel.transformers.functional``).

``--impl liger:liger_kernel`` (the installed package), ``liger:FOLDER`` (a folder holding
``liger_kernel/``) or ``liger:path/to/functional.py``. What differs from mhctool's contracts, and
how it is met here:

- ``liger_mhc_pre(x, h_pre)``: h_aggregate, the same layouts (``x[..., n, C]``);
- ``liger_mhc_post_res(x, f_out, h_post, h_res)``: h_post_bda mixing with H itself (the
  contract, not H^T), with no bias argument: where a case has a bias the adapter adds it to the
  branch (``f_out = y + bias``, one PyTorch add outside Liger's code, the same add the contract
  makes before the product);
- ``liger_mhc_coeffs(x, phi, b, alpha_pre, alpha_post, alpha_res, *, allow_fp32, tmax, rms_eps,
  pre_eps, sinkhorn_eps, post_mult)``: the projection, the RMS scale, the sigmoids and Sinkhorn in
  one autograd Function, judged as the ``mapping_sinkhorn`` family. ``phi`` is ``[n*C, n^2+2n]``
  (mhctool's weight transposed, outside the timed region in bench); the three alphas are split
  from mhctool's ``alpha[3]`` (views, so their gradients flow back); ``tmax`` is ``iters``,
  ``rms_eps`` is ``eps``, ``pre_eps`` is ``compute_h_eps``; ``post_mult`` stays 2 (the
  contract's ``H_post = 2 sigmoid``); fp32 activations need Liger's own ``allow_fp32=True``,
  which the adapter passes exactly for fp32 inputs. Conventions: eps inside the square root
  (``rms_eps=inside``), a row-softmax-first Sinkhorn (``stabilize=softmax``, rows first).
- ``liger_mhc_coeffs`` then ``liger_mhc_pre``: the whole pre-path, judged as ``mix_aggregate``.

Precision: bf16 and fp16 operands go to ``tl.dot`` as they are (exact products, fp32 sums); fp32
ones go at Triton's default, TF32 with truncated operands on a GPU (``tf32_trunc``), while the CPU
interpreter multiplies fp32 at IEEE. Liger's Sinkhorn takes ``tl.arange`` over the n streams: n must
be a power of two.
"""
from __future__ import annotations

import importlib
import importlib.metadata
from pathlib import Path

import torch

from . import TRITON_FP32_DOT, Binding, load_path_or_module

NAME = "liger"
MODULE = "liger_kernel.transformers.functional"
FUNCTIONS = ("liger_mhc_pre", "liger_mhc_post_res", "liger_mhc_coeffs")


def load(target: str):
    path = Path(target)
    if path.suffix == ".py" or path.is_dir():
        return load_path_or_module(target, MODULE, "functional.py")
    module = load_path_or_module(target, MODULE, "functional.py")
    if not any(hasattr(module, f) for f in FUNCTIONS):  # the package named: its public functional API
        try:
            return importlib.import_module(f"{target}.transformers.functional")
        except ImportError:
            return module
    return module


def _power_of_two(shape) -> str | None:
    n = shape.n
    return None if n >= 1 and n & (n - 1) == 0 else f"Liger-Kernel's mHC kernels take n a power of two, not {n}"


def _pre(m, x, h_pre):
    return m.liger_mhc_pre(x, h_pre)


def _post_res(m, h_res, x, h_post, y, bias):
    return m.liger_mhc_post_res(x, y if bias is None else y + bias, h_post, h_res)


def _phi(weight):
    """mhctool's weight ``[n^2+2n, n*C]`` -> Liger's ``phi[n*C, n^2+2n]``."""
    return weight.t().contiguous()


def _coeffs(m, x, phi, alpha, h_bias, eps=1e-6, iters=20, sinkhorn_eps=1e-6, compute_h_eps=0.0):
    return m.liger_mhc_coeffs(x, phi, h_bias, alpha[0], alpha[1], alpha[2], allow_fp32=x.dtype == torch.float32,
                              tmax=iters, rms_eps=eps, pre_eps=compute_h_eps, sinkhorn_eps=sinkhorn_eps,
                              post_mult=2.0)


def _coeffs_pre(m, x, phi, alpha, h_bias, **knobs):
    h_pre, h_post, h_res = _coeffs(m, x, phi, alpha, h_bias, **knobs)
    return m.liger_mhc_pre(x, h_pre), h_post, h_res


COEFF_KNOBS = ("eps", "iters", "sinkhorn_eps", "compute_h_eps")
CONVENTIONS = {"rms_eps": "inside", "stabilize": "softmax", "order": "row_first"}


def recognise(m) -> tuple[str, list[Binding]]:
    found = []
    if hasattr(m, "liger_mhc_pre"):
        found.append(Binding("h_aggregate", "liger_mhc_pre", _pre))
    if hasattr(m, "liger_mhc_post_res"):
        found.append(Binding("h_post_bda", "liger_mhc_post_res", _post_res,
                             glue="the bias added to the branch (y + bias), one PyTorch add"))
    if hasattr(m, "liger_mhc_coeffs"):
        found.append(Binding("mapping_sinkhorn", "liger_mhc_coeffs", _coeffs, COEFF_KNOBS, dict(CONVENTIONS),
                             TRITON_FP32_DOT, limit=_power_of_two, layouts={"weight": _phi}))
        if hasattr(m, "liger_mhc_pre"):
            found.append(Binding("mix_aggregate", "liger_mhc_coeffs+liger_mhc_pre", _coeffs_pre, COEFF_KNOBS,
                                 dict(CONVENTIONS), TRITON_FP32_DOT, limit=_power_of_two, layouts={"weight": _phi}))
    return _version(m), found


def _version(m) -> str:
    """The installed distribution's version where the module is that distribution's, else "local"."""
    try:
        dist = importlib.metadata.distribution("liger-kernel")
    except importlib.metadata.PackageNotFoundError:
        return "local"
    where = Path(str(dist.locate_file("liger_kernel"))).resolve()
    here = Path(getattr(m, "__file__", "") or ".").resolve()
    return dist.version if here.is_relative_to(where) else "local"
