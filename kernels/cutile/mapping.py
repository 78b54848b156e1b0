"""The mHC mapping path in cuTile: proj_rms then compute_h, forward and backward.

Forward: proj_rms's forward kernel (``kernels/cutile/proj_rms.py``: the projection and sum of
squares, one pass over x), then a small kernel for ``h = r * proj * alpha_col + h_bias`` on
``(BM, NP)`` tiles and the three outputs scattered to their own arrays: ``H_pre =
sigmoid(h[:, :n])``, ``H_post = 2 sigmoid(h[:, n:2n])``, ``logits = h[:, 2n:]``. The raw projection,
r and the rms are kept for the backward. (compute_h as the projection kernel's epilogue, one
launch, took 0.512 ms at the paper shape on an H200 in graph replay against 0.488 as two launches,
whose first is proj_rms's own forward at 0.477: docs/perf-notes.md.)

Backward: one kernel per token block gathers the three upstream gradients into one ``(BM, NP)``
tile, applies the activations' derivatives (recomputed from the kept projection), and writes
``d proj = dh * r * alpha_col`` and ``d r = sum_j dh * alpha_col * proj`` plus fp32 per-block
partials of the alpha and bias gradients; then proj_rms's backward (dx and dW in one pass over x),
and fixed-order sums of the partials (dW's and the bias and alpha ones in one launch).
"""
from __future__ import annotations

import cuda.tile as ct
import torch

from mhctool.core.poison import empty

from ._common import array, cdiv, check_cuda, launch, require_contiguous, sum_rows_pair, tile_ir
from ..schedule import next_pow2
from .proj_rms import _lowp, _ng, _np, _packed_row, _proj_rms_fwd, _tiles, backward_packed, launch_forward

ConstInt = ct.Constant[int]
ZERO = ct.PaddingMode.ZERO


def _alpha_cols(alpha, cols, n):
    """``[a_pre]*n ++ [a_post]*n ++ [a_res]*n^2`` as a ``(1, NP)`` tile."""
    a = ct.load(alpha, index=(0,), shape=(4,), padding_mode=ZERO).astype(ct.float32)  # [3] padded
    a0 = ct.extract(a, (0,), shape=(1,))
    a1 = ct.extract(a, (1,), shape=(1,))
    a2 = ct.extract(a, (2,), shape=(1,))
    return ct.where(cols < n, ct.reshape(a0, (1, 1)), ct.where(cols < 2 * n, ct.reshape(a1, (1, 1)), ct.reshape(a2, (1, 1))))


def _h(proj_t, r_t, alpha, bias, cols, n, N, NP, BM):
    b = ct.reshape(ct.load(bias, index=(0,), shape=(NP,), padding_mode=ZERO).astype(ct.float32), (1, NP))
    ac = _alpha_cols(alpha, cols, n)
    h = ct.reshape(r_t, (BM, 1)) * proj_t * ac + b
    return ct.where(cols < N, h, 0.0), ac


@ct.kernel
def _compute_h_fwd(proj, r, alpha, bias, pre, post, logits, n: ConstInt, N: ConstInt, NP: ConstInt, BM: ConstInt):
    """compute_h on the projection forward's outputs for a token block: ``h = r * proj * alpha_col
    + h_bias`` on the ``(BM, NP)`` tile, and the three outputs scattered to their own arrays."""
    i = ct.bid(0)
    acc = ct.load(proj, index=(i, 0), shape=(BM, NP), padding_mode=ZERO)
    rt = ct.load(r, index=(i,), shape=(BM,), padding_mode=ZERO)
    cols = ct.reshape(ct.arange(NP, dtype=ct.int32), (1, NP))
    rows = ct.reshape(i * BM + ct.arange(BM, dtype=ct.int32), (BM, 1))
    h, _ = _h(acc, rt, alpha, bias, cols, n, N, NP, BM)
    s = 1.0 / (1.0 + ct.exp(-h))
    ct.scatter(pre, (rows, cols), s, mask=cols < n)
    ct.scatter(post, (rows, cols - n), 2.0 * s, mask=(cols >= n) & (cols < 2 * n))
    ct.scatter(logits, (rows, cols - 2 * n), h, mask=(cols >= 2 * n) & (cols < N))


# tokens per program of compute_h's forward (64 and 128 timed alike on an H200, 256 a little slower)
BM_H = 128


# tokens per program of compute_h's backward (``_mapping_bwd_h``), whatever the dtype: with 128 the
# mapping backward took 1.016 ms against 1.020 with the forward's 64 and 1.027 with 256 at the paper
# shape on an H200 (paired rounds; half as many bias / alpha partial rows to sum); none spills
BWD_H_BM = 128


