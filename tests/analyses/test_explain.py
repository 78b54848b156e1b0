"""Failures mhctool never saw, explained (issue 76): what identify and parity say of a kernel
whose forward fits nothing, that takes no bias, that saturates, whose backward needs aligned
channels, or whose library talks; each stand-in in impls/strangers.py (and impls/noisy.py) gets
its conclusion line and its exit code."""
import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from mhctool.cli.app import app

STRANGERS = Path(__file__).resolve().parents[1] / "impls" / "strangers.py"


def run(*args):
    res = CliRunner().invoke(app, [str(a) for a in args])
    return res, " ".join(res.output.split())


def identify(tmp_path, fn, kernel="sinkhorn"):
    return run("identify", "--kernel", kernel, "--impl", f"{STRANGERS}:{fn}", "--device", "cpu", "-q",
               "-o", tmp_path / "id.parquet")


def test_where_nothing_fits_the_backward_is_checked_against_its_own_forward(tmp_path):
    """A row softmax whose backward forgets the softmax's second term (no knob of mhctool's
    describes the forward): no convention fits it, and the backward is judged by directional finite
    differences of the kernel's own forward (autograd's agrees: below, and the saturating one)."""
    res, text = identify(tmp_path, "sinkhorn_rows_only_wrong_backward")
    assert res.exit_code == 1, text
    assert text.startswith("no convention fits"), text
    assert "its backward is not the derivative of its own forward (directional finite differences of " \
           "its forward, 3 of 3 directions, the worst differs by" in text


def test_an_h_post_bda_without_a_bias_is_judged_identified_and_timed_without_one(tmp_path):
    """A function with no bias parameter (issue 76): parity judges it on the cases without a bias
    and says why it skips the others; identify probes it without one and asks nothing of a bias;
    bench times it without one and says so."""
    sc = tmp_path / "sc.toml"
    sc.write_text('name = "nb"\n[[cases]]\nkernel = "h_post_bda"\nshapes = ["5x2x4x40"]\ndtypes = ["fp32"]\n'
                  'families = ["random", "wide_range"]\n[cases.knobs]\nbias = [true, false]\n')
    res, text = run("parity", "--kernel", "h_post_bda", "--impl", f"{STRANGERS}:h_post_bda_without_bias", "--device",
                    "cpu", "-q", "-o", tmp_path / "p.parquet", "--scenario", sc, "--no-hint")
    assert res.exit_code == 0, text
    rows = [r for r in pq.read_table(tmp_path / "p.parquet").to_pylist() if r["impl"].endswith("without_bias")]
    judged = {json.loads(r["knobs"])["bias"] for r in rows if r["passed"] is not None}
    skipped = {r["message"] for r in rows if r["metric"] == "unsupported" and json.loads(r["knobs"])["bias"]}
    assert judged == {False} and all(r["passed"] for r in rows if r["passed"] is not None)
    assert skipped == {"it takes no bias: judged on the cases without one (bias=False)"}
    res, text = identify(tmp_path, "h_post_bda_without_bias", "h_post_bda")
    assert res.exit_code == 0 and text.startswith("best match: transpose_res=false (") and "bias" not in text, text
    res, text = run("bench", "--kernel", "h_post_bda", "--impl", f"{STRANGERS}:h_post_bda_without_bias",
                    "--device", "cpu", "--shape", "8x2x4x64", "--repeats", "3", "-q", "-o", tmp_path / "b.parquet")
    assert res.exit_code == 0, text
    notes = {r["message"] for r in pq.read_table(tmp_path / "b.parquet").to_pylist() if r["impl"].endswith("without_bias")}
    assert notes == {"no bias (it takes none)"}


