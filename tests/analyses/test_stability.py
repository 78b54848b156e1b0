"""`mhctool stability sinkhorn --quick` on the CPU: overflow points and stabilisation, from the Parquet."""
import math

import pytest
from typer.testing import CliRunner

from mhctool.core import report
from mhctool.cli.app import app
from mhctool.analyses.stability import OVERFLOW_LOGIT, first_nonfinite

runner = CliRunner()


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    d = tmp_path_factory.mktemp("stab")
    # the iteration counts the tests read (the quick sweep's 5 and 100 would cost five times more)
    res = runner.invoke(app, ["stability", "sinkhorn", "--quick", "--iters", "1,20", "--device", "cpu",
                              "-o", str(d / "s.parquet"), "--plot", str(d)])
    assert res.exit_code == 0, res.output
    table, meta = report.read(d / "s.parquet")
    assert meta["kind"] == "stability"
    return table.to_pylist(), d


def _firsts(rows, **where):
    return [f for f in first_nonfinite(rows) if all(f[k] == v for k, v in where.items())]


def test_bare_exp_overflows_at_the_dtype_limit(sweep):
    rows, _ = sweep
    for f in _firsts(rows, stabilize="none", family="random", iters=20):
        limit = OVERFLOW_LOGIT[f["dtype"]]
        # near ln(max finite): 11.09 for fp16, 88.72 for fp32 and bf16 (a row sum of several large
        # exps overflows a little below a single one)
        assert f["first_nonfinite_scale"] is not None
        assert 0.9 * limit <= f["first_nonfinite_scale"] <= limit * 1.05, f


def test_rowmax_is_finite_at_every_amplitude_in_fp32_and_bf16(sweep):
    rows, _ = sweep
    fs = _firsts(rows, stabilize="rowmax")
    assert fs
    for f in fs:
        if f["dtype"] in ("fp32", "bf16") or f["eps"] >= 1e-6:
            assert f["first_nonfinite_scale"] is None, f


def test_fp16_cannot_hold_eps_1e8(sweep):
    """eps = 1e-8 rounds to zero in fp16: a dead column then divides by zero, even with rowmax."""
    rows, _ = sweep
    f = _firsts(rows, stabilize="rowmax", dtype="fp16", eps=1e-8, family="dead_rows_cols", iters=20)
    assert f and f[0]["first_nonfinite_scale"] is not None


def test_residuals_shrink_with_iterations(sweep):
    rows, _ = sweep
    sel = {r["iters"]: r["value"] for r in rows if r["metric"] == "row_residual" and r["family"] == "random"
           and r["dtype"] == "fp32" and r["stabilize"] == "rowmax" and r["eps"] == 1e-6 and r["scale"] == 10.0}
    assert sel[1] > sel[20] >= 0 and sel[1] > 1e-3


def test_plots_written(sweep):
    _, d = sweep
    for name in ("stability-nonfinite.png", "stability-error.png", "stability-convergence.png"):
        assert (d / name).stat().st_size > 10_000


def test_unknown_impl_exit_2(tmp_path):
    res = runner.invoke(app, ["stability", "sinkhorn", "--quick", "--device", "cpu", "--impl", "bogus",
                              "-o", str(tmp_path / "s.parquet")])
    assert res.exit_code == 2 and "unknown implementation" in res.output
    assert math.isfinite(OVERFLOW_LOGIT["fp16"])


def test_eps_change_matters_only_once_the_logits_spread_past_ln_1_over_eps(sweep):
    """The sweep's shift from eps=1e-6 to 1e-8 (rowmax, 20 iterations, fp32): about eps relative
    for amplitudes up to a few units, orders of magnitude more once exp(-amplitude) drops below eps."""
    rows, _ = sweep
    shift = {(r["family"], r["scale"]): r["value"] for r in rows if r["metric"] == "shift_vs_first_eps"
             and r["eps"] == 1e-8 and r["dtype"] == "fp32" and r["stabilize"] == "rowmax" and r["iters"] == 20}
    for fam in ("random", "dead_rows_cols", "near_perm"):
        assert all(v < 3e-6 for (f, s), v in shift.items() if f == fam and s <= 3.2), fam
    for fam in ("random", "dead_rows_cols"):
        assert max(v for (f, s), v in shift.items() if f == fam and s >= 30) > 1e-3, fam


