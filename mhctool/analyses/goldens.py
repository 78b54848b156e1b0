"""Megatron golden-value files and training logs: read, write, diff, check.

Format (Megatron-LM functional tests): ``{metric: {"start_step", "end_step", "step_interval",
"values": {"<step>": number | "nan"}}}``. Metrics include ``lm loss``, ``num-zeros``,
``mem-allocated-bytes``, ``mem-max-allocated-bytes``, ``iteration-time``.

Megatron's CI rules, reproduced (``diff``):
  * only the checked metrics: ``lm loss`` and ``num-zeros`` unless the recipe's
    ``model_config.yaml`` lists ``METRICS`` or ``--metrics`` says otherwise;
  * the approximate check (always): per metric a relative tolerance (``lm loss`` 0.05, ``num-zeros``
    0.20, memory 0.05, ``iteration-time`` 0.05 on its median); a metric passes when the share of
    close steps is at least ``1 - max(1, N // 100) / N``;
  * the exact check (``deterministic``): every step equal (``nan`` equals ``nan``).
"""
from __future__ import annotations

import json
import math
import os
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from mhctool.core.errors import UsageError
from mhctool.core.report import atomic

DEFAULT_METRICS = ("lm loss", "num-zeros")
RTOL = {"lm loss": 0.05, "num-zeros": 0.20, "mem-allocated-bytes": 0.05,
        "mem-max-allocated-bytes": 0.05, "iteration-time": 0.05}
DEFAULT_RTOL = 0.05
MEDIAN_METRICS = ("iteration-time",)


@dataclass
class Series:
    start_step: int
    end_step: int
    step_interval: int
    values: dict[int, float]  # nan for Megatron's "nan"

    def steps(self) -> list[int]:
        return sorted(self.values)


Golden = dict[str, Series]


# --- read / write -----------------------------------------------------------------------------

def _number(v, where: str) -> float:
    if isinstance(v, bool):
        raise UsageError(f"{where}: {v!r} is not a number or \"nan\"")
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str) and v.strip().lower() == "nan":
        return math.nan
    raise UsageError(f"{where}: {v!r} is not a number or \"nan\"")


def _possible(metric: str, v: float, where: str) -> float:
    """``v``, where a metric of its kind can take it: a loss, a norm, a time, a memory size and a
    count of zeros are never negative, and a count is a whole number."""
    name = metric.lower()
    kind = next((k for k in ("loss", "zeros", "norm", "time", "mem") if k in name), None)
    if kind is None or math.isnan(v):
        return v
    if v < 0:
        what = {"loss": "a cross-entropy loss", "zeros": "a count of zeros", "norm": "a norm", "time": "a time",
                "mem": "a memory size"}[kind]
        raise UsageError(f"{where}: {v:g} is negative, which {what} never is")
    if kind == "zeros" and v != int(v):
        raise UsageError(f"{where}: {v:g} is not a whole number, which a count of zeros is")
    return v


def parse(data, src: str) -> Golden:
    if not isinstance(data, dict) or not data:
        raise UsageError(f"{src}: expected an object of metrics, got {type(data).__name__}")
    out: Golden = {}
    for metric, body in data.items():
        if not isinstance(body, dict) or "values" not in body:
            raise UsageError(f"{src}: metric {metric!r} has no \"values\" object")
        vals = body["values"]
        if isinstance(vals, list):
            raise UsageError(f"{src}: metric {metric!r}: \"values\" is a list; a golden-value file keys each value "
                             f"by its step (\"values\": {{\"1\": 10.8, \"2\": 10.7}})")
        if not isinstance(vals, dict) or not vals:
            raise UsageError(f"{src}: metric {metric!r} has empty \"values\"")
        parsed = {}
        for step, v in vals.items():
            try:
                s = int(step)
            except (TypeError, ValueError):
                raise UsageError(f"{src}: metric {metric!r}: step {step!r} is not an integer") from None
            parsed[s] = _possible(metric, _number(v, f"{src}: metric {metric!r} step {step}"),
                                  f"{src}: metric {metric!r} step {step}")
        steps = sorted(parsed)
        try:
            start = int(body.get("start_step", steps[0]))
            end = int(body.get("end_step", steps[-1]))
            interval = int(body.get("step_interval", 1))
        except (TypeError, ValueError):
            raise UsageError(f"{src}: metric {metric!r}: start_step, end_step and step_interval must be integers") from None
        if interval < 1:
            raise UsageError(f"{src}: metric {metric!r}: step_interval must be at least 1, got {interval}")
        out[metric] = Series(start, end, interval, parsed)
    return out


