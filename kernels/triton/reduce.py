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

from ._common import cast, next_pow2


@triton.jit
def _sum_rows(ws_ptr, out_ptr, R, L, BLOCK: tl.constexpr, BLOCK_R: tl.constexpr, ORDERED: tl.constexpr):
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < L
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    if ORDERED:
        # one row at a time, in row order: every column is summed in the same order whatever the
        # tile's layout (which Triton may choose differently for another L)
        ptrs = ws_ptr + cols
        for _ in range(0, R):
            acc += tl.load(ptrs, mask=mask, other=0.0)
            ptrs += L  # 64-bit pointer arithmetic: no int32 product r * L
    else:
        for r0 in range(0, R, BLOCK_R):
            # a tree sum over BLOCK_R rows, then a short sequential sum of those: about pairwise accuracy
            r = r0 + tl.arange(0, BLOCK_R)
            tile = tl.load(ws_ptr + r.to(tl.int64)[:, None] * L + cols[None, :],
                           mask=(r[:, None] < R) & mask[None, :], other=0.0)
            acc += tl.sum(tile, axis=0)
    tl.store(out_ptr + cols, cast(acc, out_ptr.dtype.element_ty), mask=mask)


def sum_rows(ws: torch.Tensor, dtype: torch.dtype, shape, ordered: bool = False) -> torch.Tensor:
    """Sum a ``[R, L]`` fp32 workspace over R into a new tensor of ``shape`` (L elements).

    ``ordered``: add the rows one by one in order, for per-token results (a column is one token's
    partials over C blocks, R is small). The default tree sum is more accurate for many rows (a sum
    over token blocks) but its order follows the layout Triton picks for the ``[BLOCK_R, BLOCK]``
    tile, which can change with L, i.e. with the number of tokens (seen on an H100: grad_h_post
    of one token differed by up to 5 ulp from the same token in a batch of 32768)."""
    R, L = ws.shape
    out = empty(shape, dtype, ws.device)
    if L:
        # the tree sum: narrow column blocks where L is short, so that a few thousand columns
        # still spread over a few hundred programs (a bias gradient: R partials of C columns)
        block, block_r = (1024, 1) if ordered or R == 1 else (max(32, min(128, next_pow2(triton.cdiv(L, 256)))), 64)
        _sum_rows[(triton.cdiv(L, block),)](ws, out, R, L, BLOCK=block, BLOCK_R=block_r,
                                           ORDERED=ordered or R == 1, num_warps=4)
    return out
