"""Sinkhorn-Knopp projection in cuTile: forward and backward, two paths of one kernel pair each.

The same schedule and math as the Triton kernels (``kernels/schedule.py``): fp32 math whatever
the input dtype, knobs as compile-time constants, a backward that recomputes each step's input on
chip, two-level (segments of about sqrt(pairs) pairs), with no per-iteration state in global
memory, and carries the gradient times each step's output (bounded where a line underflows).

- Per-token path (n <= ``EL_MAX_N`` = 4, mHC's case): a matrix is a tuple of n^2 ``(BT,)`` tiles,
  one entry across BT tokens, so row and column sums are adds of whole tiles and nothing is
  reduced across lanes. Its reciprocals are ``div.full`` ones, as Triton's (``RECIP``); the forward
  loads and stores a block as one ``(BT, NP, NP)`` tile, the backward gathers (``FWD_TILE_IO``, ``BWD_TILE_IO``):
  5.5 us / 21.5 us (fwd / bwd, graph replay) at 32768 tokens on an H200, from 15 / 35.
- Tile path (any n): every matrix of a block of BT tokens is a ``(BT, NP, NP)`` tile (NP = n
  rounded up to a power of two; the load pads with -inf, so padded entries exponentiate to zero,
  and a mask keeps them there). 52 us / 230 us at n = 4 on an H100: the reductions over the small
  middle axes cost what the per-token path avoids.
"""
from __future__ import annotations

import cuda.tile as ct
import torch

from mhctool.core.poison import empty_like

from ..schedule import STABILIZE, check_knobs, next_pow2, recompute_segment, sinkhorn_autograd, sinkhorn_steps
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


def _step_bwd(q, G, eps, axis, clamp):
    """VJP of ``y = q / d(q)`` along axis, carried as the gradient times the step's output:
    ``G - y * sum(G)`` (no sum term where clamped), as the Triton kernel's ``_step_bwd``."""
    d, s = _denom(q, eps, axis, clamp)
    gs = ct.sum(G, axis=axis, keepdims=True)
    if clamp:
        gs = ct.where(s >= eps, gs, 0.0)
    return G - (q * (1.0 / d)) * gs


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
    # G = g * (the output of the step being undone): the last step's output first
    if PAIRS == 0:
        g = g * start
    nseg = (PAIRS + SEG - 1) // SEG
    for r in range(nseg):
        base = (nseg - 1 - r) * SEG
        c = _pairs(start, eps, base, A, B, CLAMP)  # the state before pair `base`
        count = min(base + SEG, PAIRS) - base
        for kk in range(count):
            q = _pairs(c, eps, count - 1 - kk, A, B, CLAMP)  # input of pair base + k
            q2 = _norm(q, eps, A, CLAMP)
            last = (r == 0) & (kk == 0)
            g = ct.where(last, g * _norm(q2, eps, B, CLAMP), g)
            g = _step_bwd(q2, g, eps, B, CLAMP)
            g = _step_bwd(q, g, eps, A, CLAMP)
    if ODD:
        g = _step_bwd(p0, g, eps, B, CLAMP)
    # g is now the gradient times p0
    if STAB == 1:
        dx = g
    elif STAB == 0:
        # p0 = exp(x - max): the max receives minus the row sum of g * p0, split over ties
        is_max = (x == _rowmax(x)) & valid
        ties = ct.maximum(ct.sum(ct.where(is_max, 1.0, 0.0), axis=2, keepdims=True), 1.0)
        dx = g - ct.where(is_max, ct.sum(g, axis=2, keepdims=True) / ties, 0.0)
    else:
        # p0 = softmax + eps: the gradient at p0 times the softmax is g * sm / p0 (at most g)
        w = g * ct.where(p0 > 0.0, sm / ct.where(p0 > 0.0, p0, 1.0), 0.0)
        dx = w - sm * ct.sum(w, axis=2, keepdims=True)
    ct.store(grad_in, index=(i, 0, 0), tile=dx.astype(grad_in.dtype))


# ---- the per-token path (n <= EL_MAX_N): entry (r, c) of every matrix of BT tokens is one (BT,)
# tile, gathered with the token stride; a matrix is the tuple of its n * n entries (index r * n + c).

EL_MAX_N = 4
# the per-token path's reciprocals as Triton compiles fp32 ``1.0 / d`` (div.full.f32, within 2 ulp)
# rather than correctly rounded (RN): the backward is mostly its divisions. H200, n = 4, 32768 tokens,
# graph replay: backward 35.3 -> 21.5 us (Triton 22.4), forward 15.1 -> 12.0; largest relative
# error of the gradient against float64 3.44e-7 -> 3.64e-7 (Triton 3.42e-7); dev/sinkhorn_recip.py
RECIP = ct.RoundingMode.FULL
# The per-token path's forward loads and stores a block as one (BT, NP, NP) tile split into entries;
# its backward gathers and scatters an entry at a time. H200, 32768 tokens, graph replay: the forward
# 11.5 -> 5.5 us with tiles (Triton 6.0), the backward 21.3 -> 26.7 with them (perf-notes.md)
FWD_TILE_IO, BWD_TILE_IO = True, False


