"""The mapping path in two launches: projection + RMS with compute_h fused after it, then Sinkhorn.

``mapping(x2d, weight, alpha, h_bias, eps) -> (H_pre[M, n], H_post[M, n], H_res_logits[M, n, n])``
with ``h = r * proj * ([a_pre]*n ++ [a_post]*n ++ [a_res]*n^2) + h_bias``, ``H_pre = sigmoid``,
``H_post = 2 sigmoid`` (DESIGN.md). The forward is one kernel: the projection tile of a block of
rows stays in registers and leaves as the three mapping tensors (plus proj, r and rms, 100 bytes a
token, kept for the backward). The backward runs compute_h's vector-Jacobian product in one kernel
(grad of alpha and h_bias as deterministic per-block partials; on the tensor-core path the
projection's gradient leaves it already split for the tensor cores), then the proj_rms backward,
whose dW sum's launch also sums the alpha and h_bias partials.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from mhctool.core.poison import empty

from ._common import cdiv, check_device, fast, next_pow2, require_contiguous
from .proj_rms import (_precision, _proj_tile, coef_of, low_precision_operands, piece_cols, proj_rms_backward,
                       rms_and_r, store_split)


# compute_h's backward writes the tensor-core backward's split gradient itself (one launch less
# than ``proj_rms._split_grad`` after it); False: the split after it, for sweeps
SPLIT_IN_COMPUTE_H = True


def streams_of(n_h: int) -> int:
    """n from the number of mapping coefficients ``n^2 + 2n``."""
    n = int(round(math.sqrt(n_h + 1) - 1))
    if n * n + 2 * n != n_h:
        raise ValueError(f"the weight has {n_h} rows; the mapping needs n^2 + 2n for some n")
    return n


@triton.jit
def _scale(alpha_ptr, cols, n: tl.constexpr):
    a_pre = tl.load(alpha_ptr + 0).to(tl.float32)
    a_post = tl.load(alpha_ptr + 1).to(tl.float32)
    a_res = tl.load(alpha_ptr + 2).to(tl.float32)
    return tl.where(cols < n, a_pre, tl.where(cols < 2 * n, a_post, a_res))


@fast
@triton.jit
def _mapping_fwd(x_ptr, w_ptr, alpha_ptr, hb_ptr, pre_ptr, post_ptr, logit_ptr, proj_ptr, r_ptr,
                 rms_ptr, M, K, N, eps, n: tl.constexpr, NP: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_K: tl.constexpr, LOWP: tl.constexpr, PREC: tl.constexpr, ROUND: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, NP)
    rmask = rows < M
    acc, ss = _proj_tile(x_ptr, w_ptr, rows, cols, rmask, M, K, N, eps, NP, BLOCK_M, BLOCK_K, LOWP, PREC, ROUND)
    rms, r = rms_and_r(ss, K, eps)
    cmask = cols < N
    tl.store(proj_ptr + rows[:, None] * N + cols[None, :], acc, mask=rmask[:, None] & cmask[None, :])
    tl.store(r_ptr + rows, r, mask=rmask)
    tl.store(rms_ptr + rows, rms, mask=rmask)
    hb = tl.load(hb_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    h = acc * r[:, None] * _scale(alpha_ptr, cols, n)[None, :] + hb[None, :]
    sig = tl.sigmoid(h)
    row2 = rows[:, None]
    col2 = cols[None, :]
    m2 = rmask[:, None]
    tl.store(pre_ptr + row2 * n + col2, sig, mask=m2 & (col2 < n))
    tl.store(post_ptr + row2 * n + (col2 - n), 2.0 * sig, mask=m2 & (col2 >= n) & (col2 < 2 * n))
    tl.store(logit_ptr + row2 * (n * n) + (col2 - 2 * n), h, mask=m2 & (col2 >= 2 * n) & (col2 < N))


@fast
@triton.jit
def _compute_h_bwd(proj_ptr, r_ptr, rms_ptr, alpha_ptr, hb_ptr, gpre_ptr, gpost_ptr, glogit_ptr, dproj_ptr,
                   dr_ptr, hi_ptr, lo_ptr, cf_ptr, ws_ptr, M, K, N, n: tl.constexpr, NP: tl.constexpr,
                   BLOCK_M: tl.constexpr, PIECES: tl.constexpr, ROUND: tl.constexpr):
    """compute_h's backward on a block of rows; the block's alpha and h_bias partials in a row of
    ``ws`` (``[3 alpha | N bias]``). The projection's gradient leaves as ``dproj [M, N]`` and
    ``dr [M]``, or with ``PIECES`` (the tensor-core projection backward next) as
    ``proj_rms._split_grad`` makes it from those (two pieces of x's dtype ``[M, NP]`` and dx's
    factor of x), the same bits without that kernel's launch and its read of the fp32 gradient."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, NP)
    rmask = rows < M
    cmask = cols < N
    row2 = rows[:, None]
    col2 = cols[None, :]
    m2 = rmask[:, None] & cmask[None, :]
    proj = tl.load(proj_ptr + row2 * N + col2, mask=m2, other=0.0)
    r = tl.load(r_ptr + rows, mask=rmask, other=0.0)
    scale = _scale(alpha_ptr, cols, n)
    hb = tl.load(hb_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    h = proj * r[:, None] * scale[None, :] + hb[None, :]
    s = tl.sigmoid(h)
    g_pre = tl.load(gpre_ptr + row2 * n + col2, mask=m2 & (col2 < n), other=0.0)
    g_post = tl.load(gpost_ptr + row2 * n + (col2 - n), mask=m2 & (col2 >= n) & (col2 < 2 * n), other=0.0)
    g_log = tl.load(glogit_ptr + row2 * (n * n) + (col2 - 2 * n), mask=m2 & (col2 >= 2 * n), other=0.0)
    ds = s * (1.0 - s)
    dh = tl.where(col2 < n, g_pre * ds, tl.where(col2 < 2 * n, 2.0 * g_post * ds, g_log))
    dh = tl.where(m2, dh, 0.0)
    # products in the order of h = (proj * r) * scale: the alpha gradient is a sum with heavy
    # cancellation, where one extra rounding per term shows
    pr = proj * r[:, None]
    dproj = dh * scale[None, :] * r[:, None]
    dr = tl.sum(dh * scale[None, :] * proj, axis=1)
    if PIECES:
        rms = tl.load(rms_ptr + rows, mask=rmask, other=1.0)
        store_split(dproj, coef_of(dr, r, rms, rmask, K), hi_ptr, lo_ptr, cf_ptr, rows, rmask,
                    rows.to(tl.int64)[:, None] * NP + col2, ROUND)
    else:
        tl.store(dproj_ptr + row2 * N + col2, dproj, mask=m2)
        tl.store(dr_ptr + rows, dr, mask=rmask)
    dscale = tl.sum(dh * pr, axis=0)  # [NP]: d/d(scale column), this block
    a = tl.arange(0, 4)
    grp = tl.where(cols < n, 0, tl.where(cols < 2 * n, 1, 2))
    da = tl.sum(tl.where(grp[None, :] == a[:, None], dscale[None, :], 0.0), axis=1)  # [4]
    tl.store(ws_ptr + pid * (3 + N) + a, da, mask=a < 3)
    tl.store(ws_ptr + pid * (3 + N) + 3 + cols, tl.sum(dh, axis=0), mask=cmask)


def _check(x2d, weight, alpha, h_bias):
    if x2d.dim() != 2 or weight.dim() != 2 or x2d.shape[1] != weight.shape[1]:
        raise ValueError(f"mapping takes x2d[M,K] and weight[N,K]; got {tuple(x2d.shape)} and {tuple(weight.shape)}")
    n = streams_of(weight.shape[0])
    if tuple(alpha.shape) != (3,) or tuple(h_bias.shape) != (weight.shape[0],):
        raise ValueError(f"mapping takes alpha[3] and h_bias[{weight.shape[0]}]; got {tuple(alpha.shape)} and {tuple(h_bias.shape)}")
    check_device(x2d, weight, alpha, h_bias)
    require_contiguous("x2d", x2d)
    return n, weight.contiguous(), alpha.contiguous(), h_bias.contiguous()


# the forward's tile (BLOCK_M, BLOCK_K, warps[, pipeline stages, default 3]): a program a block of
# rows, its loop over K. At issue 99's step (4,096 rows a call) that is 64 programs for 132 SMs. On
# an H100 there, graph replay (dev/step_profile.py mapfwd, session 62): (64, 128, 4) 45.4 us (49% of
# copy), with 5 stages 45.3, 8 warps and 6 stages 40.7 (54%), all with the same bits; K blocks of
# 256 (other bits) 46.3-51.6, row blocks of 32 63-67 (session 60: 16 and 8 rows no faster)
FWD_TILE = (64, 128, 8, 6)
# fp32 operands (twice the bytes a stage: six stages of 64 x 128 fp32 tiles pass the H100's 227 KB
# of shared memory) keep the tile before session 62's
FWD_TILE_FP32 = (64, 128, 4)


def mapping_forward(x2d, weight, alpha, h_bias, eps=1e-6, tf32: bool = False, tile_=None):
    n, weight, alpha, h_bias = _check(x2d, weight, alpha, h_bias)
    M, K = x2d.shape
    N = weight.shape[0]
    dev = x2d.device
    pre, post = empty((M, n), torch.float32, dev), empty((M, n), torch.float32, dev)
    logits = empty((M, n, n), torch.float32, dev)
    proj = torch.empty((M, N), dtype=torch.float32, device=dev)
    r = torch.empty((M,), dtype=torch.float32, device=dev)
    rms = torch.empty((M,), dtype=torch.float32, device=dev)
    lowp = low_precision_operands(x2d, weight)
    if M:
        tile = tile_ or (FWD_TILE if lowp else FWD_TILE_FP32)
        bm, bk, warps, stages = (*tile, 3)[:4]  # 3: Triton's default pipelining depth
        _mapping_fwd[(cdiv(M, bm),)](x2d, weight, alpha, h_bias, pre, post, logits, proj, r, rms,
                                     M, K, N, float(eps), n=n, NP=max(16, next_pow2(N)),
                                     BLOCK_M=bm, BLOCK_K=bk, LOWP=lowp, PREC=_precision(tf32),
                                     ROUND=tf32, num_warps=warps, num_stages=stages)
    return (pre, post, logits), (proj, r, rms)


def mapping_backward(x2d, weight, alpha, h_bias, saved, grads, tf32: bool = False, agg=None, lowp=None,
                     extra=None):
    """dx, dW, d_alpha, d_bias; ``agg``: the aggregation's gradient of x that dx includes too, and
    ``extra`` another (proj_rms_backward). ``lowp``: the tensor-core projection backward (default: for bf16/fp16
    operands off the interpreter; forced on under the interpreter for the CPU tests, as there)."""
    n, weight, alpha, h_bias = _check(x2d, weight, alpha, h_bias)
    proj, r, rms = saved
    M, N = proj.shape
    K = x2d.shape[1]
    dev = x2d.device
    g_pre, g_post, g_log = (torch.zeros(shape, dtype=torch.float32, device=dev) if g is None else g.float().contiguous()
                            for g, shape in zip(grads, ((M, n), (M, n), (M, n, n))))
    if lowp is None:
        lowp = low_precision_operands(x2d, weight)
    bm = 64
    nb = cdiv(M, bm)
    NP = max(16, next_pow2(N))
    alloc = empty if M else torch.zeros  # a row a program, each written (zeros where nothing runs)
    ws = alloc((max(nb, 1), 3 + N), dtype=torch.float32, device=dev)
    pieces = dproj = dr = None
    if lowp and SPLIT_IN_COMPUTE_H:  # the gradient split for the tensor cores here (``pieces``)
        # compute_h's tile is NP wide; they differ only where N is a power of two: N = n^2 + 2n is
        # one only at n = 2 (8: both 16)
        assert piece_cols(N) == NP
        pieces = (empty((M, NP), x2d.dtype, dev), empty((M, NP), x2d.dtype, dev), empty((M,), torch.float32, dev))
    else:
        dproj = torch.empty((M, N), dtype=torch.float32, device=dev)
        dr = torch.empty((M,), dtype=torch.float32, device=dev)
    if M:
        out = pieces or (x2d, x2d, r)  # the pointers the other form does not write
        _compute_h_bwd[(nb,)](proj, r, rms, alpha, h_bias, g_pre, g_post, g_log, dproj if dproj is not None else proj,
                              dr if dr is not None else r, *out, ws, M, K, N, n=n, NP=NP, BLOCK_M=bm,
                              PIECES=pieces is not None, ROUND=tf32, num_warps=4)
    dx, dw, sums = proj_rms_backward(x2d, weight, r, rms, dproj, dr, lowp=lowp, tf32=tf32, agg=agg, pieces=pieces,
                                     also=ws, extra=extra)
    d_alpha, d_bias = sums[:3], sums[3:]
    return dx, dw, d_alpha.to(alpha.dtype), d_bias.to(h_bias.dtype)


class MappingFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, weight, alpha, h_bias, eps, tf32=False):
        outs, saved = mapping_forward(x2d, weight, alpha, h_bias, eps, tf32)
        ctx.save_for_backward(x2d, weight, alpha, h_bias, *saved)
        ctx.tf32 = tf32
        return outs

    @staticmethod
    def backward(ctx, g_pre, g_post, g_log):
        x2d, weight, alpha, h_bias, *saved = ctx.saved_tensors
        return (*mapping_backward(x2d, weight, alpha, h_bias, saved, (g_pre, g_post, g_log), ctx.tf32), None, None)


def mapping(x2d, weight, alpha, h_bias, eps: float = 1e-6):
    """``(H_pre, H_post, H_res_logits)`` from ``x2d[M, K]``, ``weight[n^2+2n, K]``, ``alpha[3]``, ``h_bias``."""
    return MappingFunction.apply(x2d, weight, alpha, h_bias, eps)


def mapping_tf32(x2d, weight, alpha, h_bias, eps: float = 1e-6):
    """The TF32 variant (``triton-tf32``): the projection's products at TF32, forward and backward
    (``proj_rms_tf32``); compute_h in fp32 as in ``mapping``."""
    return MappingFunction.apply(x2d, weight, alpha, h_bias, eps, True)
