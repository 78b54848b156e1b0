"""``mhctool parity``: its options, its progress and its tables (the engine is
:mod:`mhctool.analyses.parity`)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from mhctool.cli import kit as clikit
from mhctool.cli.kit import device as _device
from mhctool.cli.kit import err, out
from mhctool.cli.kit import fmt as _fmt
from mhctool.cli.kit import guard as _guard
from mhctool.cli.kit import short_impl as _short_impl
from mhctool.cli.kit import split as _split
from mhctool.core import names
from mhctool.core.errors import UsageError


def _verdict_table(vs: list[dict], top: int, title: str) -> Table:
    t = Table(title=title, show_lines=False)
    for c in ("kernel", "impl", "family", "dtype", "shape", "knobs", "dir", "verdict", "worst",
              "value", "threshold", "rule / reason"):
        t.add_column(c, overflow="fold")
    for v in vs[:top]:
        w = v["worst"] or {}
        verdict = {True: "[green]pass[/]", False: "[red]FAIL[/]", None: "[yellow]skip[/]"}[v["passed"]]
        worst = f"{w.get('tensor')}.{w.get('metric')}" if w else "-"
        reason = v["message"] if (v["passed"] is not True and v["message"]) else w.get("rule", "-")
        t.add_row(v["kernel"], _short_impl(v["impl"]), v["family"], v["dtype"], v["shape"],
                  v["knobs"].strip("{}").replace('"', ""), v["direction"], verdict, worst,
                  _fmt(w.get("value")), _fmt(w.get("threshold")), str(reason))
    return t


def _check_call_shape(vs: list[dict], outside: list[str]) -> None:
    """An outside implementation whose every case failed because it cannot be called with the
    family's signature, or returns what the contract cannot take, is bad input: one sentence
    naming the signature (the report keeps its rows)."""
    from mhctool.families import call_problem, get_family, signature
    for name in outside:
        mine = [v for v in vs if v["impl"] == name and v["direction"] == "fwd" and v["passed"] is not None]
        if mine and all(v["passed"] is False and call_problem(v["message"]) for v in mine):
            k = mine[0]["kernel"]
            raise UsageError(f"--impl {_short_impl(name)} cannot be judged as {k}: {mine[0]['message']}; "
                             f"expected {signature(get_family(k))}")


def _summary(vs: list[dict]) -> tuple[int, int, int]:
    from mhctool.core.findings import tally
    return tally(v["passed"] for v in vs)


@_guard
def parity(
    kernel: Optional[str] = typer.Option(None, "--kernel", "-k", help="A kernel, a comma-separated list, or a group (all; mhc or moe: every kernel of one kind): " + ", ".join(names.KERNELS) + ". Default: the kernels of --scenario, else all."),
    impl: Optional[list[str]] = typer.Option(None, "--impl", "-i", help="Implementation(s): torch, compile, triton, cutile, module.path:function or file.py:function. Repeat or comma-separate. Default: every available built-in one."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="Comma-separated dtypes (fp32, bf16, fp16); default: the scenario's."),
    shape: Optional[str] = typer.Option(None, "--shape", help="SxBxNxC for mHC kernels (e.g. 8192x4x4x7168), TxHxFxE for grouped-MLP ones (e.g. 4096x2048x1024x8); default: the scenario's."),
    device: Optional[str] = typer.Option(None, "--device", help="cpu or cuda (default: cuda when present)."),
    scenario: Optional[str] = typer.Option(None, "--scenario", help="Scenario TOML file or built-in name (parity-default, paper)."),
    seed: Optional[int] = typer.Option(None, "--seed", min=0, help="Input seed (default: the scenario's)."),
    out_path: Path = typer.Option(Path("mhctool-parity.parquet"), "--out", "-o", help="Parquet report to write."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Folder for PNG plots made from the report."),
    matmul_precision: str = typer.Option("ieee", "--matmul-precision", help="ieee, tf32 (rounded to nearest, cuBLAS), tf32_trunc (truncated operands, Triton's tl.dot default on fp32) or bf16: the precision external kernels multiply at by design; they are judged against the native implementation at it."),
    kappa: Optional[float] = typer.Option(None, "--kappa", min=1.0, help="Error may be kappa x the native error (default: scenario's, 2)."),
    top: int = typer.Option(20, "--top", min=1, help="Rows of the worst-cases table."),
    hint: bool = typer.Option(True, "--hint/--no-hint", help="Where an outside implementation fails on a measurement, identify what it computes (seconds to a minute a kernel) and print a hint with the flags that judge it."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print only the summary line."),
    isolate: Optional[bool] = typer.Option(None, "--isolate/--no-isolate", help="Run each implementation under test in a child process, so exits, crashes, hangs and CUDA faults become failed rows. Default: on for an external --impl on a GPU or with --case-timeout, off otherwise."),
    case_timeout: Optional[float] = typer.Option(None, "--case-timeout", min=0.001, help="Seconds an isolated implementation may take for one case (default: 120 s plus 30 s per GiB the case needs, 300 s more for an external one, which compiles inside the call; 4x that on the CPU)."),
    isolate_transport: Optional[str] = typer.Option(None, "--isolate-transport", show_default="shm", help="How tensors reach the child (needs isolation): shm (CUDA tensors as CUDA IPC handles, CPU ones in host shared memory), host (everything through host shared memory) or file (torch.save in /dev/shm)."),
    check: Optional[list[str]] = typer.Option(None, "--check", help="Also compare bits: determinism (the same inputs, run after run) and/or batch-invariance (each token's result at other batch sizes). Repeat or comma-separate; a difference is a failed row."),
    repeats_determinism: int = typer.Option(3, "--repeats-determinism", min=2, help="Runs in all for --check determinism."),
    convention: Optional[list[str]] = typer.Option(None, "--convention", help="KNOB=VALUE (repeat): the convention the external implementation computes (stabilize=softmax, transpose_res=true, eps_mode=clamp, eps=0, iters=10, rms_eps=inside, compute_h_eps=1e-6); the reference and the native baseline compute it too, and a function that takes no such parameter is called without it."),
    input_dtypes: Optional[list[str]] = typer.Option(None, "--input-dtypes", help="NAME=DTYPE (repeat or comma-separate): the dtype the external implementation takes an input in: activation (the case's dtype), fp32, bf16 or fp16, e.g. h_pre=activation for a function that multiplies in one dtype. The float64 reference and the native baseline see the same rounded values; its gradients are judged at the contract's threshold."),
    workers: Optional[str] = typer.Option(None, "--workers", envvar="MHCTOOL_WORKERS", show_default="spread where it pays", help="N or auto: spread the cases over N worker processes (auto: one per visible GPU, or per core on a CPU). Unset: one per GPU, or per core with at least 4 cases each. The report has the same rows in the same order as one process."),
    shard: Optional[str] = typer.Option(None, "--shard", help="I/N: run only the I-th of N deterministic slices of the cases (a CI matrix, a Slurm array); join the reports with mhctool report merge."),
    backend: str = typer.Option("local", "--backend", help="local (worker processes here) or ray: one Ray task per case (needs pip install ray)."),
    ray_address: Optional[str] = typer.Option(None, "--ray-address", help="With --backend ray: the cluster to join (ray.init's address; default: a local one)."),
    ranks: int = typer.Option(1, "--ranks", help="Split each case's tokens over R processes joined by torch.distributed (Gloo on the CPU, NCCL on GPUs, a GPU a rank), the parameter gradients all-reduced, as under data or sequence parallelism; the native baseline runs the same way."),
    grad_reduce: str = typer.Option("fp32", "--grad-reduce", help="With --ranks: the dtype the parameter gradients are all-reduced in: fp32, or bf16 (as --grad-reduce-in-bf16 trains)."),
    verbose: bool = typer.Option(False, "--verbose", help="Let the libraries' own log lines (TileLang, Triton, NCCL) show; by default they go to a log file beside the report, named in its metadata and after the summary."),
    show_profile: bool = typer.Option(False, "--profile", help="Print where the time went: inputs, the native run, the float64 reference, each implementation (its first call in a process, which compiles, apart), judging, checks, and with --workers what was spent outside the cases (the report keeps it in any case)."),
):
    """Run implementations and the float64 reference side by side, forward and backward."""
    from mhctool.spread import pool, prewarm
    pool.warm(workers, backend, bool(isolate), device)  # the fork server imports torch while this process plans
    prewarm.start(device)  # Triton's hash of itself, on a thread
    clikit.precheck(kernel, _split([dtype]) if dtype else None, shape, device)
    from mhctool.core import report
    from mhctool.core.findings import (
        baseline_findings,
        counts,
        judged_nothing,
        outside_impls,
        skipped_everywhere,
        verdicts,
        worst_first,
    )
    report.check_writable(out_path)
    if plot is not None:
        report.check_folder(plot)
    dev = _device(device)
    if kernel is None and scenario is not None:  # the scenario's kernels
        from mhctool.analyses import scenario as scenario_mod
        kernel = ",".join(dict.fromkeys(spec.kernel for spec in scenario_mod.resolve(scenario).specs)) or "all"
    kernel = kernel or "all"
    from mhctool.analyses import parity as parity_mod
    kernels = parity_mod.kernels_of(kernel)
    specs = _split(impl)
    declared = clikit.conventions(convention, kernels)
    pl = parity_mod.plan(kernels, specs, device=dev, scenario=scenario,
                         dtypes=_split([dtype]) if dtype else None, shapes=[shape] if shape else None,
                         seeds=[seed] if seed is not None else None, conventions=declared, kappa=kappa,
                         matmul_precision=matmul_precision, checks=_split(check), repeats=repeats_determinism,
                         input_dtypes=clikit.input_dtypes(input_dtypes, kernels))
    pl = parity_mod.sharded(pl, parity_mod.parse_shard(shard))
    cases = pl.cases
    from mhctool.spread import sharded
    pl.sharding = sharded.parse(ranks, grad_reduce, sorted({c.kernel for c in pl.cases}), dev)
    n_workers, backend = clikit.spread_for(workers, backend, dev, pl, alone=pl.sharding is not None)
    if pl.sharding is not None and (n_workers > 1 or backend != "local" or pl.checks):
        raise UsageError("--ranks runs each case over its own processes: it takes neither --workers, "
                         "--backend ray nor --check")

    show = not quiet and out.is_terminal
    interrupts = clikit.Interrupts()
    iso = clikit.isolation_for(isolate, specs, dev, case_timeout, isolate_transport, interrupts)
    isolate_transport = isolate_transport or "shm"
    log = clikit.LogProgress("parity", len(cases), enabled=not quiet and not out.is_terminal, unit="cases done")

    def started(c):
        bar.update(task, description=f"{c.kernel} {c.family} {c.dtype}")
        log.now = f"{c.kernel} {c.family} {c.dtype} {c.shape}"

    def finished(c):
        bar.advance(task)
        log.done += 1
    from mhctool.core.library_log import library_log
    code = 0
    from mhctool.spread.machine import pinned_threads, threads_for
    with pinned_threads(threads_for(dev, n_workers)), \
            library_log(out_path.with_name(out_path.stem + ".libraries.log"), {"stdout": out, "stderr": err},
                        enabled=not verbose) as libraries:
        try:
            with interrupts, log, Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                           TimeElapsedColumn(), console=err, transient=True, disable=not show) as bar:
                task = bar.add_task("parity", total=len(cases))
                try:
                    o = parity_mod.execute(pl, iso, interrupts, started, n_workers, backend, finished, ray_address)
                finally:
                    if iso is not None:
                        iso.close()
                    if pl.sharding is not None:
                        pl.sharding.close()
            done = o.cases_run
            table = parity_mod.table(pl, o, kernel=kernel, device=dev, isolate=iso is not None,
                                     case_timeout=case_timeout, workers=n_workers, backend=backend)
            path = report.write_atomic(table, out_path)
            vs = worst_first(verdicts(table))
            _check_call_shape(vs, outside_impls(table))
            p, f, s = _summary(vs)
            if not quiet:
                out.print(_verdict_table(vs, top, f"parity: worst of {len(vs)} (case x impl x direction)"))
            if plot is not None:
                from mhctool.views.plots import parity_figures
                for png in parity_figures(table, plot):
                    if not quiet:
                        out.print(f"plot: {png}")
            if show_profile:
                from mhctool.core.profile import lines
                for line in lines(o.timings, o.wall, n_workers):
                    out.print(line, markup=False)
            if interrupts.requested:
                out.print(f"[yellow]INTERRUPTED[/] after {done} of {len(cases)} cases: {p} passed, {f} failed, {s} skipped "
                          f"(report {path}, marked interrupted)")
                raise typer.Exit(130)
            unjudged = judged_nothing(table, parity_mod.asked_outside(pl))
            status = "[red]FAILED[/]" if f or unjudged else "[green]PASSED[/]"
            out.print(f"{status} {p} passed, {f} failed, {s} skipped  ({len(cases)} cases on {dev}; report {path})")
            for name in outside_impls(table):  # the implementations under test, apart from the baselines
                pp, ff, ss = counts(vs, name)
                out.print(f"  of them {_short_impl(name)}: {pp} passed, {ff} failed, {ss} skipped", markup=False)
            for name, why in unjudged.items():
                out.print(f"FAILED: {_short_impl(name)} was judged on no case: every row of it was skipped ({why}); "
                          "the native rows are no verdict on it", markup=False)
            findings = baseline_findings(table) if pl.checks else {}
            for (name, k, rule), n in sorted(findings.items()):
                out.print(f"note: {name} (not gated: baseline) fails {rule} on {k} in {n} row(s); see the report's messages",
                          markup=False)
            if "determinism" in pl.checks and dev == "cpu":
                from mhctool.runner.checks import CPU_NOTE
                out.print(f"note: determinism on cpu: {CPU_NOTE}; run the check on a GPU where it matters", markup=False)
            if not specs:  # a default run that judged no kernel of a built-in backend says so
                for name, why in skipped_everywhere(table).items():
                    out.print(f"note: {name} skipped for every case: {why}", markup=False)
            from mhctool.analyses.hints import hints as find_hints
            def identifying(kernel, name):  # a minute may pass here: say what runs
                err.print(f"parity: identifying {_short_impl(name)} on {kernel} for a hint (mhctool identify)", markup=False)
            hints = [] if interrupts.requested or not hint else [h for _, _, h in find_hints(pl, vs, dev, iso, isolate_transport,
                                                                                case_timeout, lambda: interrupts.requested,
                                                                                None if quiet else identifying)]
            for hint in hints:
                out.print(hint, markup=False)
            if hints:  # kept in the report too (report html shows them)
                report.write_atomic(report.with_run(table, hints=hints), out_path)
            raise typer.Exit(1 if f or unjudged else 0)
        except typer.Exit as e:  # the verdict's exit code, once the libraries' log is closed
            code = e.exit_code
    if libraries["path"]:
        report.write_atomic(report.with_run(report.read(out_path)[0], library_log=libraries["path"]), out_path)
        if not quiet:
            out.print(f"the libraries' own output: {libraries['path']}", markup=False)
    raise typer.Exit(code)