def _line(e, axis, N):
    """The row (axis 2) or column (axis 1) that entry e belongs to."""
    if axis == 2:
        return e // N
    return e % N


def _entry(k, m, axis, N):
    """The m-th entry of row/column k."""
    if axis == 2:
        return k * N + m
    return m * N + k


def _el_sums(p, axis, N):
    s = ()
    for k in ct.static_iter(range(N)):
        acc = p[_entry(k, 0, axis, N)]
        for m in ct.static_iter(range(1, N)):
            acc = acc + p[_entry(k, m, axis, N)]
        s = s + (acc,)
    return s


def _recip(d):
    return ct.truediv(1.0, d, rounding_mode=RECIP)


def _el_inv(s, eps, clamp, N):
    inv = ()
    for k in ct.static_iter(range(N)):
        if clamp:
            inv = inv + (_recip(ct.maximum(s[k], eps)),)
        else:
            inv = inv + (_recip(s[k] + eps),)
    return inv


def _el_scale(p, f, axis, N):
    out = ()
    for e in ct.static_iter(range(N * N)):
        out = out + (p[e] * f[_line(e, axis, N)],)
    return out


def _el_norm(p, eps, axis, clamp, N):
    return _el_scale(p, _el_inv(_el_sums(p, axis, N), eps, clamp, N), axis, N)


def _el_step_bwd(q, G, eps, axis, clamp, N):
    """VJP of a normalisation step carried as the gradient times its output, as ``_step_bwd``."""
    s = _el_sums(q, axis, N)
    inv = _el_inv(s, eps, clamp, N)
    gs = _el_sums(G, axis, N)
    out = ()
    for e in ct.static_iter(range(N * N)):
        k = _line(e, axis, N)
        t = gs[k]
        if clamp:
            t = ct.where(s[k] >= eps, t, 0.0)
        out = out + (G[e] - (q[e] * inv[k]) * t,)
    return out


def _el_mul(a, b, N):
    out = ()
    for e in ct.static_iter(range(N * N)):
        out = out + (a[e] * b[e],)
    return out


def _el_pairs(p, eps, count, a, b, clamp, N):
    for _ in range(count):
        p = _el_norm(p, eps, a, clamp, N)
        p = _el_norm(p, eps, b, clamp, N)
    return p


