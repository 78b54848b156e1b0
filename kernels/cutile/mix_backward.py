"""mix_aggregate's backward reading x once from memory (cuTile): one launch of persistent programs,
one a SM, that pass token blocks between them through flags. Off (``mix_aggregate.ONE_PASS``):
on an H100 its launch has not ended, even at 37x5x4x256 (docs/perf-notes.md, twenty-eighth
session); ``dev/mix_once.py diag`` runs it alone and reads its flags while it runs.

The two-pass backward (``mix_aggregate.py``) reads x and grad_out for ``grad_h_pre[t, i] =
sum_c x[t, i, c] grad_out[t, c]``, and again in the projection backward that writes dx, because a
token's projection gradient needs that whole sum first: 6.58 GB moved at the paper shape, where
x, grad_out and dx are 4.23. Here each of ``WK`` workers owns a K block of ``2H`` columns (two
halves, the projection backward's form) and walks every token block ``s``:

- (A) block s's partial of grad_h_pre over its columns into ``part[s, stream, worker]``, then a
  release count on ``cnt[s]``;
- (B) block ``s - LAG`` once ``done`` says it is closed: the projection backward with the
  aggregation term (``proj_rms._bwd_half``), x's and grad_out's tiles read again, from L2 now
  (at the paper shape a block's tiles over all workers are 4.6 MB: 18 MB for LAG 4), dx written
  and dW accumulated over all tokens in the worker's own fp32 accumulator (no token splits, no
  sum).

``CL`` closers take token blocks in turn (closer j: blocks j, j + CL, ...): wait for the block's
WK counts (acquire), sum the partials per stream in a fixed order, run compute_h's backward on
it (``mapping.bwd_h_block``: the packed gradient and the block's bias / alpha partials) and raise
``done`` (release). Sinkhorn's backward does not need grad_out and runs before, as its own launch.

Every program must be resident at once, or a worker waits for a closer that never starts: the
launch has no more programs than SMs (``plan``; a program takes 215 KB of shared memory, so one
a SM), and every wait gives up after ``SPIN_LIMIT`` polls, counting the give-up in ``err``; once
one has, no later wait polls (the results are then wrong, not hung; the GPU test reads ``err``).
That bounds the handshake between programs only; the hang seen on the GPU is not explained by it.
cuTile keeps its TMA loads pipelined around acquire polls (offline SASS, docs/perf-notes.md,
twenty-sixth session), which Triton does not.
"""
from __future__ import annotations

import cuda.tile as ct
import torch
from cuda.tile._memory_model import MemoryOrder, MemoryScope

from mhctool.poison import empty

from ..schedule import next_pow2
from ._common import array, cdiv, launch, sum_partials, tile_ir
from .mapping import bwd_h_block
from .proj_rms import _bwd_half, _ng

CI = ct.Constant[int]
ZERO = ct.PaddingMode.ZERO
ACQ, REL, DEV = MemoryOrder.ACQUIRE, MemoryOrder.RELEASE, MemoryScope.DEVICE

BM = 64  # tokens a block
H = 128  # columns a half; a worker takes two
LAG = 4  # token blocks between a worker's (A) and its (B)
CLOSERS = 20  # at most; fewer where the SMs left over or the token blocks are fewer
SPIN_LIMIT = 1 << 22  # polls before a wait gives up (about a second or more, far past any block's close)
LAST_ERR = None  # the last launch's count of waits given up (an int32 [1] CUDA tensor; tests read it)


def _read(flags, t):
    """``flags[t]`` read with acquire, as an atomic add of 0: one thread does it and the program
    shares its one result (offline SASS: one lane's ``ATOMG``, then shared memory and a barrier,
    and on to the TMA producer warp, which runs its own copy of the poll loop). A tile load is made
    by each thread, the producer's too, and their values can differ while other programs write:
    warps that disagree on the loop's trip count never meet at its barriers. The per-thread form
    hung on an H100; this form hung too, so that was not the only cause (twenty-eighth session)."""
    return ct.atomic_add(flags, (t,), 0, memory_order=ACQ, memory_scope=DEV)


def _wait(flags, t, want, err, LIMIT):
    """Poll ``flags[t]`` with acquire until it reaches ``want``; after ``LIMIT`` polls give up and
    count it in ``err[0]``. Once any wait has given up, later ones do not poll at all (so a fault
    costs one ``LIMIT`` per program, not one per wait)."""
    f = _read(flags, t)
    spins = ct.minimum(_read(err, 0), 1) * LIMIT
    while (f < want) & (spins < LIMIT):
        f = _read(flags, t)
        spins = spins + 1
    if spins >= LIMIT:
        ct.atomic_add(err, (0,), 1)