def load(path: str | os.PathLike) -> Golden:
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"no golden-value file {path}")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UsageError(f"{path}: not valid JSON (truncated?): {e.msg} at line {e.lineno}") from None
    except UnicodeDecodeError:
        raise UsageError(f"{path}: not a text file") from None
    return parse(data, str(path))


def to_json(golden: Golden) -> dict:
    return {
        m: {"start_step": s.start_step, "end_step": s.end_step, "step_interval": s.step_interval,
            "values": {str(k): ("nan" if math.isnan(v) else v) for k, v in sorted(s.values.items())}}
        for m, s in golden.items()
    }


def dump(golden: Golden, path: str | os.PathLike) -> Path:
    """Write Megatron's format atomically (temp file + rename)."""
    return atomic(path, lambda tmp: Path(tmp).write_text(json.dumps(to_json(golden), indent=4)))


# --- training logs ----------------------------------------------------------------------------

_ITER = re.compile(r"\biteration\s+(\d+)\s*/\s*\d+\s*\|")
_FIELDS = {
    "lm loss": (re.compile(r"\|\s*lm loss:\s*([-+0-9.eEnNaAiIfF]+)"), 1.0),
    "num-zeros": (re.compile(r"\|\s*num zeros:\s*([-+0-9.eEnNaA]+)"), 1.0),
    "iteration-time": (re.compile(r"elapsed time per iteration \(ms\):\s*([-+0-9.eE]+)"), 1e-3),
    "grad-norm": (re.compile(r"\|\s*grad norm:\s*([-+0-9.eEnNaAiIfF]+)"), 1.0),
    "params-norm": (re.compile(r"\|\s*params norm:\s*([-+0-9.eEnNaAiIfF]+)"), 1.0),
}


def extract_log(path: str | os.PathLike) -> Golden:
    """Read a Megatron training log into the golden form; other lines are skipped."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"no log file {path}")
    series: dict[str, dict[int, float]] = {}
    with open(path, errors="replace") as f:
        for line in f:
            m = _ITER.search(line)
            if not m:
                continue
            step = int(m.group(1))
            for name, (rx, scale) in _FIELDS.items():
                fm = rx.search(line)
                if fm:
                    try:
                        series.setdefault(name, {})[step] = float(fm.group(1)) * scale
                    except ValueError:
                        continue
    if not series:
        raise UsageError(f"{path}: no Megatron training-iteration lines found "
                         "(expected lines like ' iteration 8/ 50 | ... | lm loss: ...')")
    out = {}
    for name, vals in series.items():
        steps = sorted(vals)
        gaps = {b - a for a, b in zip(steps, steps[1:])}
        out[name] = Series(steps[0], steps[-1], min(gaps) if gaps else 1, vals)
    return out


def metrics_from_config(path: str | os.PathLike) -> list[str] | None:
    """``METRICS`` of a recipe's model_config.yaml (a YAML list), or None when it lists none."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"no model config {path}")
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"^METRICS:\s*(.*)$", line)
        if not m:
            continue
        inline = m.group(1).strip()
        if inline.startswith("["):
            return [x.strip().strip("'\"") for x in inline.strip("[]").split(",") if x.strip()]
        items = []
        for nxt in lines[i + 1:]:
            im = re.match(r"^\s+-\s*(.+?)\s*$", nxt)
            if not im:
                break
            items.append(im.group(1).strip("'\""))
        return items or None
    return None


# --- diff -------------------------------------------------------------------------------------

@dataclass
class MetricVerdict:
    metric: str
    check: str  # approximate, exact, median, missing
    passed: bool
    rtol: float | None
    n_steps: int
    n_close: int
    needed: int
    message: str
    rows: list[dict] = field(default_factory=list)  # per step


