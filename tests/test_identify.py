"""`mhctool identify`: conventions told from defects, with implementations written for it."""
import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mhctool import registry, report
from mhctool.cli import app
from mhctool.identify import FP32_EPS, classify, identify

IMPLS = Path(__file__).resolve().parent / "impls"
ROOT = Path(__file__).resolve().parent.parent
runner = CliRunner()


def _impl(kernel, target):
    return registry.resolve_impls(kernel, [f"{IMPLS / target}"])[0]


# (kernel, implementation, the knobs it must be identified with, classification)
CONVENTIONS = [
    ("sinkhorn", "conventions.py:sinkhorn_softmax_first", {"stabilize": "softmax", "eps": 1e-6, "iters": 20},
     "known convention"),
    ("sinkhorn", "defects.py:sinkhorn_col_first", {"order": "col_first", "stabilize": "rowmax", "eps": 1e-6}, "variant"),
    ("sinkhorn", "defects.py:sinkhorn_eps_1e8", {"eps": 1e-8, "order": "row_first", "iters": 20}, "likely a defect"),
    ("sinkhorn", "conventions.py:sinkhorn_one_short", {"iters": 19, "eps": 1e-6}, "likely a defect"),
    ("sinkhorn", "conventions.py:sinkhorn_clamp", {"eps_mode": "clamp", "eps": 1e-6, "iters": 20}, "variant"),
    ("sinkhorn", "conventions.py:sinkhorn_log_domain", {"eps": 0.0, "domain": "log", "iters": 20}, "known convention"),
    ("sinkhorn", "correct.py:sinkhorn", {"stabilize": "rowmax", "eps_mode": "add", "order": "row_first", "iters": 20,
                                         "eps": 1e-6}, "as asked"),
    ("h_post_bda", "defects.py:h_post_bda_transposed", {"transpose_res": True, "bias": True}, "known convention"),
    ("h_post_bda", "correct.py:h_post_bda", {"transpose_res": False, "bias": True}, "as asked"),
    ("proj_rms", "defects.py:proj_rms_eps_in_sqrt", {"rms_eps": "inside", "eps": 1e-6}, "known convention"),
    ("proj_rms", "conventions.py:proj_rms_te", {"rms_eps": "inside", "eps": FP32_EPS}, "known convention"),
    ("mapping", "conventions.py:mapping_sigmoid_eps", {"compute_h_eps": 1e-6, "rms_eps": "outside", "eps": 1e-6},
     "known convention"),
    ("swiglu", "defects.py:swiglu_scale_before", {"scale_at": "input"}, "likely a defect"),
    ("clamped_swiglu", "conventions.py:clamped_swiglu_gate_only", {"clamp_at": "gate", "limit": 7.0}, "variant"),
    ("clamped_swiglu", "conventions.py:clamped_swiglu_limit_10", {"clamp_at": "both", "limit": 10.0}, "likely a defect"),
]


@pytest.mark.parametrize("kernel,target,knobs,level", CONVENTIONS, ids=[c[1] for c in CONVENTIONS])
def test_each_convention_is_identified_with_its_knobs(kernel, target, knobs, level):
    ident = identify(kernel, _impl(kernel, target))
    assert ident.passed, ident.line()
    for k, v in knobs.items():
        got = ident.best.knobs.get(k)
        assert got == pytest.approx(v, rel=1e-3) if isinstance(v, float) else got == v, (k, ident.line())
    assert ident.best.level == level, ident.best.note
    assert ident.line().startswith("best match: ")


@pytest.mark.parametrize("target", ["conventions.py:sinkhorn_bf16_sums", "conventions.py:sinkhorn_detached_sum"])
def test_a_defect_that_is_no_convention_fits_nothing(target):
    ident = identify("sinkhorn", _impl("sinkhorn", target))
    assert not ident.passed
    assert ident.line().startswith("no convention fits: closest ")
    # the detached sum has a right forward: the backward gives it away
    if "detached" in target:
        assert "grad_logits" in ident.best.worst and ident.best.max_rel < 1e-4


