"""Two reports compared row by row (what got worse, what got better, what only one has) and the
shards of one run merged into one report."""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import NamedTuple

import pyarrow as pa

from mhctool.core.errors import UsageError
from mhctool.core.report import new_run_id, read, to_table

# what identifies a row across two runs, per report kind (a path in an implementation's name is
# reduced to its file name: one suite from two checkouts matches), and which way is worse
COMPARE_KEYS = {
    "parity": ("kernel", "impl", "family", "dtype", "shape", "knobs", "seed", "direction", "tensor", "metric"),
    "gate": ("entry", "kind", "name"),
    "identify": ("kernel", "impl", "dtype", "candidate"),
    "stability": ("impl", "family", "dtype", "scale", "stabilize", "eps", "eps_mode", "order", "iters", "metric"),
    "train": ("run", "seed", "step", "layer", "metric"),
    "bench": ("kernel", "impl", "direction", "dtype", "shape", "graph", "metric"),
    "bench-step": ("variant", "point", "layers", "hidden", "seq", "micro_batch", "global_batch", "streams", "recompute",
                   "entry", "direction", "metric"),
    "stability-eps": ("kernel", "knob", "setting_a", "setting_b", "level", "family", "dtype", "impl", "tensor",
                      "depth", "metric"),
    "stability-overflow": ("kernel", "impl", "family", "scale", "dtype", "intermediate", "metric"),
    "stability-gain": ("config", "kind", "impl", "dtype", "iters", "depth", "metric"),
}


# bench metrics where a smaller value is worse (the rest: a larger one is)
_HIGHER_IS_BETTER = ("gbps", "pct_copy_bw", "tflops", "speedup_vs_torch", "speedup_vs_compile", "tokens_per_s")


# an absolute path to a file (``/abs/dir/k.py``), not the slashes of a name (``kernel/impl/family``)
_ABSOLUTE = re.compile(r"(?<![\w.])/(?:[^/\s:]+/)+([^/\s:]+\.\w+)")


def stable(value):
    """A row's value as two runs can match it: absolute paths reduced to their file name."""
    return _ABSOLUTE.sub(r"\1", value) if isinstance(value, str) else value


class Comparison(NamedTuple):
    worse: list[dict]  # rows of B worse than in A (flipped to failed, or grown past the tolerance)
    matched: int
    only_before: list[tuple]  # keys of rows A has and B has not
    only_after: list[tuple]


# the share of the earlier report's rows the later one may lack before a comparison fails: what
# was not compared cannot have passed
UNMATCHED_SHARE = 0.1


def _renamer(pairs: dict[str, str] | None):
    """``OLD=NEW`` pairs applied to the earlier report's key values (an implementation's name as
    ``stable`` shows it, whole: not where it is the start of a longer name)."""
    subs = [(re.compile(re.escape(old) + r"(?![\w.])"), new) for old, new in (pairs or {}).items()]

    def rename(v):
        if isinstance(v, str):
            for pattern, new in subs:
                v = pattern.sub(new, v)
        return v
    return rename


def compare(a: pa.Table, b: pa.Table, tolerance: float = 0.1, kind: str = "parity",
            pairs: dict[str, str] | None = None) -> Comparison:
    """Rows of B that got worse than in A (the same key of ``kind``, :data:`COMPARE_KEYS`): the
    verdict flipped to failed, or the value grew by more than ``tolerance`` (relative; for a bench
    throughput, shrank); and the rows either has alone. ``pairs``: OLD=NEW names of A's rows
    matched with B's (an implementation and its renamed successor)."""
    keys = COMPARE_KEYS[kind]
    cols = set(a.column_names) & set(b.column_names)
    rename = _renamer(pairs)

    def key(r, rename=lambda v: v):
        return tuple(rename(stable(r.get(k))) for k in keys)
    before = {key(r, rename): r for r in a.to_pylist()}
    after = {key(r): r for r in b.to_pylist()}
    out = []
    for k, r in after.items():
        old = before.get(k)
        if old is None:
            continue
        pa_, pb_ = old.get("passed"), r.get("passed")
        flipped = pa_ is True and pb_ is False
        va, vb = (old.get("value"), r.get("value")) if "value" in cols else (None, None)
        worse = False
        ratio = float("nan")
        if va is not None and vb is not None:
            up = not (kind in ("bench", "bench-step") and r.get("metric") in _HIGHER_IS_BETTER)
            grown = (vb > va * (1 + tolerance) and vb > 0) if up else (vb < va / (1 + tolerance))
            worse = (vb == vb and grown) or (va == va and vb != vb)
            ratio = (vb / va) if (va and va == va and vb == vb) else float("inf")
        if flipped or worse:
            out.append({"key": dict(zip(keys, k)), "before": va, "after": vb, "ratio": ratio,
                        "passed_before": pa_, "passed_after": pb_, "message": r.get("message")})
    out.sort(key=lambda d: (not (d["passed_before"] is True and d["passed_after"] is False),
                            -(d["ratio"] if d["ratio"] == d["ratio"] else 0.0)))
    return Comparison(out, len(set(before) & set(after)), sorted(set(before) - set(after), key=str),
                      sorted(set(after) - set(before), key=str))


