"""Errors the CLI turns into one sentence and exit code 2, and what a call of code under test
that exits says in its failed row."""


class UsageError(ValueError):
    """Bad input from the user: an unknown name, a malformed value, a missing file."""


def system_exit_message(e: SystemExit) -> str:
    """The failed row's message of an implementation that called ``sys.exit``."""
    return f"the implementation called sys.exit({e.code!r})"


class Interrupted(BaseException):
    """A second Ctrl-C (or SIGTERM): leave at once; the command line turns it into exit code 130.
    A BaseException, so that nothing on the way swallows it and atomic writers still clean up."""