# eight warps of CUDA-core work (``num_worker_warps``): with the default four, the (A) and (B) steps
# in one loop body spilled (offline, tileiras 13.4, sm_90: 168 registers, a 296-byte stack, 129
# LDL / 156 STL); with eight, 168 registers, no stack, 215 KB of shared memory
@ct.kernel(num_worker_warps=8)
def _mix_bwd_once(x, go, w, hp, proj, r, rms, alpha, bias, g_post, g_logits, part, cnt, done, gc, ws, dx, dw, err,
                  n: CI, N: CI, NG: CI, NP: CI, NPN: CI, BM: CI, H: CI, WK: CI, KPS: CI, KP2: CI, HC: CI, C: CI,
                  CL: CI, LAG: CI, K: CI, LIMIT: CI):
    """Programs [0, WK) are workers (K block ``kb``: halves 2 kb and 2 kb + 1, in stream kb // KPS),
    [WK, WK + CL) closers. See the module's docstring."""
    b = ct.bid(0)
    nb = ct.num_tiles(x, axis=0, shape=(BM, H))  # token blocks: a runtime count, so no loop is unrolled
    if b < WK:
        kb = b
        k0, k1 = 2 * kb, 2 * kb + 1
        st = kb // KPS
        c0 = k0 - st * HC
        w0 = ct.load(w, index=(0, k0), shape=(NG, H), padding_mode=ZERO)
        w1 = ct.load(w, index=(0, k1), shape=(NG, H), padding_mode=ZERO)
        acc0 = ct.zeros((NG, H), dtype=ct.float32)
        acc1 = ct.zeros((NG, H), dtype=ct.float32)
        for step in range(nb + LAG):
            if step < nb:  # (A)
                x0 = ct.load(x, index=(step, k0), shape=(BM, H), padding_mode=ZERO).astype(ct.float32)
                x1 = ct.load(x, index=(step, k1), shape=(BM, H), padding_mode=ZERO).astype(ct.float32)
                g0 = ct.load(go, index=(step, c0), shape=(BM, H), padding_mode=ZERO).astype(ct.float32)
                g1 = ct.load(go, index=(step, c0 + 1), shape=(BM, H), padding_mode=ZERO).astype(ct.float32)
                p = ct.sum(x0 * g0, axis=1) + ct.sum(x1 * g1, axis=1)
                ct.store(part, index=(step, st, kb - st * KPS, 0), tile=ct.reshape(p, (1, 1, 1, BM)), allow_tma=False)
                ct.atomic_add(cnt, (step,), 1, memory_order=REL, memory_scope=DEV)
            t = step - LAG
            if t >= 0:  # (B)
                _wait(done, t, 1, err, LIMIT)
                g = ct.load(gc, index=(t, 0), shape=(BM, NG), padding_mode=ZERO, allow_tma=False)
                coef = ct.extract(g, index=(0, N), shape=(BM, 1))
                hpt = ct.load(hp, index=(t, 0), shape=(BM, NPN), padding_mode=ZERO)
                acc0 = acc0 + _bwd_half(x, dx, w0, g, coef, t, k0, NG, BM, H, True, hp, go, hpt, 1, HC, C, NPN)
                acc1 = acc1 + _bwd_half(x, dx, w1, g, coef, t, k1, NG, BM, H, True, hp, go, hpt, 1, HC, C, NPN)
        ct.store(dw, index=(0, k0), tile=acc0.astype(dw.dtype))
        ct.store(dw, index=(0, k1), tile=acc1.astype(dw.dtype))
    else:
        j = b - WK
        cols = ct.reshape(ct.arange(NP, dtype=ct.int32), (1, NP))
        for t in range(j, nb, CL):
            _wait(cnt, t, WK, err, LIMIT)
            g = ct.zeros((BM, NP), dtype=ct.float32)
            for s in range(n):  # stream s's partials, summed over its workers in a fixed order
                ps = ct.load(part, index=(t, s, 0, 0), shape=(1, 1, KP2, BM), padding_mode=ZERO, allow_tma=False)
                v = ct.reshape(ct.sum(ps, axis=2), (BM, 1))
                g = g + ct.where(cols == s, v, 0.0)
            bwd_h_block(proj, r, rms, alpha, bias, g_post, g_logits, gc, ws, g, t, n, N, NP, BM, K)
            ct.atomic_add(done, (t,), 1, memory_order=REL, memory_scope=DEV)


