"""The tables a command prints and ``report show`` prints again from the report's rows."""
from __future__ import annotations

from rich.markup import escape
from rich.table import Table
from rich.text import Text

from mhctool.core.text import fmt as _fmt
from mhctool.core.text import short_impl


def _short_impl(name: str) -> str:
    """:func:`short_impl`, its brackets kept (``triton[module]``, ``te:...[tf32]``: not rich's markup)."""
    return escape(short_impl(name))


def verdict_table(vs: list[dict], top: int, title: str) -> Table:
    """Verdict rows (worst first) as a table, the first ``top`` of them."""
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


def bench_table(rows: list[dict], title: str) -> Table:
    """Bench rows as a table: one line per kernel, shape, direction and implementation."""
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
        said = Text.assemble(("FAILED ", "red"), note) if "error" in m else Text(note)
        t.add_row(k, *((shp,) if shapes else ()), d, _short_impl(i) + (" (graph)" if graphed else ""),
                  short_inputs(inputs), _fmt(g("time_ms")),
                  f"{_fmt(g('time_ms_p10'))}-{_fmt(g('time_ms_p90'))}" if g("time_ms") is not None else "-",
                  _fmt(g("gbps")), _fmt(g("pct_copy_bw")), _fmt(g("tflops")),
                  next((r["bound"] for r in m.values() if r.get("bound")), "-"), _fmt(host) + flag,
                  _fmt(g("speedup_vs_torch")), _fmt(g("speedup_vs_compile")),
                  _fmt(g("peak_bytes") / 2**20 if g("peak_bytes") is not None and g("peak_bytes") == g("peak_bytes") else None),
                  said)
    return t


def short_inputs(text: str | None) -> str:
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


def bench_totals(tots: list, paths: list, path_parts: tuple) -> list[Table]:
    """fwd + bwd per kernel and implementation (``tots``: timing.totals), and the whole mHC path
    per implementation (``paths``: timing.whole_path, made of ``path_parts``), where both
    directions were timed."""
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
    if not paths:
        return [a]
    b = Table(title="the whole mHC path, fwd + bwd, ms (projection: proj_rms, or the mapping where there is no "
                    "proj_rms; a library's fastest variant per kernel)")
    for c in ("implementation", *(("shape",) if shapes else ()), *path_parts, "total ms", "% copy"):
        b.add_column(c)
    for p in sorted(paths, key=lambda p: (p.shape, p.ms)):
        b.add_row(label(p.name, p.graph), *((p.shape,) if shapes else ()),
                  *(_fmt(p.parts[s].ms) + ("" if p.parts[s].impl == p.name else f" {_short_impl(p.parts[s].impl)}")
                    for s in path_parts),
                  _fmt(p.ms), _fmt(p.pct_copy_bw))
    return [a, b]


def _by_run(rows: list[dict]) -> dict:
    """Step rows grouped by (variant, point), then (entry, direction) -> metric -> row."""
    by: dict = {}
    for r in rows:
        by.setdefault((r["variant"], r["point"]), {}).setdefault((r["entry"], r["direction"]), {})[r["metric"]] = r
    return by


def _point(text: str) -> str:
    import json
    p = json.loads(text or "{}")
    return " ".join(f"{k}={v}" for k, v in p.items()) or "-"


def step_table(rows: list[dict], title: str) -> Table:
    """``bench --engine``'s rows: one line per variant and sweep point, the step's time, its
    overhead over the baseline, and how much of it is spent inside the mHC entry points."""
    t = Table(title=title)
    by = _by_run(rows)
    points = len({p for _, p in by}) > 1
    for c in ("variant", *(("point",) if points else ()), "step ms", "p10-p90", "tokens/s", "overhead",
              "in entry points ms", "share", "elsewhere ms", "peak GiB", "note"):
        t.add_column(c)
    for (variant, point), parts in by.items():
        m = parts.get(("*", "*"), {})
        g = lambda name: m.get(name, {}).get("value")  # noqa: E731
        note = next((r["message"] for r in m.values() if r.get("message")), "") or ""
        said = Text.assemble(("FAILED ", "red"), note) if "error" in m else Text(note)
        ov = g("overhead")
        t.add_row(_short_impl(variant), *((_point(point),) if points else ()), _fmt(g("step_ms")),
                  f"{_fmt(g('step_ms_p10'))}-{_fmt(g('step_ms_p90'))}" if g("step_ms") is not None else "-",
                  _fmt(g("tokens_per_s")), "-" if ov is None else f"{100 * ov:+.1f}%", _fmt(g("mhc_ms")),
                  "-" if g("mhc_share") is None else f"{100 * g('mhc_share'):.1f}%", _fmt(g("elsewhere_ms")),
                  _fmt(g("peak_bytes") / 2**30 if g("peak_bytes") is not None else None), said)
    return t


