"""Does tileiras keep a loop's tile loads pipelined when each iteration first waits on a flag that
other programs raise? Offline (no GPU), for the read-x-once mix_aggregate backward
(docs/perf-notes.md, twenty-sixth session). Set up the tools as dev/cutile_sass.py says, then:

    TILEIRAS=... NVDISASM=... python3 dev/cutile_wait_probe.py [--keep DIR] [--worker | --once]

A probe kernel walks 512 (64, 128) bf16 tiles of one column block and sums them; before each
load it waits (WAIT 1: ``ct.load(..., memory_order=ACQUIRE, memory_scope=DEVICE)`` polled in a
``while``; WAIT 2: the same RELAXED; WAIT 0: none). The arrays are declared as the launches see
them (contiguous last axis, 16-element strides, 256-byte base, shapes of whole tiles): without
that the loads are scalar ``LDG.U16`` and the figures mean nothing. Prints each form's TMA loads
(UTMALDG), mbarrier operations (SYNCS), flag polls (``LDG.E.STRONG.GPU``) and L1 invalidations.

``--worker``: the read-x-once backward's worker loop instead (one program a K block of BK
columns; per token block, (A) x and grad_out tiles to a partial and a release count, then (B)
after an acquire wait on another block's flag, the projection backward with the aggregation term
from the packed gradient: ``proj_rms._grad_products``), with and without the waits, at BK 128
and 256; with the cubin's registers, shared memory and stack (``CUOBJDUMP``, e.g. Triton's wheel's
``backends/nvidia/bin/cuobjdump``).

``--once``: the kernel that ships (``kernels/cutile/mix_backward.py``, off by default) at the paper
shape, at its eight worker warps and at four (the default, which spills); then how long tileiras
takes on it at the GPU tests' shapes and at LAG 2, 4 and 8 (each stopped after ``--timeout`` s).
A compile that does not end is what a GPU run would see as a hang at the first launch.
"""
from __future__ import annotations

import argparse
import functools
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import cuda.tile as ct
import torch
from cuda.tile._memory_model import MemoryOrder, MemoryScope

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from cutile_sass import sass  # noqa: E402
from kernels.cutile._common import array  # noqa: E402
from kernels.cutile.mix_backward import _read  # noqa: E402
from kernels.cutile.proj_rms import _grad_products  # noqa: E402

CI = ct.Constant[int]


def _poll(flags, s, order):
    return ct.load(flags, index=(s,), shape=(1,), memory_order=order, memory_scope=MemoryScope.DEVICE)


def _wait_for(flags, s, WAIT):
    """Wait until ``flags[s]`` is set: WAIT 0 not at all, 1 a tile load polled with acquire (each
    thread its own), 2 the same relaxed, 3 the read-x-once kernel's atomic read (``mix_backward._read``:
    one result for the program)."""
    if WAIT == 1 or WAIT == 2:
        order = MemoryOrder.ACQUIRE if WAIT == 1 else MemoryOrder.RELAXED
        f = _poll(flags, s, order)
        while ct.sum(f) == 0:
            f = _poll(flags, s, order)
    if WAIT == 3:
        f = _read(flags, s)
        while f == 0:
            f = _read(flags, s)


@ct.kernel
def probe(x, flags, out, NB: ct.Constant[int], WAIT: ct.Constant[int]):
    kb = ct.bid(0)
    acc = ct.zeros((128,), dtype=ct.float32)
    for s in range(NB):
        _wait_for(flags, s, WAIT)
        acc = acc + ct.sum(ct.load(x, index=(s, kb), shape=(64, 128)).astype(ct.float32), axis=0)
    ct.store(out, index=(kb,), tile=acc)


@ct.kernel
def handoff(x, flags, out, WAIT: CI):
    """Program 0 raises ``flags[s]`` for every token block s in order (release); program j > 0 walks
    x's column block j - 1 and, before each tile, waits for its flag (WAIT as ``_wait_for`` takes it). The
    smallest cross-program wait around TMA loads: ``dev/mix_once.py handoff`` runs it on a GPU."""
    b = ct.bid(0)
    nb = ct.num_tiles(x, axis=0, shape=(64, 128))
    if b == 0:
        for s in range(nb):
            ct.atomic_add(flags, (s,), 1, memory_order=MemoryOrder.RELEASE, memory_scope=MemoryScope.DEVICE)
    else:
        acc = ct.zeros((128,), dtype=ct.float32)
        for s in range(nb):
            _wait_for(flags, s, WAIT)
            acc = acc + ct.sum(ct.load(x, index=(s, b - 1), shape=(64, 128)).astype(ct.float32), axis=0)
        ct.store(out, index=(b - 1,), tile=acc)


