"""H_post * bias-dropout-add in Triton, forward and backward.

``out[t, i, c] = sum_j H[t, i, j] x[t, j, c] + h_post[t, i] (y[t, c] + bias[c])`` (``H = h_res``,
or ``h_res^T`` with ``transpose_res``). One program owns a ``[tokens, streams, C]`` tile. The
backward reads grad_out, x and y once and writes grad_x and grad_y; the small gradients (h_res and
h_post: reductions over C; bias: a reduction over tokens) are accumulated in fp32 on chip, written
as per-block partials to a small workspace, and summed by a deterministic second kernel. For n = 4
(mHC's case) the backward is ``_h_post_bda_bwd4``: every stream its own 2D tile, token groups
walked with pipelined loads. With x, y, the bias and grad_out of one 16-bit dtype (the mHC case) it
is ``_h_post_bda_bwd4_tc``, whose 20 sums over C per token are one small tensor-core product
(98.6% of copy bandwidth in bf16 on an H200; with dropout the kept gradient rows join it, an
8 x 8 product); fp32, mixed dtypes and 16-bit operands with dropout take ``_h_post_bda_bwd4``
(FMAs and cross-lane sums; 92%). Both finish those sums themselves: the last program of a token
group (a counter elects it; the order of the sum is fixed) sums the group's partials, so the
backward is one launch beside the counters' zeroing. Other n take the generic ``_h_post_bda_bwd``
(57% / 73%), whose partials a second kernel sums.

Why one file of 650 lines: the four kernels (the general forward and backward, the n = 4 FMA and
tensor-core backwards) share the launch code, the workspace and the deterministic second kernel,
and are chosen among at one call site; each is a screen apart, and a change to the shared part
is checked against all of them by the same tests."""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from mhctool.core.poison import empty
from mhctool.references import dropout as _dropout

from ._common import cast, cdiv, check_device, fast, interpreted, next_pow2, pick_config, require_contiguous
from .reduce import sum_rows, sum_rows_pair


@triton.jit
def _tile(t0, c0, T, C, N: tl.constexpr, NP: tl.constexpr, BLOCK_T: tl.constexpr,
          BLOCK_C: tl.constexpr):
    """Token, stream and channel indices of a ``[BLOCK_T, NP, BLOCK_C]`` tile, and its masks."""
    t = (t0 + tl.arange(0, BLOCK_T)).to(tl.int64)
    n = tl.arange(0, NP)
    c = c0 + tl.arange(0, BLOCK_C)
    tmask = t < T
    cmask = c < C
    mask3 = tmask[:, None, None] & (n[None, :, None] < N) & cmask[None, None, :]
    offs3 = t[:, None, None] * N * C + n[None, :, None] * C + c[None, None, :]
    offs2 = t[:, None] * C + c[None, :]
    mask2 = tmask[:, None] & cmask[None, :]
    return t, n, c, tmask, cmask, offs3, mask3, offs2, mask2


@triton.jit
def _h_col(h_ptr, t, n, tmask, j, N: tl.constexpr, TRANSPOSE: tl.constexpr):
    """``Hm[:, i, j]`` for all i of a token block: h_res[t, i, j], or h_res[t, j, i] transposed."""
    if TRANSPOSE:
        offs = t[:, None] * N * N + j * N + n[None, :]
    else:
        offs = t[:, None] * N * N + n[None, :] * N + j
    return tl.load(h_ptr + offs, mask=tmask[:, None] & (n[None, :] < N), other=0.0).to(tl.float32), offs


@triton.jit
def _words(seed, q):
    """Philox-4x32-10's four words at each 64-bit counter of ``q`` (int64, last axis G), as the
    contract lays them over channels (:mod:`mhctool.references.dropout`): ``[..., G, 2, 2]``, whose
    row-major order is word 0, 1, 2, 3 of counter 0, then of counter 1, ...: four consecutive
    channels a counter once the caller reshapes the last three axes into one of 4 G."""
    lo = (q & 0xFFFFFFFF).to(tl.uint32)
    hi = (q >> 32).to(tl.uint32)
    zero = lo * 0
    r0, r1, r2, r3 = tl.philox(seed, lo, hi, zero, zero)
    return tl.join(tl.join(r0, r2), tl.join(r1, r3))


