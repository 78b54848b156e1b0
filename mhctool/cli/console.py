"""mhctool's two consoles and the guard that turns bad input into one sentence and exit code 2."""
from __future__ import annotations

import functools

import typer
from rich.console import Console

from mhctool.core.errors import UsageError

# soft_wrap: a line is never broken (a command or path copied from a CI log must work); tables still
# lay out at the width
out = Console(highlight=False, soft_wrap=True, width=160)
err = Console(stderr=True, highlight=False, soft_wrap=True)
state = {"debug": False}


def guard(fn):
    """Turn UsageError into one sentence and exit 2 (a traceback only with --debug)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UsageError as e:
            if state["debug"]:
                raise
            err.print(f"error: {e}", markup=False)
            raise typer.Exit(2)

    return wrapper


def say(line: str) -> None:
    """A line on stderr, as it is (no markup)."""
    err.print(line, markup=False)


def consoles() -> dict:
    """The consoles by the stream they print to (what the library log keeps on the terminal)."""
    return {"stdout": out, "stderr": err}
