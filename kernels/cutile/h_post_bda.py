"""H_post * bias-dropout-add with the residual mixing in cuTile, forward and backward:
``out[t, i, c] = sum_j H[t, i, j] x[t, j, c] + h_post[t, i] (y[t, c] + bias[c])``, with
``H = h_res`` or ``h_res^T`` (``transpose_res``).

Every tile is two-dimensional, ``(BT, BC)``: one stream of a block of tokens over a chunk of C.
The n x n mixing weights are loaded once per program as a ``(BT, NN)`` tile of h_res viewed as
``[t, n * n]`` and split into ``(BT, 1)`` columns, so the mixing is n^2 broadcast multiply-adds of
whole tiles (v1 mixed a ``(BT, NP, BC)`` tile through its middle axis: 35% / 56% of copy
bandwidth on an H100). The forward walks CB chunks of C per program; the backward walks all of
C per token block, accumulating grad_h_res and grad_h_post elementwise in fp32 and reducing over
C once at the end. The bias gradient (a reduction over tokens) is written as fp32 partials per
token block and summed by a second kernel, in a fixed order (no atomics).
"""
from __future__ import annotations

import cuda.tile as ct
import torch

from mhctool.poison import empty

from ..schedule import next_pow2
from ._common import BR, array, cdiv, check_cuda, launch, require_contiguous, sum_partials, sum_rows, tile_ir

ConstInt = ct.Constant[int]
ConstBool = ct.Constant[bool]
ZERO = ct.PaddingMode.ZERO
# tiles and occupancy picked on an H200 at 8192x4x4x7168 bf16 (docs/perf-notes.md has the sweep)
BT, BC, CB = 1, 1024, 1  # forward tile and C chunks per program
BT_BWD, BC_BWD = 16, 64  # backward tile
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


def _branch(y, bias, i, c, BT, BC, HAS_BIAS):
    z = ct.load(y, index=(i, c), shape=(BT, BC), padding_mode=ZERO).astype(ct.float32)
    if HAS_BIAS:
        z = z + ct.reshape(ct.load(bias, index=(c,), shape=(BC,), padding_mode=ZERO).astype(ct.float32), (1, BC))
    return z


def _store_stream(a, i, j, c, t, BT, BC):
    ct.store(a, index=(i, j, c), tile=ct.reshape(t.astype(a.dtype), (BT, 1, BC)))


@ct.kernel(occupancy=8)
def _h_post_bda_fwd(h_res, x, h_post, y, bias, out, N: ConstInt, NN: ConstInt, NP: ConstInt, BT: ConstInt,
                    BC: ConstInt, CB: ConstInt, HAS_BIAS: ConstBool, TRANSPOSE: ConstBool):
    i, cb = ct.bid(0), ct.bid(1)
    hc, pc = _weights(h_res, h_post, i, N, NN, NP, BT)
    for k in range(CB):  # chunks past the end of C load zeros and store nothing
        c = cb * CB + k
        z = _branch(y, bias, i, c, BT, BC, HAS_BIAS)
        xs = _streams(x, i, c, N, BT, BC)
        for r in ct.static_iter(range(N)):
            acc = pc[r] * z
            for j in ct.static_iter(range(N)):
                acc = acc + hc[_hidx(r, j, N, TRANSPOSE)] * xs[j]
            _store_stream(out, i, r, c, acc, BT, BC)


def _assemble(vals, width, BT):
    """``(BT, 1)`` tiles -> one ``(BT, width)`` tile (column e = vals[e], the rest zero)."""
    lanes = ct.reshape(ct.arange(width, dtype=ct.int32), (1, width))
    out = ct.zeros((BT, width), dtype=ct.float32)
    for e in ct.static_iter(range(len(vals))):
        out = ct.where(lanes == e, vals[e], out)
    return out


