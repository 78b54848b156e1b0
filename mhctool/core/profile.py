"""Where a run's time goes: named phases timed inside each case (the inputs, the native run, the
float64 reference, each implementation with its first call in the process apart, which is where
Triton, cuTile and TileLang compile, judging, the reproducibility checks), returned with the
case's rows and summed per run, with the rest of each case (moving inputs, freeing memory) and the
start of the ranks of `--ranks` (in the first case), apart; a
pool adds its workers' start and what is spent outside the cases (transfers, waiting for memory on
the device). ``mhctool parity --profile`` and ``mhctool gate --profile`` print the sums; their
reports keep them in the run metadata (``profile``)."""
from __future__ import annotations

import contextlib
import time

_current: dict | None = None  # the phases of the case running in this process
_seen: set = set()  # what has had its first call in this process


@contextlib.contextmanager
def case():
    """Collect the phases of one case into the dict it yields."""
    global _current
    outer, _current = _current, {}
    try:
        yield _current
    finally:
        _current = outer


@contextlib.contextmanager
def phase(name: str):
    """Add the time of the block to ``name`` in the current case (nothing outside a case)."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        if _current is not None:
            _current[name] = _current.get(name, 0.0) + time.perf_counter() - t0


def call_name(impl: str, key: tuple, first: str = "first call: compiles") -> str:
    """``impl (first)`` the first time ``key`` (the implementation, kernel and dtype) is called in
    this process, for the call that compiles (or, for PyTorch's native run, loads its libraries'
    kernels); plain ``impl`` after."""
    if key in _seen:
        return impl
    _seen.add(key)
    return f"{impl} ({first})"


def add(total: dict, part: dict | None) -> dict:
    for k, v in (part or {}).items():
        total[k] = total.get(k, 0.0) + v
    return total


OUTSIDE = "outside the cases (transfers, waiting)"
START = "worker start (a process and its imports)"
RESOLVING = "resolving the implementations (imports)"
REST = "the rest of the case (moving inputs, freeing memory)"
RANKS = "ranks start (processes, the process group)"


def lines(timings: dict, wall: float, workers: int) -> list[str]:
    """The profile as text: the wall time, the busy share of the workers, then each phase's
    seconds and share of the time inside the cases, largest first."""
    inside = sum(v for k, v in timings.items() if k not in (OUTSIDE, START))
    busy = inside / (wall * max(1, workers)) if wall > 0 else 0.0
    out = [f"profile: {wall:.1f} s wall, {inside:.1f} s inside the cases over {workers} process(es) "
           f"({100 * busy:.0f}% busy)"]
    for k, v in sorted(timings.items(), key=lambda kv: -kv[1]):
        share = f"{100 * v / inside:5.1f}%" if inside and k not in (OUTSIDE, START) else "     "
        out.append(f"  {v:8.2f} s {share}  {k}")
    return out
