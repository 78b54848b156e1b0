"""H_post * bias-dropout-add in Triton, forward and backward.

``out[t, i, c] = sum_j H[t, i, j] x[t, j, c] + h_post[t, i] (y[t, c] + bias[c])`` (``H = h_res``,
or ``h_res^T`` with ``transpose_res``). One program owns a ``[tokens, streams, C]`` tile. The backward reads grad_out, x and y once and writes grad_x and
grad_y; the small gradients (h_res and h_post: reductions over C; bias: a reduction over tokens)
are accumulated in fp32 on chip, written as per-block partials to a small workspace, and summed by
a deterministic second kernel.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from mhctool.poison import empty

from ._common import cast, check_device, interpreted, next_pow2, pick_config, require_contiguous
from .reduce import sum_rows


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
def _h_post_bda_fwd(h_ptr, x_ptr, hp_ptr, y_ptr, b_ptr, out_ptr, T, C, N: tl.constexpr,
                    NP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
                    HAS_BIAS: tl.constexpr, TRANSPOSE: tl.constexpr):
    t, n, c, tmask, cmask, offs3, mask3, offs2, mask2 = _tile(
        tl.program_id(0) * BLOCK_T, tl.program_id(1) * BLOCK_C, T, C, N, NP, BLOCK_T, BLOCK_C)
    hp = tl.load(hp_ptr + t[:, None] * N + n[None, :], mask=tmask[:, None] & (n[None, :] < N), other=0.0).to(tl.float32)
    z = tl.load(y_ptr + offs2, mask=mask2, other=0.0).to(tl.float32)
    if HAS_BIAS:
        z += tl.load(b_ptr + c, mask=cmask, other=0.0).to(tl.float32)[None, :]
    out = hp[:, :, None] * z[:, None, :]
    for j in tl.static_range(N):
        hj, _ = _h_col(h_ptr, t, n, tmask, j, N, TRANSPOSE)
        xj = tl.load(x_ptr + t[:, None] * N * C + j * C + c[None, :], mask=mask2, other=0.0).to(tl.float32)
        out += hj[:, :, None] * xj[:, None, :]
    tl.store(out_ptr + offs3, cast(out, out_ptr.dtype.element_ty), mask=mask3)


@triton.jit
def _h_post_bda_bwd(h_ptr, x_ptr, hp_ptr, y_ptr, b_ptr, g_ptr, dx_ptr, dy_ptr,
                    ws_h_ptr, ws_hp_ptr, ws_b_ptr, T, C, N: tl.constexpr, NP: tl.constexpr,
                    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, HAS_BIAS: tl.constexpr,
                    TRANSPOSE: tl.constexpr):
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
    dy = tl.sum(hp[:, :, None] * g, axis=1)
    tl.store(dy_ptr + offs2, cast(dy, dy_ptr.dtype.element_ty), mask=mask2)
    ws_row = cb.to(tl.int64) * T + t  # partials of this C block
    tl.store(ws_hp_ptr + ws_row[:, None] * N + n[None, :], tl.sum(g * z[:, None, :], axis=2), mask=nmask)
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
def _hm(h_ptr, t, tmask, i: tl.constexpr, j: tl.constexpr, N: tl.constexpr, TRANSPOSE: tl.constexpr):
    """``Hm[t, i, j]`` as a ``[BT, 1]`` column (h_res, or h_res^T), zero for a stream past N."""
    if i < N and j < N:
        if TRANSPOSE:
            w = tl.load(h_ptr + t * (N * N) + j * N + i, mask=tmask, other=0.0).to(tl.float32)
        else:
            w = tl.load(h_ptr + t * (N * N) + i * N + j, mask=tmask, other=0.0).to(tl.float32)
    else:
        w = tl.zeros(t.shape, tl.float32)
    return w[:, None]


@triton.jit
def _stream(ptr, offs, mask, i: tl.constexpr, C, N: tl.constexpr):
    """Stream i's ``[BT, BC]`` slice as fp32, zero for a stream past N."""
    if i < N:
        v = tl.load(ptr + offs + i * C, mask=mask, other=0.0).to(tl.float32)
    else:
        v = tl.zeros(offs.shape, tl.float32)
    return v


