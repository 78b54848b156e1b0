"""H-aggregate in Triton: ``out[t, c] = sum_j h_pre[t, j] x[t, j, c]``, forward and backward.

Memory-bound: the forward reads x once and writes out; the backward reads x and the upstream
gradient once and writes grad_x, with grad_h_pre (a reduction over C) kept in fp32 registers by a
program that walks the whole C of its token.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from mhctool.core.poison import empty

from ._common import cast, cdiv, check_device, fast, next_pow2, require_contiguous


@fast
@triton.jit
def _h_aggregate_fwd(x_ptr, h_ptr, out_ptr, C, N: tl.constexpr, NP: tl.constexpr,
                     BLOCK_C: tl.constexpr):
    """A one-dimensional grid, a token's C blocks on consecutive programs, so that programs
    launched together read one contiguous stretch of x (at the paper shape on an H200: 0.530 ms
    against 0.549 for a (token, C block) grid, the same bits; dev/agg_fwd_sweep.py)."""
    blocks = tl.cdiv(C, BLOCK_C)
    pid = tl.program_id(0).to(tl.int64)
    t = pid // blocks
    c = (pid % blocks) * BLOCK_C + tl.arange(0, BLOCK_C)
    j = tl.arange(0, NP)
    h = tl.load(h_ptr + t * N + j, mask=j < N, other=0.0).to(tl.float32)
    mask = (j[:, None] < N) & (c[None, :] < C)
    x = tl.load(x_ptr + t * N * C + j[:, None] * C + c[None, :], mask=mask, other=0.0)
    out = tl.sum(x.to(tl.float32) * h[:, None], axis=0)
    tl.store(out_ptr + t * C + c, cast(out, out_ptr.dtype.element_ty), mask=c < C)


@fast
@triton.jit
def _h_aggregate_bwd(x_ptr, h_ptr, g_ptr, dx_ptr, dh_ptr, C, N: tl.constexpr, NP: tl.constexpr,
                     BLOCK_C: tl.constexpr, WRITE_DX: tl.constexpr = True):
    """grad_h_pre, and with ``WRITE_DX`` grad_x (without, x and the gradient are read, nothing but
    grad_h_pre written: mix_aggregate's projection backward adds grad_x's term itself)."""
    t = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, NP)
    h = tl.load(h_ptr + t * N + j, mask=j < N, other=0.0).to(tl.float32)
    acc = tl.zeros([NP], dtype=tl.float32)
    for c0 in range(0, C, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        mask = (j[:, None] < N) & (c[None, :] < C)
        g = tl.load(g_ptr + t * C + c, mask=c < C, other=0.0).to(tl.float32)
        offs = t * N * C + j[:, None] * C + c[None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if WRITE_DX:
            tl.store(dx_ptr + offs, cast(h[:, None] * g[None, :], dx_ptr.dtype.element_ty), mask=mask)
        acc += tl.sum(x * g[None, :], axis=1)
    tl.store(dh_ptr + t * N + j, cast(acc, dh_ptr.dtype.element_ty), mask=j < N)


def _tile(C: int, backward: bool) -> dict:
    """The tile, a function of the shape alone. Both kernels' sums run in an order set by the tile
    (the backward's over C, the forward's over n), so a tile picked by timing, as an autotuner
    does, gave other bits from one process to the next: the GPU gate's fp32 h_aggregate and
    mix_aggregate rows differed between runs on one and four GPUs (four-H200 node, 2026-11-26).
    These are the tiles the autotuner picked at the paper shape on an H200 (forward 2048 x 8
    warps, 0.530 ms; backward 2048 x 4); its other choices were within 1% there."""
    block = min(2048, next_pow2(C))
    return {"BLOCK_C": block, "num_warps": 4 if backward or block < 2048 else 8}


def _check(x, h_pre):
    if x.dim() != 4 or h_pre.shape != x.shape[:3]:
        raise ValueError(f"h_aggregate takes x[s,b,n,C] and h_pre[s,b,n]; got {tuple(x.shape)} and {tuple(h_pre.shape)}")
    check_device(x, h_pre)
    require_contiguous("x", x)
    return x, h_pre.contiguous()


def h_aggregate_forward(x, h_pre):
    x, h_pre = _check(x, h_pre)
    s, b, n, C = x.shape
    T = s * b
    out = empty((s, b, C), x.dtype, x.device)
    if T and C:
        cfg = _tile(C, backward=False)
        _h_aggregate_fwd[(T * cdiv(C, cfg["BLOCK_C"]),)](x, h_pre, out, C, N=n, NP=next_pow2(n), **cfg)
    return out


def h_aggregate_backward(x, h_pre, grad_out, write_dx: bool = True):
    """``(grad_x, grad_h_pre)``; without ``write_dx`` grad_x is None (mix_aggregate's backward
    computes it inside the projection's)."""
    x, h_pre = _check(x, h_pre)
    grad_out = grad_out.contiguous()
    s, b, n, C = x.shape
    T = s * b
    dx = empty(x.shape, x.dtype, x.device) if write_dx else None
    dh = empty(h_pre.shape, h_pre.dtype, x.device)
    if T:
        args = (x, h_pre, grad_out, x if dx is None else dx, dh, C)
        _h_aggregate_bwd[(T,)](*args, N=n, NP=next_pow2(n), WRITE_DX=write_dx, **_tile(C, backward=True))
    return dx, dh


class HAggregateFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, h_pre):
        ctx.save_for_backward(x, h_pre)
        return h_aggregate_forward(x, h_pre)

    @staticmethod
    def backward(ctx, grad_out):
        x, h_pre = ctx.saved_tensors
        return h_aggregate_backward(x, h_pre, grad_out)


def h_aggregate(x, h_pre):
    """``h_aggregate(x[s,b,n,C], h_pre[s,b,n]) -> [s,b,C]`` (Megatron's signature)."""
    return HAggregateFunction.apply(x, h_pre)
