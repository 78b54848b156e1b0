"""mix_aggregate's backward in one launch that reads x from DRAM once (bf16 / fp16 x, C a multiple
of 16).

The backward needs x twice: ``grad_h_pre[t, i] = <grad_out[t], x[t, i]>`` is a reduction over a
whole token, and the projection's gradient (hence dx and dW) needs ``grad_h_pre`` through
compute_h. Run as two passes (``mix_aggregate``'s other path) x comes from DRAM twice, 1.9 GB each
time at the paper shape. Here one program per K block of ``BLOCK_K`` columns (one stream's
channels) walks every token block in order, and at step ``s``:

- (A) takes block ``s``'s x tile and grad_out tile, stores its partial of ``grad_h_pre`` (one
  value a token) to ``part[s, k block]`` and adds one to ``count[s]`` (acquire-release). The
  program that brings the count to the number of K blocks sums block ``s``'s partials (per stream,
  in K-block order: the same sum whoever arrives last), runs compute_h's backward for those
  tokens, writes the projection gradient as two pieces of x's dtype and dx's factor of x (as
  ``_split_grad`` does) and the block's alpha / h_bias partials, then raises ``ready[s]``
  (release);
- (B) waits for ``ready[s - LAG]`` (acquire) and runs the projection backward on block
  ``s - LAG`` (``_proj_rms_bwd_packed``'s body with the aggregation term): x's tile read again,
  ``LAG`` steps after (A) read it, from L2.

The wait needs every program resident at once (one program a K block: 224 at the paper shape).
``backward`` checks that against the compiled kernel's registers and shared memory and the
device's SMs; where they do not fit (and under the interpreter, where programs run one after
another) the kernel runs as two launches, all (A) steps, then all (B) steps (``PHASE``), which
reads x twice but computes the same values. A wait that lasts past ``SPINS`` polls (which only
programs that were never resident could cause) gives up: that block's dx is NaN and ``sync[2 MB]``
is set, so a failure shows instead of hanging the device.

dW needs no second reduction: each program owns its K block's columns for every token, so its
accumulator is the gradient, written once in W's dtype (summed over token blocks in order).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from mhctool.poison import empty

from ._common import INTERPRETED, cast, interpreted, next_pow2
from .mapping import h_block_vjp
from .proj_rms import coef_of
from .reduce import sum_rows_pair

# off with MHCTOOL_MIX_ONE_PASS=0 (mix_aggregate's two-pass backward then, as for other shapes)
ONE_PASS = os.environ.get("MHCTOOL_MIX_ONE_PASS", "1") != "0"
BLOCK_M = 64
LAG = 3  # steps between a block's (A) and its (B)
CLOSE = 1  # steps between a block's (A) and its close
SPINS = 1 << 22  # polls of a ready flag before giving up (about seconds: never in a working run)
WARPS = 4
APART = False  # the three launches even where every program fits (sweeps)


@triton.jit
def _missing(v):
    """How many elements of ``v`` still hold the unwritten pattern (all bits set: a NaN that no
    arithmetic and no conversion makes; the buffers start filled with it)."""
    if v.dtype.primitive_bitwidth == 32:
        bad = v.to(tl.int32, bitcast=True) == -1
    else:
        bad = v.to(tl.int16, bitcast=True) == -1
    return tl.sum(bad.to(tl.int32))


@triton.jit
def _a_sum(part_ptr, lost_ptr, s, KB, n: tl.constexpr, NP: tl.constexpr, CPB: tl.constexpr,
           CPBP: tl.constexpr, BLOCK_M: tl.constexpr, SPINS: tl.constexpr):
    """``grad_h_pre`` of token block ``s`` (``[BLOCK_M, NP]``, zero past column n) from the K blocks'
    partials, read (volatile: from L2) until none is unwritten: stream j's sum over its CPB blocks,
    a fixed tree over a tile."""
    q = tl.arange(0, CPBP)
    tok = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, NP)
    g = tl.zeros([BLOCK_M, NP], dtype=tl.float32)
    for j in tl.static_range(n):
        kb = (s * KB + j * CPB).to(tl.int64) + q
        ptrs = part_ptr + kb[:, None] * BLOCK_M + tok[None, :]
        qm = (q < CPB)[:, None]
        tile = tl.load(ptrs, mask=qm, other=0.0, volatile=True)
        miss = _missing(tile)
        polls = 0
        while (miss > 0) & (polls < SPINS):
            tile = tl.load(ptrs, mask=qm, other=0.0, volatile=True)
            miss = _missing(tile)
            polls += 1
        if miss > 0:
            tl.atomic_xchg(lost_ptr, 1)
        g = tl.where(cols[None, :] == j, tl.sum(tile, axis=0)[:, None], g)
    return g


@triton.jit
def _a_close(s, M, K, proj_ptr, r_ptr, rms_ptr, alpha_ptr, hb_ptr, gpost_ptr, glog_ptr, part_ptr, lost_ptr,
             KB, hi_ptr, lo_ptr, cf_ptr, ws_a_ptr, ws_b_ptr, N, n: tl.constexpr, NP: tl.constexpr,
             CPB: tl.constexpr, CPBP: tl.constexpr, BLOCK_M: tl.constexpr, SPINS: tl.constexpr):
    """Token block ``s``'s compute_h backward once every partial is in; its gradient's pieces."""
    rows = s * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    cols = tl.arange(0, NP)
    g_pre = _a_sum(part_ptr, lost_ptr, s, KB, n, NP, CPB, CPBP, BLOCK_M, SPINS)
    dproj, dr, da, db = h_block_vjp(proj_ptr, r_ptr, alpha_ptr, hb_ptr, g_pre, gpost_ptr, glog_ptr, rows, rmask,
                                    N, n, NP)
    r = tl.load(r_ptr + rows, mask=rmask, other=0.0)
    rms = tl.load(rms_ptr + rows, mask=rmask, other=1.0)
    hi = dproj.to(hi_ptr.dtype.element_ty)
    lo = (dproj - hi.to(tl.float32)).to(lo_ptr.dtype.element_ty)
    offs = rows.to(tl.int64)[:, None] * NP + cols[None, :]
    tl.store(hi_ptr + offs, hi, mask=rmask[:, None])
    tl.store(lo_ptr + offs, lo, mask=rmask[:, None])
    tl.store(cf_ptr + rows, coef_of(dr, r, rms, rmask, K), mask=rmask)
    a = tl.arange(0, 4)
    tl.store(ws_a_ptr + s * 3 + a, da, mask=a < 3)
    tl.store(ws_b_ptr + s * N + cols, db, mask=cols < N)


@triton.jit
def _mix_bwd(x_ptr, w_ptr, go_ptr, hp_ptr, proj_ptr, r_ptr, rms_ptr, alpha_ptr, hb_ptr, gpost_ptr, glog_ptr,
             part_ptr, lost_ptr, hi_ptr, lo_ptr, cf_ptr, ws_a_ptr, ws_b_ptr, dx_ptr, dw_ptr,
             M, K, C, N, MB, n: tl.constexpr, NP: tl.constexpr, CPB: tl.constexpr, CPBP: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, PHASE: tl.constexpr, LAG: tl.constexpr,
             CLOSE: tl.constexpr, SPINS: tl.constexpr):
    """``PHASE`` 0: the steps interleaved (every program resident): (A) of block s, the close of
    block ``s - CLOSE`` by program ``(s - CLOSE) % KB``, (B) of block ``s - LAG``. Apart, in three
    launches: 1, the (A) steps; 3, the closes; 2, the (B) steps."""
    kb = tl.program_id(0)
    KB = tl.num_programs(0)
    k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    st = kb // CPB  # the stream of this K block
    ch = k - st * C  # its channels
    cols = tl.arange(0, NP)
    tok = tl.arange(0, BLOCK_M)
    if PHASE == 3:
        for c in range(kb, MB, KB):
            _a_close(c, M, K, proj_ptr, r_ptr, rms_ptr, alpha_ptr, hb_ptr, gpost_ptr, glog_ptr, part_ptr, lost_ptr,
                     KB, hi_ptr, lo_ptr, cf_ptr, ws_a_ptr, ws_b_ptr, N, n, NP, CPB, CPBP, BLOCK_M, SPINS)
        return
    w = tl.load(w_ptr + cols[:, None] * K + k[None, :], mask=cols[:, None] < N, other=0.0)
    if INTERPRETED:
        w = w.to(tl.float32)  # the interpreter's low-precision tl.dot is unreliable (the values are exact)
    dwt = tl.zeros([BLOCK_K, NP], dtype=tl.float32)
    zero = tl.zeros([BLOCK_K, NP], dtype=tl.float32) + (M * 0.0)  # a fresh accumulator a block (proj_rms._dot)
    steps = MB
    if PHASE == 0:
        steps = MB + LAG
    for s in range(0, steps):
        if PHASE != 2:
            # (A), loads first: block s's x and grad_out tiles (masked off past the last block)
            rows = s * BLOCK_M + tok
            ma = (rows < M)[:, None]
            rows64 = rows.to(tl.int64)[:, None]
            xa = tl.load(x_ptr + rows64 * K + k[None, :], mask=ma, other=0.0)
            ga = tl.load(go_ptr + rows64 * C + ch[None, :], mask=ma, other=0.0)
        if PHASE == 0:
            c = s - CLOSE
            if (c >= 0) & (c < MB):
                if c % KB == kb:
                    _a_close(c, M, K, proj_ptr, r_ptr, rms_ptr, alpha_ptr, hb_ptr, gpost_ptr, glog_ptr, part_ptr,
                             lost_ptr, KB, hi_ptr, lo_ptr, cf_ptr, ws_a_ptr, ws_b_ptr, N, n, NP, CPB, CPBP, BLOCK_M,
                             SPINS)
        if PHASE != 1:
            # (B): the projection backward on block t, once its gradient's pieces are written
            t = s - LAG if PHASE == 0 else s
            if t >= 0:
                rows = t * BLOCK_M + tok
                rmask = rows < M
                mask = rmask[:, None]
                rows64 = rows.to(tl.int64)[:, None]
                offs = rows64 * K + k[None, :]
                goffs = rows64 * NP + cols[None, :]
                g_hi = tl.load(hi_ptr + goffs, mask=mask, other=0.0, volatile=True)
                g_lo = tl.load(lo_ptr + goffs, mask=mask, other=0.0, volatile=True)
                coef = tl.load(cf_ptr + rows, mask=rmask, other=0.0, volatile=True)
                miss = _missing(g_hi) + _missing(g_lo) + _missing(coef)
                polls = 0
                while (miss > 0) & (polls < SPINS):
                    g_hi = tl.load(hi_ptr + goffs, mask=mask, other=0.0, volatile=True)
                    g_lo = tl.load(lo_ptr + goffs, mask=mask, other=0.0, volatile=True)
                    coef = tl.load(cf_ptr + rows, mask=rmask, other=0.0, volatile=True)
                    miss = _missing(g_hi) + _missing(g_lo) + _missing(coef)
                    polls += 1
                if miss > 0:
                    tl.atomic_xchg(lost_ptr, 1)  # the pieces left unwritten are NaN: dx shows it
                xl = tl.load(x_ptr + offs, mask=mask, other=0.0)
                hs = tl.load(hp_ptr + rows * n + st, mask=rmask, other=0.0)
                gb = tl.load(go_ptr + rows64 * C + ch[None, :], mask=mask, other=0.0)
                xm = xl
                if INTERPRETED:
                    xm, g_hi, g_lo = xl.to(tl.float32), g_hi.to(tl.float32), g_lo.to(tl.float32)
                prod = tl.dot(g_hi, w, tl.dot(g_lo, w))
                xt = tl.trans(xm)
                dwt += tl.dot(xt, g_hi, tl.dot(xt, g_lo, zero))
                dx = prod + coef[:, None] * xl.to(tl.float32)
                dx += hs[:, None] * gb.to(tl.float32)
                tl.store(dx_ptr + offs, cast(dx, dx_ptr.dtype.element_ty), mask=mask)
        if PHASE != 2:
            if s < MB:
                part = tl.sum(xa.to(tl.float32) * ga.to(tl.float32), axis=1)
                tl.store(part_ptr + (s * KB + kb).to(tl.int64) * BLOCK_M + tok, part)
    if PHASE != 1:
        tl.store(dw_ptr + cols[None, :] * K + k[:, None], cast(dwt, dw_ptr.dtype.element_ty),
                 mask=cols[None, :] < N)


def k_block(C: int) -> int:
    """The K block: the largest of 128, 64, 32 and 16 that divides C (each block in one stream);
    0 where none does (the two-pass backward then)."""
    return next((bk for bk in (128, 64, 32, 16) if C % bk == 0), 0)


def usable(x, g_out) -> bool:
    """Whether ``backward`` takes these: an upstream gradient of the aggregate, bf16 / fp16 x on a
    GPU (any float dtype under the interpreter), C a multiple of 16, not turned off with
    ``MHCTOOL_MIX_ONE_PASS=0`` (``ONE_PASS``)."""
    if g_out is None or not ONE_PASS or not k_block(x.shape[-1]):
        return False
    return interpreted() or x.dtype in (torch.bfloat16, torch.float16)


_RESIDENT: dict = {}
# how the last backward ran (tests, sweeps): 1 launch (interleaved) or 3 (the phases apart), and its
# lost flag (-1: no wait gave up)
LAST: dict = {"launches": 0, "lost": None}


def _all_resident(kernel, programs: int, device) -> bool:
    """Whether ``programs`` programs of the compiled ``kernel`` fit on the device at once (registers,
    shared memory, threads; one SM's share rounded as the hardware allocates)."""
    props = torch.cuda.get_device_properties(device)
    _ = kernel.run  # loads the binary: n_regs is known from then
    warps = kernel.metadata.num_warps
    regs_warp = -(-max(kernel.n_regs, 1) * 32 // 256) * 256
    by_regs = getattr(props, "regs_per_multiprocessor", 65536) // (regs_warp * warps)
    smem_sm = getattr(props, "shared_memory_per_multiprocessor", 228 * 1024)
    by_smem = smem_sm // (kernel.metadata.shared + 1024)  # 1 KB a block is the driver's
    by_threads = getattr(props, "max_threads_per_multi_processor", 2048) // (32 * warps)
    fits = min(by_regs, by_smem, by_threads) * props.multi_processor_count
    LAST["resources"] = dict(regs=kernel.n_regs, spills=kernel.n_spills, shared=kernel.metadata.shared,
                             programs=programs, resident=fits)
    return programs <= fits


def backward(x, weight, alpha, h_bias, pre, saved, g_out, g_post, g_log):
    """``(dx [s, b, n, C], dW, d_alpha, d_bias)`` of mix_aggregate from the forward's saved values
    (``pre [M, n]``, ``saved = (proj [M, N], r, rms)``) and the upstream gradients (``g_log``: the
    Sinkhorn backward's, ``[M, n, n]`` or None; ``g_post`` ``[M, n]`` or None)."""
    s_, b_, n, C = x.shape
    M, K, N = s_ * b_, n * C, weight.shape[0]
    proj, r, rms = saved
    dev = x.device
    NP = max(16, next_pow2(N))
    bk = k_block(C)
    KB, MB = K // bk, triton.cdiv(M, BLOCK_M)
    weight, alpha, h_bias = weight.contiguous(), alpha.contiguous(), h_bias.contiguous()
    g_post, g_log = (torch.zeros(shape, dtype=torch.float32, device=dev) if g is None else g.float().contiguous()
                     for g, shape in ((g_post, (M, n)), (g_log, (M, n, n))))
    dx = empty(x.shape, x.dtype, dev)
    dw = empty(weight.shape, weight.dtype, dev)
    alloc = empty if M else torch.zeros
    ws_a = alloc((max(MB, 1), 3), dtype=torch.float32, device=dev)
    ws_b = alloc((max(MB, 1), N), dtype=torch.float32, device=dev)
    if M:
        cpb, esize = C // bk, x.element_size()
        # one buffer, filled with all bits set (``_missing``'s unwritten pattern) in one launch: the
        # lost flag (set to 1 by a wait that gave up), the partials, the gradient's pieces, dx's factor
        sizes = (16, MB * KB * BLOCK_M * 4, M * NP * esize, M * NP * esize, M * 4)
        ends = [sum(sizes[:i + 1]) for i in range(len(sizes))]
        buf = torch.empty((ends[-1],), dtype=torch.uint8, device=dev).fill_(255)
        lost, part, hi, lo, cf = (buf[e - z:e].view(dt) for e, z, dt in zip(
            ends, sizes, (torch.int32, torch.float32, x.dtype, x.dtype, torch.float32)))
        args = (x, weight, g_out.contiguous(), pre.float().contiguous(), proj, r, rms, alpha, h_bias, g_post,
                g_log, part, lost, hi, lo, cf, ws_a, ws_b, dx, dw, M, K, C, N, MB)
        meta = dict(n=n, NP=NP, CPB=cpb, CPBP=next_pow2(cpb), BLOCK_M=BLOCK_M, BLOCK_K=bk, LAG=LAG, CLOSE=CLOSE,
                    SPINS=SPINS, num_warps=WARPS)
        one = False
        if not interpreted() and not APART:
            key = (dev.index, x.dtype, n, bk, cpb, KB, LAG, CLOSE, WARPS)
            if key not in _RESIDENT:
                _RESIDENT[key] = _all_resident(_mix_bwd.warmup(*args, grid=(KB,), PHASE=0, **meta), KB, dev)
            one = _RESIDENT[key]
        LAST.update(launches=1 if one else 3, lost=lost[0])
        for phase in ((0,) if one else (1, 3, 2)):
            _mix_bwd[(KB,)](*args, PHASE=phase, **meta)
    elif K:
        dw.zero_()
    d_alpha, d_bias = sum_rows_pair((ws_a, alpha.dtype, alpha.shape, False), (ws_b, h_bias.dtype, h_bias.shape, False))
    return dx, dw, d_alpha, d_bias
