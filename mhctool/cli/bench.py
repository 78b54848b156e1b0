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
Hidden = Annotated[int, typer.Option("--hidden", min=1, help="Hidden size of the --experts sweep.")]
Ffn = Annotated[int, typer.Option("--ffn", min=1, help="FFN size per expert of the --experts sweep.")]
Out = Annotated[Path, typer.Option("--out", "-o", help="Parquet report to write.")]
Plot = Annotated[Optional[Path], typer.Option("--plot", help="PNG to write (bars per kernel and direction, roofline line).")]
Quiet = Annotated[bool, typer.Option("--quiet", "-q")]
Isolate = Annotated[Optional[bool], typer.Option("--isolate/--no-isolate", help="Time each implementation in a child process, so a crash or a hang is reported and the others are still timed. Default: on for an --impl mhctool did not ship, or with --case-timeout.")]
CaseTimeout = Annotated[Optional[float], typer.Option("--case-timeout", min=0.001, help="Seconds an isolated measurement may take (default: scaled with the shape).")]
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
    hidden: Hidden = 2048,
    ffn: Ffn = 1024,
    device: opts.Device = None,
    out_path: Out = Path("mhctool-bench.parquet"),
    plot: Plot = None,
    quiet: Quiet = False,
    isolate: Isolate = None,
    case_timeout: CaseTimeout = None,
    input_dtypes: InputDtypes = "library",
    insist: opts.Insist = False,
):
    """Time kernels against the memory roofline measured in the same run."""
    opts.precheck(kernel, [dtype], shape, device, impl)
    from mhctool.analyses.runs import bench as run
    req = run.Request(kernel, split(impl), shape, dtype, split([direction]), repeats, graph, experts, tokens, hidden,
                      ffn, device, out_path, plot, isolate, case_timeout, input_dtypes, insist)
    with watching("bench", None, quiet, unit="timed") as watch:
        o = run.run(req, watch)
    if not quiet:
        out.print(bench_table(o.rows, f"bench {o.shape_text} {o.dtype} on {o.device}: copy {o.copy_bw / 1e9:.0f} GB/s, "
                                      f"bf16 matmul {o.matmul_bf16 / 1e12:.0f} TFLOP/s, tf32 {o.matmul_tf32 / 1e12:.0f} TFLOP/s"))
        from mhctool.analyses import timing
        for t in bench_totals(o.totals, timing.whole_path(o.totals), timing.PATH):
            out.print(t)
        for k, name, glue in o.glue:
            out.print(f"note: {short_impl(name)} ({k}) is timed with its adapter's glue: {glue}", markup=False)
    if plot is not None:
        from mhctool.views.plots import bench_figure
        out.print(f"plot: {bench_figure(o.table, plot, o.copy_bw)}")
    for r in o.errors:
        out.print(f"FAILED {r['kernel']} {r['direction']} {short_impl(r['impl'])}: {r['message']}", markup=False)
    out.print("; ".join(x for x in (f"report {o.report}", said(o.library_log)) if x), markup=False)
    if o.interrupted:
        out.print("[yellow]INTERRUPTED[/]: the report holds what was timed before the stop")
    raise typer.Exit(o.exit_code)
