"""Where a user waits, the command says what it does: in a log that is no terminal, a line every
few seconds (MHCTOOL_PROGRESS_SECONDS) with what is done of how much and what runs now."""
from pathlib import Path

from typer.testing import CliRunner

from mhctool.cli.app import app

DEFECTS = Path(__file__).resolve().parents[1] / "impls" / "defects.py"
cli = CliRunner()


def _lines(text: str, label: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith(f"{label}: ")]


def test_identify_says_which_stage_it_is_in_while_it_works(tmp_path, monkeypatch):
    monkeypatch.setenv("MHCTOOL_PROGRESS_SECONDS", "0.05")
    res = cli.invoke(app, ["identify", "--kernel", "sinkhorn", "--impl", f"{DEFECTS}:sinkhorn_eps_1e8",
                           "--device", "cpu", "-o", str(tmp_path / "i.parquet")])
    assert res.exit_code == 1, res.output  # a likely defect: fitted exactly (eps=1e-8 whatever it is asked), no flag
    text = " ".join(res.output.split())
    assert "runs 1e-08 whatever it is asked" in text and "likely a defect" in text, text
    assert "judge it with" not in text and "not a convention to declare" in text, text
    lines = _lines(res.output, "identify")
    assert lines[-1].startswith("identify: 1/1 implementations done"), res.output
    assert any("; now defects.py:sinkhorn_eps_1e8: fitting the conventions" in ln for ln in lines), res.output


def test_train_says_how_many_steps_are_done_while_it_trains(tmp_path, monkeypatch):
    monkeypatch.setenv("MHCTOOL_PROGRESS_SECONDS", "0.05")
    res = cli.invoke(app, ["train", "--device", "cpu", "--steps", "3", "--seeds", "1", "--layers", "1",
                           "--no-compare", "-o", str(tmp_path / "t.parquet")])
    assert res.exit_code == 0, res.output
    lines = _lines(res.output, "train")
    assert lines[-1].startswith("train: 3/3 steps done"), res.output
