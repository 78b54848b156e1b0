"""`report show` and `report compare` on every report kind: no traceback on any pair, the same
kind compared row by row (paths reduced to file names), two kinds refused with exit 2."""
import itertools
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mhctool.cli.app import app

HERE = Path(__file__).resolve().parents[1]
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
        "train": ["train", "--impl", "torch", "--steps", "3", "--layers", "1", "--seq", "8", "--device", "cpu", "--seeds", "2", "--workers", "1",
                  "-q"],
        "stability-gain": ["stability", "gain", "--tokens", "8", "--depth", "4", "--device", "cpu", "-q"],
        "stability": ["stability", "sinkhorn", "--quick", "--iters", "1,20", "--dtype", "fp32", "--device", "cpu", "-q"],
        "bench": ["bench", "--device", "cpu", "--shape", "4x2x4x64", "--kernel", "sinkhorn", "--impl", "torch",
                  "--repeats", "3", "-q"],
    }
    out = {}
    for kind, args in commands.items():
        for i in (1, 2):
            path = d / f"{kind}-{i}.parquet"
            res, text = _run(*args, "-o", path)
            assert res.exit_code in (0, 1), (kind, text)
            out.setdefault(kind, []).append(path)
    return out


KINDS = ["parity", "gate", "identify", "train", "stability-gain", "stability", "bench"]


@pytest.mark.parametrize("kind", KINDS)
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
    assert "impl seed 0: lm loss" in _run("report", "show", reports["train"][0])[1]


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
    res = CliRunner().invoke(app, ["parity", "--kernel", "sinkhorn", "--impl", "torch", "--dtype", "fp32", "--device",
                                   "cpu", "-o", str(tmp_path / "p.parquet")], env={"MHCTOOL_PROGRESS_SECONDS": "0.2"})
    lines = [ln for ln in res.output.splitlines() if ln.startswith("parity: ") and "cases done" in ln]
    assert lines and lines[-1].startswith("parity: 20/20 cases done"), res.output


def test_the_gate_summary_groups_failures_by_implementation_and_caps_them():
    from mhctool.analyses.gate import MARKDOWN_CAP, Case, markdown
    cases = [Case("p", "parity", f"sinkhorn//abs/dir/my_k.py:sk/random/fp32/{s}x2x4x1/fwd", False, "worst")
             for s in range(MARKDOWN_CAP + 3)]
    cases.append(Case("p", "parity", 'h_post_bda/triton/random/bf16/13x3x4x67/{"bias": true}/bwd', False, "x"))
    md = markdown("s", cases)
    assert f"**p**: `my_k.py:sk` on sinkhorn ({MARKDOWN_CAP + 3} failed)" in md
    assert "... and 3 more" in md and "/abs/dir" not in md
    assert "**p**: `triton` on h_post_bda (1 failed)" in md


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_as_one_html_page(reports, kind, tmp_path):
    """report html: one self-contained page (figures inline, nothing fetched), the verdict first."""
    res, text = _run("report", "html", reports[kind][0], "-o", tmp_path / "r.html")
    assert res.exit_code == 0, text
    page = (tmp_path / "r.html").read_text()
    assert page.startswith("<!doctype html>") and f"mhctool {kind} report" in page
    assert "http://" not in page and "https://" not in page and "<script" not in page
    if kind in ("parity", "train", "stability-gain", "stability", "bench"):  # the command's figures, inline
        assert "src='data:image/png;base64," in page
    if kind == "parity":
        assert "PASSED</span>" in page and "parity-sinkhorn.png" in page


def test_a_json_report_is_the_same_report(reports, tmp_path):
    """-o x.json on any command: one strict-JSON document (summary, verdicts, rows) that report
    show, compare and html read as they read the Parquet file."""
    from mhctool.core import report
    table, meta = report.read(reports["parity"][0])
    path = report.write_atomic(table, tmp_path / "p.json")
    doc = json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
    assert doc["mhctool"]["kind"] == "parity" and doc["summary"]["ok"] is True
    assert doc["summary"]["passed"] == len(doc["verdicts"]) > 0 and len(doc["rows"]) == table.num_rows
    again, meta2 = report.read(path)
    assert again.equals(table) and meta2 == meta
    res, text = _run("report", "compare", reports["parity"][0], path)
    assert res.exit_code == 0 and "nothing got worse" in text, text
    # written by the command itself
    res, text = _run("parity", "--kernel", "sinkhorn", "--impl", "torch", "--dtype", "fp32", "--shape", "5x3x2x1",
                     "--device", "cpu", "-q", "-o", tmp_path / "cmd.json")
    assert res.exit_code == 0 and json.loads((tmp_path / "cmd.json").read_text())["summary"]["failed"] == 0
    (tmp_path / "cut.json").write_text(path.read_text()[:200])
    res, text = _run("report", "show", tmp_path / "cut.json")
    assert res.exit_code == 2 and "not a readable mhctool JSON report" in text


