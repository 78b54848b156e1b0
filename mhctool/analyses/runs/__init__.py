"""Each command's run: a request (what the user asked, checked), :func:`run`, and an outcome
(the rows, the verdicts, the hints and the paths written; the report written once). A command
parses its options into the request, calls ``run`` and prints the outcome; the API and the tests
call the same functions. One module per command; :class:`Watch` is how a run tells its watcher
what it does while it works."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


def _nothing(*args) -> None:
    return None


@dataclass
class Watch:
    """What a run says as it goes: ``planned(total)`` once it knows how many units of work it has,
    ``started(label, detail)`` as a unit of work (a case, a step, a
    measurement) starts, ``finished()`` as it ends, ``status(line)`` for what takes long now (not
    shown with --quiet), ``say(line)`` for a line always shown at once (a signal's). ``consoles``: the
    command's own consoles, kept on the terminal while the libraries' output goes to the log."""

    planned: Callable[[int], None] = _nothing
    started: Callable[[str, str], None] = _nothing
    finished: Callable[[], None] = _nothing
    status: Callable[[str], None] = _nothing
    say: Callable[[str], None] = _nothing
    consoles: dict = field(default_factory=dict)


class Stopped(Exception):
    """A signal asked a run to stop: raised where its next unit of work would start (a sweep's
    stage, identify's probe), caught by the run, which writes what it measured."""


def stop_point(requested: Callable[[], bool]) -> None:
    """Where a run may stop: raises :class:`Stopped` once ``requested()`` (a signal came)."""
    if requested():
        raise Stopped