@triton.jit
def _put(ptr, offs, v, mask, i: tl.constexpr, C, N: tl.constexpr):
    if i < N:
        tl.store(ptr + offs + i * C, cast(v, ptr.dtype.element_ty), mask=mask)


@triton.jit
def _put_sum(ptr, t, tmask, acc, k, ON: tl.constexpr):
    """One per-token gradient element: the sum over C of its accumulator, at ``ptr[t * stride + k]``."""
    if ON:
        tl.store(ptr + t + k, cast(tl.sum(acc, axis=1), ptr.dtype.element_ty), mask=tmask)


@triton.jit
def _h_post_bda_bwd4(h_ptr, x_ptr, hp_ptr, y_ptr, b_ptr, g_ptr, dx_ptr, dy_ptr, dh_ptr, dhp_ptr, ws_b_ptr,
                     T, C, P, N: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, HAS_BIAS: tl.constexpr,
                     TRANSPOSE: tl.constexpr):
    """The backward for n <= 4, as 2-D ``[BT, BC]`` tiles only: every stream is its own tile and
    every operation inside the C loop is elementwise, so nothing crosses lanes there. A program
    walks whole token blocks (``tb = pid, pid + P, ...``) over all of C, accumulating the n^2 + n
    products of grad_h_res and grad_h_post elementwise in registers and summing them over C once
    per token block: no workspace for the per-token gradients, and their order depends on BT and
    BC alone (batch-invariant). The bias partials of a program are summed in place in its own
    ``[BT, C]`` rows of ``ws_b`` (read back by the same threads), then over programs by ``sum_rows``."""
    pid = tl.program_id(0)
    rows = tl.arange(0, BT)
    cols = tl.arange(0, BC)
    for tb in range(pid, tl.cdiv(T, BT), P):
        t = (tb * BT + rows).to(tl.int64)
        tmask = t < T
        h00 = _hm(h_ptr, t, tmask, 0, 0, N, TRANSPOSE)
        h01 = _hm(h_ptr, t, tmask, 0, 1, N, TRANSPOSE)
        h02 = _hm(h_ptr, t, tmask, 0, 2, N, TRANSPOSE)
        h03 = _hm(h_ptr, t, tmask, 0, 3, N, TRANSPOSE)
        h10 = _hm(h_ptr, t, tmask, 1, 0, N, TRANSPOSE)
        h11 = _hm(h_ptr, t, tmask, 1, 1, N, TRANSPOSE)
        h12 = _hm(h_ptr, t, tmask, 1, 2, N, TRANSPOSE)
        h13 = _hm(h_ptr, t, tmask, 1, 3, N, TRANSPOSE)
        h20 = _hm(h_ptr, t, tmask, 2, 0, N, TRANSPOSE)
        h21 = _hm(h_ptr, t, tmask, 2, 1, N, TRANSPOSE)
        h22 = _hm(h_ptr, t, tmask, 2, 2, N, TRANSPOSE)
        h23 = _hm(h_ptr, t, tmask, 2, 3, N, TRANSPOSE)
        h30 = _hm(h_ptr, t, tmask, 3, 0, N, TRANSPOSE)
        h31 = _hm(h_ptr, t, tmask, 3, 1, N, TRANSPOSE)
        h32 = _hm(h_ptr, t, tmask, 3, 2, N, TRANSPOSE)
        h33 = _hm(h_ptr, t, tmask, 3, 3, N, TRANSPOSE)
        hpt = t * N
        q0 = _stream(hp_ptr, hpt, tmask, 0, 1, N)[:, None]
        q1 = _stream(hp_ptr, hpt, tmask, 1, 1, N)[:, None]
        q2 = _stream(hp_ptr, hpt, tmask, 2, 1, N)[:, None]
        q3 = _stream(hp_ptr, hpt, tmask, 3, 1, N)[:, None]
        zero = tl.zeros([BT, BC], tl.float32)
        a00, a01, a02, a03 = zero, zero, zero, zero
        a10, a11, a12, a13 = zero, zero, zero, zero
        a20, a21, a22, a23 = zero, zero, zero, zero
        a30, a31, a32, a33 = zero, zero, zero, zero
        p0, p1, p2, p3 = zero, zero, zero, zero
        for c0 in range(0, C, BC):
            c = c0 + cols
            cmask = c < C
            m2 = tmask[:, None] & cmask[None, :]
            o3 = t[:, None] * (N * C) + c[None, :]  # stream 0 of [t, :, c]
            o2 = t[:, None] * C + c[None, :]
            g0 = _stream(g_ptr, o3, m2, 0, C, N)
            g1 = _stream(g_ptr, o3, m2, 1, C, N)
            g2 = _stream(g_ptr, o3, m2, 2, C, N)
            g3 = _stream(g_ptr, o3, m2, 3, C, N)
            z = tl.load(y_ptr + o2, mask=m2, other=0.0).to(tl.float32)
            if HAS_BIAS:
                z += tl.load(b_ptr + c, mask=cmask, other=0.0).to(tl.float32)[None, :]
            dy = q0 * g0 + q1 * g1 + q2 * g2 + q3 * g3
            tl.store(dy_ptr + o2, cast(dy, dy_ptr.dtype.element_ty), mask=m2)
            if HAS_BIAS:
                wb = ws_b_ptr + pid.to(tl.int64) * BT * C + rows[:, None] * C + c[None, :]
                every = (rows[:, None] < BT) & cmask[None, :]  # every row: a program's rows are all written
                later = (tl.zeros([BT, BC], tl.int32) + tb) > pid  # after its first token block
                prev = tl.load(wb, mask=every & later, other=0.0)
                tl.store(wb, prev + dy, mask=every)
            p0 += g0 * z
            p1 += g1 * z
            p2 += g2 * z
            p3 += g3 * z
            x0 = _stream(x_ptr, o3, m2, 0, C, N)
            _put(dx_ptr, o3, h00 * g0 + h10 * g1 + h20 * g2 + h30 * g3, m2, 0, C, N)
            a00 += g0 * x0
            a10 += g1 * x0
            a20 += g2 * x0
            a30 += g3 * x0
            x1 = _stream(x_ptr, o3, m2, 1, C, N)
            _put(dx_ptr, o3, h01 * g0 + h11 * g1 + h21 * g2 + h31 * g3, m2, 1, C, N)
            a01 += g0 * x1
            a11 += g1 * x1
            a21 += g2 * x1
            a31 += g3 * x1
            x2 = _stream(x_ptr, o3, m2, 2, C, N)
            _put(dx_ptr, o3, h02 * g0 + h12 * g1 + h22 * g2 + h32 * g3, m2, 2, C, N)
            a02 += g0 * x2
            a12 += g1 * x2
            a22 += g2 * x2
            a32 += g3 * x2
            x3 = _stream(x_ptr, o3, m2, 3, C, N)
            _put(dx_ptr, o3, h03 * g0 + h13 * g1 + h23 * g2 + h33 * g3, m2, 3, C, N)
            a03 += g0 * x3
            a13 += g1 * x3
            a23 += g2 * x3
            a33 += g3 * x3
        # dHm[i, j] = sum_c g_i x_j lands at h_res[j, i] when the kernel mixes with h_res^T
        th = t * (N * N)
        _put_sum(dh_ptr, th, tmask, a00, 0, True)
        _put_sum(dh_ptr, th, tmask, a01, N if TRANSPOSE else 1, N > 1)
        _put_sum(dh_ptr, th, tmask, a02, 2 * N if TRANSPOSE else 2, N > 2)
        _put_sum(dh_ptr, th, tmask, a03, 3 * N if TRANSPOSE else 3, N > 3)
        _put_sum(dh_ptr, th, tmask, a10, 1 if TRANSPOSE else N, N > 1)
        _put_sum(dh_ptr, th, tmask, a11, N + 1, N > 1)
        _put_sum(dh_ptr, th, tmask, a12, 2 * N + 1 if TRANSPOSE else N + 2, N > 2)
        _put_sum(dh_ptr, th, tmask, a13, 3 * N + 1 if TRANSPOSE else N + 3, N > 3)
        _put_sum(dh_ptr, th, tmask, a20, 2 if TRANSPOSE else 2 * N, N > 2)
        _put_sum(dh_ptr, th, tmask, a21, N + 2 if TRANSPOSE else 2 * N + 1, N > 2)
        _put_sum(dh_ptr, th, tmask, a22, 2 * N + 2, N > 2)
        _put_sum(dh_ptr, th, tmask, a23, 3 * N + 2 if TRANSPOSE else 2 * N + 3, N > 3)
        _put_sum(dh_ptr, th, tmask, a30, 3 if TRANSPOSE else 3 * N, N > 3)
        _put_sum(dh_ptr, th, tmask, a31, N + 3 if TRANSPOSE else 3 * N + 1, N > 3)
        _put_sum(dh_ptr, th, tmask, a32, 2 * N + 3 if TRANSPOSE else 3 * N + 2, N > 3)
        _put_sum(dh_ptr, th, tmask, a33, 3 * N + 3, N > 3)
        tp = t * N
        _put_sum(dhp_ptr, tp, tmask, p0, 0, True)
        _put_sum(dhp_ptr, tp, tmask, p1, 1, N > 1)
        _put_sum(dhp_ptr, tp, tmask, p2, 2, N > 2)
        _put_sum(dhp_ptr, tp, tmask, p3, 3, N > 3)