def _el_load(arr, i, tok, N, BT, TILE):
    """Token block i's n^2 entries as ``(BT,)`` fp32 tiles: one ``(BT, NP, NP)`` tile load split
    (``TILE``), or a gather per entry."""
    out = ()
    if TILE:
        NP = ct.static_eval(next_pow2(N))
        t = ct.load(arr, index=(i, 0, 0), shape=(BT, NP, NP), padding_mode=ct.PaddingMode.ZERO).astype(ct.float32)
        for e in ct.static_iter(range(N * N)):
            out = out + (ct.reshape(ct.extract(t, (0, e // N, e % N), shape=(BT, 1, 1)), (BT,)),)
        return out
    for e in ct.static_iter(range(N * N)):
        out = out + (ct.gather(arr, (tok, e // N, e % N)).astype(ct.float32),)
    return out


def _el_store(arr, i, tok, p, N, BT, TILE):
    if TILE:
        NP = ct.static_eval(next_pow2(N))
        zero = ct.zeros((BT, 1, 1), dtype=ct.float32)
        rows = ()
        for r in ct.static_iter(range(NP)):
            row = ()
            for c in ct.static_iter(range(NP)):
                row = row + ((ct.reshape(p[r * N + c], (BT, 1, 1)) if r < N and c < N else zero),)
            rows = rows + (_cat_tree(row, 2),)
        ct.store(arr, index=(i, 0, 0), tile=_cat_tree(rows, 1).astype(arr.dtype))
        return
    for e in ct.static_iter(range(N * N)):
        ct.scatter(arr, (tok, e // N, e % N), p[e].astype(arr.dtype))


def _cat_tree(parts, axis):
    """``ct.cat`` of 1, 2 or 4 tiles along ``axis``."""
    if len(parts) == 1:
        return parts[0]
    if len(parts) == 2:
        return ct.cat((parts[0], parts[1]), axis)
    return ct.cat((ct.cat((parts[0], parts[1]), axis), ct.cat((parts[2], parts[3]), axis)), axis)


def _el_rowmax(x, N):
    m = ()
    for r in ct.static_iter(range(N)):
        acc = x[r * N]
        for c in ct.static_iter(range(1, N)):
            acc = ct.maximum(acc, x[r * N + c])
        m = m + (ct.where(acc == float("-inf"), 0.0, acc),)
    return m


def _el_init(x, eps, stab, N):
    """p0 and the row softmax (for its backward), as ``_init``."""
    p = ()
    if stab == 1:
        for e in ct.static_iter(range(N * N)):
            p = p + (ct.exp(x[e]),)
        return p, p
    m = _el_rowmax(x, N)
    for e in ct.static_iter(range(N * N)):
        p = p + (ct.exp(x[e] - m[e // N]),)
    if stab == 2:
        s = _el_sums(p, 2, N)
        sm = ()
        p0 = ()
        for e in ct.static_iter(range(N * N)):
            v = p[e] / ct.maximum(s[e // N], 1e-38)
            sm = sm + (v,)
            p0 = p0 + (v + eps,)
        return p0, sm
    return p, p


@ct.kernel
def _sinkhorn_fwd_el(logits, out, eps: ConstFloat, N: ConstInt, BT: ConstInt, PAIRS: ConstInt, ODD: ConstBool,
                     A: ConstInt, B: ConstInt, STAB: ConstInt, CLAMP: ConstBool):
    tok = ct.bid(0) * BT + ct.arange(BT, dtype=ct.int32)
    p, _ = _el_init(_el_load(logits, ct.bid(0), tok, N, BT, FWD_TILE_IO), eps, STAB, N)
    if ODD:
        p = _el_norm(p, eps, B, CLAMP, N)
    p = _el_pairs(p, eps, PAIRS, A, B, CLAMP, N)
    _el_store(out, ct.bid(0), tok, p, N, BT, FWD_TILE_IO)


@ct.kernel
def _sinkhorn_bwd_el(logits, grad_out, grad_in, eps: ConstFloat, N: ConstInt, BT: ConstInt, PAIRS: ConstInt,
                     ODD: ConstBool, A: ConstInt, B: ConstInt, STAB: ConstInt, CLAMP: ConstBool, SEG: ConstInt):
    tok = ct.bid(0) * BT + ct.arange(BT, dtype=ct.int32)
    x = _el_load(logits, ct.bid(0), tok, N, BT, BWD_TILE_IO)
    g = _el_load(grad_out, ct.bid(0), tok, N, BT, BWD_TILE_IO)
    p0, sm = _el_init(x, eps, STAB, N)
    start = p0
    if ODD:
        start = _el_norm(p0, eps, B, CLAMP, N)
    # G = g * (the output of the step being undone): the last step's output first
    if PAIRS == 0:
        g = _el_mul(g, start, N)
    # two-level recomputation, unrolled at compile time: for each segment of SEG pairs, last first,
    # its starting state comes from the logits (a loop of constant length), its states are kept
    # in registers, and its steps are undone from the last. (cuTile 1.7 fails to compile a loop
    # whose length is an outer loop's induction variable when the loops carry 1-D tiles or tuples;
    # the tile kernel's nested form over (BT, NP, NP) tiles compiles.)
    nseg = (PAIRS + SEG - 1) // SEG
    for rs in ct.static_iter(range(nseg)):
        base = (nseg - 1 - rs) * SEG
        count = min(base + SEG, PAIRS) - base
        q = _el_pairs(start, eps, base, A, B, CLAMP, N)
        states = ()
        for k in ct.static_iter(range(count)):
            states = states + (q,)
            if k + 1 < count:
                q = _el_norm(_el_norm(q, eps, A, CLAMP, N), eps, B, CLAMP, N)
        for k in ct.static_iter(range(count)):
            q = states[count - 1 - k]
            q2 = _el_norm(q, eps, A, CLAMP, N)
            if rs == 0 and k == 0:
                g = _el_mul(g, _el_norm(q2, eps, B, CLAMP, N), N)
            g = _el_step_bwd(q2, g, eps, B, CLAMP, N)
            g = _el_step_bwd(q, g, eps, A, CLAMP, N)
    if ODD:
        g = _el_step_bwd(p0, g, eps, B, CLAMP, N)
    # g is now the gradient times p0
    dx = ()
    if STAB == 1:
        dx = g
    elif STAB == 0:
        # the row max receives minus the row sum of g * p0, split over ties
        m = _el_rowmax(x, N)
        for r in ct.static_iter(range(N)):
            tot = g[r * N]
            ties = ct.where(x[r * N] == m[r], 1.0, 0.0)
            for c in ct.static_iter(range(1, N)):
                tot = tot + g[r * N + c]
                ties = ties + ct.where(x[r * N + c] == m[r], 1.0, 0.0)
            share = tot / ct.maximum(ties, 1.0)
            for c in ct.static_iter(range(N)):
                e = r * N + c
                dx = dx + (g[e] - ct.where(x[e] == m[r], share, 0.0),)
    else:
        # p0 = softmax + eps: the gradient at p0 times the softmax is g * sm / p0 (at most g)
        w = ()
        for e in ct.static_iter(range(N * N)):
            w = w + (g[e] * ct.where(p0[e] > 0.0, sm[e] / ct.where(p0[e] > 0.0, p0[e], 1.0), 0.0),)
        for r in ct.static_iter(range(N)):
            tot = w[r * N]
            for c in ct.static_iter(range(1, N)):
                tot = tot + w[r * N + c]
            for c in ct.static_iter(range(N)):
                e = r * N + c
                dx = dx + (w[e] - sm[e] * tot,)
    _el_store(grad_in, ct.bid(0), tok, dx, N, BT, BWD_TILE_IO)


EL_BT = 128  # tokens per program of the per-token path (64: 18.6 / 69.5 us; 256 did not finish compiling)


def _plan(n: int, t: int, iters, eps, stabilize, eps_mode, order, per_token: bool | None = None):
    """(forward kernel, backward kernel, grid, forward constants, backward constants): the
    per-token path for n <= EL_MAX_N, the (BT, NP, NP) tile path above it (``per_token`` forces one)."""
    cfg = sinkhorn_steps(n, stabilize, order, int(iters))
    knobs = (cfg["PAIRS"], cfg["ODD"], cfg["A"], cfg["B"], STABILIZE[stabilize], eps_mode == "clamp")
    seg = recompute_segment(cfg["PAIRS"])
    if (n <= EL_MAX_N) if per_token is None else per_token:
        consts = (float(eps), n, EL_BT, *knobs)
        return _sinkhorn_fwd_el, _sinkhorn_bwd_el, (cdiv(t, EL_BT),), consts, (*consts, seg)
    bt = max(1, 2048 // (cfg["NP"] ** 2))
    consts = (float(eps), n, cfg["NP"], bt, *knobs)
    return _sinkhorn_fwd, _sinkhorn_bwd, (cdiv(t, bt),), consts, (*consts, seg)


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
    if t:
        fwd, _, grid, consts, _ = _plan(n, t, iters, eps, stabilize, eps_mode, order)
        launch(fwd, grid, (x.view(t, n, n), out.view(t, n, n), *consts))
    return out


def sinkhorn_backward(logits, grad_out, iters=20, eps=1e-6, stabilize="rowmax", eps_mode="add", order="row_first"):
    _check(logits, iters, stabilize, eps_mode, order)
    n = logits.shape[-1]
    x = logits.contiguous()
    g = grad_out.to(x.dtype).contiguous()
    dx = empty_like(x)
    t = x.numel() // (n * n)
    if t:
        _, bwd, grid, _, consts = _plan(n, t, iters, eps, stabilize, eps_mode, order)
        launch(bwd, grid, (x.view(t, n, n), g.view(t, n, n), dx.view(t, n, n), *consts))
    return dx


sinkhorn = sinkhorn_autograd(sinkhorn_forward, sinkhorn_backward)


def compile_checks() -> dict[str, bytes]:
    """Tile IR for representative signatures, compiled on the host: the per-token path (n = 4, 3,
    2) and the tile path (n = 8, and n = 4 launched on it directly), every knob. Two iterations:
    the per-token path unrolls them (each one more is the same code again), and 20 took 35 s of the
    test suite to compile on a CPU, 4 about 3 s a dtype."""
    out = {}
    cases = ((4, "rowmax", "add", "row_first", 2), (3, "softmax", "clamp", "row_first", 2),
             (2, "none", "clamp", "col_first", 2), (8, "none", "add", "col_first", 2))
    for dtype in (torch.float32, torch.bfloat16):
        a = array(dtype, 3)
        # bf16: the loads and stores that differ, on n = 4 (n = 8's backward alone took 10 s a dtype)
        for n, stab, mode, order, iters in (cases if dtype == torch.float32 else cases[:1]):
            fwd, bwd, _, cf, cb = _plan(n, 1, iters, 1e-6, stab, mode, order)
            key = f"{dtype}-{n}-{stab}-{mode}-{order}"
            out[f"fwd-{key}"] = tile_ir(fwd, [a, a, *cf])
            out[f"bwd-{key}"] = tile_ir(bwd, [a, a, a, *cb])
        fwd, bwd, _, cf, cb = _plan(4, 1, 5, 1e-6, "softmax", "add", "row_first", per_token=False)
        out[f"fwd-{dtype}-tile4"] = tile_ir(fwd, [a, a, *cf])
        out[f"bwd-{dtype}-tile4"] = tile_ir(bwd, [a, a, a, *cb])
    return out
