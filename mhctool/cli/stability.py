"""``mhctool stability``: sinkhorn (sweep), eps (one knob changed), overflow (headroom), gain
(depth): their options, the runs (:mod:`mhctool.analyses.runs.stability`) and their tables.

The runs are imported inside the commands, so that ``--help`` and a usage error answer without
importing torch."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from mhctool.cli import options as opts
from mhctool.cli.console import guard, out
from mhctool.cli.progress import watching
from mhctool.core.text import fmt, split

stability_app = typer.Typer(no_args_is_help=True, help="Where and why a computation breaks: sweeps and analyses.")

_IMPL_HELP = "Implementations (built-in name or module:function); repeat or comma-separate."
Quiet = Annotated[bool, typer.Option("--quiet", "-q")]
Plot = Annotated[Optional[Path], typer.Option("--plot", help="Folder for PNG plots.")]
SinkhornImpl = Annotated[Optional[list[str]], typer.Option("--impl", "-i", help=_IMPL_HELP + " Default: every available built-in one.")]
SinkhornQuick = Annotated[bool, typer.Option("--quick", help="A CPU-sized sweep (under a minute).")]
SinkhornScales = Annotated[Optional[str], typer.Option("--scales", help="Logit amplitudes LO:HI[:POINTS], log-spaced (default 0.1:1000 plus points near the overflows).")]
SinkhornIters = Annotated[Optional[list[str]], typer.Option("--iters", help="Iteration counts (1 to 10000), e.g. 1,5,20,100.")]
SinkhornFamily = Annotated[Optional[list[str]], typer.Option("--family", "-f", help="Input families (default: random, near_perm, dead_rows_cols).")]
SinkhornDtype = Annotated[Optional[list[str]], typer.Option("--dtype", help="fp32, bf16, fp16 (default: all three).")]
SinkhornOut = Annotated[Path, typer.Option("--out", "-o", help="Parquet report to write.")]
EpsKernel = Annotated[str, typer.Option("--kernel", "-k", help="sinkhorn, proj_rms, mapping or h_post_bda.")]
EpsFrm = Annotated[Optional[str], typer.Option("--from", help="eps before the change (e.g. 1e-6).")]
EpsTo = Annotated[Optional[str], typer.Option("--to", help="eps after the change (e.g. 1e-8).")]
EpsKnob = Annotated[Optional[str], typer.Option("--knob", help="Any knob instead: NAME=A,B (e.g. order=row_first,col_first).")]
EpsFamily = Annotated[Optional[list[str]], typer.Option("--family", "-f", help="Input families (default: all of the kernel's).")]
EpsDtype = Annotated[Optional[list[str]], typer.Option("--dtype", help="Output dtypes to judge the shift in (default fp32,bf16).")]
EpsImpl = Annotated[Optional[list[str]], typer.Option("--impl", "-i", help=_IMPL_HELP + " Default: the native one.")]
EpsDepth = Annotated[int, typer.Option("--depth", "-L", help="Layers in the mHC stack (the mHC test recipe has 12).")]
EpsSeed = Annotated[int, typer.Option("--seed")]
EpsOut = Annotated[Path, typer.Option("--out", "-o", help="Parquet report to write.")]
OverflowKernel = Annotated[str, typer.Option("--kernel", "-k", help="sinkhorn, h_aggregate, h_post_bda, proj_rms or mapping.")]
OverflowFamily = Annotated[str, typer.Option("--family", "-f", help="Input family to scale.")]
OverflowScales = Annotated[Optional[str], typer.Option("--scales", help="Input scales LO:HI[:POINTS] (default 0.1:1000 for Sinkhorn's logit amplitude, 0.1:1e21 otherwise).")]
OverflowKnob = Annotated[Optional[list[str]], typer.Option("--knob", help="NAME=VALUE for the kernel's knobs (e.g. stabilize=none).")]
OverflowDtype = Annotated[Optional[list[str]], typer.Option("--dtype", help="Dtypes to judge headroom in (default fp32,bf16,fp16).")]
OverflowImpl = Annotated[Optional[str], typer.Option("--impl", "-i", help="Implementation whose output finiteness is checked (default: the native one).")]
OverflowQuick = Annotated[bool, typer.Option("--quick", help="Fewer scales.")]
OverflowOut = Annotated[Path, typer.Option("--out", "-o", help="Parquet report to write.")]
GainDepth = Annotated[int, typer.Option("--depth", "-L", help="Layers to compose.")]
GainIters = Annotated[Optional[list[str]], typer.Option("--iters", help="Sinkhorn iteration counts (default 1,3,5,20).")]
GainHcScale = Annotated[float, typer.Option("--hc-scale", help="HC baseline: H_res = I + hc_scale * tanh(logits).")]
GainFamily = Annotated[str, typer.Option("--family", "-f", help="Sinkhorn input family for the per-layer logits.")]
GainTokens = Annotated[int, typer.Option("--tokens", help="Tokens (one H_res per token and layer).")]
GainN = Annotated[int, typer.Option("--n", help="Residual streams.")]
GainImpl = Annotated[Optional[list[str]], typer.Option("--impl", "-i", help=_IMPL_HELP + " Default: the native one.")]
GainDtype = Annotated[str, typer.Option("--dtype", help="Dtype the implementation computes H_res in (the mapping path is fp32).")]
GainSeed = Annotated[int, typer.Option("--seed")]
GainOut = Annotated[Path, typer.Option("--out", "-o", help="Parquet report to write.")]


def _written(o, plot: Optional[Path], figures) -> None:
    """The figures drawn from the report into ``plot`` (``figures(table, folder)``), and the report's
    line; a sweep a signal stopped says so and exits 130."""
    if plot and o.rows:
        pngs = figures(o.table, plot)
        for png in pngs if isinstance(pngs, list) else [pngs]:
            out.print(f"plot: {png}")
    out.print(f"{'INTERRUPTED: the stages measured before the signal; ' if o.interrupted else ''}"
              f"report {o.report} ({len(o.rows)} rows)")
    if o.exit_code:
        raise typer.Exit(o.exit_code)


@stability_app.command("sinkhorn")
@guard
def stability_sinkhorn(
    impl: SinkhornImpl = None,
    quick: SinkhornQuick = False,
    scales: SinkhornScales = None,
    iters: SinkhornIters = None,
    family: SinkhornFamily = None,
    dtype: SinkhornDtype = None,
    device: opts.Device = None,
    out_path: SinkhornOut = Path("mhctool-stability.parquet"),
    plot: Plot = None,
    quiet: Quiet = False,
):
    """Sweep logit amplitude, family, dtype, stabilize, eps, eps_mode, order and iterations."""
    from mhctool.analyses.runs import stability as run
    req = run.SinkhornRequest(split(impl), quick, scales, split(iters), split(family), split(dtype), device, out_path,
                              plot)
    with watching("stability sinkhorn", None, quiet, unit="stages started", spinner=True) as watch:
        o = run.sinkhorn(req, watch)
    if not quiet:
        out.print(_sinkhorn_table(o))
    from mhctool.analyses.stability import OVERFLOW_LOGIT
    from mhctool.views.plots import stability_figures
    _written(o, plot, lambda t, folder: list(stability_figures(t, folder, {d: OVERFLOW_LOGIT[d]
                                                                          for d in o.extra["spec"].dtypes})))


def _sinkhorn_table(o) -> Table:
    from mhctool.analyses.stability import OVERFLOW_LOGIT
    t = Table(title="first logit amplitude with a non-finite output (at the most iterations swept)")
    for c in ("impl", "family", "dtype", "stabilize", "eps", "first non-finite", "dtype exp overflow"):
        t.add_column(c)
    top = max(o.extra["spec"].iters)
    for f in o.extra["first_nonfinite"]:
        if f["iters"] != top or f["eps_mode"] != "add" or f["order"] != "row_first":
            continue
        t.add_row(f["impl"], f["family"], f["dtype"], f["stabilize"], f"{f['eps']:g}",
                  fmt(f["first_nonfinite_scale"]) if f["first_nonfinite_scale"] else "[green]finite[/]",
                  f"{OVERFLOW_LOGIT[f['dtype']]:.4g}")
    return t


@stability_app.command("eps")
@guard
def stability_eps(
    kernel: EpsKernel,
    frm: EpsFrm = None,
    to: EpsTo = None,
    knob: EpsKnob = None,
    family: EpsFamily = None,
    dtype: EpsDtype = None,
    impl: EpsImpl = None,
    depth: EpsDepth = 12,
    seed: EpsSeed = 0,
    device: opts.Device = None,
    out_path: EpsOut = Path("mhctool-eps.parquet"),
    plot: Plot = None,
    quiet: Quiet = False,
):
    """What changing one knob (eps by default) does: per input family at the kernel, and through a stack of L layers."""
    from mhctool.analyses.runs import stability as run
    req = run.EpsRequest(kernel, frm, to, knob, split(family), split(dtype), split(impl), depth, seed, device, out_path,
                         plot)
    with watching("stability eps", None, quiet, unit="stages started", spinner=True) as watch:
        o = run.eps(req, watch)
    if not quiet:
        out.print(_eps_table(o.rows, o.extra["change"], depth))
    from mhctool.views.plots import knob_shift_figure
    _written(o, plot, knob_shift_figure)


def _eps_table(rows: list[dict], change, depth: int) -> Table:
    t = Table(title=f"{change.kernel} {change.label}: kernel shift, and after {depth} mHC layers")
    for c in ("family", "dtype", "impl", "tensor", "max shift", "ulps", "tokens >1 ulp", "shift/noise",
              f"stack shift (L={depth})", "stack noise", "visible"):
        t.add_column(c)
    get = {(r["level"], r["family"], r["dtype"], r["impl"], r["tensor"], r["depth"], r["metric"]): r["value"] for r in rows}
    for key in dict.fromkeys((r["family"], r["dtype"], r["impl"], r["tensor"]) for r in rows if r["level"] == "kernel"):
        f, dt, im, tensor = key
        k = lambda m: get.get(("kernel", f, dt, im, tensor, None, m))  # noqa: E731
        s = lambda m: get.get(("stack", f, dt, "reference", "x", depth, m))  # noqa: E731
        ratio = s("shift_over_noise")
        t.add_row(f, dt, im, tensor, fmt(k("shift_max_abs")), fmt(k("shift_ulps")), fmt(k("tokens_shifted_share")),
                  fmt(k("shift_over_noise")), fmt(s("shift_rel_l2")), fmt(s("noise_rel_l2")),
                  "-" if ratio is None else ("[red]above noise[/]" if ratio > 1 else "below noise"))
    return t



@stability_app.command("overflow")
@guard
def stability_overflow(
    kernel: OverflowKernel,
    family: OverflowFamily = "random",
    scales: OverflowScales = None,
    knob: OverflowKnob = None,
    dtype: OverflowDtype = None,
    impl: OverflowImpl = None,
    quick: OverflowQuick = False,
    device: opts.Device = None,
    out_path: OverflowOut = Path("mhctool-overflow.parquet"),
    plot: Plot = None,
    quiet: Quiet = False,
):
    """Headroom to the dtype's largest finite value of every intermediate as the input scale grows."""
    from mhctool.analyses.runs import stability as run
    req = run.OverflowRequest(kernel, family, scales, split(knob), split(dtype), impl, quick, device, out_path, plot)
    with watching("stability overflow", None, quiet, unit="stages started", spinner=True) as watch:
        o = run.overflow(req, watch)
    if not quiet:
        out.print(_overflow_table(o, kernel, family))
        if any(s["silent"] for s in o.extra["summary"]):
            out.print("[red]silent[/]: the intermediate overflows the dtype at a scale where the output is still finite")
    from mhctool.views.plots import overflow_figure
    _written(o, plot, overflow_figure)


