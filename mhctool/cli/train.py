"""``mhctool train``: a small mHC model trained with an implementation, native and float64, and
the drift judged (:mod:`mhctool.train`)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from mhctool.cli.kit import Interrupts, err, fmt, knob_items, out
from mhctool.core.errors import UsageError


def _curves(o, every: int) -> Table:
    roles = [t.role for t in o.trajectories[:3]]
    t = Table(title="lm loss and num-zeros per step (" + ", ".join(roles) + ")")
    t.add_column("step")
    for r in roles:
        t.add_column(f"{r} loss")
    for r in roles:
        t.add_column(f"{r} zeros")
    steps = sorted({s.step for traj in o.trajectories[:3] for s in traj.steps})
    for k in steps:
        if (k - 1) % every and k != steps[-1]:
            continue
        row = [str(k)]
        for metric in ("lm loss", "num-zeros"):
            for traj in o.trajectories[:3]:
                v = traj.series(metric).get(k)
                row.append("-" if v is None else f"{v:.6g}" if metric == "lm loss" else fmt(v))
        t.add_row(*row)
    return t


def train(
    impl: Optional[list[str]] = typer.Option(None, "--impl", "-i", help="The implementation under test, as parity takes it (repeat or comma-separate): triton (the default: mhctool's Triton kernels, through the interpreter on a CPU), cutile, FILE.py:function, module:function, megatron:DIR, te:DIR, liger:MODULE or an adapter's. Each mHC family the model calls (mapping, sinkhorn, h_aggregate, h_post_bda) runs it where it has one, natively otherwise; a function is the family its parameters are named after (or --kernel)."),
    kernel: Optional[str] = typer.Option(None, "--kernel", "-k", help="The family a function given to --impl implements, where its parameter names do not say: mapping, sinkhorn, h_aggregate or h_post_bda."),
    steps: Optional[int] = typer.Option(None, "--steps", help="Optimizer steps (default 20 on a CPU, 100 on a GPU)."),
    layers: Optional[int] = typer.Option(None, "--layers", help="mHC layers (default 4)."),
    streams: Optional[int] = typer.Option(None, "--streams", help="Residual streams n (default 4)."),
    hidden: Optional[int] = typer.Option(None, "--hidden", help="Hidden size C (default 32 on a CPU, 256 on a GPU)."),
    heads: Optional[int] = typer.Option(None, "--heads", help="Attention heads (default 2 on a CPU, 4 on a GPU)."),
    seq: Optional[int] = typer.Option(None, "--seq", help="Sequence length (default 16 on a CPU, 256 on a GPU)."),
    batch: Optional[int] = typer.Option(None, "--batch", help="Sequences a step (default 2 on a CPU, 8 on a GPU)."),
    vocab: Optional[int] = typer.Option(None, "--vocab", help="Vocabulary of the synthetic source (default 64 on a CPU, 512 on a GPU)."),
    lr: Optional[float] = typer.Option(None, "--lr", help="AdamW's learning rate (default 0.01; 0.3 grows the Sinkhorn logits past 88 within about 12 steps)."),
    dtype: str = typer.Option("fp32", "--dtype", help="The activations' dtype: fp32, bf16 or fp16 (the mapping path stays fp32)."),
    device: Optional[str] = typer.Option(None, "--device", help="cpu or cuda (default: cuda when present)."),
    seed: int = typer.Option(0, "--seed", min=0, help="Seeds the initial model and the synthetic tokens (the ensemble's first seed)."),
    seeds: Optional[int] = typer.Option(None, "--seeds", min=1, show_default="4 on a CPU, 8 on a GPU", help="Train from this many seeds (--seed and those after it) and judge the drift over the ensemble: a metric drifts where the geometric mean over the seeds of its distance from the float64 run over what kappa x native's allows is above 1 and most seeds are past 1 (every seed for num-zeros; 1: one sample)."),
    workers: str = typer.Option("auto", "--workers", envvar="MHCTOOL_WORKERS", help="Processes the seeds are spread over: a number, or auto (one per GPU on a GPU, one per core on a CPU, at most one a seed). The rows are the same whatever the spread. With --engine: trajectories run side by side (auto: four a GPU, one on a CPU)."),
    knob: Optional[list[str]] = typer.Option(None, "--knob", help="FAMILY.KNOB=VALUE or KNOB=VALUE (every family that has it): what every trajectory asks for, e.g. sinkhorn.eps=1e-8."),
    convention: Optional[list[str]] = typer.Option(None, "--convention", help="FAMILY.KNOB=VALUE or KNOB=VALUE: a convention the implementation computes; the native and float64 trajectories compute it too."),
    input_dtypes: str = typer.Option("contract", "--input-dtypes", help="contract: every family's inputs at mhctool's contract dtypes (the mapping path fp32); library: a library's at the dtypes its adapter says it is used with (Megatron-LM's h_pre, h_res, h_post in the activations' dtype)."),
    kappa: float = typer.Option(2.0, "--kappa", min=1.0, help="The drift may be kappa x the native trajectory's (its median distance from the float64 run)."),
    compare: bool = typer.Option(True, "--compare/--no-compare", help="Also train natively and with the mHC pieces in float64, and judge the drift (--no-compare: the implementation's run alone)."),
    trace: bool = typer.Option(True, "--trace/--no-trace", help="Trace a drift to the convention that reproduces it (reruns the native implementation with each one identify fits)."),
    isolate: Optional[bool] = typer.Option(None, "--isolate/--no-isolate", help="Train the implementation in a child process, so a crash or a hang ends its run with the steps so far (default: on for an external --impl on a GPU)."),
    out_path: Path = typer.Option(Path("mhctool-train.parquet"), "--out", "-o", help="Parquet report to write."),
    goldens: Optional[Path] = typer.Option(None, "--goldens", help="Write the implementation's run as Megatron golden values (JSON) here."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Folder for PNG plots (the curves per trajectory, the parting step marked; H_res's health per layer)."),
    every: int = typer.Option(5, "--every", min=1, help="Rows of the curves table: every N-th step."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print only the verdict lines."),
    engine: Optional[str] = typer.Option(None, "--engine", help="Train another trainer's own model instead of mhctool's: megatron:DIR (a staged megatron-core: its GPT with hyper-connections, optimizer, schedule and num-zeros count, on a GPU; the recipe of Megatron-LM's mHC test, scaled by --layers, --hidden, --heads, --seq, --batch, --vocab, --steps, --lr), or FILE.py:function (an engine of your own). --impl megatron is Megatron's own fused kernels; another --impl is swapped in at its module's entry points."),
    ranks: Optional[int] = typer.Option(None, "--ranks", min=1, help="With --engine: the processes of one trajectory, a GPU each, tensor parallel over them with sequence parallelism, as the recipe runs (--ranks 2; --recipe sequence_parallel=false turns that off); the same as --recipe tp=N."),
    recipe: Optional[list[str]] = typer.Option(None, "--recipe", help="KEY=VALUE: an option of the engine's recipe (repeat), e.g. recompute=false, recompute_layers=1, sinkhorn_eps=1e-8, global_batch=16, hidden_dropout=0, tp=2 with sequence_parallel=true (a rank a GPU, as the recipe runs)."),
):
    """Train a small mHC language model with an implementation, natively and in float64; judge the
    drift from the float64 trajectory with kappa, trace it to a knob. Exit 0 when it stays with the
    reference, 1 when it drifts, goes non-finite or fails, 2 on bad input."""
    from mhctool.cli.kit import LogProgress, isolation_for, precheck
    from mhctool.spread import pool
    pool.warm(workers if seeds is None or seeds > 1 else 1)
    precheck(dtypes=[dtype], device_name=device)
    workers_asked = pool.parse_workers(workers)
    if input_dtypes not in ("contract", "library"):
        raise UsageError(f"unknown --input-dtypes {input_dtypes!r}; accepted: contract, library")
    from mhctool.core import environment, report
    if goldens is not None:
        report.check_writable(goldens, "--goldens", suffixes=None)
    report.check_writable(out_path)
    if plot is not None:
        report.check_folder(plot)
    from mhctool.cli.kit import device as parse_device
    dev = parse_device(device)
    from mhctool.analyses import train as T
    from mhctool.core.dtypes import parse_dtype
    seeds = seeds if seeds is not None else T.default_seeds(dev)
    from mhctool.cli.kit import split
    runner = None
    if ranks is not None and engine is None:
        raise UsageError("--ranks trains over several processes only with --engine (mhctool's own model runs in one)")
    if engine is not None:
        from mhctool.analyses.train import engine as E
        cfg, runner = E.configure(
            engine, knob_items(recipe, "--recipe", "recompute=false"), split(impl or ["megatron"]), dev,
            dict(steps=steps, layers=layers, streams=streams, hidden=hidden, heads=heads, seq=seq, micro_batch=batch,
                 vocab=vocab, lr=lr), seed, knob_items(knob, "--knob", "sinkhorn.eps=1e-8"),
            knob_items(convention, "--convention", "transpose_res=true"), ranks, workers_asked, seeds)
        assigned, specs = runner.specs, list(dict.fromkeys(runner.specs.values()))
        knobs, conventions = runner.knobs, runner.conventions
    else:
        cfg = T.config(dev, steps=steps, layers=layers, streams=streams, hidden=hidden, heads=heads, seq=seq,
                       batch=batch, vocab=vocab, lr=lr, dtype=parse_dtype(dtype).name, seed=seed)
        knobs = T.parse_knobs(knob_items(knob, "--knob", "sinkhorn.eps=1e-8"), "--knob")
        conventions = T.parse_knobs(knob_items(convention, "--convention", "transpose_res=true"), "--convention",
                                    conventions_only=True)
        specs = split(impl or ["triton"])
        assigned = T.assign(specs, kernel)
        from mhctool.registry.specs import resolve_impls
        for f, spec in assigned.items():  # an unknown implementation, a function of the wrong form: before training
            resolve_impls(f, [spec])
    interrupts = Interrupts()
    iso = isolation_for(isolate, specs, dev, None, None, interrupts) if runner is None else None
    n_workers = pool.worker_count(workers_asked, dev, seeds) if runner is None else 1
    worker = None
    from mhctool.spread.isolation import Worker
    if iso is not None and n_workers == 1:
        worker = Worker("shm")
    m = cfg.model
    if runner is not None and not quiet:
        r = runner.recipe
        out.print(f"train --engine {runner.spec.name} ({r.layers} layers x {r.streams} streams, hidden {r.hidden}, "
                  f"{r.heads} heads, seq {r.seq}, micro-batch {r.micro_batch} of {r.global_batch}, vocab {r.vocab}, "
                  f"{r.steps} steps at lr {r.lr:g} (the recipe's schedule), bf16 on {dev} "
                  f"({_seeds_phrase(cfg.seed, seeds, 1)})); changed from the recipe: "
                  + (", ".join(f"{k}={v}" for k, v in r.changed().items() if k != "seed") or "nothing"),
                  markup=False, emoji=False)
    elif not quiet:
        src = T.MarkovSource(m.vocab, cfg.branch, cfg.seed)
        out.print(f"train: {m.layers} layers x {m.streams} streams, hidden {m.hidden}, {m.heads} heads, seq {m.seq} x "
                  f"batch {cfg.batch}, vocab {m.vocab}, {cfg.steps} steps at lr {cfg.lr:g}, {cfg.dtype} on {dev} "
                  f"({_seeds_phrase(cfg.seed, seeds, n_workers)}); the source's floor {src.entropy():.3f} nats a token",
                  markup=False)
    show = not quiet and out.is_terminal
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )
    total = cfg.steps * (3 if compare else 1) * seeds
    from mhctool.core.verdict import VerdictRule
    from mhctool.spread.machine import pinned_threads, threads_for
    log = LogProgress("train", total, enabled=not quiet and not out.is_terminal, unit="steps done")
    try:
        with interrupts, log, pinned_threads(threads_for(dev, n_workers)), Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                  TimeElapsedColumn(), console=err, transient=True, disable=not show) as bar:
            task = bar.add_task("train", total=total)

            def progress(role, step):
                log.done += 1
                log.now = f"{role} step {step.step}"
                bar.update(task, advance=1, description=f"{role} step {step.step} loss {step.metrics['lm loss']:.4g}")
            o = T.session(cfg, assigned, knobs, conventions, VerdictRule(kappa=kappa), compare, trace, worker,
                          interrupts, progress, as_used=input_dtypes == "library", seeds=seeds, workers=n_workers,
                          isolation_factory=lambda: Worker("shm"), engine=runner)
            meta = environment.metadata()  # with the threads it trained with
    finally:
        if worker is not None:
            worker.stop()
    table = report.to_table(T.report_rows(o), report.new_run_id(), "train", meta,
                            T.settings(o, kappa=kappa, input_dtypes=input_dtypes, workers=n_workers,
                                       **(runner.settings() if runner else {})), schema=report.TRAIN_SCHEMA)
    path = report.write_atomic(table, out_path)
    if goldens is not None:
        from mhctool.analyses.goldens import dump
        dump(T.to_golden(o.impl), goldens)
    if not quiet:
        out.print("  " + " | ".join(f"{f}: {o.impl.pieces[f]}" + (f" ({o.impl.notes[f]})" if f in o.impl.notes else "")
                                    for f in o.impl.pieces), markup=False)
        out.print(_curves(o, every))
        for traj in o.trajectories[:3]:
            if traj.steps:
                first, last = traj.steps[0].metrics["lm loss"], traj.steps[-1].metrics["lm loss"]
                zs = ", ".join(f"{n} {c:.0f}" for n, c in T.zero_sources(traj))
                out.print(f"{traj.role}: lm loss {first:.4f} -> {last:.4f} over {len(traj.steps)} steps; "
                          f"zeros mostly in {zs or 'no gradient'}", markup=False)
    if plot is not None:
        from mhctool.views.plots import train_figures
        for png in train_figures(table, plot):
            if not quiet:
                out.print(f"plot: {png}", markup=False)
    _goldens_lines(o, T)
    for d in o.drifts:
        out.print(f"{'ok' if d.passed else 'DRIFT'} {d.metric}: {d.message}", markup=False)
    if o.zeros is not None and not quiet:
        out.print(f"zeros: {o.zeros.sentence}" + "".join(f"; {p}" for p in o.zeros.parameters), markup=False)
    if o.errors and not o.nonfinite:
        first = o.errors[0]
        where = f" (seed {first.seed}; {len(o.errors)} of {len(o.seeds)} seeds ended early)" if o.ensemble else ""
        out.print(f"the implementation's run ended at {first.error}{where}", markup=False)
    if o.nonfinite:
        out.print(f"the implementation {o.nonfinite}", markup=False)
    native, ref = o.role("native"), o.role("reference")
    if native is not None and (why := T.nonfinite_sentence(native, ref)):
        out.print(f"note: the native run {why}, where the float64 run stays finite (its drift counts only before)",
                  markup=False)
    if (traced := o.traced()):
        out.print(f"traced: {traced}", markup=False)
    written = f"report {path}" + (f", golden values {goldens}" if goldens else "")
    if o.interrupted:
        out.print(f"[yellow]INTERRUPTED[/] after {len(o.impl.steps)} steps of the implementation's run ({written})")
        raise typer.Exit(130)
    if not o.compared:
        ok = not o.errors and all(r.impl.nonfinite_step is None for r in o.runs)
        out.print(("[green]TRAINED[/]" if ok else "[red]FAILED[/]") + f" {len(o.impl.steps)} steps, not compared ({written})")
        raise typer.Exit(0 if ok else 1)
    verdict = "[green]PASSED[/] stays with the float64 reference" if o.passed else "[red]FAILED[/] drifts from the float64 reference"
    over = (f"over {len(o.seeds)} seeds" if o.ensemble else
            f"one seed: a single sample of a chaotic run, --seeds {T.default_seeds(o.cfg.device)} judges over an ensemble")
    out.print(f"{verdict} (kappa {kappa:g} x native's drift, {over}; {written})")
    raise typer.Exit(0 if o.passed else 1)


def _seeds_phrase(first: int, seeds: int, workers: int) -> str:
    if seeds == 1:
        return f"seed {first}"
    spread = f" over {workers} processes" if workers > 1 else ""
    return f"seeds {first}-{first + seeds - 1}{spread}"


def _goldens_lines(o, T) -> None:
    """Megatron's golden-value rules on the implementation's run against the reference's, and the
    anomalies goldens check finds in each run."""
    ref = o.role("reference")
    from mhctool.analyses.goldens import check, diff
    if ref is not None and ref.steps and o.impl.steps:
        vs = diff(T.to_golden(ref), T.to_golden(o.impl), ["lm loss", "num-zeros"])
        out.print("goldens diff against the reference (Megatron's rules): "
                  + "; ".join(f"{v.metric} {'passes' if v.passed else 'FAILS'} ({v.message})" for v in vs), markup=False)
    seen = None
    for traj in o.trajectories[:3][::-1]:  # the reference first: the others' anomalies it has too are no finding
        found = [a.message for a in (check(T.to_golden(traj)) if len(traj.steps) >= 4 else [])
                 if a.metric != "iteration-time"]
        if seen is None:
            seen = set(found)
            if found and len(o.trajectories) > 1:
                out.print("goldens check reference (the synthetic data's own): " + "; ".join(found), markup=False)
            continue
        new = [m for m in found if m not in seen]
        if new or (found and len(o.trajectories) == 1):
            out.print(f"goldens check {traj.role}: " + "; ".join(new or found), markup=False)
