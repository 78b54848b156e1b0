"""H_post * bias-dropout-add with the residual mixing in cuTile, forward and backward:
``out[t, i, c] = sum_j H[t, i, j] x[t, j, c] + h_post[t, i] (y[t, c] + bias[c])``, with
``H = h_res`` or ``h_res^T`` (``transpose_res``).

Every tile is two-dimensional, ``(BT, BC)``: one stream of a block of tokens over a block of C.
The n x n mixing weights are loaded as a ``(BT, NN)`` tile of h_res viewed as ``[t, n * n]`` and
split into ``(BT, 1)`` columns, so the mixing is n^2 broadcast multiply-adds of whole tiles (v1
mixed a ``(BT, NP, BC)`` tile through its middle axis: 35% / 56% of copy bandwidth on an H100).
A program owns one C block and walks a group of token blocks (Triton's n = 4 kernels are shaped
so too). In the backward, dx and dy are elementwise; the n^2 + n sums over C (grad_h_res,
grad_h_post) are reduced per token block over the program's C block and written as fp32
partials per (C block, token), the bias gradient's as one per (token group, C block); second
launches sum them in a fixed order (no atomics), so a token's gradients do not depend on the
number of tokens. (The backward used to walk all of C per token block with the n^2 + n sums as
elementwise accumulators, which capped its tile and occupancy: 55% of copy bandwidth.)
"""
from __future__ import annotations

import cuda.tile as ct
import torch

from mhctool.core.poison import empty
from mhctool.references import dropout as _dropout

from ..schedule import next_pow2
from ._common import (BR, array, cdiv, check_cuda, launch, require_contiguous, scalar, sum_partials,
                      sum_partials_pair, sum_rows, sum_rows_pair, tile_ir)

ConstInt = ct.Constant[int]
ConstBool = ct.Constant[bool]
ZERO = ct.PaddingMode.ZERO
# Both directions run a program per (C block, token group): C block cb over STEPS token blocks of BT
# tokens. Picked on an H200 at 8192x4x4x7168 bf16 in paired rounds (dev/hpb_cutile.py,
# docs/perf-notes.md twenty-third session): the forward at (1, 1024, 16), occupancy 4, 1.058 ms
# against 1.285 for one (token, C block) a program (Triton 1.034 in the same rounds); the backward
# at (4, 256, 32), occupancy 3, 1.740 ms (16 steps 1.791, a 4 x 128 tile 2.567; Triton
# 1.772). The bench, graph replay: 1.02 / 1.65 ms (95.2% of copy), against 1.24 / 2.45 before.
# STEPS_BWD token blocks are the tokens of one bias partial.
BT, BC, STEPS = 1, 1024, 16
BT_BWD, BC_BWD, STEPS_BWD = 4, 256, 32
BC_SUM = 1024  # columns per program of the bias-gradient sum


def _columns(t, count, BT):
    """The first ``count`` columns of a ``(BT, K)`` tile as a tuple of ``(BT, 1)`` tiles."""
    out = ()
    for e in ct.static_iter(range(count)):
        out = out + (ct.extract(t, (0, e), shape=(BT, 1)),)
    return out


def _weights(h_res, h_post, i, N, NN, NP, BT):
    h = ct.load(h_res, index=(i, 0), shape=(BT, NN), padding_mode=ZERO).astype(ct.float32)
    p = ct.load(h_post, index=(i, 0), shape=(BT, NP), padding_mode=ZERO).astype(ct.float32)
    return _columns(h, N * N, BT), _columns(p, N, BT)


def _hidx(r, j, N, TRANSPOSE):
    """Where H[r, j] sits in h_res viewed as [t, n * n]."""
    if TRANSPOSE:
        return j * N + r
    return r * N + j


def _streams(a, i, c, N, BT, BC):
    """Streams 0..N-1 of a ``[t, n, C]`` array at token block i, C chunk c: ``(BT, BC)`` fp32 tiles."""
    out = ()
    for j in ct.static_iter(range(N)):
        t = ct.load(a, index=(i, j, c), shape=(BT, 1, BC), padding_mode=ZERO)
        out = out + (ct.reshape(t, (BT, BC)).astype(ct.float32),)
    return out


def _store_stream(a, i, j, c, t, BT, BC):
    ct.store(a, index=(i, j, c), tile=ct.reshape(t.astype(a.dtype), (BT, 1, BC)))


