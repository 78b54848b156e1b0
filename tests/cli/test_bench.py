"""`mhctool bench` on the CPU: bytes/flops models, the report schema, refusals."""
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from mhctool.analyses import timing as bench
from mhctool.cli.app import app
from mhctool.core import report
from mhctool.core.shapes import MoeShape, Shape
from mhctool.families import MHC_KERNELS, MOE_KERNELS

IMPLS = Path(__file__).resolve().parents[1] / "impls"  # loaded by file path, never as a package
DEFECTS = IMPLS / "defects.py"

runner = CliRunner()


def test_byte_models_by_hand():
    s = Shape(2, 3, 4, 10)  # T = 6 tokens, n = 4, C = 10, K = 40, N = 24
    T, n, C, K, N = 6, 4, 10, 40, 24
    m = bench.model("h_aggregate", s, "bf16")
    assert m.bytes_fwd == T * n * C * 2 + T * C * 2 + T * n * 4
    assert m.bytes_bwd == 2 * T * n * C * 2 + T * C * 2 + 2 * T * n * 4
    assert m.flops_fwd == 2 * T * n * C
    m = bench.model("h_post_bda", s, "bf16")
    # the count for the backward: read grad_out, x, y; write grad_x, grad_y (+ small grads)
    small = T * (n * n + n) * 4
    assert m.bytes_bwd == 3 * T * n * C * 2 + 2 * T * C * 2 + 2 * small + 2 * C * 2
    m = bench.model("proj_rms", s, "fp32")
    assert m.bytes_fwd == T * K * 4 + N * K * 4 + T * (N + 1) * 4
    assert m.flops_fwd == 2 * T * N * K and m.flops_bwd == 2 * m.flops_fwd
    m = bench.model("sinkhorn", s, "bf16")
    assert m.bytes_fwd == 2 * T * n * n * 4  # fp32 mapping path whatever the activation dtype
    for k in MHC_KERNELS:
        assert bench.model(k, s, "bf16").bytes_fwd > 0


def test_grouped_mlp_models_by_hand():
    s = MoeShape(100, 16, 8, 4)  # T, H, F, G
    T, H, F, G = 100, 16, 8, 4
    m = bench.model("grouped_gemm", s, "bf16")
    assert m.bytes_fwd == T * H * 2 + G * F * H * 2 + T * F * 2 and m.flops_fwd == 2 * T * H * F
    m = bench.model("swiglu", s, "bf16")
    assert m.bytes_fwd == T * 2 * F * 2 + T * 4 + T * F * 2
    assert bench.model("srelu", s, "bf16").bytes_fwd == T * F * 2 + T * 4 + T * F * 2
    m = bench.model("grouped_mlp", s, "bf16")
    assert m.flops_fwd == 2 * T * H * (2 * F + F) and m.flops_bwd == 2 * m.flops_fwd
    for k in MOE_KERNELS:
        assert bench.model(k, s, "bf16").bytes_fwd > 0


def test_expert_sweep_on_cpu(tmp_path):
    """`--experts` makes one shape per expert count; the per-expert loop and the fused path both run."""
    out = tmp_path / "b.parquet"
    res = runner.invoke(app, ["bench", "--device", "cpu", "--kernel", "grouped_gemm", "--impl", "torch",
                              "--experts", "2,5", "--tokens", "40", "--hidden", "32", "--ffn", "16",
                              "--repeats", "3", "-o", str(out)])
    assert res.exit_code == 0, res.output
    rows = report.read(out)[0].to_pylist()
    assert {r["shape"] for r in rows} == {"40x32x16x2", "40x32x16x5"}
    assert {r["metric"] for r in rows} >= {"time_ms", "host_us"}


def test_bench_on_cpu_writes_the_bench_schema(tmp_path):
    out = tmp_path / "b.parquet"
    png = tmp_path / "b.png"
    res = runner.invoke(app, ["bench", "--device", "cpu", "--shape", "4x2x4x64", "--kernel", "h_aggregate",
                              "--impl", "torch", "--repeats", "3", "-o", str(out), "--plot", str(png)])
    assert res.exit_code == 0, res.output
    assert "GPU figures need a GPU" in res.output
    table, meta = report.read(out)
    assert meta["kind"] == "bench"
    assert table.schema.equals(report.BENCH_SCHEMA, check_metadata=False)
    metrics = {r["metric"] for r in table.to_pylist()}
    assert {"time_ms", "gbps", "pct_copy_bw", "host_us", "speedup_vs_torch"} <= metrics
    assert {r["direction"] for r in table.to_pylist()} == {"fwd", "bwd"}
    assert meta["run"]["copy_bandwidth_Bps"] > 0
    assert png.stat().st_size > 5_000


