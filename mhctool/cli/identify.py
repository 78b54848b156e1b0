"""``mhctool identify``: its options, the run (:mod:`mhctool.analyses.runs.identify`) and what it
prints.

The run is imported inside the command, so that ``--help`` and a usage error answer without
importing torch."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from mhctool.cli import options as opts
from mhctool.cli.console import out
from mhctool.cli.progress import watching
from mhctool.core.library_log import said
from mhctool.core import names
from mhctool.core.errors import UsageError
from mhctool.core.text import fmt
from mhctool.spread import setup

Kernel = Annotated[str, typer.Option("--kernel", "-k", help="One kernel: " + ", ".join(names.IDENTIFIABLE) + ".")]
Impl = Annotated[list[str], typer.Option("--impl", "-i", help="The implementation: a built-in name, module.path:function, file.py:function, or a library (te:DIR, megatron:DIR); one a run.")]
Dtype = Annotated[str, typer.Option("--dtype", help="Probe dtype (fp32 separates the candidates best).")]
Shape = Annotated[Optional[str], typer.Option("--shape", help="Probe shape (default: small, per kernel; TransformerEngine's kernels need n = 4).")]
Knob = Annotated[Optional[list[str]], typer.Option("--knob", help="KNOB=VALUE (repeat): what the implementation is asked for (default: the contract's values, e.g. iters=20 eps=1e-6).")]
Seed = Annotated[int, typer.Option("--seed", min=0, help="Probe input seed.")]
Out = Annotated[Path, typer.Option("--out", "-o", help="Parquet report: one row per candidate tried.")]
Top = Annotated[int, typer.Option("--top", min=1, help="Rows of the candidates table.")]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="Print only the result lines.")]
Isolate = Annotated[Optional[bool], typer.Option("--isolate/--no-isolate", help="Run the implementation in a child process (default: on for one mhctool did not ship).")]
MatmulPrecision = Annotated[Optional[str], typer.Option("--matmul-precision", help="ieee, tf32, tf32_trunc or bf16: what the implementation multiplies at by design (default: fitted with the conventions; an adapter's declared precision is where the fit starts).")]


def _table(ident, top: int) -> Table:
    from mhctool.analyses.identify import fmt_knobs  # torch: imported where a table is made
    t = Table(title=f"identify {ident.kernel}: {ident.impl.name} (asked: {fmt_knobs(ident.asked_all) or 'the contract'})")
    for c in ("candidate", "max_rel", "x native noise", "native max_rel", "verdict", "what it is"):
        t.add_column(c)
    for c in ident.shown(top):
        verdict = "-" if c.passed is None else ("pass" if c.passed else "FAIL")
        t.add_row(fmt_knobs(c.knobs) or "(the contract)", fmt(c.max_rel), fmt(c.score), fmt(c.native_score), verdict,
                  (c.worst if c.passed is False else c.level) or "not judged")
    return t



def _one(impls: list[str]) -> str:
    """The one implementation a run identifies; several (repeated or comma-separated) are refused
    in one sentence, none kept silently."""
    given = [i for i in impls if i.strip()] or impls
    if len(given) > 1 or (given and "," in given[0] and ":" not in given[0]):
        listed = [x.strip() for i in given for x in (i.split(",") if ":" not in i else [i]) if x.strip()]
        raise UsageError(f"identify fits one implementation a run; got {len(listed)} ({', '.join(listed)}): "
                         "run it once for each")
    return given[0]


def identify(
    kernel: Kernel,
    impl: Impl,
    dtype: Dtype = "fp32",
    device: opts.Device = None,
    shape: Shape = None,
    knob: Knob = None,
    seed: Seed = 0,
    out_path: Out = Path("mhctool-identify.parquet"),
    top: Top = 8,
    quiet: Quiet = False,
    isolate: Isolate = None,
    verbose: opts.Verbose = False,
    matmul_precision: MatmulPrecision = None,
    case_timeout: opts.CaseTimeout = None,
    insist: opts.Insist = False,
):
    """Tell which convention a kernel computes: fit the family's convention knobs against the float64
    reference; exit 0 when a convention fits (the verdict rule passes under it), 1 when none does or
    what fits is likely a defect."""
    impl = _one(impl)
    opts.precheck(kernel, [dtype], shape, device, [impl])
    if kernel not in names.IDENTIFIABLE:
        raise UsageError(f"mhctool identify knows no conventions of {kernel}; it identifies "
                         + ", ".join(names.IDENTIFIABLE))
    # the fork server imports torch while this process plans, where the implementation will run
    # isolated (outside code, by default): its first call then waits for a fork, not for an import
    setup.warm(1, isolate=isolate if isolate is not None else names.is_outside(impl), device=device)
    from mhctool.analyses.runs import identify as run
    req = run.Request(kernel, impl, dtype, device, shape, opts.knob_items(knob, "--knob", "iters=20"), seed, out_path,
                      isolate, verbose, matmul_precision, case_timeout, insist)
    with watching("identify", None, quiet, unit="implementations done", spinner=True) as watch:
        o = run.run(req, watch)
    for f in o.found:
        if not quiet and f.ident.candidates:
            out.print(_table(f.ident, top))
        for line in f.lines:
            out.print(line, markup=False)
    if o.interrupted:
        out.print(f"INTERRUPTED: the report holds what was identified before the signal ({len(o.found)} "
                  f"implementation{'' if len(o.found) == 1 else 's'})")
    if not quiet:
        out.print("; ".join(x for x in (f"report {o.report}", said(o.library_log)) if x))
    raise typer.Exit(o.exit_code)
