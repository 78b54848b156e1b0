"""`mhctool parity`, `report` and `doctor` through Typer's CliRunner."""
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from mhctool.core import report
from mhctool.core.findings import verdicts
from mhctool.cli.app import app
from mhctool.families import KERNELS

IMPLS = Path(__file__).resolve().parents[1] / "impls"  # loaded by file path, never as a package
DEFECTS = IMPLS / "defects.py"
runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def _failed_families(path, impl):
    vs = verdicts(report.read(path)[0])
    return {v["family"] for v in vs if v["impl"] == impl and v["passed"] is False}


@pytest.fixture(scope="module")
def all_report(tmp_path_factory):
    d = tmp_path_factory.mktemp("parity")
    res = run("parity", "--kernel", "all", "--device", "cpu", "--impl", "torch", "-o", d / "r.parquet")
    return res, d


def test_parity_all_native_passes_and_writes_the_report(all_report):
    res, d = all_report
    assert res.exit_code == 0, res.output
    assert "PASSED" in res.output
    table, meta = report.read(d / "r.parquet")
    assert meta["kind"] == "parity" and meta["run"]["device"] == "cpu"
    assert "torch" in meta["environment"] and "git_commit" in meta["environment"]
    assert meta["environment"]["git_dirty"] in (True, False, None)
    kernels = set(table.column("kernel").to_pylist())
    assert kernels == set(KERNELS)
    assert set(table.column("direction").to_pylist()) == {"fwd", "bwd"}


def test_plot_writes_one_figure_a_kernel(tmp_path):
    """--plot: a PNG per kernel of the report (two kernels here: a figure takes about half a second)."""
    res = run("parity", "--kernel", "sinkhorn,mapping", "--device", "cpu", "--impl", "torch", "-o",
              tmp_path / "r.parquet", "--plot", tmp_path / "plots")
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == ["parity-mapping.png", "parity-sinkhorn.png"]
    for p in (tmp_path / "plots").iterdir():
        assert p.stat().st_size > 10_000


def test_report_show_and_compare(all_report):
    _, d = all_report
    res = run("report", "show", d / "r.parquet")
    assert res.exit_code == 0 and "parity report" in res.output and "passed" in res.output
    res = run("report", "compare", d / "r.parquet", d / "r.parquet")
    assert res.exit_code == 0 and "nothing got worse" in res.output


@pytest.mark.parametrize("kernel,fn", [
    ("sinkhorn", "sinkhorn"), ("h_aggregate", "h_aggregate"), ("h_post_bda", "h_post_bda"), ("proj_rms", "proj_rms")])
def test_correct_external_written_differently_passes(tmp_path, kernel, fn):
    res = run("parity", "--kernel", kernel, "--device", "cpu", "--impl", f"{IMPLS / 'correct.py'}:{fn}",
              "-o", tmp_path / "r.parquet")
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize("kernel,fn,exposing,dtype", [
    ("sinkhorn", "sinkhorn_eps_1e8", "dead_rows_cols", "fp32"),
    ("sinkhorn", "sinkhorn_col_first", "near_perm", "fp32"),
    ("sinkhorn", "sinkhorn_no_max", "large_logits", "fp32"),
    ("sinkhorn", "sinkhorn_nan_last_token", "unit_random", "fp32"),
    ("proj_rms", "proj_rms_eps_in_sqrt", "tiny_norm", "fp32"),
    ("h_post_bda", "h_post_bda_transposed", "random", "fp32"),
    ("h_post_bda", "h_post_bda_bf16_bias_grad", "long_tokens", "bf16"),
    ("mapping", "mapping_alpha_grad_bf16", "random", "fp32"),
    ("mapping", "mapping_bias_grad_bf16", "random", "fp32"),
    ("swiglu", "swiglu_scale_before", "scale_extremes", "fp32"),
    ("swiglu", "swiglu_halves_swapped", "random", "bf16"),
    ("swiglu", "swiglu_ignores_interleave", "random", "bf16"),
    ("grouped_wgrad", "grouped_wgrad_overwrites_idle_experts", "zero_experts", "fp32"),
])
def test_defect_is_flagged_with_the_family_that_exposes_it(tmp_path, kernel, fn, exposing, dtype):
    impl = f"{DEFECTS}:{fn}"
    out = tmp_path / "r.parquet"
    res = run("parity", "--kernel", kernel, "--device", "cpu", "--impl", impl, "--dtype", dtype, "-o", out, "--no-hint")
    assert res.exit_code == 1, res.output
    assert "FAIL" in res.output
    assert exposing in _failed_families(out, impl)