def test_too_large_shape_is_refused_with_the_estimate(tmp_path):
    res = runner.invoke(app, ["bench", "--device", "cpu", "--shape", "8192x4x4x7168", "--kernel", "h_post_bda",
                              "-o", str(tmp_path / "b.parquet")])
    assert res.exit_code == 2
    assert "needs about" in res.output and "GiB" in res.output
    assert not (tmp_path / "b.parquet").exists()


@pytest.mark.parametrize("args,needle", [
    (["--shape", "8192x4x4", "--kernel", "h_aggregate"], "malformed shape"),
    (["--shape", "64x2x4x512"], "one form per kind of kernel"),
    (["--kernel", "grouped_mlp", "--experts", "8,0"], "at least 1"),
    (["--kernel", "grouped_mlp", "--experts", "eight"], "not a comma-separated list"),
    (["--kernel", "h_aggregate", "--experts", "8"], "sweeps the grouped-MLP kernels"),
    (["--shape", "64x2x4x512", "--kernel", "sinkhorn", "--direction", "sideways"], "unknown --direction"),
    (["--shape", "64x2x4x512", "--kernel", "nope"], "unknown kernel"),
    (["--kernel", "sinkhorn,h_aggregate", "--impl", f"{DEFECTS}:sinkhorn_raises"], "needs one --kernel"),
])
def test_bench_bad_input_exit_2(tmp_path, args, needle):
    res = runner.invoke(app, ["bench", "--device", "cpu", *args, "-o", str(tmp_path / "b.parquet")])
    assert res.exit_code == 2, res.output
    assert needle in res.output


def test_external_implementation_benchmarks_beside_ours(tmp_path):
    """Megatron's fused kernels take the same signatures: they bench as module:function."""
    out = tmp_path / "b.parquet"
    res = runner.invoke(app, ["bench", "--device", "cpu", "--shape", "4x2x4x64", "--kernel", "h_aggregate",
                              "--impl", "torch", "--impl", f"{IMPLS / 'correct.py'}:h_aggregate", "--repeats", "3",
                              "--direction", "fwd", "-o", str(out)])
    assert res.exit_code == 0, res.output
    rows = report.read(out)[0].to_pylist()
    ext = [r for r in rows if r["backend"] == "external"]
    assert ext and {r["metric"] for r in ext} >= {"time_ms", "speedup_vs_torch"}


def test_a_group_of_kernels_takes_one_shape_beside_a_library(tmp_path):
    """``--kernel mhc`` is every mHC kernel (the side-by-side table of one command); a library
    is timed on the kernels it has and skipped with the reason where it has none."""
    out = tmp_path / "b.parquet"
    res = runner.invoke(app, ["bench", "--device", "cpu", "--shape", "4x2x4x64", "--kernel", "mhc", "--impl",
                              f"torch,te:{IMPLS / 'te_standin'}", "--repeats", "3", "--direction", "fwd",
                              "-o", str(out)])
    assert res.exit_code == 0, res.output
    rows = report.read(out)[0].to_pylist()
    from mhctool.families import MHC_KERNELS
    assert {r["kernel"] for r in rows} == set(MHC_KERNELS)
    te = {r["kernel"] for r in rows if r["impl"].startswith("te") and r["metric"] == "time_ms"}
    assert {"sinkhorn", "h_aggregate", "h_post_bda"} <= te and "proj_rms" not in te
    # TE takes x as (s, b, C, n): the adapter's conversion is done before the timing, and said so
    staged = {r["kernel"] for r in rows if r["metric"] == "time_ms" and "layout conversion is not timed" in (r["message"] or "")}
    assert staged == {"h_aggregate", "h_post_bda", "mix_aggregate"}
    res = runner.invoke(app, ["bench", "--device", "cpu", "--shape", "4x2x4x64", "-o", str(out)])
    assert res.exit_code == 2 and "mhc or moe" in res.output
    # an implementation that runs none of the kernels is an error, with the reason
    res = runner.invoke(app, ["bench", "--device", "cpu", "--shape", "4x2x4x64", "--kernel", "mhc",
                              "--impl", "torch,cutile", "-o", str(out)])
    assert res.exit_code == 2 and "--impl cutile cannot run" in res.output, res.output


def _timed(kernel, impl, backend, fwd_ms, bwd_ms, fwd_pct=50.0, bwd_pct=100.0):
    return [dict(kernel=kernel, shape="8192x4x4x7168", impl=impl, backend=backend, graph=True, direction=d,
                 metric=m, value=v)
            for d, t, p in (("fwd", fwd_ms, fwd_pct), ("bwd", bwd_ms, bwd_pct))
            for m, v in (("time_ms", t), ("pct_copy_bw", p))]


