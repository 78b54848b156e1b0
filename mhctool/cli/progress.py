"""What a command shows while it works: a progress bar on a terminal, a line every few seconds in a
log that is no terminal (a CI job's), nothing with --quiet. :func:`watching` hands the run a
:class:`~mhctool.analyses.runs.Watch` that feeds both."""
from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator

from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from mhctool.analyses.runs import Watch
from mhctool.cli.console import consoles, err, out, say

PROGRESS_ENV = "MHCTOOL_PROGRESS_SECONDS"  # how often the log's line comes (default 10 s)


class LogProgress:
    """Progress for a log that is no terminal: a line on stderr every ``every`` seconds while the
    work runs, from a background thread, so a case that compiles for a minute still shows the run
    is alive: what is done of how much, the time, the failures so far and what runs now. Silent
    where ``enabled`` is false (a terminal has the progress bar; --quiet)."""

    def __init__(self, label: str, total: int | None, enabled: bool, every: float | None = None, unit: str = "done"):
        every = every if every is not None else float(os.environ.get(PROGRESS_ENV, "10"))
        self.label, self.total, self.every, self.enabled, self.unit = label, total, every, enabled, unit
        self.done, self.failed, self.now = 0, 0, ""
        self._stop = threading.Event()
        self._thread = None
        self._t0 = 0.0

    def __enter__(self):
        self._t0 = time.monotonic()
        if self.enabled:
            self._thread = threading.Thread(target=self._beat, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, exc_type, *exc):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(1.0)
            if exc_type is None or self.done:  # a request refused before any work has no progress to tell
                self.line()

    def _beat(self) -> None:
        while not self._stop.wait(self.every):
            self.line()

    def line(self) -> None:
        of = f"/{self.total}" if self.total is not None else ""
        failed = f", {self.failed} failed so far" if self.failed else ""
        now = f"; now {self.now}" if self.now and not self._stop.is_set() else ""
        err.print(f"{self.label}: {self.done}{of} {self.unit}, {time.monotonic() - self._t0:.0f} s{failed}{now}",
                  markup=False)


@contextlib.contextmanager
def watching(label: str, total: int | None, quiet: bool, unit: str = "done", spinner: bool = False) -> Iterator[Watch]:
    """A Watch for a run of ``total`` units (None: not known ahead): a transient bar on a terminal
    (a spinner with what runs now where ``spinner``), the log's lines elsewhere, nothing when quiet.
    ``status`` lines go to stderr unless quiet; ``say`` lines always."""
    show = not quiet and out.is_terminal
    log = LogProgress(label, total, enabled=not quiet and not out.is_terminal, unit=unit)
    columns = ((SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn()) if spinner else
               (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()))
    with log, Progress(*columns, console=err, transient=True, disable=not show) as bar:
        task = bar.add_task(label, total=total)

        def planned(n: int) -> None:
            bar.update(task, total=n)
            log.total = n

        def started(what: str, detail: str) -> None:
            bar.update(task, description=what)
            log.now = detail

        def finished() -> None:
            bar.advance(task)
            log.done += 1
        yield Watch(planned, started, finished, (lambda line: None) if quiet else say, say, consoles())
