"""A process's descendants, and ending them: where a worker is stopped, what it started (its own
fork server, the isolation workers forked from that, a hung one among them) is ended with it,
never left running after mhctool exits. Linux reads ``/proc``; elsewhere nothing is found."""
from __future__ import annotations

import contextlib
import os
import signal


def _stat(pid: int) -> tuple[int, str] | None:
    """(parent pid, start time) of ``pid`` from /proc, or None where it is gone or unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2:].split()  # after the command name, which may hold spaces
    try:
        return int(fields[1]), fields[19]
    except (IndexError, ValueError):
        return None


def descendants(pid: int) -> list[tuple[int, str]]:
    """Every process below ``pid`` now, as (pid, start time): the time tells it from a later
    process that was given the same pid."""
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return []
    children: dict[int, list[tuple[int, str]]] = {}
    for p in pids:
        st = _stat(p)
        if st is not None:
            children.setdefault(st[0], []).append((p, st[1]))
    out, todo = [], [pid]
    while todo:
        for kid in children.get(todo.pop(), []):
            out.append(kid)
            todo.append(kid[0])
    return out


def end(procs: list[tuple[int, str]]) -> None:
    """SIGKILL each of ``procs`` that still runs as the same process."""
    for pid, start in procs:
        st = _stat(pid)
        if st is not None and st[1] == start:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