def test_where_no_candidate_comes_near_none_is_named_and_the_outputs_speak(tmp_path):
    """A row softmax and nothing more (issue 76 item 3): every candidate is millions of times native
    noise off, so no 'closest' is offered as a finding; the line says what the outputs show (rows
    sum to one, columns do not) and how far each probe is from the contract as asked; exit 1."""
    res, text = identify(tmp_path, "sinkhorn_rows_only")
    assert res.exit_code == 1, text
    assert text.startswith("no convention fits, and none comes near: the nearest (") and "closest" not in text, text
    assert "no finding; its distance from the contract as asked, in native noise: random " in text
    assert "rows sum to one within " in text and "columns only within " in text, text
    assert "uniform" not in text and "saturates" not in text, text  # a row softmax saturates nothing
    assert "its backward is the derivative of its own forward (directional finite differences of its forward, " \
           "3 of 3 directions" in text, text  # autograd's


def test_a_saturating_exponential_is_named_by_the_matrices_it_collapses(tmp_path):
    """exp(20 tanh(x / 20)) (issue 76 item 2): on large_logits its outputs are finite but every
    matrix is uniform, where the contract's are not: the guard names the saturation, not only an
    overflow; no clamp at any bound fits it either, and its backward is its forward's derivative."""
    res, text = identify(tmp_path, "sinkhorn_soft_clamped_exp")
    assert res.exit_code == 1, text
    assert text.startswith("no convention fits"), text
    assert "on large_logits (" in text and "its outputs are uniform in 64 of 64 matrices where the contract's are not: " \
                                          "the exponential saturates" in text, text
    assert "its backward is the derivative of its own forward" in text, text


def test_a_clamped_exponential_is_a_convention_with_its_bound_fitted(tmp_path):
    """exp(min(x, 20)) (issue 76 item 1): where the guard saturates, identify fits stabilize=clamp
    and its bound on logits that sweep the bounds, says what it costs, and parity passes it with the
    convention its hint names."""
    res, text = identify(tmp_path, "sinkhorn_clamped_exp")
    assert res.exit_code == 0, text
    assert text.startswith("best match: stabilize=clamp eps_mode=add order=row_first iters=20 eps=1e-06 clamp_at=20 "), text
    assert "stabilize=clamp clamp_at=20: the exponential clamped at 20 (exp(min(x, 20)), no max subtraction" in text
    assert "judge it with: mhctool parity --kernel sinkhorn --impl " in text and "--convention stabilize=clamp" in text
    res, text = run("parity", "--kernel", "sinkhorn", "--impl", f"{STRANGERS}:sinkhorn_clamped_exp", "--dtype", "fp32",
                    "--device", "cpu", "-q", "--convention", "stabilize=clamp", "--convention", "clamp_at=20",
                    "-o", tmp_path / "p.parquet")
    assert res.exit_code == 0, text
    assert "of them strangers.py:sinkhorn_clamped_exp: 40 passed, 0 failed, 0 skipped" in text, text


def test_a_backward_that_needs_aligned_channels_is_named_by_its_limit(tmp_path):
    """A backward that fails unless C % 4 == 0 (issue 76 item 5): identify tries the nearest
    multiples of 2, 4, ... of the probe's C, names the alignment and identifies it where it runs."""
    res, text = identify(tmp_path, "h_aggregate_backward_needs_c4", "h_aggregate")
    assert res.exit_code == 0, text
    assert text.startswith("best match: the contract (") and (
        "its backward fails at C = 67 (C % 4 = 3: RuntimeError: misaligned address) and runs at C = 64 and 68: "
        "an alignment requirement of its backward (C % 4 == 0)") in text, text


