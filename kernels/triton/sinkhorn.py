"""Sinkhorn-Knopp projection in Triton: forward and backward, one kernel each.

Every ``n x n`` matrix of a block of tokens lives in registers as a ``[BT, NP, NP]`` tile
(``NP`` = n rounded up to a power of two, padded entries masked to zero); the math is fp32
whatever the input dtype. The knobs (``stabilize``, ``eps_mode``, ``order``, ``iters``) are
compile-time constants. The backward keeps no per-iteration state in global memory: for each
normalisation step, from last to first, it recomputes the step's input on chip and applies that
step's vector-Jacobian product, carried as the gradient times the step's output (``_step_bwd``).
The recomputation is two-level: the pairs are cut into segments of about sqrt(pairs); each
segment's starting state is recomputed from the logits once, and each step's input from that
state, so 20 iterations recompute 70 pairs instead of 190.
"""
from __future__ import annotations

import triton
import triton.language as tl

from mhctool.core.poison import empty_like

from ..schedule import STABILIZE as _STABILIZE
from ..schedule import check_knobs, recompute_segment, sinkhorn_autograd, sinkhorn_steps
from ._common import cast, cdiv, check_device, exp, fast, next_pow2


@triton.jit
def _load_tile(ptr, t0, T, N: tl.constexpr, BT: tl.constexpr, NP: tl.constexpr):
    t = t0 + tl.arange(0, BT)[:, None, None]
    i = tl.arange(0, NP)[None, :, None]
    j = tl.arange(0, NP)[None, None, :]
    mask = (t < T) & (i < N) & (j < N)
    offs = t * (N * N) + i * N + j
    return offs, mask


@triton.jit
def _init(x, mask, eps, STAB: tl.constexpr):
    """The starting matrix p0, and the row softmax (for its backward) when STAB is softmax."""
    if STAB == 1:  # none: bare exp
        p = tl.where(mask, exp(x), 0.0)
        sm = p
    else:
        xm = tl.where(mask, x, float("-inf"))
        m = tl.max(xm, axis=2, keep_dims=True)
        m = tl.where(m == float("-inf"), 0.0, m)
        p = tl.where(mask, exp(x - m), 0.0)
        sm = p
        if STAB == 2:  # softmax + eps
            # a row of only padding sums to 0 (any valid row to at least 1); the floor is a normal
            # fp32 number: Triton types a literal below fp32's normal range (1e-38) as fp64, and
            # everything it touches became fp64 on the GPU (the interpreter keeps fp32)
            sm = p / tl.maximum(tl.sum(p, axis=2, keep_dims=True), 1e-30)
            p = tl.where(mask, sm + eps, 0.0)
    return p, sm


@triton.jit
def _denom(p, eps, AXIS: tl.constexpr, CLAMP: tl.constexpr):
    s = tl.sum(p, axis=AXIS, keep_dims=True)
    if CLAMP:
        return tl.maximum(s, eps), s
    return s + eps, s


@triton.jit
def _norm(p, eps, AXIS: tl.constexpr, CLAMP: tl.constexpr):
    # one reciprocal per row (column) and a multiply per element: a precise fp32 division per
    # element costs several times more, and the extra rounding is one ulp per step
    d, _ = _denom(p, eps, AXIS, CLAMP)
    return p * (1.0 / d)


@triton.jit
def _step_bwd(q, G, eps, AXIS: tl.constexpr, CLAMP: tl.constexpr):
    """VJP of ``y = q / d(q)`` along AXIS in log terms: with ``G = g * y`` the gradient times the
    step's output, the same product for its input is ``G - y * sum(G)`` (no sum term where
    clamped: there ``d`` is the constant eps). Every factor is at most 1: the linear form
    ``(g - sum(g * y)) / d`` multiplies by ``1 / d``, up to ``1 / eps`` a step, which overflows fp32
    within a few iterations where a line's entries underflow (logits ~100 apart)."""
    d, s = _denom(q, eps, AXIS, CLAMP)
    y = q * (1.0 / d)
    gs = tl.sum(G, axis=AXIS, keep_dims=True)
    if CLAMP:
        gs = tl.where(s >= eps, gs, 0.0)
    return G - y * gs


@triton.jit
def _pairs(p, eps, count, A: tl.constexpr, B: tl.constexpr, CLAMP: tl.constexpr):
    """``count`` normalisation pairs: along A, then along B."""
    for _ in range(count):
        p = _norm(p, eps, A, CLAMP)
        p = _norm(p, eps, B, CLAMP)
    return p


# The step sequence alternates axes for STEPS steps starting with FIRST. It runs as an optional
# lone first step (ODD: along FIRST) followed by STEPS // 2 pairs (A, B), so that every axis is a
# compile-time constant.

@fast
@triton.jit
def _sinkhorn_fwd(x_ptr, out_ptr, T, eps, N: tl.constexpr, NP: tl.constexpr, BT: tl.constexpr,
                  PAIRS: tl.constexpr, ODD: tl.constexpr, A: tl.constexpr, B: tl.constexpr,
                  STAB: tl.constexpr, CLAMP: tl.constexpr):
    t0 = tl.program_id(0) * BT
    offs, mask = _load_tile(x_ptr, t0, T, N, BT, NP)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    p, _ = _init(x, mask, eps, STAB)
    if ODD:
        p = _norm(p, eps, B, CLAMP)
    p = _pairs(p, eps, PAIRS, A, B, CLAMP)
    tl.store(out_ptr + offs, cast(p, out_ptr.dtype.element_ty), mask=mask)


