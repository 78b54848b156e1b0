"""``mhctool bench``: its options, the run (:mod:`mhctool.analyses.runs.bench`) and its tables.

The run is imported inside the command, so that ``--help`` and a usage error answer without
importing torch."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from mhctool.cli import options as opts
from mhctool.cli.console import guard, out
from mhctool.cli.progress import watching
from mhctool.core.library_log import said
from mhctool.cli.tables import bench_table, bench_totals
from mhctool.core import names
from mhctool.core.errors import UsageError
from mhctool.core.text import short_impl, split

Shape = Annotated[Optional[str], typer.Option("--shape", help="SxBxNxC for mHC kernels (default 8192x4x4x7168 on a GPU, 64x2x4x512 on the CPU), TxHxFxE for grouped-MLP ones (default 4096x2048x1024x8, 64x64x96x4 on the CPU).")]
Kernel = Annotated[str, typer.Option("--kernel", "-k", help="A kernel, a comma-separated list, or a group (all; mhc or moe: every kernel of one kind): " + ", ".join(names.KERNELS) + ".")]
Impl = Annotated[Optional[list[str]], typer.Option("--impl", "-i", help="Implementations (default: every available one: torch, compile, triton, cutile), or module:function.")]
Dtype = Annotated[str, typer.Option("--dtype", help="Activation dtype (sinkhorn always runs on the fp32 mapping path).")]
Direction = Annotated[str, typer.Option("--direction", help="fwd, bwd or both (comma-separated).")]
Repeats = Annotated[int, typer.Option("--repeats", min=3, help="Timed repeats (median and p10/p90 reported).")]
Graph = Annotated[bool, typer.Option("--graph", help="Time CUDA-graph replays (launch and Python overhead removed).")]
Experts = Annotated[Optional[str], typer.Option("--experts", help="Grouped-MLP sweep over expert counts, e.g. 8,32,128: each implementation timed with and without CUDA graphs.")]
Tokens = Annotated[int, typer.Option("--tokens", min=1, help="Tokens of the --experts sweep.")]
Hidden = Annotated[Optional[int], typer.Option("--hidden", min=1, show_default="2048; with --engine the recipe's 512, 64 on a CPU", help="Hidden size of the --experts sweep, or of the --engine model.")]
Ffn = Annotated[int, typer.Option("--ffn", min=1, help="FFN size per expert of the --experts sweep.")]
Out = Annotated[Path, typer.Option("--out", "-o", help="Parquet report to write.")]
Plot = Annotated[Optional[Path], typer.Option("--plot", help="PNG to write (bars per kernel and direction, roofline line).")]
Quiet = Annotated[bool, typer.Option("--quiet", "-q")]
Isolate = Annotated[Optional[bool], typer.Option("--isolate/--no-isolate", help="Time each implementation in a child process, so a crash or a hang is reported and the others are still timed. Default: on for an --impl mhctool did not ship, or with --case-timeout.")]
CaseTimeout = Annotated[Optional[float], typer.Option("--case-timeout", min=0.001, help="Seconds an isolated measurement may take (default: scaled with the shape).")]
Engine = Annotated[Optional[str], typer.Option("--engine", help="Time a training step instead of kernels alone: megatron:DIR (a staged megatron-core, its GPT by Megatron-LM's mHC recipe, on a GPU) or FILE.py:function (an engine of your own, as train --engine takes). Each variant is timed: plain (no hyper-connections, the baseline), native (the engine's own mHC path), fused (its fused switch) and each --impl at the entry points (default: triton and cutile on a GPU, torch on a CPU).")]
Recipe = Annotated[Optional[list[str]], typer.Option("--recipe", help="With --engine, KEY=VALUE: an option of the recipe (repeat), e.g. recompute=false, global_batch=16, heads=16.")]
Sweep = Annotated[Optional[list[str]], typer.Option("--sweep", help="With --engine, KEY=V1,V2,...: time every variant at each value of a recipe option (repeat for every combination), e.g. streams=2,4,8, hidden=512,1024, seq=1024,4096, recompute=true,false.")]
Layers = Annotated[Optional[int], typer.Option("--layers", min=1, help="With --engine: layers (the recipe's 12; 2 on a CPU).")]
Heads = Annotated[Optional[int], typer.Option("--heads", min=1, help="With --engine: attention heads (the recipe's 8; 4 on a CPU).")]
Seq = Annotated[Optional[int], typer.Option("--seq", min=1, help="With --engine: sequence length (the recipe's 1024; 64 on a CPU).")]
Batch = Annotated[Optional[int], typer.Option("--batch", min=1, help="With --engine: the micro-batch (the recipe's 4 of 32; 2 of 4 on a CPU; --recipe global_batch=N for the step's).")]
Streams = Annotated[Optional[int], typer.Option("--streams", min=1, help="With --engine: residual streams n (the recipe's 4).")]
Vocab = Annotated[Optional[int], typer.Option("--vocab", min=1, help="With --engine: vocabulary (the recipe's 50304; 512 on a CPU).")]
Steps = Annotated[int, typer.Option("--steps", min=3, help="With --engine: timed steps per variant (median and p10/p90).")]
Warmup = Annotated[int, typer.Option("--warmup", min=0, help="With --engine: steps run first and not timed (compilation, the allocator's growth).")]
EntrySteps = Annotated[int, typer.Option("--entry-steps", min=0, help="With --engine: steps after the timed ones with the mHC entry points timed in place (their forward, backward and recompute); 0: none.")]
Variant = Annotated[Optional[list[str]], typer.Option("--variant", help="With --engine: time only these variants (plain, native, fused, an --impl; the baseline always runs).")]
Kernels = Annotated[bool, typer.Option("--kernels/--no-kernels", help="With --engine: each swapped-in kernel also timed alone at the step's shape, beside its time in the step.")]
Knob = Annotated[Optional[list[str]], typer.Option("--knob", help="KEY=VALUE (repeat or comma-separate): a knob of the kernels timed, e.g. dropout=0.1 (h_post_bda's dropout: its mask drawn in the kernel); default: the family's.")]
InputDtypes = Annotated[str, typer.Option("--input-dtypes", help="library: each library timed at the input dtypes its adapter says it is used with (Megatron-LM's h_res and h_post in the activations' dtype); contract: every implementation at mhctool's contract dtypes.")]


@guard
def bench(
    shape: Shape = None,
    kernel: Kernel = "all",
    impl: Impl = None,
    dtype: Dtype = "bf16",
    direction: Direction = "fwd,bwd",
    repeats: Repeats = 50,
    graph: Graph = False,
    experts: Experts = None,
    tokens: Tokens = 4096,
    hidden: Hidden = None,
    ffn: Ffn = 1024,
    device: opts.Device = None,
    out_path: Out = Path("mhctool-bench.parquet"),
    plot: Plot = None,
    quiet: Quiet = False,
    isolate: Isolate = None,
    case_timeout: CaseTimeout = None,
    input_dtypes: InputDtypes = "library",
    insist: opts.Insist = False,
    engine: Engine = None,
    recipe: Recipe = None,
    sweep: Sweep = None,
    layers: Layers = None,
    heads: Heads = None,
    seq: Seq = None,
    batch: Batch = None,
    streams: Streams = None,
    vocab: Vocab = None,
    steps: Steps = 10,
    warmup: Warmup = 3,
    entry_steps: EntrySteps = 3,
    variant: Variant = None,
    kernels: Kernels = True,
    knob: Knob = None,
):
    """Time kernels against the memory roofline measured in the same run; with --engine, a
    training step and what mHC costs in it."""
    if engine is not None:
        if knob:
            raise UsageError("--knob sets a kernel's knobs for timing it alone; with --engine the recipe decides "
                             "them (--recipe hidden_dropout=...)")
        return _bench_engine(engine, impl, recipe, sweep, dict(layers=layers, hidden=hidden, heads=heads, seq=seq,
                                                                micro_batch=batch, streams=streams, vocab=vocab),
                             steps, warmup, entry_steps, variant, kernels, device, out_path, plot, quiet)
    _kernels_only(recipe=recipe, sweep=sweep, layers=layers, heads=heads, seq=seq, batch=batch, streams=streams,
                  vocab=vocab, variant=variant)
    hidden = 2048 if hidden is None else hidden
    opts.precheck(kernel, [dtype], shape, device, impl)
    from mhctool.analyses.runs import bench as run
    req = run.Request(kernel, split(impl), shape, dtype, split([direction]), repeats, graph, experts, tokens, hidden,
                      ffn, device, out_path, plot, isolate, case_timeout, input_dtypes, insist,
                      opts.knob_items(knob, "--knob", "dropout=0.1"))
    with watching("bench", None, quiet, unit="timed") as watch:
        o = run.run(req, watch)
    _show(o, quiet, plot)
    _finish(o, [f"{r['kernel']} {r['direction']} {short_impl(r['impl'])}: {r['message']}" for r in o.errors])


def _show(o, quiet: bool, plot) -> None:
    """The kernels' table, their totals over both directions and the whole path, and the figure."""
    if not quiet:
        out.print(bench_table(o.rows, f"bench {o.shape_text} {o.dtype} on {o.device}: copy {o.copy_bw / 1e9:.3g} GB/s, "
                                      f"bf16 matmul {o.matmul_bf16 / 1e12:.3g} TFLOP/s, tf32 {o.matmul_tf32 / 1e12:.3g} "
                                      "TFLOP/s" + ("" if o.device == "cuda" else " (a CPU's: no roofline applies)")))
        from mhctool.analyses import timing
        for t in bench_totals(o.totals, timing.whole_path(o.totals), timing.PATH):
            out.print(t)
        for k, name, glue in o.glue:
            out.print(f"note: {short_impl(name)} ({k}) is timed with its adapter's glue: {glue}", markup=False)
    if plot is not None:
        from mhctool.views.plots import bench_figure
        out.print(f"plot: {bench_figure(o.table, plot, o.copy_bw)}")


