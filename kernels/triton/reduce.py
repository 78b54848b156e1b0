"""A deterministic column sum in Triton: ``out[l] = sum_r ws[r, l]`` (fp32 partials -> out dtype).

The backward kernels write per-block partial sums (over C chunks or token blocks) to a small fp32
workspace instead of using atomics, so their results do not depend on scheduling; this kernel
finishes the reduction.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from mhctool.poison import empty

from ._common import cast


@triton.jit
def _sum_rows(ws_ptr, out_ptr, R, L, BLOCK: tl.constexpr, BLOCK_R: tl.constexpr):
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < L
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        # a tree sum over BLOCK_R rows, then a short sequential sum of those: about pairwise accuracy
        r = r0 + tl.arange(0, BLOCK_R)
        tile = tl.load(ws_ptr + r.to(tl.int64)[:, None] * L + cols[None, :],
                       mask=(r[:, None] < R) & mask[None, :], other=0.0)
        acc += tl.sum(tile, axis=0)
    tl.store(out_ptr + cols, cast(acc, out_ptr.dtype.element_ty), mask=mask)


def sum_rows(ws: torch.Tensor, dtype: torch.dtype, shape) -> torch.Tensor:
    """Sum a ``[R, L]`` fp32 workspace over R into a new tensor of ``shape`` (L elements)."""
    R, L = ws.shape
    out = empty(shape, dtype, ws.device)
    if L:
        block, block_r = (128, 64) if R > 1 else (1024, 1)
        _sum_rows[(triton.cdiv(L, block),)](ws, out, R, L, BLOCK=block, BLOCK_R=block_r, num_warps=4)
    return out
