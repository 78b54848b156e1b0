"""`mhctool gate` (mhctool.analyses.gate): the names a CI reads are the same in every checkout."""
import shutil
from pathlib import Path

import pyarrow.parquet as pq
from typer.testing import CliRunner

from mhctool.cli.app import app

IMPLS = Path(__file__).resolve().parents[1] / "impls"
runner = CliRunner()


def test_junit_markdown_and_report_names_hold_no_absolute_path(tmp_path):
    """A suite's own file (``mine.py:fn``, resolved against the suite's folder to run it) is named
    relative to that folder in the JUnit XML, the Markdown summary and the gate report."""
    shutil.copy(IMPLS / "defects.py", tmp_path / "mine.py")
    (tmp_path / "s.toml").write_text('name = "t"\n[[parity]]\nkernel = "sinkhorn"\nimpls = ["mine.py:sinkhorn_eps_1e8"]\n'
                                     'dtypes = ["fp32"]\n')
    res = runner.invoke(app, ["gate", "--suite", str(tmp_path / "s.toml"), "--device", "cpu", "-q", "--no-isolate",
                              "--junit", str(tmp_path / "g.xml"), "--summary", str(tmp_path / "g.md"),
                              "-o", str(tmp_path / "g.parquet")])
    assert res.exit_code == 1, res.output  # the eps defect fails
    xml, md = (tmp_path / "g.xml").read_text(), (tmp_path / "g.md").read_text()
    names = [r["name"] for r in pq.read_table(tmp_path / "g.parquet").to_pylist()]
    assert 'name="sinkhorn/mine.py:sinkhorn_eps_1e8/' in xml
    assert any(n.startswith("sinkhorn/mine.py:sinkhorn_eps_1e8/") for n in names)
    for text in (xml, md, *names):
        assert str(tmp_path) not in text


def test_a_step_entry_holds_each_variants_overhead_to_its_budget(tmp_path):
    """[[step]] (issue 91): bench --engine's step through the engine stand-in, the engine's path
    relative to the suite file; a variant over the budget is a failed case naming both step times."""
    shutil.copy(IMPLS / "engine_standin.py", tmp_path / "engine.py")
    (tmp_path / "s.toml").write_text(
        'name = "t"\n[[step]]\nengine = "engine.py:train"\nmax_overhead = 0\nvariants = ["torch"]\nsteps = 3\n'
        'warmup = 1\nrecipe = { layers = 1, hidden = 16, heads = 2, seq = 8, micro_batch = 2, global_batch = 4, '
        'vocab = 32 }\n')
    res = runner.invoke(app, ["gate", "--suite", str(tmp_path / "s.toml"), "--device", "cpu", "-q",
                              "--junit", str(tmp_path / "g.xml"), "--summary", str(tmp_path / "g.md"),
                              "-o", str(tmp_path / "g.parquet")])
    assert res.exit_code == 1, res.output
    rows = pq.read_table(tmp_path / "g.parquet").to_pylist()
    assert [(r["kind"], r["name"], r["passed"]) for r in rows] == [("step", "torch overhead", False)], rows
    assert rows[0]["entry"] == "step-engine.py:train"  # named as the suite writes it
    assert str(tmp_path) not in (tmp_path / "g.md").read_text() + (tmp_path / "g.xml").read_text()
    assert "against the baseline's" in rows[0]["message"] and "over the budget of 0%" in rows[0]["message"]


def test_a_step_entry_is_checked_before_anything_runs(tmp_path):
    shutil.copy(IMPLS / "engine_standin.py", tmp_path / "engine.py")
    for body, words in (('engine = "engine.py:train"\n', "max_overhead: required"),
                        ('engine = "engine.py:train"\nmax_overhead = 5\nrecipe = { steps = 4 }\n', "bench's to set"),
                        ('engine = "nothing.py:train"\nmax_overhead = 5\n', "nothing.py"),
                        ('engine = "engine.py:train"\nmax_overhead = "5%"\n', "max_overhead")):
        (tmp_path / "s.toml").write_text(f'name = "t"\n[[step]]\n{body}')
        res = runner.invoke(app, ["gate", "--suite", str(tmp_path / "s.toml"), "--device", "cpu", "-q"])
        assert res.exit_code == 2 and words in res.output, (body, res.output)
