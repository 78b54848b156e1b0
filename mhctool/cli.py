"""The mhctool command line: one function per command, parsing and printing only.

Exit codes: 0 all checks passed, 1 a numerics or verdict failure, 2 bad usage or input.
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from types import SimpleNamespace
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

from . import __version__, cli_identify, cli_train, clikit, names
from .cli_stability import stability_app
from .clikit import device as _device
from .clikit import err, lazy, out
from .clikit import fmt as _fmt
from .clikit import short_impl as _short_impl
from .clikit import guard as _guard
from .clikit import split as _split
from .errors import UsageError

# the engines, imported when a command runs (so --help and usage errors answer without torch)
environment, isolation, registry, report, runner, sharded = (
    lazy(m) for m in ("environment", "isolation", "registry", "report", "runner", "sharded"))
parity_mod = lazy("parity")


def parse_dtype(name: str):
    from .dtypes import parse_dtype as parse
    return parse(name)

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Numerics validation for fused mHC and grouped-MLP kernels.")
report_app = typer.Typer(no_args_is_help=True, help="Read Parquet reports: show one, compare two.")
app.add_typer(report_app, name="report")
app.add_typer(stability_app, name="stability")
goldens_app = typer.Typer(no_args_is_help=True, help="Megatron golden-value files and training logs: show, diff, check, extract.")
app.add_typer(goldens_app, name="goldens")
app.command()(_guard(cli_identify.identify))
app.command()(_guard(cli_train.train))



def main() -> None:
    try:
        app()
    except UsageError as e:
        err.print(f"error: {e}")
        sys.exit(2)
    except clikit.Interrupted:
        err.print("interrupted: stopped at once; no report written")
        sys.exit(130)


def _version(value: bool) -> None:
    if value:
        out.print(f"mhctool {__version__}", markup=False)
        raise typer.Exit(0)


@app.callback()
def _root(debug: bool = typer.Option(False, "--debug", help="Show tracebacks for errors."),
          version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print mhctool's version and exit.")):
    clikit.state["debug"] = debug


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


def _ordered(vs: list[dict]) -> list[dict]:
    rank = {False: 0, None: 2, True: 1}
    return sorted(vs, key=lambda v: (rank[v["passed"]], -(v["worst_margin"] if v["worst_margin"] == v["worst_margin"] else math.inf)))


def _check_call_shape(vs: list[dict], outside: list[str]) -> None:
    """An outside implementation whose every case failed because it cannot be called with the
    family's signature, or returns what the contract cannot take, is bad input: one sentence
    naming the signature (the report keeps its rows)."""
    for name in outside:
        mine = [v for v in vs if v["impl"] == name and v["direction"] == "fwd" and v["passed"] is not None]
        if mine and all(v["passed"] is False and registry.call_problem(v["message"]) for v in mine):
            k = mine[0]["kernel"]
            raise UsageError(f"--impl {_short_impl(name)} cannot be judged as {k}: {mine[0]['message']}; "
                             f"expected {registry.signature(registry.get_family(k))}")


def _summary(vs: list[dict]) -> tuple[int, int, int]:
    return report.tally(v["passed"] for v in vs)


@app.command()
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
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print only the summary line."),
    isolate: Optional[bool] = typer.Option(None, "--isolate/--no-isolate", help="Run each implementation under test in a child process, so exits, crashes, hangs and CUDA faults become failed rows. Default: on for an external --impl on a GPU or with --case-timeout, off otherwise."),
    case_timeout: Optional[float] = typer.Option(None, "--case-timeout", min=0.001, help="Seconds an isolated implementation may take for one case (default: 120 s plus 30 s per GiB the case needs, 300 s more for an external one, which compiles inside the call; 4x that on the CPU)."),
    isolate_transport: str = typer.Option("shm", "--isolate-transport", help="How tensors reach the child: shm (CUDA tensors as CUDA IPC handles, CPU ones in host shared memory), host (everything through host shared memory) or file (torch.save in /dev/shm)."),
    check: Optional[list[str]] = typer.Option(None, "--check", help="Also compare bits: determinism (the same inputs, run after run) and/or batch-invariance (each token's result at other batch sizes). Repeat or comma-separate; a difference is a failed row."),
    repeats_determinism: int = typer.Option(3, "--repeats-determinism", min=2, help="Runs in all for --check determinism."),
    convention: Optional[list[str]] = typer.Option(None, "--convention", help="KNOB=VALUE (repeat): the convention the external implementation computes (stabilize=softmax, transpose_res=true, eps_mode=clamp, eps=0, iters=10, rms_eps=inside, compute_h_eps=1e-6); the reference and the native baseline compute it too, and a function that takes no such parameter is called without it."),
    input_dtypes: Optional[list[str]] = typer.Option(None, "--input-dtypes", help="NAME=DTYPE (repeat or comma-separate): the dtype the external implementation takes an input in: activation (the case's dtype), fp32, bf16 or fp16, e.g. h_pre=activation for a function that multiplies in one dtype. The float64 reference and the native baseline see the same rounded values; its gradients are judged at the contract's threshold."),
    workers: Optional[str] = typer.Option(None, "--workers", help="N or auto: spread the cases over N worker processes (auto: one per visible GPU, or per core on a CPU); the report has the same rows in the same order as one process."),
    shard: Optional[str] = typer.Option(None, "--shard", help="I/N: run only the I-th of N deterministic slices of the cases (a CI matrix, a Slurm array); join the reports with mhctool report merge."),
    backend: str = typer.Option("local", "--backend", help="local (worker processes here) or ray: one Ray task per case (needs pip install ray)."),
    ray_address: Optional[str] = typer.Option(None, "--ray-address", help="With --backend ray: the cluster to join (ray.init's address; default: a local one)."),
    ranks: int = typer.Option(1, "--ranks", help="Split each case's tokens over R processes joined by torch.distributed (Gloo on the CPU, NCCL on GPUs, a GPU a rank), the parameter gradients all-reduced, as under data or sequence parallelism; the native baseline runs the same way."),
    grad_reduce: str = typer.Option("fp32", "--grad-reduce", help="With --ranks: the dtype the parameter gradients are all-reduced in: fp32, or bf16 (as --grad-reduce-in-bf16 trains)."),
    show_profile: bool = typer.Option(False, "--profile", help="Print where the time went: inputs, the native run, the float64 reference, each implementation (its first call in a process, which compiles, apart), judging, checks, and with --workers what was spent outside the cases (the report keeps it in any case)."),
):
    """Run implementations and the float64 reference side by side, forward and backward."""
    from . import pool, prewarm
    pool.warm(workers, backend, bool(isolate))  # the fork server imports torch while this process plans
    prewarm.start(device)  # Triton's hash of itself, on a thread
    clikit.precheck(kernel, _split([dtype]) if dtype else None, shape, device)
    report.check_writable(out_path)
    dev = _device(device)
    if kernel is None and scenario is not None:  # the scenario's kernels
        from . import scenario as scenario_mod
        kernel = ",".join(dict.fromkeys(spec.kernel for spec in scenario_mod.resolve(scenario).specs)) or "all"
    kernel = kernel or "all"
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
    n_workers, backend = clikit.spread_for(workers, backend, dev, pl)
    pl.sharding = sharded.parse(ranks, grad_reduce, sorted({c.kernel for c in pl.cases}), dev)
    if pl.sharding is not None and (n_workers > 1 or backend != "local" or pl.checks):
        raise UsageError("--ranks runs each case over its own processes: it takes neither --workers, "
                         "--backend ray nor --check")

    show = not quiet and out.is_terminal
    interrupts = clikit.Interrupts()
    iso = clikit.isolation_for(isolate, specs, dev, case_timeout, isolate_transport, interrupts)
    log = clikit.LogProgress("parity", len(cases), enabled=not quiet and not out.is_terminal, unit="cases done")

    def started(c):
        bar.update(task, description=f"{c.kernel} {c.family} {c.dtype}")
        log.now = f"{c.kernel} {c.family} {c.dtype} {c.shape}"

    def finished(c):
        bar.advance(task)
        log.done += 1
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
    vs = _ordered(report.verdicts(table))
    _check_call_shape(vs, report.outside_impls(table))
    p, f, s = _summary(vs)
    if not quiet:
        out.print(_verdict_table(vs, top, f"parity: worst of {len(vs)} (case x impl x direction)"))
    if plot is not None:
        from .plots import parity_figures
        for png in parity_figures(table, plot):
            if not quiet:
                out.print(f"plot: {png}")
    if show_profile:
        from .profile import lines
        for line in lines(o.timings, o.wall, n_workers):
            out.print(line, markup=False)
    if interrupts.requested:
        out.print(f"[yellow]INTERRUPTED[/] after {done} of {len(cases)} cases: {p} passed, {f} failed, {s} skipped "
                  f"(report {path}, marked interrupted)")
        raise typer.Exit(130)
    unjudged = report.judged_nothing(table, parity_mod.asked_outside(pl))
    status = "[red]FAILED[/]" if f or unjudged else "[green]PASSED[/]"
    out.print(f"{status} {p} passed, {f} failed, {s} skipped  ({len(cases)} cases on {dev}; report {path})")
    for name in report.outside_impls(table):  # the implementations under test, apart from the baselines
        pp, ff, ss = report.counts(vs, name)
        out.print(f"  of them {_short_impl(name)}: {pp} passed, {ff} failed, {ss} skipped", markup=False)
    for name, why in unjudged.items():
        out.print(f"FAILED: {_short_impl(name)} was judged on no case: every row of it was skipped ({why}); "
                  "the native rows are no verdict on it", markup=False)
    findings = report.baseline_findings(table) if pl.checks else {}
    for (name, k, rule), n in sorted(findings.items()):
        out.print(f"note: {name} (not gated: baseline) fails {rule} on {k} in {n} row(s); see the report's messages",
                  markup=False)
    if "determinism" in pl.checks and dev == "cpu":
        from .repro import CPU_NOTE
        out.print(f"note: determinism on cpu: {CPU_NOTE}; run the check on a GPU where it matters", markup=False)
    if not specs:  # a default run that judged no kernel of a built-in backend says so
        for name, why in report.skipped_everywhere(table).items():
            out.print(f"note: {name} skipped for every case: {why}", markup=False)
    from .hints import hints as find_hints
    hints = [] if interrupts.requested else [h for _, _, h in find_hints(pl, vs, dev, iso, isolate_transport,
                                                                        case_timeout, lambda: interrupts.requested)]
    for hint in hints:
        out.print(hint, markup=False)
    if hints:  # kept in the report too (report html shows them)
        report.write_atomic(report.with_run(table, hints=hints), out_path)
    raise typer.Exit(1 if f or unjudged else 0)


@app.command()
@_guard
def bench(
    shape: Optional[str] = typer.Option(None, "--shape", help="SxBxNxC for mHC kernels (default 8192x4x4x7168 on a GPU, 64x2x4x512 on the CPU), TxHxFxE for grouped-MLP ones (default 4096x2048x1024x8, 64x64x96x4 on the CPU)."),
    kernel: str = typer.Option("all", "--kernel", "-k", help="A kernel, a comma-separated list, or a group (all; mhc or moe: every kernel of one kind): " + ", ".join(names.KERNELS) + "."),
    impl: Optional[list[str]] = typer.Option(None, "--impl", "-i", help="Implementations (default: every available one: torch, compile, triton, cutile), or module:function."),
    dtype: str = typer.Option("bf16", "--dtype", help="Activation dtype (sinkhorn always runs on the fp32 mapping path)."),
    direction: str = typer.Option("fwd,bwd", "--direction", help="fwd, bwd or both (comma-separated)."),
    repeats: int = typer.Option(50, "--repeats", min=3, help="Timed repeats (median and p10/p90 reported)."),
    graph: bool = typer.Option(False, "--graph", help="Time CUDA-graph replays (launch and Python overhead removed)."),
    experts: Optional[str] = typer.Option(None, "--experts", help="Grouped-MLP sweep over expert counts, e.g. 8,32,128: each implementation timed with and without CUDA graphs."),
    tokens: int = typer.Option(4096, "--tokens", min=1, help="Tokens of the --experts sweep."),
    hidden: int = typer.Option(2048, "--hidden", min=1, help="Hidden size of the --experts sweep."),
    ffn: int = typer.Option(1024, "--ffn", min=1, help="FFN size per expert of the --experts sweep."),
    device: Optional[str] = typer.Option(None, "--device", help="cpu or cuda (default: cuda when present)."),
    out_path: Path = typer.Option(Path("mhctool-bench.parquet"), "--out", "-o", help="Parquet report to write."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="PNG to write (bars per kernel and direction, roofline line)."),
    quiet: bool = typer.Option(False, "--quiet", "-q"),
    isolate: Optional[bool] = typer.Option(None, "--isolate/--no-isolate", help="Time each implementation in a child process, so a crash or a hang is reported and the others are still timed. Default: on for an external --impl on a GPU or with --case-timeout."),
    case_timeout: Optional[float] = typer.Option(None, "--case-timeout", min=0.001, help="Seconds an isolated measurement may take (default: scaled with the shape)."),
    input_dtypes: str = typer.Option("library", "--input-dtypes", help="library: each library timed at the input dtypes its adapter says it is used with (Megatron-LM's h_res and h_post in the activations' dtype); contract: every implementation at mhctool's contract dtypes."),
):
    """Time kernels against the memory roofline measured in the same run."""
    clikit.precheck(kernel, [dtype], shape, device)
    from . import bench as bench_mod
    from .shapes import MOE_PAPER_SHAPE, PAPER_SHAPE, MoeShape, parse_shape_for

    report.check_writable(out_path)
    dev = _device(device)
    fmt = parse_dtype(dtype)
    if input_dtypes not in ("library", "contract"):
        raise UsageError(f"unknown --input-dtypes {input_dtypes!r}; accepted: library, contract")
    contract = input_dtypes == "contract"
    kernels = parity_mod.kernels_of(_split([kernel]))
    kinds = {registry.get_family(k).shape_kind for k in kernels}
    if experts is not None:
        if kinds != {"moe"}:
            raise UsageError("--experts sweeps the grouped-MLP kernels; pick them with --kernel (e.g. grouped_mlp)")
        try:
            counts = [int(v) for v in _split([experts])]
        except ValueError:
            raise UsageError(f"--experts {experts!r} is not a comma-separated list of expert counts") from None
        if not counts or min(counts) < 1:
            raise UsageError(f"--experts {experts!r}: every expert count must be at least 1")
        moe_shapes = [MoeShape(tokens, hidden, ffn, e) for e in counts]
        graphs = [False, True] if dev == "cuda" else [False]
    else:
        if shape and len(kinds) > 1:
            raise UsageError("--shape takes one form per kind of kernel (SxBxNxC for mHC, TxHxFxE for the grouped "
                             "MLP); pick the kernels with --kernel (mhc or moe: every kernel of one kind)")
        moe_shapes = [parse_shape_for("moe", shape or (MOE_PAPER_SHAPE if dev == "cuda" else "64x64x96x4"))] \
            if "moe" in kinds else []
        graphs = [graph]
    mhc_shape = parse_shape_for("mhc", shape or (PAPER_SHAPE if dev == "cuda" else "64x2x4x512")) if "mhc" in kinds else None
    dirs = _split([direction])
    bad = [d for d in dirs if d not in ("fwd", "bwd")]
    if bad or not dirs:
        raise UsageError(f"unknown --direction {direction!r}; accepted: fwd, bwd, fwd,bwd")
    specs = _split(impl)
    if any(registry.is_function_spec(s) for s in specs) and len(kernels) != 1:
        raise UsageError("an external --impl module:function needs one --kernel, not all")
    resolved = {k: registry.resolve_impls(k, specs) if specs else registry.impls_for(k) for k in kernels}
    targets = [SimpleNamespace(kernel=k, device=dev, dtype=bench_mod.bench_dtype(k, fmt.name)) for k in kernels]
    if specs:  # as in parity: skipped where it cannot run, an error only where it runs nothing
        runner.check_runnable(resolved, targets)
    plan = []
    for t in targets:
        shapes = moe_shapes if registry.get_family(t.kernel).shape_kind == "moe" else [mhc_shape]
        for i in resolved[t.kernel]:
            why = i.unsupported(t.device, t.dtype)
            for shp in shapes:
                for g in graphs:
                    plan.append((t.kernel, i, shp, g, why))
    # refuse up front what cannot fit, with the estimate
    worst, worst_shape = max((bench_mod.footprint(k, shp, fmt.name), shp) for k, _, shp, _, _ in plan)
    if dev == "cuda":
        free, _ = environment.cuda_mem_info()
        if worst > 0.9 * free:
            raise UsageError(f"--shape {worst_shape} needs about {worst / 2**30:.1f} GiB on the GPU for one kernel; "
                             f"{free / 2**30:.1f} GiB are free")
        l2 = environment.l2_bytes()
    else:
        if worst > 2 * 2**30:
            raise UsageError(f"--shape {worst_shape} needs about {worst / 2**30:.1f} GiB; CPU benchmarks take shapes "
                             "under 2 GiB (GPU figures need a GPU)")
        l2 = 0
        err.print("note: no GPU here: CPU timer on a small shape; GPU figures need a GPU")

    copy_bw = bench_mod.copy_bandwidth(dev, (1 << 30) if dev == "cuda" else (1 << 26))
    mm_bf16 = bench_mod.matmul_rate(dev, torch_dtype("bf16"))
    mm_tf32 = bench_mod.matmul_rate(dev, torch_dtype("fp32"))
    results = []
    show = not quiet and out.is_terminal
    interrupts = clikit.Interrupts()
    iso = clikit.isolation_for(isolate, specs, dev, case_timeout, "shm", interrupts)
    with interrupts, Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                              TimeElapsedColumn(), console=err, transient=True, disable=not show) as bar:
        task = bar.add_task("bench", total=len(plan) * len(dirs))
        try:
            for k, i, shp, g, why in plan:
                for d in dirs:
                    if interrupts.requested:
                        break
                    bar.update(task, description=f"{k} {shp} {i.name} {d}{' graph' if g else ''}")
                    if why:
                        results.append(("skip", k, i, d, why, shp, g))
                    else:
                        results.append(_bench_one(bench_mod, iso, k, i, shp, fmt.name, dev, repeats, d, g, l2,
                                                  contract))
                    bar.advance(task)
        finally:
            if iso is not None:
                iso.close()
    rows = bench_mod.rows(results, dev, copy_bw, mm_bf16, mm_tf32)
    shape_text = ", ".join(dict.fromkeys(str(p[2]) for p in plan))
    settings = {"command": "bench", "shape": shape_text, "dtype": fmt.name, "device": dev, "repeats": repeats,
                "graph": graphs, "copy_bandwidth_Bps": copy_bw, "matmul_bf16_flops": mm_bf16,
                "matmul_tf32_flops": mm_tf32, "isolate": iso is not None, "input_dtypes": input_dtypes,
                "interrupted": interrupts.requested}
    table = report.to_table(rows, report.new_run_id(), "bench", environment.metadata(), settings,
                            schema=report.BENCH_SCHEMA)
    path = report.write_atomic(table, out_path)
    if not quiet:
        out.print(_bench_table(rows, f"bench {shape_text} {fmt.name} on {dev}: copy {copy_bw / 1e9:.0f} GB/s, "
                                     f"bf16 matmul {mm_bf16 / 1e12:.0f} TFLOP/s, tf32 {mm_tf32 / 1e12:.0f} TFLOP/s"))
        for t in _bench_totals(bench_mod, rows):
            out.print(t)
        for k, impls in resolved.items():  # what an adapter adds around a library's call is timed with it
            for i in impls:
                if i.glue and any(r["impl"] == i.name for r in rows):
                    out.print(f"note: {_short_impl(i.name)} ({k}) is timed with its adapter's glue: {i.glue}",
                              markup=False)
    if plot is not None:
        from .plots import bench_figure
        out.print(f"plot: {bench_figure(table, plot, copy_bw)}")
    out.print(f"report {path}")
    if interrupts.requested:
        out.print("[yellow]INTERRUPTED[/]: the report holds what was timed before the stop")
        raise typer.Exit(130)


def _bench_one(bench_mod, iso, k, i, shp, dtype, dev, repeats, d, g, l2, contract=False) -> tuple:
    """One timed (kernel, implementation, direction): in-process, or in an isolation worker; a
    kernel that fails, crashes or hangs is reported and the others are still timed."""
    if iso is None or i.native:
        try:
            return ("ok", k, i, d, bench_mod.measure(k, i, shp, dtype, dev, repeats, d, g, l2, 0, contract), shp, g)
        except SystemExit as e:
            return ("skip", k, i, d, f"failed: {isolation.system_exit_message(e)}", shp, g)
        except Exception as e:  # a kernel that fails to run is reported, the rest still run
            return ("skip", k, i, d, f"failed: {runner.short_error(e)}", shp, g)
    value, failure = iso.call(i, "mhctool.bench:isolated_measure",
                              (k, i.spec or i.name, i.name, shp, dtype, dev, repeats, d, g, l2, 0, contract),
                              bench_mod.footprint(k, shp, dtype), dev)
    if failure is not None:
        return ("skip", k, i, d, f"failed: {failure.message}", shp, g)
    return ("ok", k, i, d, value, shp, g)


def torch_dtype(name: str):
    return parse_dtype(name).torch_dtype


def _bench_table(rows: list[dict], title: str) -> Table:
    t = Table(title=title)
    shapes = len({r["shape"] for r in rows}) > 1
    for c in ("kernel", *(("shape",) if shapes else ()), "dir", "impl", "inputs", "ms", "p10-p90", "GB/s", "% copy",
              "TFLOP/s", "bound", "host us", "vs eager", "vs compile", "peak MiB", "note"):
        t.add_column(c)
    by = {}
    for r in rows:
        by.setdefault((r["kernel"], r["shape"], r["direction"], r["impl"], r["graph"]), {})[r["metric"]] = r
    for (k, shp, d, i, graphed), m in by.items():
        g = lambda name: m.get(name, {}).get("value")  # noqa: E731
        note = next((r["message"] for r in m.values() if r.get("message")), "") or ""
        host = g("host_us")
        flag = " [yellow](host-bound)[/]" if note and "host-bound" in note else ""
        inputs = next((r.get("inputs") for r in m.values() if r.get("inputs")), None)
        t.add_row(k, *((shp,) if shapes else ()), d, _short_impl(i) + (" (graph)" if graphed else ""),
                  _short_inputs(inputs), _fmt(g("time_ms")),
                  f"{_fmt(g('time_ms_p10'))}-{_fmt(g('time_ms_p90'))}" if g("time_ms") is not None else "-",
                  _fmt(g("gbps")), _fmt(g("pct_copy_bw")), _fmt(g("tflops")),
                  next((r["bound"] for r in m.values() if r.get("bound")), "-"), _fmt(host) + flag,
                  _fmt(g("speedup_vs_torch")), _fmt(g("speedup_vs_compile")),
                  _fmt(g("peak_bytes") / 2**20 if g("peak_bytes") is not None and g("peak_bytes") == g("peak_bytes") else None),
                  note)
    return t


def _short_inputs(text: str | None) -> str:
    """``x=bf16,h_pre=fp32,y=bf16`` -> ``bf16; fp32 h_pre``: the commonest dtype alone, then the
    others with their inputs (the report's ``inputs`` column has them all)."""
    if not text:
        return "-"
    by: dict = {}
    for part in text.split(","):
        name, _, dt = part.partition("=")
        by.setdefault(dt, []).append(name)
    common = max(by, key=lambda dt: len(by[dt]))
    return "; ".join([common] + [f"{dt} {' '.join(names)}" for dt, names in by.items() if dt != common])


def _bench_totals(bench_mod, rows: list[dict]) -> list[Table]:
    """fwd + bwd per kernel and implementation, and the whole mHC path per implementation (where
    both directions were timed)."""
    tots = bench_mod.totals(rows)
    if not tots:
        return []
    shapes = len({t.shape for t in tots}) > 1
    label = lambda name, graph: _short_impl(name) + (" (graph)" if graph else "")  # noqa: E731
    a = Table(title="fwd + bwd")
    for c in ("kernel", *(("shape",) if shapes else ()), "impl", "fwd ms", "bwd ms", "fwd+bwd ms", "% copy"):
        a.add_column(c)
    for t in tots:
        a.add_row(t.kernel, *((t.shape,) if shapes else ()), label(t.impl, t.graph), _fmt(t.fwd_ms), _fmt(t.bwd_ms),
                  _fmt(t.ms), _fmt(t.pct_copy_bw))
    paths = bench_mod.whole_path(tots)
    if not paths:
        return [a]
    b = Table(title="the whole mHC path, fwd + bwd, ms (projection: proj_rms, or the mapping where there is no "
                    "proj_rms; a library's fastest variant per kernel)")
    for c in ("implementation", *(("shape",) if shapes else ()), *bench_mod.PATH, "total ms", "% copy"):
        b.add_column(c)
    for p in sorted(paths, key=lambda p: (p.shape, p.ms)):
        b.add_row(label(p.name, p.graph), *((p.shape,) if shapes else ()),
                  *(_fmt(p.parts[s].ms) + ("" if p.parts[s].impl == p.name else f" {_short_impl(p.parts[s].impl)}")
                    for s in bench_mod.PATH),
                  _fmt(p.ms), _fmt(p.pct_copy_bw))
    return [a, b]


_SPARK = "▁▂▃▄▅▆▇█"


def _sparkline(vals: list[float], width: int = 50) -> str:
    fin = [v for v in vals if math.isfinite(v)]
    if not fin:
        return ""
    step = max(1, len(vals) // width)
    vals = vals[::step]
    lo, hi = min(fin), max(fin)
    span = hi - lo or 1.0
    return "".join(" " if not math.isfinite(v) else _SPARK[min(7, int((v - lo) / span * 8))] for v in vals)


def _read_run(path: Path):
    from .gate import read_run
    return read_run(path)


@goldens_app.command("show")
@_guard
def goldens_show(path: Path = typer.Argument(..., help="Golden-value JSON or a Megatron training log.")):
    """Per metric: steps, range and a sparkline."""
    g = _read_run(path)
    t = Table(title=str(path))
    for c in ("metric", "steps", "first..last", "min", "max", "nan", "trend"):
        t.add_column(c)
    for m, s in g.items():
        vals = [s.values[k] for k in s.steps()]
        fin = [v for v in vals if math.isfinite(v)]
        t.add_row(m, f"{len(vals)} ({s.start_step}-{s.end_step}/{s.step_interval})",
                  f"{_fmt(vals[0])}..{_fmt(vals[-1])}", _fmt(min(fin)) if fin else "-", _fmt(max(fin)) if fin else "-",
                  str(len(vals) - len(fin)), _sparkline(vals))
    out.print(t)


def _rtol_overrides(items: Optional[list[str]]) -> dict[str, float]:
    outd = {}
    for item in _split(items):
        name, sep, val = item.rpartition("=")
        try:
            outd[name.strip()] = float(val)
            assert sep and name.strip()
        except (ValueError, AssertionError):
            raise UsageError(f"malformed --rtol {item!r}; expected METRIC=VALUE, e.g. 'num-zeros=0.2'") from None
    return outd


@goldens_app.command("diff")
@_guard
def goldens_diff(
    golden: Path = typer.Argument(..., help="The golden values (JSON)."),
    actual: Path = typer.Argument(..., help="The run to check (JSON, or a training log)."),
    metrics: Optional[str] = typer.Option(None, "--metrics", help="Comma-separated metrics to check (default: lm loss, num-zeros, or the config's METRICS)."),
    config: Optional[Path] = typer.Option(None, "--config", help="The recipe's model_config.yaml (its METRICS list)."),
    rtol: Optional[list[str]] = typer.Option(None, "--rtol", help="Per-metric tolerance METRIC=VALUE (repeat)."),
    deterministic: bool = typer.Option(False, "--deterministic", help="Add Megatron's exact check."),
    out_path: Optional[Path] = typer.Option(None, "--out", "-o", help="Parquet report to write."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Folder for per-metric PNGs."),
):
    """Megatron's CI checks of ACTUAL against GOLDEN, per metric and step."""
    from . import goldens as G
    if out_path:
        report.check_writable(out_path)
    g, a = G.load(golden), _read_run(actual)
    chosen = [m.strip() for m in metrics.split(",") if m.strip()] if metrics else (
        G.metrics_from_config(config) if config else None)
    verdicts_ = G.diff(g, a, chosen, _rtol_overrides(rtol), deterministic)
    t = Table(title=f"{golden.name} vs {actual.name}")
    for c in ("metric", "check", "verdict", "detail"):
        t.add_column(c, overflow="fold")
    for v in verdicts_:
        t.add_row(v.metric, v.check, "[green]pass[/]" if v.passed else "[red]FAIL[/]", v.message)
    out.print(t)
    others = sorted((set(g) | set(a)) - {v.metric for v in verdicts_})
    if others:
        out.print(f"not checked (Megatron checks only the listed metrics): {', '.join(others)}")
    if out_path:
        rows = []
        for v in verdicts_:
            rows.append({"command": "diff", "metric": v.metric, "check": v.check, "step": None, "passed": v.passed,
                         "message": v.message})
            rows += [{"command": "diff", "metric": v.metric, "check": v.check, **r, "passed": None,
                      "message": r.get("note")} for r in v.rows]
        tab = report.to_table(rows, report.new_run_id(), "goldens", environment.metadata(),
                              {"command": "goldens diff", "golden": str(golden), "actual": str(actual)},
                              schema=report.GOLDENS_SCHEMA)
        out.print(f"report {report.write_atomic(tab, out_path)}")
    if plot:
        from .plots import golden_figures
        for png in golden_figures(g, a, [v.metric for v in verdicts_], plot, (golden.name, actual.name)):
            out.print(f"plot: {png}")
    failed = [v for v in verdicts_ if not v.passed]
    out.print(("[red]FAILED[/] " if failed else "[green]PASSED[/] ") +
              f"{len(verdicts_) - len(failed)} passed, {len(failed)} failed")
    raise typer.Exit(1 if failed else 0)


@goldens_app.command("check")
@_guard
def goldens_check(
    path: Path = typer.Argument(..., help="Golden-value JSON or a training log."),
    factor: float = typer.Option(5.0, "--factor", min=1.0, help="A count that moves by this factor is an anomaly."),
    out_path: Optional[Path] = typer.Option(None, "--out", "-o", help="Parquet report to write."),
):
    """Anomalies inside one run: zero-count jumps or two levels, non-finite values, loss spikes."""
    from . import goldens as G
    if out_path:
        report.check_writable(out_path)
    found = G.check(_read_run(path), factor)
    for a in found:
        out.print(f"[red]{a.kind}[/] {a.message}")
    if out_path:
        rows = [{"command": "check", "metric": a.metric, "check": a.kind, "step": s, "passed": False,
                 "message": a.message} for a in found for s in a.steps]
        tab = report.to_table(rows, report.new_run_id(), "goldens", environment.metadata(),
                              {"command": "goldens check", "file": str(path), "factor": factor},
                              schema=report.GOLDENS_SCHEMA)
        out.print(f"report {report.write_atomic(tab, out_path)}")
    out.print(f"{len(found)} anomal{'y' if len(found) == 1 else 'ies'} in {path}" if found else f"no anomaly in {path}")
    raise typer.Exit(1 if found else 0)


@goldens_app.command("extract")
@_guard
def goldens_extract(
    log: Path = typer.Argument(..., help="A Megatron training log."),
    out_path: Path = typer.Option(..., "--out", "-o", help="Golden-value JSON to write."),
):
    """Read a training log's iteration lines into Megatron's golden-value format."""
    from . import goldens as G
    report.check_writable(out_path)
    g = G.extract_log(log)
    G.dump(g, out_path)
    out.print(f"{out_path}: " + ", ".join(f"{m} ({len(s.values)} steps)" for m, s in g.items()))


@app.command()
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
    workers: Optional[str] = typer.Option(None, "--workers", help="N or auto: spread each parity entry's cases over N worker processes (auto: one per visible GPU, or per core)."),
    shard: Optional[str] = typer.Option(None, "--shard", help="I/N: run only the I-th of N deterministic slices of the suite (a CI matrix); join the reports with mhctool report merge."),
    backend: str = typer.Option("local", "--backend", help="local (worker processes here) or ray: one Ray task per parity case (needs pip install ray)."),
    ray_address: Optional[str] = typer.Option(None, "--ray-address", help="With --backend ray: the cluster to join (default: a local one)."),
    show_profile: bool = typer.Option(False, "--profile", help="Print where the parity entries' time went (as parity --profile does, summed over the entries); the report keeps it in any case."),
):
    """Run a suite of checks as one CI verdict: exit 0 pass, 1 a failure, 2 bad input."""
    from . import pool, prewarm
    pool.warm(workers, backend, isolate)  # the fork server (workers, isolation) imports torch while this process plans
    prewarm.start(device)
    from . import gate as gate_mod
    for path_, what in ((junit, "--junit"), (summary, "--summary"), (out_path, "--out")):
        report.check_writable(path_, what)
    s = gate_mod.load_suite(suite)
    dev = _device(device)
    cut = parity_mod.parse_shard(shard)
    n_workers = pool.parse_workers(workers)  # per parity entry: pool.worker_count of its cases
    pool.check_backend(backend)
    interrupts = clikit.Interrupts()
    iso = clikit.isolation_for(isolate, [], dev, case_timeout, "shm", interrupts, default_on=isolate)
    log = clikit.LogProgress("gate", None, enabled=not quiet and not out.is_terminal, unit="checks started")

    def progress(what: str) -> None:
        log.done += 1
        log.now = what
    timings: dict = {}
    t0 = time.perf_counter()
    try:
        with interrupts, log:
            cases = gate_mod.run_suite(s, dev, progress=progress, isolation=iso, interrupted=interrupts, shard=cut,
                                       workers=n_workers, backend=backend, ray_address=ray_address, timings=timings)
    finally:
        if iso is not None:
            iso.close()
    wall = time.perf_counter() - t0
    rows = [{"suite": s.name, "entry": c.suite_item, "kind": c.kind, "name": c.name, "passed": c.passed,
             "message": c.message} for c in cases]
    settings = {"command": "gate", "suite": str(suite), "suite_name": s.name, "isolate": iso is not None,
                "interrupted": interrupts.requested, "workers": workers or 1, "backend": backend,
                "profile": {k: round(v, 4) for k, v in timings.items()}, "wall_s": round(wall, 3)}
    if show_profile:
        from .profile import lines
        for line in lines(timings, wall, pool.worker_count(n_workers, dev, 1 << 30) if n_workers != 1 else 1):
            out.print(line, markup=False)
    if cut is not None:
        settings |= {"shard": f"{cut[0]}/{cut[1]}", "units": [c.unit for c in cases]}
    if gate_mod.hints_of(cases):
        settings["hints"] = gate_mod.hints_of(cases)
    table = report.to_table(rows, report.new_run_id(), "gate", environment.metadata(), settings,
                            schema=report.GATE_SCHEMA)
    _gate_outputs(table, s.name, cases, out_path, junit, summary, quiet, interrupts.requested)


def _gate_outputs(table, suite_name: str, cases: list, out_path: Path, junit: Path, summary: Path, quiet: bool,
                  interrupted: bool) -> None:
    """A gate's report, JUnit XML and Markdown summary, written atomically, and its verdict line
    and exit code (a gate run, or slices of one merged by mhctool report merge)."""
    from . import gate as gate_mod
    report.write_atomic(table, out_path)
    xml = gate_mod.junit_xml(suite_name, cases)
    report.atomic(junit, lambda tmp: Path(tmp).write_bytes(xml))
    _write_summary(summary, gate_mod.markdown(suite_name, cases))
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


@report_app.command("show")
@_guard
def report_show(
    path: Path = typer.Argument(..., help="A Parquet report written by mhctool."),
    top: int = typer.Option(30, "--top", min=1, help="Rows of the verdict table."),
):
    """Summarise a report: its environment, settings and worst verdicts."""
    table, meta = report.read(path)
    env = meta["environment"]
    out.print(f"{path}: {meta['kind']} report, schema v{meta['schema_version']}, {table.num_rows} rows")
    out.print("environment: " + ", ".join(f"{k}={env.get(k)}" for k in
                                          ("mhctool", "torch", "triton", "cuda_tile", "gpu", "git_commit")))
    out.print("run: " + ", ".join(f"{k}={v}" for k, v in meta["run"].items()))
    if meta["run"].get("interrupted"):
        out.print(f"[yellow]interrupted[/]: {meta['run'].get('cases_run')} of {meta['run'].get('cases_planned')} "
                  "cases were run before the run was stopped")
    if meta["kind"] == "parity":
        vs = _ordered(report.verdicts(table))
        out.print(_verdict_table(vs, top, "verdicts (worst first)"))
        p, f, s = _summary(vs)
        out.print(f"{p} passed, {f} failed, {s} skipped")
    elif meta["kind"] == "bench":  # the tables bench printed, from the rows
        from . import bench as bench_mod
        rows = table.to_pylist()
        run = meta["run"]
        out.print(_bench_table(rows, f"bench {run.get('shape')} {run.get('dtype')} on {run.get('device')}"))
        for t in _bench_totals(bench_mod, rows):
            out.print(t)
    else:
        _show_rows(meta["kind"], table.to_pylist(), top)


def _show_rows(kind: str, rows: list[dict], top: int) -> None:
    """``report show`` of the kinds whose rows are their verdicts: the failed ones first."""
    if kind == "gate":
        failed = [r for r in rows if r["passed"] is False]
        t = Table(title=f"gate: {len(failed)} of {len(rows)} checks failed (failures first)")
        for col in ("entry", "kind", "name", "verdict", "message"):
            t.add_column(col, overflow="fold")
        for r in sorted(rows, key=lambda r: {False: 0, None: 1, True: 2}[r["passed"]])[:top]:
            t.add_row(r["entry"], r["kind"], _short(r["name"]), {True: "pass", False: "[red]FAIL[/]", None: "skip"}[r["passed"]],
                      r["message"] or "")
        out.print(t)
        p = sum(r["passed"] is True for r in rows)
        out.print(f"{p} passed, {len(failed)} failed, {len(rows) - p - len(failed)} skipped")
    elif kind == "identify":
        for r in rows:
            if r["best"] or r["stage"] == "error":
                out.print(f"{r['kernel']} {_short(r['impl'])}: best {r['candidate']} max_rel {_fmt(r['max_rel'])} "
                          f"{'passes' if r['passed'] else 'fails'}; {r['classification'] or ''} {r['message'] or ''}",
                          markup=False)
        judged = [r for r in rows if r["stage"] == "judged"]
        out.print(f"{len(rows)} candidates tried, {len(judged)} judged, {sum(bool(r['passed']) for r in judged)} passed")
    elif kind == "train":
        for r in rows:
            if r["step"] is None or r["metric"].startswith(("drift:", "traced:")) or r["metric"] in ("nonfinite", "error"):
                if r["metric"].startswith(("drift:", "traced:")) or r["metric"] in ("nonfinite", "error"):
                    verdict = {True: "ok", False: "FAIL", None: "-"}[r["passed"]]
                    out.print(f"{verdict} {r['run']} {r['metric']}: {r['message']}", markup=False)
        runs = {}
        for r in rows:
            if r["metric"] == "lm loss":
                runs.setdefault(r["run"], []).append((r["step"], r["value"]))
        for run, pts in runs.items():
            pts.sort()
            out.print(f"{run}: lm loss {pts[0][1]:.4f} -> {pts[-1][1]:.4f} over {len(pts)} steps", markup=False)
    elif kind == "stability":
        bad = [r for r in rows if r["metric"] == "nonfinite_rate" and r["value"]]
        out.print(f"{len(rows)} rows; {len(bad)} with non-finite outputs" + (
            ": first " + "; ".join(f"{r['impl']} {r['family']} {r['dtype']} scale {r['scale']:g} {r['stabilize']}"
                                   for r in bad[:top]) if bad else ""), markup=False)
    else:
        out.print(f"{len(rows)} rows (no summary for {kind} reports: read them with pyarrow, see the reports page)")


@report_app.command("html")
@_guard
def report_html(
    path: Path = typer.Argument(..., help="A report written by mhctool (Parquet, or JSON from -o x.json)."),
    out_path: Optional[Path] = typer.Option(None, "--out", "-o", help="The page to write (default: the report's name with .html)."),
):
    """One self-contained HTML page from a report: the verdict, the rows that decided it (failures
    first), the hints, the figures inline; nothing beside it to copy, no network."""
    from . import html as html_mod
    target = out_path or path.with_suffix(".html")
    report.check_writable(target)
    page = html_mod.render(path)
    report.atomic(target, lambda tmp: Path(tmp).write_text(page))
    out.print(f"page {target}", markup=False)


@report_app.command("merge")
@_guard
def report_merge(
    paths: list[Path] = typer.Argument(..., help="The reports of every slice of one run (parity or gate --shard I/N)."),
    out_path: Path = typer.Option(..., "--out", "-o", help="The merged Parquet report to write."),
    junit: Optional[Path] = typer.Option(None, "--junit", help="Gate slices: the JUnit XML of the merged run."),
    summary: Optional[Path] = typer.Option(None, "--summary", help="Gate slices: the Markdown summary of the merged run."),
    quiet: bool = typer.Option(False, "--quiet", "-q"),
):
    """Join the slices of a --shard run into the report one run would have written (exit 1 if a
    verdict in it failed)."""
    report.check_writable(out_path)
    table = report.merge(paths)
    _, meta = report.read(paths[0])
    if meta["kind"] != "gate" and (junit or summary):
        raise UsageError("--junit and --summary are for gate slices; these are parity reports")
    if meta["kind"] == "gate":
        from . import gate as gate_mod
        cases = gate_mod.cases_from_rows(table.to_pylist())
        name = meta["run"].get("suite_name") or (cases[0].suite_item if cases else "gate")
        interrupted = json.loads(table.schema.metadata[b"mhctool.run"]).get("interrupted", False)
        _gate_outputs(table, name, cases, out_path, junit or out_path.with_suffix(".xml"),
                      summary or out_path.with_suffix(".md"), quiet, interrupted)
    path = report.write_atomic(table, out_path)
    vs = report.verdicts(table)
    p, f, s = _summary(vs)
    status = "[red]FAILED[/]" if f else "[green]PASSED[/]"
    out.print(f"{status} {p} passed, {f} failed, {s} skipped  ({len(paths)} slices merged; report {path})")
    raise typer.Exit(1 if f else 0)


@report_app.command("compare")
@_guard
def report_compare(
    before: Path = typer.Argument(..., help="The earlier report."),
    after: Path = typer.Argument(..., help="The later report."),
    tolerance: float = typer.Option(0.1, "--tolerance", min=0.0, help="Relative growth below which a value is not 'worse'."),
    top: int = typer.Option(30, "--top", min=1),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Also write the comparison as JSON here (what got worse, what either report has alone)."),
    junit: Optional[Path] = typer.Option(None, "--junit", help="Also write JUnit XML here: a failed test per verdict that flipped to fail, a passed one per row that grew, a skipped one per row only one report has."),
    summary: Optional[Path] = typer.Option(None, "--summary", help="Also write a Markdown summary here (and append it to $GITHUB_STEP_SUMMARY when set)."),
):
    """What got worse from BEFORE to AFTER, and by how much, for reports of one kind (parity, gate,
    identify, stability, train, bench); rows either has alone are counted and listed. Exit 1 if a
    verdict flipped to fail, 2 for reports that cannot be compared."""
    for path_, what in ((json_path, "--json"), (junit, "--junit"), (summary, "--summary")):
        if path_ is not None:
            report.check_writable(path_, what)
    a, ma = report.read(before)
    b, mb = report.read(after)
    kind = ma["kind"]
    if kind != mb["kind"]:
        raise UsageError(f"{before} is a {kind} report and {after} a {mb['kind']} report; report compare "
                         "compares two reports of one kind")
    if kind not in report.COMPARE_KEYS:
        raise UsageError(f"report compare does not compare {kind} reports; it compares "
                         + ", ".join(report.COMPARE_KEYS))
    c = report.compare(a, b, tolerance, kind)
    flipped = [w for w in c.worse if w["passed_before"] is True and w["passed_after"] is False]
    if json_path is not None:
        payload = {"kind": kind, "before": str(before), "after": str(after), "tolerance": tolerance,
                   "matched": c.matched, "worse": c.worse, "flipped": len(flipped),
                   "only_before": [list(k) for k in c.only_before], "only_after": [list(k) for k in c.only_after]}
        report.atomic(json_path, lambda tmp: Path(tmp).write_text(json.dumps(payload, indent=2, default=str)))
    keys = report.COMPARE_KEYS[kind]
    if junit is not None or summary is not None:
        _compare_outputs(c, kind, keys, before, after, tolerance, junit, summary)
    if c.worse:
        t = Table(title=f"{kind}: {len(c.worse)} rows worse, {len(flipped)} now failing")
        for col in (*keys, "before", "after", "x", "verdict"):
            t.add_column(col, overflow="fold")
        for w in c.worse[:top]:
            verdict = "[red]pass->FAIL[/]" if w in flipped else str(w["passed_after"])
            t.add_row(*(_fmt(w["key"][k]) if not isinstance(w["key"][k], str) else _short(w["key"][k]) for k in keys),
                      _fmt(w["before"]), _fmt(w["after"]), _fmt(w["ratio"]), verdict)
        out.print(t)
    else:
        out.print(f"nothing got worse (tolerance {tolerance:g}) across the {c.matched} rows both {kind} reports have")
    for side, rows in (("before", c.only_before), ("after", c.only_after)):
        if rows:
            out.print(f"{len(rows)} rows only in the {'earlier' if side == 'before' else 'later'} report, not compared; "
                      "first: " + "; ".join("/".join(str(v) for v in k if v is not None) for k in rows[:3]),
                      markup=False)
    raise typer.Exit(1 if flipped else 0)


def _compare_outputs(c, kind: str, keys: tuple, before: Path, after: Path, tolerance: float,
                     junit: Optional[Path], summary: Optional[Path]) -> None:
    """report compare's JUnit XML and Markdown summary, written atomically."""
    from . import gate as gate_mod

    def name(key) -> str:
        return "/".join(str(_short(v)) for v in (key.values() if isinstance(key, dict) else key) if v is not None)
    flipped = [w for w in c.worse if w["passed_before"] is True and w["passed_after"] is False]
    item = f"compare {kind}"
    cases = [gate_mod.Case(item, kind, name(w["key"]), False if w in flipped else True,
                           f"{_fmt(w['before'])} -> {_fmt(w['after'])} (x{_fmt(w['ratio'])})"
                           + (f"; now failing: {w['message']}" if w in flipped and w["message"] else
                              "; now failing" if w in flipped else ""))
             for w in c.worse]
    cases.append(gate_mod.Case(item, kind, "no worse", True,
                               f"{c.matched - len(c.worse)} of {c.matched} matched rows within tolerance {tolerance:g}"))
    cases += [gate_mod.Case(item, kind, name(k), None, f"only in {side}")
              for side, ks in ((before.name, c.only_before), (after.name, c.only_after)) for k in ks]
    if junit is not None:
        xml = gate_mod.junit_xml(f"mhctool report compare {before.name} {after.name}", cases)
        report.atomic(junit, lambda tmp: Path(tmp).write_bytes(xml))
    if summary is not None:
        head = "FAILED" if flipped else "passed"
        lines = [f"## mhctool report compare ({kind}): {head}", "",
                 f"`{before.name}` -> `{after.name}`: {c.matched} rows matched, {len(c.worse)} worse "
                 f"(tolerance {tolerance:g}), {len(flipped)} flipped to fail; {len(c.only_before)} only in the "
                 f"earlier report, {len(c.only_after)} only in the later one", ""]
        if c.worse:
            lines += ["| " + " | ".join((*keys, "before", "after", "x", "verdict")) + " |",
                      "|" + "---|" * (len(keys) + 4)]
            for w in c.worse[:gate_mod.MARKDOWN_CAP]:
                verdict = "❌ pass → fail" if w in flipped else ("fail" if w["passed_after"] is False else "ok")
                lines.append("| " + " | ".join(str(_short(w["key"][k])) if w["key"][k] is not None else ""
                                               for k in keys)
                             + f" | {_fmt(w['before'])} | {_fmt(w['after'])} | {_fmt(w['ratio'])} | {verdict} |")
            if len(c.worse) > gate_mod.MARKDOWN_CAP:
                lines.append(f"\n... and {len(c.worse) - gate_mod.MARKDOWN_CAP} more (the JUnit XML and --json "
                             "have every one)")
        _write_summary(summary, "\n".join(lines) + "\n")


def _write_summary(path: Path, md: str) -> None:
    """A Markdown summary, written atomically and appended to ``$GITHUB_STEP_SUMMARY`` when set."""
    import os
    report.atomic(path, lambda tmp: Path(tmp).write_text(md))
    if os.environ.get("GITHUB_STEP_SUMMARY"):
        with open(os.environ["GITHUB_STEP_SUMMARY"], "a") as f:
            f.write(md)


def _short(text: str) -> str:
    """Paths in a cell reduced to their file name (the report keeps them whole)."""
    return report.stable(text)


@app.command()
@_guard
def doctor():
    """Which backends work here, and why not."""
    t = Table(title="backends")
    for c in ("backend", "usable", "mode", "version", "why not"):
        t.add_column(c)
    for b in environment.backends():
        t.add_row(b.name, "[green]yes[/]" if b.usable else "[red]no[/]", b.mode, b.version or "-", b.reason or "")
    out.print(t)
    gpu = environment.gpu_info()
    out.print(f"GPU: {gpu.get('gpu') or 'none visible'}" + (f" (sm_{gpu['sm']}, driver {gpu.get('driver')}, CUDA {gpu.get('cuda')})" if gpu.get("gpu") else ""))
    out.print(f"tileiras: {environment.tileiras_path() or 'not on PATH'}")
    if environment.triton_interpreted():
        from . import interpreter
        errors = interpreter.prepare()
        out.print("Triton interpreter: mhctool's kernels, library adapters and plain FILE:function or "
                  "module:function implementations run through it (TRITON_INTERPRET=1 is set for them)")
        for dt, err in errors.items():
            state = ("right" if err <= interpreter.TOLERANCE else f"wrong (relative error {err:.2g}): {dt} cases skipped")
            mend = " after mhctool's mend (bf16 operands widened to fp32)" if dt == "bf16" and interpreter.mended() else ""
            out.print(f"  tl.dot on {dt}: {state}{mend}")
        before, after, mended_casts = interpreter.casts()
        state = "right" if not after else f"wrong ({after} of {interpreter.CAST_PROBES} probe casts): bf16 cases skipped"
        mend = (f" after mhctool's mend (it truncated or misrounded {before} of {interpreter.CAST_PROBES}; now rounded "
                "to nearest even)") if mended_casts else ""
        out.print(f"  fp32 <-> bf16 casts: {state}{mend}")
    for k in registry.KERNELS:
        names = ", ".join(f"{i.name}{'' if not i.unavailable() else ' (unavailable)'}" for i in registry.impls_for(k))
        out.print(f"{k}: {names}")


if __name__ == "__main__":  # pragma: no cover
    main()