def plan(m: int, n: int, c: int, x_dtype, w_dtype, sms: int) -> tuple[int, int] | None:
    """``(workers, closers)`` where this backward applies on a GPU of ``sms`` SMs, else None (then
    the two passes run): bf16 x and W (the tensor-core path), a worker's 2H columns inside one
    stream (C a multiple of 2H), and every program resident at once with at least one closer
    (workers + closers <= SMs, one program a SM)."""
    if x_dtype != torch.bfloat16 or w_dtype != torch.bfloat16 or m == 0 or c % (2 * H):
        return None
    wk = n * c // (2 * H)
    cl = min(CLOSERS, sms - wk, cdiv(m, BM))
    return (wk, cl) if cl >= 1 else None


def backward(saved, pre, g_out, g_post, g_logits, workers: int, closers: int):
    """``(dx, dW, d alpha, d h_bias)`` of mix_aggregate from the mapping forward's ``saved``
    (``mapping.forward``), ``pre`` (H_pre fp32 ``[M, n]``), ``g_out`` (``[M, C]``) and the fp32
    gradients of H_post ``[M, n]`` and the logits ``[M, n, n]`` (Sinkhorn's backward done); a
    ``plan``'s workers and closers. The launch's count of waits given up is left in ``LAST_ERR``."""
    dx, dw, ws, _, err = start(saved, pre, g_out, g_post, g_logits, workers, closers)
    global LAST_ERR
    LAST_ERR = err
    np_ = ws.shape[1] - 4
    nr = saved[1].shape[0]
    sums = empty((np_ + 4,), torch.float32, ws.device)
    sum_partials(ws, sums, next_pow2(np_ + 4), 128)
    return dx, dw, sums[np_:np_ + 3].to(saved[2].dtype), sums[:nr].to(saved[3].dtype)


def start(saved, pre, g_out, g_post, g_logits, workers: int, closers: int, programs: int | None = None):
    """Launch the kernel (``backward``'s arguments) and return what it writes, without waiting for
    it: ``(dx, dW, the bias / alpha rows a token block, flags, err)``. ``flags[0]`` counts each
    token block's workers done with (A), ``flags[1]`` marks blocks whose closer is done; a copy on
    another stream reads them while the kernel runs (``dev/mix_once.py diag``). ``programs``: launch
    only the first so many (the workers alone, for ``diag``); the default launches all."""
    x2d, weight, a3, bias, proj, r, rms = saved
    m = x2d.shape[0]
    n = pre.shape[1]
    c = g_out.shape[1]
    np_ = proj.shape[1]
    ng = _ng(weight.shape[0])
    if ng != np_:
        raise ValueError(f"mix_aggregate backward: the packed gradient needs {ng} columns, the projection has {np_}")
    dev = x2d.device
    nb = cdiv(m, BM)
    part = empty((nb, n, c // (2 * H), BM), torch.float32, dev)
    flags = torch.zeros((2, nb), dtype=torch.int32, device=dev)
    err = torch.zeros((1,), dtype=torch.int32, device=dev)
    gc = empty((m, ng), torch.float32, dev)
    ws = empty((nb, np_ + 4), torch.float32, dev)
    dx = empty(x2d.shape, x2d.dtype, dev)
    dw = empty(weight.shape, weight.dtype, dev)
    launch(_mix_bwd_once, (workers + closers if programs is None else programs,),
           (x2d, g_out, weight, pre, proj, r, rms, a3, bias, g_post, g_logits.reshape(m, n * n), part, flags[0],
            flags[1], gc, ws, dx, dw, err, *constants(n, c, workers, closers)))
    return dx, dw, ws, flags, err


def constants(n: int, c: int, workers: int, closers: int) -> list[int]:
    """The kernel's compile-time parameters for ``n`` streams of ``c`` channels and a ``plan``."""
    nr = n * n + 2 * n
    kps = c // (2 * H)
    return [n, nr, _ng(nr), _ng(nr), next_pow2(n), BM, H, workers, kps, next_pow2(kps), c // H, c, closers, LAG,
            n * c, SPIN_LIMIT]


def signature(arr=array, n: int = 4, c: int = 7168, workers: int = 112, closers: int = 20) -> list:
    """The kernel's parameters for ``tile_ir`` (bf16; by default the paper shape's, 8192x4x4x7168 on
    132 SMs): ``arr`` makes each array's description (``_common.array``, or a launch-like aligned one
    for offline SASS). The token count is not among them: the kernel reads it from x at run time."""
    bf, f32, i32 = torch.bfloat16, torch.float32, torch.int32
    f1, f2 = arr(f32, 1), arr(f32, 2)
    return [arr(bf, 2), arr(bf, 2), arr(bf, 2), f2, f2, f1, f1, f1, f1, f2, f2, arr(f32, 4), arr(i32, 1), arr(i32, 1),
            f2, f2, arr(bf, 2), arr(bf, 2), arr(i32, 1), *constants(n, c, workers, closers)]


def compile_checks() -> dict[str, bytes]:
    return {"bwd-once": tile_ir(_mix_bwd_once, signature())}
