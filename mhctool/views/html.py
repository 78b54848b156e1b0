"""``mhctool report html``: one self-contained page from a report (no network, no files beside it):
what ran where, the verdict, the rows that decided it (failures first), the hints the command
printed, and the report's figures as inline PNGs."""
from __future__ import annotations

import base64
import html
import json
import tempfile
from pathlib import Path

import pyarrow as pa

from mhctool.analyses.stability import OVERFLOW_LOGIT
from mhctool.core import report
from mhctool.core.combine import stable
from mhctool.core.findings import rows_worst_first, verdicts, worst_first
from mhctool.views import plots

_STYLE = """
body{font:14px/1.45 system-ui,sans-serif;margin:2em auto;max-width:1200px;padding:0 1em;color:#222}
h1{font-size:1.4em} h2{font-size:1.15em;margin-top:1.6em}
table{border-collapse:collapse;font-size:12px;margin:.5em 0}
td,th{border:1px solid #ccc;padding:2px 6px;text-align:left;vertical-align:top}
th{background:#f3f3f3} tr.fail td{background:#fde8e8} .ok{color:#1a7f37} .bad{color:#c62828;font-weight:600}
dl{display:grid;grid-template-columns:max-content auto;gap:0 1em;font-size:12px} dt{font-weight:600}
img{max-width:100%;border:1px solid #eee;margin:.5em 0} code{background:#f6f6f6;padding:0 3px}
"""
_ROWS_CAP = 500  # rows of the table shown; the page says how many more the report has


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return html.escape(stable("" if value is None else str(value)))


def _table(rows: list[dict], columns: list[str]) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = []
    for r in rows:
        cls = ' class="fail"' if r.get("passed") is False else ""
        body.append(f"<tr{cls}>" + "".join(f"<td>{_cell(r.get(c))}</td>" for c in columns) + "</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def _rows_for(kind: str, table: pa.Table) -> tuple[list[dict], list[str]]:
    """The rows a reader wants first, and the columns to show: a parity report's verdicts (the
    worst row of each), another kind's rows with a verdict (else every row), failures first."""
    if kind == "parity":
        vs = worst_first(verdicts(table))
        rows = [{k: v[k] for k in ("kernel", "impl", "family", "dtype", "shape", "knobs", "direction", "passed",
                                   "message")}
                | ({k: v["worst"][k] for k in ("tensor", "metric", "value", "threshold", "rule")} if v["worst"] else {})
                for v in vs]
        return rows, ["kernel", "impl", "family", "dtype", "shape", "knobs", "direction", "passed", "tensor",
                      "metric", "value", "threshold", "rule", "message"]
    rows = table.to_pylist()
    columns = [c for c in table.column_names if c != "run_id"]
    if kind == "bench":
        rows = [r for r in rows if r["metric"] in ("time_ms", "pct_copy_bw", "speedup_vs_torch") or r["message"]]
    elif kind == "bench-step":
        rows = [r for r in rows if r["metric"] in ("step_ms", "overhead", "mhc_ms", "entry_ms", "kernel_ms")
                or r["message"]]
    elif "passed" in columns and any(r["passed"] is not None for r in rows):
        rows = rows_worst_first([r for r in rows if r["passed"] is not None or r.get("message")])
    return rows, columns


def _figures(kind: str, table: pa.Table, run: dict, folder: Path) -> list[Path]:
    """The figures the report's own command draws with ``--plot``, into ``folder``."""
    if kind == "parity":
        return plots.parity_figures(table, folder)
    if kind == "bench" and run.get("copy_bandwidth_Bps"):
        return [plots.bench_figure(table, folder / "bench.png", float(run["copy_bandwidth_Bps"]))]
    if kind == "train":
        return plots.train_figures(table, folder)
    if kind == "bench-step":
        return [plots.step_figure(table, folder / "step.png")]
    if kind == "stability":
        dtypes = set(table.column("dtype").to_pylist())
        return plots.stability_figures(table, folder, {d: x for d, x in OVERFLOW_LOGIT.items() if d in dtypes})
    if kind == "stability-eps":
        return [plots.knob_shift_figure(table, folder)]
    if kind == "stability-overflow":
        return [plots.overflow_figure(table, folder)]
    if kind == "stability-gain":
        return [plots.gain_figure(table, folder)]
    return []


def render(path: str | Path) -> str:
    """The page for the report at ``path`` (Parquet or JSON)."""
    table, meta = report.read(path)
    kind, run, env = meta["kind"], meta["run"], meta["environment"]
    s = report.summary(table, kind)
    verdict = (f'<span class="{"ok" if s["ok"] else "bad"}">{"PASSED" if s["ok"] else "FAILED"}</span> '
               f'{s["passed"]} passed, {s["failed"]} failed, {s["skipped"]} skipped') \
        if s["passed"] + s["failed"] + s["skipped"] else f"{table.num_rows} rows"
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>mhctool {html.escape(kind)} report"
             f"</title><style>{_STYLE}</style></head><body>",
             f"<h1>mhctool {html.escape(kind)} report: {verdict}</h1>",
             f"<p>{html.escape(Path(path).name)}, schema v{meta['schema_version']}, {table.num_rows} rows</p>"]
    if run.get("interrupted"):
        parts.append(f"<p class='bad'>interrupted: {run.get('cases_run')} of {run.get('cases_planned')} cases ran</p>")
    hints = run.get("hints") or []
    if hints:
        parts.append("<h2>Hints</h2><ul>" + "".join(f"<li><code>{html.escape(h)}</code></li>" for h in hints)
                     + "</ul>")
    rows, columns = _rows_for(kind, table)
    more = len(rows) - _ROWS_CAP
    parts.append(f"<h2>{'Verdicts' if kind == 'parity' else 'Rows'} (failures first)</h2>"
                 + _table(rows[:_ROWS_CAP], columns)
                 + (f"<p>{more} more rows in the report (mhctool report show, or pyarrow)</p>" if more > 0 else ""))
    with tempfile.TemporaryDirectory(prefix="mhctool-html-") as folder:
        try:
            figures = _figures(kind, table, run, Path(folder))
        except (ValueError, KeyError, TypeError) as e:  # rows a figure cannot be drawn from: said on the page
            figures = []
            parts.append(f"<h2>Figures</h2><p class='bad'>not drawn: {html.escape(f'{type(e).__name__}: {e}')}</p>")
        if figures:
            parts.append("<h2>Figures</h2>")
        for png in figures:
            data = base64.b64encode(png.read_bytes()).decode()
            parts.append(f"<p>{html.escape(png.name)}</p><img alt='{html.escape(png.name)}' "
                         f"src='data:image/png;base64,{data}'>")
    parts.append("<h2>Environment and run</h2><dl>"
                 + "".join(f"<dt>{html.escape(str(k))}</dt><dd>{_cell(v if not isinstance(v, (dict, list)) else json.dumps(v))}</dd>"
                           for k, v in {**env, **{f"run.{k}": v for k, v in run.items()}}.items())
                 + "</dl></body></html>")
    return "\n".join(parts)