def test_compare_writes_junit_and_markdown_for_ci(reports, tmp_path):
    """A verdict that flipped: a failed JUnit test and a Markdown row saying so, exit 1; rows only
    one report has are skipped tests, never dropped."""
    import xml.etree.ElementTree as ET

    import pyarrow as pa

    from mhctool.core import report
    table, _ = report.read(reports["parity"][0])
    rows = table.to_pylist()
    hit = next(i for i, r in enumerate(rows) if r["rule"] and r["rule"].startswith("baseline tol")
               and r["direction"] == "fwd")
    rows[hit] = {**rows[hit], "value": (rows[hit]["threshold"] or 1.0) * 10, "passed": False, "message": "planted"}
    worse = pa.Table.from_pylist(rows[:-3], schema=table.schema)  # and three rows gone
    report.write_atomic(worse, tmp_path / "b.parquet")
    res, text = _run("report", "compare", reports["parity"][0], tmp_path / "b.parquet",
                     "--junit", tmp_path / "c.xml", "--summary", tmp_path / "c.md")
    assert res.exit_code == 1, text
    root = ET.parse(tmp_path / "c.xml").getroot()
    failures = root.findall(".//failure")
    assert len(failures) == 1 and "now failing: planted" in failures[0].get("message")
    assert len(root.findall(".//skipped")) == 3
    md = (tmp_path / "c.md").read_text()
    assert "## mhctool report compare (parity): FAILED" in md and "❌ pass → fail" in md
    assert "3 only in the earlier report" in md


def test_the_gate_carries_parity_s_hint(tmp_path):
    """A failed outside implementation in a gate gets parity's hint: printed, in the JUnit failure,
    under its group in the Markdown, and in the report (report html shows it)."""
    suite = tmp_path / "s.toml"
    suite.write_text(f'name = "h"\n[[parity]]\nname = "sk"\nkernel = "sinkhorn"\n'
                     f'impls = ["{HERE / "impls" / "conventions.py"}:sinkhorn_softmax_first"]\n'
                     f'dtypes = ["fp32"]\ndevice = "cpu"\n')
    res, text = _run("gate", "--suite", suite, "--no-isolate", "-q", "--junit", tmp_path / "g.xml",
                     "--summary", tmp_path / "g.md", "-o", tmp_path / "g.parquet")
    assert res.exit_code == 1, text
    hint = "hint: conventions.py:sinkhorn_softmax_first fails on sinkhorn but passes with --convention stabilize=softmax"
    assert hint in text
    assert hint in (tmp_path / "g.xml").read_text() and f"> {hint}" in (tmp_path / "g.md").read_text()
    from mhctool.core import report
    assert any(h.startswith(hint) for h in report.read(tmp_path / "g.parquet")[1]["run"]["hints"])


def test_compare_pairs_a_renamed_implementation_and_never_passes_what_it_could_not_match(tmp_path):
    """A kernel and its fixed version under another name: without --pair most rows match nothing,
    which fails (exit 1) instead of 'nothing got worse'; with --pair OLD=NEW the rows are matched
    and the fix's improvement is no flip."""
    impls = Path(__file__).resolve().parents[1] / "impls"
    (tmp_path / "old.py").write_text((impls / "defects.py").read_text())
    (tmp_path / "new.py").write_text((impls / "correct.py").read_text())
    paths = {}
    for name, fn in (("a", "old.py:sinkhorn_eps_1e8"), ("b", "new.py:sinkhorn")):
        paths[name] = tmp_path / f"{name}.parquet"
        _run("parity", "--kernel", "sinkhorn", "--device", "cpu", "--dtype", "fp32", "--shape", "9x2x4x1",
             "--impl", tmp_path / fn, "-o", paths[name], "-q", "--no-hint")
    res, text = _run("report", "compare", paths["a"], paths["b"])
    assert res.exit_code == 1, text
    assert "have no match in the later one: not compared, so not passed" in text and "nothing got worse" in text
    res, text = _run("report", "compare", paths["a"], paths["b"], "--pair", "old.py:sinkhorn_eps_1e8=new.py:sinkhorn")
    assert res.exit_code == 0, text
    assert "have no match" not in text
    res, text = _run("report", "compare", paths["a"], paths["b"], "--pair", "nonsense")
    assert res.exit_code == 2 and "malformed --pair" in text


def test_parity_says_when_it_identifies_a_failed_kernel_for_its_hint(tmp_path):
    """The hint's identification takes seconds to a minute after the cases are done: a line says
    what runs (stderr; -q leaves it out), before the hint."""
    spec = str(Path(__file__).resolve().parents[1] / "impls" / "conventions.py") + ":sinkhorn_softmax_first"
    args = ["parity", "--kernel", "sinkhorn", "--dtype", "fp32", "--device", "cpu", "--shape", "9x2x4x1",
            "--impl", spec]
    res, text = _run(*args, "-o", tmp_path / "a.parquet")
    assert "parity: identifying conventions.py:sinkhorn_softmax_first on sinkhorn for a hint" in text, text
    assert text.index("parity: identifying") < text.index("hint: ")
