"""``mhctool bench``: its options and tables (the timing is :mod:`mhctool.analyses.timing`)."""
from __future__ import annotations

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

from mhctool.cli import kit as clikit
from mhctool.cli.kit import device as _device
from mhctool.cli.kit import err, out, parse_dtype
from mhctool.cli.kit import fmt as _fmt
from mhctool.cli.kit import guard as _guard
from mhctool.cli.kit import short_impl as _short_impl
from mhctool.cli.kit import split as _split
from mhctool.core import names
from mhctool.core.errors import UsageError, system_exit_message


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
    from mhctool.core import environment, report
    from mhctool.core.shapes import (
        MOE_PAPER_SHAPE,
        PAPER_SHAPE,
        MoeShape,
        parse_shape_for,
    )

    report.check_writable(out_path)
    if plot is not None:
        report.check_writable(plot, "--plot", suffixes=(".png",))
    dev = _device(device)
    fmt = parse_dtype(dtype)
    if input_dtypes not in ("library", "contract"):
        raise UsageError(f"unknown --input-dtypes {input_dtypes!r}; accepted: library, contract")
    contract = input_dtypes == "contract"
    from mhctool.analyses import parity as parity_mod
    kernels = parity_mod.kernels_of(_split([kernel]))
    from mhctool.families import get_family
    kinds = {get_family(k).shape_kind for k in kernels}
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
    from mhctool.registry.specs import is_function_spec, resolve_impls
    if any(is_function_spec(s) for s in specs) and len(kernels) != 1:
        raise UsageError("an external --impl module:function needs one --kernel, not all")
    from mhctool.registry.builtin import impls_for
    resolved = {k: resolve_impls(k, specs) if specs else impls_for(k) for k in kernels}
    from mhctool.analyses import timing as bench_mod
    targets = [SimpleNamespace(kernel=k, device=dev, dtype=bench_mod.bench_dtype(k, fmt.name)) for k in kernels]
    from mhctool.runner.case import check_runnable
    if specs:  # as in parity: skipped where it cannot run, an error only where it runs nothing
        check_runnable(resolved, targets)
    plan = []
    for t in targets:
        shapes = moe_shapes if get_family(t.kernel).shape_kind == "moe" else [mhc_shape]
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
    iso = clikit.isolation_for(isolate, specs, dev, case_timeout, None, interrupts)
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
        from mhctool.views.plots import bench_figure
        out.print(f"plot: {bench_figure(table, plot, copy_bw)}")
    out.print(f"report {path}")
    if interrupts.requested:
        out.print("[yellow]INTERRUPTED[/]: the report holds what was timed before the stop")
        raise typer.Exit(130)


def _bench_one(bench_mod, iso, k, i, shp, dtype, dev, repeats, d, g, l2, contract=False) -> tuple:
    """One timed (kernel, implementation, direction): in-process, or in an isolation worker; a
    kernel that fails, crashes or hangs is reported and the others are still timed."""
    from mhctool.runner.call import short_error
    if iso is None or i.native:
        try:
            return ("ok", k, i, d, bench_mod.measure(k, i, shp, dtype, dev, repeats, d, g, l2, 0, contract), shp, g)
        except SystemExit as e:
            return ("skip", k, i, d, f"failed: {system_exit_message(e)}", shp, g)
        except Exception as e:  # a kernel that fails to run is reported, the rest still run
            return ("skip", k, i, d, f"failed: {short_error(e)}", shp, g)
    value, failure = iso.call(i, "mhctool.analyses.timing:isolated_measure",
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
