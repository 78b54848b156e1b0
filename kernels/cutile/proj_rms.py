"""Projection + RMS in cuTile: ``proj = x W^T`` (fp32) and ``r = 1 / (||x||_2 / sqrt(K) + eps)``
in one pass over x; backward dx and dW.

The sum of squares adds the chunks with Kahan compensation: a plain running sum of 448 chunk sums
at K = 28672 put r 1.3x over the verdict bound (twice the native error) on an H100.

Products: bf16/fp16 operands on tensor cores (``ct.mma``, fp32 accumulation, a fresh accumulator
per K chunk added in fp32: tensor cores accumulate by truncation); fp32 operands as IEEE fp32
multiply-adds. In the backward the fp32 upstream gradient is split into two bf16 pieces (16
significant bits, past what the bf16 dx and dW keep) for the same tensor cores.
The N = n^2 + 2n outputs are padded to a power of two (zeros).

Backward, one pass over x: a program per (K block, split of the tokens) walks its token blocks,
writing dx and accumulating its split's dW partial in fp32; a second kernel adds the partials in
a fixed order (no atomics). v1 ran dx and dW as two kernels, each reading x, with one dW program
per K block walking all 32768 tokens (448 programs): 17.5% of copy bandwidth on an H200. v2 (one
pass, 64 x 64 tiles, three pieces): 44% on an H100; v3 (128 x 128, two pieces): 80% there, 70% on an
H200; v4 (the gradient and dx's per-token factor packed into one fp32 row by a small kernel first,
so that a token block takes one load of them instead of four; 64 x 256 tiles): 86% on an H200;
v5 (each 256-column K block as two halves with their own W tile and dW accumulator: the same bits,
no register spills in the loop): 88.7% there. With mix_aggregate's aggregation term (n a power of
two, C a multiple of 256 / n), v6 runs a program per channel block of all n streams instead of per
K block, so that grad_out's tile is loaded once for the n streams: the same bits, mix_aggregate's
backward 81% -> 85% of copy on an H200.

Why one file of 510 lines: the forward, the fp32 and the two-piece tensor-core backwards share the
chunk loop, the Kahan sum and the launch code; apart, each would import the others' helpers."""
from __future__ import annotations

import cuda.tile as ct
import torch

from mhctool.core.poison import empty

from ..schedule import next_pow2
from ._common import (BR, array, cdiv, check_cuda, launch, require_contiguous, sum_partials, sum_partials_pair, sum_rows,
                      sum_rows_occ2, tile_ir)

ConstInt = ct.Constant[int]
ConstFloat = ct.Constant[float]
ConstBool = ct.Constant[bool]
ZERO = ct.PaddingMode.ZERO


# the bf16 forward's (BM, BK) and ``occupancy`` hint (sweeps set them). Without the hint, (64, 128)
# took 0.50 ms at the paper shape on an H200 against 0.71 for (64, 64) and 0.56 for (128, 64)
# (dev/bwd_sweep.py cutile_fwd); 32 or 16 tokens a program were slower still. With two programs a
# SM asked for (thirty-second session, dev/cutile_fwd_hints.py, graph replay, the same bits each
# way), H200: (64, 128) 0.494 -> 0.439 ms, (128, 128) 0.454 -> 0.426 (the mapping's forward 0.504
# -> 0.435); occupancy 3 or 4 and (256, 128) were slower, and a DRAM latency hint on x's loads
# (4 or 10, tried and removed) no faster.
FWD_TILE = (128, 128)
FWD_OCCUPANCY = 2


def _tiles(lowp: bool) -> tuple[int, int]:
    """(BM, BK) of the forward (and of the fp32 backward): ``FWD_TILE`` (tensor cores) for bf16;
    smaller ones for the fp32 multiply-add path, whose products are a (BM, BK, N) tile. The bf16
    backward's tile is ``BWD_TILE``."""
    return FWD_TILE if lowp else (16, 32)


def _np(n: int) -> int:
    return max(16, next_pow2(n))  # the MMA's smallest N


def _product(a, b, lowp, M_, N_, K_):
    """``a (M_, K_) @ b (K_, N_)`` in fp32: one tensor-core product, or IEEE multiply-adds."""
    if lowp:
        return ct.mma(a, b, ct.zeros((M_, N_), dtype=ct.float32))
    return ct.sum(ct.reshape(a.astype(ct.float32), (M_, K_, 1)) * ct.reshape(b.astype(ct.float32), (1, K_, N_)), axis=1)