def test_classification_of_a_match_against_what_was_asked():
    asked = {"stabilize": "rowmax", "eps": 1e-6, "iters": 20, "order": "row_first"}
    assert classify("sinkhorn", dict(asked), asked)[0] == "as asked"
    level, note = classify("sinkhorn", {**asked, "iters": 19}, asked)
    assert level == "likely a defect" and note == "matches with iters=19 — asked for 20: likely a defect"
    level, note = classify("sinkhorn", {**asked, "stabilize": "softmax"}, asked)
    assert level == "known convention" and "Megatron-LM" in note
    assert classify("sinkhorn", {**asked, "eps": 0.0}, asked)[0] == "known convention"
    assert classify("sinkhorn", {**asked, "order": "col_first"}, asked)[0] == "variant"
    assert classify("sinkhorn", {**asked, "stabilize": "none"}, asked)[0] == "likely a defect"


def test_cli_prints_the_best_match_line_exits_0_and_reports_every_candidate(tmp_path):
    out = tmp_path / "id.parquet"
    res = runner.invoke(app, ["identify", "--kernel", "sinkhorn", "--impl", f"{IMPLS / 'conventions.py'}:sinkhorn_softmax_first",
                              "--device", "cpu", "-o", str(out)])
    assert res.exit_code == 0, res.output
    line = next(ln for ln in res.output.splitlines() if ln.startswith("best match:"))
    assert re.fullmatch(r"best match: stabilize=softmax eps_mode=add order=row_first iters=20 eps=1e-06 "
                        r"\(max_rel \d\.?\d*e-\d\d\)", line), line
    assert "--convention stabilize=softmax" in res.output
    table, meta = report.read(out)
    assert meta["kind"] == "identify"
    rows = table.to_pylist()
    assert len(rows) > 1000  # the sinkhorn grid alone: 3 x 2 x 2 x 7 knob sets x 16 eps values, less duplicates
    assert len({r["candidate"] for r in rows}) == len(rows)
    best = [r for r in rows if r["best"]]
    assert len(best) == 1 and best[0]["passed"] and json.loads(best[0]["candidate"])["stabilize"] == "softmax"
    assert {r["stage"] for r in rows} >= {"grid", "judged"}


def test_cli_exits_1_when_no_convention_fits(tmp_path):
    res = runner.invoke(app, ["identify", "--kernel", "sinkhorn", "--impl", f"{IMPLS / 'conventions.py'}:sinkhorn_bf16_sums",
                              "--device", "cpu", "-q", "-o", str(tmp_path / "id.parquet")])
    assert res.exit_code == 1, res.output
    assert "no convention fits: closest" in res.output


def test_asked_knobs_move_the_search(tmp_path):
    # asked for 10 iterations, the kernel runs 9: the range is around the asked value
    res = runner.invoke(app, ["identify", "--kernel", "sinkhorn", "--impl", f"{IMPLS / 'conventions.py'}:sinkhorn_one_short",
                              "--knob", "iters=10", "--device", "cpu", "-q", "-o", str(tmp_path / "id.parquet")])
    assert res.exit_code == 0, res.output
    assert "iters=9 " in res.output and "asked for 10: likely a defect" in res.output


@pytest.mark.parametrize("args,words", [
    (["--kernel", "nope"], "unknown kernel"),
    (["--kernel", "grouped_gemm"], "knows no conventions of grouped_gemm"),
    (["--kernel", "sinkhorn", "--knob", "iters"], "malformed --knob"),
    (["--kernel", "sinkhorn", "--knob", "colour=red"], "no knob of sinkhorn"),
    (["--kernel", "sinkhorn", "--dtype", "fp8"], "dtype"),
])
def test_bad_input_is_one_sentence_and_exit_2(tmp_path, args, words):
    res = runner.invoke(app, ["identify", *args, "--impl", "torch", "--device", "cpu", "-o", str(tmp_path / "x.parquet")])
    assert res.exit_code == 2, res.output
    assert words in res.output and "Traceback" not in res.output


