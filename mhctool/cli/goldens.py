"""``mhctool goldens show|diff|check|extract``: golden-value files and training logs."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from mhctool.cli.console import guard, out
from mhctool.core.text import fmt as _fmt
from mhctool.core.text import split as _split
from mhctool.core.errors import UsageError

goldens_app = typer.Typer(no_args_is_help=True, help="Megatron golden-value files and training logs: show, diff, check, extract.")


_SPARK = "▁▂▃▄▅▆▇█"


def _sparkline(vals: list[float], width: int = 50) -> str:
    fin = [v for v in vals if math.isfinite(v)]
    if not fin:
        return ""
    step = max(1, len(vals) // width)
    vals = vals[::step]
    lo, hi = min(fin), max(fin)
    span = hi - lo or 1.0
    return "".join(" " if not math.isfinite(v) else _SPARK[min(7, int((v - lo) / span * 8))] for v in vals)


def _read_run(path: Path):
    from mhctool.analyses.gate import read_run
    return read_run(path)


@goldens_app.command("show")
@guard
def goldens_show(path: Path = typer.Argument(..., help="Golden-value JSON or a Megatron training log.")):
    """Per metric: steps, range and a sparkline."""
    g = _read_run(path)
    t = Table(title=str(path))
    for c in ("metric", "steps", "first..last", "min", "max", "nan", "trend"):
        t.add_column(c)
    for m, s in g.items():
        vals = [s.values[k] for k in s.steps()]
        fin = [v for v in vals if math.isfinite(v)]
        t.add_row(m, f"{len(vals)} ({s.start_step}-{s.end_step}/{s.step_interval})",
                  f"{_fmt(vals[0])}..{_fmt(vals[-1])}", _fmt(min(fin)) if fin else "-", _fmt(max(fin)) if fin else "-",
                  str(len(vals) - len(fin)), _sparkline(vals))
    out.print(t)


def _rtol_overrides(items: Optional[list[str]]) -> dict[str, float]:
    outd = {}
    for item in _split(items):
        name, sep, val = item.rpartition("=")
        try:
            outd[name.strip()] = float(val)
            assert sep and name.strip()
        except (ValueError, AssertionError):
            raise UsageError(f"malformed --rtol {item!r}; expected METRIC=VALUE, e.g. 'num-zeros=0.2'") from None
    return outd


@goldens_app.command("diff")
@guard
def goldens_diff(
    golden: Path = typer.Argument(..., help="The golden values (JSON)."),
    actual: Path = typer.Argument(..., help="The run to check (JSON, or a training log)."),
    metrics: Optional[str] = typer.Option(None, "--metrics", help="Comma-separated metrics to check (default: lm loss, num-zeros, or the config's METRICS)."),
    config: Optional[Path] = typer.Option(None, "--config", help="The recipe's model_config.yaml (its METRICS list)."),
    rtol: Optional[list[str]] = typer.Option(None, "--rtol", help="Per-metric tolerance METRIC=VALUE (repeat)."),
    deterministic: bool = typer.Option(False, "--deterministic", help="Add Megatron's exact check."),
    out_path: Optional[Path] = typer.Option(None, "--out", "-o", help="Parquet report to write."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Folder for per-metric PNGs."),
):
    """Megatron's CI checks of ACTUAL against GOLDEN, per metric and step."""
    from mhctool.core import environment, report
    if out_path:
        report.check_writable(out_path)
    if plot:
        report.check_folder(plot)
    from mhctool.analyses import goldens as G
    g, a = G.load(golden), _read_run(actual)
    chosen = [m.strip() for m in metrics.split(",") if m.strip()] if metrics else (
        G.metrics_from_config(config) if config else None)
    verdicts_ = G.diff(g, a, chosen, _rtol_overrides(rtol), deterministic)
    t = Table(title=f"{golden.name} vs {actual.name}")
    for c in ("metric", "check", "verdict", "detail"):
        t.add_column(c, overflow="fold")
    for v in verdicts_:
        t.add_row(v.metric, v.check, "[green]pass[/]" if v.passed else "[red]FAIL[/]", v.message)
    out.print(t)
    others = sorted((set(g) | set(a)) - {v.metric for v in verdicts_})
    if others:
        out.print(f"not checked (Megatron checks only the listed metrics): {', '.join(others)}")
    if out_path:
        rows = []
        for v in verdicts_:
            rows.append({"command": "diff", "metric": v.metric, "check": v.check, "step": None, "passed": v.passed,
                         "message": v.message})
            rows += [{"command": "diff", "metric": v.metric, "check": v.check, **r, "passed": None,
                      "message": r.get("note")} for r in v.rows]
        tab = report.to_table(rows, report.new_run_id(), "goldens", environment.metadata(),
                              {"command": "goldens diff", "golden": str(golden), "actual": str(actual)},
                              schema=report.GOLDENS_SCHEMA)
        out.print(f"report {report.write_atomic(tab, out_path)}")
    if plot:
        from mhctool.views.plots import golden_figures
        for png in golden_figures(g, a, [v.metric for v in verdicts_], plot, (golden.name, actual.name)):
            out.print(f"plot: {png}")
    failed = [v for v in verdicts_ if not v.passed]
    out.print(("[red]FAILED[/] " if failed else "[green]PASSED[/] ") +
              f"{len(verdicts_) - len(failed)} passed, {len(failed)} failed")
    raise typer.Exit(1 if failed else 0)


@goldens_app.command("check")
@guard
def goldens_check(
    path: Path = typer.Argument(..., help="Golden-value JSON or a training log."),
    factor: float = typer.Option(5.0, "--factor", min=1.0, help="A count that moves by this factor is an anomaly."),
    out_path: Optional[Path] = typer.Option(None, "--out", "-o", help="Parquet report to write."),
):
    """Anomalies inside one run: zero-count jumps or two levels, non-finite values, loss spikes."""
    from mhctool.core import environment, report
    if out_path:
        report.check_writable(out_path)
    from mhctool.analyses import goldens as G
    found = G.check(_read_run(path), factor)
    for a in found:
        out.print(f"[red]{a.kind}[/] {a.message}")
    if out_path:
        rows = [{"command": "check", "metric": a.metric, "check": a.kind, "step": s, "passed": False,
                 "message": a.message} for a in found for s in a.steps]
        tab = report.to_table(rows, report.new_run_id(), "goldens", environment.metadata(),
                              {"command": "goldens check", "file": str(path), "factor": factor},
                              schema=report.GOLDENS_SCHEMA)
        out.print(f"report {report.write_atomic(tab, out_path)}")
    out.print(f"{len(found)} anomal{'y' if len(found) == 1 else 'ies'} in {path}" if found else f"no anomaly in {path}")
    raise typer.Exit(1 if found else 0)


@goldens_app.command("extract")
@guard
def goldens_extract(
    log: Path = typer.Argument(..., help="A Megatron training log."),
    out_path: Path = typer.Option(..., "--out", "-o", help="Golden-value JSON to write."),
):
    """Read a training log's iteration lines into Megatron's golden-value format."""
    from mhctool.core import report
    report.check_writable(out_path, suffixes=None)
    from mhctool.analyses import goldens as G
    g = G.extract_log(log)
    G.dump(g, out_path)
    out.print(f"{out_path}: " + ", ".join(f"{m} ({len(s.values)} steps)" for m, s in g.items()))