def _proj_tile(x, w, i, NP, BM, BK, LOWP):
    """``x W^T`` for token block i (fp32 ``(BM, NP)``) and the rows' sums of squares."""
    acc = ct.zeros((BM, NP), dtype=ct.float32)
    ss = ct.zeros((BM,), dtype=ct.float32)
    comp = ct.zeros((BM,), dtype=ct.float32)  # Kahan: hundreds of chunk sums at K = 28672
    for k in range(ct.num_tiles(x, axis=1, shape=(BM, BK))):
        xt = ct.load(x, index=(i, k), shape=(BM, BK), padding_mode=ZERO)
        wt = ct.load(w, index=(0, k), shape=(NP, BK), padding_mode=ZERO)
        acc = acc + _product(xt, ct.transpose(wt), LOWP, BM, NP, BK)
        xf = xt.astype(ct.float32)
        y = ct.sum(xf * xf, axis=1) - comp
        t = ss + y
        comp = (t - ss) - y
        ss = t
    return acc, ss


@ct.kernel
def _proj_rms_fwd(x, w, proj, r, rms, eps: ConstFloat, NP: ConstInt, BM: ConstInt, BK: ConstInt, LOWP: ConstBool):
    i = ct.bid(0)
    acc, ss = _proj_tile(x, w, i, NP, BM, BK, LOWP)
    kk = ct.num_tiles(x, axis=1, shape=(1, 1)) * 1.0  # K, as a float
    m = ct.sqrt(ss / kk)
    ct.store(proj, index=(i, 0), tile=acc)
    ct.store(r, index=(i,), tile=1.0 / (m + eps))
    ct.store(rms, index=(i,), tile=m)


def _grad_products(g, wt, xt, lowp, BM, BK, NG, init=None):
    """``init + g W`` (dx's product, ``(BM, BK)``; ``init`` an fp32 tile or None for zeros) and
    ``g^T x`` (this block's dW, ``(NG, BK)``) in fp32: on tensor cores with the fp32 ``g`` in two
    bf16 pieces (16 significant bits, past what a bf16 dx or dW keeps; a third piece changed no kept
    bit and, at the 128 x 128 tile, cost 4x), or as IEEE fp32 multiply-adds."""
    if not lowp:
        prod = _product(g, wt, False, BM, BK, NG)
        return (prod if init is None else prod + init), _product(ct.transpose(g), xt, False, NG, BK, BM)
    hi = g.astype(ct.bfloat16)
    lo = (g - hi.astype(ct.float32)).astype(ct.bfloat16)
    wb = wt.astype(ct.bfloat16)
    prod = ct.mma(hi, wb, ct.mma(lo, wb, ct.zeros((BM, BK), dtype=ct.float32) if init is None else init))
    part = ct.mma(ct.transpose(hi), xt, ct.mma(ct.transpose(lo), xt, ct.zeros((NG, BK), dtype=ct.float32)))
    return prod, part


SPLITS = 8  # token splits of the backward (dW partials)
BC_SUM = 1024  # columns per program of the dW partials' sum (H200: 11.3 us, 13.6 with 512; the same bits)
BM_PACK = 128  # tokens per program of the gradient's packing


def _packed_row(g, grt, rt, mt, kk, col, N, BM):
    """The packed gradient of a token block (``_pack_grad``'s layout, also written by the mapping
    backward): ``g`` (the projection's gradient) in columns [0, N), dx's factor of x ``-g_r r^2 /
    (K rms)`` in column N (0 where rms is 0), zeros past it. ``kk``: K as a float."""
    coef = ct.reshape(ct.where(mt > 0.0, -grt * rt * rt / (kk * ct.maximum(mt, 1e-38)), 0.0), (BM, 1))
    return ct.where(col < N, g, ct.where(col == N, coef, 0.0))


@ct.kernel
def _pack_grad(x, gp, gr, r, rms, out, N: ConstInt, NG: ConstInt, BM: ConstInt):
    """The backward's per-token operand as one fp32 row of NG: ``g_proj`` in columns [0, N), dx's
    factor of x in column N (``d r / d x = -r^2 x / (K rms)``, times ``g_r``), zeros past it. The
    backward then loads one tile a token block instead of four (g_proj, g_r, r, rms), and the
    factor's column multiplies W's zero padding rows in ``g W``."""
    i = ct.bid(0)
    kk = ct.num_tiles(x, axis=1, shape=(1, 1)) * 1.0  # K, as a float
    g = ct.load(gp, index=(i, 0), shape=(BM, NG), padding_mode=ZERO)
    rt = ct.load(r, index=(i,), shape=(BM,), padding_mode=ZERO)
    mt = ct.load(rms, index=(i,), shape=(BM,), padding_mode=ZERO)
    grt = ct.load(gr, index=(i,), shape=(BM,), padding_mode=ZERO)
    col = ct.reshape(ct.arange(NG, dtype=ct.int32), (1, NG))
    ct.store(out, index=(i, 0), tile=_packed_row(g, grt, rt, mt, kk, col, N, BM))


