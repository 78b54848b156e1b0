"""The commands' runs (mhctool.analyses.runs): a request in, an outcome out, the report written once
with what the run found, also when a second interrupt lands after the cases."""
import json
import os
import signal
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from mhctool.analyses.runs import Watch
from mhctool.analyses.runs import parity as run
from mhctool.core import report
from mhctool.core.errors import UsageError

DEFECT = str(Path(__file__).parents[1] / "impls" / "defects.py") + ":sinkhorn_eps_1e8"


def _scenario(tmp_path):
    sc = tmp_path / "sc.toml"
    sc.write_text('name = "runs"\n[[cases]]\nkernel = "sinkhorn"\nshapes = ["9x1x4x3"]\n'
                  'families = ["dead_rows_cols"]\ndtypes = ["fp32"]\n')
    return str(sc)


def _writes(monkeypatch) -> list:
    written = []
    real = report.write_atomic
    monkeypatch.setattr(report, "write_atomic", lambda table, path: written.append(path) or real(table, path))
    return written


def test_a_failing_outside_kernel_gives_an_outcome_and_one_report_with_its_hint(tmp_path, monkeypatch):
    monkeypatch.setattr(run, "find_hints", lambda pl, vs, *a: [("sinkhorn", vs[0]["impl"], "hint: a stand-in's hint")])
    written = _writes(monkeypatch)
    seen = {"planned": [], "started": 0, "finished": 0}
    watch = Watch(planned=seen["planned"].append, started=lambda *a: seen.__setitem__("started", seen["started"] + 1),
                  finished=lambda: seen.__setitem__("finished", seen["finished"] + 1))
    out = tmp_path / "r.parquet"
    o = run.run(run.Request("sinkhorn", [DEFECT], scenario=_scenario(tmp_path), device="cpu", out=out), watch)
    assert written == [out] and o.report == out  # once, with everything found
    meta = json.loads(pq.read_table(out).schema.metadata[b"mhctool.run"])
    assert meta["hints"] == o.hints == ["hint: a stand-in's hint"] and meta["kernel"] == "sinkhorn"
    assert o.failed and o.exit_code == 1 and o.outside == [DEFECT] and o.counts_of(DEFECT)[1] > 0
    assert seen == {"planned": [1], "started": 1, "finished": 1}


def test_a_second_interrupt_while_hinting_keeps_the_cases_rows(tmp_path, monkeypatch):
    """Two signals while the hints are found: the cases' rows are written all the same, marked
    interrupted there, with no hint, and the exit code says so."""
    def stopped(*args):
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
        raise AssertionError("the second signal stops the hints at once")
    monkeypatch.setattr(run, "find_hints", stopped)
    out = tmp_path / "r.parquet"
    o = run.run(run.Request("sinkhorn", [DEFECT], scenario=_scenario(tmp_path), device="cpu", out=out))
    table, meta = report.read(out)
    assert table.num_rows > 0 and "hints" not in meta["run"]
    assert meta["run"]["interrupted"] is True and meta["run"]["interrupted_in"] == "hints" and o.exit_code == 130


def test_a_bad_request_is_one_sentence_before_any_case_runs(tmp_path, monkeypatch):
    written = _writes(monkeypatch)
    with pytest.raises(UsageError, match="--convention pigeon is no convention of sinkhorn"):
        run.run(run.Request("sinkhorn", [DEFECT], scenario=_scenario(tmp_path), device="cpu",
                            conventions=[("pigeon", "1")], out=tmp_path / "r.parquet"))
    assert written == []