def test_fwd_plus_bwd_and_the_whole_path_per_implementation():
    """Issue 20's one table: fwd + bwd per kernel, and the path (Sinkhorn, h_aggregate, h_post_bda,
    the projection) summed per implementation, per library (its fastest variant per kernel), and as
    the best of mhctool's kernels; a group without every kernel of the path is not summed."""
    from mhctool.analyses import timing as bench_mod
    rows = (_timed("sinkhorn", "triton", "triton", 0.01, 0.02) + _timed("h_aggregate", "triton", "triton", 1, 2)
            + _timed("h_post_bda", "triton", "triton", 1, 3) + _timed("proj_rms", "triton", "triton", 1, 3)
            + _timed("mapping", "triton", "triton", 1, 2.5)
            + _timed("sinkhorn", "cutile", "cutile", 0.02, 0.04) + _timed("h_aggregate", "cutile", "cutile", 1, 1.5)
            + _timed("h_post_bda", "cutile", "cutile", 1, 3) + _timed("proj_rms", "cutile", "cutile", 1, 2)
            + _timed("sinkhorn", "te[main]:mhc_fused_sinkhorn", "external", 0.03, 0.05)
            + _timed("h_aggregate", "te[main]:mhc_fused_aggregate[tf32]", "external", 1, 2)
            + _timed("h_aggregate", "te[main]:mhc_fused_aggregate[ieee]", "external", 1, 1.9)
            + _timed("h_post_bda", "te[main]:mhc_fused_expand_combine[tf32]", "external", 1, 2)
            + _timed("mapping", "te[main]:mhc_fused_projection+mhc_fused_scale[tf32]", "external", 1, 5)
            + _timed("sinkhorn", "megatron[pr3828]:fused_sinkhorn", "external", 0.05, 0.2)
            + [dict(kernel="h_post_bda", shape="8192x4x4x7168", impl="torch", backend="torch", graph=True,
                    direction="fwd", metric="time_ms", value=2.0)])  # no backward: no total
    tots = bench_mod.totals(rows)
    agg = next(t for t in tots if t.kernel == "h_aggregate" and t.impl == "triton")
    assert (agg.fwd_ms, agg.bwd_ms, agg.ms) == (1, 2, 3)
    assert agg.pct_copy_bw == pytest.approx((50 * 1 + 100 * 2) / 3)  # the bytes over the summed time
    assert not [t for t in tots if t.impl == "torch"]
    paths = {p.name: p for p in bench_mod.whole_path(tots)}
    assert set(paths) == {"triton", "cutile", "te", "best of mhctool", "best of the libraries"}  # not megatron
    assert paths["triton"].ms == pytest.approx(0.03 + 3 + 4 + 4)  # proj_rms, not the faster mapping
    assert paths["cutile"].ms == pytest.approx(0.06 + 2.5 + 4 + 3)
    best = paths["best of mhctool"]
    assert {s: t.impl for s, t in best.parts.items()} == {
        "sinkhorn": "triton", "h_aggregate": "cutile", "h_post_bda": "triton", "projection": "cutile"}
    te = paths["te"]  # TE has no proj_rms: its mapping fills the projection; its faster aggregate variant
    assert te.parts["projection"].kernel == "mapping" and te.parts["h_aggregate"].impl.endswith("[ieee]")
    assert te.ms == pytest.approx(0.08 + 2.9 + 3 + 6)


def test_the_tf32_projection_is_its_own_line_of_the_whole_path():
    """``triton-tf32`` (TF32 by design) never counts in "best of mhctool" (IEEE accuracy); with one
    timed, the best of mhctool with it allowed is a line of its own, beside."""
    from mhctool.analyses import timing as bench_mod
    ours = (_timed("sinkhorn", "triton", "triton", 0.01, 0.02) + _timed("h_aggregate", "triton", "triton", 1, 2)
            + _timed("h_post_bda", "triton", "triton", 1, 3) + _timed("proj_rms", "triton", "triton", 1, 3))
    assert {p.name for p in bench_mod.whole_path(bench_mod.totals(ours))} == {"triton", "best of mhctool"}
    rows = ours + _timed("proj_rms", "triton-tf32", "triton", 1, 1.5)
    paths = {p.name: p for p in bench_mod.whole_path(bench_mod.totals(rows))}
    assert set(paths) == {"triton", "best of mhctool", bench_mod.TF32_BEST}  # triton-tf32 alone is no path
    assert paths["best of mhctool"].parts["projection"].impl == "triton"
    assert paths[bench_mod.TF32_BEST].parts["projection"].impl == "triton-tf32"
    assert paths[bench_mod.TF32_BEST].ms == pytest.approx(paths["best of mhctool"].ms - 1.5)