def _agg_half(hp, go, hpt, i, kh, BM, H, AGG, HC, C, NPN):
    """mix_aggregate's aggregation gradient of x on half block ``kh`` of token block ``i``, fp32
    ``(BM, H)``: ``h_pre[t, s] * grad_out[t, c]`` at column ``s * C + c``. ``AGG`` 1 (C a whole
    number ``HC`` of half blocks): the block lies in one stream s, grad_out comes as a tile and
    h_pre's column s is picked from ``hpt`` (the token block's h_pre, ``(BM, NPN)``, loaded once for
    both halves) by a masked row sum; 2 (any C): column by column, gathered (a block may span
    streams or cut one). Past the last token or past K the loads give zeros (those elements are
    not stored)."""
    if AGG == 1:
        s = kh // HC
        gt = ct.load(go, index=(i, kh - s * HC), shape=(BM, H), padding_mode=ZERO)
        col = ct.reshape(ct.arange(NPN, dtype=ct.int32), (1, NPN))
        hs = ct.sum(ct.where(col == s, hpt, 0.0), axis=1, keepdims=True)
    else:
        rows = ct.reshape(i * BM + ct.arange(BM, dtype=ct.int32), (BM, 1))
        k = ct.reshape(kh * H + ct.arange(H, dtype=ct.int32), (1, H))
        s = k // C
        gt = ct.gather(go, (rows, k - s * C))
        hs = ct.gather(hp, (rows, s))
    return hs.astype(ct.float32) * gt.astype(ct.float32)


def _bwd_half(x, dx, wt, g, coef, i, kh, NG, BM, H, LOWP, hp, go, hpt, AGG, HC, C, NPN, ex, EXTRA):
    """One half (``H`` columns, half block ``kh``) of a token block: stores ``dx = gP W + coef x``
    (with ``AGG``, the aggregation term is the products' starting accumulator, so it is added in
    fp32 before dx's one rounding; with ``EXTRA``, ``ex``'s tile, the residual's other gradient,
    joins the term) and returns the half's ``gP^T x``. (The term added after the
    products instead, with h_pre gathered a half: 2.70 against 2.05 ms eager for mix_aggregate's
    backward on an H200, 255 registers and a stack frame in the offline SASS. ``coef x`` in the
    accumulator as well spilled with the term, and without it took 2.12 against 1.04 ms:
    docs/perf-notes.md.)"""
    xt = ct.load(x, index=(i, kh), shape=(BM, H), padding_mode=ZERO)
    term = _agg_half(hp, go, hpt, i, kh, BM, H, AGG, HC, C, NPN) if AGG > 0 else None
    if EXTRA:  # only with the term (mix_aggregate's backward takes the link)
        term = term + ct.load(ex, index=(i, kh), shape=(BM, H), padding_mode=ZERO).astype(ct.float32)
    out, part = _dx_and_part(g, wt, xt, coef, term, dx.dtype, LOWP, BM, H, NG)
    ct.store(dx, index=(i, kh), tile=out)
    return part


def _dx_and_part(g, wt, xt, coef, init, dtype, LOWP, BM, H, NG):
    """A half block's dx, ``gP W + coef x`` (plus ``init``, fp32 or None, in the products'
    accumulator) rounded once to ``dtype``, and its ``gP^T x``; x's tile ``xt`` is ``(BM, H)``."""
    prod, part = _grad_products(g, wt, xt, LOWP, BM, H, NG, init)
    return (prod + coef * xt.astype(ct.float32)).astype(dtype), part


def _packed_block(gc, i, N, NG, BM):
    """Token block i's packed gradient ``(BM, NG)`` (``_pack_grad``'s layout) and its column N, dx's
    factor of x ``(BM, 1)``."""
    g = ct.load(gc, index=(i, 0), shape=(BM, NG), padding_mode=ZERO)
    return g, ct.extract(g, index=(0, N), shape=(BM, 1))


