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
CHUNK = 4  # token blocks a chunk: the workers wait (and their inner loops restart) once a chunk
LAG = 1  # chunks between a chunk's (A) and its (B)
CLOSERS = 8  # programs that close token blocks, beside the K-block workers
STAGES = 3  # the inner loops' pipeline stages
MAX_BK = 128  # the widest K block
STAGGER = 1  # K block kb starts a chunk at its block kb * STAGGER (mod the chunk): programs apart in L2
SPINS = 1 << 22  # polls of a counter before giving up (about seconds: never in a working run)
WARPS = 4
APART = False  # the three launches even where every program fits (sweeps)
TIMED = None  # a list: each launch's (phase, (start, end) events) appended to it (dev/mix_one_pass.py)


@triton.jit
def _wait(ptr, want, lost_ptr, SPINS: tl.constexpr):
    """Poll ``*ptr`` (acquire) until it reaches ``want``; past ``SPINS`` polls give up and set the
    lost flag (the values read after are then unready: NaN where the buffers are poisoned)."""
    got = tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")
    polls = 0
    while (got < want) & (polls < SPINS):
        got = tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")
        polls += 1
    if got < want:
        tl.atomic_xchg(lost_ptr, 1)


@triton.jit
def _a_sum(part_ptr, s, KB, n: tl.constexpr, NP: tl.constexpr, CPB: tl.constexpr, CPBP: tl.constexpr,
           BLOCK_M: tl.constexpr):
    """``grad_h_pre`` of token block ``s`` (``[BLOCK_M, NP]``, zero past column n) from the K blocks'
    partials: stream j's sum over its CPB blocks, a fixed tree over a tile (read past L1: other
    programs wrote them)."""
    q = tl.arange(0, CPBP)
    tok = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, NP)
    g = tl.zeros([BLOCK_M, NP], dtype=tl.float32)
    for j in tl.static_range(n):
        kb = (s * KB + j * CPB).to(tl.int64) + q
        tile = tl.load(part_ptr + kb[:, None] * BLOCK_M + tok[None, :], mask=(q < CPB)[:, None], other=0.0,
                       cache_modifier=".cg")
        g = tl.where(cols[None, :] == j, tl.sum(tile, axis=0)[:, None], g)
    return g


@triton.jit
def _close(s, M, K, proj_ptr, r_ptr, rms_ptr, alpha_ptr, hb_ptr, gpost_ptr, glog_ptr, part_ptr, KB,
           hi_ptr, lo_ptr, cf_ptr, ws_a_ptr, ws_b_ptr, N, n: tl.constexpr, NP: tl.constexpr,
           CPB: tl.constexpr, CPBP: tl.constexpr, BLOCK_M: tl.constexpr):
    """Token block ``s``'s compute_h backward from its partials; its gradient's pieces."""
    rows = s * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    cols = tl.arange(0, NP)
    g_pre = _a_sum(part_ptr, s, KB, n, NP, CPB, CPBP, BLOCK_M)
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
             part_ptr, sync_ptr, hi_ptr, lo_ptr, cf_ptr, ws_a_ptr, ws_b_ptr, dx_ptr, dw_ptr,
             M, K, C, N, MB, NCH, n: tl.constexpr, NP: tl.constexpr, CPB: tl.constexpr, CPBP: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, CHUNK: tl.constexpr, LAG: tl.constexpr,
             CLOSERS: tl.constexpr, STAGES: tl.constexpr, STAGGER: tl.constexpr, PHASE: tl.constexpr, SPINS: tl.constexpr):
    """Programs ``[0, KB)`` are the K blocks' workers, the ``CLOSERS`` after them close token blocks.
    ``PHASE`` 0: every program resident, waits between them; apart (three launches, nothing waits):
    1, the workers' (A); 3, the closes; 2, the workers' (B). ``sync``: per chunk the workers'
    (A) count, then per chunk the closed blocks' count, then the lost flag."""
    pid = tl.program_id(0)
    KB = tl.num_programs(0) - CLOSERS
    done_ptr = sync_ptr + NCH
    lost_ptr = sync_ptr + 2 * NCH
    if pid >= KB:
        if PHASE == 0 or PHASE == 3:
            for s in range(pid - KB, MB, CLOSERS):
                ci = s // CHUNK
                if PHASE == 0:
                    _wait(sync_ptr + ci, KB, lost_ptr, SPINS)
                _close(s, M, K, proj_ptr, r_ptr, rms_ptr, alpha_ptr, hb_ptr, gpost_ptr, glog_ptr, part_ptr, KB,
                       hi_ptr, lo_ptr, cf_ptr, ws_a_ptr, ws_b_ptr, N, n, NP, CPB, CPBP, BLOCK_M)
                tl.debug_barrier()  # every thread's stores before the count
                tl.atomic_add(done_ptr + ci, 1, sem="release", scope="gpu")
        return
    kb = pid
    k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    st = kb // CPB  # the stream of this K block
    ch = k - st * C  # its channels
    cols = tl.arange(0, NP)
    tok = tl.arange(0, BLOCK_M)
    w = tl.load(w_ptr + cols[:, None] * K + k[None, :], mask=cols[:, None] < N, other=0.0)
    if INTERPRETED:
        w = w.to(tl.float32)  # the interpreter's low-precision tl.dot is unreliable (the values are exact)
    dwt = tl.zeros([BLOCK_K, NP], dtype=tl.float32)
    zero = tl.zeros([BLOCK_K, NP], dtype=tl.float32) + (M * 0.0)  # a fresh accumulator a block (proj_rms._dot)
    rounds = NCH
    if PHASE == 0:
        rounds = NCH + LAG
    for i in range(0, rounds):
        if PHASE == 0 or PHASE == 1:
            if i < NCH:
                # (A) over chunk i: each block's partial of grad_h_pre
                a_lo = i * CHUNK
                a_n = tl.minimum(a_lo + CHUNK, MB) - a_lo
                for j in tl.range(0, a_n, num_stages=STAGES):
                    s = a_lo + (j + kb * STAGGER) % a_n
                    rows = s * BLOCK_M + tok
                    ma = (rows < M)[:, None]
                    rows64 = rows.to(tl.int64)[:, None]
                    xa = tl.load(x_ptr + rows64 * K + k[None, :], mask=ma, other=0.0)
                    ga = tl.load(go_ptr + rows64 * C + ch[None, :], mask=ma, other=0.0)
                    part = tl.sum(xa.to(tl.float32) * ga.to(tl.float32), axis=1)
                    tl.store(part_ptr + (s * KB + kb).to(tl.int64) * BLOCK_M + tok, part)
                if PHASE == 0:
                    tl.debug_barrier()  # every thread's partials before the count
                    tl.atomic_add(sync_ptr + i, 1, sem="release", scope="gpu")
        if PHASE == 0 or PHASE == 2:
            t = i - LAG if PHASE == 0 else i
            if t >= 0:
                lo_s = t * CHUNK
                hi_s = tl.minimum(lo_s + CHUNK, MB)
                if PHASE == 0:
                    _wait(done_ptr + t, hi_s - lo_s, lost_ptr, SPINS)
                # (B) over chunk t: the projection backward with the aggregation term
                for j in tl.range(0, hi_s - lo_s, num_stages=STAGES):
                    s = lo_s + (j + kb * STAGGER) % (hi_s - lo_s)
                    rows = s * BLOCK_M + tok
                    rmask = rows < M
                    mask = rmask[:, None]
                    rows64 = rows.to(tl.int64)[:, None]
                    offs = rows64 * K + k[None, :]
                    goffs = rows64 * NP + cols[None, :]
                    xl = tl.load(x_ptr + offs, mask=mask, other=0.0)
                    g_hi = tl.load(hi_ptr + goffs, mask=mask, other=0.0, cache_modifier=".cg")
                    g_lo = tl.load(lo_ptr + goffs, mask=mask, other=0.0, cache_modifier=".cg")
                    coef = tl.load(cf_ptr + rows, mask=rmask, other=0.0, cache_modifier=".cg")
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
    if PHASE == 0 or PHASE == 2:
        tl.store(dw_ptr + cols[None, :] * K + k[:, None], cast(dwt, dw_ptr.dtype.element_ty),
                 mask=cols[None, :] < N)


