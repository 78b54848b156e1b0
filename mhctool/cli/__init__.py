"""The command line: one module per command (its options and printing only), and the modules they
share (:mod:`.console`, :mod:`.options`, :mod:`.progress`, :mod:`.tables`). The Typer app is
:data:`mhctool.cli.app.app`; ``mhctool`` runs :func:`main`."""
from __future__ import annotations


def main() -> None:
    """``mhctool``: a signal that comes where a command does not handle its own (while Python imports
    the command line, before a run starts measuring) stops it with exit code 130 and one sentence,
    never a traceback; a run that measures writes what it has (its own handling).

    The handler's ``SystemExit`` can come out as another exception: raised while Python makes a
    class (a ``__set_name__`` hook, as in markdown_it, which typer imports to print a usage error)
    it becomes ``RuntimeError``. So the signal is remembered, and whatever comes out of the run
    after it is exit code 130 (our CI met it on 2026-11-29)."""
    import atexit
    import signal
    import sys

    from mhctool.core.library_log import drop_if_empty
    atexit.register(drop_if_empty)  # first: it runs after every handler a library registers later

    from mhctool.core.errors import MEASURED, SIGNALLED
    came = SIGNALLED  # what a run's own handling checks as it starts (an import may swallow SystemExit)
    late: list[int] = []  # signals after the run measured (said once)

    def stopped(signum, frame):
        if MEASURED:  # the run has measured: its report is written as finished, its exit code stands
            if not late:
                sys.stderr.write(f"{signal.Signals(signum).name} came after the run had measured: "
                                 "its report is written as finished\n")
            late.append(signum)
            return
        came.append(signal.Signals(signum).name)
        sys.stderr.write(f"interrupted ({came[0]}): stopped at once; no report written\n")
        raise SystemExit(130)
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, stopped)
    try:
        from mhctool.cli.app import main as run
        run()
    except SystemExit:  # the command's own end (an uncaught error's traceback stays on the terminal)
        # concluded: a signal now (the process group's copy of a timeout's SIGTERM) changes nothing,
        # neither the exit code nor what was said
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, signal.SIG_IGN)
        from mhctool.core.library_log import after_conclusion
        after_conclusion()
        raise
    except BaseException:
        if came and not MEASURED:
            raise SystemExit(130) from None
        raise
