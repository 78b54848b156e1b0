"""``mhctool gate`` as a run: a suite's parity entries, golden checks, stability sweeps and
training runs as one CI verdict, with its report, JUnit XML and Markdown summary (the suite's
entries are :mod:`mhctool.analyses.gate`'s)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa

from mhctool.analyses import gate as gate_mod
from mhctool.analyses import parity
from mhctool.analyses.runs import Watch
from mhctool.core import environment, report
from mhctool.core.library_log import beside
from mhctool.spread import pool, setup


@dataclass
class Request:
    suite: Path
    junit: Path = Path("mhctool-gate.xml")
    summary: Path = Path("mhctool-gate.md")
    out: Path = Path("mhctool-gate.parquet")
    device: str | None = None  # the parity entries' default
    isolate: bool = True
    case_timeout: float | None = None
    workers: str | None = None
    shard: str | None = None
    backend: str = "local"
    ray_address: str | None = None
    insist: bool = False  # an implementation that keeps ending its process or hanging runs on every case


@dataclass
class Outcome:
    suite_name: str
    cases: list[gate_mod.Case]  # one a verdict, metric check or configuration
    interrupted: bool
    paths: tuple[Path, Path, Path]  # report, JUnit XML, Markdown summary
    timings: dict = field(default_factory=dict)  # the parity entries' phases (core.profile)
    wall: float = 0.0
    workers: int = 1
    library_log: str | None = None  # where the libraries' own output went, where they wrote any

    @property
    def failed(self) -> list[gate_mod.Case]:
        return [c for c in self.cases if c.passed is False]

    @property
    def passed(self) -> int:
        return sum(c.passed is True for c in self.cases)

    @property
    def hints(self) -> list[str]:
        return gate_mod.hints_of(self.cases)

    @property
    def exit_code(self) -> int:
        return 130 if self.interrupted else 1 if self.failed else 0


def write_outputs(table: pa.Table, suite_name: str, cases: list, out: Path, junit: Path, summary: Path) -> None:
    """A gate's report, JUnit XML and Markdown summary, each written atomically (a gate run, or the
    slices of one merged by ``mhctool report merge``)."""
    report.write_atomic(table, out)
    xml = gate_mod.junit_xml(suite_name, cases)
    report.atomic(junit, lambda tmp: Path(tmp).write_bytes(xml))
    report.write_summary(summary, gate_mod.markdown(suite_name, cases))


def run(req: Request, watch: Watch = Watch()) -> Outcome:
    """Run every entry of the suite (or the request's shard of it) and write what it found."""
    for path, what in ((req.junit, "--junit"), (req.summary, "--summary"), (req.out, "--out")):
        report.check_writable(path, what, report.REPORT_SUFFIXES if what == "--out" else None)
    suite = gate_mod.load_suite(req.suite)
    dev = environment.resolve_device(req.device)
    cut = parity.parse_shard(req.shard)
    asked = pool.parse_workers(req.workers)  # per parity entry: pool.worker_count of its cases
    pool.check_backend(req.backend)
    size = pool.worker_count(asked, dev, 1 << 30)  # the most any entry gets
    s = setup.prepare(dev, isolate=req.isolate, default_isolate=req.isolate, case_timeout=req.case_timeout,
                      insist=req.insist, workers=size, backend=req.backend, library_log=beside(req.out),
                      consoles=watch.consoles, say=watch.say)
    timings: dict = {}
    t0 = time.perf_counter()

    def progress(what: str) -> None:
        watch.started(what, what)
        watch.finished()
    with s.running():
        cases = gate_mod.run_suite(suite, dev, progress=progress, isolation=s.isolation, interrupted=s.interrupts,
                                   shard=cut, workers=asked, backend=req.backend, ray_address=req.ray_address,
                                   timings=timings)
        meta = environment.metadata()  # with the threads the run computed with
    wall = time.perf_counter() - t0
    rows = [{"suite": suite.name, "entry": c.suite_item, "kind": c.kind, "name": c.name, "passed": c.passed,
             "message": c.message} for c in cases]
    settings = {"command": "gate", "suite": str(req.suite), "suite_name": suite.name, "isolate": s.isolation is not None,
                "interrupted": s.interrupts.requested, "workers": size, "backend": req.backend,
                "profile": {k: round(v, 4) for k, v in timings.items()}, "wall_s": round(wall, 3)}
    if cut is not None:
        settings |= {"shard": f"{cut[0]}/{cut[1]}", "units": [c.unit for c in cases]}
    if gate_mod.hints_of(cases):
        settings["hints"] = gate_mod.hints_of(cases)
    table = report.to_table(rows, report.new_run_id(), "gate", meta, settings, schema=report.GATE_SCHEMA)
    write_outputs(table, suite.name, cases, req.out, req.junit, req.summary)
    return Outcome(suite.name, cases, s.interrupts.requested, (req.out, req.junit, req.summary), timings, wall, size,
                   s.library_log)
