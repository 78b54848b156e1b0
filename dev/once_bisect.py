"""Which part of the read-x-once backward's worker loop (kernels/cutile/mix_backward.py) keeps its
launch from ending. The twenty-ninth session's `dev/mix_once.py diag 0` showed the workers alone,
with no poll loop compiled at all (SPIN_LIMIT 0), finishing every (A) step and then never ending;
so the hang is in the loop's structure, not in a wait between programs. ``bisect`` is the worker's
loop with each part behind a compile-time switch, launched as workers only (no closers: ``done``
is set beforehand, so a poll ends at once):

    python3 dev/once_bisect.py [NAME ...]   # each variant in its own process (a hang ends it), on a GPU
    python3 dev/once_bisect.py --offline    # each variant through tileiras (TILEIRAS, NVDISASM, CUOBJDUMP)

Switches: A (the (A) step), ATOM (its release count), B (the (B) step), AGG (the aggregation term
in (B)), READ (0: no wait, 1: ``_wait`` with LIMIT 0, 2: ``_wait`` polling), LAG, NBC (0: the
token-block count read at run time, as shipped; else that constant).
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import cuda.tile as ct
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels.cutile._common import array  # noqa: E402
from kernels.cutile.mix_backward import ACQ, DEV, REL, ZERO, _wait  # noqa: E402
from kernels.cutile.proj_rms import _bwd_half, _ng  # noqa: E402
from kernels.schedule import next_pow2  # noqa: E402

CI = ct.Constant[int]
SHIPPED = dict(A=1, ATOM=1, B=1, AGG=1, READ=1, LAG=4, NBC=0)
VARIANTS = {
    "shipped": {},
    "no-read": dict(READ=0),
    "polls": dict(READ=2),
    "no-atom": dict(ATOM=0),
    "A-only": dict(B=0),
    "B-only": dict(A=0),
    "no-agg": dict(AGG=0),
    "lag-0": dict(LAG=0),
    "nb-const": dict(NBC=3),
    "B-only-no-read": dict(A=0, READ=0),
}
SHAPE = (37, 5, 4, 256)  # m 185 (three token blocks, the last cut), K 1024: four workers
BM, H = 64, 128


@ct.kernel(num_worker_warps=8)
def bisect(x, go, w, hp, gc, part, cnt, done, err, dx, dw, N: CI, NG: CI, NPN: CI, BM: CI, H: CI, KPS: CI, HC: CI,
           C: CI, A: CI, ATOM: CI, B: CI, AGG: CI, READ: CI, LAG: CI, NBC: CI):
    kb = ct.bid(0)
    if NBC == 0:
        nb = ct.num_tiles(x, axis=0, shape=(BM, H))
    else:
        nb = NBC
    k0, k1 = 2 * kb, 2 * kb + 1
    st = kb // KPS
    c0 = k0 - st * HC
    w0 = ct.load(w, index=(0, k0), shape=(NG, H), padding_mode=ZERO)
    w1 = ct.load(w, index=(0, k1), shape=(NG, H), padding_mode=ZERO)
    acc0 = ct.zeros((NG, H), dtype=ct.float32)
    acc1 = ct.zeros((NG, H), dtype=ct.float32)
    for step in range(nb + LAG):
        if A:
            if step < nb:
                x0 = ct.load(x, index=(step, k0), shape=(BM, H), padding_mode=ZERO).astype(ct.float32)
                x1 = ct.load(x, index=(step, k1), shape=(BM, H), padding_mode=ZERO).astype(ct.float32)
                g0 = ct.load(go, index=(step, c0), shape=(BM, H), padding_mode=ZERO).astype(ct.float32)
                g1 = ct.load(go, index=(step, c0 + 1), shape=(BM, H), padding_mode=ZERO).astype(ct.float32)
                p = ct.sum(x0 * g0, axis=1) + ct.sum(x1 * g1, axis=1)
                ct.store(part, index=(step, st, kb - st * KPS, 0), tile=ct.reshape(p, (1, 1, 1, BM)), allow_tma=False)
                if ATOM:
                    ct.atomic_add(cnt, (step,), 1, memory_order=REL, memory_scope=DEV)
        t = step - LAG
        if B:
            if t >= 0:
                if READ == 1:
                    _wait(done, t, 1, err, 0)
                if READ == 2:
                    _wait(done, t, 1, err, 1 << 22)
                g = ct.load(gc, index=(t, 0), shape=(BM, NG), padding_mode=ZERO, allow_tma=False)
                coef = ct.extract(g, index=(0, N), shape=(BM, 1))
                hpt = None
                if AGG == 1:
                    hpt = ct.load(hp, index=(t, 0), shape=(BM, NPN), padding_mode=ZERO)
                acc0 = acc0 + _bwd_half(x, dx, w0, g, coef, t, k0, NG, BM, H, True, hp, go, hpt, AGG, HC, C, NPN)
                acc1 = acc1 + _bwd_half(x, dx, w1, g, coef, t, k1, NG, BM, H, True, hp, go, hpt, AGG, HC, C, NPN)
    ct.store(dw, index=(0, k0), tile=acc0.astype(dw.dtype))
    ct.store(dw, index=(0, k1), tile=acc1.astype(dw.dtype))


def constants(sw: dict, n=SHAPE[2], c=SHAPE[3]) -> list[int]:
    nr = n * n + 2 * n
    return [nr, _ng(nr), next_pow2(n), BM, H, c // (2 * H), c // H, c,
            *(sw[k] for k in ("A", "ATOM", "B", "AGG", "READ", "LAG", "NBC"))]


def arrays(arr) -> list:
    bf, f32, i32 = torch.bfloat16, torch.float32, torch.int32
    return [arr(bf, 2), arr(bf, 2), arr(bf, 2), arr(f32, 2), arr(f32, 2), arr(f32, 4), arr(i32, 1), arr(i32, 1),
            arr(i32, 1), arr(bf, 2), arr(bf, 2)]


def run_one(name: str, seconds: float = 10.0, shape=SHAPE, repeats: int = 0) -> None:
    """One variant on the GPU at ``shape``: does its launch end; with ``repeats``, then its time
    (CUDA events, median of that many launches after the first)."""
    from kernels.cutile._common import launch
    from mix_once import watch
    sw = {**SHIPPED, **VARIANTS[name]}
    s, b, n, c = shape
    m, k, nr = s * b, n * c, n * n + 2 * n
    ng = _ng(nr)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    go = torch.randn(m, c, device="cuda", generator=g).bfloat16()
    w = torch.randn(nr, k, device="cuda", generator=g).bfloat16()
    hp = torch.rand(m, n, device="cuda", generator=g)
    gc = torch.randn(m, ng, device="cuda", generator=g)
    nb = -(-m // BM)
    part = torch.zeros(nb, n, c // (2 * H), BM, device="cuda")
    cnt = torch.zeros(nb, dtype=torch.int32, device="cuda")
    done = torch.ones(nb, dtype=torch.int32, device="cuda")  # every block closed: a poll ends at once
    err = torch.zeros(1, dtype=torch.int32, device="cuda")
    dx, dw = torch.empty_like(x), torch.empty_like(w)
    args = (x, go, w, hp, gc, part, cnt, done, err, dx, dw, *constants(sw, n, c))
    side = torch.cuda.Stream()
    t0 = time.time()
    launch(bisect, (n * c // (2 * H),), args)
    print(f"{name} {sw} at {shape}: queued in {time.time() - t0:.1f} s", flush=True)
    watch(seconds, side, (cnt, err), lambda hc, he: f"counts {int(hc.sum())}, err {int(he[0])}")
    print(f"{name}: ENDED; counts {int(cnt.sum())}, err {int(err.item())}", flush=True)
    if repeats:
        ms = []
        for _ in range(repeats):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            launch(bisect, (n * c // (2 * H),), args)
            e1.record()
            torch.cuda.synchronize()
            ms.append(e0.elapsed_time(e1))
        print(f"{name} at {shape}: median {sorted(ms)[len(ms) // 2]:.3f} ms of {repeats}", flush=True)


def two_passes(repeats: int = 5) -> None:
    """The shipped two-pass cuTile backward at the paper shape, eager, CUDA events: the baseline."""
    from mix_once import grads, paper
    leaves, outs, ups = paper()
    grads(leaves, outs, ups, False)
    ms = []
    for _ in range(repeats):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        grads(leaves, outs, ups, False)
        e1.record()
        torch.cuda.synchronize()
        ms.append(e0.elapsed_time(e1))
    print(f"two passes (the whole backward, eager) at the paper shape: median {sorted(ms)[len(ms) // 2]:.3f} ms",
          flush=True)


def offline(names) -> None:
    from cutile_sass import sass
    from cutile_wait_probe import _COUNTS, _array, _resources
    import re
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            sw = {**SHIPPED, **VARIANTS[name]}
            t0 = time.time()
            text = sass(bisect, [*arrays(_array), *constants(sw)], Path(tmp), name, timeout=300)
            found = {k: len(re.findall(pat, text)) for k, pat in _COUNTS}
            print(f"{name}: {time.time() - t0:.1f} s; {_resources(Path(tmp) / f'{name}.cubin')}"
                  + ", ".join(f"{k} {v}" for k, v in found.items()), flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    if args and args[0] == "--offline":
        offline(args[1:] or list(VARIANTS))
    elif len(args) == 2 and args[0] == "--one":
        run_one(args[1])
    elif len(args) == 2 and args[0] == "--time":  # a variant at the paper shape: ends? how long?
        if args[1] == "two-passes":
            two_passes()
        else:
            run_one(args[1], 60.0, (8192, 4, 4, 7168), 5)
    else:
        for name in args or list(VARIANTS):
            try:
                p = subprocess.run([sys.executable, __file__, "--one", name], capture_output=True, text=True,
                                   timeout=120, env=os.environ)
            except subprocess.TimeoutExpired:
                print(f"--- {name}: no answer in 120 s (a compile or a hang the watch did not end)", flush=True)
                continue
            lines = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.strip()]
            print(f"--- {name}: rc {p.returncode}; " + " | ".join(lines[-3:]), flush=True)