def test_defect_details_name_the_tensor():
    """The bf16 bias-gradient defect fails on grad_bias only, in the backward."""
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "r.parquet"
        run("parity", "--kernel", "h_post_bda", "--device", "cpu", "--dtype", "bf16",
            "--impl", f"{DEFECTS}:h_post_bda_bf16_bias_grad", "-o", out)
        rows = pq.read_table(out).to_pylist()
    failed = {(r["direction"], r["tensor"]) for r in rows if r["passed"] is False}
    assert failed == {("bwd", "grad_bias")}


def test_external_errors_are_failed_cases_and_others_still_run(tmp_path):
    out = tmp_path / "r.parquet"
    res = run("parity", "--kernel", "sinkhorn", "--device", "cpu", "--impl", f"{DEFECTS}:sinkhorn_raises",
              "--impl", f"{DEFECTS}:sinkhorn_wrong_shape,{DEFECTS}:sinkhorn_wrong_dtype",
              "--impl", "torch", "-o", out)
    assert res.exit_code == 1
    rows = pq.read_table(out).to_pylist()
    msgs = {r["impl"].split(":")[1]: r["message"] for r in rows if r["metric"] == "error" and r["direction"] == "fwd"}
    assert "kernel launch failed" in msgs["sinkhorn_raises"]
    assert "shape" in msgs["sinkhorn_wrong_shape"]
    # another floating dtype is judged by value (float64 here: more precise, so it passes), and the
    # report names the dtype it came back in
    wrong_dtype = [r for r in rows if r["impl"].endswith("sinkhorn_wrong_dtype") and r["tensor"] == "out"]
    assert wrong_dtype and {r["dtype_out"] for r in wrong_dtype} == {"fp64"}
    assert all(r["passed"] is not False for r in wrong_dtype)
    assert any(r["impl"] == "torch" and r["passed"] is True for r in rows)


def test_outputs_are_conformed_by_value():
    import torch
    from mhctool.runner.call import conform_outputs
    from mhctool.families import get_family
    fam = get_family("proj_rms")
    expect = [((5, 24), torch.float32, "cpu"), ((5,), torch.float32, "cpu")]
    returned = {}
    outs, problem = conform_outputs(fam, [torch.zeros(5, 24, dtype=torch.bfloat16), torch.zeros(5, 1)],
                                           expect, returned)
    assert problem is None and outs[1].shape == (5,) and outs[0].dtype == torch.float32
    assert returned == {"proj": "bf16"}  # judged at fp32's threshold: a lower precision is not excused
    for bad, needle in (([torch.zeros(5, 23), torch.zeros(5)], "shape"),
                        ([torch.zeros(5, 24), torch.zeros(5, dtype=torch.int32)], "dtype"),
                        ([torch.zeros(5, 24)], "returned 1 outputs"),
                        ([torch.zeros(5, 24), 3.0], "not a tensor")):
        assert needle in conform_outputs(fam, bad, expect, {})[1]


def test_external_without_backward_is_unsupported_not_failed(tmp_path):
    out = tmp_path / "r.parquet"
    res = run("parity", "--kernel", "sinkhorn", "--device", "cpu", "--dtype", "fp32",
              "--impl", f"{DEFECTS}:sinkhorn_no_backward", "-o", out)
    assert res.exit_code == 0, res.output
    rows = [r for r in pq.read_table(out).to_pylist() if r["impl"].endswith("no_backward")]
    bwd = [r for r in rows if r["direction"] == "bwd"]
    assert bwd and all(r["metric"] == "unsupported" and r["passed"] is None for r in bwd)
    assert any(r["direction"] == "fwd" and r["passed"] is True for r in rows)