@pytest.mark.parametrize("command,where", [("identify", "--no-isolate"), ("parity", "--isolate")])
def test_a_librarys_own_output_goes_to_a_log_not_between_the_conclusions(tmp_path, command, where):
    """A library that logs through a handler of its own, prints and writes to the stderr descriptor
    at every call (issue 76 item 7, as TileLang's compile logs): from a shell, none of it shows,
    whether it runs in mhctool's process or in an isolation worker; it is in the log beside the
    report, named in the last line and in the report's metadata."""
    extra = ["--dtype", "fp32"] if command == "parity" else []
    res = subprocess.run([sys.executable, "-m", "mhctool.cli", command, "--kernel", "h_aggregate", "--impl",
                          f"{STRANGERS.parent / 'noisy.py'}:h_aggregate", "--device", "cpu", where, *extra,
                          "-o", str(tmp_path / "id.parquet")], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "noisylib" not in res.stdout + res.stderr, res.stdout + res.stderr
    log = tmp_path / "id.libraries.log"
    assert res.stdout.splitlines()[-1].endswith(f"the libraries' own output: {log}"), res.stdout
    text = log.read_text()
    assert "noisylib INFO: compiling a kernel" in text and "autotuning done" in text and "a C library's line" in text
    run = json.loads(pq.read_table(tmp_path / "id.parquet").schema.metadata[b"mhctool.run"])
    assert run["library_log"] == str(log)


def test_eps_as_a_threshold_is_a_convention_identify_finds_when_the_common_ones_fit_nothing(tmp_path):
    """A row or column whose sum is at or below eps left as it is (issue 76 item 1): add and clamp
    fit nothing on the eps sweep's columns, so the rarer modes are tried, and threshold fits; the
    hint's flag makes parity pass."""
    res, text = identify(tmp_path, "sinkhorn_eps_threshold")
    assert res.exit_code == 0, text
    assert text.startswith("best match: stabilize=rowmax eps_mode=threshold order=row_first iters=20 eps=1e-06 "), text
    assert "--convention eps_mode=threshold" in text, text
    res, text = run("parity", "--kernel", "sinkhorn", "--impl", f"{STRANGERS}:sinkhorn_eps_threshold", "--device", "cpu",
                    "--dtype", "fp32", "-q", "--no-hint", "--convention", "eps_mode=threshold",
                    "-o", tmp_path / "p.parquet")
    assert res.exit_code == 0, text


def test_fast_math_is_a_convention_judged_against_a_native_baseline_that_computes_so(tmp_path):
    """A clamped Sinkhorn built with --use_fast_math (__expf: the product x log2(e) rounded in fp32,
    about |x| ulps at large |x|; a reciprocal-multiply per division; issue 76 item 1): judged at
    stabilize=clamp against the IEEE baseline it fails on the dead rows (where logits reach the
    bound), so identify names math=fast too (only a failing candidate is judged again under it), and
    parity passes it with the hint's flags."""
    res, text = identify(tmp_path, "sinkhorn_fast_math")
    assert res.exit_code == 0, text
    assert text.startswith("best match: stabilize=clamp eps_mode=add order=row_first iters=20 eps=1e-06 clamp_at=20 "
                           "math=fast "), text
    assert "math=fast: a known convention, as a kernel built with --use_fast_math computes" in text, text
    flags = "--convention stabilize=clamp --convention math=fast"
    assert f"judge it with: mhctool parity --kernel sinkhorn --impl {STRANGERS}:sinkhorn_fast_math {flags}" in text
    res, text = run("parity", "--kernel", "sinkhorn", "--impl", f"{STRANGERS}:sinkhorn_fast_math", "--dtype", "fp32",
                    "--device", "cpu", "-q", "--no-hint", *flags.split(), "-o", tmp_path / "p.parquet")
    assert res.exit_code == 0 and "of them strangers.py:sinkhorn_fast_math: 40 passed, 0 failed" in text, text


def test_no_library_log_is_left_where_the_libraries_said_nothing(tmp_path):
    """A run whose code under test writes nothing leaves no ``*.libraries.log`` beside its report
    (the shutdown's redirection used to create the file again, empty, after the conclusion), and
    its last line names none."""
    res = subprocess.run([sys.executable, "-m", "mhctool.cli", "parity", "--kernel", "sinkhorn", "--impl", "torch",
                          "--shape", "5x3x4x1", "--dtype", "fp32", "--device", "cpu", "-q",
                          "-o", str(tmp_path / "p.parquet")], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert (tmp_path / "p.parquet").is_file() and not list(tmp_path.glob("*.libraries.log"))
    assert "libraries' own output" not in res.stdout