# --- stability eps ----------------------------------------------------------------------------

def _run(tmp_path, *args, name="r.parquet"):
    path = tmp_path / name
    res = runner.invoke(app, ["stability", *args, "--device", "cpu", "-o", str(path)])
    rows = report.read(path)[0].to_pylist() if res.exit_code == 0 else []
    return res, rows


def _kernel_metric(rows, family, dtype, metric, impl="torch", tensor="out"):
    (v,) = [r["value"] for r in rows if r["level"] == "kernel" and r["family"] == family and r["dtype"] == dtype
            and r["impl"] == impl and r["tensor"] == tensor and r["metric"] == metric]
    return v


def _stack_metric(rows, family, dtype, metric, depth=12):
    (v,) = [r["value"] for r in rows if r["level"] == "stack" and r["family"] == family and r["dtype"] == dtype
            and r["depth"] == depth and r["metric"] == metric]
    return v


def test_eps_shift_is_visible_on_dead_columns_and_not_on_plain_logits(tmp_path):
    res, rows = _run(tmp_path, "eps", "--kernel", "sinkhorn", "--from", "1e-6", "--to", "1e-8", "--plot", str(tmp_path))
    assert res.exit_code == 0, res.output
    assert {r["setting_a"] for r in rows} == {"1e-06"} and {r["setting_b"] for r in rows} == {"1e-08"}
    # fp32: eps relative on plain logits, a hundred times more where a column sum sits below eps
    plain = _kernel_metric(rows, "unit_random", "fp32", "shift_max_abs")
    dead = _kernel_metric(rows, "dead_rows_cols", "fp32", "shift_max_abs")
    assert plain < 2e-6 and dead > 100 * plain
    # bf16 outputs: plain logits do not move by a single ulp; dead columns move many tokens
    assert _kernel_metric(rows, "unit_random", "bf16", "shift_ulps") == 0
    assert _kernel_metric(rows, "dead_rows_cols", "bf16", "tokens_shifted_share") > 0.2
    # the stack: dead columns shift the residual stream about 10x more, both below bf16 storage noise
    s_plain = _stack_metric(rows, "unit_random", "bf16", "shift_rel_l2")
    s_dead = _stack_metric(rows, "dead_rows_cols", "bf16", "shift_rel_l2")
    assert s_dead > 5 * s_plain
    assert _stack_metric(rows, "dead_rows_cols", "bf16", "shift_over_noise") < 1
    assert _stack_metric(rows, "dead_rows_cols", "fp32", "shift_over_noise") > 1
    assert len({r["depth"] for r in rows if r["level"] == "stack"}) == 12
    assert (tmp_path / "stability-eps.png").stat().st_size > 10_000


def test_proj_rms_eps_moves_tiny_norm_rows_through_the_stack(tmp_path):
    res, rows = _run(tmp_path, "eps", "--kernel", "proj_rms", "--from", "1e-6", "--to", "1e-8", "--depth", "4")
    assert res.exit_code == 0, res.output
    assert _kernel_metric(rows, "random", "fp32", "shift_max_abs", tensor="proj") == 0
    assert _stack_metric(rows, "tiny_norm", "bf16", "shift_over_noise", depth=4) > 1
    assert _stack_metric(rows, "random", "bf16", "shift_over_noise", depth=4) < 1e-2


def test_any_knob_can_be_compared(tmp_path):
    res, rows = _run(tmp_path, "eps", "--kernel", "sinkhorn", "--knob", "order=row_first,col_first",
                     "--family", "near_perm", "--dtype", "fp32", "--depth", "2")
    assert res.exit_code == 0, res.output
    assert {r["knob"] for r in rows} == {"order"}
    assert _kernel_metric(rows, "near_perm", "fp32", "ref_shift_max_abs") > 1e-3