def _overflow_table(o, kernel: str, family: str) -> Table:
    summ, knobs, dtypes, impl = (o.extra[k] for k in ("summary", "knobs", "dtypes", "impl"))
    t = Table(title=f"{kernel} ({family}, {', '.join(f'{k}={v}' for k, v in knobs.items()) or 'no knobs'}): "
                    f"first input scale with no headroom left; output checked with {impl}")
    for c in ("intermediate", *dtypes):
        t.add_column(c)
    by = {(s["intermediate"], s["dtype"]): s for s in summ}
    for name in dict.fromkeys(s["intermediate"] for s in summ):
        cells = []
        for dt in dtypes:
            s = by[(name, dt)]
            cell = fmt(s["first_overflow_scale"]) if s["first_overflow_scale"] is not None else "[green]-[/]"
            if s["silent"]:
                cell += " [red]silent[/]"
            cells.append(cell)
        t.add_row(name, *cells)
    first_out = {s["dtype"]: s["output_first_nonfinite"] for s in summ}
    t.add_row(f"{impl} output non-finite", *[fmt(first_out.get(dt)) if first_out.get(dt) else "[green]-[/]"
                                              for dt in dtypes])
    return t


@stability_app.command("gain")
@guard
def stability_gain(
    depth: GainDepth = 64,
    iters: GainIters = None,
    hc_scale: GainHcScale = 0.3,
    family: GainFamily = "random",
    tokens: GainTokens = 256,
    n: GainN = 4,
    impl: GainImpl = None,
    dtype: GainDtype = "fp32",
    seed: GainSeed = 0,
    device: opts.Device = None,
    out_path: GainOut = Path("mhctool-gain.parquet"),
    plot: Plot = None,
    quiet: Quiet = False,
):
    """Amax gain of the composite H_res over depth: Sinkhorn configurations against unconstrained HC."""
    from mhctool.analyses.runs import stability as run
    req = run.GainRequest(depth, split(iters), hc_scale, family, tokens, n, split(impl), dtype, seed, device, out_path,
                          plot)
    with watching("stability gain", None, quiet, unit="stages started", spinner=True) as watch:
        o = run.gain(req, watch)
    if not quiet:
        out.print(_gain_table(o.rows, depth, tokens))
    from mhctool.views.plots import gain_figure
    _written(o, plot, gain_figure)


def _gain_table(rows: list[dict], depth: int, tokens: int) -> Table:
    marks = sorted({d for d in (1, 4, 16, 64, 256, depth) if d <= depth})
    t = Table(title=f"composite Amax gain, forward / backward (mean over {tokens} tokens; max in the last column)")
    for c in ("config", "impl", *[f"L={d}" for d in marks], f"max over tokens, L={depth}"):
        t.add_column(c)
    get = {(r["config"], r["impl"], r["depth"], r["metric"]): r["value"] for r in rows}
    for cfg, im in dict.fromkeys((r["config"], r["impl"]) for r in rows):
        t.add_row(cfg, im, *[f"{get[(cfg, im, d, 'fwd_gain')]:.3g} / {get[(cfg, im, d, 'bwd_gain')]:.3g}" for d in marks],
                  f"{get[(cfg, im, depth, 'fwd_gain_max')]:.3g} / {get[(cfg, im, depth, 'bwd_gain_max')]:.3g}")
    return t
