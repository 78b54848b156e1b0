"""A deterministic column sum in Triton: ``out[l] = sum_r ws[r, l]`` (fp32 partials -> out dtype).

The backward kernels write per-block partial sums (over C chunks or token blocks) to a small fp32
workspace instead of using atomics, so their results do not depend on scheduling; this kernel
finishes the reduction. ``sum_rows_pair`` finishes two workspaces in one launch (the Triton
mapping backward's alpha and bias partials): one launch instead of two, and the two sums' reads
overlap instead of each paying its own ramp and tail. (The n = 4 h_post_bda tensor-core backward
finishes its own partials inside the kernel.)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from mhctool.core.poison import empty

from ._common import cast, cdiv, fast, next_pow2


@triton.jit
def _sum_cols(ws_ptr, out_ptr, R, L, pid, BLOCK: tl.constexpr, BLOCK_R: tl.constexpr, ORDERED: tl.constexpr):
    """Columns ``[pid * BLOCK, (pid + 1) * BLOCK)`` of one workspace."""
    cols = pid * BLOCK + tl.arange(0, BLOCK)
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


@fast
@triton.jit
def _sum_rows(ws_ptr, out_ptr, R, L, P, ws2_ptr, out2_ptr, R2, L2,
              BLOCK: tl.constexpr, BLOCK_R: tl.constexpr, ORDERED: tl.constexpr,
              BLOCK2: tl.constexpr, BLOCK_R2: tl.constexpr, ORDERED2: tl.constexpr, PAIR: tl.constexpr):
    """Programs ``[0, P)`` sum the first workspace; with ``PAIR``, the rest sum the second."""
    pid = tl.program_id(0)
    if PAIR:
        if pid < P:
            _sum_cols(ws_ptr, out_ptr, R, L, pid, BLOCK, BLOCK_R, ORDERED)
        else:
            _sum_cols(ws2_ptr, out2_ptr, R2, L2, pid - P, BLOCK2, BLOCK_R2, ORDERED2)
    else:
        _sum_cols(ws_ptr, out_ptr, R, L, pid, BLOCK, BLOCK_R, ORDERED)


def _plan(ws: torch.Tensor, ordered: bool) -> tuple[int, int, bool, int]:
    """(columns a program, rows a step, ordered, programs) for a ``[R, L]`` workspace."""
    R, L = ws.shape
    ordered = ordered or R == 1
    if ordered:
        return 1024, 1, True, cdiv(L, 1024)
    if R < 64:
        # a few partials of many columns (dW's token splits: 8 rows of 688128 at the paper shape):
        # all rows in one step and wide column blocks. 64 rows a step (56 of them masked) over
        # 5376 programs, mix_aggregate's backward spent 23.3 us in its two sums on an H200; 14.5 so
        block_r = next_pow2(R)
        block = max(32, min(8192 // block_r, next_pow2(cdiv(L, 256))))
        return block, block_r, False, cdiv(L, block)
    # the tree sum: narrow column blocks where L is short, so that a few thousand columns still
    # spread over a few hundred programs (a bias gradient: R partials of C columns)
    block = max(32, min(128, next_pow2(cdiv(L, 256))))
    return block, 64, False, cdiv(L, block)


def sum_rows(ws: torch.Tensor, dtype: torch.dtype, shape, ordered: bool = False) -> torch.Tensor:
    """Sum a ``[R, L]`` fp32 workspace over R into a new tensor of ``shape`` (L elements).

    ``ordered``: add the rows one by one in order, for per-token results (a column is one token's
    partials over C blocks, R is small). The default tree sum is more accurate for many rows (a sum
    over token blocks) but its order follows the layout Triton picks for the ``[BLOCK_R, BLOCK]``
    tile, which can change with L, i.e. with the number of tokens (seen on an H100: grad_h_post
    of one token differed by up to 5 ulp from the same token in a batch of 32768)."""
    out = empty(shape, dtype, ws.device)
    R, L = ws.shape
    if L:
        block, block_r, ordered, progs = _plan(ws, ordered)
        _sum_rows[(progs,)](ws, out, R, L, progs, ws, out, R, L, BLOCK=block, BLOCK_R=block_r, ORDERED=ordered,
                            BLOCK2=block, BLOCK_R2=block_r, ORDERED2=ordered, PAIR=False, num_warps=4)
    return out


def sum_rows_pair(first: tuple, second: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """Two ``sum_rows`` in one launch: each argument is ``(ws, dtype, shape, ordered)``; the
    results are the same bits as two ``sum_rows`` calls (the same programs, numbered on)."""
    (ws, dtype, shape, ordered), (ws2, dtype2, shape2, ordered2) = first, second
    out, out2 = empty(shape, dtype, ws.device), empty(shape2, dtype2, ws2.device)
    (R, L), (R2, L2) = ws.shape, ws2.shape
    block, block_r, ordered, progs = _plan(ws, ordered)
    block2, block_r2, ordered2, progs2 = _plan(ws2, ordered2)
    if progs + progs2:
        _sum_rows[(progs + progs2,)](ws, out, R, L, progs, ws2, out2, R2, L2, BLOCK=block, BLOCK_R=block_r,
                                     ORDERED=ordered, BLOCK2=block2, BLOCK_R2=block_r2, ORDERED2=ordered2,
                                     PAIR=True, num_warps=4)
    return out, out2
