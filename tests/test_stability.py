"""`mhctool stability sinkhorn --quick` on the CPU: overflow points and stabilisation, from the Parquet."""
import math

import pytest
from typer.testing import CliRunner

from mhctool import report
from mhctool.cli import app
from mhctool.stability import OVERFLOW_LOGIT, first_nonfinite

runner = CliRunner()


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    d = tmp_path_factory.mktemp("stab")
    res = runner.invoke(app, ["stability", "sinkhorn", "--quick", "--device", "cpu", "-o", str(d / "s.parquet"),
                              "--plot", str(d)])
    assert res.exit_code == 0, res.output
    table, meta = report.read(d / "s.parquet")
    assert meta["kind"] == "stability"
    return table.to_pylist(), d


def _firsts(rows, **where):
    return [f for f in first_nonfinite(rows) if all(f[k] == v for k, v in where.items())]


def test_bare_exp_overflows_at_the_dtype_limit(sweep):
    rows, _ = sweep
    for f in _firsts(rows, stabilize="none", family="random", iters=100):
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
    f = _firsts(rows, stabilize="rowmax", dtype="fp16", eps=1e-8, family="dead_rows_cols", iters=100)
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