def test_eps_shift_of_the_triton_kernel_matches_the_native_one(tmp_path):
    res, rows = _run(tmp_path, "eps", "--kernel", "sinkhorn", "--from", "1e-6", "--to", "1e-8", "--impl", "torch,triton",
                     "--family", "dead_rows_cols", "--dtype", "fp32", "--depth", "1")
    assert res.exit_code == 0, res.output
    a = _kernel_metric(rows, "dead_rows_cols", "fp32", "shift_max_abs", impl="torch")
    b = _kernel_metric(rows, "dead_rows_cols", "fp32", "shift_max_abs", impl="triton")
    assert abs(a - b) <= 0.05 * a


# --- stability overflow -----------------------------------------------------------------------

def _firsts_overflow(tmp_path, *args):
    from mhctool.analyses import overflow
    res, rows = _run(tmp_path, "overflow", *args)
    assert res.exit_code == 0, res.output
    return {(s["intermediate"], s["dtype"]): s for s in overflow.summary(rows)}, rows


def test_proj_rms_sum_of_squares_overflows_silently(tmp_path):
    """fp32: the sum of squares overflows from an input scale near 3e18 while proj stays finite;
    r = 1 / inf = 0 is a number, and wrong. In fp16 the sum overflows near 30, but the native
    implementation accumulates fp16 inputs in fp32, so that one is not flagged."""
    s, _ = _firsts_overflow(tmp_path, "--kernel", "proj_rms", "--plot", str(tmp_path))
    sq32 = s[("sum_sq", "fp32")]
    assert 1e17 < sq32["first_overflow_scale"] < 1e19 and sq32["silent"]
    assert sq32["output_first_nonfinite"] is None
    sq16 = s[("sum_sq", "fp16")]
    assert 10 <= sq16["first_overflow_scale"] <= 100 and not sq16["silent"]
    assert s[("proj", "fp16")]["first_overflow_scale"] > 1e3
    assert (tmp_path / "stability-overflow-proj_rms.png").stat().st_size > 10_000


def test_sinkhorn_exp_headroom_with_and_without_max_subtraction(tmp_path):
    bare, _ = _firsts_overflow(tmp_path, "--kernel", "sinkhorn", "--knob", "stabilize=none")  # dense near 11 and 88
    for dt in ("fp16", "fp32"):
        first = bare[("exp", dt)]["first_overflow_scale"]
        assert OVERFLOW_LOGIT[dt] <= first <= 1.1 * OVERFLOW_LOGIT[dt], (dt, first)
    # the native fp16 row sum of four large exps overflows just before a single exp does: the row
    # becomes 0 / inf = 0, a finite and wrong output
    assert bare[("row_sum", "fp16")]["silent"]
    safe, rows = _firsts_overflow(tmp_path, "--kernel", "sinkhorn", "--scales", "1:1000:20")
    assert all(safe[("exp", dt)]["first_overflow_scale"] is None for dt in ("fp16", "bf16", "fp32"))
    assert max(r["value"] for r in rows if r["metric"] == "amax" and r["intermediate"] == "exp") <= 1.0


def test_a_kernel_that_holds_intermediates_in_fp32_is_not_flagged(tmp_path):
    """The Triton Sinkhorn computes in fp32 whatever the input dtype: past fp16's exp overflow
    its fp16 output stays finite and right."""
    s, rows = _firsts_overflow(tmp_path, "--kernel", "sinkhorn", "--knob", "stabilize=none", "--impl", "triton",
                               "--dtype", "fp16", "--scales", "8:40:4")
    assert s[("exp", "fp16")]["first_overflow_scale"] is not None
    assert not s[("exp", "fp16")]["silent"] and not s[("row_sum", "fp16")]["silent"]
    assert s[("exp", "fp16")]["output_first_nonfinite"] is None


# --- stability gain ---------------------------------------------------------------------------

