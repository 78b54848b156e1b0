"""TransformerEngine's Triton mHC kernels (``transformer_engine/pytorch/triton/mhc.py``).

What differs from mhctool's contracts, and how it is met here:

- layouts: TE keeps the streams innermost, ``x`` is ``(s, b, C, n)``; the adapter permutes
  mhctool's ``(s, b, n, C)`` into it and the output back (outside TE's code);
- ``mhc_fused_sinkhorn(H_res, n, recompute_hist, iters)``: log-domain iterations, rows first, no
  eps: conventions ``eps=0``, ``domain=log`` (judged against a log-domain native baseline at the
  same dtype; the float64 reference is the same matrix in either domain);
- ``mhc_fused_expand_combine(f, bias, H_post, x, H_res, n, use_tf32)``: h_post_bda with ``H_res^T``
  (``transpose_res=true``);
- ``mhc_fused_projection(x, phi, use_tf32) -> (H [M, 32] padded, ms [M])`` then
  ``mhc_fused_scale(H, alpha (3,), beta (1, N), ms, n)``: the mapping path in two calls, with eps
  inside the square root (``rms_eps=inside``, ``eps`` = fp32 machine epsilon); the optional ``rms``
  output is ``sqrt(ms)``. The projection asks CUDA for TMA support: GPU only;
- n = 4 only; ``use_tf32=True`` (as shipped) is judged at TF32 with truncated operands on a GPU
  (``tf32_trunc``: Triton's tl.dot, as ``mhctool identify`` names it on an H100) and at IEEE through
  the CPU interpreter (which multiplies fp32 at IEEE whatever it is asked), ``use_tf32=False`` at
  IEEE: each kernel with a ``use_tf32`` flag is offered as two implementations.

- ``mhc_generate_mix_and_aggregate(x, phi, alpha, beta)``: the whole pre-path in one call, judged
  as the ``mix_aggregate`` family against the float64 composite (mapping, Sinkhorn, aggregation),
  with the projection's and the Sinkhorn's conventions together; x goes in as ``(s, b, C, n)`` and
  phi's columns are permuted to match (the product is the same sum).
"""
from __future__ import annotations

import os

import torch

from . import TRITON_FP32_DOT, Binding, load_path_or_module, n_of

NAME = "te"
MODULE = "transformer_engine.pytorch.triton.mhc"
FP32_EPS = float(torch.finfo(torch.float32).eps)


def load(target: str):
    if os.environ.get("TRITON_INTERPRET") == "1":  # TE's autotuner cannot run under the interpreter
        os.environ.setdefault("NVTE_DISABLE_TRITON_AUTOTUNING", "1")
    return load_path_or_module(target, MODULE, "mhc.py")


def _n4(shape) -> str | None:
    return None if shape.n == 4 else f"TransformerEngine's mHC kernels take n = 4 only, not {shape.n}"


def _sinkhorn(m, logits, iters=20):
    return m.mhc_fused_sinkhorn(logits, 4, True, iters)


def _streams_inner(x):
    """mhctool's (s, b, n, C) -> TE's (s, b, C, n)."""
    return x.transpose(-1, -2).contiguous()


def _phi(weight):
    """mhctool's weight rows over (n, C) -> TE's phi, whose columns follow (C, n) like its x."""
    rows, nc = weight.shape
    n = n_of(weight)
    return weight.reshape(rows, n, nc // n).transpose(1, 2).reshape(rows, nc).contiguous()


# the inputs whose layout TE's kernels take otherwise; converted by the adapter, outside the
# library's code (and outside the timed region in bench)
STREAMS_INNER = {"x": _streams_inner}


def _aggregate(tf32: bool):
    def call(m, x, h_pre):  # x in TE's layout
        return m.mhc_fused_aggregate(x, h_pre, 4, use_tf32=tf32)
    return call


def _expand_combine(tf32: bool):
    def call(m, h_res, x, h_post, y, bias):
        out = m.mhc_fused_expand_combine(y, bias, h_post, x, h_res, 4, use_tf32=tf32)
        return out.transpose(-1, -2)  # a view: back to mhctool's layout without a copy
    return call


def _mapping(tf32: bool):
    def call(m, x2d, weight, alpha, h_bias):
        n = n_of(weight)
        padded, ms = m.mhc_fused_projection(x2d, weight, use_tf32=tf32)
        h_pre, h_post, h_res = m.mhc_fused_scale(padded, alpha, h_bias.reshape(1, -1), ms, n)
        return h_pre, h_post, h_res.reshape(h_res.shape[0], n, n), ms.sqrt()
    return call


def _mix_aggregate(tf32: bool):
    def call(m, x, weight, alpha, h_bias):  # x and weight in TE's layouts
        return m.mhc_generate_mix_and_aggregate(x, weight, alpha, h_bias.reshape(1, -1), use_tf32=tf32)
    return call


def recognise(m) -> tuple[str, list[Binding]]:
    found = []
    # TE's own projection asks CUDA for TMA support (GPU only); a plain-PyTorch module with its
    # signatures (no mHCProjectionOp) runs anywhere
    projection_devices = ("cuda",) if hasattr(m, "mHCProjectionOp") else ("cpu", "cuda")
    if hasattr(m, "mhc_fused_sinkhorn"):
        found.append(Binding("sinkhorn", "mhc_fused_sinkhorn", _sinkhorn, ("iters",),
                             {"eps": 0.0, "stabilize": "rowmax", "order": "row_first", "domain": "log"}, limit=_n4))
    for tf32 in (True, False):
        # use_tf32: Triton's tl.dot at TF32, whose operands the tensor cores truncate (identified on an
        # H100: tf32_trunc); the CPU interpreter multiplies fp32 at IEEE whatever it is asked
        precision, variant = (TRITON_FP32_DOT, "tf32") if tf32 else ("ieee", "ieee")
        if hasattr(m, "mhc_fused_aggregate"):
            found.append(Binding("h_aggregate", "mhc_fused_aggregate", _aggregate(tf32), (), {}, precision, variant,
                                 limit=_n4, layouts=STREAMS_INNER))
        if hasattr(m, "mhc_fused_expand_combine"):
            found.append(Binding("h_post_bda", "mhc_fused_expand_combine", _expand_combine(tf32), (),
                                 {"transpose_res": True}, precision, variant, limit=_n4, layouts=STREAMS_INNER))
        if hasattr(m, "mhc_fused_projection") and hasattr(m, "mhc_fused_scale"):
            found.append(Binding("mapping", "mhc_fused_projection+mhc_fused_scale", _mapping(tf32), (),
                                 {"rms_eps": "inside", "eps": FP32_EPS}, precision, variant, projection_devices, _n4))
        if hasattr(m, "mhc_generate_mix_and_aggregate"):
            found.append(Binding("mix_aggregate", "mhc_generate_mix_and_aggregate", _mix_aggregate(tf32), (),
                                 {"rms_eps": "inside", "eps": FP32_EPS, "sinkhorn_eps": 0.0, "domain": "log"},
                                 precision, variant, projection_devices, _n4,
                                 layouts={**STREAMS_INNER, "weight": _phi}))
    return "main", found