def test_an_external_that_takes_no_knob_is_said_to_ignore_it(tmp_path):
    sc = tmp_path / "s.toml"
    sc.write_text('name = "k"\n[[cases]]\nkernel = "sinkhorn"\nshapes = ["9x1x4x1"]\nfamilies = ["random"]\n'
                  '[cases.knobs]\norder = ["row_first", "col_first"]\n')
    out = tmp_path / "r.parquet"
    res = run("parity", "--kernel", "sinkhorn", "--device", "cpu", "--scenario", sc,
              "--impl", f"{DEFECTS}:sinkhorn_no_backward", "-o", out)
    assert res.exit_code == 0, res.output
    rows = [r for r in pq.read_table(out).to_pylist() if r["impl"].endswith("no_backward")]
    skipped = [r for r in rows if r["metric"] == "unsupported" and json.loads(r["knobs"])["order"] == "col_first"]
    assert skipped and "takes no order parameter, so it ignores order='col_first'" in skipped[0]["message"]
    assert "--convention order=VALUE" in skipped[0]["message"]


def test_tf32_external_is_judged_against_native_at_tf32(tmp_path):
    impl = f"{DEFECTS}:proj_rms_tf32"
    ieee = run("parity", "--kernel", "proj_rms", "--device", "cpu", "--impl", impl, "-o", tmp_path / "a.parquet")
    tf32 = run("parity", "--kernel", "proj_rms", "--device", "cpu", "--impl", impl, "--matmul-precision", "tf32",
               "-o", tmp_path / "b.parquet")
    assert ieee.exit_code == 1  # a TF32 product is far outside 2x the fp32 error
    assert tf32.exit_code == 0, tf32.output
    rows = pq.read_table(tmp_path / "b.parquet").to_pylist()
    assert {r["precision"] for r in rows if r["impl"] == impl} == {"tf32"}


@pytest.mark.parametrize("args,needle", [
    (["--kernel", "softmax"], "unknown kernel 'softmax'"),
    (["--kernel", "sinkhorn", "--shape", "8192x4x4"], "malformed shape '8192x4x4'"),
    (["--kernel", "h_aggregate", "--shape", "8192xfoo"], "malformed shape '8192xfoo'"),
    (["--kernel", "proj_rms", "--shape", "0x4x4x8"], "zero dimension"),
    (["--shape", "64x2x4x512"], "one form per kind of kernel"),
    (["--dtype", "fp8"], "unknown dtype 'fp8'"),
    (["--kernel", "sinkhorn", "--impl", "no_such_module_xyz:fn"], "cannot import module no_such_module_xyz"),
    (["--kernel", "sinkhorn", "--impl", "tests/impls/nope.py:fn"], "no file tests/impls/nope.py"),
    (["--kernel", "sinkhorn", "--impl", f"{DEFECTS}:no_such_fn"], "has no function no_such_fn"),
    (["--kernel", "sinkhorn", "--impl", "bogus"], "unknown implementation 'bogus'"),
    (["--impl", f"{DEFECTS}:sinkhorn_raises"], "needs one --kernel"),
    (["--scenario", "no_such_builtin"], "no built-in scenario"),
    (["--matmul-precision", "fp8"], "unknown --matmul-precision"),
    (["--device", "tpu"], "unknown device 'tpu'"),
])
def test_bad_input_is_one_sentence_and_exit_2(tmp_path, args, needle):
    res = run("parity", "--device", "cpu", *args, "-o", tmp_path / "r.parquet") if "--device" not in args else \
        run("parity", *args, "-o", tmp_path / "r.parquet")
    assert res.exit_code == 2, res.output
    assert needle in res.output
    assert "Traceback" not in res.output
    assert not (tmp_path / "r.parquet").exists()


def test_cuda_without_gpu_is_exit_2(tmp_path):
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    res = run("parity", "--device", "cuda", "-o", tmp_path / "r.parquet")
    assert res.exit_code == 2 and "no CUDA GPU" in res.output


def test_scenario_unknown_key_names_file_and_key(tmp_path):
    sc = tmp_path / "bad.toml"
    sc.write_text('name = "x"\n[[cases]]\nkernel = "sinkhorn"\nitters = 3\n')
    res = run("parity", "--device", "cpu", "--scenario", sc, "-o", tmp_path / "r.parquet")
    assert res.exit_code == 2
    assert str(sc) in res.output and "cases[0].itters" in res.output and "accepted" in res.output