def test_composite_gain_stays_near_one_for_sinkhorn_and_grows_for_hc(tmp_path):
    res, rows = _run(tmp_path, "gain", "--depth", "64", "--iters", "1,20", "--plot", str(tmp_path))
    assert res.exit_code == 0, res.output
    g = {(r["config"], r["depth"], r["metric"]): r["value"] for r in rows}
    hc = next(c for c, _, _ in g if c.startswith("HC"))
    for m in ("fwd_gain", "bwd_gain"):
        assert 0.9 < g[("sinkhorn iters=20", 64, m)] < 1.05
        assert g[("sinkhorn iters=1", 64, m)] < 1.6  # fewer iterations drift, but stay bounded
        assert g[(hc, 64, m)] > 20 * g[(hc, 4, m)] > 20  # exponential growth with depth
    assert (tmp_path / "stability-gain.png").stat().st_size > 10_000


# --- bad input ----------------------------------------------------------------------------------

@pytest.mark.parametrize("args,message", [
    (["eps", "--kernel", "sinkhorn", "--knob", "temperature=1,2"], "unknown knob 'temperature'"),
    (["eps", "--kernel", "sinkhorn", "--knob", "order=row_first"], "is not NAME=A,B"),
    (["eps", "--kernel", "sinkhorn", "--knob", "order=row_first,diagonal"], "accepted: 'row_first', 'col_first'"),
    (["eps", "--kernel", "sinkhorn", "--from", "1e-6"], "give --from and --to"),
    (["eps", "--kernel", "sinkhorn", "--from", "1e-6", "--to", "1e-6"], "two different values"),
    (["eps", "--kernel", "sinkhorn", "--from", "-1", "--to", "1e-8"], "must be zero or positive"),
    (["eps", "--kernel", "h_aggregate", "--from", "1e-6", "--to", "1e-8"], "has no knob to change"),
    (["eps", "--kernel", "sinkhorn", "--from", "1e-6", "--to", "1e-8", "--depth", "0"], "not a possible stack depth"),
    (["eps", "--kernel", "sinkhorn", "--from", "1e-6", "--to", "1e-8", "--family", "tiny_norm"], "unknown input family"),
    (["sinkhorn", "--quick", "--scales", "1000:0.1"], "goes from 1000 down to 0.1"),
    (["sinkhorn", "--quick", "--scales", "0.1-1000"], "is not LO:HI"),
    (["sinkhorn", "--quick", "--iters", "0"], "not a possible iteration count"),
    (["sinkhorn", "--quick", "--iters", "2.5"], "not a possible iteration count"),
    (["sinkhorn", "--quick", "--iters", "1000000"], "not a possible iteration count"),
    (["overflow", "--kernel", "proj_rms", "--knob", "order=row_first"], "give NAME=VALUE"),
    (["overflow", "--kernel", "nope"], "unknown kernel 'nope'"),
    (["overflow", "--kernel", "grouped_mlp"], "has no overflow analysis"),
    (["overflow", "--kernel", "sinkhorn", "--scales", "100:10"], "goes from 100 down to 10"),
    (["gain", "--iters", "0"], "not a possible iteration count"),
    (["gain", "--depth", "-3"], "not a possible depth"),
])
def test_bad_input_exits_2(tmp_path, args, message):
    res = runner.invoke(app, ["stability", *args, "--device", "cpu", "-o", str(tmp_path / "r.parquet")])
    assert res.exit_code == 2, res.output
    assert message in res.output
    assert not (tmp_path / "r.parquet").exists()


def test_dtypes_whose_exp_overflows_alike_share_one_labelled_line():
    """bf16 (ln of its largest finite: 88.719) and fp32 (88.723) overflow at one amplitude to the
    eye: one dotted line, one label naming both, never two labels drawn over each other."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from mhctool.analyses.stability import OVERFLOW_LOGIT
    from mhctool.views.plots import _overflow_lines
    fig, ax = plt.subplots()
    _overflow_lines(ax, {d: OVERFLOW_LOGIT[d] for d in ("fp32", "bf16", "fp16")})
    labels = sorted(t.get_text() for t in ax.texts)
    plt.close(fig)
    assert labels == ["bf16/fp32 exp overflow", "fp16 exp overflow"] and len(ax.lines) == 2