# keys of a run's settings that differ between the slices of one run (``--shard``) by design
_SLICE_KEYS = {"shard", "planned", "units", "interrupted", "cases_run", "cases_planned", "workers", "backend",
               "profile", "wall_s", "hints"}


class _Slice(NamedTuple):
    index: int  # I of --shard I/N
    count: int  # N
    path: Path
    table: pa.Table
    meta: dict

    @property
    def run(self) -> dict:
        return self.meta["run"]


def merge(paths: list[str | os.PathLike]) -> pa.Table:
    """The report one run would have written, from the reports of its ``--shard I/N`` slices
    (parity or gate): every slice present once, the same settings, rows in the whole run's order
    (parity: the planned case order; gate: the suite's units). A file that is no slice of the
    same run is a UsageError naming it."""
    if not paths:
        raise UsageError("report merge needs the reports of a run's slices (--shard I/N)")
    slices = []
    for path in paths:
        table, meta = read(path)
        if meta["kind"] not in ("parity", "gate"):
            raise UsageError(f"{path} is a {meta['kind']} report; report merge joins parity and gate reports")
        i, _, n = str(meta["run"].get("shard", "")).partition("/")
        if not (i.isdigit() and n.isdigit()):
            raise UsageError(f"{path} is not a slice of a run (it was written without --shard I/N)")
        slices.append(_Slice(int(i), int(n), Path(path), table, meta))
    slices.sort(key=lambda sl: sl.index)
    first = slices[0]
    kind, count = first.meta["kind"], first.count
    same = {k: v for k, v in first.run.items() if k not in _SLICE_KEYS}
    seen: dict[int, Path] = {}
    for sl in slices:
        if sl.meta["kind"] != kind or sl.count != count:
            raise UsageError(f"{sl.path} is slice {sl.index}/{sl.count} of a {sl.meta['kind']} run; {first.path} "
                             f"is slice {first.index}/{count} of a {kind} run")
        if sl.index in seen:
            raise UsageError(f"{sl.path} and {seen[sl.index]} are both slice {sl.index}/{count}")
        seen[sl.index] = sl.path
        other = {k: v for k, v in sl.run.items() if k not in _SLICE_KEYS}
        if other != same or (kind == "parity" and sl.run.get("planned") != first.run.get("planned")):
            diff = sorted(k for k in set(other) | set(same) if other.get(k) != same.get(k)) or ["planned"]
            raise UsageError(f"{sl.path} is a slice of another run than {first.path} (settings differ: {', '.join(diff)})")
    missing = [f"{i}/{count}" for i in range(1, count + 1) if i not in seen]
    if missing:
        raise UsageError(f"slice(s) {', '.join(missing)} missing: a merged report has every slice of the run")
    keyed = []  # (position in the whole run, slice, row within the slice, row)
    if kind == "parity":
        order = {cid: k for k, cid in reversed(list(enumerate(first.run["planned"])))}
        for sl in slices:
            keyed += [(order.get(r["case_id"], len(order)), sl.index, j, r) for j, r in enumerate(sl.table.to_pylist())]
    else:
        for sl in slices:
            units = sl.run.get("units") or []
            if len(units) != sl.table.num_rows:
                raise UsageError(f"{sl.path}: a gate slice without the units of its rows")
            keyed += [(u, sl.index, j, r) for j, (u, r) in enumerate(zip(units, sl.table.to_pylist()))]
    keyed.sort(key=lambda t: t[:3])
    run = {**same, "interrupted": any(sl.run.get("interrupted") for sl in slices),
           "merged_from": [{"shard": f"{sl.index}/{count}", "file": str(sl.path),
                            "run_id": sl.table.column("run_id")[0].as_py() if sl.table.num_rows else None,
                            "gpu": sl.meta["environment"].get("gpu"), "host": sl.meta["environment"].get("host")}
                           for sl in slices]}
    if kind == "parity":
        profile: dict = {}
        for sl in slices:  # the phases' seconds, summed over the slices
            for k, v in (sl.run.get("profile") or {}).items():
                profile[k] = round(profile.get(k, 0.0) + v, 4)
        run |= {"cases_run": sum(int(sl.run.get("cases_run", 0)) for sl in slices),
                "cases_planned": len(first.run["planned"]), "profile": profile}
    return to_table([r for *_, r in keyed], new_run_id(), kind, first.meta["environment"], run,
                    schema=pa.schema(list(first.table.schema)))
