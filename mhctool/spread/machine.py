"""How a run uses the machine: how many worker processes, and how many PyTorch threads each.

**Threads.** PyTorch's CPU reductions split their work by the intra-op thread count, so the last
bits of a float64 reference's or a native run's sums depend on it: one process with two threads
against one with one changed 119 of the 13,308 rows of the default CPU parity run. On the CPU,
every process of a run (the command's, its pool workers, its isolation workers) therefore computes
with **one** thread, and the cores are used by worker processes instead: the rows are the same on
a 2-core laptop and a 64-core host, with one worker or sixteen. On a GPU the rows are computed on
the GPU, and each process gets its share of the cores (``cores // workers``) for what it does on
the host. ``MHCTOOL_THREADS=N`` overrides both (the rows' last bits may then differ from another
machine's); the number used is in every report's metadata.

**Workers.** ``--workers`` unset (or ``MHCTOOL_WORKERS`` unset) spreads a run where it pays: on a
GPU machine one worker per visible GPU; on a CPU one per core, but no more than one per
:data:`CASES_A_WORKER` cases (a worker's start, forked from the fork server, costs about what a
few small cases do), so a run of a handful of cases stays in one process. ``auto`` is one per GPU
or core whatever the count; a number is that many. A run whose implementations cannot be spread
(Python callables, ``--ranks``) stays in one process where nothing was asked.

Torch-free: imported before the fork server starts.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from mhctool.core.errors import UsageError
from mhctool.core.host import cores

THREADS_ENV = "MHCTOOL_THREADS"
CASES_A_WORKER = 4


def threads_asked() -> int | None:
    """``MHCTOOL_THREADS`` where set: a positive integer, else a UsageError."""
    raw = os.environ.get(THREADS_ENV, "").strip()
    if not raw:
        return None
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise UsageError(f"malformed {THREADS_ENV}={raw!r}; expected a positive integer (PyTorch threads a process)")
    return n


def threads_for(device: str, workers: int) -> int:
    """PyTorch's intra-op threads for each process of a run on ``device`` over ``workers``."""
    asked = threads_asked()
    if asked is not None:
        return asked
    if device == "cpu":
        return 1
    return max(1, cores() // max(1, workers))


@contextlib.contextmanager
def pinned_threads(n: int) -> Iterator[int]:
    """This process computes with ``n`` threads, and every process it starts from here takes the
    same number (``MHCTOOL_THREADS``, applied by :func:`apply_threads` in the child); both restored
    on leaving (a command run in-process, as the tests run them, leaves no trace)."""
    import torch
    before, env = torch.get_num_threads(), os.environ.get(THREADS_ENV)
    torch.set_num_threads(n)
    os.environ[THREADS_ENV] = str(n)
    try:
        yield n
    finally:
        torch.set_num_threads(before)
        if env is None:
            os.environ.pop(THREADS_ENV, None)
        else:
            os.environ[THREADS_ENV] = env


def apply_threads() -> None:
    """In a child process (a pool or isolation worker, a Ray task): the run's thread count, where
    the parent pinned one."""
    n = os.environ.get(THREADS_ENV, "").strip()
    if n.isdigit() and int(n) > 0:
        import torch
        if torch.get_num_threads() != int(n):
            torch.set_num_threads(int(n))


def default_workers(device: str, cases: int, gpus: int) -> int:
    """Workers for a run that did not ask: one per GPU, or per core with at least
    :data:`CASES_A_WORKER` cases each."""
    if device == "cuda":
        return max(1, min(gpus, cases))
    return max(1, min(cores(), cases // CASES_A_WORKER))
