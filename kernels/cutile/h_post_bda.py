"""H_post * bias-dropout-add with the residual mixing in cuTile, forward and backward:
``out[t, i, c] = sum_j H[t, i, j] x[t, j, c] + h_post[t, i] (y[t, c] + bias[c])``, with
``H = h_res`` or ``h_res^T`` (``transpose_res``).

Tiles: x and the output ``(BT, NP, BC)``, h_res ``(BT, NP, NP)`` and h_post ``(BT, NP)`` in fp32,
y ``(BT, BC)``; the mixing adds one stream at a time (v1 broadcast a ``(BT, NP, NP, BC)`` product
and summed it: 6% of copy bandwidth on an H100). The backward is one program per token block walking C: grad_x and grad_y chunk by
chunk, grad_h_res and grad_h_post reduced over C in fp32 on chip; the bias gradient (a reduction
over tokens) is written as fp32 partials per token block and summed by a second kernel, in a
fixed order (no atomics).
"""
from __future__ import annotations

import cuda.tile as ct
import torch

from mhctool.poison import empty

from ..schedule import next_pow2
from ._common import array, cdiv, check_cuda, launch, require_contiguous, tile_ir

ConstInt = ct.Constant[int]
ConstBool = ct.Constant[bool]
ZERO = ct.PaddingMode.ZERO
BT, BC = 8, 256
BR = 32  # rows per step of the partial-sum reduction


def _mix(h, xt, N, NP, BT, BC):
    """``sum_j h[t, i, j] xt[t, j, c]`` -> ``(BT, NP, BC)``, one stream j at a time."""
    acc = ct.zeros((BT, NP, BC), dtype=ct.float32)
    for j in ct.static_iter(range(N)):
        acc = acc + ct.extract(h, (0, 0, j), shape=(BT, NP, 1)) * ct.extract(xt, (0, j, 0), shape=(BT, 1, BC))
    return acc


def _load_h(h_res, i, NP, BT, TRANSPOSE):
    h = ct.load(h_res, index=(i, 0, 0), shape=(BT, NP, NP), padding_mode=ZERO).astype(ct.float32)
    if TRANSPOSE:
        h = ct.permute(h, (0, 2, 1))
    return h


@ct.kernel
def _h_post_bda_fwd(h_res, x, h_post, y, bias, out, N: ConstInt, NP: ConstInt, BT: ConstInt, BC: ConstInt,
                    HAS_BIAS: ConstBool, TRANSPOSE: ConstBool):
    i, c = ct.bid(0), ct.bid(1)
    h = _load_h(h_res, i, NP, BT, TRANSPOSE)
    xt = ct.load(x, index=(i, 0, c), shape=(BT, NP, BC), padding_mode=ZERO).astype(ct.float32)
    hp = ct.load(h_post, index=(i, 0), shape=(BT, NP), padding_mode=ZERO).astype(ct.float32)
    z = ct.load(y, index=(i, c), shape=(BT, BC), padding_mode=ZERO).astype(ct.float32)
    if HAS_BIAS:
        z = z + ct.reshape(ct.load(bias, index=(c,), shape=(BC,), padding_mode=ZERO).astype(ct.float32), (1, BC))
    o = _mix(h, xt, N, NP, BT, BC) + ct.reshape(hp, (BT, NP, 1)) * ct.reshape(z, (BT, 1, BC))
    ct.store(out, index=(i, 0, c), tile=o.astype(out.dtype))


