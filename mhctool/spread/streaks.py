"""An implementation that keeps ending its process, or hangs, is stopped: how its last cases
ended, counted where the cases run (the runner's isolation, the pool that hands cases out), and
the row of a case it was not run on. Free of torch (the pool imports it before the fork server)."""
from __future__ import annotations

# an implementation that ended its process (exit, signal, vanished) in this many cases in a row, or
# hung past the time limit in this many, is not run on the cases after unless the run insists: a
# broken stranger costs seconds, not a new worker and a time limit a case
ENDED_IN_A_ROW = 2
HUNG_IN_A_ROW = 1
ENDED = ("exit", "signal", "lost")  # the failure kinds (a row's rule) of a process that ended


def stopped_message(kind: str, count: int, message: str) -> str:
    """The row of a case an implementation was not run on, and why."""
    what = "hung past the time limit" if kind == "timeout" else "ended its process"
    cases = "the last case" if count == 1 else f"the last {count} cases"
    return f"not run: it {what} in {cases} ({message}); --insist runs it on every case"


class Streaks:
    """Per implementation, how its last cases ended (``ended`` or ``timeout``, how many in a row,
    the last message): :meth:`stopped` names those past their limit. What the runner's isolation
    keeps for the calls it makes, and the pool for the cases it hands out (a worker that died with
    the implementation in it is seen in the case's rows)."""

    def __init__(self, insist: bool = False):
        self.insist = insist
        self.streak: dict[str, tuple[str, int, str]] = {}

    def saw(self, name: str, kind: str | None, message: str = "") -> None:
        """One more case of ``name`` that ended by ``kind`` (a failure's kind or a row's rule; None:
        it returned)."""
        kind = "timeout" if kind == "timeout" else "ended" if kind in ENDED else None
        if kind is None:
            self.streak.pop(name, None)
            return
        last, count, _ = self.streak.get(name, (None, 0, ""))
        self.streak[name] = (kind, count + 1 if last == kind else 1, message)

    def saw_rows(self, rows: list[dict], names: list[str]) -> None:
        """A case's rows: each of ``names`` that has rows, by whether an error row says its own
        process ended or hung (``exit``, ``signal``, ``timeout``: its isolation worker's; a case
        whose worker died twice, ``lost``, is mhctool's part, counted against none)."""
        for name in names:
            mine = [r for r in rows if r.get("impl") == name]
            if mine:
                ended = next((r for r in mine if r.get("metric") == "error"
                              and r.get("rule") in ("exit", "signal", "timeout")), None)
                self.saw(name, ended and ended["rule"], ended and ended["message"] or "")

    def why(self, name: str) -> str | None:
        """Why ``name`` is not run any more, or None."""
        kind, count, message = self.streak.get(name, (None, 0, ""))
        if self.insist or kind is None or count < (HUNG_IN_A_ROW if kind == "timeout" else ENDED_IN_A_ROW):
            return None
        return stopped_message(kind, count, message)

    def stopped(self, names: list[str]) -> tuple:
        return tuple((n, w) for n in names if (w := self.why(n)) is not None)