def _blocks(C: int, n: int, elems: int = 8192, max_c: int = 256, warps: int = 8):
    """(BLOCK_T, BLOCK_C, num_warps): a [BLOCK_T, NP, BLOCK_C] tile of about ``elems`` elements."""
    np_ = next_pow2(n)
    if interpreted():
        return 64, min(256, next_pow2(C)), 4
    bc = max(32, min(max_c, next_pow2(C)))
    bt = max(1, elems // (np_ * bc))
    return bt, bc, warps


def _candidates(C: int, n: int) -> list[tuple]:
    if interpreted():
        return [_blocks(C, n)]
    out = []
    for elems, max_c, warps in ((8192, 256, 8), (4096, 512, 4), (8192, 1024, 8), (4096, 128, 4),
                                (16384, 512, 8), (2048, 256, 4), (16384, 256, 8), (32768, 1024, 16)):
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


def h_post_bda_forward(h_res, x, h_post, y, bias=None, transpose_res=False):
    h_res, h_post = _check(h_res, x, h_post, y, bias)
    s, b, n, C = x.shape
    T = s * b
    out = empty(x.shape, x.dtype, x.device)

    def run(cfg):
        bt, bc, warps = cfg
        _h_post_bda_fwd[(triton.cdiv(T, bt), triton.cdiv(C, bc))](
            h_res, x, h_post, y, bias if bias is not None else y, out, T, C, N=n, NP=next_pow2(n),
            BLOCK_T=bt, BLOCK_C=bc, HAS_BIAS=bias is not None, TRANSPOSE=bool(transpose_res),
            num_warps=warps)

    if T and C:
        run(pick_config(("h_post_bda_fwd", T, C, n, x.dtype, bias is not None), _candidates(C, n), run,
                        work=T * n * C))
    return out


def backward_tile(C: int, n: int) -> tuple:
    """The backward's (BLOCK_T, BLOCK_C, warps): a function of C and n alone, never of the number
    of tokens. grad_h_res and grad_h_post are sums over C whose order the tile decides (the C
    blocks, and within a block the layout of the tile's reduction), so a tile timed per token count,
    as it was, gave a token other bits at another batch size. Fixed from the sweep in
    docs/perf-notes.md (H100, paper shape): 4096-element tiles at most 128 channels wide on 4
    warps, the tile the timing used to pick there (2.99 ms; the old first candidate took 4.03).
    (The forward has no reduction across lanes: its tile stays timed.)"""
    return _blocks(C, n, 4096, 128, 4)


# n <= 4: (tokens per block, channels per chunk, warps, programs per SM); from the sweep in
# docs/perf-notes.md. The tile is fixed (batch invariance); the number of programs may follow the
# device and the token count: it only decides which program sums which tokens' bias partials.
TILE4 = (4, 128, 4, 4)
SWEEP4 = [TILE4, (2, 256, 4, 4), (4, 256, 8, 2), (8, 128, 8, 2), (2, 128, 2, 8), (1, 512, 4, 4), (4, 64, 2, 8),
          (2, 512, 8, 2), (4, 128, 4, 2), (4, 128, 4, 8), (8, 64, 4, 4)]


def _programs(T: int, bt: int, per_sm: int, device) -> int:
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    return max(1, min(triton.cdiv(T, bt), sms * per_sm))


def _backward4(h_res, x, h_post, y, bias, grad_out, transpose_res, tile):
    s, b, n, C = x.shape
    T = s * b
    bt, bc, warps, per_sm = tile
    dx = empty(x.shape, x.dtype, x.device)
    dy = empty(y.shape, y.dtype, y.device)
    dh = empty(h_res.shape, h_res.dtype, x.device)
    dhp = empty(h_post.shape, h_post.dtype, x.device)
    P = _programs(T, bt, per_sm, x.device)
    ws_b = torch.empty((P * bt, C) if bias is not None and T else (1, 1), dtype=torch.float32, device=x.device)
    if T and C:
        _h_post_bda_bwd4[(P,)](h_res, x, h_post, y, bias if bias is not None else y, grad_out, dx, dy, dh, dhp, ws_b,
                               T, C, P, N=n, BT=bt, BC=bc, HAS_BIAS=bias is not None,
                               TRANSPOSE=bool(transpose_res), num_warps=warps)
    else:
        dh.zero_(), dhp.zero_(), ws_b.zero_()
        if not C:
            dh.zero_()
    d_b = sum_rows(ws_b, bias.dtype, bias.shape) if bias is not None else None
    return dh, dx, dhp, dy, d_b


def h_post_bda_backward(h_res, x, h_post, y, bias, grad_out, transpose_res=False, tile_=None):
    h_res, h_post = _check(h_res, x, h_post, y, bias)
    grad_out = grad_out.contiguous()
    s, b, n, C = x.shape
    T = s * b
    if n <= 4 and (tile_ is None or len(tile_) == 4):
        return _backward4(h_res, x, h_post, y, bias, grad_out, transpose_res, tile_ or TILE4)
    dx = empty(x.shape, x.dtype, x.device)
    dy = empty(y.shape, y.dtype, y.device)

    def run(cfg):
        bt, bc, warps = cfg
        n_cb, n_tb = triton.cdiv(C, bc), triton.cdiv(T, bt)
        ws_h = torch.empty((n_cb, T * n * n), dtype=torch.float32, device=x.device)
        ws_hp = torch.empty((n_cb, T * n), dtype=torch.float32, device=x.device)
        ws_b = torch.empty((n_tb, C) if bias is not None else (1, 1), dtype=torch.float32, device=x.device)
        if T and C:
            _h_post_bda_bwd[(n_tb, n_cb)](
                h_res, x, h_post, y, bias if bias is not None else y, grad_out, dx, dy, ws_h, ws_hp, ws_b,
                T, C, N=n, NP=next_pow2(n), BLOCK_T=bt, BLOCK_C=bc, HAS_BIAS=bias is not None,
                TRANSPOSE=bool(transpose_res), num_warps=warps)
        else:
            ws_h.zero_(), ws_hp.zero_(), ws_b.zero_()
        return ws_h, ws_hp, ws_b

    ws_h, ws_hp, ws_b = run(tile_ or backward_tile(C, n))
    d_h = sum_rows(ws_h, h_res.dtype, h_res.shape, ordered=True)
    d_hp = sum_rows(ws_hp, h_post.dtype, h_post.shape, ordered=True)
    d_b = sum_rows(ws_b, bias.dtype, bias.shape) if bias is not None else None
    return d_h, dx, d_hp, dy, d_b


class HPostBdaFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_res, x, h_post, y, bias, transpose_res):
        ctx.save_for_backward(h_res, x, h_post, y, bias)
        ctx.transpose_res = transpose_res
        return h_post_bda_forward(h_res, x, h_post, y, bias, transpose_res)

    @staticmethod
    def backward(ctx, grad_out):
        h_res, x, h_post, y, bias = ctx.saved_tensors
        return (*h_post_bda_backward(h_res, x, h_post, y, bias, grad_out, ctx.transpose_res), None)


def h_post_bda(h_res, x, h_post, y, bias=None, transpose_res: bool = False):
    """Megatron's signature ``h_post_bda(h_res, x, h_post, y, bias)``; ``transpose_res`` by keyword."""
    return HPostBdaFunction.apply(h_res, x, h_post, y, bias, transpose_res)