@ct.kernel(occupancy=2)
def _h_post_bda_bwd(h_res, x, h_post, y, bias, g, dh_res, dx, dh_post, dy, ws, N: ConstInt, NN: ConstInt,
                    NP: ConstInt, BT: ConstInt, BC: ConstInt, HAS_BIAS: ConstBool, TRANSPOSE: ConstBool):
    i = ct.bid(0)
    hc, pc = _weights(h_res, h_post, i, N, NN, NP, BT)
    acc_h = ()  # acc_h[r * N + j] = sum over C of g_r * x_j, elementwise until the end
    for e in ct.static_iter(range(N * N)):
        acc_h = acc_h + (ct.zeros((BT, BC), dtype=ct.float32),)
    acc_p = ()
    for r in ct.static_iter(range(N)):
        acc_p = acc_p + (ct.zeros((BT, BC), dtype=ct.float32),)
    for c in range(ct.num_tiles(y, axis=1, shape=(BT, BC))):
        gs = _streams(g, i, c, N, BT, BC)
        xs = _streams(x, i, c, N, BT, BC)
        z = _branch(y, bias, i, c, BT, BC, HAS_BIAS)
        for j in ct.static_iter(range(N)):
            d = hc[_hidx(0, j, N, TRANSPOSE)] * gs[0]
            for r in ct.static_iter(range(1, N)):
                d = d + hc[_hidx(r, j, N, TRANSPOSE)] * gs[r]
            _store_stream(dx, i, j, c, d, BT, BC)
        gy = pc[0] * gs[0]
        for r in ct.static_iter(range(1, N)):
            gy = gy + pc[r] * gs[r]
        ct.store(dy, index=(i, c), tile=gy.astype(dy.dtype))
        if HAS_BIAS:
            ct.store(ws, index=(i, c), tile=ct.reshape(ct.sum(gy, axis=0), (1, BC)))
        new_h = ()
        for e in ct.static_iter(range(N * N)):
            new_h = new_h + (acc_h[e] + gs[e // N] * xs[e % N],)
        acc_h = new_h
        new_p = ()
        for r in ct.static_iter(range(N)):
            new_p = new_p + (acc_p[r] + gs[r] * z,)
        acc_p = new_p
    dh = ()  # column _hidx(r, j) of dh_res holds sum_c g_r x_j
    for e in ct.static_iter(range(N * N)):
        dh = dh + (ct.sum(acc_h[_hidx(e // N, e % N, N, TRANSPOSE)], axis=1, keepdims=True),)
    ct.store(dh_res, index=(i, 0), tile=_assemble(dh, NN, BT).astype(dh_res.dtype))
    dp = ()
    for r in ct.static_iter(range(N)):
        dp = dp + (ct.sum(acc_p[r], axis=1, keepdims=True),)
    ct.store(dh_post, index=(i, 0), tile=_assemble(dp, NP, BT).astype(dh_post.dtype))


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


class _HPostBda(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_res, x, h_post, y, bias, transpose_res):
        _check(h_res, x, h_post, y, bias)
        s, b, n, c = x.shape
        t = s * b
        h_res, h_post = h_res.contiguous(), h_post.contiguous()
        bias_c = bias.contiguous() if bias is not None else None
        out = empty(x.shape, x.dtype, x.device)
        if out.numel():
            launch(_h_post_bda_fwd, (cdiv(t, BT), cdiv(cdiv(c, BC), CB)),
                   (h_res.view(t, n * n), x.view(t, n, c), h_post.view(t, n), y.view(t, c),
                    bias_c if bias_c is not None else y.view(-1), out.view(t, n, c), n, next_pow2(n * n),
                    next_pow2(n), BT, BC, CB, bias is not None, bool(transpose_res)))
        ctx.save_for_backward(h_res, x, h_post, y, bias_c)
        ctx.transpose = bool(transpose_res)
        return out

    @staticmethod
    def backward(ctx, g):
        h_res, x, h_post, y, bias = ctx.saved_tensors
        s, b, n, c = x.shape
        t = s * b
        g = g.contiguous()
        dh = empty(h_res.shape, h_res.dtype, x.device)
        dx = empty(x.shape, x.dtype, x.device)
        dp = empty(h_post.shape, h_post.dtype, x.device)
        dy = empty(y.shape, y.dtype, x.device)
        nb = cdiv(t, BT_BWD)
        ws = empty((nb, c), torch.float32, x.device) if bias is not None else dy.view(t, c)
        if t:
            launch(_h_post_bda_bwd, (nb,),
                   (h_res.view(t, n * n), x.view(t, n, c), h_post.view(t, n), y.view(t, c),
                    bias if bias is not None else y.view(-1), g.view(t, n, c), dh.view(t, n * n), dx.view(t, n, c),
                    dp.view(t, n), dy.view(t, c), ws, n, next_pow2(n * n), next_pow2(n), BT_BWD, BC_BWD,
                    bias is not None, ctx.transpose))
        db = None
        if bias is not None:
            db = empty(bias.shape, bias.dtype, x.device)
            sum_partials(ws, db, BC_SUM)
        return dh, dx, dp, dy, db, None


def h_post_bda(h_res, x, h_post, y, bias=None, transpose_res: bool = False):
    """``sum_j H[i, j] x[j] + h_post[i] (y + bias)``; grads of all five inputs."""
    return _HPostBda.apply(h_res, x, h_post, y, bias, transpose_res)


def compile_checks() -> dict[str, bytes]:
    out = {}
    f32 = torch.float32
    for dtype in (torch.float32, torch.bfloat16):
        for n, has_bias, tr in ((4, True, False), (3, False, True)):
            nn, np_ = next_pow2(n * n), next_pow2(n)
            key = f"{dtype}-{n}-{has_bias}-{tr}"
            out[f"fwd-{key}"] = tile_ir(_h_post_bda_fwd, [array(f32, 2), array(dtype, 3), array(f32, 2), array(dtype, 2),
                                                            array(dtype, 1), array(dtype, 3), n, nn, np_, BT, BC, CB,
                                                            has_bias, tr])
            out[f"bwd-{key}"] = tile_ir(_h_post_bda_bwd, [array(f32, 2), array(dtype, 3), array(f32, 2), array(dtype, 2),
                                                            array(dtype, 1), array(dtype, 3), array(f32, 2), array(dtype, 3),
                                                            array(f32, 2), array(dtype, 2), array(f32, 2), n, nn, np_,
                                                            BT_BWD, BC_BWD, has_bias, tr])
        out[f"sum-{dtype}"] = tile_ir(sum_rows, [array(f32, 2), array(dtype, 1), BR, BC_SUM])
    return out
