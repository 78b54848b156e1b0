"""One case as a worker process runs it: the job (everything plain enough to pickle), what runs it
in the worker (:func:`case_job`), how long it may take, and the rows of a case whose worker died
twice.

The pool imports this module and must stay free of torch until a command has started the fork
server (``docs/dev/architecture.md``, "Imports inside functions"): what needs the runner or the
registry is imported inside the function that runs the job."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from mhctool.core import profile
from mhctool.core.names import is_outside
from mhctool.spread.forkserver import start_forkserver


@dataclass(frozen=True)
class IsolationSettings:
    """What a worker needs to isolate the implementations under test as the parent would.
    ``own`` False (a case's first run in a worker): mhctool's own implementations (its Triton,
    cuTile and PyTorch kernels) run in the worker itself, which is a process apart already; what
    they do to it (a crash, a hang, a CUDA fault) runs the case again with ``own`` True, every
    implementation isolated. External ones (a file, a library) are always isolated: code that
    changes its process's state (a global flag) must not reach the cases after it."""

    transport: str = "shm"
    case_timeout: float | None = None
    own: bool = False
    insist: bool = False  # Isolation.insist


@dataclass(frozen=True)
class Job:
    """One case, as a worker runs it: everything plain enough to pickle."""

    case: object  # runner.Case
    specs: tuple  # the --impl specs the parent resolved (empty: every default built-in)
    rule: object  # verdict.VerdictRule
    matmul_precision: str
    conventions: dict | None
    checks: tuple
    repeats: int
    isolation: IsolationSettings | None
    input_dtypes: dict | None = None  # the external implementations' declared input dtypes
    stopped: tuple = ()  # (implementation name, why): not run on this case (Streaks)


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
        """A case's rows: each of ``names`` that has rows, by whether an error row says its process ended."""
        for name in names:
            mine = [r for r in rows if r.get("impl") == name]
            if mine:
                ended = next((r for r in mine if r.get("metric") == "error" and r.get("rule") in (*ENDED, "timeout")), None)
                self.saw(name, ended and ended["rule"], ended and ended["message"] or "")

    def why(self, name: str) -> str | None:
        """Why ``name`` is not run any more, or None."""
        kind, count, message = self.streak.get(name, (None, 0, ""))
        if self.insist or kind is None or count < (HUNG_IN_A_ROW if kind == "timeout" else ENDED_IN_A_ROW):
            return None
        return stopped_message(kind, count, message)

    def stopped(self, names: list[str]) -> tuple:
        return tuple((n, w) for n in names if (w := self.why(n)) is not None)


_isolations: dict = {}


def case_job(job: Job) -> dict:
    """Run one case in this (worker) process; the rows and whether an interrupt cut it short."""
    from mhctool.registry.specs import resolve_impls
    from mhctool.runner import run as runner
    from mhctool.spread.case_isolation import Isolation
    t0 = time.perf_counter()
    impls = resolve_impls(job.case.kernel, list(job.specs))
    stopped = dict(job.stopped)
    skipped = [i for i in impls if i.name in stopped]
    impls = [i for i in impls if i.name not in stopped]
    resolving = time.perf_counter() - t0
    iso = None
    if job.isolation is not None:
        iso = _isolations.get(job.isolation)
        if iso is None:
            iso = _isolations[job.isolation] = Isolation(transport=job.isolation.transport,
                                                                case_timeout=job.isolation.case_timeout,
                                                                own=job.isolation.own, insist=job.isolation.insist)
        # the fork server of this worker's isolation workers, started while the case's inputs,
        # reference and native run come first (none where nothing of the case is isolated)
        if any(iso.isolates(i) for i in impls if not i.native):
            start_forkserver()
    res = runner.run_case(job.case, impls, job.rule, job.matmul_precision, iso, job.conventions,
                          job.checks, job.repeats, input_dtypes=job.input_dtypes)
    rows = res.rows + error_rows(job, [(i.name, i.backend) for i in skipped], "stopped",
                                 lambda name, direction: stopped[name])
    return {"rows": rows, "abandoned": res.abandoned,
            "timings": profile.add(res.timings, {profile.RESOLVING: resolving})}


def job_timeout(job: Job, impls: int) -> float:
    """How long one case may take in a worker: the isolation limit of each implementation, the
    native run and the reference included (each one compiles and runs inside it)."""
    from mhctool.runner.case import default_timeout, footprint
    if job.isolation is not None and job.isolation.case_timeout is not None:
        per = job.isolation.case_timeout
    else:
        per = default_timeout(footprint(job.case), job.case.device,
                              external=any(is_outside(s) for s in job.specs))
    checks = 1 + (job.repeats if job.checks else 0)
    return per * (impls + 2) * checks


def error_rows(job: Job, impl_names: list[tuple[str, str]], rule: str, message) -> list[dict]:
    """One failed error row per implementation and direction, ``message(name, direction)`` saying why."""
    from mhctool.registry.impl import Impl
    from mhctool.runner.case import row_fields
    rows = []
    for name, backend in impl_names:
        base = row_fields(job.case, job.case.shape, Impl(name, job.case.kernel, backend, name), "ieee",
                         job.case.knob_dict)
        for direction in ("fwd", "bwd"):
            rows.append({**base, "direction": direction, "tensor": "*", "metric": "error", "value": math.nan,
                         "threshold": None, "passed": False, "rule": rule, "message": message(name, direction)})
    return rows


def lost_rows(job: Job, impl_names: list[tuple[str, str]], why: str) -> list[dict]:
    """One error row per implementation and direction: the case's worker died twice, the second
    time with every implementation isolated, so mhctool's own part of the case is what failed."""
    return error_rows(job, impl_names, "lost", lambda name, direction: f"the worker running this case died: {why}"
                      if direction == "fwd" else "not run: the case's worker died")


@dataclass
class Spread:
    """What :func:`run_cases` returns: rows per case index (None: not finished)."""

    rows: list
    interrupted: bool
    timings: dict = field(default_factory=dict)  # phase -> seconds, inside the cases and outside them
