"""Errors the CLI turns into one sentence and exit code 2, and what a call of code under test
that exits or raises says in its failed row (one line)."""
import contextlib
from collections.abc import Iterator


# lines PyTorch adds to a CUDA error that say nothing of the error itself
_ADVICE = ("CUDA kernel errors might be asynchronously reported", "For debugging consider passing CUDA_LAUNCH_BLOCKING",
           "Compile with `TORCH_USE_CUDA_DSA`", "Search for `cuda", "Device-side assertion tracking was not enabled")
# where PyTorch's out-of-memory message turns from the allocation to the other processes and advice
_OOM_TAIL = (" Process ", " Including non-PyTorch memory", " Of the allocated memory", " If reserved but unallocated")


def short_error(e: BaseException) -> str:
    """The error in one line; compiler errors put the cause after the first line, so keep it.
    PyTorch's advice lines after a CUDA error, and its out-of-memory message's account of the
    other processes, are left out."""
    lines = [ln.strip() for ln in f"{type(e).__name__}: {e}".splitlines()
             if ln.strip() and not ln.strip().startswith(_ADVICE)]
    text = " | ".join(lines)
    if type(e).__name__ == "OutOfMemoryError":
        cut = min((i for i in (text.find(t) for t in _OOM_TAIL) if i > 0), default=len(text))
        text = text[:cut]
    return text[:1500]


class UsageError(ValueError):
    """Bad input from the user: an unknown name, a malformed value, a missing file."""


def system_exit_message(e: SystemExit) -> str:
    """The failed row's message of an implementation that called ``sys.exit``."""
    return f"the implementation called sys.exit({e.code!r})"


class Interrupted(BaseException):
    """A second Ctrl-C (or SIGTERM): the work in hand is abandoned at once. A run catches it where
    it keeps what it measured (:func:`kept_at_once`) and writes that, marked interrupted; where
    nothing catches it the command line turns it into exit code 130. A BaseException, so that
    nothing on the way swallows it and atomic writers still clean up."""


_ABANDONABLE = [0]  # how deep the main thread is in stretches a second signal may abandon


@contextlib.contextmanager
def abandonable() -> Iterator[None]:
    """A stretch of measuring a second signal may abandon: there it raises :class:`Interrupted`
    (the caller catches it and keeps what was measured). Outside every such stretch (a report
    being built or written) a second signal only asks the run to stop at its next check."""
    _ABANDONABLE[0] += 1
    try:
        yield
    finally:
        _ABANDONABLE[0] -= 1


def may_abandon() -> bool:
    return _ABANDONABLE[0] > 0


@contextlib.contextmanager
def kept_at_once() -> Iterator[None]:
    """An :func:`abandonable` stretch whose abandonment ends the block here: what it measured
    before (rows it appended, steps it logged) is kept for the report. The run's
    ``interrupted()`` stays true, so no later stage starts."""
    try:
        with abandonable():
            yield
    except Interrupted:
        pass


# set once a run has finished measuring (its signals' handling is over): a signal after it, while the
# report is written and the conclusion printed, changes neither (the report, finished, says so)
MEASURED: list[bool] = []

# the signals that came while the command line loaded (its handler's SystemExit can be swallowed on
# the way, by an import's ``except BaseException``): a run that starts after one leaves at once
SIGNALLED: list[str] = []