def test_quiet_prints_only_the_summary(tmp_path):
    res = run("parity", "--kernel", "h_aggregate", "--device", "cpu", "--impl", "torch", "--dtype", "fp32",
              "--quiet", "-o", tmp_path / "r.parquet")
    assert res.exit_code == 0
    assert res.output.strip().count("\n") == 0 and "PASSED" in res.output


def test_doctor_lists_backends():
    res = run("doctor")
    assert res.exit_code == 0
    for name in ("torch", "compile", "triton", "cutile"):
        assert name in res.output


@pytest.mark.slow
def test_torch_compile_variant_passes(tmp_path):
    res = run("parity", "--kernel", "h_aggregate", "--device", "cpu", "--impl", "compile", "--dtype", "fp32",
              "-o", tmp_path / "r.parquet")
    assert res.exit_code == 0, res.output
    rows = pq.read_table(tmp_path / "r.parquet").to_pylist()
    assert any(r["impl"] == "compile" and r["backend"] == "compile" and r["passed"] for r in rows)


def test_kernel_groups_expand_in_order_once_each():
    from mhctool.analyses import parity as parity_mod
    from mhctool.core.errors import UsageError
    from mhctool.families import KERNELS, MHC_KERNELS, MOE_KERNELS

    assert parity_mod.kernels_of("all") == list(KERNELS)
    assert parity_mod.kernels_of("sinkhorn,mhc") == list(MHC_KERNELS)
    assert parity_mod.kernels_of(["moe"]) == list(MOE_KERNELS) and not set(MHC_KERNELS) & set(MOE_KERNELS)
    with pytest.raises(UsageError, match="or a group: all, mhc, moe"):
        parity_mod.kernels_of("mlp")


def test_a_checkout_that_differs_from_its_commit_says_so(tmp_path, monkeypatch):
    """git_dirty: a tracked file changed since the commit the report names (a checkout copied onto
    another machine beside an older .git named code that did not run)."""
    import subprocess

    from mhctool.core import environment
    repo = tmp_path / "repo"
    (repo / "mhctool").mkdir(parents=True)
    (repo / "mhctool" / "x.py").write_text("a = 1\n")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "x"], check=True)
    monkeypatch.setattr(environment, "__file__", str(repo / "mhctool" / "environment.py"))
    assert environment.git_commit() and environment.git_dirty() is False
    (repo / "mhctool" / "x.py").write_text("a = 2\n")
    assert environment.git_dirty() is True
    monkeypatch.setattr(environment, "__file__", str(tmp_path / "elsewhere" / "mhctool" / "environment.py"))
    assert environment.git_commit() is None and environment.git_dirty() is None


def test_no_hint_leaves_the_identification_out(tmp_path):
    """The same failing run with and without --no-hint: the verdicts alike, the hint (and the
    identification it runs) only without."""
    args = ["parity", "--kernel", "sinkhorn", "--device", "cpu", "--dtype", "fp32", "--shape", "9x2x4x1",
            "--impl", f"{DEFECTS}:sinkhorn_eps_1e8"]
    plain = run(*args, "-o", tmp_path / "a.parquet")
    quiet = run(*args, "-o", tmp_path / "b.parquet", "--no-hint")
    assert plain.exit_code == quiet.exit_code == 1
    assert "hint:" in plain.output and "hint:" not in quiet.output and "identifying" not in quiet.output
    verdicts = [[(r["family"], r["metric"], r["passed"]) for r in pq.read_table(tmp_path / n).to_pylist()]
                for n in ("a.parquet", "b.parquet")]
    assert verdicts[0] == verdicts[1]


def test_report_show_keeps_the_run_line_short_and_puts_each_hint_on_its_own_line():
    from mhctool.cli.report import SETTING_CHARS, settings_line
    run_ = {"command": "parity", "profile": {f"phase{k}": k for k in range(40)}, "hints": ["hint: try order=col_first"],
            "kappa": 2.0}
    line = settings_line(run_)
    assert "profile=...," in line and "kappa=2.0" in line and "hint" not in line and len(line) < 2 * SETTING_CHARS + 40
    assert line.endswith("(--settings: every one in full)")
    full = settings_line(run_, full=True)
    assert "phase39" in full and "hints=" in full and "--settings" not in full
