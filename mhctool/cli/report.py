"""``mhctool report show|html|merge|compare``: reading reports."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from mhctool.cli import kit as clikit
from mhctool.cli.gate import show as show_gate
from mhctool.cli.kit import fmt as _fmt
from mhctool.cli.kit import guard as _guard
from mhctool.cli.kit import out
from mhctool.cli.tables import bench_table, bench_totals, verdict_table
from mhctool.core.findings import tally
from mhctool.core.errors import UsageError

report_app = typer.Typer(no_args_is_help=True, help="Read Parquet reports: show one, compare two.")


@report_app.command("show")
@_guard
def report_show(
    path: Path = typer.Argument(..., help="A Parquet report written by mhctool."),
    top: int = typer.Option(30, "--top", min=1, help="Rows of the verdict table."),
):
    """Summarise a report: its environment, settings and worst verdicts."""
    from mhctool.core import report
    from mhctool.core.findings import verdicts, worst_first
    table, meta = report.read(path)
    env = meta["environment"]
    out.print(f"{path}: {meta['kind']} report, schema v{meta['schema_version']}, {table.num_rows} rows")
    out.print("environment: " + ", ".join(f"{k}={env.get(k)}" for k in
                                          ("mhctool", "torch", "triton", "cuda_tile", "gpu", "git_commit")))
    out.print("run: " + ", ".join(f"{k}={v}" for k, v in meta["run"].items()))
    if meta["run"].get("interrupted"):
        out.print(f"[yellow]interrupted[/]: {meta['run'].get('cases_run')} of {meta['run'].get('cases_planned')} "
                  "cases were run before the run was stopped")
    if meta["kind"] == "parity":
        vs = worst_first(verdicts(table))
        out.print(verdict_table(vs, top, "verdicts (worst first)"))
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
    else:
        _show_rows(meta["kind"], table.to_pylist(), top)


def _show_rows(kind: str, rows: list[dict], top: int) -> None:
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
                out.print(f"{r['kernel']} {_short(r['impl'])}: best {r['candidate']} max_rel {_fmt(r['max_rel'])} "
                          f"{'passes' if r['passed'] else 'fails'}; {r['classification'] or ''} {r['message'] or ''}",
                          markup=False)
        judged = [r for r in rows if r["stage"] == "judged"]
        out.print(f"{len(rows)} candidates tried, {len(judged)} judged, {sum(bool(r['passed']) for r in judged)} passed")
    elif kind == "train":
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
@_guard
def report_html(
    path: Path = typer.Argument(..., help="A report written by mhctool (Parquet, or JSON from -o x.json)."),
    out_path: Optional[Path] = typer.Option(None, "--out", "-o", help="The page to write (default: the report's name with .html)."),
):
    """One self-contained HTML page from a report: the verdict, the rows that decided it (failures
    first), the hints, the figures inline; nothing beside it to copy, no network."""
    target = out_path or path.with_suffix(".html")
    from mhctool.core import report
    report.check_writable(target, suffixes=None)
    from mhctool.views import html as html_mod
    page = html_mod.render(path)
    report.atomic(target, lambda tmp: Path(tmp).write_text(page))
    out.print(f"page {target}", markup=False)


@report_app.command("merge")
@_guard
def report_merge(
    paths: list[Path] = typer.Argument(..., help="The reports of every slice of one run (parity or gate --shard I/N)."),
    out_path: Path = typer.Option(..., "--out", "-o", help="The merged Parquet report to write."),
    junit: Optional[Path] = typer.Option(None, "--junit", help="Gate slices: the JUnit XML of the merged run."),
    summary: Optional[Path] = typer.Option(None, "--summary", help="Gate slices: the Markdown summary of the merged run."),
    quiet: bool = typer.Option(False, "--quiet", "-q"),
):
    """Join the slices of a --shard run into the report one run would have written (exit 1 if a
    verdict in it failed)."""
    from mhctool.core import report
    from mhctool.core.combine import merge
    from mhctool.core.findings import verdicts
    report.check_writable(out_path)
    table = merge(paths)
    _, meta = report.read(paths[0])
    if meta["kind"] != "gate" and (junit or summary):
        raise UsageError("--junit and --summary are for gate slices; these are parity reports")
    if meta["kind"] == "gate":
        from mhctool.analyses import gate as gate_mod
        cases = gate_mod.cases_from_rows(table.to_pylist())
        name = meta["run"].get("suite_name") or (cases[0].suite_item if cases else "gate")
        interrupted = json.loads(table.schema.metadata[b"mhctool.run"]).get("interrupted", False)
        from mhctool.analyses.runs.gate import write_outputs
        paths = (out_path, junit or out_path.with_suffix(".xml"), summary or out_path.with_suffix(".md"))
        write_outputs(table, name, cases, *paths)
        raise typer.Exit(show_gate(name, cases, paths, quiet, interrupted))
    path = report.write_atomic(table, out_path)
    vs = verdicts(table)
    p, f, s = tally(v["passed"] for v in vs)
    status = "[red]FAILED[/]" if f else "[green]PASSED[/]"
    out.print(f"{status} {p} passed, {f} failed, {s} skipped  ({len(paths)} slices merged; report {path})")
    raise typer.Exit(1 if f else 0)


@report_app.command("compare")
@_guard
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
    from mhctool.core import report
    from mhctool.core.combine import COMPARE_KEYS, compare
    for path_, what in ((json_path, "--json"), (junit, "--junit"), (summary, "--summary")):
        if path_ is not None:
            report.check_writable(path_, what, suffixes=None)
    a, ma = report.read(before)
    b, mb = report.read(after)
    kind = ma["kind"]
    if kind != mb["kind"]:
        raise UsageError(f"{before} is a {kind} report and {after} a {mb['kind']} report; report compare "
                         "compares two reports of one kind")
    if kind not in COMPARE_KEYS:
        raise UsageError(f"report compare does not compare {kind} reports; it compares "
                         + ", ".join(COMPARE_KEYS))
    pairs = {}
    for item in pair or []:
        old, sep, new = item.partition("=")
        if not sep or not old.strip() or not new.strip():
            raise UsageError(f"malformed --pair {item!r}; expected OLD=NEW (two implementation names)")
        pairs[old.strip()] = new.strip()
    c = compare(a, b, tolerance, kind, pairs)
    from mhctool.core.combine import UNMATCHED_SHARE
    if c.matched == 0 and (c.only_before or c.only_after):
        raise UsageError(f"{before} and {after} share no row ({len(c.only_before)} and {len(c.only_after)} rows): "
                         "nothing was compared; pair a renamed implementation with --pair OLD=NEW")
    unmatched = len(c.only_before) / max(1, c.matched + len(c.only_before))
    flipped = [w for w in c.worse if w["passed_before"] is True and w["passed_after"] is False]
    if json_path is not None:
        payload = {"kind": kind, "before": str(before), "after": str(after), "tolerance": tolerance,
                   "matched": c.matched, "worse": c.worse, "flipped": len(flipped), "pairs": pairs,
                   "unmatched_earlier_share": unmatched,
                   "only_before": [list(k) for k in c.only_before], "only_after": [list(k) for k in c.only_after]}
        report.atomic(json_path, lambda tmp: Path(tmp).write_text(json.dumps(payload, indent=2, default=str)))
    keys = COMPARE_KEYS[kind]
    if junit is not None or summary is not None:
        _compare_outputs(c, kind, keys, before, after, tolerance, junit, summary)
    if c.worse:
        t = Table(title=f"{kind}: {len(c.worse)} rows worse, {len(flipped)} now failing")
        for col in (*keys, "before", "after", "x", "verdict"):
            t.add_column(col, overflow="fold")
        for w in c.worse[:top]:
            verdict = "[red]pass->FAIL[/]" if w in flipped else str(w["passed_after"])
            t.add_row(*(_fmt(w["key"][k]) if not isinstance(w["key"][k], str) else _short(w["key"][k]) for k in keys),
                      _fmt(w["before"]), _fmt(w["after"]), _fmt(w["ratio"]), verdict)
        out.print(t)
    else:
        out.print(f"nothing got worse (tolerance {tolerance:g}) across the {c.matched} rows both {kind} reports have")
    for side, rows in (("before", c.only_before), ("after", c.only_after)):
        if rows:
            out.print(f"{len(rows)} rows only in the {'earlier' if side == 'before' else 'later'} report, not compared; "
                      "first: " + "; ".join("/".join(str(v) for v in k if v is not None) for k in rows[:3]),
                      markup=False)
    if unmatched > UNMATCHED_SHARE:
        out.print(f"[red]FAILED[/]: {len(c.only_before)} of the earlier report's {c.matched + len(c.only_before)} rows "
                  f"({unmatched:.0%}, more than {UNMATCHED_SHARE:.0%}) have no match in the later one: not compared, so "
                  "not passed (a renamed implementation: --pair OLD=NEW)")
        raise typer.Exit(1)
    raise typer.Exit(1 if flipped else 0)


def _compare_outputs(c, kind: str, keys: tuple, before: Path, after: Path, tolerance: float,
                     junit: Optional[Path], summary: Optional[Path]) -> None:
    """report compare's JUnit XML and Markdown summary, written atomically."""

    def name(key) -> str:
        return "/".join(str(_short(v)) for v in (key.values() if isinstance(key, dict) else key) if v is not None)
    flipped = [w for w in c.worse if w["passed_before"] is True and w["passed_after"] is False]
    item = f"compare {kind}"
    from mhctool.analyses import gate as gate_mod
    cases = [gate_mod.Case(item, kind, name(w["key"]), False if w in flipped else True,
                           f"{_fmt(w['before'])} -> {_fmt(w['after'])} (x{_fmt(w['ratio'])})"
                           + (f"; now failing: {w['message']}" if w in flipped and w["message"] else
                              "; now failing" if w in flipped else ""))
             for w in c.worse]
    cases.append(gate_mod.Case(item, kind, "no worse", True,
                               f"{c.matched - len(c.worse)} of {c.matched} matched rows within tolerance {tolerance:g}"))
    cases += [gate_mod.Case(item, kind, name(k), None, f"only in {side}")
              for side, ks in ((before.name, c.only_before), (after.name, c.only_after)) for k in ks]
    from mhctool.core import report
    if junit is not None:
        xml = gate_mod.junit_xml(f"mhctool report compare {before.name} {after.name}", cases)
        report.atomic(junit, lambda tmp: Path(tmp).write_bytes(xml))
    if summary is not None:
        head = "FAILED" if flipped else "passed"
        lines = [f"## mhctool report compare ({kind}): {head}", "",
                 f"`{before.name}` -> `{after.name}`: {c.matched} rows matched, {len(c.worse)} worse "
                 f"(tolerance {tolerance:g}), {len(flipped)} flipped to fail; {len(c.only_before)} only in the "
                 f"earlier report, {len(c.only_after)} only in the later one", ""]
        if c.worse:
            lines += ["| " + " | ".join((*keys, "before", "after", "x", "verdict")) + " |",
                      "|" + "---|" * (len(keys) + 4)]
            for w in c.worse[:gate_mod.MARKDOWN_CAP]:
                verdict = "❌ pass → fail" if w in flipped else ("fail" if w["passed_after"] is False else "ok")
                lines.append("| " + " | ".join(str(_short(w["key"][k])) if w["key"][k] is not None else ""
                                               for k in keys)
                             + f" | {_fmt(w['before'])} | {_fmt(w['after'])} | {_fmt(w['ratio'])} | {verdict} |")
            if len(c.worse) > gate_mod.MARKDOWN_CAP:
                lines.append(f"\n... and {len(c.worse) - gate_mod.MARKDOWN_CAP} more (the JUnit XML and --json "
                             "have every one)")
        report.write_summary(summary, "\n".join(lines) + "\n")




def _short(text: str) -> str:
    """Paths in a cell reduced to their file name (the report keeps them whole)."""
    from mhctool.core.combine import stable
    return stable(text)
