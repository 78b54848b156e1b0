"""A run's set-up, one function for every command: what stops it (SIGINT, SIGTERM), whether the
implementations under test run in a child process (isolation), how many worker processes and
PyTorch threads it uses, and where the libraries' own output goes (the library log).

An analysis calls :func:`prepare` with what its request asks and runs inside
:meth:`Setup.running`; the command that asked only prints. Torch-free, like the rest of the
spreading layer's entry points: a usage error found here answers before torch is imported.
"""
from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from mhctool.core.errors import MEASURED, SIGNALLED, Interrupted, UsageError, may_abandon
from mhctool.core.library_log import library_log
from mhctool.core.names import is_outside
from mhctool.spread import pool, prewarm
from mhctool.spread.forkserver import start_resource_tracker_quietly
from mhctool.spread.machine import pinned_threads, threads_for


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


# the same signal again within this many seconds is the same request: coreutils' timeout (without
# --foreground), a CI job's limit and Slurm send SIGTERM to the command and then to its whole process
# group, so the main process gets it twice at once
SAME_REQUEST_S = 1.0


class Interrupts:
    """SIGINT and SIGTERM during a long run: the first one asks the run to stop starting new cases
    (``requested``), so what was measured is written; a second one stops at once (``aborted``):
    inside a stretch of measuring (:func:`~mhctool.core.errors.abandonable`) it raises
    :class:`Interrupted`, which the run catches where it keeps what it measured
    (:func:`~mhctool.core.errors.kept_at_once`), and the report is still written, marked
    interrupted. The same signal again within :data:`SAME_REQUEST_S` of the first is one
    request delivered twice; any signal after the second is ignored (the report is being
    written: only SIGKILL leaves nothing). ``say``: where the sentences go (the command's
    console)."""

    def __init__(self, say: Callable[[str], None] = _stderr, clock: Callable[[], float] = time.monotonic):
        self.requested = False
        self.aborted = False
        self.say = say
        self._old: dict = {}
        self._clock = clock
        self._first: tuple[int, float] | None = None  # the first signal and when it came

    def _handle(self, signum, frame):
        if self.aborted:
            return  # stopping already: what was measured is being written
        if self.requested:
            if self._first is not None and self._first[0] == signum and \
                    self._clock() - self._first[1] < SAME_REQUEST_S:
                return  # the same request, delivered to the process and again to its group
            self.aborted = True
            self.say(f"{signal.Signals(signum).name} again: stopping at once, the work in hand abandoned; "
                     "writing what was measured")
            if may_abandon():
                raise Interrupted()
            return  # building or writing the report: it stops at its next check
        self.requested = True
        self._first = (signum, self._clock())
        self.say(f"{signal.Signals(signum).name}: finishing the case in hand, then writing what was measured "
                 "(again to stop at once)")

    def __enter__(self):
        MEASURED.clear()
        if SIGNALLED:  # one came while the command line loaded, and was swallowed on its way out
            raise Interrupted()
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc):
        MEASURED.append(True)  # a signal from here on comes after the measuring: the command line's to answer
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old.clear()

    def __call__(self) -> bool:
        return self.requested


def warm(workers: str | int | None, backend: str = "local", isolate: bool = False,
         device: str | None = None) -> None:
    """The first thing a command that spreads or isolates does: the fork server imports torch, and
    Triton hashes itself, while the command plans (:func:`pool.warm`, :func:`prewarm.start`).
    Python's resource tracker starts first, its warnings off (:func:`start_resource_tracker_quietly`),
    before a module under test imported here could start it with the terminal as its stderr."""
    start_resource_tracker_quietly()
    pool.warm(workers, backend, isolate, device)
    prewarm.start(device)


