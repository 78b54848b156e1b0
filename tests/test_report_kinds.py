"""`report show` and `report compare` on every report kind: no traceback on any pair, the same
kind compared row by row (paths reduced to file names), two kinds refused with exit 2."""
import itertools
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mhctool.cli import app

HERE = Path(__file__).resolve().parent
GOLDENS = HERE / "data" / "goldens" / "gpt3_mcore_te_tp2_pp2_mhc"
runner = CliRunner()


def _run(*args):
    res = runner.invoke(app, [str(a) for a in args])
    return res, " ".join(res.output.split())


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """One small report of every kind, each written twice (two runs to compare)."""
    d = tmp_path_factory.mktemp("kinds")
    suite = d / "suite.toml"
    suite.write_text(f'name = "g"\n[[goldens_check]]\nfile = "{GOLDENS / "golden_values_dev_dgx_h100.pr3828.json"}"\n'
                     f'[[goldens]]\ngolden = "{GOLDENS / "golden_values_dev_dgx_h100.dev.json"}"\n'
                     f'actual = "{GOLDENS / "golden_values_dev_dgx_h100.pr3828.json"}"\n')
    commands = {
        "parity": ["parity", "--kernel", "sinkhorn", "--impl", "torch", "--dtype", "fp32", "--shape", "5x3x2x1",
                   "--device", "cpu", "-q"],
        "gate": ["gate", "--suite", suite, "--no-isolate", "-q", "--junit", d / "g.xml", "--summary", d / "g.md"],
        "identify": ["identify", "--kernel", "h_aggregate", "--impl", "torch", "--device", "cpu", "-q"],
        "train": ["train", "--impl", "torch", "--steps", "3", "--layers", "1", "--seq", "8", "--device", "cpu", "-q"],
        "stability-gain": ["stability", "gain", "--tokens", "8", "--depth", "4", "--device", "cpu", "-q"],
    }
    out = {}
    for kind, args in commands.items():
        for i in (1, 2):
            path = d / f"{kind}-{i}.parquet"
            res, text = _run(*args, "-o", path)
            assert res.exit_code in (0, 1), (kind, text)
            out.setdefault(kind, []).append(path)
    return out


@pytest.mark.parametrize("kind", ["parity", "gate", "identify", "train", "stability-gain"])
def test_show_and_compare_every_kind(reports, kind, tmp_path):
    a, b = reports[kind]
    res, text = _run("report", "show", b)
    assert res.exit_code == 0 and "Traceback" not in text, text
    assert f"{kind} report" in text
    res, text = _run("report", "compare", a, b, "--json", tmp_path / "c.json")
    assert res.exit_code == 0, text
    # the same command twice: nothing flipped (a time may have grown: train's iteration-time)
    assert f"both {kind} reports have" in text or f"{kind}: " in text and "0 now failing" in text, text
    data = json.loads((tmp_path / "c.json").read_text())
    assert data["kind"] == kind and data["matched"] > 0 and data["only_before"] == data["only_after"] == []


def test_show_says_what_each_kind_holds(reports):
    assert "checks failed" in _run("report", "show", reports["gate"][0])[1]
    assert "candidates tried" in _run("report", "show", reports["identify"][0])[1]
    assert "impl: lm loss" in _run("report", "show", reports["train"][0])[1]


def test_two_kinds_are_not_compared(reports):
    for x, y in itertools.combinations(sorted(reports), 2):
        res, text = _run("report", "compare", reports[x][0], reports[y][0])
        assert res.exit_code == 2 and "compares two reports of one kind" in text and "Traceback" not in text


def test_rows_one_report_has_alone_are_counted(tmp_path):
    """A passing report of one implementation against a report of another: the rows of each are
    counted and named, never silently left out."""
    args = ["parity", "--kernel", "sinkhorn", "--dtype", "fp32", "--shape", "5x3x2x1", "--device", "cpu", "-q"]
    _run(*args, "--impl", "torch", "-o", tmp_path / "a.parquet")
    _run(*args, "--impl", str(HERE / "impls" / "correct.py:sinkhorn"), "-o", tmp_path / "b.parquet")
    res, text = _run("report", "compare", tmp_path / "a.parquet", tmp_path / "b.parquet")
    assert res.exit_code == 0, text
    assert "rows only in the later report, not compared; first: sinkhorn/correct.py:sinkhorn/" in text


def test_a_log_that_is_no_terminal_gets_progress_lines(tmp_path):
    """In a CI log (stderr no terminal), a line every few seconds: cases done of how many, the
    time, what runs now; and one at the end."""
    import subprocess
    import sys
    import os
    res = subprocess.run([sys.executable, "-c", "from mhctool.cli import main; main()", "parity", "--kernel", "sinkhorn",
                          "--impl", "torch", "--dtype", "fp32", "--device", "cpu", "-o", str(tmp_path / "p.parquet")],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "MHCTOOL_PROGRESS_SECONDS": "0.2"})
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("parity: ")]
    assert lines and lines[-1].startswith("parity: 20/20 cases done"), res.stderr


def test_the_gate_summary_groups_failures_by_implementation_and_caps_them():
    from mhctool.gate import MARKDOWN_CAP, Case, markdown
    cases = [Case("p", "parity", f"sinkhorn//abs/dir/my_k.py:sk/random/fp32/{s}x2x4x1/fwd", False, "worst")
             for s in range(MARKDOWN_CAP + 3)]
    cases.append(Case("p", "parity", 'h_post_bda/triton/random/bf16/13x3x4x67/{"bias": true}/bwd', False, "x"))
    md = markdown("s", cases)
    assert f"**p**: `my_k.py:sk` on sinkhorn ({MARKDOWN_CAP + 3} failed)" in md
    assert "... and 3 more" in md and "/abs/dir" not in md
    assert "**p**: `triton` on h_post_bda (1 failed)" in md
