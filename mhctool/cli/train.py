"""``mhctool train``: its options, the run (:mod:`mhctool.analyses.runs.train`) and what it prints.

The run is imported inside the command, so that ``--help`` and a usage error answer without
importing torch."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from mhctool.cli.options import lower
from mhctool.cli.console import out
from mhctool.cli.options import knob_items, precheck
from mhctool.cli.progress import watching
from mhctool.core.library_log import said
from mhctool.core.text import fmt, split
from mhctool.spread import setup

Impl = Annotated[Optional[list[str]], typer.Option("--impl", "-i", help="The implementation under test, as parity takes it (repeat or comma-separate): triton (the default: mhctool's Triton kernels, through the interpreter on a CPU), cutile, FILE.py:function, module:function, megatron:DIR, te:DIR, liger:MODULE or an adapter's. Each mHC family the model calls (mapping, sinkhorn, h_aggregate, h_post_bda) runs it where it has one, natively otherwise; a function is the family its parameters are named after (or --kernel). X[module] (alone) computes the whole module in two calls a direction, X's: the pre-path (mix_aggregate) and the post-path (h_post_bda, its dropout drawn in the kernel).")]
Kernel = Annotated[Optional[str], typer.Option("--kernel", "-k", help="The family a function given to --impl implements, where its parameter names do not say: mapping, sinkhorn, h_aggregate or h_post_bda.")]
Steps = Annotated[Optional[int], typer.Option("--steps", help="Optimizer steps (default 20 on a CPU, 100 on a GPU).")]
Layers = Annotated[Optional[int], typer.Option("--layers", help="mHC layers (default 4).")]
Streams = Annotated[Optional[int], typer.Option("--streams", help="Residual streams n (default 4).")]
Hidden = Annotated[Optional[int], typer.Option("--hidden", help="Hidden size C (default 32 on a CPU, 256 on a GPU).")]
Heads = Annotated[Optional[int], typer.Option("--heads", help="Attention heads (default 2 on a CPU, 4 on a GPU).")]
Seq = Annotated[Optional[int], typer.Option("--seq", help="Sequence length (default 16 on a CPU, 256 on a GPU).")]
Batch = Annotated[Optional[int], typer.Option("--batch", help="Sequences a step (default 2 on a CPU, 8 on a GPU).")]
Vocab = Annotated[Optional[int], typer.Option("--vocab", help="Vocabulary of the synthetic source (default 64 on a CPU, 512 on a GPU).")]
Lr = Annotated[Optional[float], typer.Option("--lr", help="AdamW's learning rate (default 0.01; 0.3 grows the Sinkhorn logits past 88 within about 12 steps).")]
Dtype = Annotated[str, typer.Option("--dtype", help="The activations' dtype: fp32, bf16 or fp16 (the mapping path stays fp32).")]
Device = Annotated[Optional[str], typer.Option("--device", callback=lower, help="cpu or cuda (default: cuda when present).")]
Seed = Annotated[int, typer.Option("--seed", min=0, help="Seeds the initial model and the synthetic tokens (the ensemble's first seed).")]
Seeds = Annotated[Optional[int], typer.Option("--seeds", min=1, show_default="4 on a CPU, 8 on a GPU", help="Train from this many seeds (--seed and those after it) and judge the drift over the ensemble: a metric drifts where the geometric mean over the seeds of its distance from the float64 run over what kappa x native's allows is above 1 and most seeds are past 1 (every seed for num-zeros; 1: one sample).")]
Workers = Annotated[str, typer.Option("--workers", envvar="MHCTOOL_WORKERS", help="Processes the seeds are spread over: a number, or auto (one per GPU on a GPU, one per core on a CPU, at most one a seed). The rows are the same whatever the spread. With --engine: trajectories run side by side (auto: four a GPU, one on a CPU).")]
Knob = Annotated[Optional[list[str]], typer.Option("--knob", help="FAMILY.KNOB=VALUE or KNOB=VALUE (every family that has it): what every trajectory asks for, e.g. sinkhorn.eps=1e-8.")]
Convention = Annotated[Optional[list[str]], typer.Option("--convention", help="FAMILY.KNOB=VALUE or KNOB=VALUE: a convention the implementation computes; the native and float64 trajectories compute it too.")]
InputDtypes = Annotated[str, typer.Option("--input-dtypes", help="contract: every family's inputs at mhctool's contract dtypes (the mapping path fp32); library: a library's at the dtypes its adapter says it is used with (Megatron-LM's h_pre, h_res, h_post in the activations' dtype).")]
Kappa = Annotated[float, typer.Option("--kappa", min=1.0, help="The drift may be kappa x the native trajectory's (its median distance from the float64 run).")]
Compare = Annotated[bool, typer.Option("--compare/--no-compare", help="Also train natively and with the mHC pieces in float64, and judge the drift (--no-compare: the implementation's run alone).")]
Trace = Annotated[bool, typer.Option("--trace/--no-trace", help="Trace a drift to the convention that reproduces it (reruns the native implementation with each one identify fits).")]
TraceBudget = Annotated[Optional[float], typer.Option("--trace-budget", min=0.0, help="Seconds the tracing of a drift may take; no rerun starts after them, and the verdict says the drift was not traced (default: as long as the trajectories took, so a run that traces takes at most about twice its runs; 0: no limit).")]
Isolate = Annotated[Optional[bool], typer.Option("--isolate/--no-isolate", help="Train the implementation in a child process, so a crash or a hang ends its run with the steps so far (default: on for an --impl mhctool did not ship, or with --step-timeout).")]
StepTimeout = Annotated[Optional[float], typer.Option("--step-timeout", min=0.001, help="Seconds one step of an isolated implementation may take before it is called hung and its run ends with the steps so far (default: 600 s for the first step, which compiles; a later one 10x the slowest before it, at least 60 s).")]
Out = Annotated[Path, typer.Option("--out", "-o", help="Parquet report to write.")]
Goldens = Annotated[Optional[Path], typer.Option("--goldens", help="Write the implementation's run as Megatron golden values (JSON) here.")]
Plot = Annotated[Optional[Path], typer.Option("--plot", help="Folder for PNG plots (the curves per trajectory, the parting step marked; H_res's health per layer).")]
Every = Annotated[int, typer.Option("--every", min=1, help="Rows of the curves table: every N-th step.")]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="Print only the verdict lines.")]
Engine = Annotated[Optional[str], typer.Option("--engine", help="Train another trainer's own model instead of mhctool's: megatron:DIR (a staged megatron-core: its GPT with hyper-connections, optimizer, schedule and num-zeros count, on a GPU; the recipe of Megatron-LM's mHC test, scaled by --layers, --hidden, --heads, --seq, --batch, --vocab, --steps, --lr), or FILE.py:function (an engine of your own). --impl megatron is Megatron's own fused kernels; another --impl is swapped in at its module's entry points.")]
Ranks = Annotated[Optional[int], typer.Option("--ranks", min=1, help="With --engine: the processes of one trajectory, a GPU each, tensor parallel over them with sequence parallelism, as the recipe runs (--ranks 2; --recipe sequence_parallel=false turns that off); the same as --recipe tp=N.")]
Recipe = Annotated[Optional[list[str]], typer.Option("--recipe", help="KEY=VALUE: an option of the engine's recipe (repeat), e.g. recompute=false, recompute_layers=1, sinkhorn_eps=1e-8, global_batch=16, hidden_dropout=0, tp=2 with sequence_parallel=true (a rank a GPU, as the recipe runs).")]


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
    impl: Impl = None,
    kernel: Kernel = None,
    steps: Steps = None,
    layers: Layers = None,
    streams: Streams = None,
    hidden: Hidden = None,
    heads: Heads = None,
    seq: Seq = None,
    batch: Batch = None,
    vocab: Vocab = None,
    lr: Lr = None,
    dtype: Dtype = "fp32",
    device: Device = None,
    seed: Seed = 0,
    seeds: Seeds = None,
    workers: Workers = "auto",
    knob: Knob = None,
    convention: Convention = None,
    input_dtypes: InputDtypes = "contract",
    kappa: Kappa = 2.0,
    compare: Compare = True,
    trace: Trace = True,
    trace_budget: TraceBudget = None,
    isolate: Isolate = None,
    step_timeout: StepTimeout = None,
    out_path: Out = Path("mhctool-train.parquet"),
    goldens: Goldens = None,
    plot: Plot = None,
    every: Every = 5,
    quiet: Quiet = False,
    engine: Engine = None,
    ranks: Ranks = None,
    recipe: Recipe = None,
):
    """Train a small mHC language model with an implementation, natively and in float64; judge the
    drift from the float64 trajectory with kappa, trace it to a knob. Exit 0 when it stays with the
    reference, 1 when it drifts, goes non-finite or fails, 2 on bad input."""
    setup.warm(workers if seeds is None or seeds > 1 else 1)
    precheck(kernel, dtypes=[dtype], device_name=device, impls=impl)
    from mhctool.analyses.runs import train as run
    sizes = dict(steps=steps, layers=layers, streams=streams, hidden=hidden, heads=heads, seq=seq, batch=batch,
                 vocab=vocab, lr=lr)
    req = run.Request(split(impl), kernel, sizes, dtype, device, seed, seeds, workers,
                      knob_items(knob, "--knob", "sinkhorn.eps=1e-8"),
                      knob_items(convention, "--convention", "transpose_res=true"), input_dtypes, kappa, compare, trace,
                      isolate, out_path, goldens, plot, engine, ranks, knob_items(recipe, "--recipe", "recompute=false"),
                      step_timeout, trace_budget)
    with watching("train", None, quiet, unit="steps done") as watch:
        plan = run.prepare(req, watch)
        o = run.run(plan, watch, None if quiet else lambda: out.print(plan.header(), markup=False, emoji=False))
    show(o, every, quiet, plot)
    raise typer.Exit(o.exit_code)


def show(o, every: int, quiet: bool, plot: Optional[Path] = None) -> None:
    """A training run's outcome: the pieces, the curves, the figures (drawn from the report into
    ``plot``), the golden-value findings, the verdict."""
    from mhctool.analyses import train as T
    from mhctool.analyses.runs.train import golden_lines
    s = o.session
    pngs = []
    if plot is not None:
        from mhctool.views.plots import train_figures
        pngs = train_figures(o.table, plot)
    if not quiet:
        out.print("  " + " | ".join(f"{f}: {s.impl.pieces[f]}" + (f" ({s.impl.notes[f]})" if f in s.impl.notes else "")
                                    for f in s.impl.pieces), markup=False)
        out.print(_curves(s, every))
        for traj in s.trajectories[:3]:
            if traj.steps:
                first, last = traj.steps[0].metrics["lm loss"], traj.steps[-1].metrics["lm loss"]
                zs = ", ".join(f"{n} {c:.0f}" for n, c in T.zero_sources(traj))
                out.print(f"{traj.role}: lm loss {first:.4f} -> {last:.4f} over {len(traj.steps)} steps; "
                          f"zeros mostly in {zs or 'no gradient'}", markup=False)
        for png in pngs:
            out.print(f"plot: {png}", markup=False)
    lines = golden_lines(s)
    if s.first_step is not None:  # the first verdict line: deterministic, whatever the trajectories do
        lines.append(f"{'ok' if s.first_step.passed else 'FAIL'} first step: {s.first_step.sentence()}")
    lines += [f"{'ok' if d.passed else 'DRIFT'} {d.metric}: {d.message}" for d in s.drifts]
    if s.zeros is not None and not quiet:
        lines.append(f"zeros: {s.zeros.sentence}" + "".join(f"; {p}" for p in s.zeros.parameters))
    if s.errors and not s.nonfinite:
        first = s.errors[0]
        where = f" (seed {first.seed}; {len(s.errors)} of {len(s.seeds)} seeds ended early)" if s.ensemble else ""
        lines.append(f"the implementation's run ended at {first.error}{where}")
    if s.nonfinite:
        lines.append(f"the implementation {s.nonfinite}")
    native, ref = s.role("native"), s.role("reference")
    if native is not None and (why := T.nonfinite_sentence(native, ref)):
        lines.append(f"note: the native run {why}, where the float64 run stays finite (its drift counts only before)")
    if (traced := s.traced()):
        lines.append(f"traced: {traced}")
    for line in lines:
        out.print(line, markup=False)
    out.print(_verdict(o))


def _verdict(o) -> str:
    s, kappa = o.session, o.plan.req.kappa
    written = f"report {o.report}" + (f", golden values {o.goldens}" if o.goldens else "") + \
        (f"; {said(o.library_log)}" if o.library_log else "")
    if s.interrupted:
        return f"[yellow]INTERRUPTED[/] after {len(s.impl.steps)} steps of the implementation's run ({written})"
    if not s.compared:
        return ("[green]TRAINED[/]" if o.trained_cleanly else "[red]FAILED[/]") + \
            f" {len(s.impl.steps)} steps, not compared ({written})"
    from mhctool.analyses.train import default_seeds
    verdict = "[green]PASSED[/] stays with the float64 reference" if s.passed else f"[red]FAILED[/] {failed_how(s)}"
    over = (f"over {len(s.seeds)} seeds" if s.ensemble else
            f"one seed: a single sample of a chaotic run, --seeds {default_seeds(s.cfg.device)} judges over an ensemble")
    return f"{verdict} (kappa {kappa:g} x native's drift, {over}; {written})"


def failed_how(s) -> str:
    """What failed, in the order the verdict lines give it: the first step, a non-finite value, a
    run that ended, the drift (by metric); never "drifts" where nothing drifted."""
    said = []
    if s.first_step is not None and not s.first_step.passed:
        said.append("at the first step")
    if s.nonfinite:
        said.append("with a non-finite value")
    elif s.errors or s.impl.error is not None:
        said.append("with a run that ended early")
    drifted = [d.metric for d in s.drifts if not d.passed]
    if drifted:
        said.append(f"drifts from the float64 reference in {', '.join(drifted)}")
    if not said:
        return "against the float64 reference"
    return (", ".join(said[:-1]) + " and " + said[-1]) if len(said) > 1 else said[0]