@ct.kernel
def _proj_rms_bwd(x, w, gc, dx, ws, hp, go, ex, N: ConstInt, NG: ConstInt, BM: ConstInt, BK: ConstInt,
                  BLOCKS: ConstInt, LOWP: ConstBool, AGG: ConstInt, HC: ConstInt, C: ConstInt, NPN: ConstInt,
                  GROUP: ConstInt = 0, EXTRA: ConstBool = False):
    """For K block k and token blocks ``s * BLOCKS ...``: ``dx = gP W + coef x`` and the split's
    ``dW[:, k block] = sum gP^T x`` into ``ws[s]``, from the packed gradient ``gc`` (``_pack_grad``;
    W's rows past N load as zeros, so its factor column adds nothing to ``gP W``, and dW's rows
    past N are not stored). ``AGG`` > 0 (mix_aggregate's backward): dx also holds the aggregation's
    gradient of x from ``hp`` (h_pre, fp32 ``[M, n]``) and ``go`` (grad_out ``[M, C]``), see
    ``_agg_half``; so no pass writes that gradient and no other adds the two. ``EXTRA`` (with the
    term): dx also holds ``ex`` (x's shape: the residual's gradient from the module's post-path,
    kernels.schedule.ResidualLink), added to the term in fp32.

    The K block goes as two halves of ``BK / 2`` columns, each with its own W tile and dW
    accumulator: the same products element by element (the same bits), but at (64, 256) the
    whole-block form kept more live than 168 registers hold and spilled in its loop (32 LDL / 13
    STL in the SASS, 10 M local-memory requests a launch under ncu); the halves spill nothing.
    Where K has an odd number of half blocks, the last program's second half is its first again
    (the same values written twice), so no tile lies wholly past K. ``GROUP`` > 0 (the n streams,
    with the term and C a multiple of BK): the n programs over the same channels of the n streams
    are launched side by side, so that grad_out's tile, which each of them reads, is still in L2
    for the others."""
    k, s = ct.bid(0), ct.bid(1)
    if GROUP > 0:
        k = (k % GROUP) * (C // BK) + k // GROUP
    H = BK // 2
    k0 = 2 * k
    k1 = ct.minimum(2 * k + 1, ct.num_tiles(x, axis=1, shape=(BM, H)) - 1)
    w0 = ct.load(w, index=(0, k0), shape=(NG, H), padding_mode=ZERO)
    w1 = ct.load(w, index=(0, k1), shape=(NG, H), padding_mode=ZERO)
    acc0 = ct.zeros((NG, H), dtype=ct.float32)
    acc1 = ct.zeros((NG, H), dtype=ct.float32)
    for b in range(BLOCKS):  # blocks past the last token load zeros and store nothing
        i = s * BLOCKS + b
        g, coef = _packed_block(gc, i, N, NG, BM)
        hpt = None
        if AGG == 1:
            hpt = ct.load(hp, index=(i, 0), shape=(BM, NPN), padding_mode=ZERO)
        acc0 = acc0 + _bwd_half(x, dx, w0, g, coef, i, k0, NG, BM, H, LOWP, hp, go, hpt, AGG, HC, C, NPN, ex, EXTRA)
        acc1 = acc1 + _bwd_half(x, dx, w1, g, coef, i, k1, NG, BM, H, LOWP, hp, go, hpt, AGG, HC, C, NPN, ex, EXTRA)
    ct.store(ws, index=(s, 0, k0), tile=ct.reshape(acc0, (1, NG, H)))
    ct.store(ws, index=(s, 0, k1), tile=ct.reshape(acc1, (1, NG, H)))


@ct.kernel
def _proj_rms_bwd_streams(x, w, gc, dx, ws, hp, go, ex, N: ConstInt, NG: ConstInt, BM: ConstInt, Q: ConstInt,
                          NH: ConstInt, BLOCKS: ConstInt, LOWP: ConstBool, EXTRA: ConstBool = False):
    """``_proj_rms_bwd`` with mix_aggregate's term, a program per channel block of all n streams:
    x, dx and W as ``[rows, n, C]`` views, ws as ``[splits, N, n, C]``; program (c, s) takes
    channels ``[c Q, (c + 1) Q)`` of every stream (``2 NH`` = n of them) for the token blocks of
    split s, as two halves of ``NH`` streams (``NH Q`` columns each, the two-halves form of
    ``_proj_rms_bwd``). Each element's products are the ones that kernel computes, so the bits are
    the same; what changes is that grad_out's tile of a token block is loaded once for the n
    streams (the K-block form loads it once a stream, n times over from L2), and h_pre's stream
    factor is a slice of the token block's h_pre instead of a masked row sum. Needs n a power of
    two and C a multiple of Q. ``EXTRA``: ``ex`` (as dx) joins the term, as in ``_proj_rms_bwd``."""
    c, s = ct.bid(0), ct.bid(1)
    H = NH * Q
    w0 = ct.reshape(ct.load(w, index=(0, 0, c), shape=(NG, NH, Q), padding_mode=ZERO), (NG, H))
    w1 = ct.reshape(ct.load(w, index=(0, 1, c), shape=(NG, NH, Q), padding_mode=ZERO), (NG, H))
    acc0 = ct.zeros((NG, H), dtype=ct.float32)
    acc1 = ct.zeros((NG, H), dtype=ct.float32)
    for b in range(BLOCKS):  # blocks past the last token load zeros and store nothing
        i = s * BLOCKS + b
        g, coef = _packed_block(gc, i, N, NG, BM)
        hpt = ct.load(hp, index=(i, 0), shape=(BM, 2 * NH), padding_mode=ZERO)
        gt = ct.reshape(ct.load(go, index=(i, c), shape=(BM, Q), padding_mode=ZERO).astype(ct.float32), (BM, 1, Q))
        acc0 = acc0 + _streams_half(x, dx, w0, g, coef, hpt, gt, i, c, 0, NG, BM, Q, NH, LOWP, ex, EXTRA)
        acc1 = acc1 + _streams_half(x, dx, w1, g, coef, hpt, gt, i, c, 1, NG, BM, Q, NH, LOWP, ex, EXTRA)
    ct.store(ws, index=(s, 0, 0, c), tile=ct.reshape(acc0, (1, NG, NH, Q)))
    ct.store(ws, index=(s, 0, 1, c), tile=ct.reshape(acc1, (1, NG, NH, Q)))


def _streams_half(x, dx, wt, g, coef, hpt, gt, i, c, h, NG, BM, Q, NH, LOWP, ex, EXTRA):
    """Half h (streams ``[h NH, (h + 1) NH)``) of ``_proj_rms_bwd_streams``'s token block i: stores
    its dx and returns its ``gP^T x``, as ``_bwd_half`` with the term ``h_pre[t, s] grad_out[t, c]``
    as the products' starting accumulator."""
    H = NH * Q
    hs = ct.reshape(ct.extract(hpt, index=(0, h), shape=(BM, NH)), (BM, NH, 1))
    term = ct.reshape(hs * gt, (BM, H))
    if EXTRA:
        term = term + ct.reshape(ct.load(ex, index=(i, h, c), shape=(BM, NH, Q), padding_mode=ZERO), (BM, H)
                                 ).astype(ct.float32)
    xt = ct.reshape(ct.load(x, index=(i, h, c), shape=(BM, NH, Q), padding_mode=ZERO), (BM, H))
    out, part = _dx_and_part(g, wt, xt, coef, term, dx.dtype, LOWP, BM, H, NG)
    ct.store(dx, index=(i, h, c), tile=ct.reshape(out, (BM, NH, Q)))
    return part


# the bf16 backward's (BM, BK, token splits): the fastest timed at the paper shape on an H200
# (dev/bwd_sweep.py cutile, docs/perf-notes.md twelfth session: 1.08 ms with the packed gradient,
# against 1.14-1.18 for (128, 128, 4 or 8) and 1.28 for the unpacked kernel before)
BWD_TILE = (64, 256, SPLITS)
# the same kernel with mix_aggregate's aggregation term (``agg``): its tile (sweeps set it)
AGG_TILE = BWD_TILE
# the backward's ``num_worker_warps`` hint: None (tileiras picks; four warps, where the bf16 kernel
# keeps a 16-24 byte stack, 3-6 LDL / STL offline) or 8 (no stack, 23-32 KB less shared memory
# offline). Graph replay at the paper shape, the same bits each way (docs/perf-notes.md): without
# the aggregation term 8 is slower on an H100 (1.456 against 1.398 ms, twenty-ninth session); with
# it (mix_aggregate's whole backward) 8 is faster on an H100 (2.459 against 2.718 ms) and slower on
# an H200 (2.214 against 1.786 ms, thirty-second session). So the term's bf16 kernel takes its hint
# by device: ``AGG_WORKER_WARPS_BY_DEVICE`` maps a part of the device's name to the hint, and any
# other device gets tileiras's pick. Sweeps set ``AGG_WORKER_WARPS`` (None or a number of warps) in
# place of the table.
BWD_WORKER_WARPS = None
BWD_OCCUPANCY = None  # the kernel without the term's ``occupancy`` hint (sweeps set it)
AGG_WORKER_WARPS_BY_DEVICE = {"H100": 8}
BY_DEVICE = "by device"
AGG_WORKER_WARPS = BY_DEVICE
# the term's kernel's ``occupancy`` hint (None: tileiras's own; 2 was slower on an H200, 2.156
# against 1.824 ms for the whole backward at (64, 256, 8), thirty-second session). Sweeps set it.
AGG_OCCUPANCY = None
# with the term and C a multiple of the K block: the n streams' programs side by side (``GROUP``),
# as Triton's run; the same bits, and mix_aggregate's whole backward 2.454 against 2.462 ms in
# graph replay on an H100 (docs/perf-notes.md, thirty-first session), 1.784 against 1.786 on an
# H200 (thirty-second): within noise, so off
GROUP_STREAMS = False
# with the term, bf16, n a power of two and C a multiple of BK / n: a program per channel block of
# all n streams (``_proj_rms_bwd_streams``), grad_out's tile loaded once for the n of them
AGG_STREAMS = True


_HINTED = {}


def _hinted(kernel, **hints):
    """``kernel`` with the hints that are not None (itself where none is), one object per kernel
    and hints: a kernel compiles once an object."""
    hints = {k: v for k, v in hints.items() if v is not None}
    if not hints:
        return kernel
    key = (kernel, tuple(sorted(hints.items())))
    if key not in _HINTED:
        _HINTED[key] = kernel.replace_hints(**hints)
    return _HINTED[key]


def agg_worker_warps(device_name: str, streams: bool = False):
    """The worker-warp hint of the bf16 kernel with the aggregation term on a device of this name:
    ``AGG_WORKER_WARPS`` where a sweep set it; else, for the per-K-block kernel, the first entry of
    ``AGG_WORKER_WARPS_BY_DEVICE`` whose key is part of the name; else None (tileiras's pick). The
    streams form (``streams``) takes tileiras's pick everywhere: eight warps made it slower on an
    H100 too (2.477 against 2.389 ms for mix_aggregate's backward, thirty-third session)."""
    if AGG_WORKER_WARPS != BY_DEVICE:
        return AGG_WORKER_WARPS
    if streams:
        return None
    return next((w for key, w in AGG_WORKER_WARPS_BY_DEVICE.items() if key in device_name), None)


def _bwd_kernel(agg: bool, lowp: bool, device_name: str = "", streams: bool = False):
    """``_proj_rms_bwd`` (``_proj_rms_bwd_streams`` with ``streams``) as it launches on a device of
    this name: with ``agg_worker_warps`` and ``AGG_OCCUPANCY`` for the bf16 kernel with the
    aggregation term, else ``BWD_WORKER_WARPS`` and ``BWD_OCCUPANCY`` (None: as declared)."""
    warps, occ = ((agg_worker_warps(device_name, streams), AGG_OCCUPANCY) if agg and lowp
                  else (BWD_WORKER_WARPS, BWD_OCCUPANCY))
    return _hinted(_proj_rms_bwd_streams if streams else _proj_rms_bwd, num_worker_warps=warps, occupancy=occ)


def _streams_form(n: int, c: int, bk: int, lowp: bool) -> bool:
    """Whether the term's backward takes ``_proj_rms_bwd_streams``: ``AGG_STREAMS`` on, bf16, n a
    power of two of at least 2 that divides the K block, Q = BK / n at least 16 (the smallest MMA
    tile side), and C a multiple of Q."""
    return (AGG_STREAMS and lowp and n >= 2 and n & (n - 1) == 0 and bk % n == 0 and bk // n >= 16
            and c % (bk // n) == 0)


def _ng(n: int) -> int:
    """Columns of the packed gradient: N, the factor, padding (also the MMA's smallest N)."""
    return _np(n + 1)


def backward_into(x2d, weight, g_proj, g_r, r, rms, dx, dw, tile_=None) -> None:
    """dx and dW of proj_rms: ``g_proj`` fp32 ``[M, >= N]`` (columns past N ignored), ``g_r`` fp32
    ``[M]``, into the preallocated ``dx`` and ``dw`` (zero without tokens). ``tile_``: (BM, BK,
    splits) for the bf16 kernel (sweeps)."""
    m = x2d.shape[0]
    if not m:
        dw.zero_()
        return
    n = weight.shape[0]
    ng = _ng(n)
    gc = empty((m, ng), torch.float32, x2d.device)
    launch(_pack_grad, (cdiv(m, BM_PACK),), (x2d, g_proj, g_r, r, rms, gc, n, ng, BM_PACK))
    backward_packed(x2d, weight, gc, dx, dw, tile_)


def _agg_mode(c: int, half: int) -> int:
    """``_agg_half``'s path: 1 where C is a whole number of half blocks, else 2."""
    return 1 if c % half == 0 else 2


def backward_packed(x2d, weight, gc, dx, dw, tile_=None, side=None, agg=None, extra=None) -> None:
    """dx and dW from the packed gradient ``gc`` (fp32 ``[M, _ng(N)]`` in ``_pack_grad``'s layout;
    the mapping path's backward writes it directly), into ``dx`` and ``dw``. ``side``: another
    ``(ws, out, bc, br)`` partial sum (the mapping's bias and alpha), done in the dW sum's launch.
    ``agg``: ``(h_pre fp32 [M, n], grad_out [M, C])`` with n * C = K, both contiguous: dx also
    holds the aggregation's gradient of x, ``h_pre[t, i] * grad_out[t, c]`` at column ``i * C + c``
    (mix_aggregate's backward). ``extra`` (with ``agg``; x2d's shape and dx's dtype, contiguous):
    added to dx in the same pass (the residual's other gradient, kernels.schedule.ResidualLink)."""
    m, k = x2d.shape
    if extra is not None and (agg is None or extra.shape != x2d.shape or extra.dtype != dx.dtype
                              or not extra.is_contiguous()):
        raise ValueError(f"extra goes with agg and is a contiguous {dx.dtype} gradient of x2d {tuple(x2d.shape)}; "
                         f"got {extra.dtype} {tuple(extra.shape)}{' without agg' if agg is None else ''}")
    if not m:
        dw.zero_()
        return
    n = weight.shape[0]
    ng = _ng(n)
    lowp = _lowp(x2d, weight)
    bm, bk, most = (tile_ or (BWD_TILE if agg is None else AGG_TILE)) if lowp else (*_tiles(False), SPLITS)
    nb = cdiv(m, bm)
    blocks = cdiv(nb, most)
    splits = cdiv(nb, blocks)  # at most ``most``, fewer where there are fewer token blocks
    ws = empty((splits, n, k), torch.float32, x2d.device)  # rows past N of each partial are not stored
    if agg is None:
        hp, go, mode, c = x2d, x2d, 0, 1
    else:
        hp, go = agg
        c = go.shape[1]
        if hp.shape[0] != m or go.shape[0] != m or hp.shape[1] * c != k:
            raise ValueError(f"the aggregation term takes h_pre [M, n] and grad_out [M, C] with n * C = K for x2d "
                             f"{tuple(x2d.shape)}; got {tuple(hp.shape)} and {tuple(go.shape)}")
        mode = _agg_mode(c, bk // 2)
    name = torch.cuda.get_device_name(x2d.device) if agg is not None and lowp else ""
    streams = hp.shape[1] if mode else 1  # n, with the term
    if mode and _streams_form(streams, c, bk, lowp):
        q = bk // streams
        launch(_bwd_kernel(True, lowp, name, True), (c // q, splits),
               (x2d.view(m, streams, c), weight.view(n, streams, c), gc, dx.view(m, streams, c),
                ws.view(splits, n, streams, c), hp, go, (dx if extra is None else extra).view(m, streams, c), n, ng,
                bm, q, streams // 2, blocks, lowp, extra is not None))
    else:
        group = streams if GROUP_STREAMS and mode and c % bk == 0 else 0
        launch(_bwd_kernel(agg is not None, lowp, name), (cdiv(k, bk), splits),
               (x2d, weight, gc, dx, ws, hp, go, dx if extra is None else extra, n, ng, bm, bk, blocks, lowp, mode,
                max(1, c // (bk // 2)), c, next_pow2(streams) if mode else 1, group, extra is not None))
    # one step over the splits' rows (an H200 took 22 us for this sum with 32-row steps over 8 rows, 10 us now)
    if side is None:
        sum_partials(ws.view(splits, n * k), dw.view(n * k), BC_SUM, splits, sum_rows_occ2)
    else:
        sum_partials_pair((ws.view(splits, n * k), dw.view(n * k), BC_SUM, splits), side)


def launch_forward(x2d, weight, proj, r, rms, eps, np_, bm, bk, lowp) -> None:
    """``_proj_rms_fwd`` over token blocks of ``bm`` (also the mapping's first launch), with the
    forward's hints."""
    launch(_hinted(_proj_rms_fwd, occupancy=FWD_OCCUPANCY), (cdiv(x2d.shape[0], bm),),
           (x2d, weight, proj, r, rms, float(eps), np_, bm, bk, lowp))


def forward(x2d, weight, eps, tile_=None):
    """``proj, r, rms`` of proj_rms (inputs checked by the caller); ``tile_``: (BM, BK) (sweeps)."""
    m, n = x2d.shape[0], weight.shape[0]
    lowp = _lowp(x2d, weight)
    bm, bk = tile_ or _tiles(lowp)
    proj = empty((m, n), torch.float32, x2d.device)
    r = empty((m,), torch.float32, x2d.device)
    rms = empty((m,), torch.float32, x2d.device)
    if m:
        launch_forward(x2d, weight, proj, r, rms, eps, _np(n), bm, bk, lowp)
    return proj, r, rms


def _lowp(x, w) -> bool:
    """Tensor cores for bf16 (the gradient pieces are bf16, so fp16 takes the fp32 path)."""
    return x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16


class _ProjRms(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, weight, eps):
        check_cuda(x2d, weight)
        require_contiguous("x2d", x2d)
        require_contiguous("weight", weight)
        if x2d.dim() != 2 or weight.dim() != 2 or weight.shape[1] != x2d.shape[1]:
            raise ValueError(f"x2d must be [M, K] and weight [N, K]; got {tuple(x2d.shape)}, {tuple(weight.shape)}")
        proj, r, rms = forward(x2d, weight, eps)
        ctx.save_for_backward(x2d, weight, r, rms)
        return proj, r

    @staticmethod
    def backward(ctx, g_proj, g_r):
        x2d, weight, r, rms = ctx.saved_tensors
        m, k = x2d.shape
        n = weight.shape[0]
        g_proj = (g_proj if g_proj is not None else torch.zeros((m, n), device=x2d.device)).float().contiguous()
        g_r = (g_r if g_r is not None else torch.zeros((m,), device=x2d.device)).float().contiguous()
        dx = empty(x2d.shape, x2d.dtype, x2d.device)
        dw = empty(weight.shape, weight.dtype, x2d.device)
        backward_into(x2d, weight, g_proj, g_r, r, rms, dx, dw)
        return dx, dw, None


def proj_rms(x2d, weight, eps: float = 1e-6):
    """``(x2d @ weight^T, 1 / (||x||_2 / sqrt(K) + eps))`` in fp32 whatever the input dtype."""
    return _ProjRms.apply(x2d, weight, eps)


def compile_checks() -> dict[str, bytes]:
    out = {}
    f32 = torch.float32
    for dtype, lowp in ((torch.bfloat16, True), (torch.float32, False)):
        a2 = array(dtype, 2)
        bm, bk = _tiles(lowp)
        out[f"fwd-{dtype}"] = tile_ir(_proj_rms_fwd, [a2, a2, array(f32, 2), array(f32, 1), array(f32, 1),
                                                      1e-6, 32, bm, bk, lowp])
        bbm, bbk = BWD_TILE[:2] if lowp else (bm, bk)  # the backward at the tile it runs at
        out[f"bwd-{dtype}"] = tile_ir(_proj_rms_bwd, [a2, a2, array(f32, 2), a2, array(f32, 3), a2, a2, a2, 24, 32,
                                                     bbm, bbk, 8, lowp, 0, 1, 1, 1, 0, False])
        # mix_aggregate's aggregation term: grad_out as tiles (C = 7168, the streams' programs side
        # by side) and gathered (C = 75), each with the hints it launches with on an H100 and on
        # other devices, with and without the residual's other gradient (EXTRA)
        for mode, c, group in ((1, 7168, 4), (2, 75, 0)):
            for tag, dev in ((("", "NVIDIA H200"), ("-h100", "NVIDIA H100 80GB HBM3")) if lowp else (("", ""),)):
                for extra in (False, True):
                    out[f"bwd-agg{mode}-{dtype}{tag}{'-extra' if extra else ''}"] = tile_ir(
                        _bwd_kernel(True, lowp, dev), [a2, a2, array(f32, 2), a2, array(f32, 3), array(f32, 2), a2, a2,
                                                       24, 32, bbm, bbk, 8, lowp, mode, max(1, c // (bbk // 2)), c, 4,
                                                       group, extra])
        if lowp:  # the term's kernel a program per channel block of the n = 4 streams (C = 7168)
            a3 = array(dtype, 3)
            for extra in (False, True):
                out[f"bwd-agg-streams-{dtype}{'-extra' if extra else ''}"] = tile_ir(
                    _bwd_kernel(True, True, "NVIDIA H200", True), [a3, a3, array(f32, 2), a3, array(f32, 4),
                                                                   array(f32, 2), a2, a3, 24, 32, bbm, bbk // 4, 2, 8,
                                                                   True, extra])
    out["pack"] = tile_ir(_pack_grad, [array(torch.bfloat16, 2), array(f32, 2), array(f32, 1), array(f32, 1),
                                       array(f32, 1), array(f32, 2), 24, 32, BM_PACK])
    out["sum"] = tile_ir(sum_rows, [array(f32, 2), array(torch.bfloat16, 1), BR, BC_SUM])
    out["sum-splits"] = tile_ir(sum_rows, [array(f32, 2), array(torch.bfloat16, 1), SPLITS, BC_SUM])
    return out