@fast
@triton.jit
def _sinkhorn_bwd(x_ptr, g_ptr, dx_ptr, T, eps, N: tl.constexpr, NP: tl.constexpr,
                  BT: tl.constexpr, PAIRS: tl.constexpr, ODD: tl.constexpr, A: tl.constexpr,
                  B: tl.constexpr, STAB: tl.constexpr, CLAMP: tl.constexpr, SEG: tl.constexpr):
    t0 = tl.program_id(0) * BT
    offs, mask = _load_tile(x_ptr, t0, T, N, BT, NP)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    p0, sm = _init(x, mask, eps, STAB)
    start = p0
    if ODD:
        start = _norm(p0, eps, B, CLAMP)
    # G = g * (the output of the step being undone): the last step's output first
    if PAIRS == 0:
        g = g * start
    for seg in range(tl.cdiv(PAIRS, SEG) - 1, -1, -1):
        base = seg * SEG
        c = _pairs(start, eps, base, A, B, CLAMP)  # the state before pair `base`
        for k in range(tl.minimum(base + SEG, PAIRS) - base - 1, -1, -1):
            q = _pairs(c, eps, k, A, B, CLAMP)  # input of pair base + k: the same operations as
            q2 = _norm(q, eps, A, CLAMP)        # the forward's, so the same fp32 values
            if base + k == PAIRS - 1:
                g = g * _norm(q2, eps, B, CLAMP)
            g = _step_bwd(q2, g, eps, B, CLAMP)
            g = _step_bwd(q, g, eps, A, CLAMP)
    if ODD:
        g = _step_bwd(p0, g, eps, B, CLAMP)
    # g is now the gradient times p0
    if STAB == 1:
        dx = g
    elif STAB == 0:
        # p0 = exp(x - max): the max receives minus the row sum of g * p0, split over ties
        xm = tl.where(mask, x, float("-inf"))
        m = tl.max(xm, axis=2, keep_dims=True)
        is_max = (xm == m) & mask
        ties = tl.maximum(tl.sum(is_max.to(tl.float32), axis=2, keep_dims=True), 1.0)
        dx = g - tl.where(is_max, tl.sum(g, axis=2, keep_dims=True) / ties, 0.0)
    else:
        # p0 = softmax + eps: the gradient at p0 times the softmax is g * sm / p0 (at most g)
        w = g * tl.where(p0 > 0.0, sm / tl.where(p0 > 0.0, p0, 1.0), 0.0)
        dx = w - sm * tl.sum(w, axis=2, keep_dims=True)
    tl.store(dx_ptr + offs, cast(dx, dx_ptr.dtype.element_ty), mask=mask)


def tiles(n: int) -> list[tuple[int, int]]:
    """The (tokens per program, warps) tiles the kernels can run with, for the sweep."""
    np2 = next_pow2(n) ** 2
    first = (max(1, min(64, 1024 // np2)), 4)
    return [first] + [(bt, w) for bt in (16, 32, 64, 128, 256) for w in (1, 2, 4, 8)
                      if (bt, w) != first and bt * np2 >= 32 * w]


def tile(n: int) -> tuple[int, int]:
    """The tile every launch uses: a function of n alone, never of the number of tokens. Triton
    orders a reduction over a tile's axis by the tile's layout, so a tile chosen per token count
    (timed, as it was) gave a token other bits at another batch size; and a tile chosen by timing
    can differ between two processes. From the sweep in docs/perf-notes.md (H100, n = 4): 64
    tokens on 2 warps, one matrix per thread, was the fastest in both directions; larger n keep
    the tile of about 1024 elements on 4 warps (not swept)."""
    return (64, 2) if next_pow2(n) <= 4 else tiles(n)[0]


def _launch(kernel, x, extra, iters, eps, stabilize, eps_mode, order, tile_=None):
    n = x.shape[-1]
    if x.shape[-2] != n:
        raise ValueError(f"sinkhorn needs square matrices in the last two dims, got {tuple(x.shape)}")
    check_knobs(stabilize, eps_mode, order, iters)
    check_device(x, *extra)
    x = x.contiguous()
    T = x.numel() // (n * n)
    cfg = sinkhorn_steps(n, stabilize, order, int(iters))
    out = empty_like(x)
    args = [x, *[e.contiguous() for e in extra], out]
    if kernel is _sinkhorn_bwd:
        cfg["SEG"] = recompute_segment(cfg["PAIRS"])
    if T:
        bt, warps = tile_ or tile(n)
        kernel[(cdiv(T, bt),)](*args, T, float(eps), N=n, STAB=_STABILIZE[stabilize],
                               CLAMP=eps_mode == "clamp", num_warps=warps, BT=bt, **cfg)
    return out


def sinkhorn_forward(logits, iters=20, eps=1e-6, stabilize="rowmax", eps_mode="add", order="row_first"):
    return _launch(_sinkhorn_fwd, logits, [], iters, eps, stabilize, eps_mode, order)


def sinkhorn_backward(logits, grad_out, iters=20, eps=1e-6, stabilize="rowmax", eps_mode="add",
                      order="row_first"):
    return _launch(_sinkhorn_bwd, logits, [grad_out.to(logits.dtype) if grad_out.dtype != logits.dtype else grad_out],
                   iters, eps, stabilize, eps_mode, order)


sinkhorn = sinkhorn_autograd(sinkhorn_forward, sinkhorn_backward)