def step_attribution_table(rows: list[dict], title: str) -> Table | None:
    """Where each variant's overhead over the baseline goes: per part of the module (its entry
    points and other ops, all directions), milliseconds a step and share of the overhead; the
    kernels outside the module and the device's idle time, each against the baseline's; their
    sum, the overhead; and the byte floor at the copy rate. None where nothing was attributed."""
    from mhctool.analyses.train.step_bench import OPS
    by = _by_run(rows)
    runs = [(v, p) for (v, p), parts in by.items() if "outside_ms" in parts.get(("*", "*"), {})]
    if not runs:
        return None
    points = len({p for _, p in runs}) > 1
    t = Table(title=title)
    t.add_column("part")
    for v, p in runs:
        t.add_column(_short_impl(v) + (f" {_point(p)}" if points else "") + " ms (share)")

    def whole(run, name):
        return by[run].get(("*", "*"), {}).get(name, {}).get("value")

    def part(run, op):
        vals = [m["entry_ms"]["value"] for (e, _), m in by[run].items() if e == op and "entry_ms" in m]
        return sum(vals) if vals else None
    ops = {e for run in runs for (e, _), m in by[run].items() if e != "*" and "entry_ms" in m}
    order = sorted(ops, key=lambda e: -max(part(run, e) or 0.0 for run in runs))
    lines = [(escape(OPS.get(e, e)), [part(run, e) for run in runs]) for e in order]  # "[module]" is no markup
    lines += [("kernels outside the module (against the baseline's)", [whole(run, "outside_ms") for run in runs]),
              ("device idle (against the baseline's)", [whole(run, "idle_ms") for run in runs]),
              ("= the overhead", [whole(run, "overhead_ms") for run in runs])]
    for label, vals in lines:
        t.add_row(label, *("-" if v is None else f"{_fmt(v)} ({100 * v / o:.0f}%)" if (o := whole(run, "overhead_ms"))
                           else _fmt(v) for v, run in zip(vals, runs)))
    t.add_row("byte floor at the copy rate", *("-" if whole(run, "floor_ms") is None else _fmt(whole(run, "floor_ms"))
                                               for run in runs))
    return t


def step_split_table(rows: list[dict], title: str) -> Table | None:
    """Where the time inside the entry points goes: per entry point and direction, each variant's
    milliseconds a step and share of its step, with the kernel's own bench figure beside where
    there is one, and on a GPU the device's gaps ended by its launches (where the host was late;
    the profiled step's, which the profiler widens), the gaps before other kernels in a last row;
    None where no entry point was timed."""
    by = _by_run(rows)
    runs = [(v, p) for (v, p), parts in by.items() if any(e != "*" for e, _ in parts)]
    if not runs:
        return None
    points = len({p for _, p in runs}) > 1
    t = Table(title=title)
    t.add_column("entry point")
    t.add_column("dir")
    for v, p in runs:
        t.add_column(_short_impl(v) + (f" {_point(p)}" if points else "") + " ms (share; alone)")
    keys = sorted({k for run in runs for k in by[run] if k[0] != "*"},
                  key=lambda k: (k[0], ("fwd", "bwd", "recompute").index(k[1]) if k[1] in ("fwd", "bwd", "recompute")
                                 else 9))
    for key in keys:
        cells = []
        for run in runs:
            m = by[run].get(key, {})
            ms, share, alone = (m.get(x, {}).get("value") for x in ("entry_ms", "entry_share", "kernel_ms"))
            cell = "-" if ms is None else f"{_fmt(ms)} ({100 * share:.1f}%)"
            if alone is not None:
                cell += f"; {_fmt(alone)} x {_fmt(m.get('calls', {}).get('value'))}"
            if (gap := m.get("gap_before_ms", {}).get("value")) is not None:
                cell += f"; waited {_fmt(gap)}"
            cells.append(cell)
        t.add_row(key[0], key[1], *cells)
    gaps = [by[run].get(("*", "*"), {}).get("gap_ms", {}).get("value") for run in runs]
    if any(g is not None for g in gaps):
        inside = [sum(m["gap_before_ms"]["value"] for k, m in by[run].items() if k[0] != "*" and "gap_before_ms" in m)
                  for run in runs]
        t.add_row("device waited before other kernels", "",
                  *("-" if g is None else f"{_fmt(g - i)} of {_fmt(g)} (profiled)" for g, i in zip(gaps, inside)))
    return t
