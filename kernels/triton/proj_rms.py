"""Projection + RMS in Triton: ``proj = x W^T`` (fp32 accumulation) and
``r = 1 / (||x||_2 / sqrt(K) + eps)`` in one pass over x; backward dx and dW.

The mapping path is fp32 whatever the activation dtype. With bf16 (or fp16) x and W the product
runs on tensor cores in that dtype: the products are exact in fp32 and accumulate in fp32 (one
fresh accumulator per K chunk), so the result is an fp32 product of the upcast inputs; in the
backward the fp32 upstream gradient is split into two bf16 pieces for the same tensor cores
(``_proj_rms_bwd_packed``, after ``_split_grad`` has made the pieces and dx's factor of x, once
a token).
Operands that are fp32 multiply as IEEE fp32 (see ``_precision``); so does everything under the
interpreter, whose bf16 ``tl.dot`` is unreliable.

The backward reads x once and writes dx; dW (a reduction over all tokens) is accumulated in fp32
per split of the tokens, and the splits are summed by a deterministic second kernel.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from mhctool.core.poison import empty

from ._common import (cast, cdiv, check_device, fast, interpreted, next_pow2, pick_config, require_contiguous,
                      round_low_bits)
from .reduce import sum_rows, sum_rows_pair


@triton.jit
def round_tf32(v):
    """fp32 -> the nearest TF32 value (10 explicit mantissa bits, ties to even), kept in fp32;
    inf and NaN unchanged. Triton's own TF32 products truncate their operands: rounded first, the
    truncation is exact and the product is a TF32 product as the contract defines it (DESIGN.md)."""
    return tl.where(tl.abs(v) <= 3.4028234663852886e38, round_low_bits(v, 13), v)  # finite: rounded


@triton.jit
def _dot(a, b, zero, LOWP: tl.constexpr, PREC: tl.constexpr, ROUND: tl.constexpr = False):
    """One K chunk's product in its own accumulator (``zero``: a runtime zero tile, so the
    compiler cannot fold the caller's add into the MMA); the caller adds the chunks in fp32 with
    round-to-nearest. Tensor cores accumulate by truncation: a long K kept inside one MMA
    accumulator drifted to 3e-5 relative at K = 28672 on an H100 (2.95e-7 split like this)."""
    if LOWP:
        return tl.dot(a, b, zero)
    a, b = a.to(tl.float32), b.to(tl.float32)
    if ROUND:
        a, b = round_tf32(a), round_tf32(b)
    return tl.dot(a, b, zero, input_precision=PREC)


@triton.jit
def _proj_tile(x_ptr, w_ptr, rows, cols, rmask, M, K, N, eps, NP: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, LOWP: tl.constexpr,
               PREC: tl.constexpr, ROUND: tl.constexpr = False):
    """``x W^T`` for a block of rows (fp32, ``[BLOCK_M, NP]``) and the rows' sums of squares
    (``ROUND``: the product's operands rounded to TF32; the sums of squares never are). A chunk's
    squares are summed as a tree; the chunks' sums are added with Kahan's compensation. Added one
    after another (224 chunks at the paper shape) they were most of ``r``'s error (a CPU model of
    the order, 2048 random bf16 rows: 3.9e-7 largest, 1.6e-7 compensated; ``rms_and_r``)."""
    acc = tl.zeros([BLOCK_M, NP], dtype=tl.float32)
    zero = tl.zeros([BLOCK_M, NP], dtype=tl.float32) + eps * 0.0  # not a compile-time constant
    ss = tl.zeros([BLOCK_M], dtype=tl.float32)
    lost = tl.zeros([BLOCK_M], dtype=tl.float32)  # what the last addition to ss rounded away
    x_row = x_ptr + rows.to(tl.int64)[:, None] * K
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < K
        x = tl.load(x_row + k[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(w_ptr + cols[:, None] * K + k[None, :], mask=(cols[:, None] < N) & kmask[None, :], other=0.0)
        xf = x.to(tl.float32)
        part = tl.sum(xf * xf, axis=1) - lost
        total = ss + part
        lost = (total - ss) - part
        ss = total
        acc += _dot(x, tl.trans(w), zero, LOWP, PREC, ROUND)
    return acc, ss


@triton.jit
def rms_and_r(ss, K, eps):
    """``rms = sqrt(ss / K)`` and ``r = 1 / (rms + eps)`` from a row's sum of squares, each step
    rounded to nearest as PyTorch's are. Triton's ``/`` and ``tl.sqrt`` are approximate on a GPU
    (about 2 ulp each). With them, and the sums of squares added without compensation
    (``_proj_tile``), the paper shape's bf16 ``r`` had 2.2-2.6x PyTorch's largest error on an
    H200, at the verdict's edge (1.002 of its threshold on one draw); rounded to nearest, 0.94;
    with the compensation too, 0.30. Once a row: nothing that shows in the time."""
    rms = tl.sqrt_rn(tl.div_rn(ss, tl.zeros_like(ss) + K))
    return rms, tl.div_rn(tl.zeros_like(rms) + 1.0, rms + eps)


@fast
@triton.jit
def _proj_rms_fwd(x_ptr, w_ptr, proj_ptr, r_ptr, rms_ptr, M, K, N, eps, NP: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, LOWP: tl.constexpr,
                  PREC: tl.constexpr, ROUND: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, NP)
    rmask = rows < M
    acc, ss = _proj_tile(x_ptr, w_ptr, rows, cols, rmask, M, K, N, eps, NP, BLOCK_M, BLOCK_K, LOWP, PREC, ROUND)
    rms, r = rms_and_r(ss, K, eps)
    tl.store(proj_ptr + rows[:, None] * N + cols[None, :], acc, mask=rmask[:, None] & (cols[None, :] < N))
    tl.store(r_ptr + rows, r, mask=rmask)
    tl.store(rms_ptr + rows, rms, mask=rmask)


@triton.jit
def _bwd_block(w_ptr, K, N, NP: tl.constexpr, BLOCK_K: tl.constexpr):
    """A backward program's place: its token split, its K block (and mask), the padded mapping
    rows, and W's ``[NP, BLOCK_K]`` block, which it keeps for every row block it walks."""
    k = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    kmask = k < K
    cols = tl.arange(0, NP)
    w = tl.load(w_ptr + cols[:, None] * K + k[None, :], mask=(cols[:, None] < N) & kmask[None, :], other=0.0)
    return tl.program_id(1), k, kmask, cols, w


