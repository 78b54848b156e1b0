"""Grouped GEMM over experts in Triton, with the token counts read on the device.

Rows of ``x[M, K]`` are grouped by expert, ``m_splits[e]`` rows each, in order:
``y_e = x_e W_e^T (+ b_e)`` with ``W[G, N, K]``; dgrad ``dx_e = dy_e W_e``; wgrad
``dW_e = dy_e^T x_e`` (optionally added into a ``main_grad`` buffer, per expert by an accumulate
mask). ``m_splits`` is never read on the host: the launch grid is the bound
``cdiv(M, BLOCK_M) + G`` row tiles (each expert adds at most one partial tile) and every program
finds its expert and rows from the counts on the device; programs past the last tile exit. The
whole path is therefore free of host synchronisation and can be captured in a CUDA graph.

Products: bf16/fp16 operands on tensor cores, fp32 operands as IEEE fp32 (and everything under
the interpreter, whose low-precision ``tl.dot`` is unreliable). Each K chunk (each token chunk in
wgrad) gets a fresh accumulator that is added in fp32: tensor cores accumulate by truncation.

``m_splits`` must sum to M; checking it would need a host synchronisation, so it is not checked.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from mhctool.core.poison import empty

from ._common import cast, cdiv, check_device, interpreted, pick_config, require_contiguous


@triton.jit
def _find_tile(splits_ptr, pid, G, BLOCK_M: tl.constexpr):
    """Expert, first row and end row of row tile ``pid`` (expert -1 past the last tile)."""
    tile0 = pid * 0
    row0 = pid * 0
    expert = pid * 0 - 1
    lo = pid * 0
    hi = pid * 0
    for e in range(0, G):
        c = tl.load(splits_ptr + e).to(tl.int32)
        t = (c + BLOCK_M - 1) // BLOCK_M
        hit = (pid >= tile0) & (pid < tile0 + t)
        expert = tl.where(hit, e, expert)
        lo = tl.where(hit, row0 + (pid - tile0) * BLOCK_M, lo)
        hi = tl.where(hit, row0 + c, hi)
        tile0 += t
        row0 += c
    return expert, lo, hi


@triton.jit
def _dot(a, b, zero, LOWP: tl.constexpr):
    if LOWP:
        return tl.dot(a, b, zero)
    return tl.dot(a.to(tl.float32), b.to(tl.float32), zero, input_precision="ieee")


@triton.jit
def _gemm(a_ptr, w_ptr, bias_ptr, out_ptr, splits_ptr, G, N, K, stride_wg, stride_wk, stride_wn, zero_f,
          HAS_BIAS: tl.constexpr, LOWP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
          BLOCK_K: tl.constexpr):
    """``out[rows of e] = a[rows of e] @ B_e`` with ``B_e[k, n]`` at ``w + e*stride_wg + k*stride_wk
    + n*stride_wn`` (forward: W_e^T; dgrad: W_e)."""
    expert, lo, hi = _find_tile(splits_ptr, tl.program_id(0), G, BLOCK_M)
    if expert < 0:
        return
    rows = lo + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < hi
    cmask = cols < N
    a_row = a_ptr + rows.to(tl.int64)[:, None] * K
    w_e = w_ptr + expert.to(tl.int64) * stride_wg
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    zero = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32) + zero_f  # runtime zero: no fused adds
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < K
        a = tl.load(a_row + k[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(w_e + k[:, None] * stride_wk + cols[None, :] * stride_wn,
                    mask=kmask[:, None] & cmask[None, :], other=0.0)
        acc += _dot(a, b, zero, LOWP)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert.to(tl.int64) * N + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :], cast(acc, out_ptr.dtype.element_ty),
             mask=rmask[:, None] & cmask[None, :])


@triton.jit
def _wgrad(x_ptr, dy_ptr, splits_ptr, offs_ptr, out_ptr, flags_ptr, N, K, zero_f,
           ACCUMULATE: tl.constexpr, LOWP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
           BLOCK_K: tl.constexpr):
    """``out[e] = dy_e^T x_e`` (``[N, K]``); with ACCUMULATE, ``out[e] += ...`` where ``flags[e]``
    and the expert has tokens (a zero-token expert's buffer is not touched)."""
    e = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.program_id(2) * BLOCK_K + tl.arange(0, BLOCK_K)
    nmask = n < N
    kmask = k < K
    count = tl.load(splits_ptr + e).to(tl.int32)
    end = tl.load(offs_ptr + e).to(tl.int32)
    start = end - count
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    zero = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32) + zero_f
    for m0 in range(start, end, BLOCK_M):
        m = m0 + tl.arange(0, BLOCK_M)
        mmask = m < end
        dyt = tl.load(dy_ptr + m.to(tl.int64)[None, :] * N + n[:, None], mask=nmask[:, None] & mmask[None, :], other=0.0)
        xt = tl.load(x_ptr + m.to(tl.int64)[:, None] * K + k[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        acc += _dot(dyt, xt, zero, LOWP)
    ptrs = out_ptr + e.to(tl.int64) * N * K + n[:, None] * K + k[None, :]
    mask = nmask[:, None] & kmask[None, :]
    if ACCUMULATE:
        # the per-expert predicates are compared on whole blocks: Triton 3.9's interpreter rejects a
        # mask combined from a scalar comparison ("mask has unsupported dtype")
        ones = tl.full([BLOCK_N, BLOCK_K], 1, tl.int32)
        flag = (ones * tl.load(flags_ptr + e).to(tl.int32)) != 0
        has_tokens = (ones * count) > 0
        old = tl.load(ptrs, mask=mask & flag, other=0.0).to(tl.float32)
        tl.store(ptrs, cast(acc + old, out_ptr.dtype.element_ty), mask=mask & (has_tokens | (flag == 0)))
    else:
        tl.store(ptrs, cast(acc, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _segment_sum(dy_ptr, splits_ptr, offs_ptr, out_ptr, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``out[e] = sum over the rows of e of dy`` (the bias gradient), fp32."""
    e = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    count = tl.load(splits_ptr + e).to(tl.int32)
    end = tl.load(offs_ptr + e).to(tl.int32)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for m0 in range(end - count, end, BLOCK_M):
        m = m0 + tl.arange(0, BLOCK_M)
        tile = tl.load(dy_ptr + m.to(tl.int64)[:, None] * N + n[None, :], mask=(m < end)[:, None] & nmask[None, :], other=0.0)
        acc += tl.sum(tile.to(tl.float32), axis=0)
    tl.store(out_ptr + e.to(tl.int64) * N + n, cast(acc, out_ptr.dtype.element_ty), mask=nmask)


_GEMM_CONFIGS = [  # (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)
    (64, 64, 32, 4, 2), (128, 128, 64, 8, 3), (64, 128, 64, 4, 3), (128, 64, 64, 4, 3), (64, 256, 64, 8, 3),
]
_WGRAD_CONFIGS = [
    (32, 64, 64, 4, 2), (64, 128, 128, 8, 3), (64, 128, 64, 4, 3), (128, 64, 64, 4, 3), (64, 64, 128, 4, 3),
]


def _lowp(*ts) -> bool:
    return not interpreted() and all(t.dtype in (torch.bfloat16, torch.float16) for t in ts)


def _check_splits(m_splits: torch.Tensor, g: int) -> None:
    if m_splits.dtype not in (torch.int32, torch.int64) or m_splits.shape != (g,):
        raise ValueError(f"m_splits must be an integer tensor of shape ({g},), got {tuple(m_splits.shape)} {m_splits.dtype}")
    if m_splits.device.type != ("cpu" if interpreted() else "cuda"):
        raise ValueError(f"m_splits must live with the data (device tensor), got {m_splits.device}")


def gemm(a: torch.Tensor, w: torch.Tensor, m_splits: torch.Tensor, bias=None, transpose_w: bool = True,
         out_dtype=None) -> torch.Tensor:
    """``out_e = a_e @ W_e^T`` (``transpose_w``, W ``[G, N, K]``) or ``a_e @ W_e`` (W ``[G, K, N]``)."""
    g = w.shape[0]
    m, k = a.shape
    n = w.shape[1] if transpose_w else w.shape[2]
    if (w.shape[2] if transpose_w else w.shape[1]) != k:
        raise ValueError(f"inner dimensions differ: a is {tuple(a.shape)}, weight is {tuple(w.shape)}")
    sg, s1, s2 = w.stride()
    stride_k, stride_n = (s2, s1) if transpose_w else (s1, s2)
    out = empty((m, n), out_dtype or a.dtype, a.device)
    lowp = _lowp(a, w)

    def run(cfg):
        bm, bn, bk, warps, stages = cfg
        grid = (cdiv(m, bm) + g, cdiv(n, bn))
        _gemm[grid](a, w, bias if bias is not None else w, out, m_splits, g, n, k, sg, stride_k, stride_n, 0.0,
                    HAS_BIAS=bias is not None, LOWP=lowp, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                    num_warps=warps, num_stages=stages)

    cfg = pick_config(("gemm", m, n, k, g, a.dtype, transpose_w, bias is not None), _GEMM_CONFIGS, run, m * n * k // 64)
    run(cfg)
    return out


def wgrad(x: torch.Tensor, dy: torch.Tensor, m_splits: torch.Tensor, offs: torch.Tensor, out: torch.Tensor,
          flags: torch.Tensor | None = None) -> torch.Tensor:
    """``out[e] = dy_e^T x_e`` into ``out [G, N, K]``; with ``flags``, added where flagged."""
    g, n, k = out.shape
    lowp = _lowp(x, dy)

    def run(cfg):
        bm, bn, bk, warps, stages = cfg
        _wgrad[(g, cdiv(n, bn), cdiv(k, bk))](
            x, dy, m_splits, offs, out, flags if flags is not None else m_splits, n, k, 0.0,
            ACCUMULATE=flags is not None, LOWP=lowp, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
            num_warps=warps, num_stages=stages)

    # an accumulating run changes ``out``, so it cannot be timed by repeating it: it takes a fixed
    # mid-size tile (the interpreter, the smallest)
    if flags is None:
        cfg = pick_config(("wgrad", x.shape[0], n, k, g, x.dtype), _WGRAD_CONFIGS, run, x.shape[0] * n * k // 64)
    else:
        cfg = _WGRAD_CONFIGS[0] if interpreted() else _WGRAD_CONFIGS[2]
    run(cfg)
    return out


def segment_sum(dy: torch.Tensor, m_splits: torch.Tensor, offs: torch.Tensor, dtype) -> torch.Tensor:
    g, n = m_splits.shape[0], dy.shape[1]
    out = empty((g, n), dtype, dy.device)
    _segment_sum[(g, cdiv(n, 128))](dy, m_splits, offs, out, n, BLOCK_M=32, BLOCK_N=128)
    return out


def _validate(x, weight, m_splits, bias):
    check_device(x, weight, m_splits, bias)
    require_contiguous("x", x)
    require_contiguous("weight", weight)
    if x.dim() != 2 or weight.dim() != 3 or weight.shape[2] != x.shape[1]:
        raise ValueError(f"x must be [tokens, K] and weight [G, N, K]; got {tuple(x.shape)} and {tuple(weight.shape)}")
    _check_splits(m_splits, weight.shape[0])
    if bias is not None:
        require_contiguous("bias", bias)
        if bias.shape != weight.shape[:2]:
            raise ValueError(f"bias must be [G, N] = {tuple(weight.shape[:2])}, got {tuple(bias.shape)}")


class _GroupedGemm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, m_splits, bias):
        _validate(x, weight, m_splits, bias)
        out = gemm(x, weight, m_splits, bias)
        ctx.save_for_backward(x, weight, m_splits, bias)
        return out

    @staticmethod
    def backward(ctx, dy):
        x, weight, m_splits, bias = ctx.saved_tensors
        dy = dy.contiguous()
        offs = torch.cumsum(m_splits, 0)  # on the device: no host synchronisation
        dx = gemm(dy, weight, m_splits, transpose_w=False) if ctx.needs_input_grad[0] else None
        dw = None
        if ctx.needs_input_grad[1]:
            dw = wgrad(x, dy, m_splits, offs, empty(weight.shape, weight.dtype, weight.device))
        db = segment_sum(dy, m_splits, offs, bias.dtype) if bias is not None and ctx.needs_input_grad[3] else None
        return dx, dw, None, db


def grouped_gemm(x, weight, m_splits, bias=None):
    """``y_e = x_e W_e^T (+ bias_e)`` per expert; ``m_splits`` is a device tensor, never synced."""
    return _GroupedGemm.apply(x, weight, m_splits, bias)


def grouped_wgrad(x, grad_out, m_splits, main_grad=None, accumulate=None):
    """``dW_e = grad_out_e^T x_e``; with ``main_grad`` (``[G, N, K]``, updated in place and returned)
    the experts whose ``accumulate`` flag is set get ``main_grad_e + dW_e`` and keep their buffer
    untouched when they have no token; the others get ``dW_e``."""
    check_device(x, grad_out, m_splits, main_grad, accumulate)
    for name, t in (("x", x), ("grad_out", grad_out)):
        require_contiguous(name, t)
    g = m_splits.shape[0]
    _check_splits(m_splits, g)
    offs = torch.cumsum(m_splits, 0)
    shape = (g, grad_out.shape[1], x.shape[1])
    if main_grad is None:
        return wgrad(x, grad_out, m_splits, offs, empty(shape, x.dtype, x.device))
    require_contiguous("main_grad", main_grad)
    if tuple(main_grad.shape) != shape:
        raise ValueError(f"main_grad must be [G, N, K] = {shape}, got {tuple(main_grad.shape)}")
    flags = (torch.ones(g, dtype=torch.uint8, device=x.device) if accumulate is None
             else accumulate.to(torch.uint8).contiguous())
    return wgrad(x, grad_out, m_splits, offs, main_grad, flags)
