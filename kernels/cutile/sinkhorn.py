"""Sinkhorn-Knopp projection in cuTile: forward and backward, one kernel each.

The same schedule and math as the Triton kernels (``kernels/schedule.py``): every ``n x n`` matrix
of a block of ``BT`` tokens is a ``(BT, NP, NP)`` tile (NP = n rounded up to a power of two; the
load pads with -inf, so padded entries exponentiate to zero, and a mask keeps them there); fp32
math whatever the input dtype; knobs are compile-time constants; the backward recomputes each
step's input on chip, two-level (segments of about sqrt(pairs) pairs), with no per-iteration state
in global memory.
"""
from __future__ import annotations

import cuda.tile as ct
import torch

from mhctool.poison import empty_like

from ..schedule import STABILIZE, check_knobs, recompute_segment, sinkhorn_autograd, sinkhorn_steps
from ._common import array, cdiv, check_cuda, launch, tile_ir

ConstInt = ct.Constant[int]
ConstFloat = ct.Constant[float]
ConstBool = ct.Constant[bool]


def _denom(p, eps, axis, clamp):
    s = ct.sum(p, axis=axis, keepdims=True)
    if clamp:
        return ct.maximum(s, eps), s
    return s + eps, s


def _norm(p, eps, axis, clamp):
    d, _ = _denom(p, eps, axis, clamp)
    return p * (1.0 / d)


def _norm_bwd(q, g, eps, axis, clamp):
    """VJP of ``y = q / d(q)`` along axis: ``(g - sum(g * y)) / d`` (no sum term where clamped)."""
    d, s = _denom(q, eps, axis, clamp)
    inv = 1.0 / d
    gy = ct.sum(g * (q * inv), axis=axis, keepdims=True)
    if clamp:
        gy = ct.where(s >= eps, gy, 0.0)
    return (g - gy) * inv


def _pairs(p, eps, count, a, b, clamp):
    for _ in range(count):
        p = _norm(p, eps, a, clamp)
        p = _norm(p, eps, b, clamp)
    return p


def _valid(N, NP):
    ii = ct.arange(NP, dtype=ct.int32)
    return ct.reshape(ii < N, (1, NP, 1)) & ct.reshape(ii < N, (1, 1, NP))


def _rowmax(x):
    m = ct.max(x, axis=2, keepdims=True)
    return ct.where(m == float("-inf"), 0.0, m)  # a padded row: all -inf


def _init(x, valid, eps, stab):
    """The starting matrix p0 and the row softmax (for its backward)."""
    if stab == 1:  # none: bare exp
        p = ct.where(valid, ct.exp(x), 0.0)
        return p, p
    p = ct.where(valid, ct.exp(x - _rowmax(x)), 0.0)
    if stab == 2:  # softmax + eps
        sm = p / ct.maximum(ct.sum(p, axis=2, keepdims=True), 1e-38)
        return ct.where(valid, sm + eps, 0.0), sm
    return p, p


@ct.kernel
def _sinkhorn_fwd(logits, out, eps: ConstFloat, N: ConstInt, NP: ConstInt, BT: ConstInt, PAIRS: ConstInt,
                  ODD: ConstBool, A: ConstInt, B: ConstInt, STAB: ConstInt, CLAMP: ConstBool):
    i = ct.bid(0)
    x = ct.load(logits, index=(i, 0, 0), shape=(BT, NP, NP), padding_mode=ct.PaddingMode.NEG_INF)
    x = x.astype(ct.float32)
    p, _ = _init(x, _valid(N, NP), eps, STAB)
    if ODD:
        p = _norm(p, eps, B, CLAMP)
    p = _pairs(p, eps, PAIRS, A, B, CLAMP)
    ct.store(out, index=(i, 0, 0), tile=p.astype(out.dtype))