def _philox(key, q):
    """Philox-4x32-10's four words at the 64-bit counters ``q`` (int64 tile) under ``key`` (the
    seed's low and high words, uint64 scalars): each 32 x 32-bit product taken whole in uint64,
    so its high and low words are exact (:mod:`mhctool.references.dropout`)."""
    q = q.astype(ct.uint64)
    c0, c1 = q & 0xFFFFFFFF, q >> 32
    c2 = c0 * 0
    c3 = c2
    k0, k1 = key
    for _ in ct.static_iter(range(10)):
        pb, pa = c2 * 0xCD9E8D57, c0 * 0xD2511F53
        c0, c1, c2, c3 = (pb >> 32) ^ c1 ^ k0, pb & 0xFFFFFFFF, (pa >> 32) ^ c3 ^ k1, pa & 0xFFFFFFFF
        k0, k1 = (k0 + 0x9E3779B9) & 0xFFFFFFFF, (k1 + 0xBB67AE85) & 0xFFFFFFFF
    return c0, c1, c2, c3


def _kept(mask, i, r, cb, N, BT, BC):
    """The contract's keep mask ``(BT, BC)`` of stream r, token block i, C block cb: a counter a
    row of four channels, ``offset + (t * N + r) * G + c // 4``, word ``c % 4`` kept where it is at
    least the threshold. ``mask``: (key, offset, counters a row G, threshold)."""
    key, offset, g_row, thr = mask
    t = ct.reshape(ct.arange(BT, dtype=ct.int64), (BT, 1)) + i * BT
    g = ct.reshape(ct.arange(BC // 4, dtype=ct.int64), (1, BC // 4)) + cb * (BC // 4)
    w0, w1, w2, w3 = _philox(key, (t * N + r) * g_row + g + offset)
    w = ct.cat((ct.cat((w0[:, :, None], w1[:, :, None]), 2), ct.cat((w2[:, :, None], w3[:, :, None]), 2)), 2)
    return ct.reshape(w, (BT, BC)) >= thr


def _mask(seed_lo, seed_hi, off_lo, off_hi, g_row, thr):
    """The kernels' dropout scalars as :func:`_kept` takes them (the words compared in uint64).
    cuTile takes a Python int as int32: each 32-bit word comes as the int32 of the same bits
    (:func:`_i32`), its low 32 bits taken back here, and the 64-bit offset as two such words."""
    lo = 0xFFFFFFFF
    key = (ct.astype(seed_lo, ct.uint64) & lo, ct.astype(seed_hi, ct.uint64) & lo)
    offset = ct.astype(off_hi, ct.int64) * 4294967296 + (ct.astype(off_lo, ct.int64) & lo)
    return key, offset, ct.astype(g_row, ct.int64), ct.astype(thr, ct.uint64) & lo


@ct.kernel(occupancy=4)
def _h_post_bda_fwd(h_res, x, h_post, y, bias, out, seed_lo, seed_hi, off_lo, off_hi, g_row, thr, scale,
                    N: ConstInt, NN: ConstInt, NP: ConstInt, BT: ConstInt,
                    BC: ConstInt, STEPS: ConstInt, HAS_BIAS: ConstBool, TRANSPOSE: ConstBool, DROPOUT: ConstBool):
    """Program (cb, tg): C block cb over ``STEPS`` token blocks of ``BT``, the bias loaded once;
    with ``DROPOUT`` the branch kept where the contract's mask keeps it, scaled by ``scale``."""
    cb, tg = ct.bid(0), ct.bid(1)
    mask = _mask(seed_lo, seed_hi, off_lo, off_hi, g_row, thr)
    scale = ct.astype(scale, ct.float32)  # however the launch typed it
    if HAS_BIAS:
        bz = ct.reshape(ct.load(bias, index=(cb,), shape=(BC,), padding_mode=ZERO).astype(ct.float32), (1, BC))
    for s in range(STEPS):
        i = tg * STEPS + s  # past the last token: zeros loaded, nothing stored
        hc, pc = _weights(h_res, h_post, i, N, NN, NP, BT)
        z = ct.load(y, index=(i, cb), shape=(BT, BC), padding_mode=ZERO).astype(ct.float32)
        if HAS_BIAS:
            z = z + bz
        xs = _streams(x, i, cb, N, BT, BC)
        for r in ct.static_iter(range(N)):
            acc = pc[r] * z
            if DROPOUT:
                acc = ct.where(_kept(mask, i, r, cb, N, BT, BC), acc * scale, 0.0)
            for j in ct.static_iter(range(N)):
                acc = acc + hc[_hidx(r, j, N, TRANSPOSE)] * xs[j]
            _store_stream(out, i, r, cb, acc, BT, BC)


def grad_streams_and_branch(hc, pc, gs, gb, dx, dy, i, c, N, BT, BC, TRANSPOSE):
    """dx and dy of token block i over C block c, stored: stream j's ``sum_r H[r, j] g_r`` and the
    branch's ``sum_r h_post[r] gb_r``, which is returned (fp32, for the bias's partial); ``gb``:
    the gradients the branch receives (``gs``, or masked and scaled under dropout)."""
    for j in ct.static_iter(range(N)):
        d = hc[_hidx(0, j, N, TRANSPOSE)] * gs[0]
        for r in ct.static_iter(range(1, N)):
            d = d + hc[_hidx(r, j, N, TRANSPOSE)] * gs[r]
        _store_stream(dx, i, j, c, d, BT, BC)
    gy = pc[0] * gb[0]
    for r in ct.static_iter(range(1, N)):
        gy = gy + pc[r] * gb[r]
    ct.store(dy, index=(i, c), tile=gy.astype(dy.dtype))
    return gy


def _assemble(vals, width, BT):
    """``(BT, 1)`` tiles -> one ``(BT, width)`` tile (column e = vals[e], the rest zero)."""
    lanes = ct.reshape(ct.arange(width, dtype=ct.int32), (1, width))
    out = ct.zeros((BT, width), dtype=ct.float32)
    for e in ct.static_iter(range(len(vals))):
        out = ct.where(lanes == e, vals[e], out)
    return out


@ct.kernel(occupancy=3)
def _h_post_bda_bwd(h_res, x, h_post, y, bias, g, dx, dy, ws_h, ws_p, ws_b, seed_lo, seed_hi, off_lo, off_hi, g_row,
                    thr, scale, N: ConstInt, NN: ConstInt, NP: ConstInt, BT: ConstInt, BC: ConstInt, STEPS: ConstInt,
                    HAS_BIAS: ConstBool, TRANSPOSE: ConstBool, DROPOUT: ConstBool):
    """Program (cb, tg): C block cb over ``STEPS`` token blocks of ``BT`` (Triton's n = 4 FMA form).
    Per token block: dx and dy written; the n^2 + n sums over the block's channels reduced at once
    and stored as this C block's partials, ``ws_h[cb, t]`` (dH where h_res keeps it) and
    ``ws_p[cb, t]`` (dh_post); the bias's partial over the program's tokens stays in registers and
    goes to ``ws_b[tg]``. No accumulator lives across C, so the tile is not bound by n^2 + n of them."""
    cb, tg = ct.bid(0), ct.bid(1)
    mask = _mask(seed_lo, seed_hi, off_lo, off_hi, g_row, thr)
    scale = ct.astype(scale, ct.float32)  # however the launch typed it
    if HAS_BIAS:
        bz = ct.reshape(ct.load(bias, index=(cb,), shape=(BC,), padding_mode=ZERO).astype(ct.float32), (1, BC))
    acc_b = ct.zeros((BT, BC), dtype=ct.float32)
    for s in range(STEPS):
        i = tg * STEPS + s  # past the last token: zeros loaded, nothing stored
        hc, pc = _weights(h_res, h_post, i, N, NN, NP, BT)
        gs = _streams(g, i, cb, N, BT, BC)
        gb = gs  # what the branch receives: the forward's mask drawn again from the same key
        if DROPOUT:
            gb = ()
            for r in ct.static_iter(range(N)):
                gb = gb + (ct.where(_kept(mask, i, r, cb, N, BT, BC), gs[r] * scale, 0.0),)
        gy = grad_streams_and_branch(hc, pc, gs, gb, dx, dy, i, cb, N, BT, BC, TRANSPOSE)
        acc_b = acc_b + gy
        xs = _streams(x, i, cb, N, BT, BC)
        z = ct.load(y, index=(i, cb), shape=(BT, BC), padding_mode=ZERO).astype(ct.float32)
        if HAS_BIAS:
            z = z + bz
        dh = ()  # column e as h_res keeps it: H[r, j] at _hidx(r, j)
        for e in ct.static_iter(range(N * N)):
            r, j = (e % N, e // N) if TRANSPOSE else (e // N, e % N)
            dh = dh + (ct.sum(gs[r] * xs[j], axis=1, keepdims=True),)
        dp = ()
        for r in ct.static_iter(range(N)):
            dp = dp + (ct.sum(gb[r] * z, axis=1, keepdims=True),)
        # (BT, NN) / (BT, NP) tiles into [cb, t, n^2] / [cb, t, n] rows: the padding columns fall outside
        ct.store(ws_h, index=(cb, i, 0), tile=ct.reshape(_assemble(dh, NN, BT), (1, BT, NN)))
        ct.store(ws_p, index=(cb, i, 0), tile=ct.reshape(_assemble(dp, NP, BT), (1, BT, NP)))
    if HAS_BIAS:
        ct.store(ws_b, index=(tg, cb), tile=ct.reshape(ct.sum(acc_b, axis=0), (1, BC)))


def _check(h_res, x, h_post, y, bias):
    check_cuda(h_res, x, h_post, y, bias)
    for name, t in (("x", x), ("y", y)):
        require_contiguous(name, t)
    if x.dim() != 4:
        raise ValueError(f"x must be [s, b, n, C], got {tuple(x.shape)}")
    s, b, n, c = x.shape
    if h_res.shape != (s, b, n, n) or h_post.shape != (s, b, n) or y.shape != (s, b, c):
        raise ValueError(f"h_res has shape {tuple(h_res.shape)}, h_post {tuple(h_post.shape)}, y {tuple(y.shape)}; "
                         f"expected {(s, b, n, n)}, {(s, b, n)}, {(s, b, c)}")
    if bias is not None and bias.shape != (c,):
        raise ValueError(f"bias must be [C] = ({c},), got {tuple(bias.shape)}")


def _i32(v: int) -> int:
    """A 32-bit word (0 <= v < 2**32) as the int32 of the same bits: cuTile types a Python int
    argument int32, and a word past 2**31 - 1 (a seed's, Megatron's offset, the threshold at p >=
    0.5) raised OverflowError at the launch (the H100, 2026-12-07)."""
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >= 1 << 31 else v


def mask_args(c: int, dropout: float = 0.0, seed: int = 0, offset: int = 0) -> tuple[tuple, bool]:
    """The kernels' dropout scalars ``(seed's low word, high word, offset's low word, high word,
    counters a row, threshold, scale)``, each word as an int32 of its bits (:func:`_i32`), for the
    contract's mask (:mod:`mhctool.references.dropout`), and whether dropout is on."""
    k = _dropout.key(c, dropout, seed, offset)
    return ((_i32(k.seed), _i32(k.seed >> 32), _i32(k.offset), _i32(k.offset >> 32), k.counters_per_row,
             _i32(k.threshold), k.scale), bool(k.threshold))


def forward(h_res, x, h_post, y, bias, transpose_res, tile=None, kernel=None, mask=((0, 0, 0, 0, 0, 0, 1.0), False)):
    """``out`` of contiguous inputs (checked by the caller). ``tile``: (BT, BC, STEPS) and
    ``kernel``: the forward kernel with other hints (``replace_hints``), for sweeps. ``mask``:
    :func:`mask_args`'s."""
    s, b, n, c = x.shape
    t = s * b
    bt, bc, steps = tile or (BT, BC, STEPS)
    out = empty(x.shape, x.dtype, x.device)
    if out.numel():
        launch(kernel or _h_post_bda_fwd, (cdiv(c, bc), cdiv(t, bt * steps)),
               (h_res.view(t, n * n), x.view(t, n, c), h_post.view(t, n), y.view(t, c),
                bias if bias is not None else y.view(-1), out.view(t, n, c), *mask[0], n, next_pow2(n * n),
                next_pow2(n), bt, bc, steps, bias is not None, bool(transpose_res), mask[1]))
    return out


def backward(h_res, x, h_post, y, bias, g, transpose_res, tile=None, kernel=None, mask=((0, 0, 0, 0, 0, 0, 1.0), False)):
    """``(dh_res, dx, dh_post, dy, dbias)`` of contiguous inputs and upstream gradient ``g``
    (``dbias`` None without a bias). ``tile``: (BT, BC, STEPS), ``kernel`` and ``mask``, as for
    ``forward`` (the forward's key: the same mask)."""
    s, b, n, c = x.shape
    t = s * b
    bt, bc, steps = tile or (BT_BWD, BC_BWD, STEPS_BWD)
    dh = empty(h_res.shape, h_res.dtype, x.device)
    dx = empty(x.shape, x.dtype, x.device)
    dp = empty(h_post.shape, h_post.dtype, x.device)
    dy = empty(y.shape, y.dtype, x.device)
    db = empty(bias.shape, bias.dtype, x.device) if bias is not None else None
    if t:
        ncb, ntg = cdiv(c, bc), cdiv(t, bt * steps)
        f32 = torch.float32
        ws_h, ws_p = empty((ncb, t, n * n), f32, x.device), empty((ncb, t, n), f32, x.device)
        ws_b = empty((ntg, c), f32, x.device) if bias is not None else dy.view(t, c)
        launch(kernel or _h_post_bda_bwd, (ncb, ntg),
               (h_res.view(t, n * n), x.view(t, n, c), h_post.view(t, n), y.view(t, c),
                bias if bias is not None else y.view(-1), g.view(t, n, c), dx.view(t, n, c), dy.view(t, c),
                ws_h, ws_p, ws_b, *mask[0], n, next_pow2(n * n), next_pow2(n), bt, bc, steps, bias is not None,
                bool(transpose_res), mask[1]))
        # the C blocks' partials in C-block order: a token's sums do not depend on the token count
        sum_partials_pair((ws_h.view(ncb, t * n * n), dh.view(-1), BC_SUM, BR),
                          (ws_p.view(ncb, t * n), dp.view(-1), BC_SUM, BR))
        if bias is not None:
            sum_partials(ws_b, db, BC_SUM)
    elif bias is not None:
        db.zero_()
    return dh, dx, dp, dy, db


class _HPostBda(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_res, x, h_post, y, bias, transpose_res, dropout=0.0, dropout_seed=0, dropout_offset=0):
        _check(h_res, x, h_post, y, bias)
        h_res, h_post = h_res.contiguous(), h_post.contiguous()
        bias = bias.contiguous() if bias is not None else None
        ctx.save_for_backward(h_res, x, h_post, y, bias)
        ctx.transpose = bool(transpose_res)
        ctx.mask = mask_args(x.shape[-1], dropout, dropout_seed, dropout_offset)  # the key, for the backward
        return forward(h_res, x, h_post, y, bias, transpose_res, mask=ctx.mask)

    @staticmethod
    def backward(ctx, g):
        return (*backward(*ctx.saved_tensors, g.contiguous(), ctx.transpose, mask=ctx.mask), None, None, None, None)


def h_post_bda(h_res, x, h_post, y, bias=None, transpose_res: bool = False, dropout: float = 0.0,
               dropout_seed: int = 0, dropout_offset: int = 0):
    """``sum_j H[i, j] x[j] + keep[i] / (1 - p) h_post[i] (y + bias)``, the mask the contract's
    (drawn in the kernel from ``dropout_seed`` and ``dropout_offset``; all kept without dropout);
    grads of all five inputs."""
    return _HPostBda.apply(h_res, x, h_post, y, bias, transpose_res, dropout, dropout_seed, dropout_offset)


def compile_checks() -> dict[str, bytes]:
    out = {}
    f32 = torch.float32
    for dtype in (torch.float32, torch.bfloat16):
        for n, has_bias, tr, drop in ((4, True, False, False), (3, False, True, False), (4, True, False, True),
                                      (3, False, True, True)):
            nn, np_ = next_pow2(n * n), next_pow2(n)
            key = f"{dtype}-{n}-{has_bias}-{tr}" + ("-dropout" if drop else "")
            # as the launch types them: a Python int is int32 (mask_args), a float float32
            mask = [scalar(ct.int32)] * 6 + [scalar(ct.float32)]
            out[f"fwd-{key}"] = tile_ir(_h_post_bda_fwd, [array(f32, 2), array(dtype, 3), array(f32, 2), array(dtype, 2),
                                                            array(dtype, 1), array(dtype, 3), *mask, n, nn, np_, BT, BC,
                                                            STEPS, has_bias, tr, drop])
            out[f"bwd-{key}"] = tile_ir(_h_post_bda_bwd, [array(f32, 2), array(dtype, 3), array(f32, 2), array(dtype, 2),
                                                            array(dtype, 1), array(dtype, 3), array(dtype, 3), array(dtype, 2),
                                                            array(f32, 3), array(f32, 3),
                                                            array(f32 if has_bias else dtype, 2), *mask, n, nn, np_,
                                                            BT_BWD, BC_BWD, STEPS_BWD, has_bias, tr, drop])
        out[f"sum-{dtype}"] = tile_ir(sum_rows, [array(f32, 2), array(dtype, 1), BR, BC_SUM])
        out[f"sum-pair-{dtype}"] = tile_ir(sum_rows_pair, [array(f32, 2), array(f32, 1), array(f32, 2), array(f32, 1),
                                                           BR, BC_SUM, BR, BC_SUM])
    return out
