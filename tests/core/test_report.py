"""Parquet schema, round trip, metadata, atomic writes, verdict summaries and compare."""
import math
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mhctool.core import report
from mhctool.core.combine import compare
from mhctool.core.findings import verdicts
from mhctool.core.errors import UsageError


def _row(**kw):
    base = dict(scenario="s", case_id="c1", kernel="sinkhorn", impl="torch", backend="torch",
                precision="ieee", family="random", dtype="fp32", dtype_out="fp32", shape="1x1x4x1",
                knobs="{}", seed=0, device="cpu", direction="fwd", tensor="out", metric="max_abs",
                value=1e-7, threshold=2e-7, passed=True, rule="kappa=2 x native", message=None)
    base.update(kw)
    return base


def test_round_trip_schema_and_metadata(tmp_path):
    rows = [_row(), _row(metric="ulp", threshold=None, passed=None, rule="info", value=3.0)]
    t = report.to_table(rows, "run1", "parity", {"torch": "x"}, {"kernel": "sinkhorn"})
    path = report.write_atomic(t, tmp_path / "sub" / "r.parquet")
    back, meta = report.read(path)
    assert back.schema.equals(report.SCHEMA, check_metadata=False)
    assert back.to_pylist()[0]["run_id"] == "run1"
    assert back.to_pylist()[1]["passed"] is None
    assert meta == {"schema_version": report.SCHEMA_VERSION, "kind": "parity",
                    "environment": {"torch": "x"}, "run": {"kernel": "sinkhorn"}}
    assert [p.name for p in path.parent.iterdir()] == ["r.parquet"]  # no temp file left behind


def test_atomic_write_leaves_old_file_on_failure(tmp_path, monkeypatch):
    path = tmp_path / "r.parquet"
    report.write_atomic(report.to_table([_row()], "a", "parity", {}), path)
    before = path.read_bytes()

    def boom(table, where):
        open(where, "wb").write(b"PAR1 half")
        raise KeyboardInterrupt

    monkeypatch.setattr(pq, "write_table", boom)
    with pytest.raises(KeyboardInterrupt):
        report.write_atomic(report.to_table([_row(value=1.0)], "b", "parity", {}), path)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["r.parquet"]


def test_reader_rejects_non_reports_and_newer_versions(tmp_path):
    with pytest.raises(UsageError, match="no report file"):
        report.read(tmp_path / "missing.parquet")
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"not parquet")
    with pytest.raises(UsageError, match="not a readable Parquet"):
        report.read(junk)
    plain = tmp_path / "plain.parquet"
    pq.write_table(pa.table({"a": [1]}), plain)
    with pytest.raises(UsageError, match="not an mhctool report"):
        report.read(plain)
    t = report.to_table([_row()], "a", "parity", {})
    meta = dict(t.schema.metadata)
    meta[b"mhctool.schema_version"] = b"99"
    newer = tmp_path / "newer.parquet"
    pq.write_table(t.replace_schema_metadata(meta), newer)
    with pytest.raises(UsageError, match="schema version 99"):
        report.read(newer)


def test_reader_accepts_added_columns(tmp_path):
    """A later version may add columns: this reader picks columns by name."""
    t = report.to_table([_row()], "a", "parity", {})
    t2 = t.append_column("new_col", pa.array([1.5])).replace_schema_metadata(t.schema.metadata)
    path = tmp_path / "r.parquet"
    pq.write_table(t2, path)
    back, _ = report.read(path)
    assert verdicts(back)[0]["passed"] is True


def test_verdicts_worst_and_failure():
    rows = [_row(), _row(metric="rel_l2", value=3e-7, threshold=2e-7, passed=False),
            _row(direction="bwd", tensor="*", metric="unsupported", value=math.nan, threshold=None,
                 passed=None, message="no backward")]
    vs = {v["direction"]: v for v in verdicts(report.to_table(rows, "r", "parity", {}))}
    assert vs["fwd"]["passed"] is False and vs["fwd"]["worst"]["metric"] == "rel_l2"
    assert vs["bwd"]["passed"] is None and vs["bwd"]["message"] == "no backward"


def test_compare_reports_what_got_worse():
    a = report.to_table([_row(), _row(metric="rel_l2", value=1e-7)], "a", "parity", {})
    b = report.to_table([_row(value=5e-7, passed=False), _row(metric="rel_l2", value=1.05e-7)], "b", "parity", {})
    c = compare(a, b, tolerance=0.1)
    worse = c.worse
    assert len(worse) == 1 and c.matched == 2 and not c.only_before and not c.only_after
    assert worse[0]["key"]["metric"] == "max_abs" and worse[0]["ratio"] == pytest.approx(5.0)
    assert worse[0]["passed_before"] is True and worse[0]["passed_after"] is False