def k_block(C: int) -> int:
    """The K block: the largest of 128, 64, 32 and 16 that divides C (each block in one stream);
    0 where none does (the two-pass backward then)."""
    return next((bk for bk in (128, 64, 32, 16) if C % bk == 0 and bk <= MAX_BK), 0)


def usable(x, g_out) -> bool:
    """Whether ``backward`` takes these: an upstream gradient of the aggregate, bf16 / fp16 x on a
    GPU (any float dtype under the interpreter), C a multiple of 16, not turned off with
    ``MHCTOOL_MIX_ONE_PASS=0`` (``ONE_PASS``)."""
    if g_out is None or not ONE_PASS or not k_block(x.shape[-1]):
        return False
    return interpreted() or x.dtype in (torch.bfloat16, torch.float16)


_RESIDENT: dict = {}
# how the last backward ran (tests, sweeps): 1 launch (interleaved) or 3 (the phases apart), and its
# lost flag (0: no wait gave up)
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
        cpb, nch = C // bk, triton.cdiv(MB, CHUNK)
        part = empty((MB, KB, BLOCK_M), torch.float32, dev)
        sync = torch.zeros((2 * nch + 1,), dtype=torch.int32, device=dev)
        hi, lo = empty((M, NP), x.dtype, dev), empty((M, NP), x.dtype, dev)
        cf = empty((M,), torch.float32, dev)
        args = (x, weight, g_out.contiguous(), pre.float().contiguous(), proj, r, rms, alpha, h_bias, g_post,
                g_log, part, sync, hi, lo, cf, ws_a, ws_b, dx, dw, M, K, C, N, MB, nch)
        meta = dict(n=n, NP=NP, CPB=cpb, CPBP=next_pow2(cpb), BLOCK_M=BLOCK_M, BLOCK_K=bk, CHUNK=CHUNK, LAG=LAG,
                    CLOSERS=CLOSERS, STAGES=STAGES, STAGGER=STAGGER, SPINS=SPINS, num_warps=WARPS)
        grid = (KB + CLOSERS,)
        one = False
        if not interpreted() and not APART:
            key = (dev.index, x.dtype, n, bk, cpb, KB, CHUNK, LAG, CLOSERS, STAGES, STAGGER, WARPS)
            if key not in _RESIDENT:
                _RESIDENT[key] = _all_resident(_mix_bwd.warmup(*args, grid=grid, PHASE=0, **meta), grid[0], dev)
            one = _RESIDENT[key]
        LAST.update(launches=1 if one else 3, lost=sync[-1])
        for phase in ((0,) if one else (1, 3, 2)):
            if TIMED is not None:
                ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
                ev[0].record()
            _mix_bwd[grid](*args, PHASE=phase, **meta)
            if TIMED is not None:
                ev[1].record()
                TIMED.append((phase, ev))
    elif K:
        dw.zero_()
    d_alpha, d_bias = sum_rows_pair((ws_a, alpha.dtype, alpha.shape, False), (ws_b, h_bias.dtype, h_bias.shape, False))
    return dx, dw, d_alpha, d_bias
