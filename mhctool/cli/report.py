"""``mhctool report show|html|merge|compare``: reading reports.

What reads a report (pyarrow) is imported inside each command, so that ``--help`` and a usage
error answer at once."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from mhctool.cli.gate import show as show_gate
from mhctool.cli.console import guard, out
from mhctool.cli.tables import bench_table, bench_totals, verdict_table
from mhctool.core.errors import UsageError
from mhctool.core.text import fmt

report_app = typer.Typer(no_args_is_help=True, help="Read Parquet reports: show one, compare two.")


@report_app.command("show")
@guard
def report_show(
    path: Path = typer.Argument(..., help="A Parquet report written by mhctool."),
    top: int = typer.Option(30, "--top", min=1, help="Rows of the verdict table."),
    settings: bool = typer.Option(False, "--settings", help="Every run setting in full (by default a long one is "
                                                            "shortened to its name)."),
):
    """Summarise a report: its environment, settings, hints and worst verdicts."""
    from mhctool.core import report
    from mhctool.core.findings import verdicts, worst_first
    table, meta = report.read(path)
    env = meta["environment"]
    out.print(f"{path}: {meta['kind']} report, schema v{meta['schema_version']}, {table.num_rows} rows")
    out.print("environment: " + ", ".join(f"{k}={env.get(k)}" for k in
                                          ("mhctool", "torch", "triton", "cuda_tile", "gpu", "git_commit")))
    out.print(settings_line(meta["run"], settings), markup=False, highlight=False)
    for h in meta["run"].get("hints", []):  # what the run found to say, on lines of their own
        out.print(h if h.startswith("hint:") else f"hint: {h}", markup=False, highlight=False)
    if meta["run"].get("interrupted"):
        run = meta["run"]
        out.print(f"[yellow]interrupted[/]: {run['cases_run']} of {run['cases_planned']} cases were run before the run "
                  "was stopped" if run.get("cases_planned") is not None else
                  "[yellow]interrupted[/]: a signal stopped the run; the rows are what it measured before")
    if meta["kind"] == "parity":
        vs = worst_first(verdicts(table))
        out.print(verdict_table(vs, top, "verdicts (worst first)"))
        from mhctool.core.findings import tally
        p, f, s = tally(v["passed"] for v in vs)
        out.print(f"{p} passed, {f} failed, {s} skipped")
    elif meta["kind"] == "bench":  # the tables bench printed, from the rows
        from mhctool.analyses import timing as bench_mod
        rows = table.to_pylist()
        run = meta["run"]
        out.print(bench_table(rows, f"bench {run.get('shape')} {run.get('dtype')} on {run.get('device')}"))
        tots = bench_mod.totals(rows)
        for t in bench_totals(tots, bench_mod.whole_path(tots), bench_mod.PATH):
            out.print(t)
    elif meta["kind"] == "bench-step":  # the tables bench --engine printed, from the rows
        from mhctool.cli.tables import step_attribution_table, step_split_table, step_table
        rows = table.to_pylist()
        run = meta["run"]
        out.print(step_table(rows, f"bench --engine {run.get('engine')} on {run.get('device')}"))
        for t in (step_split_table(rows, "inside the mHC module, a step"),
                  step_attribution_table(rows, "where the overhead goes, a step (share of the overhead)")):
            if t is not None:
                out.print(t)
    else:
        _show_rows(meta["kind"], table.to_pylist(), top, meta["run"])


# a run setting longer than this is shortened to its name in ``report show`` (--settings: in full)
SETTING_CHARS = 60


def settings_line(run: dict, full: bool = False) -> str:
    """The ``run:`` line of ``report show``: each setting as ``key=value``; without ``full`` a value
    longer than :data:`SETTING_CHARS` is ``key=...`` and the hints (printed on lines of their
    own) are left out."""
    parts, cut = [], False
    for k, v in run.items():
        if k == "hints" and not full:
            continue
        text = str(v)
        if len(text) > SETTING_CHARS and not full:
            text, cut = "...", True
        parts.append(f"{k}={text}")
    return "run: " + ", ".join(parts) + (" (--settings: every one in full)" if cut else "")


def _show_rows(kind: str, rows: list[dict], top: int, run: dict | None = None) -> None:
    """``report show`` of the kinds whose rows are their verdicts: the failed ones first."""
    from mhctool.core.findings import rows_worst_first
    if kind == "gate":
        failed = [r for r in rows if r["passed"] is False]
        t = Table(title=f"gate: {len(failed)} of {len(rows)} checks failed (failures first)")
        for col in ("entry", "kind", "name", "verdict", "message"):
            t.add_column(col, overflow="fold")
        for r in rows_worst_first(rows)[:top]:
            t.add_row(r["entry"], r["kind"], _short(r["name"]), {True: "pass", False: "[red]FAIL[/]", None: "skip"}[r["passed"]],
                      r["message"] or "")
        out.print(t)
        p = sum(r["passed"] is True for r in rows)
        out.print(f"{p} passed, {len(failed)} failed, {len(rows) - p - len(failed)} skipped")
    elif kind == "identify":
        for r in rows:
            if r["best"] or r["stage"] == "error":
                out.print(f"{r['kernel']} {_short(r['impl'])}: best {r['candidate']} max_rel {fmt(r['max_rel'])} "
                          f"{'passes' if r['passed'] else 'fails'}; {r['classification'] or ''} {r['message'] or ''}",
                          markup=False)
        judged = [r for r in rows if r["stage"] == "judged"]
        out.print(f"{len(rows)} candidates tried, {len(judged)} judged, {sum(bool(r['passed']) for r in judged)} passed")
        claims = (run or {}).get("claims", [])
        for c in claims:  # what identify said, each sentence with the check that earned it
            if c["held"]:
                out.print(f"said: {c['text']}  [check: {c['check']}]", markup=False, highlight=False)
        unsaid = [c for c in claims if not c["held"]]
        if unsaid:
            out.print(f"{len(unsaid)} claim(s) not said, their check failed: "
                      + "; ".join(f"{c['kind']} ({c['check']})" for c in unsaid), markup=False, highlight=False)
    elif kind == "train":
        first = [r for r in rows if r["run"] == "first-step" and r["passed"] is not None]
        failed = [r for r in first if r["passed"] is False]
        if first:
            out.print(f"{'FAIL' if failed else 'ok'} first step: {len({r['metric'] for r in failed})} of "
                      f"{len(first)} tensor metrics fail parity's rule", markup=False)
        for r in failed[:top]:
            _, metric, tensor = (r["metric"].split(":", 2) + ["", ""])[:3]
            out.print(f"  {tensor}: {metric} {fmt(r['value'])} > {fmt(r['threshold'])} ({r['message']})", markup=False)
        for r in rows:
            if r["metric"].startswith(("drift:", "traced:")) or r["metric"] in ("nonfinite", "error", "zeros-finding"):
                verdict = {True: "ok", False: "FAIL", None: "-"}[r["passed"]]
                out.print(f"{verdict} {r['run']} {r['metric']}: {r['message']}", markup=False)
        runs = {}
        for r in rows:
            if r["metric"] == "lm loss":
                runs.setdefault((r["run"], r.get("seed")), []).append((r["step"], r["value"]))
        several = len({seed for _, seed in runs}) > 1
        for (run, seed), pts in runs.items():
            pts.sort()
            name = f"{run} seed {seed}" if several else run
            out.print(f"{name}: lm loss {pts[0][1]:.4f} -> {pts[-1][1]:.4f} over {len(pts)} steps", markup=False)
    elif kind == "stability":
        bad = [r for r in rows if r["metric"] == "nonfinite_rate" and r["value"]]
        out.print(f"{len(rows)} rows; {len(bad)} with non-finite outputs" + (
            ": first " + "; ".join(f"{r['impl']} {r['family']} {r['dtype']} scale {r['scale']:g} {r['stabilize']}"
                                   for r in bad[:top]) if bad else ""), markup=False)
    else:
        out.print(f"{len(rows)} rows (no summary for {kind} reports: read them with pyarrow, see the reports page)")


@report_app.command("html")
@guard
def report_html(
    path: Path = typer.Argument(..., help="A report written by mhctool (Parquet, or JSON from -o x.json)."),
    out_path: Optional[Path] = typer.Option(None, "--out", "-o", help="The page to write (default: the report's name with .html)."),
):
    """One self-contained HTML page from a report: the verdict, the rows that decided it (failures
    first), the hints, the figures inline; nothing beside it to copy, no network."""
    target = out_path or path.with_suffix(".html")
    from mhctool.core import report
    report.check_writable(target, suffixes=None)
    if target.resolve() == path.resolve():
        raise UsageError(f"--out {target} is the report read; name another file (default: {path.with_suffix('.html')})")
    from mhctool.views import html as html_mod
    page = html_mod.render(path)
    report.atomic(target, lambda tmp: Path(tmp).write_text(page))
    out.print(f"page {target}", markup=False)


@report_app.command("merge")
@guard
def report_merge(
    paths: list[Path] = typer.Argument(..., help="The reports of every slice of one run (parity or gate --shard I/N)."),
    out_path: Path = typer.Option(..., "--out", "-o", help="The merged Parquet report to write."),
    junit: Optional[Path] = typer.Option(None, "--junit", help="Gate slices: the JUnit XML of the merged run."),
    summary: Optional[Path] = typer.Option(None, "--summary", help="Gate slices: the Markdown summary of the merged run."),
    quiet: bool = typer.Option(False, "--quiet", "-q"),
):
    """Join the slices of a --shard run into the report one run would have written (exit 1 if a
    verdict in it failed)."""
    from mhctool.analyses.runs.report import merge_reports
    m = merge_reports(paths, out_path, junit, summary)
    if m.gate is not None:
        raise typer.Exit(show_gate(*m.gate[:3], quiet, m.gate[3]))
    p, f, s = m.counts
    status = "[red]FAILED[/]" if f else "[green]PASSED[/]"
    out.print(f"{status} {p} passed, {f} failed, {s} skipped  ({len(paths)} slices merged; report {m.report})")
    raise typer.Exit(1 if f else 0)


@report_app.command("compare")
@guard
def report_compare(
    before: Path = typer.Argument(..., help="The earlier report."),
    after: Path = typer.Argument(..., help="The later report."),
    tolerance: float = typer.Option(0.1, "--tolerance", min=0.0, help="Relative growth below which a value is not 'worse'."),
    top: int = typer.Option(30, "--top", min=1),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Also write the comparison as JSON here (what got worse, what either report has alone)."),
    junit: Optional[Path] = typer.Option(None, "--junit", help="Also write JUnit XML here: a failed test per verdict that flipped to fail, a passed one per row that grew, a skipped one per row only one report has."),
    summary: Optional[Path] = typer.Option(None, "--summary", help="Also write a Markdown summary here (and append it to $GITHUB_STEP_SUMMARY when set)."),
    pair: Optional[list[str]] = typer.Option(None, "--pair", help="OLD=NEW: the earlier report's rows of implementation OLD are compared with the later one's of NEW (a kernel and its renamed fixed version; names as report show prints them, e.g. mine.py:sinkhorn_eps8=mine.py:sinkhorn). Repeat for several."),
):
    """What got worse from BEFORE to AFTER, and by how much, for reports of one kind (parity, gate,
    identify, stability, train, bench); rows either has alone are counted and listed. Exit 1 if a
    verdict flipped to fail or more than a tenth of the earlier report's rows have no match in the
    later one (not compared, so not passed), 2 for reports that cannot be compared or share no row."""
    from mhctool.analyses.runs.report import CompareRequest, compare_reports
    c = compare_reports(CompareRequest(before, after, tolerance, json_path, junit, summary, pair or []))
    r = c.result
    if r.worse:
        t = Table(title=f"{c.kind}: {len(r.worse)} rows worse, {len(c.flipped)} now failing")
        for col in (*c.keys, "before", "after", "x", "verdict"):
            t.add_column(col, overflow="fold")
        for w in r.worse[:top]:
            verdict = "[red]pass->FAIL[/]" if w in c.flipped else str(w["passed_after"])
            t.add_row(*(fmt(w["key"][k]) if not isinstance(w["key"][k], str) else _short(w["key"][k]) for k in c.keys),
                      fmt(w["before"]), fmt(w["after"]), fmt(w["ratio"]), verdict)
        out.print(t)
    else:
        out.print(f"nothing got worse (tolerance {tolerance:g}) across the {r.matched} rows both {c.kind} reports have")
    for side, rows in (("earlier", r.only_before), ("later", r.only_after)):
        if rows:
            out.print(f"{len(rows)} rows only in the {side} report, not compared; "
                      "first: " + "; ".join("/".join(str(v) for v in k if v is not None) for k in rows[:3]),
                      markup=False)
    from mhctool.core.combine import UNMATCHED_SHARE
    if c.unmatched > UNMATCHED_SHARE:
        out.print(f"[red]FAILED[/]: {len(r.only_before)} of the earlier report's {r.matched + len(r.only_before)} rows "
                  f"({c.unmatched:.0%}, more than {UNMATCHED_SHARE:.0%}) have no match in the later one: not compared, "
                  "so not passed (a renamed implementation: --pair OLD=NEW)")
    raise typer.Exit(c.exit_code)


def _short(text: str) -> str:
    """Paths in a cell reduced to their file name (the report keeps them whole)."""
    from mhctool.core.combine import stable
    return stable(text)
