"""What a parity report's rows say, read back: the verdict per case and implementation, the
tallies, what the native baseline itself fails, the skips every implementation shares, the
implementations that judged nothing."""
from __future__ import annotations

import math

import pyarrow as pa


def verdicts(table: pa.Table) -> list[dict]:
    """One verdict per (case, impl, direction): failed when any gated row failed."""
    out: dict[tuple, dict] = {}
    keys = ("case_id", "kernel", "impl", "family", "dtype", "shape", "knobs", "direction")
    for r in table.to_pylist():
        if r.get("backend") == "reference":  # the float64 reference's own check rows: never a verdict
            continue
        k = tuple(r[c] for c in keys)
        v = out.setdefault(k, {**{c: r[c] for c in keys}, "passed": None, "worst": None,
                               "worst_margin": -1.0, "message": None})
        if r["metric"] == "unsupported":
            v["message"] = r["message"]
            continue
        if r["passed"] is None:
            continue
        v["passed"] = bool(r["passed"]) if v["passed"] is None else (v["passed"] and bool(r["passed"]))
        m = row_margin(r)
        if m > v["worst_margin"]:
            v["worst_margin"], v["worst"] = m, r
        if r["message"] and not r["passed"]:
            v["message"] = r["message"]
    return list(out.values())


def baseline_findings(table: pa.Table) -> dict[tuple[str, str, str], int]:
    """(impl, kernel, rule) -> cases where a reproducibility check found a difference in an
    implementation that is not gated (the native baseline when not asked for, the float64
    reference): what PyTorch itself does on this platform."""
    out: dict[tuple[str, str, str], int] = {}
    for r in table.select(["impl", "kernel", "rule", "message", "passed", "case_id"]).to_pylist():
        if r["passed"] is None and (r["message"] or "").startswith("(baseline, not gated)"):
            out[r["impl"], r["kernel"], r["rule"]] = out.get((r["impl"], r["kernel"], r["rule"]), 0) + 1
    return out


def skipped_everywhere(table: pa.Table) -> dict[str, str]:
    """Implementations that were skipped on every case of a parity report, with the first
    reason given (a backend unusable here: no GPU, an interpreter that cannot run, ...)."""
    reasons: dict[str, str] = {}
    ran: set[str] = set()
    for r in table.select(["impl", "metric", "message"]).to_pylist():
        if r["metric"] == "unsupported" and r["message"]:
            reasons.setdefault(r["impl"], r["message"])
        elif r["metric"] != "unsupported":
            ran.add(r["impl"])
    return {k: v for k, v in reasons.items() if k not in ran}


def outside_impls(table: pa.Table) -> list[str]:
    """The implementations from outside mhctool (a plain function, a library through its adapter)
    in a parity report, in the order they first appear."""
    if "backend" not in table.column_names:
        return []
    return list(dict.fromkeys(r["impl"] for r in table.select(["impl", "backend"]).to_pylist()
                              if r["backend"] == "external"))


def tally(flags) -> tuple[int, int, int]:
    """(passed, failed, skipped) of verdicts' ``passed`` values (True, False, None)."""
    flags = list(flags)
    p = sum(x is True for x in flags)
    f = sum(x is False for x in flags)
    return p, f, len(flags) - p - f


def counts(vs: list[dict], impl: str) -> tuple[int, int, int]:
    """(passed, failed, skipped) verdicts of one implementation."""
    return tally(v["passed"] for v in vs if v["impl"] == impl)


def judged_nothing(table: pa.Table, groups: dict[str, list[str]] | None = None) -> dict[str, str]:
    """What was asked for from outside mhctool and judged on no case (every row skipped or
    unsupported), with the first reason given: a run that judged nothing of it is no pass.
    ``groups``: what was asked for (an ``--impl`` spec) -> the implementations it stands for (a
    library: one per function it has); default: each outside implementation alone."""
    outside = outside_impls(table)
    groups = groups if groups is not None else {name: [name] for name in outside}
    judged: set[str] = set()
    reasons: dict[str, str] = {}
    for r in table.select(["impl", "metric", "passed", "message"]).to_pylist():
        if r["passed"] is not None:
            judged.add(r["impl"])
        elif r["metric"] == "unsupported":
            reasons.setdefault(r["impl"], r["message"] or "unsupported")
    out = {}
    for spec, names in groups.items():
        if names and not any(n in judged for n in names):
            out[spec] = next((reasons[n] for n in names if n in reasons), "no row of it was judged")
    return out


def row_margin(r: dict) -> float:
    """value / threshold, the share of the allowed error used (inf for a failed zero threshold)."""
    if r["passed"] is False and r["metric"] == "error":
        return float("inf")
    t, v = r["threshold"], r["value"]
    if t is None or v is None:
        return 0.0
    if t == 0:
        return 0.0 if v == 0 else float("inf")
    if t == float("inf"):
        return 0.0
    return v / t if v == v else float("inf")



# the one order of badness every listing uses: failed, then passed, then skipped (nothing judged)
VERDICT_RANK = {False: 0, True: 1, None: 2}


def _descending(m: float) -> float:
    return -(math.inf if m != m else m)  # a NaN margin (nothing comparable) sorts with the worst


def worst_first(verdicts: list[dict]) -> list[dict]:
    """Verdicts (:func:`verdicts`) failed first, then passed, then skipped; within each, by the
    margin of the row that decided them (:func:`row_margin`), largest first."""
    return sorted(verdicts, key=lambda v: (VERDICT_RANK[v["passed"]], _descending(v["worst_margin"])))


def rows_worst_first(rows: list[dict]) -> list[dict]:
    """Rows with a ``passed`` column in the same order as :func:`worst_first`, each by its own margin
    where it has a value and a threshold."""
    return sorted(rows, key=lambda r: (VERDICT_RANK[r["passed"]],
                                       _descending(row_margin(r) if "threshold" in r and "value" in r else 0.0)))