def test_parity_points_the_way_for_a_failed_external(tmp_path):
    res = runner.invoke(app, ["parity", "--kernel", "sinkhorn", "--dtype", "fp32", "--device", "cpu", "-q",
                              "--impl", f"{IMPLS / 'conventions.py'}:sinkhorn_softmax_first", "-o", str(tmp_path / "p.parquet")])
    assert res.exit_code == 1
    assert "passes with --convention stabilize=softmax" in res.output
    res = runner.invoke(app, ["parity", "--kernel", "sinkhorn", "--dtype", "fp32", "--device", "cpu", "-q",
                              "--impl", f"{IMPLS / 'conventions.py'}:sinkhorn_one_short", "-o", str(tmp_path / "p.parquet")])
    assert "iters=19 — asked for 20: likely a defect" in res.output


TE_STAGED = ROOT / ".anchors" / "te"


@pytest.mark.skipif(not TE_STAGED.is_dir(), reason="TE is not staged (../shared/anchors/stage.sh te GIT_DIR)")
def test_transformer_engines_real_sinkhorn_is_identified(monkeypatch):
    # TE's own Triton kernel, unchanged, through the interpreter (n = 4, the default probe shape)
    monkeypatch.setenv("NVTE_DISABLE_TRITON_AUTOTUNING", "1")
    impl = registry.resolve_impls("sinkhorn", [f"te:{TE_STAGED}"])[0]
    # what its adapter declares (eps=0, judged against the log-domain baseline) is what it is asked for
    ident = identify("sinkhorn", impl)
    assert ident.passed, ident.line()
    assert ident.best.knobs["eps"] == 0.0 and ident.best.knobs["iters"] == 20
    assert ident.best.level == "as asked" and ident.fixed == {"domain": "log"}
    # asked for the contract instead (linear domain, eps 1e-6), it is found to compute TE's convention
    ident = identify("sinkhorn", impl, asked={"eps": 1e-6, "domain": "linear"})
    assert ident.passed, ident.line()
    assert ident.best.knobs["eps"] == 0.0
    assert ident.best.level == "known convention" and "TransformerEngine" in ident.best.note


def test_a_tf32_kernel_is_judged_at_the_precision_it_declares(tmp_path):
    # multiplies at TF32 by design: against the IEEE baseline no convention passes; told its
    # precision, it computes what it was asked for
    args = ["identify", "--kernel", "proj_rms", "--impl", f"{IMPLS / 'defects.py'}:proj_rms_tf32", "--device", "cpu",
            "-q", "-o", str(tmp_path / "id.parquet")]
    res = runner.invoke(app, args)
    assert res.exit_code == 1, res.output
    res = runner.invoke(app, args + ["--matmul-precision", "tf32"])
    assert res.exit_code == 0, res.output
    assert "best match: rms_eps=outside eps=1e-06" in res.output
    res = runner.invoke(app, args + ["--matmul-precision", "fp8"])
    assert res.exit_code == 2 and "unknown matmul precision" in res.output


def test_a_probe_shape_the_implementation_cannot_run_is_bad_input(tmp_path):
    # the TE stand-in takes n = 4 only: a probe shape with n = 3 is refused before anything runs
    res = runner.invoke(app, ["identify", "--kernel", "sinkhorn", "--impl", f"te:{IMPLS / 'te_standin'}",
                              "--shape", "8x2x3x1", "--device", "cpu", "-o", str(tmp_path / "x.parquet")])
    assert res.exit_code == 2, res.output
    assert "cannot run the probe shape" in res.output and "n = 4" in res.output


def test_the_hint_takes_what_the_adapter_declares_as_asked(tmp_path):
    # the TE stand-in's Sinkhorn runs one iteration short; its adapter declares eps=0 domain=log, so
    # the hint names the defect and not the declared conventions as something to declare
    res = runner.invoke(app, ["parity", "--kernel", "sinkhorn", "--dtype", "fp32", "--device", "cpu", "-q",
                              "--impl", f"te:{IMPLS / 'te_standin_defects'}", "-o", str(tmp_path / "p.parquet")])
    assert res.exit_code == 1, res.output
    hint = " ".join(res.output[res.output.index("hint:"):].split())
    assert "matches with iters=19 — asked for 20: likely a defect" in hint
    assert "eps=0" not in hint and "--convention" not in hint