def test_bench_prints_the_whole_path(tmp_path):
    res = runner.invoke(app, ["bench", "--device", "cpu", "--shape", "4x2x4x64", "--kernel",
                              "sinkhorn,h_aggregate,h_post_bda,proj_rms", "--impl", "torch", "--repeats", "3",
                              "-o", str(tmp_path / "b.parquet")])
    assert res.exit_code == 0, res.output
    assert "fwd + bwd" in res.output and "the whole mHC path" in res.output
    shown = runner.invoke(app, ["report", "show", str(tmp_path / "b.parquet")])  # the same tables, from the report
    assert shown.exit_code == 0, shown.output
    assert "h_post_bda" in shown.output and "the whole mHC path" in shown.output


def test_a_library_is_timed_at_the_dtypes_it_is_used_with(tmp_path):
    """Megatron's HyperConnectionModule hands fused_h_post_bda h_res and h_post in the activations'
    dtype (and its output follows h_res's): bench times it so, says so, and every row names the
    input dtypes; ``--input-dtypes contract`` times it at mhctool's contract dtypes instead."""
    spec = f"megatron:{IMPLS / 'megatron_pr3828'}"
    out = tmp_path / "b.parquet"
    inputs = {}
    for mode in ("library", "contract"):
        res = runner.invoke(app, ["bench", "--device", "cpu", "--shape", "3x2x4x40", "--kernel", "h_aggregate,h_post_bda",
                                  "--impl", f"triton,{spec}", "--repeats", "3", "--direction", "fwd",
                                  "--input-dtypes", mode, "-o", str(out)], terminal_width=250)
        assert res.exit_code == 0, res.output
        table, meta = report.read(out)
        assert meta["run"]["input_dtypes"] == mode
        rows = [r for r in table.to_pylist() if r["metric"] == "time_ms"]
        inputs[mode] = {(r["kernel"], r["impl"].split("[")[0]): r["inputs"] for r in rows}
        notes = {(r["kernel"], r["impl"].split("[")[0]): r["message"] or "" for r in rows}
        assert all(r["inputs"] for r in rows)  # every timed row says its input dtypes
        if mode == "library":
            assert "h_res, h_post at bf16, as the library is used" in notes["h_post_bda", "megatron"]
            assert "h_pre at bf16" in notes["h_aggregate", "megatron"]
        else:
            assert "as the library is used" not in "".join(notes.values())
    assert inputs["library"]["h_post_bda", "megatron"] == "h_res=bf16,x=bf16,h_post=bf16,y=bf16,bias=bf16"
    assert inputs["contract"]["h_post_bda", "megatron"] == "h_res=fp32,x=bf16,h_post=fp32,y=bf16,bias=bf16"
    assert inputs["library"]["h_aggregate", "megatron"] == "x=bf16,h_pre=bf16"
    # mhctool's own kernels are timed at the contract's dtypes either way
    assert inputs["library"]["h_post_bda", "triton"] == inputs["contract"]["h_post_bda", "triton"] \
        == "h_res=fp32,x=bf16,h_post=fp32,y=bf16,bias=bf16"
    res = runner.invoke(app, ["bench", "--device", "cpu", "--shape", "3x2x4x40", "--kernel", "h_aggregate",
                              "--input-dtypes", "mine", "-o", str(out)])
    assert res.exit_code == 2 and "unknown --input-dtypes" in res.output


def test_the_table_shows_input_dtypes_compactly():
    from mhctool.cli.tables import short_inputs as _short_inputs
    assert _short_inputs("h_res=fp32,x=bf16,h_post=fp32,y=bf16,bias=bf16") == "bf16; fp32 h_res h_post"
    assert _short_inputs("logits=fp32") == "fp32"
    assert _short_inputs(None) == "-"


def test_a_bias_parameter_that_refuses_a_bias_is_timed_without_one(tmp_path):
    """An optional input the function has a parameter for but raises on (its library has no
    bias): timed without it, and the row says what the call with it raised; no failure."""
    out = tmp_path / "b.parquet"
    strangers = Path(__file__).resolve().parents[1] / "impls" / "strangers.py"
    res = CliRunner().invoke(app, ["bench", "--kernel", "h_post_bda", "--device", "cpu", "--shape", "5x1x4x8",
                                   "--repeats", "3", "--impl", f"{strangers}:h_post_bda_refuses_bias", "-q",
                                   "-o", str(out)])
    assert res.exit_code == 0, res.output
    timed = [r for r in pq.read_table(out).to_pylist() if r["metric"] == "time_ms"]
    assert {r["direction"] for r in timed} == {"fwd", "bwd"}
    assert all(r["message"] == "no bias (given one, it raised NotImplementedError: bias is not supported)"
               for r in timed), timed
