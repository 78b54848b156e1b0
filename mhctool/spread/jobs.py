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
