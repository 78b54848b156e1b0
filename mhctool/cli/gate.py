"""``mhctool gate``: its options, the run (:mod:`mhctool.analyses.runs.gate`) and what it prints."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from mhctool.cli import options as opts
from mhctool.cli.console import guard, out
from mhctool.cli.progress import watching
from mhctool.core.library_log import said
from mhctool.spread import setup

Suite = Annotated[Path, typer.Option("--suite", help="Suite TOML (parity runs, golden comparisons, golden checks).")]
Junit = Annotated[Path, typer.Option("--junit", help="JUnit XML to write.")]
Summary = Annotated[Path, typer.Option("--summary", help="Markdown summary to write (also appended to $GITHUB_STEP_SUMMARY when set).")]
Device = Annotated[Optional[str], typer.Option("--device", callback=opts.lower, help="Default device of parity entries.")]
Isolate = Annotated[bool, typer.Option("--isolate/--no-isolate", help="Run the implementations under test in child processes (default on: a crash, an exit or a hang fails its check and the suite goes on).")]
Workers = Annotated[Optional[str], typer.Option("--workers", envvar="MHCTOOL_WORKERS", show_default="spread where it pays", help="N or auto: spread each parity entry's cases over N worker processes (auto: one per visible GPU, or per core). Unset: one per GPU, or per core with at least 4 cases each.")]
Shard = Annotated[Optional[str], typer.Option("--shard", help="I/N: run only the I-th of N deterministic slices of the suite (a CI matrix); join the reports with mhctool report merge.")]
Backend = Annotated[str, typer.Option("--backend", help="local (worker processes here) or ray: one Ray task per parity case (needs pip install ray).")]
RayAddress = Annotated[Optional[str], typer.Option("--ray-address", help="With --backend ray: the cluster to join (default: a local one).")]
Profile = Annotated[bool, typer.Option("--profile", help="Print where the parity entries' time went (as parity --profile does, summed over the entries); the report keeps it in any case.")]


@guard
def gate(
    suite: Suite,
    junit: Junit = Path("mhctool-gate.xml"),
    summary: Summary = Path("mhctool-gate.md"),
    out_path: Annotated[Path, typer.Option("--out", "-o", help="Parquet report to write.")] = Path("mhctool-gate.parquet"),
    device: Device = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q")] = False,
    isolate: Isolate = True,
    case_timeout: opts.CaseTimeout = None,
    insist: opts.Insist = False,
    workers: Workers = None,
    shard: Shard = None,
    backend: Backend = "local",
    ray_address: RayAddress = None,
    show_profile: Profile = False,
):
    """Run a suite of checks as one CI verdict: exit 0 pass, 1 a failure, 2 bad input."""
    setup.warm(workers, backend, isolate, device)  # the fork server imports torch while this process plans
    from mhctool.analyses.runs import gate as run
    req = run.Request(suite, junit, summary, out_path, device, isolate, case_timeout, workers, shard, backend,
                      ray_address, insist)
    with watching("gate", None, quiet, unit="checks started") as watch:
        o = run.run(req, watch)
    if show_profile:
        from mhctool.core.profile import lines
        for line in lines(o.timings, o.wall, o.workers):
            out.print(line, markup=False)
    code = show(o.suite_name, o.cases, o.paths, quiet, o.interrupted)
    if o.library_log and not quiet:
        out.print(said(o.library_log), markup=False)
    raise typer.Exit(code)


def show(suite_name: str, cases: list, paths: tuple, quiet: bool, interrupted: bool) -> int:
    """A gate's failed checks, hints and verdict line (a run, or slices merged); its exit code."""
    from mhctool.analyses.gate import hints_of
    out_path, junit, summary = paths
    failed = [c for c in cases if c.passed is False]
    if not quiet:
        for c in failed[:30]:
            out.print(f"[red]FAIL[/] {c.suite_item}: {c.name}: {c.message}")
    for hint in hints_of(cases):
        out.print(hint, markup=False)
    ok = sum(c.passed is True for c in cases)
    where = f"(suite {suite_name}; {junit}, {summary}, {out_path})"
    if interrupted:
        out.print(f"[yellow]INTERRUPTED[/] {ok} passed, {len(failed)} failed before the stop {where}")
        return 130
    out.print(("[red]FAILED[/] " if failed else "[green]PASSED[/] ") +
              f"{ok} passed, {len(failed)} failed, {len(cases) - ok - len(failed)} skipped {where}")
    return 1 if failed else 0
