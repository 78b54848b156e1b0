"""--check determinism / batch-invariance: each check catches what it should and nothing else."""
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from mhctool.core import report
from mhctool.families import generate, get_family, input_families
from mhctool.runner import checks as repro
from mhctool.cli.app import app
from mhctool.runner.call import cast_inputs
from mhctool.core.shapes import parse_shape_for
from mhctool.testing import check_parity

IMPLS = Path(__file__).resolve().parents[1] / "impls"  # loaded by file path, never as a package
REPRO = IMPLS / "repro.py"
CHECKS = ("--check", "determinism", "--check", "batch-invariance")


def _parity(tmp_path, fn, *extra):
    out = tmp_path / f"{fn}.parquet"
    res = CliRunner().invoke(app, ["parity", "--kernel", "h_aggregate", "--impl", f"{REPRO}:{fn}", "--device", "cpu",
                                   "--dtype", "fp32", "--repeats-determinism", "5", "-o", str(out), *CHECKS, *extra])
    return res, report.read(out)[0].to_pylist()


def _failed_rules(rows, impl_suffix):
    return {r["rule"] for r in rows if r["impl"].endswith(impl_suffix) and r["passed"] is False}


@pytest.mark.parametrize("fn, code, failing", [
    ("random_order", 1, {"determinism"}),
    ("order_by_tokens", 1, {"batch-invariance"}),
    ("fixed", 0, set()),
])
def test_each_check_catches_exactly_its_defect(tmp_path, fn, code, failing):
    res, rows = _parity(tmp_path, fn)
    assert res.exit_code == code, res.output
    assert _failed_rules(rows, f":{fn}") == failing
    checked = [r for r in rows if r["impl"].endswith(f":{fn}") and r["rule"] in repro.CHECKS]
    assert {r["tensor"] for r in checked} == {"out", "grad_x", "grad_h_pre"}  # every per-token tensor
    if fn == "random_order":  # batch invariance cannot be judged on a tensor that changes run to run
        out_rows = [r for r in checked if r["rule"] == "batch-invariance" and r["tensor"] == "out"]
        assert all(r["passed"] is None and "not judged" in r["message"] for r in out_rows)
        msg = next(r["message"] for r in checked if r["passed"] is False)
        assert msg.startswith("nondeterministic: out differs in") and "ulp" in msg and "over 5 runs" in msg
    if fn == "order_by_tokens":
        msg = next(r["message"] for r in checked if r["passed"] is False)
        assert "not batch-invariant: out differs between the case's 39 tokens and" in msg
    # the float64 reference is checked too, and never decides the verdict
    ref = [r for r in rows if r["backend"] == "reference"]
    assert ref and {r["rule"] for r in ref} == set(repro.CHECKS) and all(r["passed"] is None for r in ref)
    assert "determinism on cpu" in res.output  # honest about the interpreter


def test_tensors_that_sum_over_tokens_are_left_out_and_said_so(tmp_path):
    r = check_parity("torch", "proj_rms", dtypes=["fp32"], families=["random"], device="cpu",
                     checks=["batch-invariance"])
    rows = [x for x in r.table.to_pylist() if x["rule"] == "batch-invariance" and x["impl"] == "torch"]
    left_out = {x["tensor"] for x in rows if x["message"] and "sums over tokens" in x["message"]}
    assert left_out == {"grad_weight"}
    assert {x["tensor"] for x in rows} == {"proj", "r", "grad_x2d", "grad_weight"}


