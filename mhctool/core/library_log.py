"""The libraries' own output kept apart from mhctool's: TileLang's compile logs,
Triton's and PyTorch's C-level warnings, NCCL's lines. While a command works, whatever goes to the
process's stdout and stderr (a library's ``logging`` handler, a ``print``, a ``warnings`` line, a
C library's write to its descriptor) goes to a log file instead; mhctool's own consoles are
pointed at the terminal meanwhile, so its lines and its conclusions are all that shows. Isolation workers started meanwhile write to the same file
(``MHCTOOL_LIBRARY_LOG``, read in :mod:`mhctool.spread.isolation`).

A descriptor is redirected only where Python's stream is that descriptor (a command run from a
shell): under a test runner that captures the streams nothing is, and the workers still log."""
from __future__ import annotations

import contextlib
import io
import os
import sys
import warnings
from pathlib import Path

ENV = "MHCTOOL_LIBRARY_LOG"
_last: Path | None = None  # the log of this process's last run (None: no run kept one)
_held: list[str] = []  # what the code under test wrote while the command planned (see holding)


def beside(report: Path) -> Path:
    """Where a run keeps its libraries' own output: ``REPORT.libraries.log`` beside its report."""
    return report.with_name(report.stem + ".libraries.log")


def said(path: str | Path | None) -> str:
    """The clause that names the log where one was written, else nothing."""
    return f"the libraries' own output: {path}" if path else ""


def _fd_of(stream) -> int | None:
    try:
        return stream.fileno()
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return None


def to_log(path: str | None) -> None:
    """In a worker process: its stdout and stderr descriptors to the log (appended)."""
    if not path:
        return
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    for target in (1, 2):
        os.dup2(fd, target)
    os.close(fd)


class _Held(io.TextIOBase):
    """A stream that holds what is written to it while ``holding`` is true, then passes writes on to
    the stream it stood in for (a logging handler made at import keeps it, and still reaches the
    log or the terminal as that stream does)."""

    def __init__(self, target):
        super().__init__()
        self.target, self.holding, self.held = target, True, []

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if self.holding:
            self.held.append(text)
        else:
            self.target.write(text)
        return len(text)

    def flush(self) -> None:
        if not self.holding:
            self.target.flush()

    def fileno(self) -> int:
        return self.target.fileno()


@contextlib.contextmanager
def holding(consoles: dict):
    """While a command plans, before its log opens (the code under test is imported then): what
    Python-level code writes to ``sys.stdout`` or ``sys.stderr``, its warnings included (a
    library's import-time UserWarning), is held, and written first into the run's library log when
    it opens (dropped where none opens: a command stopped by bad input says one sentence). A
    stream kept meanwhile (a logging handler made at import) writes where the real one does
    afterwards. mhctool's own ``consoles`` keep the streams they had."""
    out, err = _Held(sys.stdout), _Held(sys.stderr)
    for name, c in consoles.items():
        c.file = getattr(sys, name)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            warnings.simplefilter("default")  # each warning once, as Python shows it by default
            yield
    finally:
        for c in consoles.values():
            c.file = None  # back to the stream it prints to (resolved at each print), as library_log leaves it
        out.holding = err.holding = False
        held = "".join(out.held + err.held)
        if held:
            _held.append(held)


@contextlib.contextmanager
def library_log(path: Path, consoles: dict, enabled: bool = True):
    """Yields a dict whose ``"path"`` is the log's path once the block ends, where anything was
    written to it (None otherwise: the empty file is removed). ``consoles``: mhctool's own rich
    consoles by the stream they print to (``{"stdout": out, "stderr": err}``), pointed at the
    terminal meanwhile. ``enabled`` False (``--verbose``): the libraries' lines show where they are
    written."""
    global _last
    state: dict = {"path": None}
    if not enabled:
        yield state
        return
    _last = Path(path)
    for s in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            s.flush()
    log_fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    if _held:  # what the code under test wrote while the command planned
        os.write(log_fd, "".join(_held).encode("utf-8", "replace"))
        _held.clear()
    saved_fds, terminals = {}, []
    for name, fd in (("stdout", 1), ("stderr", 2)):
        stream = getattr(sys, name)
        if _fd_of(stream) != fd:
            continue
        saved_fds[fd] = os.dup(fd)
        os.dup2(log_fd, fd)
        if name in consoles:
            terminal = io.TextIOWrapper(os.fdopen(os.dup(saved_fds[fd]), "wb"), encoding=stream.encoding,
                                        errors=stream.errors, line_buffering=True, write_through=True)
            consoles[name].file = terminal
            terminals.append((consoles[name], terminal))
    previous_env = os.environ.get(ENV)
    os.environ[ENV] = str(path)
    try:
        yield state
    finally:
        if previous_env is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = previous_env
        for console, terminal in terminals:
            console.file = None  # back to the stream it prints to (resolved at each print)
            with contextlib.suppress(Exception):
                terminal.close()
        for s in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                s.flush()
        for fd, saved in saved_fds.items():
            os.dup2(saved, fd)
            os.close(saved)
        os.close(log_fd)
        if path.exists() and path.stat().st_size > 0:
            state["path"] = str(path)
        else:
            with contextlib.suppress(OSError):
                path.unlink()


def after_conclusion() -> None:
    """Once a command has said its last line: what the process still writes as it shuts down
    (PyTorch's C++ warnings from static destructors, such as CUDA IPC's "Producer process has been
    terminated before all shared CUDA tensors released" where an isolation worker died holding the
    inputs it was sent; an ``atexit`` line of a library) goes to the last run's library log, or
    nowhere where no run kept one; never after the conclusion on the terminal. The log is made
    again for it where the run's was empty, and removed at exit if nothing came
    (:func:`drop_if_empty`, which the command line registers first, so that it runs after every
    other ``atexit`` handler). Only where Python's stream is the descriptor (a shell)."""
    for s in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            s.flush()
    fds = [fd for name, fd in (("stdout", 1), ("stderr", 2)) if _fd_of(getattr(sys, name)) == fd]
    if not fds:
        return
    try:
        target = os.open(_last if _last is not None else os.devnull, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError:
        return
    for fd in fds:
        os.dup2(target, fd)
    os.close(target)


def drop_if_empty() -> None:
    """At exit: the last run's library log removed where nothing was written to it (a run whose
    libraries said nothing leaves no empty log beside its report). Registered with ``atexit``
    before any library is imported, it runs after their handlers; what a C++ destructor writes
    later still goes to the file's descriptor, never to the terminal."""
    with contextlib.suppress(OSError):
        if _last is not None and _last.is_file() and _last.stat().st_size == 0:
            _last.unlink()
