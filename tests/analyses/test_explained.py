"""identify's explanations checked against its own numbers (issue 100): the five stand-ins in
impls/explained.py, each asked three ways, get the conclusion their behaviour earns, and every
sentence printed is a claim in the report whose check held."""
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mhctool.cli.app import app
from mhctool.core import report

EXPLAINED = Path(__file__).resolve().parents[1] / "impls" / "explained.py"
runner = CliRunner()


def identify(tmp_path, kernel, fn, *extra):
    out = tmp_path / "id.parquet"
    res = runner.invoke(app, ["identify", "--kernel", kernel, "--impl", f"{EXPLAINED}:{fn}", "--device", "cpu", "-q",
                              "-o", str(out), *map(str, extra)])
    text = " ".join(res.output.split())
    _, meta = report.read(out)
    claims = meta["run"]["claims"]
    # every sentence printed is a claim whose check held; nothing printed that did not
    said = [c["text"] for c in claims if c["held"]]
    for c in claims:
        assert (" ".join(c["text"].split()) in text) == c["held"], (c, text)
    assert said and all(c["check"] for c in claims)
    return res, text, claims


@pytest.mark.parametrize("ask", [(), ("--knob", "eps=0"), ("--knob", "iters=20")], ids=["nothing", "eps", "iters"])
def test_an_early_stop_is_named_with_its_tolerance_and_counts_not_blamed_on_rounding(tmp_path, ask):
    res, text, _ = identify(tmp_path, "sinkhorn", "sinkhorn_log_early_stop", *ask)
    assert res.exit_code == 0, text
    assert "best match: stabilize=rowmax eps_mode=add order=row_first iters=20 eps=0 domain=log tol=1e-06" in text
    assert "it stops early, each matrix once its row and column sums are within 1e-06 of one, at most iters=20" in text
    assert "the float64 run stopped early in" in text and "iterations" in text
    assert "rounds as native's" not in text and "--convention tol=1e-06" in text


@pytest.mark.parametrize("ask", [(), ("--knob", "eps=0"), ("--knob", "order=col_first")], ids=["nothing", "eps", "order"])
def test_an_absolute_floor_on_the_exponentials_is_what_its_finite_outputs_fit(tmp_path, ask):
    res, text, claims = identify(tmp_path, "sinkhorn", "sinkhorn_exp_floor", *ask)
    assert res.exit_code == 1, text
    assert "no convention fits: 1024 of 1024 outputs non-finite on large_logits" in text
    assert "its finite outputs fit stabilize=none eps_mode=add order=row_first exp_floor=1e-10 iters=20 eps=0" in text
    first = next(c for c in claims if c["kind"] == "identification")
    assert first["held"] and "within 8x" in first["check"]


@pytest.mark.parametrize("ask", [(), ("--knob", "transpose_res=true"), ("--knob", "bias=false")],
                         ids=["nothing", "transpose", "no-bias"])
def test_where_no_convention_fits_no_precision_is_claimed(tmp_path, ask):
    res, text, claims = identify(tmp_path, "h_post_bda", "h_post_bda_scaled_mix", *ask)
    assert res.exit_code == 1, text
    assert "no convention fits" in text
    assert "multiplies" not in text and "bf16 operands" not in text and "matmul_precision" not in text
    # the precision the fit reached is kept in the report, unsaid, with why
    unsaid = [c for c in claims if c["kind"] == "precision"]
    assert unsaid and not any(c["held"] for c in unsaid)
    assert all(c["check"] == "no convention fits, so no precision is identified" for c in unsaid)


@pytest.mark.parametrize("ask", [(), ("--matmul-precision", "tf32"), ("--matmul-precision", "bf16")],
                         ids=["nothing", "tf32", "bf16"])
def test_a_precision_asked_for_is_not_claimed_where_the_outputs_are_nearer_fp32(tmp_path, ask):
    res, text, _ = identify(tmp_path, "h_aggregate", "h_aggregate_fp32", *ask)
    assert res.exit_code == 0, text
    assert "best match: the contract" in text
    assert "multiplies at TF32" not in text and "bf16 operands" not in text and "--matmul-precision" not in text
    if ask:
        assert (f"asked at matmul_precision={ask[1]}, it multiplies at IEEE fp32: its outputs are nearest those "
                "products and pass there") in text


def test_the_contracts_own_value_is_never_a_variant_and_a_dropped_ask_is_said(tmp_path):
    res, text, _ = identify(tmp_path, "h_post_bda", "h_post_bda_no_bias")
    assert res.exit_code == 0 and "best match: transpose_res=false" in text and "variant" not in text, text
    res, text, _ = identify(tmp_path, "h_post_bda", "h_post_bda_no_bias", "--knob", "transpose_res=true")
    assert "computes the contract's transpose_res=false, not the asked true (it takes no transpose_res parameter)" \
        in text and "variant" not in text, text
    res, text, _ = identify(tmp_path, "h_post_bda", "h_post_bda_no_bias", "--knob", "bias=true")
    assert "asked bias=true: dropped; it takes no bias input, so it was identified without one" in text, text


@pytest.mark.parametrize("stage", ["nothing near: fitting the rarer conventions too", "judging the best fits"])
def test_two_signals_during_the_search_still_write_the_report_marked_interrupted(tmp_path, stage):
    """timeout's SIGTERM and a Ctrl-C after it while identify searches the rarer knobs (or judges):
    the identification in hand is abandoned, the report is written, marked interrupted, exit 130."""
    import os
    import signal

    from mhctool.analyses.runs import Watch
    from mhctool.analyses.runs import identify as run

    def started(line, detail):
        if stage in line:
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGINT)
    out = tmp_path / "id.parquet"
    o = run.run(run.Request("sinkhorn", f"{EXPLAINED}:sinkhorn_exp_floor", device="cpu", out=out),
                Watch(started=started))
    assert o.exit_code == 130 and o.found == []
    _, meta = report.read(out)
    assert meta["run"]["interrupted"] is True and meta["run"]["claims"] == []
