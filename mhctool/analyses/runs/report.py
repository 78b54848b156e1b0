"""``mhctool report compare|merge`` as runs: what got worse from one report to another, and the
slices of a ``--shard`` run joined into the report one run would have written (the row matching
is :mod:`mhctool.core.combine`'s)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa

from mhctool.analyses import gate as gate_mod
from mhctool.analyses.runs.gate import write_outputs
from mhctool.core import report
from mhctool.core.combine import COMPARE_KEYS, UNMATCHED_SHARE, compare, merge, stable
from mhctool.core.errors import UsageError
from mhctool.core.findings import tally, verdicts
from mhctool.core.text import fmt as _fmt


@dataclass
class CompareRequest:
    before: Path
    after: Path
    tolerance: float = 0.1
    json: Path | None = None
    junit: Path | None = None
    summary: Path | None = None
    pairs: list[str] = field(default_factory=list)  # OLD=NEW implementation names


@dataclass
class Comparison:
    kind: str
    keys: tuple
    result: object  # core.combine.Comparison
    flipped: list[dict]  # rows that passed before and fail after
    unmatched: float  # the share of the earlier report's rows with no match in the later one

    @property
    def exit_code(self) -> int:
        return 1 if self.unmatched > UNMATCHED_SHARE or self.flipped else 0


def _pairs(items: list[str]) -> dict[str, str]:
    pairs = {}
    for item in items:
        old, sep, new = item.partition("=")
        if not sep or not old.strip() or not new.strip():
            raise UsageError(f"malformed --pair {item!r}; expected OLD=NEW (two implementation names)")
        pairs[old.strip()] = new.strip()
    return pairs


def compare_reports(req: CompareRequest) -> Comparison:
    """BEFORE against AFTER, for reports of one kind; the JSON, JUnit XML and Markdown summary
    asked for written atomically. A UsageError for reports that cannot be compared or share no row."""
    for path, what in ((req.json, "--json"), (req.junit, "--junit"), (req.summary, "--summary")):
        if path is not None:
            report.check_writable(path, what, suffixes=None)
            if path.resolve() in (req.before.resolve(), req.after.resolve()):
                raise UsageError(f"{what} {path} is one of the reports compared; name another file")
    a, ma = report.read(req.before)
    b, mb = report.read(req.after)
    kind = ma["kind"]
    if kind != mb["kind"]:
        raise UsageError(f"{req.before} is a {kind} report and {req.after} a {mb['kind']} report; report compare "
                         "compares two reports of one kind")
    if kind not in COMPARE_KEYS:
        raise UsageError(f"report compare does not compare {kind} reports; it compares " + ", ".join(COMPARE_KEYS))
    pairs = _pairs(req.pairs)
    c = compare(a, b, req.tolerance, kind, pairs)
    if c.matched == 0 and (c.only_before or c.only_after):
        raise UsageError(f"{req.before} and {req.after} share no row ({len(c.only_before)} and {len(c.only_after)} "
                         "rows): nothing was compared; pair a renamed implementation with --pair OLD=NEW")
    unmatched = len(c.only_before) / max(1, c.matched + len(c.only_before))
    flipped = [w for w in c.worse if w["passed_before"] is True and w["passed_after"] is False]
    if req.json is not None:
        payload = {"kind": kind, "before": str(req.before), "after": str(req.after), "tolerance": req.tolerance,
                   "matched": c.matched, "worse": c.worse, "flipped": len(flipped), "pairs": pairs,
                   "unmatched_earlier_share": unmatched,
                   "only_before": [list(k) for k in c.only_before], "only_after": [list(k) for k in c.only_after]}
        report.atomic(req.json, lambda tmp: Path(tmp).write_text(json.dumps(payload, indent=2, default=str)))
    keys = COMPARE_KEYS[kind]
    if req.junit is not None or req.summary is not None:
        _compare_outputs(c, kind, keys, req.before, req.after, req.tolerance, req.junit, req.summary)
    return Comparison(kind, keys, c, flipped, unmatched)


def _compare_outputs(c, kind: str, keys: tuple, before: Path, after: Path, tolerance: float,
                     junit: Path | None, summary: Path | None) -> None:
    """report compare's JUnit XML and Markdown summary, written atomically."""

    def name(key) -> str:
        return "/".join(str(_short(v)) for v in (key.values() if isinstance(key, dict) else key) if v is not None)
    flipped = [w for w in c.worse if w["passed_before"] is True and w["passed_after"] is False]
    item = f"compare {kind}"
    cases = [gate_mod.Case(item, kind, name(w["key"]), False if w in flipped else True,
                           f"{_fmt(w['before'])} -> {_fmt(w['after'])} (x{_fmt(w['ratio'])})"
                           + (f"; now failing: {w['message']}" if w in flipped and w["message"] else
                              "; now failing" if w in flipped else ""))
             for w in c.worse]
    cases.append(gate_mod.Case(item, kind, "no worse", True,
                               f"{c.matched - len(c.worse)} of {c.matched} matched rows within tolerance {tolerance:g}"))
    cases += [gate_mod.Case(item, kind, name(k), None, f"only in {side}")
              for side, ks in ((before.name, c.only_before), (after.name, c.only_after)) for k in ks]
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




@dataclass
class Merged:
    table: pa.Table
    report: Path
    counts: tuple[int, int, int]  # passed, failed, skipped (parity slices)
    gate: tuple | None = None  # (suite name, cases, (report, JUnit, summary), interrupted) for gate slices


def merge_reports(paths: list[Path], out: Path, junit: Path | None = None, summary: Path | None = None) -> Merged:
    """The slices of one ``--shard`` run (parity or gate) joined in the order one run has, written
    to ``out`` (for gate slices with the JUnit XML and Markdown summary one run writes)."""
    report.check_writable(out)
    if out.resolve() in {p.resolve() for p in paths}:
        raise UsageError(f"--out {out} is one of the slices merged; name another file")
    table = merge(paths)
    _, meta = report.read(paths[0])
    if meta["kind"] != "gate" and (junit or summary):
        raise UsageError("--junit and --summary are for gate slices; these are parity reports")
    if meta["kind"] == "gate":
        cases = gate_mod.cases_from_rows(table.to_pylist())
        name = meta["run"].get("suite_name") or (cases[0].suite_item if cases else "gate")
        interrupted = json.loads(table.schema.metadata[b"mhctool.run"]).get("interrupted", False)
        written = (out, junit or out.with_suffix(".xml"), summary or out.with_suffix(".md"))
        write_outputs(table, name, cases, *written)
        return Merged(table, out, (0, 0, 0), (name, cases, written, interrupted))
    path = report.write_atomic(table, out)
    return Merged(table, path, tally(v["passed"] for v in verdicts(table)))


def _short(text: str) -> str:
    """Paths in a cell reduced to their file name (the report keeps them whole)."""
    return stable(text)
