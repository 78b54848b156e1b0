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