def test_variants_hold_the_case_tokens_at_their_positions():
    for kernel, shape in [("h_post_bda", "13x3x4x67"), ("mapping", "13x3x4x67"), ("grouped_mlp", "37x64x96x5")]:
        fam = get_family(kernel)
        sh = parse_shape_for(fam.shape_kind, shape)
        fam_name = next(iter(input_families(kernel)))
        _, raw = generate(kernel, fam_name, sh, 0, {})
        _, raw2 = generate(kernel, fam_name, sh, 1, {})
        base, others = cast_inputs(fam, raw, "fp32", "cpu"), cast_inputs(fam, raw2, "fp32", "cpu")
        total = repro.token_count(fam, base)
        vs = repro.variants(fam, base, [], others, [])  # no upstream gradients: inputs only
        assert [v.label.split(" ")[0] for v in vs][:1] == ["1"] and len(vs) == 3
        for v in vs:
            for name, d in repro.TOKEN_DIMS[kernel].items():
                if name not in base or base[name] is None:
                    continue
                got = repro._flat(v.base[name], d)
                mine = v.positions >= 0
                assert torch.equal(got[mine], repro._flat(base[name], d)[v.positions[mine]])
                assert got.shape[0] == v.tokens
            for name in base:
                if name not in repro.TOKEN_DIMS[kernel] and name != repro.COUNTS:
                    assert v.base[name] is base[name]  # shared inputs: the same tensor
            if "m_splits" in base:
                assert int(v.base["m_splits"].sum()) == v.tokens
        assert vs[-1].tokens > total and (vs[-1].positions[:total] == torch.arange(total)).all()


def test_ulps():
    one = torch.tensor([1.0])
    assert repro.ulps(one, torch.nextafter(one, torch.tensor([2.0]))).item() == 1.0
    b = torch.tensor([1.0], dtype=torch.bfloat16)
    assert repro.ulps(b, torch.tensor([1.0078125], dtype=torch.bfloat16)).item() == 1.0
    nan = torch.tensor([float("nan")])
    assert repro.ulps(nan, nan).item() == 0.0 and bool(repro.same(nan, nan).all())


@pytest.mark.skipif(torch.cuda.is_available(), reason="Triton on the CPU needs the interpreter; GPU sessions leave it off")
def test_builtin_triton_h_aggregate_passes_both_checks_on_the_cpu(tmp_path):
    out = tmp_path / "t.parquet"
    sc = tmp_path / "sc.toml"  # an odd C and tokens; the long_c family's C of 4099 would add nothing here
    sc.write_text('name = "agg"\n[[cases]]\nkernel = "h_aggregate"\nshapes = ["13x3x4x67"]\ndtypes = ["fp32"]\n'
                  'families = ["random", "wide_range"]\n')
    res = CliRunner().invoke(app, ["parity", "--kernel", "h_aggregate", "--impl", "triton", "--device", "cpu",
                                   "--scenario", str(sc), "-o", str(out), *CHECKS])
    assert res.exit_code == 0, res.output
    rows = [r for r in report.read(out)[0].to_pylist() if r["impl"] == "triton" and r["rule"] in repro.CHECKS]
    assert rows and all(r["passed"] is True for r in rows)
    assert report.read(out)[1]["run"]["checks"] == ["determinism", "batch-invariance"]


@pytest.mark.parametrize("args, needle", [
    (["--check", "bogus"], "unknown check 'bogus'"),
    (["--check", "determinism", "--repeats-determinism", "1"], "repeats-determinism"),
])
def test_bad_checks_exit_2(tmp_path, args, needle):
    res = CliRunner().invoke(app, ["parity", "--kernel", "sinkhorn", "--device", "cpu", "-o", str(tmp_path / "r.parquet"),
                                   *args])
    assert res.exit_code == 2 and needle in res.output


def test_gate_suite_entry_with_checks(tmp_path):
    suite = tmp_path / "gate.toml"
    suite.write_text(f'''name = "repro"
[[parity]]
name = "agg-random-order"
kernel = "h_aggregate"
impls = ["{REPRO}:random_order"]
dtypes = ["fp32"]
device = "cpu"
checks = ["determinism"]
''')
    outs = ["--junit", str(tmp_path / "g.xml"), "--summary", str(tmp_path / "g.md"), "-o", str(tmp_path / "g.parquet")]
    res = CliRunner().invoke(app, ["gate", "--suite", str(suite), *outs, "--no-isolate"])
    assert res.exit_code == 1, res.output
    suite.write_text(suite.read_text().replace('checks = ["determinism"]', 'checks = ["sometimes"]'))
    res = CliRunner().invoke(app, ["gate", "--suite", str(suite), *outs])
    assert res.exit_code == 2 and "checks" in res.output
    suite.write_text(suite.read_text().replace('checks = ["sometimes"]', 'checks = "determinism"'))
    res = CliRunner().invoke(app, ["gate", "--suite", str(suite), *outs])
    assert res.exit_code == 2 and "must be a list" in res.output