def _median(values) -> float:
    """The median, finite wherever the values are: of an even count, the mean of the two middle
    values taken as halves where their sum overflows (``statistics.median`` gave inf for two values
    near the float maximum, and a run then failed against its own golden values)."""
    v = sorted(values)
    if not v:
        raise statistics.StatisticsError("no median for empty data")
    mid = len(v) // 2
    if len(v) % 2:
        return v[mid]
    lo, hi = v[mid - 1], v[mid]
    m = (lo + hi) / 2
    return m if math.isfinite(m) or not (math.isfinite(lo) and math.isfinite(hi)) else lo / 2 + hi / 2


def _close(g: float, a: float, rtol: float) -> bool:
    if math.isnan(g) or math.isnan(a):
        return math.isnan(g) and math.isnan(a)
    return abs(a - g) <= rtol * abs(g)


def diff(golden: Golden, actual: Golden, metrics: list[str] | None = None,
         rtol: dict[str, float] | None = None, deterministic: bool = False) -> list[MetricVerdict]:
    """Megatron's checks of ``actual`` against ``golden`` for each checked metric."""
    checked = list(metrics) if metrics else list(DEFAULT_METRICS)
    tol = {**RTOL, **(rtol or {})}
    out = []
    for metric in checked:
        g, a = golden.get(metric), actual.get(metric)
        if g is None or a is None:
            side = "golden" if g is None else "actual"
            out.append(MetricVerdict(metric, "missing", False, None, 0, 0, 0,
                                     f"{metric} is missing from the {side} file"))
            continue
        r = tol.get(metric, DEFAULT_RTOL)
        steps = g.steps()
        rows = []
        for s in steps:
            gv = g.values[s]
            av = a.values.get(s, math.nan if s in a.values else None)
            if av is None:
                rows.append({"step": s, "golden": gv, "actual": None, "abs_diff": None, "rel_diff": None,
                             "close": False, "note": "missing in actual"})
                continue
            d = abs(av - gv) if not (math.isnan(av) or math.isnan(gv)) else math.nan
            rel = d / abs(gv) if gv not in (0.0,) and not math.isnan(d) else (0.0 if d == 0 else math.nan)
            rows.append({"step": s, "golden": gv, "actual": av, "abs_diff": d, "rel_diff": rel,
                         "close": _close(gv, av, r), "note": None})
        extra = sorted(set(a.values) - set(steps))
        n = len(steps)
        if metric in MEDIAN_METRICS:
            gm = [v for v in g.values.values() if not math.isnan(v)]
            am = [v for v in a.values.values() if not math.isnan(v)]
            gmed = _median(gm) if gm else math.nan
            amed = _median(am) if am else math.nan
            if math.isnan(gmed):  # no finite golden value: only an equally empty run matches
                ok = math.isnan(amed)
            else:
                ok = not math.isnan(amed) and abs(amed - gmed) <= r * abs(gmed)
            v = MetricVerdict(metric, "median", ok, r, n, sum(x["close"] for x in rows), n,
                              f"median {amed:.6g} vs golden {gmed:.6g} (rtol {r:g})", rows)
        else:
            needed = math.ceil(n * (1 - max(1, n // 100) / n)) if n else 0
            n_close = sum(x["close"] for x in rows)
            ok = n_close >= needed
            far = [x for x in rows if not x["close"]]
            worst = max((x for x in far if x["rel_diff"] is not None and not math.isnan(x["rel_diff"])),
                        key=lambda x: x["rel_diff"], default=None)
            msg = f"{n_close}/{n} steps within rtol {r:g} (need {needed})"
            if worst:
                msg += f"; worst step {worst['step']}: {worst['actual']:.6g} vs {worst['golden']:.6g} ({worst['rel_diff']:.1%})"
            v = MetricVerdict(metric, "approximate", ok, r, n, n_close, needed, msg, rows)
        if extra:
            v.message += f"; steps only in actual: {extra[:5]}{'...' if len(extra) > 5 else ''}"
        out.append(v)
        if deterministic:
            same = all((x["actual"] is not None) and (x["golden"] == x["actual"] or
                       (math.isnan(x["golden"]) and math.isnan(x["actual"]))) for x in rows)
            first = next((x for x in rows if not (x["actual"] is not None and (x["golden"] == x["actual"] or (
                math.isnan(x["golden"]) and math.isnan(x["actual"]))))), None)
            out.append(MetricVerdict(metric, "exact", same, 0.0, n, n if same else 0, n,
                                     "every step equal" if same else f"first difference at step {first['step']}"))
    return out


# --- check (one run, no reference) -------------------------------------------------------------

@dataclass
class Anomaly:
    metric: str
    kind: str  # bimodal, jump, nonfinite, loss_spike
    steps: list[int]
    message: str
    low: float | None = None
    high: float | None = None
    ratio: float | None = None
    first_step: int | None = None


def _two_levels(steps: list[int], vals: list[float]):
    """Split positive values into two levels on a log scale (1-D 2-means)."""
    logs = sorted((math.log(v), s, v) for s, v in zip(steps, vals) if v > 0)
    if len(logs) < 4:
        return None
    best = None
    for i in range(1, len(logs)):
        lo, hi = logs[:i], logs[i:]
        ml = sum(x[0] for x in lo) / len(lo)
        mh = sum(x[0] for x in hi) / len(hi)
        cost = sum((x[0] - ml) ** 2 for x in lo) + sum((x[0] - mh) ** 2 for x in hi)
        if best is None or cost < best[0]:
            best = (cost, lo, hi)
    _, lo, hi = best
    return lo, hi


def check(golden: Golden, factor: float = 5.0, spike: float = 0.10) -> list[Anomaly]:
    """Anomalies inside one run: zero-count series that are bimodal or jump by ``factor`` against
    their rolling median, non-finite values (except Megatron's own "nan" for the first
    ``iteration-time`` step), and loss spikes (``spike`` above the median of the 5 steps before)."""
    out = []
    for metric, s in golden.items():
        steps = s.steps()
        vals = [s.values[k] for k in steps]
        bad = [k for k, v in zip(steps, vals) if not math.isfinite(v)]
        if metric == "iteration-time" and bad and bad[0] == steps[0]:
            bad = bad[1:]  # Megatron logs no time for its first step
        if bad:
            out.append(Anomaly(metric, "nonfinite", bad, f"{metric}: non-finite at steps {bad[:10]}"))
        fin = [(k, v) for k, v in zip(steps, vals) if math.isfinite(v)]
        if "zeros" in metric and len(fin) >= 4:
            levels = _two_levels([k for k, _ in fin], [v for _, v in fin])
            if levels:
                lo, hi = levels
                low = _median(x[2] for x in lo)
                high = _median(x[2] for x in hi)
                ratio = high / low if low > 0 else math.inf
                if ratio >= factor and min(len(lo), len(hi)) >= max(2, len(fin) // 10):
                    hs = sorted(x[1] for x in hi)
                    out.append(Anomaly(metric, "bimodal", hs,
                                       f"{metric}: two levels, about {low:.4g} and {high:.4g} ({ratio:.1f}x); "
                                       f"{len(hs)} of {len(fin)} steps at the high level, first at step {hs[0]}",
                                       low, high, ratio, hs[0]))
                    continue
            jumps = []
            for i, (k, v) in enumerate(fin):
                window = [x for _, x in fin[max(0, i - 5):i + 6] if x > 0]
                med = _median(window) if window else 0
                if med > 0 and v > 0 and (v / med >= factor or med / v >= factor):
                    jumps.append((k, v, med))
            if jumps:
                k0, v0, m0 = jumps[0]
                out.append(Anomaly(metric, "jump", [j[0] for j in jumps],
                                   f"{metric}: {len(jumps)} steps jump {factor:g}x or more against the rolling "
                                   f"median, first at step {k0} ({v0:.4g} vs {m0:.4g})",
                                   m0, v0, v0 / m0 if m0 else math.inf, k0))
        if metric == "lm loss":
            spikes = []
            for i in range(5, len(fin)):
                med = _median(v for _, v in fin[i - 5:i])
                if fin[i][1] > med * (1 + spike):
                    spikes.append(fin[i][0])
            if spikes:
                out.append(Anomaly(metric, "loss_spike", spikes,
                                   f"lm loss: {len(spikes)} steps more than {spike:.0%} above the median of the "
                                   f"5 steps before, first at step {spikes[0]}", first_step=spikes[0]))
    return out