@triton.jit
def _kept1(seed, row, c0, BLOCK_C: tl.constexpr, THRESHOLD: tl.constexpr):
    """The contract's keep mask ``[BLOCK_C]`` of channels ``c0 ..`` (a multiple of 4) in the row
    whose first counter is ``row`` (int64: offset + (token * n + stream) * counters a row)."""
    q = row + (c0 // 4 + tl.arange(0, BLOCK_C // 4)).to(tl.int64)
    return tl.reshape(_words(seed, q), (BLOCK_C,)) >= THRESHOLD


@triton.jit
def _kept2(seed, rows, c0, BLOCK_C: tl.constexpr, THRESHOLD: tl.constexpr):
    """The contract's keep mask ``[R, BLOCK_C]`` of channels ``c0 ..`` (``c0`` a multiple of 4) in
    rows whose first counter is ``rows`` ([R] int64: offset + (token * n + stream) * counters a row)."""
    q = rows[:, None] + (c0 // 4 + tl.arange(0, BLOCK_C // 4)).to(tl.int64)[None, :]
    return tl.reshape(_words(seed, q), (q.shape[0], BLOCK_C)) >= THRESHOLD


@triton.jit
def _kept3(seed, rows, c0, BLOCK_C: tl.constexpr, THRESHOLD: tl.constexpr):
    """:func:`_kept2` over ``[A, B]`` rows: ``[A, B, BLOCK_C]``."""
    q = rows[:, :, None] + (c0 // 4 + tl.arange(0, BLOCK_C // 4)).to(tl.int64)[None, None, :]
    return tl.reshape(_words(seed, q), (q.shape[0], q.shape[1], BLOCK_C)) >= THRESHOLD


@fast
@triton.jit
def _h_post_bda_fwd(h_ptr, x_ptr, hp_ptr, y_ptr, b_ptr, out_ptr, T, C, seed, offset, G, scale, N: tl.constexpr,
                    NP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
                    HAS_BIAS: tl.constexpr, TRANSPOSE: tl.constexpr, THRESHOLD: tl.constexpr):
    t, n, c, tmask, cmask, offs3, mask3, offs2, mask2 = _tile(
        tl.program_id(0) * BLOCK_T, tl.program_id(1) * BLOCK_C, T, C, N, NP, BLOCK_T, BLOCK_C)
    hp = tl.load(hp_ptr + t[:, None] * N + n[None, :], mask=tmask[:, None] & (n[None, :] < N), other=0.0).to(tl.float32)
    z = tl.load(y_ptr + offs2, mask=mask2, other=0.0).to(tl.float32)
    if HAS_BIAS:
        z += tl.load(b_ptr + c, mask=cmask, other=0.0).to(tl.float32)[None, :]
    out = hp[:, :, None] * z[:, None, :]
    if THRESHOLD > 0:  # dropout: the branch kept where the contract's mask keeps it, scaled
        rows = offset + (t[:, None] * N + n[None, :]) * G
        out = tl.where(_kept3(seed, rows, tl.program_id(1) * BLOCK_C, BLOCK_C, THRESHOLD), out * scale, 0.0)
    for j in tl.static_range(N):
        hj, _ = _h_col(h_ptr, t, n, tmask, j, N, TRANSPOSE)
        xj = tl.load(x_ptr + t[:, None] * N * C + j * C + c[None, :], mask=mask2, other=0.0).to(tl.float32)
        out += hj[:, :, None] * xj[:, None, :]
    tl.store(out_ptr + offs3, cast(out, out_ptr.dtype.element_ty), mask=mask3)


@fast
@triton.jit
def _h_post_bda_fwd4(h_ptr, x_ptr, hp_ptr, y_ptr, b_ptr, out_ptr, T, C, seed, offset, G, scale,
                     GROUP: tl.constexpr, BLOCK_C: tl.constexpr, HAS_BIAS: tl.constexpr, TRANSPOSE: tl.constexpr,
                     STAGES: tl.constexpr, THRESHOLD: tl.constexpr):
    """n = 4, shaped like the n = 4 backward: a program walks ``GROUP`` tokens over one C block, a
    token a step, its loads pipelined over ``STAGES`` steps; ``out_i = h_post_i (y + bias) +
    sum_j Hm[i, j] x_j`` per (token, channel) in fp32, added in the generic kernel's order. The
    grid is one-dimensional, C blocks fastest (the order a ``(C blocks, token groups)`` grid runs
    in): a token group a program would put more than 65535 of them on CUDA's second grid axis."""
    n_cb = tl.cdiv(C, BLOCK_C)
    cb = tl.program_id(0) % n_cb
    tg = tl.program_id(0) // n_cb
    c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < C
    if HAS_BIAS:
        bias = tl.load(b_ptr + c, mask=cmask, other=0.0).to(tl.float32)
    t_start = tg.to(tl.int64) * GROUP
    t_end = tl.minimum(t_start + GROUP, T)
    for t in tl.range(t_start, t_end, num_stages=STAGES):
        x0 = tl.load(x_ptr + t * 4 * C + c, mask=cmask, other=0.0).to(tl.float32)
        x1 = tl.load(x_ptr + t * 4 * C + C + c, mask=cmask, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + t * 4 * C + 2 * C + c, mask=cmask, other=0.0).to(tl.float32)
        x3 = tl.load(x_ptr + t * 4 * C + 3 * C + c, mask=cmask, other=0.0).to(tl.float32)
        z = tl.load(y_ptr + t * C + c, mask=cmask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            z += bias
        for i in tl.static_range(4):
            o = tl.load(hp_ptr + t * 4 + i).to(tl.float32) * z
            if THRESHOLD > 0:
                o = tl.where(_kept1(seed, offset + (t * 4 + i) * G, cb * BLOCK_C, BLOCK_C, THRESHOLD), o * scale, 0.0)
            o += _hm1(h_ptr, t, i, 0, TRANSPOSE) * x0
            o += _hm1(h_ptr, t, i, 1, TRANSPOSE) * x1
            o += _hm1(h_ptr, t, i, 2, TRANSPOSE) * x2
            o += _hm1(h_ptr, t, i, 3, TRANSPOSE) * x3
            tl.store(out_ptr + t * 4 * C + i * C + c, cast(o, out_ptr.dtype.element_ty), mask=cmask)


@fast
@triton.jit
def _h_post_bda_bwd(h_ptr, x_ptr, hp_ptr, y_ptr, b_ptr, g_ptr, dx_ptr, dy_ptr,
                    ws_h_ptr, ws_hp_ptr, ws_b_ptr, T, C, seed, offset, G, scale, N: tl.constexpr, NP: tl.constexpr,
                    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, HAS_BIAS: tl.constexpr,
                    TRANSPOSE: tl.constexpr, THRESHOLD: tl.constexpr):
    tb = tl.program_id(0)
    cb = tl.program_id(1)
    t, n, c, tmask, cmask, offs3, mask3, offs2, mask2 = _tile(
        tb * BLOCK_T, cb * BLOCK_C, T, C, N, NP, BLOCK_T, BLOCK_C)
    nmask = tmask[:, None] & (n[None, :] < N)
    g = tl.load(g_ptr + offs3, mask=mask3, other=0.0).to(tl.float32)
    hp = tl.load(hp_ptr + t[:, None] * N + n[None, :], mask=nmask, other=0.0).to(tl.float32)
    z = tl.load(y_ptr + offs2, mask=mask2, other=0.0).to(tl.float32)
    if HAS_BIAS:
        z += tl.load(b_ptr + c, mask=cmask, other=0.0).to(tl.float32)[None, :]
    gb = g  # the gradient the branch receives: the mask's where dropout is on
    if THRESHOLD > 0:
        gb = tl.where(_kept3(seed, offset + (t[:, None] * N + n[None, :]) * G, cb * BLOCK_C, BLOCK_C, THRESHOLD),
                      g * scale, 0.0)
    dy = tl.sum(hp[:, :, None] * gb, axis=1)
    tl.store(dy_ptr + offs2, cast(dy, dy_ptr.dtype.element_ty), mask=mask2)
    ws_row = cb.to(tl.int64) * T + t  # partials of this C block
    tl.store(ws_hp_ptr + ws_row[:, None] * N + n[None, :], tl.sum(gb * z[:, None, :], axis=2), mask=nmask)
    for j in tl.static_range(N):
        hj, hoffs = _h_col(h_ptr, t, n, tmask, j, N, TRANSPOSE)
        xoffs = t[:, None] * N * C + j * C + c[None, :]
        xj = tl.load(x_ptr + xoffs, mask=mask2, other=0.0).to(tl.float32)
        dxj = tl.sum(hj[:, :, None] * g, axis=1)  # sum_i Hm[i, j] g[i, c]
        tl.store(dx_ptr + xoffs, cast(dxj, dx_ptr.dtype.element_ty), mask=mask2)
        dhj = tl.sum(g * xj[:, None, :], axis=2)  # dHm[i, j] over this C block
        tl.store(ws_h_ptr + cb.to(tl.int64) * T * N * N + hoffs, dhj, mask=nmask)
    if HAS_BIAS:
        tl.store(ws_b_ptr + tb.to(tl.int64) * C + c, tl.sum(dy, axis=0), mask=cmask)


@triton.jit
def _dropped(seed, rows, c0, BLOCK_C: tl.constexpr, THRESHOLD: tl.constexpr, g, scale):
    """``g`` ([BLOCK_T, BLOCK_C]) where the contract's mask keeps it, scaled; zero where it drops."""
    return tl.where(_kept2(seed, rows, c0, BLOCK_C, THRESHOLD), g * scale, 0.0)


@triton.jit
def _hoff4(i: tl.constexpr, j: tl.constexpr, TRANSPOSE: tl.constexpr):
    """Where ``Hm[i, j]`` sits in a token's 16 entries of h_res (``h_res[j, i]`` transposed)."""
    return j * 4 + i if TRANSPOSE else i * 4 + j


@triton.jit
def _hm4(h_ptr, t, tmask, i: tl.constexpr, j: tl.constexpr, TRANSPOSE: tl.constexpr):
    """``Hm[t, i, j]`` of a token block as a ``[BLOCK_T, 1]`` column (n = 4)."""
    return tl.load(h_ptr + t * 16 + _hoff4(i, j, TRANSPOSE), mask=tmask, other=0.0).to(tl.float32)[:, None]


@triton.jit
def _dx4(g0, g1, g2, g3, h_ptr, t, tmask, j: tl.constexpr, TRANSPOSE: tl.constexpr):
    """``sum_i Hm[i, j] g_i``: stream j's input gradient, per (token, channel), in registers."""
    return (_hm4(h_ptr, t, tmask, 0, j, TRANSPOSE) * g0 + _hm4(h_ptr, t, tmask, 1, j, TRANSPOSE) * g1
            + _hm4(h_ptr, t, tmask, 2, j, TRANSPOSE) * g2 + _hm4(h_ptr, t, tmask, 3, j, TRANSPOSE) * g3)


@triton.jit
def _dh4(ws_row, t, tmask, gi, xj, i: tl.constexpr, j: tl.constexpr, TRANSPOSE: tl.constexpr):
    """This C block's part of ``dHm[t, i, j] = sum_c g_i x_j``, stored in its row of the workspace
    where h_res[t] keeps it."""
    tl.store(ws_row + t * 16 + _hoff4(i, j, TRANSPOSE), tl.sum(gi * xj, axis=1), mask=tmask,
             eviction_policy="evict_last")


@fast
@triton.jit
def _h_post_bda_bwd4(h_ptr, x_ptr, hp_ptr, y_ptr, b_ptr, g_ptr, dx_ptr, dy_ptr, ws_ptr, ws_b_ptr, T, C,
                     cnt_ptr, dh_ptr, dhp_ptr, db_ptr, ws_b2_ptr, SUPER, seed, offset, G, scale,
                     GROUP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, HAS_BIAS: tl.constexpr,
                     TRANSPOSE: tl.constexpr, STAGES: tl.constexpr, GH: tl.constexpr, GP: tl.constexpr,
                     ROWS: tl.constexpr, DISCARD: tl.constexpr, NL_H: tl.constexpr, NL_P: tl.constexpr,
                     NL_B: tl.constexpr, THRESHOLD: tl.constexpr):
    """n = 4: each stream is its own ``[BLOCK_T, BLOCK_C]`` tile, all four in one layout, so every
    per-(token, channel) product (dy, the four dx) is thread-local and only the sums over C
    (dH, dh_post) and over tokens (the bias) cross lanes. A program owns a C block and a group of
    ``GROUP`` tokens, walking them ``BLOCK_T`` at a time: its bias partial stays in registers
    ([BLOCK_T, BLOCK_C], summed over the rows once at the end), one row per (token group, C
    block); dH and dh_post leave as one partial per (C block, token), in the tensor-core kernel's
    workspace layout, and ``_finish_tc`` sums them at the end of the kernel as it does there (no
    second launch). The tile (and so every sum's order over C) does not depend on the number of
    tokens."""
    cb = tl.program_id(0)
    tg = tl.program_id(1)
    c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < C
    if HAS_BIAS:
        bias = tl.load(b_ptr + c, mask=cmask, other=0.0).to(tl.float32)[None, :]
        db = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    t_end = tl.minimum(tg * GROUP + GROUP, T)  # the loop over int32 bounds: over int64 ones it took 241
    # registers against 168 at (1, 512, 64, 1, 3) (sm_90, dev/sass_offline.py)
    ws_row = ws_ptr + cb.to(tl.int64) * T * 20  # this C block's partials: dH of every token, then dh_post
    for t0 in tl.range(tg * GROUP, t_end, BLOCK_T, num_stages=STAGES):
        t = (t0 + tl.arange(0, BLOCK_T)).to(tl.int64)
        tmask = t < t_end
        mask = tmask[:, None] & cmask[None, :]
        offs = t[:, None] * 4 * C + c[None, :]  # stream 0 of x, g, dx; stream i is i * C further
        g0 = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        g1 = tl.load(g_ptr + offs + C, mask=mask, other=0.0).to(tl.float32)
        g2 = tl.load(g_ptr + offs + 2 * C, mask=mask, other=0.0).to(tl.float32)
        g3 = tl.load(g_ptr + offs + 3 * C, mask=mask, other=0.0).to(tl.float32)
        z = tl.load(y_ptr + t[:, None] * C + c[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            z += bias
        hp0 = tl.load(hp_ptr + t * 4, mask=tmask, other=0.0).to(tl.float32)[:, None]
        hp1 = tl.load(hp_ptr + t * 4 + 1, mask=tmask, other=0.0).to(tl.float32)[:, None]
        hp2 = tl.load(hp_ptr + t * 4 + 2, mask=tmask, other=0.0).to(tl.float32)[:, None]
        hp3 = tl.load(hp_ptr + t * 4 + 3, mask=tmask, other=0.0).to(tl.float32)[:, None]
        b0, b1, b2, b3 = g0, g1, g2, g3  # the gradients the branch receives: masked where dropout is on
        if THRESHOLD > 0:
            b0 = _dropped(seed, offset + t * 4 * G, cb * BLOCK_C, BLOCK_C, THRESHOLD, g0, scale)
            b1 = _dropped(seed, offset + (t * 4 + 1) * G, cb * BLOCK_C, BLOCK_C, THRESHOLD, g1, scale)
            b2 = _dropped(seed, offset + (t * 4 + 2) * G, cb * BLOCK_C, BLOCK_C, THRESHOLD, g2, scale)
            b3 = _dropped(seed, offset + (t * 4 + 3) * G, cb * BLOCK_C, BLOCK_C, THRESHOLD, g3, scale)
        dy = hp0 * b0 + hp1 * b1 + hp2 * b2 + hp3 * b3
        tl.store(dy_ptr + t[:, None] * C + c[None, :], cast(dy, dy_ptr.dtype.element_ty), mask=mask)
        if HAS_BIAS:
            db += dy  # zero outside the tile's masks (g loaded as zeros there)
        hp_row = ws_row + T * 16 + t * 4
        tl.store(hp_row, tl.sum(b0 * z, axis=1), mask=tmask, eviction_policy="evict_last")
        tl.store(hp_row + 1, tl.sum(b1 * z, axis=1), mask=tmask, eviction_policy="evict_last")
        tl.store(hp_row + 2, tl.sum(b2 * z, axis=1), mask=tmask, eviction_policy="evict_last")
        tl.store(hp_row + 3, tl.sum(b3 * z, axis=1), mask=tmask, eviction_policy="evict_last")
        for j in tl.static_range(4):
            xj = tl.load(x_ptr + offs + j * C, mask=mask, other=0.0).to(tl.float32)
            dxj = _dx4(g0, g1, g2, g3, h_ptr, t, tmask, j, TRANSPOSE)
            tl.store(dx_ptr + offs + j * C, cast(dxj, dx_ptr.dtype.element_ty), mask=mask)
            _dh4(ws_row, t, tmask, g0, xj, 0, j, TRANSPOSE)
            _dh4(ws_row, t, tmask, g1, xj, 1, j, TRANSPOSE)
            _dh4(ws_row, t, tmask, g2, xj, 2, j, TRANSPOSE)
            _dh4(ws_row, t, tmask, g3, xj, 3, j, TRANSPOSE)
    if HAS_BIAS:
        tl.store(ws_b_ptr + tg.to(tl.int64) * C + c, tl.sum(db, axis=0), mask=cmask, eviction_policy="evict_last")
    _finish_tc(ws_ptr, ws_b_ptr, ws_b2_ptr, cnt_ptr, dh_ptr, dhp_ptr, db_ptr, T, C, SUPER, cb, tg,
               tg.to(tl.int64) * GROUP, t_end.to(tl.int64), c, cmask, BLOCK_C, HAS_BIAS, GH, GP, ROWS, DISCARD,
               NL_H, NL_P, NL_B)


@triton.jit
def _sums_over_c(a, b, F32DOT: tl.constexpr):
    """``a @ b^T``: every row of ``a`` against every row of ``b`` summed over the block's channels,
    on tensor cores (with ``F32DOT``, the operands upcast to fp32 at IEEE: the interpreter)."""
    if F32DOT:
        return tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), input_precision="ieee")
    return tl.dot(a, tl.trans(b))


@fast
@triton.jit
def _h_post_bda_bwd4_tc(h_ptr, x_ptr, hp_ptr, y_ptr, b_ptr, g_ptr, dx_ptr, dy_ptr, ws_ptr, ws_b_ptr, T, C,
                        cnt_ptr, dh_ptr, dhp_ptr, db_ptr, ws_b2_ptr, SUPER, seed, offset, G, scale,
                        GROUP: tl.constexpr, BLOCK_C: tl.constexpr, HAS_BIAS: tl.constexpr,
                        TRANSPOSE: tl.constexpr, STAGES: tl.constexpr, F32DOT: tl.constexpr,
                        GH: tl.constexpr, GP: tl.constexpr, ROWS: tl.constexpr, DISCARD: tl.constexpr,
                        NL_H: tl.constexpr, NL_P: tl.constexpr, NL_B: tl.constexpr, THRESHOLD: tl.constexpr):
    """n = 4 with 16-bit x, y, bias and grad_out: the 20 sums over C as one tensor-core product.
    A step is one token over the program's C block: its gradient as a ``[4, BLOCK_C]`` tile times
    the ``[8, BLOCK_C]`` tile of x's four streams, y, the bias and two zero rows (transposed), so
    ``d[i, j] = g_i . x_j`` (dH) and ``d[i, 4] + d[i, 5] = g_i . (y + bias)`` (dh_post): exact
    products of 16-bit values summed in fp32 (one accumulator over the block's 512 channels: at the
    paper shape 6.6e-7 relative to the FMA kernel's sums), no cross-lane sums. dx and dy are per (token,
    channel) and thread-local, as in ``_h_post_bda_bwd4``; the bias partial stays in registers
    over the program's ``GROUP`` tokens. A C block's row of ``ws`` holds every token's 16 dH
    partials (where h_res keeps them), then every token's 4 dh_post partials; the bias partial
    goes to ``ws_b``'s row of the token group. All are stored with an L2 evict-last hint and summed
    at the end of the kernel by ``_finish_tc``: no second launch, no partial read back from DRAM.
    ``F32DOT``: the product's operands upcast to fp32 (the interpreter, whose bf16 ``tl.dot`` is
    unreliable). ``DISCARD``: drop the partials from L2 once summed (not under the interpreter).

    With dropout (``THRESHOLD``), the branch's gradient is the mask's: the product's first operand
    is ``[8, BLOCK_C]``, the gradient's four rows and then the same rows where the contract's mask
    keeps them (zeroed elsewhere, which rounds nothing in 16 bits), so rows 0-3 give dH (the
    residual mix is never dropped) and rows 4-7 the kept sums of dh_post, scaled after the sum;
    dy takes the kept gradient scaled, element by element in fp32, as the FMA kernel does."""
    cb = tl.program_id(0)
    tg = tl.program_id(1)
    c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < C
    r4 = tl.arange(0, 4)
    r8 = tl.arange(0, 8)
    if HAS_BIAS:
        db = tl.zeros([BLOCK_C], dtype=tl.float32)
        rows = r8 < 6
    else:
        rows = r8 < 5
    hoff = r8[None, :] * 4 + r4[:, None] if TRANSPOSE else r4[:, None] * 4 + r8[None, :]
    t_start = tg.to(tl.int64) * GROUP
    t_end = tl.minimum(t_start + GROUP, T)
    for t in tl.range(t_start, t_end, num_stages=STAGES):
        g = tl.load(g_ptr + t * 4 * C + r4[:, None] * C + c[None, :], mask=cmask[None, :], other=0.0)
        # the product's other operand: rows 0-3 x_j, row 4 y, row 5 the bias, rows 6-7 masked
        off = tl.where(r8 < 4, t * 4 * C + r8 * C, t * C)[:, None] + c[None, :]
        src = tl.where(r8[:, None] < 4, x_ptr + off, y_ptr + off)
        if HAS_BIAS:
            src = tl.where(r8[:, None] == 5, b_ptr + c[None, :], src)
        xyb = tl.load(src, mask=rows[:, None] & cmask[None, :], other=0.0)
        ws_row = ws_ptr + cb.to(tl.int64) * T * 20  # this C block's partials: dH of every token, then dh_post
        branch = (r8[None, :] == 4) | (r8[None, :] == 5)  # the columns of y and the bias
        if THRESHOLD > 0:
            kept = _kept2(seed, offset + (t * 4 + r4) * G, cb * BLOCK_C, BLOCK_C, THRESHOLD)
            gm = tl.where(kept, g, tl.zeros_like(g))
            g8 = tl.reshape(tl.permute(tl.join(g, gm), (2, 0, 1)), (8, BLOCK_C))  # g's rows, then the kept ones
            d = _sums_over_c(g8, xyb, F32DOT)
            hoff8 = r8[None, :] * 4 + r8[:, None] if TRANSPOSE else r8[:, None] * 4 + r8[None, :]
            tl.store(ws_row + t * 16 + hoff8, d, mask=(r8[:, None] < 4) & (r8[None, :] < 4),
                     eviction_policy="evict_last")
            tl.store(ws_row + T * 16 + t * 4 + (r8 - 4), tl.sum(tl.where(branch, d, 0.0), axis=1) * scale,
                     mask=r8 >= 4, eviction_policy="evict_last")
            m0, m1, m2, m3 = _rows4(gm.to(tl.float32))
            m0, m1, m2, m3 = m0 * scale, m1 * scale, m2 * scale, m3 * scale
        else:
            d = _sums_over_c(g, xyb, F32DOT)
            tl.store(ws_row + t * 16 + hoff, d, mask=r8[None, :] < 4, eviction_policy="evict_last")
            tl.store(ws_row + T * 16 + t * 4 + r4, tl.sum(tl.where(branch, d, 0.0), axis=1), eviction_policy="evict_last")
        g0, g1, g2, g3 = _rows4(g.to(tl.float32))
        if THRESHOLD == 0:
            m0, m1, m2, m3 = g0, g1, g2, g3  # the gradients the branch receives
        dy = (tl.load(hp_ptr + t * 4).to(tl.float32) * m0 + tl.load(hp_ptr + t * 4 + 1).to(tl.float32) * m1
              + tl.load(hp_ptr + t * 4 + 2).to(tl.float32) * m2 + tl.load(hp_ptr + t * 4 + 3).to(tl.float32) * m3)
        tl.store(dy_ptr + t * C + c, cast(dy, dy_ptr.dtype.element_ty), mask=cmask)
        if HAS_BIAS:
            db += dy
        for j in tl.static_range(4):
            dxj = (_hm1(h_ptr, t, 0, j, TRANSPOSE) * g0 + _hm1(h_ptr, t, 1, j, TRANSPOSE) * g1
                   + _hm1(h_ptr, t, 2, j, TRANSPOSE) * g2 + _hm1(h_ptr, t, 3, j, TRANSPOSE) * g3)
            tl.store(dx_ptr + t * 4 * C + j * C + c, cast(dxj, dx_ptr.dtype.element_ty), mask=cmask)
    if HAS_BIAS:
        tl.store(ws_b_ptr + tg.to(tl.int64) * C + c, db, mask=cmask, eviction_policy="evict_last")
    _finish_tc(ws_ptr, ws_b_ptr, ws_b2_ptr, cnt_ptr, dh_ptr, dhp_ptr, db_ptr, T, C, SUPER, cb, tg, t_start, t_end,
               c, cmask, BLOCK_C, HAS_BIAS, GH, GP, ROWS, DISCARD, NL_H, NL_P, NL_B)


@triton.jit
def _discard_l2(lo, hi, NL: tl.constexpr, dep):
    """Drop the 128-byte L2 lines that lie wholly in ``[lo, hi)`` (pointers) without writing them
    back (PTX ``discard.global.L2``): a workspace that has been read for the last time need not
    reach DRAM. ``dep`` (a value computed from the last loads of those lines) makes the discard
    wait for them. ``NL`` bounds the number of lines."""
    first = (lo.to(tl.int64) + 127) // 128 * 128
    line = first + tl.arange(0, NL).to(tl.int64) * 128
    ok = (line + 128 <= hi.to(tl.int64)).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p discard.global.L2 [$1], 128; mov.u32 $0, 0; }",
        "=r,l,r,f", [line, ok, dep + tl.zeros([NL], tl.float32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _sum_rows_in_order(ptrs, stride, rows, mask, ROWS: tl.constexpr):
    """``sum_r ptrs[r * stride]`` over ``rows`` rows, added one row after another in row order,
    ``ROWS`` rows' loads issued at once (L2, bypassing L1); rows past the end load as -0.0, which
    leaves every sum's bits as they are (-0.0 included)."""
    acc = tl.zeros(ptrs.shape, dtype=tl.float32)
    for r0 in range(0, rows, ROWS):
        for k in tl.static_range(ROWS):
            acc += tl.load(ptrs + k * stride, mask=mask & (tl.full(ptrs.shape, r0 + k, tl.int32) < rows), other=-0.0,
                           cache_modifier=".cg")
        ptrs += ROWS * stride
    return acc


@triton.jit
def _finish_tc(ws_ptr, ws_b_ptr, ws_b2_ptr, cnt_ptr, dh_ptr, dhp_ptr, db_ptr, T, C, SUPER, cb, tg, t_start, t_end,
               c, cmask, BLOCK_C: tl.constexpr, HAS_BIAS: tl.constexpr, GH: tl.constexpr, GP: tl.constexpr,
               ROWS: tl.constexpr, DISCARD: tl.constexpr, NL_H: tl.constexpr, NL_P: tl.constexpr,
               NL_B: tl.constexpr):
    """The small gradients finished inside the backward, by whichever program arrives last (a
    counter decides who; what is summed, and in which order, is fixed, so the bits do not depend on
    scheduling): the last of a token group's C-block programs sums the group's dH and dh_post
    partials over the C blocks in block order (the same sums as an ordered ``sum_rows``), reading
    them from L2 where they were just written, ``GH / 16`` tokens at a time (``GP = GH / 4``). The
    bias partials (a row per token group) are summed in two levels: the last of ``SUPER``
    consecutive token groups of a C block sums their rows in order into a row of ``ws_b2``, and the
    last of those sums ``ws_b2``'s rows in order. Counters (int32, zeroed by the caller):
    ``[0, n_tg)`` the token groups, then a C block's supergroups, then the C blocks. The stores
    before a counter's increment are made visible by the barrier and the increment's release; the
    elected program's loads bypass L1 (``.cg``)."""
    n_cb = tl.num_programs(0)
    n_tg = tl.num_programs(1)
    tl.debug_barrier()
    if tl.atomic_add(cnt_ptr + tg, 1, sem="acq_rel") == n_cb - 1:
        dep = 0.0
        for s0 in range(t_start, t_end, GH // 16):  # GH / 16 tokens at a time
            s1 = tl.minimum(s0 + GH // 16, t_end)
            kh = s0 * 16 + tl.arange(0, GH)
            kp = T * 16 + s0 * 4 + tl.arange(0, GP)
            mh = kh < s1 * 16
            mp = kp < T * 16 + s1 * 4
            acc_h = tl.zeros([GH], dtype=tl.float32)
            acc_p = tl.zeros([GP], dtype=tl.float32)
            row = ws_ptr
            for r0 in range(0, n_cb, ROWS):
                for k in tl.static_range(ROWS):
                    acc_h += tl.load(row + k * T * 20 + kh, mask=mh & (tl.full([GH], r0 + k, tl.int32) < n_cb),
                                     other=-0.0, cache_modifier=".cg")
                    acc_p += tl.load(row + k * T * 20 + kp, mask=mp & (tl.full([GP], r0 + k, tl.int32) < n_cb),
                                     other=-0.0, cache_modifier=".cg")
                row += ROWS * T * 20
            tl.store(dh_ptr + kh, cast(acc_h, dh_ptr.dtype.element_ty), mask=mh)
            tl.store(dhp_ptr + kp - T * 16, cast(acc_p, dhp_ptr.dtype.element_ty), mask=mp)
            dep += tl.sum(acc_h, axis=0) + tl.sum(acc_p, axis=0)
        if DISCARD:
            row = ws_ptr
            for _ in range(0, n_cb):
                _discard_l2(row + t_start * 16, row + t_end * 16, NL_H, dep)
                _discard_l2(row + T * 16 + t_start * 4, row + T * 16 + t_end * 4, NL_P, dep)
                row += T * 20
    if HAS_BIAS:
        n_sup = tl.cdiv(n_tg, SUPER)
        sup = tg // SUPER
        lo = sup * SUPER
        hi = tl.minimum(lo + SUPER, n_tg)
        if tl.atomic_add(cnt_ptr + n_tg + cb * n_sup + sup, 1, sem="acq_rel") == hi - lo - 1:
            acc = _sum_rows_in_order(ws_b_ptr + lo.to(tl.int64) * C + c, C, hi - lo, cmask, ROWS)
            tl.store(ws_b2_ptr + sup.to(tl.int64) * C + c, acc, mask=cmask)
            if DISCARD:
                dep = tl.sum(acc, axis=0)
                row = ws_b_ptr + lo.to(tl.int64) * C + cb * BLOCK_C
                for _ in range(lo, hi):
                    _discard_l2(row, row + tl.minimum(BLOCK_C, C - cb * BLOCK_C), NL_B, dep)
                    row += C
            tl.debug_barrier()
            if tl.atomic_add(cnt_ptr + n_tg + n_cb * n_sup + cb, 1, sem="acq_rel") == n_sup - 1:
                acc = _sum_rows_in_order(ws_b2_ptr + c, C, n_sup, cmask, ROWS)
                tl.store(db_ptr + c, cast(acc, db_ptr.dtype.element_ty), mask=cmask)


@triton.jit
def _rows4(v):
    """The four rows of a ``[4, B]`` tile as ``[B]`` vectors (in-thread: every thread holds all four)."""
    a, b = tl.split(tl.reshape(tl.trans(v), (v.shape[1], 2, 2)))  # a: rows 0 and 2; b: rows 1 and 3
    r0, r2 = tl.split(a)
    r1, r3 = tl.split(b)
    return r0, r1, r2, r3


@triton.jit
def _hm1(h_ptr, t, i: tl.constexpr, j: tl.constexpr, TRANSPOSE: tl.constexpr):
    """``Hm[t, i, j]`` of one token, a scalar."""
    return tl.load(h_ptr + t * 16 + _hoff4(i, j, TRANSPOSE)).to(tl.float32)


# the generic kernels' tiles under Triton's interpreter: [BLOCK_T, NP, BLOCK_C] of about this many
# elements, at most this many channels wide (fixed, so batch invariance holds there too). The
# default scenario's long_tokens (4101 tokens, C = 67) took 4.8 s a case at 64 x 4 x 128 tiles.
INTERPRETER_ELEMS = 2**18
INTERPRETER_MAX_C = 1024


def _blocks(C: int, n: int, elems: int = 8192, max_c: int = 256, warps: int = 8):
    """(BLOCK_T, BLOCK_C, num_warps): a [BLOCK_T, NP, BLOCK_C] tile of about ``elems`` elements."""
    np_ = next_pow2(n)
    if interpreted():  # the interpreter's cost is per program and operation: few, large tiles
        bc = min(INTERPRETER_MAX_C, max(4, next_pow2(C)))  # at least one dropout counter's 4 channels
        return max(16, INTERPRETER_ELEMS // (np_ * bc)), bc, 4
    bc = max(32, min(max_c, next_pow2(C)))
    bt = max(1, elems // (np_ * bc))
    return bt, bc, warps


def _candidates(C: int, n: int) -> list[tuple]:
    if interpreted():
        return [_blocks(C, n)]
    out = []
    # the last three (one and two warps): the H200's forward went 1.06 -> 1.05 ms with them
    for elems, max_c, warps in ((8192, 256, 8), (4096, 512, 4), (8192, 1024, 8), (4096, 128, 4),
                                (16384, 512, 8), (2048, 256, 4), (16384, 256, 8), (32768, 1024, 16),
                                (1024, 256, 1), (2048, 256, 1), (2048, 512, 2)):
        cfg = _blocks(C, n, elems, max_c, warps)
        if cfg not in out:
            out.append(cfg)
    return out


def _check(h_res, x, h_post, y, bias):
    if x.dim() != 4:
        raise ValueError(f"h_post_bda takes x[s,b,n,C]; got {tuple(x.shape)}")
    s, b, n, C = x.shape
    want = {"h_res": (s, b, n, n), "h_post": (s, b, n), "y": (s, b, C)}
    for name, t in (("h_res", h_res), ("h_post", h_post), ("y", y)):
        if tuple(t.shape) != want[name]:
            raise ValueError(f"h_post_bda: {name} has shape {tuple(t.shape)}, expected {want[name]}")
    if bias is not None and tuple(bias.shape) != (C,):
        raise ValueError(f"h_post_bda: bias has shape {tuple(bias.shape)}, expected ({C},)")
    check_device(h_res, x, h_post, y, bias)
    require_contiguous("x", x)
    require_contiguous("y", y)
    return h_res.contiguous(), h_post.contiguous()


def _mask_args(C: int, dropout: float, seed: int, offset: int) -> tuple[tuple, int]:
    """The kernels' dropout arguments ``(seed, offset, counters a row, scale)`` and THRESHOLD (0:
    no dropout), for the contract's mask (:mod:`mhctool.references.dropout`)."""
    k = _dropout.key(C, dropout, seed, offset)
    return (k.seed, k.offset, k.counters_per_row, k.scale), k.threshold


def h_post_bda_forward(h_res, x, h_post, y, bias=None, transpose_res=False, tile_=None, dropout=0.0,
                       dropout_seed=0, dropout_offset=0):
    """``tile_``: a tile for the generic kernel (3 entries) or the n = 4 one (4; sweeps). With
    ``dropout``, the branch is dropped by the contract's mask keyed by ``dropout_seed`` and
    ``dropout_offset``, drawn in the kernel."""
    h_res, h_post = _check(h_res, x, h_post, y, bias)
    s, b, n, C = x.shape
    T = s * b
    if tile_ is not None and len(tile_) == 4 and n != 4:
        raise ValueError(f"h_post_bda_forward: a 4-entry tile is for n = 4, not n = {n}")
    out = empty(x.shape, x.dtype, x.device)
    mask, thr = _mask_args(C, dropout, dropout_seed, dropout_offset)

    def run(cfg):
        if len(cfg) == 4:  # the n = 4 kernel: (BLOCK_C, GROUP, warps, stages)
            bc, group, warps, stages = cfg
            _h_post_bda_fwd4[(cdiv(C, bc) * cdiv(T, group),)](
                h_res, x, h_post, y, bias if bias is not None else y, out, T, C, *mask, GROUP=group, BLOCK_C=bc,
                HAS_BIAS=bias is not None, TRANSPOSE=bool(transpose_res), STAGES=stages, THRESHOLD=thr,
                num_warps=warps)
            return
        bt, bc, warps = cfg
        _h_post_bda_fwd[(cdiv(T, bt), cdiv(C, bc))](
            h_res, x, h_post, y, bias if bias is not None else y, out, T, C, *mask, N=n, NP=next_pow2(n),
            BLOCK_T=bt, BLOCK_C=bc, HAS_BIAS=bias is not None, TRANSPOSE=bool(transpose_res),
            THRESHOLD=thr, num_warps=warps)

    if T and C:
        run(tile_ or (forward_tile4() if _n4_kernels(n) else
                      pick_config(("h_post_bda_fwd", T, C, n, x.dtype, bias is not None, thr > 0),
                                  _candidates(C, n), run, work=T * n * C)))
    return out


def _n4_kernels(n: int) -> bool:
    """Whether the n = 4 kernels run by default: on a GPU. Through the interpreter, whose cost is
    per operation rather than per element, their unrolled per-token scalar work ran 60-100x slower
    than the generic kernel's [tokens, n, C] tiles (200 tokens, C = 67, bf16: 8.8 / 12.2 s forward /
    backward against 0.14 / 0.17 s); there the generic kernel is the default, the same one for
    every shape (so batch invariance holds there too), and the n = 4 kernels run when a tile of
    theirs is asked for (tests/kernels/test_triton.py does, at odd shapes)."""
    return n == 4 and not interpreted()


def forward_tile4() -> tuple:
    """The n = 4 forward kernel's (BLOCK_C, GROUP, warps, stages), fixed like the backward's and not
    timed against the generic kernel: the two kernels' fp32 sums contract differently (on an H200,
    bf16 outputs one ulp apart), so a choice timed per shape would give a token other bits at
    another batch size. Under the interpreter, small blocks that cross C blocks and token groups at
    the tests' odd shapes."""
    return (64, 8, 1, 1) if interpreted() else FWD4_TILE


# the n = 4 forward's tile on a GPU: one token a program, no pipelining, many small programs (TE's
# forward is shaped so too). On an H200 at the paper shape (bf16, graph replay, docs/perf-notes.md
# fifteenth session) (1024, 1, 1, 1) took 0.986-0.988 ms, other one-token tiles of 256-2048
# channels 0.985-0.991, two tokens 0.996-0.998, the fourteenth session's (512, 16, 1, 3) 1.024-1.027
# (and 1.043-1.046 where the generic kernel's timed pick took 1.067). The tile changes bits: with
# one stage the compiler contracts the sums into FMAs otherwise than with pipelined stages.
# At issue 99's step call (4,096 tokens, C = 2048, bf16) with its dropout 0.1 on an H100 (graph
# replay, dev/step_profile.py postfwd, session 62): (1024, 1, 1, 1) 68.4 us (73% of copy), (512, 1,
# 1, 1) 54.4 (92%), (2048, 1, 2, 1) 69.2, (512, 4, 1, 3) 61.5, (256, 8, 1, 3) 60.6, every one with
# the same bits; so 512 channels a program, which the paper shape's sweep put level with 1024
FWD4_TILE = (512, 1, 1, 1)


def backward_tile(C: int, n: int) -> tuple:
    """The generic backward's (BLOCK_T, BLOCK_C, warps), n != 4: a function of C and n alone,
    never of the number of tokens. grad_h_res and grad_h_post are sums over C whose order the tile
    decides (the C blocks, and within a block the layout of the tile's reduction), so a tile timed
    per token count, as it was, gave a token other bits at another batch size. Fixed from the sweep in
    docs/perf-notes.md (H100, paper shape): 4096-element tiles at most 128 channels wide on 4
    warps, the tile the timing used to pick there (2.99 ms; the old first candidate took 4.03).
    (The forward has no reduction across lanes: its tile stays timed.)

    Under the interpreter, the forward's large tiles (a tile's sum over its tokens is pairwise
    there, as mhctool mends the interpreter's ``tl.sum``: sequential, 512 tokens a tile failed the
    fp32 long_tokens grad_bias at 1.2x the allowed error)."""
    return _blocks(C, n, 4096, 128, 4)


def backward_tile4(dtype: torch.dtype, tc: bool = False, dropout: bool = False) -> tuple:
    """The n = 4 backward's tile, fixed per kernel and element size like ``backward_tile`` (never
    a function of the number of tokens, so a token's dH sums in the same order at every batch
    size). ``tc``: the tensor-core kernel's (BLOCK_C, GROUP, warps, stages); otherwise the FMA
    kernel's (BLOCK_T, BLOCK_C, GROUP, warps, stages); ``dropout`` with 16-bit operands: the FMA
    kernel's at its own tile, whatever ``tc`` says (the mask's Philox rounds made the tensor-core
    kernel the slower one). Under the interpreter, small blocks so that the tests' odd shapes
    cross C blocks, token groups and partial tiles."""
    if interpreted():
        return (64, 8, 1, 1) if tc else (4, 64, 8, 4, 1)
    if dropout and dtype in (torch.bfloat16, torch.float16):
        return BWD4_TILE_DROPOUT
    if tc:
        return BWD4_TILE_TC
    return BWD4_TILE_FP32 if dtype == torch.float32 else BWD4_TILE


# the n = 4 backward's tiles on a GPU, from the sweeps at the paper shape (dev/bwd_sweep.py,
# docs/perf-notes.md). Pipelined loads (stages) made it fast on an H100, where the ninth session
# shipped (4, 256, 256, 4, 3) for bf16 and (4, 128, 256, 4, 2) for fp32. On an H200 those sat at
# 80% / 85% of copy (1.95 / 3.7 ms; ncu: 25% occupancy, limited by registers and shared memory,
# a third of the issue gaps on shuffles and shared memory); one-warp programs over one token and
# 512 channels (16 a lane, so fewer shuffles per byte in the 20 sums over C) took 1.76-1.82 /
# 3.32-3.48 ms, 88-94%. Not re-timed on an H100 (there (2, 256, 128, 1, 3) matched the old tile).
# The FMA kernel keeps these for fp32 (and 16-bit operands of mixed dtypes).
BWD4_TILE = (1, 512, 64, 1, 3)  # bf16, fp16
BWD4_TILE_FP32 = (1, 512, 64, 1, 3)
# The tensor-core kernel (16-bit operands of one dtype), (BLOCK_C, GROUP, warps, stages): one warp
# over one token and 512 channels a step, four stages (134 registers, 37 KB of shared memory: 6
# programs a SM; dev/sass_offline.py). On an H200 the FMA kernel's 20 sums over C (100 shuffles a
# step) and their workspace cost 100 us of its 1.71 ms; this kernel at this tile was 1.5-2% faster
# than the FMA one, two and three stages in between (docs/perf-notes.md, thirteenth session). With
# the sums finished in the kernel (fifteenth session), groups of 16 tokens took 1.579-1.584 ms
# against 1.597-1.602 for 32 (12: 1.580, 24: 1.592, 64: 1.661; 16 with 3 / 5 / 6 stages: 1.597 /
# 1.737 / 2.121): more, shorter programs, and their extra bias partials now stay in L2. A token's
# dH, dh_post, dx and dy have the same bits at every group size.
BWD4_TILE_TC = (512, 16, 1, 4)
# With dropout, the mask's counters (the Philox rounds of four rows a token) take registers: compiled
# for sm_90 offline with the device's Triton 3.6 (dev/sass_offline.py), one warp over 512 channels
# spilled (255 registers, 108 local loads and 124 stores in the main loop, at 4 stages and at 2),
# two warps did not (249 registers, 45 KB of shared memory), nor did one warp over 256 channels.
# On an H100 (docs/perf-notes.md, 2026-12-07, session 59): 3.45 ms at the paper shape, where the FMA
# kernel took 2.41; in issue 99's step (4,096 tokens a call, C = 2048, where the FMA tile makes 256
# one-warp programs) the post-path's backward fell from 55 to 35 ms a step. The tensor-core kernel's
# tile where dropout asks for it (tile_, sweeps); by default dropout takes the FMA kernel below.
BWD4_TILE_TC_DROPOUT = (512, 16, 2, 4)
# With dropout, 16-bit operands: the FMA kernel over 256 channels and 32 tokens a program. At issue
# 99's step call (4,096 tokens, C = 2048, bf16, dropout 0.1) on an H100, graph replay
# (dev/step_profile.py postbwd, session 63): 100.0 us (78% of copy), where the tensor-core kernel
# with the mask took 147.2 at its tile and 131.2-154.4 at six others (its loop is mostly the
# mask's Philox rounds: 1,484 instructions against 920 without dropout, offline for sm_90), and the
# FMA kernel 254.6 at its paper-shape tile (256 programs a call), 111.8-117.9 at three others. In
# the step the post-path's backward fell from 32.8 to 25.8 ms. Not timed at the paper shape.
BWD4_TILE_DROPOUT = (1, 256, 32, 1, 3)


def _tc_operands(x, y, bias, grad_out) -> bool:
    """x, y, the bias and grad_out of one 16-bit dtype: the tensor-core n = 4 backward's operands."""
    return (x.dtype in (torch.bfloat16, torch.float16) and y.dtype == grad_out.dtype == x.dtype
            and (bias is None or bias.dtype == x.dtype))


def h_post_bda_backward(h_res, x, h_post, y, bias, grad_out, transpose_res=False, tile_=None, dropout=0.0,
                        dropout_seed=0, dropout_offset=0):
    """``tile_``: a tile for the generic kernel (3 entries), the n = 4 tensor-core one (4) or the
    n = 4 FMA one (5); by default the n = 4 tensor-core kernel where n = 4 and x, y, the bias and
    grad_out share a 16-bit dtype and there is no dropout, the n = 4 FMA kernel for other n = 4
    cases (``backward_tile4``; the tensor-core kernel takes dropout where its tile is asked for:
    the kept gradient rows join the product). With ``dropout``, the forward's mask is drawn again
    from the same key."""
    h_res, h_post = _check(h_res, x, h_post, y, bias)
    grad_out = grad_out.contiguous()
    s, b, n, C = x.shape
    T = s * b
    mask, thr = _mask_args(C, dropout, dropout_seed, dropout_offset)
    tc = n == 4 and _tc_operands(x, y, bias, grad_out)
    tile = tile_ or (backward_tile4(x.dtype, tc, thr > 0) if _n4_kernels(n) else backward_tile(C, n))
    if len(tile) in (4, 5) and n != 4:
        raise ValueError(f"h_post_bda_backward: a {len(tile)}-entry tile is for n = 4, not n = {n}")
    if len(tile) == 4 and not tc:
        raise ValueError("h_post_bda_backward: the tensor-core tile (4 entries) needs x, y, bias and grad_out "
                         f"of one 16-bit dtype; got {x.dtype}, {y.dtype}, "
                         f"{None if bias is None else bias.dtype}, {grad_out.dtype}")
    dx = empty(x.shape, x.dtype, x.device)
    dy = empty(y.shape, y.dtype, y.device)
    if len(tile) in (4, 5):
        return _backward_n4(h_res, x, h_post, y, bias, grad_out, dx, dy, transpose_res, tile, mask, thr)
    bt, bc = tile[0], tile[1]
    n_cb = cdiv(C, bc)
    n_tb = cdiv(T, bt)  # rows of bias partials
    # poisoned like the outputs under parity: a partial no program writes shows as NaN
    ws_h = empty((n_cb, T * n * n), torch.float32, x.device)
    ws_hp = empty((n_cb, T * n), torch.float32, x.device)
    ws_b = empty((n_tb, C) if bias is not None else (1, 1), torch.float32, x.device)
    if not (T and C):
        ws_h.zero_(), ws_hp.zero_(), ws_b.zero_()
    else:
        _h_post_bda_bwd[(n_tb, n_cb)](h_res, x, h_post, y, bias if bias is not None else y, grad_out, dx, dy, ws_h,
                                      ws_hp, ws_b, T, C, *mask, N=n, NP=next_pow2(n), BLOCK_T=bt, BLOCK_C=bc,
                                      HAS_BIAS=bias is not None, TRANSPOSE=bool(transpose_res),
                                      THRESHOLD=thr, num_warps=tile[2])
    # dH's and dh_post's partials in one launch (the bits of two)
    d_h, d_hp = sum_rows_pair((ws_h, h_res.dtype, h_res.shape, True), (ws_hp, h_post.dtype, h_post.shape, True))
    d_b = sum_rows(ws_b, bias.dtype, bias.shape) if bias is not None else None
    return d_h, dx, d_hp, dy, d_b


def _backward_n4(h_res, x, h_post, y, bias, grad_out, dx, dy, transpose_res, tile, mask, thr):
    """The n = 4 backwards, the tensor-core kernel (a 4-entry tile) or the FMA one (5 entries):
    each finishes dH, dh_post and the bias's gradient itself (``_finish_tc``), one launch beside
    the counters' zeroing."""
    s, b, n, C = x.shape
    T = s * b
    fma = len(tile) == 5
    bt, bc, group, warps, stages = tile if fma else (1, *tile)
    n_cb = cdiv(C, bc)
    n_tg = cdiv(T, group)
    sup = math.isqrt(max(n_tg - 1, 0)) + 1  # the bias partials' two levels: about sqrt(n_tg) rows a sum at each
    n_sup = cdiv(n_tg, sup)
    # poisoned like the outputs under parity: a partial no program writes shows as NaN
    ws = empty((n_cb, T * 20), torch.float32, x.device)
    ws_b = empty((n_tg, C) if bias is not None else (1, 1), torch.float32, x.device)
    ws_b2 = empty((n_sup, C) if bias is not None else (1, 1), torch.float32, x.device)
    cnt = torch.zeros(n_tg + n_cb * n_sup + n_cb, dtype=torch.int32, device=x.device)
    d_h = empty(h_res.shape, h_res.dtype, x.device)
    d_hp = empty(h_post.shape, h_post.dtype, x.device)
    d_b = empty(bias.shape, bias.dtype, x.device) if bias is not None else None
    args = (h_res, x, h_post, y, bias if bias is not None else y, grad_out, dx, dy, ws, ws_b, T, C,
            cnt, d_h, d_hp, d_b if d_b is not None else d_h, ws_b2, sup, *mask)
    finish = finish_args(group, bc, fma)
    if T and C and fma:
        _h_post_bda_bwd4[(n_cb, n_tg)](*args, GROUP=group, BLOCK_T=bt, BLOCK_C=bc, HAS_BIAS=bias is not None,
                                      TRANSPOSE=bool(transpose_res), STAGES=stages, THRESHOLD=thr, **finish,
                                      num_warps=warps)
    elif T and C:
        _h_post_bda_bwd4_tc[(n_cb, n_tg)](*args, GROUP=group, BLOCK_C=bc, HAS_BIAS=bias is not None,
                                         TRANSPOSE=bool(transpose_res), STAGES=stages, F32DOT=interpreted(),
                                         THRESHOLD=thr, **finish, num_warps=warps)
    else:  # sums over no channels or no tokens
        for t in (d_h, d_hp, d_b):
            if t is not None:
                t.zero_()
    return d_h, dx, d_hp, dy, d_b


# The finishing sums inside the tensor-core backward load this many partial rows at once (one
# warp; H200, paper shape, with bias: 2 / 4 / 8 / 16 rows 1.617 / 1.609 / 1.605 / 1.654 ms, 16 spills)
FINISH_ROWS = 8
# the FMA kernel's (one warp over 256 channels with dropout: 2 rows 167 registers, 4 219, 8 255)
FINISH_ROWS_FMA = 2
# ... and this many tokens at a time (the tensor-core tile's group); the FMA kernel's groups of 32
# and 64 tokens whole took 249-255 registers against its loop's 168 (sm_90, dev/sass_offline.py)
FINISH_TOKENS = 16


def finish_args(group: int, bc: int, fma: bool, rows: int | None = None) -> dict:
    """``_finish_tc``'s compile-time arguments for a backward over ``group``-token groups and
    ``bc``-channel blocks: the tokens it sums at a time, the partial rows it loads at once (``rows``,
    else the kernel's: they change no bits, the rows are added in order whatever it is, only the
    registers), whether it drops the partials from L2, and the lines to drop."""
    at_once = next_pow2(min(group, FINISH_TOKENS))
    return dict(GH=at_once * 16, GP=at_once * 4, ROWS=rows or (FINISH_ROWS_FMA if fma else FINISH_ROWS),
                DISCARD=not interpreted(), NL_H=_lines(group * 64), NL_P=_lines(group * 16), NL_B=_lines(bc * 4))


def _lines(nbytes: int) -> int:
    """A power of two at least the number of 128-byte lines that ``nbytes`` contiguous bytes touch."""
    return next_pow2(nbytes // 128 + 2)


class HPostBdaFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_res, x, h_post, y, bias, transpose_res, dropout=0.0, dropout_seed=0, dropout_offset=0):
        ctx.save_for_backward(h_res, x, h_post, y, bias)
        ctx.transpose_res = transpose_res
        ctx.mask = (dropout, dropout_seed, dropout_offset)  # the key: the backward draws the mask again
        return h_post_bda_forward(h_res, x, h_post, y, bias, transpose_res, None, *ctx.mask)

    @staticmethod
    def backward(ctx, grad_out):
        h_res, x, h_post, y, bias = ctx.saved_tensors
        grads = h_post_bda_backward(h_res, x, h_post, y, bias, grad_out, ctx.transpose_res, None, *ctx.mask)
        return (*grads, None, None, None, None)


def h_post_bda(h_res, x, h_post, y, bias=None, transpose_res: bool = False, dropout: float = 0.0,
               dropout_seed: int = 0, dropout_offset: int = 0):
    """Megatron's signature ``h_post_bda(h_res, x, h_post, y, bias)``; ``transpose_res`` and the
    dropout's probability and key by keyword (the mask is the contract's, drawn in the kernel)."""
    return HPostBdaFunction.apply(h_res, x, h_post, y, bias, transpose_res, dropout, dropout_seed, dropout_offset)