@ct.kernel
def worker(x, go, gc, w, part, cnt, done, dx, dwout, NB: CI, BM: CI, BK: CI, NG: CI, N: CI, CB: CI, LAG: CI,
           WAIT: CI):
    k = ct.bid(0)
    wt = ct.load(w, index=(0, k), shape=(NG, BK), padding_mode=ct.PaddingMode.ZERO)
    acc = ct.zeros((NG, BK), dtype=ct.float32)
    for s in range(NB + LAG):
        if s < NB:  # (A): block s's partial, then its count
            xt = ct.load(x, index=(s, k), shape=(BM, BK))
            gt = ct.load(go, index=(s, k % CB), shape=(BM, BK))
            p = ct.sum(xt.astype(ct.float32) * gt.astype(ct.float32), axis=1)
            ct.store(part, index=(s, k, 0), tile=ct.reshape(p, (1, 1, BM)))
            if WAIT:
                ct.atomic_add(cnt, (s,), 1, memory_order=MemoryOrder.RELEASE, memory_scope=MemoryScope.DEVICE)
        t = s - LAG
        if t >= 0:  # (B): block t once its packed gradient is there
            if WAIT:
                f = _poll(done, t, MemoryOrder.ACQUIRE)
                while ct.sum(f) == 0:
                    f = _poll(done, t, MemoryOrder.ACQUIRE)
            g = ct.load(gc, index=(t, 0), shape=(BM, NG))
            coef = ct.extract(g, index=(0, N), shape=(BM, 1))
            xb = ct.load(x, index=(t, k), shape=(BM, BK))
            gb = ct.load(go, index=(t, k % CB), shape=(BM, BK))
            prod, part2 = _grad_products(g, wt, xb, True, BM, BK, NG, gb.astype(ct.float32))
            ct.store(dx, index=(t, k), tile=(prod + coef * xb.astype(ct.float32)).astype(dx.dtype))
            acc = acc + part2
    ct.store(dwout, index=(0, k), tile=acc)


_array = functools.partial(array, aligned=True)  # as a launch specialises the tensors


_COUNTS = (("UTMALDG", r"UTMALDG"), ("SYNCS", r"SYNCS\."), ("polls", r"LDG\.E\.STRONG\.GPU"),
           ("CCTL.IVALL", r"CCTL\.IVALL"), ("HGMMA", r"HGMMA"), ("LDL", r"\bLDL"), ("STL", r"\bSTL"))


def _resources(cubin: Path) -> str:
    tool = os.environ.get("CUOBJDUMP")
    if not tool:
        return ""
    res = subprocess.run([tool, "-res-usage", str(cubin)], capture_output=True, text=True).stdout
    return " ".join(re.findall(r"REG:\d+|SHARED:\d+|STACK:\d+", res)) + "; "


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keep", type=Path, help="write the bytecode, cubins and SASS here")
    ap.add_argument("--worker", action="store_true", help="the read-x-once backward's worker loop")
    ap.add_argument("--once", action="store_true", help="the read-x-once backward as it ships")
    ap.add_argument("--timeout", type=float, default=120, help="seconds a --once shape's compile may take")
    args = ap.parse_args()
    bf, f32, i32 = torch.bfloat16, torch.float32, torch.int32
    if args.once:
        from kernels.cutile import mix_backward as mb
        params = mb.signature(_array)
        cases = {f"once, {w} worker warps": (mb._mix_bwd_once.replace_hints(num_worker_warps=w), params) for w in (8, 4)}
    elif args.worker:
        arrays = [_array(bf, 2), _array(bf, 2), _array(f32, 2), _array(bf, 2), _array(f32, 3), _array(i32, 1),
                  _array(i32, 1), _array(bf, 2), _array(f32, 2)]
        cases = {f"worker, BK {bk}, {'waits' if wait else 'no waits'}":
                 (worker, [*arrays, 512, 64, bk, 32, 24, 7168 // bk, 3, wait]) for bk in (128, 256) for wait in (0, 1)}
    else:
        arrays = [_array(bf, 2), _array(i32, 1), _array(f32, 1), 512]
        cases = {name: (probe, [*arrays, wait]) for wait, name in ((0, "no wait"), (1, "acquire poll"),
                                                                   (2, "relaxed poll"))}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.keep or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        for i, (name, (kernel, params)) in enumerate(cases.items()):
            text = sass(kernel, params, workdir, f"case{i}")
            found = {k: len(re.findall(pat, text)) for k, pat in _COUNTS}
            print(f"{name}: {_resources(workdir / f'case{i}.cubin')}" + ", ".join(f"{k} {v}" for k, v in found.items()),
                  flush=True)
        if args.once:
            _once_compile_times(workdir, args.timeout)


def _once_compile_times(workdir: Path, timeout: float) -> None:
    """tileiras's time on the read-x-once kernel at the GPU tests' shapes (132 SMs) and other LAGs."""
    from kernels.cutile import mix_backward as mb
    cases = [((s, b, n, c), mb.LAG) for s, b, n, c in ((37, 5, 4, 256), (9, 2, 2, 512), (1000, 1, 4, 768),
                                                       (3, 1, 4, 7168))]
    cases += [((8192, 4, 4, 7168), lag) for lag in (2, 4, 8)]
    old = mb.LAG
    try:
        for i, ((s, b, n, c), lag) in enumerate(cases):
            mb.LAG = lag
            workers, closers = mb.plan(s * b, n, c, torch.bfloat16, torch.bfloat16, 132)
            t0 = time.time()
            try:
                sass(mb._mix_bwd_once, mb.signature(_array, n, c, workers, closers), workdir, f"shape{i}",
                     timeout=timeout)
                took = f"{time.time() - t0:.1f} s"
            except subprocess.TimeoutExpired:
                took = f"not done in {timeout:.0f} s"
            except subprocess.CalledProcessError as ex:
                took = f"tileiras failed ({ex.returncode})"
            print(f"once at {s}x{b}x{n}x{c}, LAG {lag} ({workers} workers, {closers} closers): compiled in {took}",
                  flush=True)
    finally:
        mb.LAG = old


if __name__ == "__main__":
    main()