@ct.kernel
def _h_post_bda_bwd(h_res, x, h_post, y, bias, g, dh_res, dx, dh_post, dy, ws, N: ConstInt, NP: ConstInt,
                    BT: ConstInt, BC: ConstInt, HAS_BIAS: ConstBool, TRANSPOSE: ConstBool):
    i = ct.bid(0)
    h = _load_h(h_res, i, NP, BT, TRANSPOSE)
    ht = ct.permute(h, (0, 2, 1))
    hp = ct.reshape(ct.load(h_post, index=(i, 0), shape=(BT, NP), padding_mode=ZERO).astype(ct.float32), (BT, NP, 1))
    lanes = ct.reshape(ct.arange(NP, dtype=ct.int32), (1, 1, NP))  # grad_h_res is built column by column
    acc_h = ct.zeros((BT, NP, NP), dtype=ct.float32)
    acc_p = ct.zeros((BT, NP), dtype=ct.float32)
    for c in range(ct.num_tiles(y, axis=1, shape=(BT, BC))):
        gt = ct.load(g, index=(i, 0, c), shape=(BT, NP, BC), padding_mode=ZERO).astype(ct.float32)
        xt = ct.load(x, index=(i, 0, c), shape=(BT, NP, BC), padding_mode=ZERO).astype(ct.float32)
        z = ct.load(y, index=(i, c), shape=(BT, BC), padding_mode=ZERO).astype(ct.float32)
        if HAS_BIAS:
            z = z + ct.reshape(ct.load(bias, index=(c,), shape=(BC,), padding_mode=ZERO).astype(ct.float32), (1, BC))
        ct.store(dx, index=(i, 0, c), tile=_mix(ht, gt, N, NP, BT, BC).astype(dx.dtype))
        gy = ct.zeros((BT, 1, BC), dtype=ct.float32)
        for s in ct.static_iter(range(N)):
            gy = gy + ct.extract(hp, (0, s, 0), shape=(BT, 1, 1)) * ct.extract(gt, (0, s, 0), shape=(BT, 1, BC))
            col = ct.sum(gt * ct.extract(xt, (0, s, 0), shape=(BT, 1, BC)), axis=2, keepdims=True)  # (BT, NP, 1)
            acc_h = acc_h + ct.where(lanes == s, col, 0.0)
        gy2 = ct.reshape(gy, (BT, BC))
        ct.store(dy, index=(i, c), tile=gy2.astype(dy.dtype))
        if HAS_BIAS:
            ct.store(ws, index=(i, c), tile=ct.reshape(ct.sum(gy2, axis=0), (1, BC)))
        acc_p = acc_p + ct.sum(gt * ct.reshape(z, (BT, 1, BC)), axis=2)
    if TRANSPOSE:
        acc_h = ct.permute(acc_h, (0, 2, 1))
    ct.store(dh_res, index=(i, 0, 0), tile=acc_h.astype(dh_res.dtype))
    ct.store(dh_post, index=(i, 0), tile=acc_p.astype(dh_post.dtype))


@ct.kernel
def _sum_rows(ws, out, BR: ConstInt, BC: ConstInt):
    """``out[c] = sum_r ws[r, c]`` in a fixed order (fp32 partials -> out dtype)."""
    c = ct.bid(0)
    acc = ct.zeros((BC,), dtype=ct.float32)
    for r in range(ct.num_tiles(ws, axis=0, shape=(BR, BC))):
        acc = acc + ct.sum(ct.load(ws, index=(r, c), shape=(BR, BC), padding_mode=ZERO), axis=0)
    ct.store(out, index=(c,), tile=acc.astype(out.dtype))


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
        if t and c:
            launch(_h_post_bda_fwd, (cdiv(t, BT), cdiv(c, BC)),
                   (h_res.view(t, n, n), x.view(t, n, c), h_post.view(t, n), y.view(t, c),
                    bias_c if bias_c is not None else y.view(-1), out.view(t, n, c), n, next_pow2(n), BT, BC,
                    bias is not None, bool(transpose_res)))
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
        nb = cdiv(t, BT)
        ws = empty((nb, c), torch.float32, x.device) if bias is not None else dy.view(t, c)
        if t:
            launch(_h_post_bda_bwd, (nb,),
                   (h_res.view(t, n, n), x.view(t, n, c), h_post.view(t, n), y.view(t, c),
                    bias if bias is not None else y.view(-1), g.view(t, n, c), dh.view(t, n, n), dx.view(t, n, c),
                    dp.view(t, n), dy.view(t, c), ws, n, next_pow2(n), BT, BC, bias is not None, ctx.transpose))
        db = None
        if bias is not None:
            db = empty(bias.shape, bias.dtype, x.device)
            launch(_sum_rows, (cdiv(c, BC),), (ws, db, BR, BC))
        return dh, dx, dp, dy, db, None


def h_post_bda(h_res, x, h_post, y, bias=None, transpose_res: bool = False):
    """``sum_j H[i, j] x[j] + h_post[i] (y + bias)``; grads of all five inputs."""
    return _HPostBda.apply(h_res, x, h_post, y, bias, transpose_res)


def compile_checks() -> dict[str, bytes]:
    out = {}
    f32 = torch.float32
    for dtype in (torch.float32, torch.bfloat16):
        for n, has_bias, tr in ((4, True, False), (3, False, True)):
            np_ = next_pow2(n)
            key = f"{dtype}-{n}-{has_bias}-{tr}"
            out[f"fwd-{key}"] = tile_ir(_h_post_bda_fwd, [array(f32, 3), array(dtype, 3), array(f32, 2), array(dtype, 2),
                                                            array(dtype, 1), array(dtype, 3), n, np_, BT, BC, has_bias, tr])
            out[f"bwd-{key}"] = tile_ir(_h_post_bda_bwd, [array(f32, 3), array(dtype, 3), array(f32, 2), array(dtype, 2),
                                                            array(dtype, 1), array(dtype, 3), array(f32, 3), array(dtype, 3),
                                                            array(f32, 2), array(dtype, 2), array(f32, 2), n, np_, BT, BC,
                                                            has_bias, tr])
        out[f"sum-{dtype}"] = tile_ir(_sum_rows, [array(f32, 2), array(dtype, 1), BR, BC])
    return out
