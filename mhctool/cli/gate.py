"""``mhctool gate``: a suite's verdicts, its JUnit XML and Markdown summary."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import typer

from mhctool.cli import kit as clikit
from mhctool.cli.kit import device as _device
from mhctool.cli.kit import guard as _guard
from mhctool.cli.kit import out


@_guard
def gate(
    suite: Path = typer.Option(..., "--suite", help="Suite TOML (parity runs, golden comparisons, golden checks)."),
    junit: Path = typer.Option(Path("mhctool-gate.xml"), "--junit", help="JUnit XML to write."),
    summary: Path = typer.Option(Path("mhctool-gate.md"), "--summary", help="Markdown summary to write (also appended to $GITHUB_STEP_SUMMARY when set)."),
    out_path: Path = typer.Option(Path("mhctool-gate.parquet"), "--out", "-o", help="Parquet report to write."),
    device: Optional[str] = typer.Option(None, "--device", help="Default device of parity entries."),
    quiet: bool = typer.Option(False, "--quiet", "-q"),
    isolate: bool = typer.Option(True, "--isolate/--no-isolate", help="Run the implementations under test in child processes (default on: a crash, an exit or a hang fails its check and the suite goes on)."),
    case_timeout: Optional[float] = typer.Option(None, "--case-timeout", min=0.001, help="Seconds an isolated implementation may take for one case (default: scaled with the case)."),
    workers: Optional[str] = typer.Option(None, "--workers", envvar="MHCTOOL_WORKERS", show_default="spread where it pays", help="N or auto: spread each parity entry's cases over N worker processes (auto: one per visible GPU, or per core). Unset: one per GPU, or per core with at least 4 cases each."),
    shard: Optional[str] = typer.Option(None, "--shard", help="I/N: run only the I-th of N deterministic slices of the suite (a CI matrix); join the reports with mhctool report merge."),
    backend: str = typer.Option("local", "--backend", help="local (worker processes here) or ray: one Ray task per parity case (needs pip install ray)."),
    ray_address: Optional[str] = typer.Option(None, "--ray-address", help="With --backend ray: the cluster to join (default: a local one)."),
    show_profile: bool = typer.Option(False, "--profile", help="Print where the parity entries' time went (as parity --profile does, summed over the entries); the report keeps it in any case."),
):
    """Run a suite of checks as one CI verdict: exit 0 pass, 1 a failure, 2 bad input."""
    from mhctool.spread import pool, prewarm
    pool.warm(workers, backend, isolate, device)  # the fork server (workers, isolation) imports torch while this process plans
    prewarm.start(device)
    from mhctool.core import environment, report
    for path_, what in ((junit, "--junit"), (summary, "--summary"), (out_path, "--out")):
        report.check_writable(path_, what, report.REPORT_SUFFIXES if what == "--out" else None)
    from mhctool.analyses import gate as gate_mod
    s = gate_mod.load_suite(suite)
    dev = _device(device)
    from mhctool.analyses import parity as parity_mod
    cut = parity_mod.parse_shard(shard)
    n_workers = pool.parse_workers(workers)  # per parity entry: pool.worker_count of its cases
    pool.check_backend(backend)
    interrupts = clikit.Interrupts()
    iso = clikit.isolation_for(isolate, [], dev, case_timeout, None, interrupts, default_on=isolate)
    log = clikit.LogProgress("gate", None, enabled=not quiet and not out.is_terminal, unit="checks started")

    def progress(what: str) -> None:
        log.done += 1
        log.now = what
    timings: dict = {}
    t0 = time.perf_counter()
    size = pool.worker_count(n_workers, dev, 1 << 30)  # the most any entry gets
    from mhctool.spread.machine import pinned_threads, threads_for
    try:
        with interrupts, log, pinned_threads(threads_for(dev, size)):
            cases = gate_mod.run_suite(s, dev, progress=progress, isolation=iso, interrupted=interrupts, shard=cut,
                                       workers=n_workers, backend=backend, ray_address=ray_address, timings=timings)
            meta = environment.metadata()  # with the threads the run computed with
    finally:
        if iso is not None:
            iso.close()
    wall = time.perf_counter() - t0
    rows = [{"suite": s.name, "entry": c.suite_item, "kind": c.kind, "name": c.name, "passed": c.passed,
             "message": c.message} for c in cases]
    settings = {"command": "gate", "suite": str(suite), "suite_name": s.name, "isolate": iso is not None,
                "interrupted": interrupts.requested, "workers": size, "backend": backend,
                "profile": {k: round(v, 4) for k, v in timings.items()}, "wall_s": round(wall, 3)}
    if show_profile:
        from mhctool.core.profile import lines
        for line in lines(timings, wall, size):
            out.print(line, markup=False)
    if cut is not None:
        settings |= {"shard": f"{cut[0]}/{cut[1]}", "units": [c.unit for c in cases]}
    if gate_mod.hints_of(cases):
        settings["hints"] = gate_mod.hints_of(cases)
    table = report.to_table(rows, report.new_run_id(), "gate", meta, settings,
                            schema=report.GATE_SCHEMA)
    _gate_outputs(table, s.name, cases, out_path, junit, summary, quiet, interrupts.requested)


def _gate_outputs(table, suite_name: str, cases: list, out_path: Path, junit: Path, summary: Path, quiet: bool,
                  interrupted: bool) -> None:
    """A gate's report, JUnit XML and Markdown summary, written atomically, and its verdict line
    and exit code (a gate run, or slices of one merged by mhctool report merge)."""
    from mhctool.core import report
    report.write_atomic(table, out_path)
    from mhctool.analyses import gate as gate_mod
    xml = gate_mod.junit_xml(suite_name, cases)
    report.atomic(junit, lambda tmp: Path(tmp).write_bytes(xml))
    clikit.write_summary(summary, gate_mod.markdown(suite_name, cases))
    failed = [c for c in cases if c.passed is False]
    if not quiet:
        for c in failed[:30]:
            out.print(f"[red]FAIL[/] {c.suite_item}: {c.name}: {c.message}")
    for hint in gate_mod.hints_of(cases):
        out.print(hint, markup=False)
    ok = sum(c.passed is True for c in cases)
    if interrupted:
        out.print(f"[yellow]INTERRUPTED[/] {ok} passed, {len(failed)} failed before the stop "
                  f"(suite {suite_name}; {junit}, {summary}, {out_path})")
        raise typer.Exit(130)
    out.print(("[red]FAILED[/] " if failed else "[green]PASSED[/] ") +
              f"{ok} passed, {len(failed)} failed, {len(cases) - ok - len(failed)} skipped "
              f"(suite {suite_name}; {junit}, {summary}, {out_path})")
    raise typer.Exit(1 if failed else 0)