# two programs a SM asked for: alone at the paper shape on an H200 this kernel took 14.5 us without
# the hint, 9.2 with the gathers' own bounds checks dropped (the token mask covers them) and 6.2
# with both (docs/perf-notes.md, seventeenth session)
@ct.kernel(occupancy=2)
def _mapping_bwd_h(proj, r, rms, alpha, bias, g_pre, g_post, g_logits, gc, ws, n: ConstInt, N: ConstInt,
                   NP: ConstInt, BM: ConstInt, K: ConstInt):
    """compute_h's backward for a token block, written as proj_rms's packed gradient ``gc`` (fp32
    ``(BM, NP)`` rows: ``d proj = dh r alpha_col`` in columns [0, N), dx's factor of x ``-d r r^2 /
    (K rms)`` in column N, with ``d r = sum_j dh alpha_col proj``; ``_pack_grad``'s layout, so the
    projection backward takes it as it is), and the block's bias and alpha partials as one row of
    ``ws``: columns [0, NP) the bias, [NP, NP + 4) alpha."""
    i = ct.bid(0)
    cols = ct.reshape(ct.arange(NP, dtype=ct.int32), (1, NP))
    rows = ct.reshape(i * BM + ct.arange(BM, dtype=ct.int32), (BM, 1))
    p = ct.load(proj, index=(i, 0), shape=(BM, NP), padding_mode=ZERO)
    rt = ct.load(r, index=(i,), shape=(BM,), padding_mode=ZERO)
    mt = ct.load(rms, index=(i,), shape=(BM,), padding_mode=ZERO)
    h, ac = _h(p, rt, alpha, bias, cols, n, N, NP, BM)
    s = 1.0 / (1.0 + ct.exp(-h))
    live = rows < ct.num_tiles(proj, axis=0, shape=(1, 1))  # tokens past M: masked, so no bounds checks
    g = (ct.gather(g_pre, (rows, cols), mask=live & (cols < n), check_bounds=False)
         + ct.gather(g_post, (rows, cols - n), mask=live & (cols >= n) & (cols < 2 * n), check_bounds=False)
         + ct.gather(g_logits, (rows, cols - 2 * n), mask=live & (cols >= 2 * n) & (cols < N), check_bounds=False))
    dh = ct.where(cols < n, g * s * (1.0 - s), ct.where(cols < 2 * n, 2.0 * g * s * (1.0 - s), g))
    r2 = ct.reshape(rt, (BM, 1))
    grt = ct.sum(dh * ac * p, axis=1)
    ct.store(gc, index=(i, 0), tile=_packed_row(dh * r2 * ac, grt, rt, mt, K * 1.0, cols, N, BM))
    terms = ct.sum(dh * r2 * p, axis=0, keepdims=True)  # (1, NP): per column, this block's alpha terms
    da = ct.zeros((1, 4), dtype=ct.float32)
    lanes = ct.reshape(ct.arange(4, dtype=ct.int32), (1, 4))
    da = da + ct.where(lanes == 0, ct.sum(ct.where(cols < n, terms, 0.0), axis=1, keepdims=True), 0.0)
    da = da + ct.where(lanes == 1, ct.sum(ct.where((cols >= n) & (cols < 2 * n), terms, 0.0), axis=1, keepdims=True), 0.0)
    da = da + ct.where(lanes == 2, ct.sum(ct.where(cols >= 2 * n, terms, 0.0), axis=1, keepdims=True), 0.0)
    ct.store(ws, index=(i, 0), tile=ct.sum(dh, axis=0, keepdims=True))
    ct.store(ws, index=(i, NP // 4), tile=da)


def _streams(n_rows: int) -> int:
    """n from the mapping's n^2 + 2n weight rows."""
    return round((n_rows + 1) ** 0.5 - 1)


def _check(x2d, weight, alpha, h_bias):
    check_cuda(x2d, weight, alpha, h_bias)
    require_contiguous("x2d", x2d)
    require_contiguous("weight", weight)
    n_rows = weight.shape[0]
    n = _streams(n_rows)
    if n * n + 2 * n != n_rows:
        raise ValueError(f"weight must have n^2 + 2n rows, got {n_rows}")
    if x2d.dim() != 2 or weight.shape[1] != x2d.shape[1] or alpha.shape != (3,) or h_bias.shape != (n_rows,):
        raise ValueError(f"x2d [M, K], weight [n^2+2n, K], alpha [3], h_bias [n^2+2n] expected; got "
                         f"{tuple(x2d.shape)}, {tuple(weight.shape)}, {tuple(alpha.shape)}, {tuple(h_bias.shape)}")
    return n


def forward(x2d, weight, alpha, h_bias, eps):
    """``((H_pre, H_post, logits), saved)``: the three outputs ``[M, n]``, ``[M, n]``, ``[M, n, n]``
    (fp32) and what ``backward`` takes."""
    n = _check(x2d, weight, alpha, h_bias)
    m, k = x2d.shape
    nr = weight.shape[0]
    np_ = _np(nr)
    lowp = _lowp(x2d, weight)
    bm, bk = _tiles(lowp)
    dev = x2d.device
    a3, bias = alpha.contiguous(), h_bias.contiguous()
    pre, post = empty((m, n), torch.float32, dev), empty((m, n), torch.float32, dev)
    logits = empty((m, n, n), torch.float32, dev)
    proj = empty((m, np_), torch.float32, dev)
    r, rms = empty((m,), torch.float32, dev), empty((m,), torch.float32, dev)
    if m:
        launch_forward(x2d, weight, proj, r, rms, eps, np_, bm, bk, lowp)
        launch(_compute_h_fwd, (cdiv(m, BM_H),), (proj, r, a3, bias, pre, post, logits.view(m, n * n), n, nr, np_, BM_H))
    return (pre, post, logits), (x2d, weight, a3, bias, proj, r, rms)


def backward(saved, g_pre, g_post, g_logits, agg=None, extra=None):
    """``(dx, dW, d alpha, d h_bias)`` from ``forward``'s ``saved`` and the outputs' gradients (None:
    zero). ``agg``: mix_aggregate's aggregation term, and ``extra`` (with it, x2d's shape): the
    residual's other gradient, both added to dx in the projection's pass (see
    ``proj_rms.backward_packed``)."""
    x2d, weight, a3, bias, proj, r, rms = saved
    m = x2d.shape[0]
    nr = weight.shape[0]
    n = _streams(nr)
    np_ = proj.shape[1]
    bm = BWD_H_BM
    dev = x2d.device
    zeros = {}

    def grad(g, shape):
        if g is None:
            if shape not in zeros:
                zeros[shape] = torch.zeros(shape, dtype=torch.float32, device=dev)
            return zeros[shape]
        return g.float().contiguous()

    gp, gq, gl = grad(g_pre, (m, n)), grad(g_post, (m, n)), grad(g_logits, (m, n, n))
    nb = cdiv(m, bm)
    k = x2d.shape[1]
    if _ng(nr) != np_:  # never for mHC's N = n^2 + 2n: N + 1 <= NP (n = 2: N = 8, NP = 16)
        raise ValueError(f"mapping backward: the packed gradient needs {_ng(nr)} columns, the projection has {np_}")
    gc = empty((m, np_), torch.float32, dev)
    ws = empty((nb, np_ + 4), torch.float32, dev)  # per block: bias partials, then alpha's
    dx = empty(x2d.shape, x2d.dtype, dev)
    dw = empty(weight.shape, weight.dtype, dev)
    if m:
        launch(_mapping_bwd_h, (nb,), (proj, r, rms, a3, bias, gp, gq, gl.view(m, n * n), gc, ws,
                                      n, nr, np_, bm, k))
    sums = empty((np_ + 4,), torch.float32, dev)
    # the bias and alpha partials' sum (one program, 128 token blocks a step) in dW's sum's launch
    backward_packed(x2d, weight, gc, dx, dw, side=(ws, sums, next_pow2(np_ + 4), 128), agg=agg,
                    extra=extra)  # dW = 0 without tokens
    if not m:
        return dx, dw, torch.zeros_like(a3), torch.zeros_like(bias)
    return dx, dw, sums[np_:np_ + 3].to(a3.dtype), sums[:nr].to(bias.dtype)


class _Mapping(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, weight, alpha, h_bias, eps):
        outs, saved = forward(x2d, weight, alpha, h_bias, eps)
        ctx.save_for_backward(*saved)
        return outs

    @staticmethod
    def backward(ctx, g_pre, g_post, g_logits):
        return (*backward(ctx.saved_tensors, g_pre, g_post, g_logits), None)


def mapping(x2d, weight, alpha, h_bias, eps: float = 1e-6):
    """``(H_pre, H_post, H_res_logits)`` of ``compute_h(proj_rms(x2d, weight, eps), alpha, h_bias)``."""
    return _Mapping.apply(x2d, weight, alpha, h_bias, eps)


def compile_checks() -> dict[str, bytes]:
    out = {}
    f32 = torch.float32
    for dtype, lowp in ((torch.bfloat16, True), (torch.float32, False)):
        bm, bk = _tiles(lowp)
        a2 = array(dtype, 2)
        out[f"fwd-{dtype}"] = tile_ir(_proj_rms_fwd, [a2, a2, array(f32, 2), array(f32, 1), array(f32, 1), 1e-6, 32,
                                                      bm, bk, lowp])
        out[f"bwd-{dtype}"] = tile_ir(_mapping_bwd_h, [array(f32, 2), array(f32, 1), array(f32, 1), array(f32, 1),
                                                       array(f32, 1), array(f32, 2), array(f32, 2), array(f32, 2),
                                                       array(f32, 2), array(f32, 2), 4, 24, 32, bm, 28672])
    out["fwd-h"] = tile_ir(_compute_h_fwd, [array(f32, 2), array(f32, 1), array(f32, 1), array(f32, 1), array(f32, 2),
                                            array(f32, 2), array(f32, 2), 4, 24, 32, BM_H])
    out["sum-dw-bias-alpha"] = tile_ir(sum_rows_pair, [array(f32, 2), array(torch.bfloat16, 1), array(f32, 2),
                                                       array(f32, 1), 8, 1024, 128, 64])
    return out