def _kernels_only(**given) -> None:
    """The options that time a training step, given without --engine: a UsageError naming them."""
    named = [f"--{k}" for k, v in given.items() if v is not None]
    if named:
        raise UsageError(f"{', '.join(named)} time a training step: give --engine too (or leave them out)")


def _finish(o, failures: list[str]):
    """What both bench runs end with: each failure, where the report (and the libraries' log)
    went, a stop said; the exit code."""
    for line in failures:
        out.print(f"FAILED {line}", markup=False)
    out.print("; ".join(x for x in (f"report {o.report}", said(o.library_log)) if x), markup=False)
    if o.interrupted:
        out.print("[yellow]INTERRUPTED[/]: the report holds what was timed before the stop")
    raise typer.Exit(o.exit_code)


def _sweep_items(items) -> list[tuple[str, str]]:
    """``--sweep KEY=V1,V2`` items (the commas are the values')."""
    out = []
    for item in items or []:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip() or not raw.strip():
            raise UsageError(f"malformed --sweep {item!r}; expected KEY=V1,V2,..., e.g. streams=2,4,8")
        out.append((key.strip(), raw.strip()))
    return out


def _bench_engine(engine, impl, recipe, sweep, sizes, steps, warmup, entry_steps, variant, kernels, device, out_path,
                  plot, quiet):
    """``bench --engine``: the step of each variant, its overhead over the baseline and where the
    time inside the mHC entry points goes."""
    from mhctool.cli.tables import step_attribution_table, step_split_table, step_table
    opts.precheck(None, [], None, device, impl)
    from mhctool.analyses.runs import bench_step as run
    req = run.Request(engine, split(impl), sizes, opts.knob_items(recipe, "--recipe", "recompute=false"),
                      _sweep_items(sweep), warmup, steps, entry_steps, device, kernels,
                      out_path, plot, split(variant))
    with watching("bench", None, quiet, unit="variants timed") as watch:
        o = run.run(req, watch)
    r = o.recipe
    head = (f"bench --engine {o.engine} on {o.device}: {r.layers} layers, hidden {r.hidden}, {r.heads} heads, seq "
            f"{r.seq}, micro-batch {r.micro_batch} of {r.global_batch}, n = {r.streams}, recompute "
            f"{'on' if r.recompute else 'off'}; median of {req.steps} steps after {req.warmup}"
            + ("" if o.host_op_us is None else f"; host {o.host_op_us:.1f} us to issue a small op"
               + (f" ({o.cpu})" if o.cpu else "")))
    if not quiet:
        out.print(step_table(o.rows, head))
        for t in (step_split_table(o.rows, f"inside the mHC module, a step (median of {req.entry_steps} steps timed "
                                           "in place; alone: the kernel timed alone at the step's shape x calls)"),
                  step_attribution_table(o.rows, "where the overhead goes, a step (share of the overhead)")):
            if t is not None:
                out.print(t)
    if plot is not None and o.rows:
        from mhctool.views.plots import step_figure
        out.print(f"plot: {step_figure(o.table, plot)}")
    _finish(o, [f"{short_impl(e['variant'])}: {e['message']}" for e in o.errors])
