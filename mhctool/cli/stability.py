"""``mhctool stability``: sinkhorn (sweep), eps (one knob changed), overflow (headroom), gain (depth)."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer
from rich.progress import Progress, TextColumn
from rich.table import Table

from mhctool.cli.kit import device as parse_device
from mhctool.cli.kit import err, fmt, guard, out, parse_dtype, split
from mhctool.core.errors import UsageError

if TYPE_CHECKING:
    from mhctool.registry.impl import Impl



def typed_value(kind, name, value):
    from mhctool.analyses.knob_shift import typed_value as typed
    return typed(kind, name, value)



stability_app = typer.Typer(no_args_is_help=True, help="Where and why a computation breaks: sweeps and analyses.")

_IMPL_HELP = "Implementations (built-in name or module:function); repeat or comma-separate."


def _impls(kernel: str, specs: list[str], default: str) -> list[Impl]:
    """``specs`` resolved and usable here; without specs, the native one (``default="native"``) or
    every available built-in one (``default="all"``)."""
    from mhctool.registry.specs import resolve_impls
    if specs:
        impls = resolve_impls(kernel, specs)
        for i in impls:
            if why := i.unavailable():
                raise UsageError(f"--impl {i.name} cannot run here: {why}")
        return impls
    from mhctool.registry.builtin import impls_for, native_impl
    if default == "native":
        return [native_impl(kernel)]
    return [i for i in impls_for(kernel) if i.default and not i.unavailable()]


def _dtypes(values: list[str], default: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(parse_dtype(v).name for v in values) if values else default


def _progress(quiet: bool):
    return Progress(TextColumn("{task.description}"), console=err, transient=True,
                    disable=quiet or not err.is_terminal)


def _write(rows, kind: str, run: dict, schema, out_path: Path) -> "tuple":
    from mhctool.core import environment, report
    table = report.to_table(rows, report.new_run_id(), kind, environment.metadata(), run, schema=schema)
    return table, report.write_atomic(table, out_path)


@stability_app.command("sinkhorn")
@guard
def stability_sinkhorn(
    impl: Optional[list[str]] = typer.Option(None, "--impl", "-i", help=_IMPL_HELP + " Default: every available built-in one."),
    quick: bool = typer.Option(False, "--quick", help="A CPU-sized sweep (under a minute)."),
    scales: Optional[str] = typer.Option(None, "--scales", help="Logit amplitudes LO:HI[:POINTS], log-spaced (default 0.1:1000 plus points near the overflows)."),
    iters: Optional[list[str]] = typer.Option(None, "--iters", help="Iteration counts (1 to 10000), e.g. 1,5,20,100."),
    family: Optional[list[str]] = typer.Option(None, "--family", "-f", help="Input families (default: random, near_perm, dead_rows_cols)."),
    dtype: Optional[list[str]] = typer.Option(None, "--dtype", help="fp32, bf16, fp16 (default: all three)."),
    device: Optional[str] = typer.Option(None, "--device", help="cpu or cuda (default: cuda when present)."),
    out_path: Path = typer.Option(Path("mhctool-stability.parquet"), "--out", "-o", help="Parquet report to write."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Folder for PNG plots."),
    quiet: bool = typer.Option(False, "--quiet", "-q"),
):
    """Sweep logit amplitude, family, dtype, stabilize, eps, eps_mode, order and iterations."""
    from mhctool.core import report
    report.check_writable(out_path)
    if plot:
        report.check_folder(plot)
    dev = parse_device(device)
    from mhctool.analyses import stability as st
    spec = st.quick_spec() if quick else st.full_spec()
    if scales:
        spec = dataclasses.replace(spec, scales=st.parse_range(scales, "--scales"))
    if iters:
        spec = dataclasses.replace(spec, iters=st.parse_iters(split(iters)))
    from mhctool.families import input_family
    if family:
        fams = split(family)
        for f in fams:
            input_family("sinkhorn", f)
        spec = dataclasses.replace(spec, families=tuple(fams))
    spec = dataclasses.replace(spec, dtypes=_dtypes(split(dtype), spec.dtypes))
    specs = split(impl)
    impls = _impls("sinkhorn", specs, "all")
    if quick and not specs:
        impls = [i for i in impls if i.native]  # the interpreter is too slow for a one-minute sweep
    with _progress(quiet) as bar:
        task = bar.add_task("stability")
        rows = st.sinkhorn_sweep(impls, spec, dev, lambda d: bar.update(task, description=d))
    table, path = _write(rows, "stability", {"command": "stability sinkhorn", "quick": quick, "device": dev,
                                             "impls": [i.name for i in impls], "converged_iters": st.CONVERGED_ITERS},
                         report.STABILITY_SCHEMA, out_path)
    t = Table(title="first logit amplitude with a non-finite output (at the most iterations swept)")
    for c in ("impl", "family", "dtype", "stabilize", "eps", "first non-finite", "dtype exp overflow"):
        t.add_column(c)
    top = max(spec.iters)
    for f in st.first_nonfinite(rows):
        if f["iters"] != top or f["eps_mode"] != "add" or f["order"] != "row_first":
            continue
        t.add_row(f["impl"], f["family"], f["dtype"], f["stabilize"], f"{f['eps']:g}",
                  fmt(f["first_nonfinite_scale"]) if f["first_nonfinite_scale"] else "[green]finite[/]",
                  f"{st.OVERFLOW_LOGIT[f['dtype']]:.4g}")
    if not quiet:
        out.print(t)
    if plot:
        from mhctool.views.plots import stability_figures
        for png in stability_figures(table, plot, {d: st.OVERFLOW_LOGIT[d] for d in spec.dtypes}):
            out.print(f"plot: {png}")
    out.print(f"report {path} ({len(rows)} rows)")


@stability_app.command("eps")
@guard
def stability_eps(
    kernel: str = typer.Option(..., "--kernel", "-k", help="sinkhorn, proj_rms, mapping or h_post_bda."),
    frm: Optional[str] = typer.Option(None, "--from", help="eps before the change (e.g. 1e-6)."),
    to: Optional[str] = typer.Option(None, "--to", help="eps after the change (e.g. 1e-8)."),
    knob: Optional[str] = typer.Option(None, "--knob", help="Any knob instead: NAME=A,B (e.g. order=row_first,col_first)."),
    family: Optional[list[str]] = typer.Option(None, "--family", "-f", help="Input families (default: all of the kernel's)."),
    dtype: Optional[list[str]] = typer.Option(None, "--dtype", help="Output dtypes to judge the shift in (default fp32,bf16)."),
    impl: Optional[list[str]] = typer.Option(None, "--impl", "-i", help=_IMPL_HELP + " Default: the native one."),
    depth: int = typer.Option(12, "--depth", "-L", help="Layers in the mHC stack (the mHC test recipe has 12)."),
    seed: int = typer.Option(0, "--seed"),
    device: Optional[str] = typer.Option(None, "--device", help="cpu or cuda (default: cuda when present)."),
    out_path: Path = typer.Option(Path("mhctool-eps.parquet"), "--out", "-o", help="Parquet report to write."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Folder for PNG plots."),
    quiet: bool = typer.Option(False, "--quiet", "-q"),
):
    """What changing one knob (eps by default) does: per input family at the kernel, and through a stack of L layers."""
    from mhctool.core import report
    report.check_writable(out_path)
    if plot:
        report.check_folder(plot)
    from mhctool.families import get_family
    get_family(kernel)
    from mhctool.analyses import knob_shift as ks
    change = ks.parse_change(kernel, knob, frm, to)
    if not 1 <= depth <= 1000:
        raise UsageError(f"--depth {depth} is not a possible stack depth; give 1 to 1000 layers")
    dev = parse_device(device)
    fams = split(family) or list(ks.STACK_FAMILIES[kernel])
    for f in fams:
        if f not in ks.STACK_FAMILIES[kernel]:
            raise UsageError(f"unknown input family {f!r} for stability eps on {kernel}; accepted: "
                             + ", ".join(ks.STACK_FAMILIES[kernel]))
    dtypes = _dtypes(split(dtype), ("fp32", "bf16"))
    impls = _impls(kernel, split(impl), "native")
    rows = []
    with _progress(quiet) as bar:
        task = bar.add_task("eps")
        for f in fams:
            for dt in dtypes:
                for i in impls:
                    bar.update(task, description=f"{f} {dt} {i.name}")
                    if why := i.unsupported(dev, dt):
                        raise UsageError(f"--impl {i.name} cannot run {dt} on {dev}: {why}")
                    rows += ks.kernel_shift(change, i, f, dt, dev, seed)
                bar.update(task, description=f"{f} {dt} stack of {depth}")
                rows += ks.stack_shift(change, f, dt, depth, seed)
    common = dict(kernel=kernel, knob=change.knob, setting_a=repr(change.a), setting_b=repr(change.b))
    rows = [{**common, **r} for r in rows]
    table, path = _write(rows, "stability-eps", {"command": "stability eps", "device": dev, "depth": depth,
                                                 "impls": [i.name for i in impls], "change": change.label},
                         report.KNOB_SHIFT_SCHEMA, out_path)
    if not quiet:
        out.print(_eps_table(rows, change, depth))
    if plot:
        from mhctool.views.plots import knob_shift_figure
        out.print(f"plot: {knob_shift_figure(table, plot)}")
    out.print(f"report {path} ({len(rows)} rows)")


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
    kernel: str = typer.Option(..., "--kernel", "-k", help="sinkhorn, h_aggregate, h_post_bda, proj_rms or mapping."),
    family: str = typer.Option("random", "--family", "-f", help="Input family to scale."),
    scales: Optional[str] = typer.Option(None, "--scales", help="Input scales LO:HI[:POINTS] (default 0.1:1000 for Sinkhorn's logit amplitude, 0.1:1e21 otherwise)."),
    knob: Optional[list[str]] = typer.Option(None, "--knob", help="NAME=VALUE for the kernel's knobs (e.g. stabilize=none)."),
    dtype: Optional[list[str]] = typer.Option(None, "--dtype", help="Dtypes to judge headroom in (default fp32,bf16,fp16)."),
    impl: Optional[str] = typer.Option(None, "--impl", "-i", help="Implementation whose output finiteness is checked (default: the native one)."),
    quick: bool = typer.Option(False, "--quick", help="Fewer scales."),
    device: Optional[str] = typer.Option(None, "--device", help="cpu or cuda (default: cuda when present)."),
    out_path: Path = typer.Option(Path("mhctool-overflow.parquet"), "--out", "-o", help="Parquet report to write."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Folder for PNG plots."),
    quiet: bool = typer.Option(False, "--quiet", "-q"),
):
    """Headroom to the dtype's largest finite value of every intermediate as the input scale grows."""
    from mhctool.core import report
    report.check_writable(out_path)
    if plot:
        report.check_folder(plot)
    from mhctool.analyses import overflow as ov
    ov.check_kernel(kernel)
    from mhctool.families import get_family
    fam = get_family(kernel)
    from mhctool.families import input_family
    input_family(kernel, family)
    knobs = {k: v.default for k, v in fam.knobs.items() if v.passed}
    for item in split(knob):
        name, sep, value = item.partition("=")
        if not sep or name not in knobs:
            raise UsageError(f"--knob {item!r}: give NAME=VALUE with NAME one of {', '.join(knobs) or '(none)'}")
        knobs[name] = fam.knobs[name].check(kernel, name, typed_value(fam.knobs[name].kind, name, value))
    dev = parse_device(device)
    dtypes = _dtypes(split(dtype), ("fp32", "bf16", "fp16"))
    from mhctool.analyses import stability as st
    if scales:
        grid = st.parse_range(scales, "--scales")
    else:
        grid = ov.default_scales(kernel, 12 if quick else 45)
    (im,) = _impls(kernel, [impl] if impl else [], "native")
    with _progress(quiet) as bar:
        task = bar.add_task("overflow")
        rows = ov.sweep(kernel, im, family, dtypes, grid, knobs, dev,
                        progress=lambda d: bar.update(task, description=d))
    table, path = _write(rows, "stability-overflow", {"command": "stability overflow", "device": dev, "impl": im.name,
                                                      "knobs": knobs, "family": family},
                         report.OVERFLOW_SCHEMA, out_path)
    summ = ov.summary(rows)
    t = Table(title=f"{kernel} ({family}, {', '.join(f'{k}={v}' for k, v in knobs.items()) or 'no knobs'}): "
                    f"first input scale with no headroom left; output checked with {im.name}")
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
    t.add_row(f"{im.name} output non-finite", *[fmt(first_out.get(dt)) if first_out.get(dt) else "[green]-[/]" for dt in dtypes])
    if not quiet:
        out.print(t)
        if any(s["silent"] for s in summ):
            out.print("[red]silent[/]: the intermediate overflows the dtype at a scale where the output is still finite")
    if plot:
        from mhctool.views.plots import overflow_figure
        out.print(f"plot: {overflow_figure(table, plot)}")
    out.print(f"report {path} ({len(rows)} rows)")