@fast
@triton.jit
def _proj_rms_bwd(x_ptr, w_ptr, gp_ptr, gr_ptr, r_ptr, rms_ptr, dx_ptr, ws_ptr, hp_ptr, go_ptr, ex_ptr, C, M, K, N,
                  NP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                  SPLIT: tl.constexpr, PREC: tl.constexpr, ROUND: tl.constexpr, NS: tl.constexpr = 0,
                  AGG_ONE: tl.constexpr = False, EXTRA: tl.constexpr = False):
    """fp32 operands (and everything under the interpreter): products at ``PREC``; ``ROUND`` (the
    TF32 variant): their operands rounded to TF32 first (the gradient, W and x; the RMS term takes
    x as it is). ``NS`` > 0: the aggregation's gradient of x added to dx (``_agg_term``).
    ``EXTRA``: another gradient of x (``ex``, x2d's shape) added to dx before its rounding."""
    sp, k, kmask, cols, w = _bwd_block(w_ptr, K, N, NP, BLOCK_K)
    w = w.to(tl.float32)
    if ROUND:
        w = round_tf32(w)
    dw = tl.zeros([NP, BLOCK_K], dtype=tl.float32)
    zero = tl.zeros([NP, BLOCK_K], dtype=tl.float32) + (M * 0.0)  # not a compile-time constant
    for mb in range(sp, tl.cdiv(M, BLOCK_M), SPLIT):
        rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < M
        mask = rmask[:, None] & kmask[None, :]
        offs = rows.to(tl.int64)[:, None] * K + k[None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        gp = tl.load(gp_ptr + rows[:, None] * N + cols[None, :], mask=rmask[:, None] & (cols[None, :] < N), other=0.0)
        coef = _coef(gr_ptr, r_ptr, rms_ptr, rows, rmask, K)
        xm = x  # x as the product takes it; the RMS term below takes x as it is
        if ROUND:
            gp, xm = round_tf32(gp), round_tf32(x)
        part = tl.dot(tl.trans(gp), xm, zero, input_precision=PREC)
        prod = tl.dot(gp, w, input_precision=PREC)
        dx = prod + coef[:, None] * x
        if NS > 0:
            dx += _agg_term(hp_ptr, go_ptr, rows, rmask, k, tl.program_id(0) * BLOCK_K, mask, C, NS, BLOCK_M, BLOCK_K,
                            AGG_ONE)
        if EXTRA:
            dx += tl.load(ex_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_ptr + offs, cast(dx, dx_ptr.dtype.element_ty), mask=mask)
        dw += part
    tl.store(ws_ptr + sp * N * K + cols[:, None] * K + k[None, :], dw, mask=(cols[:, None] < N) & kmask[None, :])


@triton.jit
def _coef(gr_ptr, r_ptr, rms_ptr, rows, rmask, K):
    """d r / d x = -r^2 x / (K rms): the per-row factor of x in dx."""
    gr = tl.load(gr_ptr + rows, mask=rmask, other=0.0)
    r = tl.load(r_ptr + rows, mask=rmask, other=0.0)
    rms = tl.load(rms_ptr + rows, mask=rmask, other=1.0)
    return coef_of(gr, r, rms, rmask, K)


@triton.jit
def coef_of(gr, r, rms, rmask, K):
    """``_coef`` from the row values in registers (rows outside ``rmask``: 0)."""
    return tl.where(rmask, -gr * r * r / (K * rms), 0.0)


@fast
@triton.jit
def _split_grad(gp_ptr, gr_ptr, r_ptr, rms_ptr, hi_ptr, lo_ptr, cf_ptr, M, K, N, NG: tl.constexpr,
                BLOCK_M: tl.constexpr, ROUND: tl.constexpr):
    """The tensor-core backward's per-token operands, made once: ``g_proj`` (rounded to TF32
    first with ``ROUND``) as two pieces of x's dtype, ``hi = g`` rounded and ``lo = g - hi``
    rounded, in ``hi`` and ``lo`` (``[M, NG]`` each, columns past N zero: NG is the MMA's N), and
    dx's factor of x (``_coef``) in ``cf [M]``. The backward loads the pieces straight into its
    products' shared-memory operands. Split inside its loop instead (an fp32 row a token packed
    with the factor, split in registers for every K block, then written to shared memory for the
    products) the same bits took 1.13x as long on an H200 (docs/perf-notes.md)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, NG)
    rmask = rows < M
    offs = rows.to(tl.int64)[:, None] * NG + cols[None, :]
    g = tl.load(gp_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :], mask=rmask[:, None] & (cols[None, :] < N),
                other=0.0)
    store_split(g, _coef(gr_ptr, r_ptr, rms_ptr, rows, rmask, K), hi_ptr, lo_ptr, cf_ptr, rows, rmask, offs, ROUND)


@triton.jit
def store_split(g, coef, hi_ptr, lo_ptr, cf_ptr, rows, rmask, offs, ROUND: tl.constexpr):
    """``_split_grad``'s outputs from the gradient ``g`` (fp32, zero past N) and dx's factor
    ``coef`` in registers, ``offs`` the ``[rows, NG]`` offsets (also the mapping backward's
    compute_h kernel, which makes them itself)."""
    if ROUND:
        g = round_tf32(g)
    hi = g.to(hi_ptr.dtype.element_ty)
    lo = (g - hi.to(tl.float32)).to(lo_ptr.dtype.element_ty)
    tl.store(hi_ptr + offs, hi, mask=rmask[:, None])
    tl.store(lo_ptr + offs, lo, mask=rmask[:, None])
    tl.store(cf_ptr + rows, coef, mask=rmask)


@triton.jit
def _agg_term(hp_ptr, go_ptr, rows, rmask, k, k0, mask, C, NS: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_K: tl.constexpr, ONE: tl.constexpr):
    """mix_aggregate's aggregation part of x's gradient on a ``[rows, k]`` tile of x2d (columns k =
    stream * C + channel, from ``k0``, the K block's first): ``h_pre[t, stream] * grad_out[t,
    channel]``, in fp32. ``ONE`` (C a multiple of BLOCK_K, the paper shape): the program's K block
    lies in one stream, whose h_pre column is one load a row. Otherwise the stream of a column is
    picked from the row's NS weights by a select per stream (a block may span several)."""
    if ONE:
        st = k0 // C
        go = tl.load(go_ptr + rows.to(tl.int64)[:, None] * C + (k - st * C)[None, :], mask=mask, other=0.0)
        hs = tl.load(hp_ptr + rows * NS + st, mask=rmask, other=0.0)
        term = hs[:, None] * go.to(tl.float32)
    else:  # (a branch, not code after a return: Triton compiles that too)
        st = k // C
        go = tl.load(go_ptr + rows.to(tl.int64)[:, None] * C + (k - st * C)[None, :], mask=mask, other=0.0)
        hp = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
        for s in tl.static_range(NS):
            hs = tl.load(hp_ptr + rows * NS + s, mask=rmask, other=0.0)
            hp = tl.where(st[None, :] == s, hs[:, None], hp)
        term = hp * go.to(tl.float32)
    return term


@fast
@triton.jit
def _proj_rms_bwd_packed(x_ptr, w_ptr, hi_ptr, lo_ptr, cf_ptr, dx_ptr, ws_ptr, hp_ptr, go_ptr, ex_ptr, C, M, K, N,
                         NG: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
                         STAGES: tl.constexpr, NS: tl.constexpr = 0, AGG_ONE: tl.constexpr = False,
                         GROUP: tl.constexpr = False, EXTRA: tl.constexpr = False):
    """bf16 (fp16) x and W on tensor cores, from the split gradient (``_split_grad``): for its K
    block and token split, ``dx = g W + coef x`` for each row block and the split's dW partial.
    The fp32 gradient comes as two pieces of x's dtype (16 significant bits for bf16, past what a
    bf16 dx or dW keeps; the TF32 variant's gradient, rounded to 11 bits, exactly), each product
    the sum of the two pieces' products. dW is accumulated transposed, ``x^T g``
    (``[BLOCK_K, NG]``): the product's M is the K block, which the tensor cores' warpgroup
    products take (``g^T x`` has M = NG = 32, below their 64).
    ``NS`` > 0 (n streams): mix_aggregate's aggregation gradient of x (``_agg_term``: ``h_pre`` and
    the aggregate's upstream gradient ``grad_out``) added to dx in fp32 before its one rounding, so
    that no pass writes that gradient and no other adds the two. (Loads and dx's store through TMA
    tensor descriptors gave the same bits and were no faster: dev/perf-notes.md.) ``GROUP``
    (with the term, C a multiple of BLOCK_K): program i takes K block ``(i % NS) * C / BLOCK_K + i //
    NS``, the NS streams' blocks over the same channels side by side (``GROUP_STREAMS``).
    ``EXTRA``: another gradient of x (``ex``, x2d's shape: the residual's from the module's
    post-path) added to dx in fp32 before its rounding, so that no pass adds the two after."""
    kb = tl.program_id(0)
    if GROUP:
        kb = (kb % NS) * (C // BLOCK_K) + kb // NS
    k0 = kb * BLOCK_K
    k = k0 + tl.arange(0, BLOCK_K)
    kmask = k < K
    cols = tl.arange(0, NG)
    w = tl.load(w_ptr + cols[:, None] * K + k[None, :], mask=(cols[:, None] < N) & kmask[None, :], other=0.0)
    sp = tl.program_id(1)
    dwt = tl.zeros([BLOCK_K, NG], dtype=tl.float32)
    zero = tl.zeros([BLOCK_K, NG], dtype=tl.float32) + (M * 0.0)  # not a compile-time constant (see _dot)
    for mb in tl.range(sp, tl.cdiv(M, BLOCK_M), SPLIT, num_stages=STAGES):
        rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < M
        mask = rmask[:, None] & kmask[None, :]
        offs = rows.to(tl.int64)[:, None] * K + k[None, :]
        xl = tl.load(x_ptr + offs, mask=mask, other=0.0)
        goffs = rows.to(tl.int64)[:, None] * NG + cols[None, :]
        g_hi = tl.load(hi_ptr + goffs, mask=rmask[:, None], other=0.0)
        g_lo = tl.load(lo_ptr + goffs, mask=rmask[:, None], other=0.0)
        coef = tl.load(cf_ptr + rows, mask=rmask, other=0.0)
        prod = tl.dot(g_hi, w, tl.dot(g_lo, w))
        xt = tl.trans(xl)
        dwt += tl.dot(xt, g_hi, tl.dot(xt, g_lo, zero))  # a fresh accumulator per chunk (see _dot)
        dx = prod + coef[:, None] * xl.to(tl.float32)
        if NS > 0:
            dx += _agg_term(hp_ptr, go_ptr, rows, rmask, k, k0, mask, C, NS, BLOCK_M, BLOCK_K, AGG_ONE)
        if EXTRA:
            dx += tl.load(ex_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_ptr + offs, cast(dx, dx_ptr.dtype.element_ty), mask=mask)
    tl.store(ws_ptr + sp * N * K + cols[None, :] * K + k[:, None], dwt, mask=(cols[None, :] < N) & kmask[:, None])


def piece_cols(n_rows: int) -> int:
    """NG, the columns of the split gradient's pieces for W of ``n_rows`` rows (the MMA's N)."""
    return max(16, next_pow2(n_rows + 1))


def _precision(tf32: bool = False) -> str:
    """Products of fp32 operands run as IEEE fp32 FMAs. tf32x3 (three TF32 tensor-core products)
    is 5x faster at the paper shape but was measured on an H100 at up to 1.9x the error of cuBLAS's
    fp32 product in the gradient of compute_h's alphas: outside the parity rule. bf16 and fp16
    operands always take the tensor cores (exact products). ``tf32``: the TF32 variant's products,
    one TF32 tensor-core product of operands rounded to TF32 first (``round_tf32``); under the
    interpreter the same rounded operands multiply in fp32, which is exact: the same values."""
    return "tf32" if tf32 and not interpreted() else "ieee"


def _check(x2d, weight):
    if x2d.dim() != 2 or weight.dim() != 2 or x2d.shape[1] != weight.shape[1]:
        raise ValueError(f"proj_rms takes x2d[M,K] and weight[N,K]; got {tuple(x2d.shape)} and {tuple(weight.shape)}")
    check_device(x2d, weight)
    require_contiguous("x2d", x2d)
    return weight.contiguous()


def low_precision_operands(x2d, weight) -> bool:
    """bf16/fp16 x and W of one dtype take the tensor cores (not under the interpreter)."""
    return x2d.dtype == weight.dtype and x2d.dtype in (torch.bfloat16, torch.float16) and not interpreted()


def proj_rms_forward(x2d, weight, eps=1e-6, tf32: bool = False):
    """Returns ``proj, r, rms`` (rms is kept for the backward: ``1/r - eps`` would cancel).
    ``tf32``: the product at TF32 (fp32 operands rounded to TF32; bf16 ones are exact either way)."""
    weight = _check(x2d, weight)
    M, K = x2d.shape
    N = weight.shape[0]
    proj = empty((M, N), torch.float32, x2d.device)
    r = empty((M,), torch.float32, x2d.device)
    rms = torch.empty((M,), dtype=torch.float32, device=x2d.device)
    bm, bk = (64, 128)
    if M:
        _proj_rms_fwd[(cdiv(M, bm),)](x2d, weight, proj, r, rms, M, K, N, float(eps),
                                      NP=max(16, next_pow2(N)), BLOCK_M=bm, BLOCK_K=bk,
                                      LOWP=low_precision_operands(x2d, weight),
                                      PREC=_precision(tf32), ROUND=tf32, num_warps=4)
    return proj, r, rms


# the bf16 (fp16) backward's tile, fixed (BLOCK_M, BLOCK_K, SPLIT, warps, stages): the fastest in
# paired rounds at the paper shape on an H200 (0.89x of (128, 128, 8, 8, 4), which an H100 timed within
# noise of it; dev/bwd_sweep.py packed, docs/perf-notes.md twenty-first session); SPLIT decides the
# order of dW's sum over row blocks, so it is not timed per token count. PACK_M: tokens a program of
# the gradient's split (``_split_grad``)
LOWP_TILE = (64, 128, 8, 4, 4)
PACK_M = 128
# pipeline stages with mix_aggregate's aggregation term (``agg``, grad_out-sized tiles beside x's)
# where its loads are pointer loads (cp.async): at LOWP_TILE four took 7.73 ms against 2.80 for three
# on an H200 (dev/mix_sweep.py), and at the H100's (128, 128) tile four needed 280 KB of shared
# memory, past the 227 KB an SM has
AGG_STAGES = 3
# With the term and C a multiple of the K block: the n streams' programs over the same channels
# launched side by side (``GROUP``), so that grad_out's tile, which each of them reads, is still in
# L2 for the others. In the plain order a stream's programs start up to a wave apart and grad_out
# came from memory again: under ncu on an H100 the kernel read 2.89 GB, side by side 2.39 (x and
# grad_out once: 2.35). mix_aggregate's whole backward in graph replay on an H100 (thirty-first
# session, docs/perf-notes.md): 2.52 -> 2.37 ms with the pointer loads, 2.42 with the TMA loads.
GROUP_STREAMS = True
# With another gradient of x added in the dx pass (``extra``: the residual's from the module's
# post-path, kernels.schedule.ResidualLink), its tile's load beside x's: compiled for sm_90 offline
# (Triton 3.6) at LOWP_TILE the spills went from 25 / 32 local loads / stores to 46 / 79; with 8
# warps, or with K blocks of 64, none. mapping_backward with the term at issue 99's step call (4,096
# rows, n = 4, C = 2048, bf16) on an H100, graph replay (dev/step_profile.py fold, session 62):
# 69.0 us without extra, 136.6 with autograd's add after it; with extra (64, 64, 8, 4, 3) 91.1,
# (64, 128, 8, 4, 2) 92.8, (64, 128, 8, 4, 3) 94.4, (128, 128, 4, 8, 2) 95.0, (64, 128, 8, 8, 3)
# 100.0, (64, 128, 8, 8, 2) 128.1
EXTRA_TILE = (64, 64, 8, 4, 3)
# Loads by the TMA engine through host tensor descriptors (x, the gradient's pieces, grad_out) and
# dx stored through one gave the same bits and were no faster with the streams side by side (2.42
# against 2.37 ms for mix_aggregate's backward on an H100; 1.04-1.12x without the term): pointer
# loads only (dev/perf-notes.md, thirtieth and thirty-first sessions; removed in the forty-third).


def proj_rms_backward(x2d, weight, r, rms, grad_proj, grad_r, lowp=None, tile_=None, tf32: bool = False,
                      agg=None, pieces=None, also=None, extra=None):
    """``lowp``: the tensor-core kernel (default: for bf16/fp16 operands off the interpreter).
    Forced on for fp32 operands it runs with exact fp32 pieces: how the CPU tests reach its
    indexing through the interpreter. ``tile_``: (BLOCK_M, BLOCK_K, SPLIT, warps, stages) for
    sweeps, of whichever kernel runs (default: ``LOWP_TILE``, or the generic kernel's timed
    pick). ``tf32``: the TF32 variant, products of operands rounded to TF32 (bf16/fp16 ones
    through the two-piece kernel, exact there; fp32 ones through ``_proj_rms_bwd``). ``agg``:
    ``(h_pre [M, n], grad_out [M, C])`` with n * C = K: dx also holds the aggregation's gradient
    of x, ``h_pre[t, i] * grad_out[t, c]`` at column ``i * C + c``, added in fp32 in the same pass
    (mix_aggregate's backward). ``pieces``: the tensor-core kernel's operands already made
    (``(hi, lo, cf)`` as ``_split_grad`` writes them; the mapping backward's compute_h kernel does):
    ``grad_proj`` and ``grad_r`` are then unused. ``also``: another fp32 workspace ``[R, L]`` summed
    over R in dW's sum's launch; its sum (fp32, ``[L]``) is returned third. ``extra``: another
    gradient of x (x2d's shape, any float dtype) that dx includes, added in fp32 in the same pass
    (the residual's from the module's post-path: ``kernels.schedule.ResidualLink``)."""
    weight = _check(x2d, weight)
    if extra is not None:
        if tuple(extra.shape) != tuple(x2d.shape):
            raise ValueError(f"proj_rms_backward's extra is a gradient of x2d {tuple(x2d.shape)}; got {tuple(extra.shape)}")
        extra = extra.contiguous()
    ex_arg = x2d if extra is None else extra
    ns, c_agg, hp_arg, go_arg = 0, 1, x2d, x2d
    if agg is not None:
        hp_arg, go_arg = agg[0].float().contiguous(), agg[1].contiguous()
        ns, c_agg = hp_arg.shape[-1], go_arg.shape[-1]
        if hp_arg.shape != (x2d.shape[0], ns) or go_arg.shape != (x2d.shape[0], c_agg) or ns * c_agg != x2d.shape[1]:
            raise ValueError(f"proj_rms_backward's agg takes h_pre [M, n] and grad_out [M, C] with n * C = K for "
                             f"x2d {tuple(x2d.shape)}; got {tuple(hp_arg.shape)} and {tuple(go_arg.shape)}")
    M, K = x2d.shape
    N = weight.shape[0]
    if lowp is None:
        lowp = low_precision_operands(x2d, weight)
    elif lowp and not (low_precision_operands(x2d, weight) or interpreted()):
        # fp32 operands through the tensor-core kernel are exact only under the interpreter (on a
        # GPU its fp32 tl.dot would multiply at TF32)
        raise ValueError("proj_rms_backward(lowp=True) takes bf16/fp16 operands (fp32 ones only under the interpreter)")
    if pieces is None:
        grad_proj = torch.zeros((M, N), dtype=torch.float32, device=x2d.device) if grad_proj is None else grad_proj.float().contiguous()
        grad_r = torch.zeros((M,), dtype=torch.float32, device=x2d.device) if grad_r is None else grad_r.float().contiguous()
    elif not lowp:
        raise ValueError("proj_rms_backward's pieces are the tensor-core kernel's operands (lowp=True)")
    dx = empty(x2d.shape, x2d.dtype, x2d.device)
    NP = max(16, next_pow2(N))

    def workspace(bm, split):
        """The dW partials: one per token split, at most one split per row block; every element is
        written by the kernels (zeros only where there are no tokens and nothing runs)."""
        split = max(1, min(split, cdiv(M, bm)))
        return split, (empty if M else torch.zeros)((split, N * K), dtype=torch.float32, device=x2d.device)

    def _finish(ws):
        """dW from its partials, and ``also``'s sum in the same launch."""
        if also is None:
            return (sum_rows(ws, weight.dtype, weight.shape),)
        return sum_rows_pair((ws, weight.dtype, weight.shape, False), (also, torch.float32, also.shape[1:], False))

    if lowp:
        bm, bk, split, warps, stages = tile_ or (LOWP_TILE if extra is None else EXTRA_TILE)
        split, ws = workspace(bm, split)
        if M:
            ng = piece_cols(N)
            if pieces is None:
                hi, lo = empty((M, ng), x2d.dtype, x2d.device), empty((M, ng), x2d.dtype, x2d.device)
                cf = empty((M,), torch.float32, x2d.device)
                _split_grad[(cdiv(M, PACK_M),)](grad_proj, grad_r, r, rms, hi, lo, cf, M, K, N, NG=ng,
                                                BLOCK_M=PACK_M, ROUND=tf32)
            else:
                hi, lo, cf = pieces
                if hi.shape != (M, ng) or lo.shape != (M, ng) or cf.shape != (M,):
                    raise ValueError(f"proj_rms_backward's pieces are [M, {ng}] twice and [M]; got "
                                     f"{tuple(hi.shape)}, {tuple(lo.shape)} and {tuple(cf.shape)}")
            if agg is not None and tile_ is None:  # grad_out's tiles take shared memory too
                stages = min(stages, AGG_STAGES)
            _proj_rms_bwd_packed[(cdiv(K, bk), split)](x2d, weight, hi, lo, cf, dx, ws, hp_arg, go_arg, ex_arg,
                                                       c_agg, M, K, N, NG=ng, BLOCK_M=bm, BLOCK_K=bk, SPLIT=split,
                                                       STAGES=stages, NS=ns, AGG_ONE=ns > 0 and c_agg % bk == 0,
                                                       GROUP=GROUP_STREAMS and ns > 0 and c_agg % bk == 0,
                                                       EXTRA=extra is not None, num_warps=warps)
        return (dx, *_finish(ws))

    def run(cfg):
        bm, bk, split, warps, stages = (*cfg, 3)[:5]  # 3: Triton's default pipelining depth
        split, ws = workspace(bm, split)
        _proj_rms_bwd[(cdiv(K, bk), split)](x2d, weight, grad_proj, grad_r, r, rms, dx, ws, hp_arg, go_arg,
                                            ex_arg, c_agg, M, K, N, NP=NP, BLOCK_M=bm, BLOCK_K=bk, SPLIT=split,
                                            PREC=_precision(tf32), ROUND=tf32, NS=ns,
                                            AGG_ONE=ns > 0 and c_agg % bk == 0, EXTRA=extra is not None,
                                            num_warps=warps, num_stages=stages)
        return ws

    # (64, 128, 8, 4, 2): two stages; the TF32 products at the paper shape took 3.0 ms with them and
    # 6.3 with Triton's default three (H100, docs/perf-notes.md)
    configs = [(64, 128, 1, 4)] if interpreted() else [
        (64, 128, 8, 4), (64, 128, 8, 4, 2), (128, 128, 4, 8), (64, 256, 8, 8), (128, 64, 8, 4), (64, 64, 16, 4),
        (128, 256, 4, 8)]
    best = tile_ or pick_config(("proj_rms_bwd", M, K, N, x2d.dtype, weight.dtype, tf32), configs, run, work=M * K)
    return (dx, *_finish(run(best)))


class ProjRmsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, weight, eps, tf32=False):
        proj, r, rms = proj_rms_forward(x2d, weight, eps, tf32)
        ctx.save_for_backward(x2d, weight, r, rms)
        ctx.tf32 = tf32
        return proj, r

    @staticmethod
    def backward(ctx, grad_proj, grad_r):
        x2d, weight, r, rms = ctx.saved_tensors
        dx, dw = proj_rms_backward(x2d, weight, r, rms, grad_proj, grad_r, tf32=ctx.tf32)
        return dx, dw, None, None


def proj_rms(x2d, weight, eps: float = 1e-6):
    """Megatron's signature ``proj_rms(x2d[M,K], weight[N,K], eps) -> (proj, r)``, both fp32."""
    return ProjRmsFunction.apply(x2d, weight, eps)


def proj_rms_tf32(x2d, weight, eps: float = 1e-6):
    """The TF32 variant (implementation ``triton-tf32``): every product, forward and backward, a
    TF32 product of operands rounded to TF32, as the mHC paper specifies and Megatron's cuTile
    kernel computes; judged against the native implementation at TF32 (DESIGN.md)."""
    return ProjRmsFunction.apply(x2d, weight, eps, True)
