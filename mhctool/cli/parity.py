"""``mhctool parity``: its options, the run (:mod:`mhctool.analyses.runs.parity`) and what it prints.

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
from mhctool.cli.tables import verdict_table
from mhctool.core import names
from mhctool.core.text import short_impl, split
from mhctool.spread import setup

Kernel = Annotated[Optional[str], typer.Option("--kernel", "-k", help="A kernel, a comma-separated list, or a group (all; mhc or moe: every kernel of one kind): " + ", ".join(names.KERNELS) + ". Default: the kernels of --scenario, else all.")]
Impl = Annotated[Optional[list[str]], typer.Option("--impl", "-i", help="Implementation(s): torch, compile, triton, cutile, module.path:function or file.py:function. Repeat or comma-separate. Default: every available built-in one.")]
Dtype = Annotated[Optional[str], typer.Option("--dtype", help="Comma-separated dtypes (fp32, bf16, fp16); default: the scenario's.")]
Shape = Annotated[Optional[str], typer.Option("--shape", help="SxBxNxC for mHC kernels (e.g. 8192x4x4x7168), TxHxFxE for grouped-MLP ones (e.g. 4096x2048x1024x8); default: the scenario's.")]
Scenario = Annotated[Optional[str], typer.Option("--scenario", help="Scenario TOML file or built-in name (parity-default, paper).")]
Seed = Annotated[Optional[int], typer.Option("--seed", min=0, help="Input seed (default: the scenario's).")]
Out = Annotated[Path, typer.Option("--out", "-o", help="Parquet report to write.")]
MatmulPrecision = Annotated[str, typer.Option("--matmul-precision", help="ieee, tf32 (rounded to nearest, cuBLAS), tf32_trunc (truncated operands, Triton's tl.dot default on fp32) or bf16: the precision external kernels multiply at by design; they are judged against the native implementation at it.")]
Kappa = Annotated[Optional[float], typer.Option("--kappa", min=1.0, help="Error may be kappa x the native error (default: scenario's, 2).")]
Top = Annotated[int, typer.Option("--top", min=1, help="Rows of the worst-cases table.")]
Hint = Annotated[bool, typer.Option("--hint/--no-hint", help="Where an outside implementation fails on a measurement, identify what it computes (seconds to a minute a kernel) and print a hint with the flags that judge it.")]
Isolate = Annotated[Optional[bool], typer.Option("--isolate/--no-isolate", help="Run each implementation under test in a child process, so exits, crashes, hangs and CUDA faults become failed rows. Default: on for an --impl mhctool did not ship, or with --case-timeout; off otherwise.")]
CaseTimeout = Annotated[Optional[float], typer.Option("--case-timeout", min=0.001, help="Seconds an isolated implementation may take for one case (default: 120 s plus 30 s per GiB the case needs, 300 s more for an external one, which compiles inside the call; 4x that on the CPU).")]
IsolateTransport = Annotated[Optional[str], typer.Option("--isolate-transport", show_default="shm", help="How tensors reach the child (needs isolation): shm (CUDA tensors as CUDA IPC handles, CPU ones in host shared memory), host (everything through host shared memory) or file (torch.save in /dev/shm).")]
Check = Annotated[Optional[list[str]], typer.Option("--check", help="Also compare bits: determinism (the same inputs, run after run) and/or batch-invariance (each token's result at other batch sizes). Repeat or comma-separate; a difference is a failed row.")]
RepeatsDeterminism = Annotated[int, typer.Option("--repeats-determinism", min=2, help="Runs in all for --check determinism.")]
Convention = Annotated[Optional[list[str]], typer.Option("--convention", help="KNOB=VALUE (repeat): the convention the external implementation computes (stabilize=softmax, transpose_res=true, eps_mode=clamp, eps=0, iters=10, rms_eps=inside, compute_h_eps=1e-6); the reference and the native baseline compute it too, and a function that takes no such parameter is called without it.")]
InputDtypes = Annotated[Optional[list[str]], typer.Option("--input-dtypes", help="NAME=DTYPE (repeat or comma-separate): the dtype the external implementation takes an input in: activation (the case's dtype), fp32, bf16 or fp16, e.g. h_pre=activation for a function that multiplies in one dtype. The float64 reference and the native baseline see the same rounded values; its gradients are judged at the contract's threshold.")]
Shard = Annotated[Optional[str], typer.Option("--shard", help="I/N: run only the I-th of N deterministic slices of the cases (a CI matrix, a Slurm array); join the reports with mhctool report merge.")]
Ranks = Annotated[int, typer.Option("--ranks", help="Split each case's tokens over R processes joined by torch.distributed (Gloo on the CPU, NCCL on GPUs, a GPU a rank), the parameter gradients all-reduced, as under data or sequence parallelism; the native baseline runs the same way.")]
GradReduce = Annotated[str, typer.Option("--grad-reduce", help="With --ranks: the dtype the parameter gradients are all-reduced in: fp32, or bf16 (as --grad-reduce-in-bf16 trains).")]


@guard
def parity(
    kernel: Kernel = None,
    impl: Impl = None,
    dtype: Dtype = None,
    shape: Shape = None,
    device: opts.Device = None,
    scenario: Scenario = None,
    seed: Seed = None,
    out_path: Out = Path("mhctool-parity.parquet"),
    plot: opts.Plot = None,
    matmul_precision: MatmulPrecision = "ieee",
    kappa: Kappa = None,
    top: Top = 20,
    hint: Hint = True,
    quiet: opts.Quiet = False,
    isolate: Isolate = None,
    case_timeout: CaseTimeout = None,
    insist: opts.Insist = False,
    isolate_transport: IsolateTransport = None,
    check: Check = None,
    repeats_determinism: RepeatsDeterminism = 3,
    convention: Convention = None,
    input_dtypes: InputDtypes = None,
    workers: opts.Workers = None,
    shard: Shard = None,
    backend: opts.Backend = "local",
    ray_address: opts.RayAddress = None,
    ranks: Ranks = 1,
    grad_reduce: GradReduce = "fp32",
    verbose: opts.Verbose = False,
    show_profile: opts.ShowProfile = False,
):
    """Run implementations and the float64 reference side by side, forward and backward."""
    setup.warm(workers, backend, bool(isolate), device)  # the fork server imports torch while this process plans
    opts.precheck(kernel, split([dtype]) if dtype else None, shape, device, impl)
    from mhctool.analyses.runs import parity as run
    req = run.Request(kernel, split(impl), split([dtype]) if dtype else None, shape, device, scenario, seed, out_path,
                      plot, matmul_precision, kappa, hint, split(check), repeats_determinism,
                      opts.knob_items(convention, "--convention", "stabilize=softmax"),
                      opts.knob_items(input_dtypes, "--input-dtypes", "h_pre=activation"), isolate, case_timeout,
                      isolate_transport, workers, backend, ray_address, shard, ranks, grad_reduce, verbose,
                      insist=insist)
    with watching("parity", None, quiet, unit="cases done") as watch:
        o = run.run(req, watch)
    show(o, top, quiet, show_profile, plot)
    raise typer.Exit(o.exit_code)


def show(o, top: int, quiet: bool, show_profile: bool, plot: Optional[Path] = None) -> None:
    """A parity run's outcome: the worst verdicts, the plots (drawn from the report into ``plot``),
    the summary line and what follows it."""
    p, f, s = o.counts
    n = len(o.plan.cases)
    pngs = []
    if plot is not None:
        from mhctool.views.plots import parity_figures
        pngs = parity_figures(o.table, plot)
    if not quiet and o.verdicts:  # an interrupted run may have judged nothing: no empty table
        out.print(verdict_table(o.verdicts, top, f"parity: worst of {len(o.verdicts)} (case x impl x direction)"))
        for png in pngs:
            out.print(f"plot: {png}")
    if show_profile:
        from mhctool.core.profile import lines
        for line in lines(o.ran.timings, o.ran.wall, o.workers):
            out.print(line, markup=False)
    if o.interrupted:
        out.print(f"[yellow]INTERRUPTED[/] after {o.ran.cases_run} of {n} cases: {p} passed, {f} failed, {s} skipped "
                  f"(report {o.report}, marked interrupted)")
    else:
        status = "[red]FAILED[/]" if o.failed else "[green]PASSED[/]"
        out.print(f"{status} {p} passed, {f} failed, {s} skipped  ({n} cases on {o.device}; report {o.report})")
        for name in o.outside:  # the implementations under test, apart from the baselines
            pp, ff, ss = o.counts_of(name)
            out.print(f"  of them {short_impl(name)}: {pp} passed, {ff} failed, {ss} skipped", markup=False)
        for name, why in o.unjudged.items():
            out.print(f"FAILED: {short_impl(name)} was judged on no case: every row of it was skipped ({why}); "
                      "the native rows are no verdict on it", markup=False)
        for line in o.notes + o.hints:
            out.print(line, markup=False)
    if o.library_log and not quiet:
        out.print(said(o.library_log), markup=False)