@stability_app.command("gain")
@guard
def stability_gain(
    depth: int = typer.Option(64, "--depth", "-L", help="Layers to compose."),
    iters: Optional[list[str]] = typer.Option(None, "--iters", help="Sinkhorn iteration counts (default 1,3,5,20)."),
    hc_scale: float = typer.Option(0.3, "--hc-scale", help="HC baseline: H_res = I + hc_scale * tanh(logits)."),
    family: str = typer.Option("random", "--family", "-f", help="Sinkhorn input family for the per-layer logits."),
    tokens: int = typer.Option(256, "--tokens", help="Tokens (one H_res per token and layer)."),
    n: int = typer.Option(4, "--n", help="Residual streams."),
    impl: Optional[list[str]] = typer.Option(None, "--impl", "-i", help=_IMPL_HELP + " Default: the native one."),
    dtype: str = typer.Option("fp32", "--dtype", help="Dtype the implementation computes H_res in (the mapping path is fp32)."),
    seed: int = typer.Option(0, "--seed"),
    device: Optional[str] = typer.Option(None, "--device", help="cpu or cuda (default: cuda when present)."),
    out_path: Path = typer.Option(Path("mhctool-gain.parquet"), "--out", "-o", help="Parquet report to write."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Folder for PNG plots."),
    quiet: bool = typer.Option(False, "--quiet", "-q"),
):
    """Amax gain of the composite H_res over depth: Sinkhorn configurations against unconstrained HC."""
    from mhctool.core import report
    report.check_writable(out_path)
    if plot:
        report.check_folder(plot)
    if not 1 <= depth <= 10_000:
        raise UsageError(f"--depth {depth} is not a possible depth; give 1 to 10000 layers")
    if not 1 <= tokens <= 1 << 20 or not 2 <= n <= 16:
        raise UsageError(f"--tokens {tokens} / --n {n}: give 1 to 1048576 tokens and 2 to 16 streams")
    if not hc_scale > 0:
        raise UsageError(f"--hc-scale {hc_scale:g} must be positive")
    from mhctool.families import input_family
    input_family("sinkhorn", family)
    from mhctool.analyses import stability as st
    counts = st.parse_iters(split(iters)) if iters else (1, 3, 5, 20)
    dt = parse_dtype(dtype).name
    dev = parse_device(device)
    impls = _impls("sinkhorn", split(impl), "native")
    from mhctool.analyses import gain as gn
    layers = gn.layer_logits(family, depth, tokens, n, seed)
    rows = []
    for i in impls:
        if why := i.unsupported(dev, dt):
            raise UsageError(f"--impl {i.name} cannot run {dt} on {dev}: {why}")
        for it in counts:
            rows += [{**r, "impl": i.name, "dtype": dt}
                     for r in gn.composite_gain(gn.GainConfig("sinkhorn", it), layers, i, dt, dev)]
    rows += [{**r, "impl": "reference", "dtype": "fp64"}
             for r in gn.composite_gain(gn.GainConfig("hc", hc_scale=hc_scale), layers, None, "fp64", "cpu")]
    table, path = _write(rows, "stability-gain", {"command": "stability gain", "device": dev, "family": family,
                                                  "tokens": tokens, "n": n, "hc_scale": hc_scale},
                         report.GAIN_SCHEMA, out_path)
    marks = sorted({d for d in (1, 4, 16, 64, 256, depth) if d <= depth})
    t = Table(title=f"composite Amax gain, forward / backward (mean over {tokens} tokens; max in the last column)")
    for c in ("config", "impl", *[f"L={d}" for d in marks], f"max over tokens, L={depth}"):
        t.add_column(c)
    get = {(r["config"], r["impl"], r["depth"], r["metric"]): r["value"] for r in rows}
    for cfg, im in dict.fromkeys((r["config"], r["impl"]) for r in rows):
        t.add_row(cfg, im, *[f"{get[(cfg, im, d, 'fwd_gain')]:.3g} / {get[(cfg, im, d, 'bwd_gain')]:.3g}" for d in marks],
                  f"{get[(cfg, im, depth, 'fwd_gain_max')]:.3g} / {get[(cfg, im, depth, 'bwd_gain_max')]:.3g}")
    if not quiet:
        out.print(t)
    if plot:
        from mhctool.views.plots import gain_figure
        out.print(f"plot: {gain_figure(table, plot)}")
    out.print(f"report {path} ({len(rows)} rows)")