def isolation_for(isolate: bool | None, specs: list[str], device: str, case_timeout: float | None,
                  transport: str | None, interrupts: Interrupts, default_on: bool = False, insist: bool = False):
    """The runner's Isolation, or None. Default: on where ``default_on`` (the gate), where an
    outside implementation runs (in mhctool's own process an ``os._exit`` in it would end mhctool;
    in a pool worker a hang would hold the worker for the whole case's limit, then the case would
    run again to find who hung: on a 2-core CPU 192 s for a hung function over parity's 40
    default Sinkhorn cases, 37 s isolated), or when a case time limit is asked for. ``transport``:
    None where the user named none (shm)."""
    external = any(is_outside(s) for s in specs)
    asked = isolate
    if isolate is None:
        isolate = default_on or external or case_timeout is not None
    if not isolate:
        if case_timeout is not None:
            raise UsageError("--case-timeout needs --isolate (a time limit needs a child process to stop)")
        if transport is not None:
            raise UsageError(f"--isolate-transport {transport} needs isolation, which "
                             + ("--no-isolate turns off" if asked is False else "is off here: add --isolate"))
        return None
    transport = transport or "shm"
    from mhctool.spread.isolation import TRANSPORTS
    if transport not in TRANSPORTS:
        raise UsageError(f"unknown --isolate-transport {transport!r}; accepted: {', '.join(TRANSPORTS)}")
    from mhctool.spread.case_isolation import Isolation
    return Isolation(transport=transport, case_timeout=case_timeout, interrupted=interrupts, insist=insist)


def spread_for(workers: str | int | None, backend: str, device: str, units: int,
               check_spreadable: Callable[[], None], alone: bool = False) -> tuple[int, str]:
    """``--workers`` and ``--backend`` for a run of ``units`` cases -> (worker processes, backend),
    checked before anything runs. ``check_spreadable()`` raises a UsageError where the run's
    implementations cannot leave this process (Python callables). ``alone``: the run keeps its
    cases in this process (``--ranks``); with ``--workers`` unset, so does a run that cannot be
    spread."""
    pool.check_backend(backend)
    asked = pool.parse_workers(workers)
    if asked == pool.DEFAULT and backend == "local":
        try:
            check_spreadable()
        except UsageError:
            alone = True
        if alone:
            return 1, backend
    n = pool.worker_count(asked, device, max(units, 1))
    if n > 1 or backend == "ray":
        check_spreadable()
    return n, backend


@dataclass
class Setup:
    """How one run uses the machine; :meth:`running` puts it in force."""

    device: str
    interrupts: Interrupts
    isolation: object | None = None  # case_isolation.Isolation
    workers: int = 1
    backend: str = "local"
    threads: int | None = None  # PyTorch threads a process (None: left as they are)
    log_path: Path | None = None  # the library log asked for (None: the libraries' lines show)
    consoles: dict = field(default_factory=dict)  # mhctool's consoles, kept on the terminal
    library_log: str | None = None  # after running: the log's path, where anything was written to it

    @property
    def transport(self) -> str:
        return "shm" if self.isolation is None else self.isolation.transport

    @contextlib.contextmanager
    def running(self) -> Iterator[Setup]:
        """Signals caught, threads pinned, the libraries' output in the log; the isolation
        workers stopped and the log's path known on leaving, however the run ends."""
        with contextlib.ExitStack() as stack:
            stack.callback(self._close)
            stack.enter_context(self.interrupts)
            if self.threads is not None:
                stack.enter_context(pinned_threads(self.threads))
            if self.log_path is not None:
                log: dict = {}  # read once the log is closed: an ExitStack unwinds last in, first out
                stack.callback(lambda: setattr(self, "library_log", log["state"]["path"]))
                log["state"] = stack.enter_context(library_log(self.log_path, self.consoles))
            yield self

    def _close(self) -> None:
        if self.isolation is not None:
            self.isolation.close()


def prepare(device: str, *, specs: list[str] = (), isolate: bool | None = None, case_timeout: float | None = None,
            insist: bool = False,
            transport: str | None = None, default_isolate: bool = False, workers: int = 1, backend: str = "local",
            pin_threads: bool = True, library_log: Path | None = None, consoles: dict | None = None,
            say: Callable[[str], None] = _stderr) -> Setup:
    """A run's set-up, checked before anything runs (a UsageError otherwise): isolation as
    :func:`isolation_for` decides, ``workers`` processes (from :func:`spread_for`), PyTorch threads
    for them (:func:`machine.threads_for`) unless ``pin_threads`` is false, and the libraries'
    output to ``library_log`` where one is given."""
    interrupts = Interrupts(say)
    iso = isolation_for(isolate, list(specs), device, case_timeout, transport, interrupts, default_on=default_isolate,
                        insist=insist)
    return Setup(device, interrupts, iso, workers, backend, threads_for(device, workers) if pin_threads else None,
                 library_log, dict(consoles or {}))
