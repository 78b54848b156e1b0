"""Large inputs drawn on a GPU, one launch a tensor.

A value is a function of the seed and of its index alone: counter-based Philox-4x32-10, keyed by
the seed, its counter the element's index. A GPU therefore draws the same values whatever its size
and however its programs are scheduled, and a tensor of n values is the first n of a longer one.
Normal values come by Box-Muller from the first two of the four words Philox gives an index,
uniform ones in [0, 1) from the first word. (PyTorch's CUDA generator gives its values by thread,
and a large tensor's threads by the GPU's size: drawn with it in blocks small enough for any GPU,
a paper-shape case took some 20,000 launches, 0.2-0.3 s of launches a case on an H200 host.)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _fill(out_ptr, n, seed, NORMAL: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    lo = (i & 0xFFFFFFFF).to(tl.uint32)
    hi = (i >> 32).to(tl.uint32)
    zero = tl.zeros_like(lo)
    r0, r1, _, _ = tl.philox(seed, lo, hi, zero, zero)
    u0 = tl.uint_to_uniform_float(r0)
    if NORMAL:
        u1 = tl.uint_to_uniform_float(r1)
        v = tl.sqrt(-2.0 * tl.log(tl.maximum(u0, 1.0e-7))) * tl.cos(6.283185307179586 * u1)
    else:
        v = u0
    tl.store(out_ptr + i, v, mask=i < n)


def fill(out: torch.Tensor, seed: int, normal: bool) -> torch.Tensor:
    """``out`` (contiguous float32) filled with seeded standard normal (``normal``) or uniform
    [0, 1) values; ``seed`` in [0, 2^63)."""
    if not out.is_contiguous() or out.dtype != torch.float32:
        raise ValueError("philox.fill takes a contiguous float32 tensor")
    n = out.numel()
    if n:
        _fill[(triton.cdiv(n, BLOCK),)](out, n, seed, NORMAL=normal, BLOCK=BLOCK)
    return out