@ct.kernel
def _sinkhorn_bwd(logits, grad_out, grad_in, eps: ConstFloat, N: ConstInt, NP: ConstInt, BT: ConstInt,
                  PAIRS: ConstInt, ODD: ConstBool, A: ConstInt, B: ConstInt, STAB: ConstInt, CLAMP: ConstBool,
                  SEG: ConstInt):
    i = ct.bid(0)
    x = ct.load(logits, index=(i, 0, 0), shape=(BT, NP, NP), padding_mode=ct.PaddingMode.NEG_INF)
    x = x.astype(ct.float32)
    g = ct.load(grad_out, index=(i, 0, 0), shape=(BT, NP, NP), padding_mode=ct.PaddingMode.ZERO)
    g = g.astype(ct.float32)
    valid = _valid(N, NP)
    p0, sm = _init(x, valid, eps, STAB)
    start = p0
    if ODD:
        start = _norm(p0, eps, B, CLAMP)
    nseg = (PAIRS + SEG - 1) // SEG
    for r in range(nseg):
        base = (nseg - 1 - r) * SEG
        c = _pairs(start, eps, base, A, B, CLAMP)  # the state before pair `base`
        count = min(base + SEG, PAIRS) - base
        for kk in range(count):
            q = _pairs(c, eps, count - 1 - kk, A, B, CLAMP)  # input of pair base + k
            q2 = _norm(q, eps, A, CLAMP)
            g = _norm_bwd(q2, g, eps, B, CLAMP)
            # padded entries (n not a power of two) get (0 - sum) / eps per step: keep them zero
            # before they overflow and turn the next step's sums into inf * 0 = NaN
            g = ct.where(valid, _norm_bwd(q, g, eps, A, CLAMP), 0.0)
    if ODD:
        g = ct.where(valid, _norm_bwd(p0, g, eps, B, CLAMP), 0.0)
    if STAB == 1:
        dx = g * p0
    elif STAB == 0:
        # p0 = exp(x - max): the max receives minus the row sum of g * p0, split over ties
        gp = g * p0
        is_max = (x == _rowmax(x)) & valid
        ties = ct.maximum(ct.sum(ct.where(is_max, 1.0, 0.0), axis=2, keepdims=True), 1.0)
        dx = gp - ct.where(is_max, ct.sum(gp, axis=2, keepdims=True) / ties, 0.0)
    else:
        dx = sm * (g - ct.sum(g * sm, axis=2, keepdims=True))
    ct.store(grad_in, index=(i, 0, 0), tile=dx.astype(grad_in.dtype))


def _config(n: int, stabilize: str, order: str, iters: int) -> dict:
    cfg = sinkhorn_steps(n, stabilize, order, iters)
    cfg["BT"] = max(1, 2048 // (cfg["NP"] ** 2))
    return cfg


def _constants(x, iters, eps, stabilize, eps_mode, order) -> tuple:
    n = x.shape[-1]
    cfg = _config(n, stabilize, order, int(iters))
    return (float(eps), n, cfg["NP"], cfg["BT"], cfg["PAIRS"], cfg["ODD"], cfg["A"], cfg["B"],
            STABILIZE[stabilize], eps_mode == "clamp")


def _check(x, iters, stabilize, eps_mode, order):
    n = x.shape[-1]
    if x.dim() < 2 or x.shape[-2] != n:
        raise ValueError(f"sinkhorn needs square matrices in the last two dims, got {tuple(x.shape)}")
    check_knobs(stabilize, eps_mode, order, iters)
    check_cuda(x)


def sinkhorn_forward(logits, iters=20, eps=1e-6, stabilize="rowmax", eps_mode="add", order="row_first"):
    _check(logits, iters, stabilize, eps_mode, order)
    n = logits.shape[-1]
    x = logits.contiguous()
    out = empty_like(x)
    t = x.numel() // (n * n)
    consts = _constants(x, iters, eps, stabilize, eps_mode, order)
    if t:
        launch(_sinkhorn_fwd, (cdiv(t, consts[3]),), (x.view(t, n, n), out.view(t, n, n), *consts))
    return out


def sinkhorn_backward(logits, grad_out, iters=20, eps=1e-6, stabilize="rowmax", eps_mode="add", order="row_first"):
    _check(logits, iters, stabilize, eps_mode, order)
    n = logits.shape[-1]
    x = logits.contiguous()
    g = grad_out.to(x.dtype).contiguous()
    dx = empty_like(x)
    t = x.numel() // (n * n)
    consts = _constants(x, iters, eps, stabilize, eps_mode, order)
    if t:
        launch(_sinkhorn_bwd, (cdiv(t, consts[3]),),
               (x.view(t, n, n), g.view(t, n, n), dx.view(t, n, n), *consts, recompute_segment(consts[4])))
    return dx


sinkhorn = sinkhorn_autograd(sinkhorn_forward, sinkhorn_backward)


def compile_checks() -> dict[str, bytes]:
    """Tile IR for representative signatures (n = 4 and 3, every knob), compiled on the host."""
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        a = array(dtype, 3)
        for n, stab, mode, order, iters in ((4, "rowmax", "add", "row_first", 20), (3, "softmax", "clamp", "row_first", 3),
                                            (8, "none", "add", "col_first", 2)):
            c = list(_constants(torch.empty(1, n, n), iters, 1e-6, stab, mode, order))
            key = f"{dtype}-{n}-{stab}-{mode}-{order}"
            out[f"fwd-{key}"] = tile_ir(_sinkhorn_fwd, [a, a, *c])
            out[f"bwd-{key}"] = tile_ir(_sinkhorn_bwd, [a, a, a, *c, recompute_segment(c[4])])
    return out
