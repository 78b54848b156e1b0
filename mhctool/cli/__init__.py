"""The command line: one module per command (its options and printing only), and the modules they
share (:mod:`.console`, :mod:`.options`, :mod:`.progress`, :mod:`.tables`). The Typer app is
:data:`mhctool.cli.app.app`; ``mhctool`` runs :func:`main`."""
from __future__ import annotations


def main() -> None:
    """``mhctool``: a signal that comes where a command does not handle its own (while Python imports
    the command line, before a run starts measuring) stops it with exit code 130 and one sentence,
    never a traceback; a run that measures writes what it has (its own handling)."""
    import signal
    import sys

    def stopped(signum, frame):
        sys.stderr.write(f"interrupted ({signal.Signals(signum).name}): stopped at once; no report written\n")
        raise SystemExit(130)
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, stopped)
    from mhctool.cli.app import main as run
    try:
        run()
    except SystemExit:  # the command's own end (an uncaught error's traceback stays on the terminal)
        from mhctool.core.library_log import after_conclusion
        after_conclusion()
        raise
