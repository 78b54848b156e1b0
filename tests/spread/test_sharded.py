"""``parity --ranks R --grad-reduce fp32|bf16`` on the CPU: the tokens split over R processes
joined by Gloo, the parameter gradients all-reduced, judged against the whole batch's float64
reference beside the native implementation sharded the same way."""
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from typer.testing import CliRunner

from mhctool.families import generate, get_family
from mhctool.runner.call import cast_inputs, run_impl, upstream_for
from mhctool.runner.case import Case
from mhctool.spread import sharded
from mhctool.cli.app import app
from mhctool.core.dtypes import FORMATS
from mhctool.registry.builtin import native_impl
from mhctool.core.shapes import parse_shape_for

IMPLS = Path(__file__).resolve().parents[1] / "impls"
cli = CliRunner()

# 7 x 2 tokens: x2d has 14 rows (R = 3: 5, 5, 4), the 4-D x 7 along s (R = 3: 3, 2, 2)
SCENARIO = """name = "ranks"
[[cases]]
kernel = "{kernel}"
shapes = ["7x2x4x45"]
dtypes = ["fp32", "bf16"]
families = ["random"]
"""


def _scenario(tmp_path, kernels):
    path = tmp_path / "ranks.toml"
    path.write_text("\n".join(SCENARIO.format(kernel=k) if i == 0 else SCENARIO.format(kernel=k).split("\n", 1)[1]
                              for i, k in enumerate(kernels)))
    return path


@pytest.mark.parametrize("ranks,reduce", [(2, "fp32"), (3, "bf16")])
def test_sharded_parity_of_the_mapping_path_passes_with_every_parameter_gradient_judged(tmp_path, ranks, reduce):
    out = tmp_path / "r.parquet"
    res = cli.invoke(app, ["parity", "--scenario", str(_scenario(tmp_path, ["proj_rms", "mapping", "mix_aggregate"])),
                           "--impl", "triton", "--device", "cpu", "--ranks", str(ranks), "--grad-reduce", reduce,
                           "-o", str(out), "--quiet"])
    assert res.exit_code == 0, res.output
    rows = pq.read_table(out).to_pylist()
    assert {(r["ranks"], r["grad_reduce"]) for r in rows} == {(ranks, reduce)}
    judged = {(r["kernel"], r["impl"], r["tensor"]) for r in rows if r["passed"] is not None and r["direction"] == "bwd"}
    for kernel, params in (("proj_rms", ["grad_weight"]), ("mapping", ["grad_weight", "grad_alpha", "grad_h_bias"]),
                           ("mix_aggregate", ["grad_weight", "grad_alpha", "grad_h_bias"])):
        for impl in ("torch", "triton"):
            assert {(kernel, impl, p) for p in params} <= judged, (kernel, impl)
    meta = pq.read_schema(out).metadata
    assert b'"ranks": %d' % ranks in meta[b"mhctool.run"]
    # the ranks' start (processes, the process group and its first collective) is a phase of its own
    import json
    from mhctool.core import profile
    assert json.loads(meta[b"mhctool.run"])["profile"][profile.RANKS] > 0


def _native_case(kernel, shape="7x2x4x45", dtype="fp32", device="cpu"):
    case = Case(kernel, "random", dtype, parse_shape_for("mhc", shape), (), 0, "cpu")
    fam = get_family(kernel)
    _, raw = generate(kernel, "random", case.shape, case.seed, {})
    base = cast_inputs(fam, raw, dtype, device)
    nat = run_impl(fam, native_impl(kernel), base, {}, lambda outs: upstream_for(fam, outs, 0))
    return fam, base, upstream_for(fam, nat.outputs, 0), nat


TWO_GPUS = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                              reason="needs two CUDA GPUs (NCCL takes one GPU a rank)")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, TWO_GPUS])])
def test_the_ranks_partials_are_all_reduced_in_the_asked_dtype(device):
    """Two ranks: each parameter gradient is the sum of the two slices' own gradients, added in the
    reduce dtype (one addition: the same bits as adding them here); the outputs and x's gradient
    are the slices' put back in order. One group of rank processes serves both dtypes. On GPUs the
    tensors go to the ranks and back as CUDA IPC handles: what comes back is this process's own,
    and the inputs handed over are untouched."""
    fam, base, ups, _ = _native_case("mapping", device=device)
    kept = {k: v.clone() for k, v in base.items() if v is not None}
    parts = []
    for r in range(2):
        cut = {k: (torch.tensor_split(v, 2)[r] if k == "x2d" else v) for k, v in base.items()}
        parts.append(run_impl(fam, native_impl("mapping"), cut, {},
                                     lambda outs, r=r: [torch.tensor_split(u, 2)[r] for u in ups]))
    s = sharded.Sharding(2, "fp32", device)
    try:
        for reduce in ("fp32", "bf16"):
            s.reduce = reduce
            got = sharded.run("mapping", native_impl("mapping"), base, {}, ups, s, 120)
            assert got.fwd_error is None and got.bwd_error is None
            dt = FORMATS[reduce].torch_dtype
            for k in ("weight", "alpha", "h_bias"):
                want = parts[0].grads[k].to(dt) + parts[1].grads[k].to(dt)
                assert got.grads[k].dtype == dt and torch.equal(got.grads[k], want), (reduce, k)
                assert got.grads[k].device == base["x2d"].device
            assert torch.equal(got.grads["x2d"], torch.cat([p.grads["x2d"] for p in parts]))
            for o, a, b in zip(got.outputs, parts[0].outputs, parts[1].outputs):
                assert torch.equal(o, torch.cat([a, b])) and o.device == base["x2d"].device
            if reduce == "bf16":  # the bf16 sum is really bf16: not the fp32 one
                exact = parts[0].grads["weight"].float() + parts[1].grads["weight"].float()
                assert not torch.equal(got.grads["weight"].float(), exact)
        assert all(torch.equal(base[k], v) for k, v in kept.items())
    finally:
        s.close()


def test_a_rank_that_dies_is_a_failed_row_and_the_next_case_still_runs(tmp_path):
    path = tmp_path / "s.toml"
    path.write_text('name = "dies"\n[[cases]]\nkernel = "sinkhorn"\nshapes = ["9x2x4x1", "5x2x4x1"]\n'
                    'dtypes = ["fp32"]\nfamilies = ["random"]\n')
    out = tmp_path / "r.parquet"
    res = cli.invoke(app, ["parity", "--scenario", str(path), "--kernel", "sinkhorn",
                           "--impl", f"{IMPLS / 'process.py'}:sinkhorn_os_exit",
                           "--device", "cpu", "--ranks", "2", "-o", str(out), "--quiet"])
    assert res.exit_code == 1, res.output
    rows = pq.read_table(out).to_pylist()
    errors = [r for r in rows if r["metric"] == "error" and r["direction"] == "fwd"]
    assert len(errors) == 2 and all("ended without a result" in r["message"] for r in errors)
    assert all(r["rule"] == "crashed" for r in errors)
    # the native baseline of both cases ran over two ranks (the group was started again)
    assert {r["case_id"] for r in rows if r["impl"] == "torch" and r["passed"]} == {r["case_id"] for r in errors}


def test_more_ranks_than_token_rows_is_an_unsupported_row(tmp_path):
    out = tmp_path / "r.parquet"
    res = cli.invoke(app, ["parity", "--kernel", "mix_aggregate", "--impl", "torch", "--device", "cpu", "--shape",
                           "3x2x4x45", "--dtype", "fp32", "--ranks", "4", "-o", str(out), "--quiet"])
    assert res.exit_code == 0, res.output
    msgs = {r["message"] for r in pq.read_table(out).to_pylist() if r["metric"] == "unsupported"}
    assert any("4 ranks need at least 4 token rows; this case has 3" in (m or "") for m in msgs), msgs


@pytest.mark.parametrize("args,needle", [
    (["--ranks", "0"], "at least 1"),
    (["--ranks", "2", "--grad-reduce", "fp16"], "unknown --grad-reduce"),
    (["--ranks", "2", "--kernel", "swiglu"], "not swiglu"),
    (["--ranks", "2", "--workers", "2"], "takes neither --workers"),
    (["--ranks", "2", "--check", "determinism"], "takes neither --workers"),
])
def test_bad_ranks_options_exit_2(tmp_path, args, needle):
    base = [] if "--kernel" in args else ["--kernel", "proj_rms"]
    res = cli.invoke(app, ["parity", *base, "--device", "cpu", *args, "-o", str(tmp_path / "r.parquet")])
    assert res.exit_code == 2, res.output
    assert needle in res.output


@pytest.mark.parametrize("kernel", sorted(sharded.TOKEN_INPUTS))
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_whole_batchs_output_shapes_come_from_its_first_token_row(kernel, dtype):
    """A sharded case draws its upstream gradients from the whole batch's output shapes, found by a
    native forward on the first token row: they are those of the whole batch's native run, so the
    draws are the same."""
    fam, base, ups, nat = _native_case(kernel, dtype=dtype)
    shapes = sharded.whole_batch_outputs(fam, kernel, native_impl(kernel), base, {})
    assert [(o.shape, o.dtype, o.device) for o in shapes] == [(o.shape, o.dtype, o.device) for o in nat.outputs]
    assert all(torch.equal(a, b) for a, b in zip(upstream_for(fam, shapes, 0), ups))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, TWO_GPUS])])
def test_a_gradient_that_is_the_upstream_tensor_itself_comes_back_from_a_rank(tmp_path, device):
    """A rank gets its upstream gradients as CUDA IPC handles; a backward that returns one of them
    as a gradient (here a wrong one) is copied before it goes back (a process cannot hand on what
    it mapped), so the case is judged, not an error."""
    out = tmp_path / "r.parquet"
    res = cli.invoke(app, ["parity", "--kernel", "sinkhorn", "--impl", f"{IMPLS / 'defects.py'}:sinkhorn_grad_is_upstream",
                           "--device", device, "--shape", "9x2x4x1", "--dtype", "fp32", "--ranks", "2",
                           "-o", str(out), "--quiet"])
    assert res.exit_code == 1, res.output
    rows = [r for r in pq.read_table(out).to_pylist() if r["impl"].endswith(":sinkhorn_grad_is_upstream")]
    assert rows and not [r for r in rows if r["metric"] == "error"], rows
    assert any(r["direction"] == "fwd" and r["passed"] for r in rows)
    assert any(r["direction"] == "bwd" and r["passed"] is False for r in rows)


def test_the_ranks_native_run_overlaps_the_reference_only_where_both_fit(monkeypatch):
    """The ranks run a case's native baseline while this process computes the float64 reference:
    on an 80 GB GPU not at the paper shape's fp32 h_post_bda (a 43 GB reference), which runs them
    one after the other; on a 141 GB one both fit."""
    s = sharded.Sharding(2, "fp32", "cuda")
    paper = Case("h_post_bda", "random", "fp32", parse_shape_for("mhc", "8192x4x4x7168"), (), 0, "cuda")
    small = Case("h_post_bda", "random", "fp32", parse_shape_for("mhc", "7x2x4x45"), (), 0, "cuda")
    monkeypatch.setattr("mhctool.spread.sharded.device_memory", lambda device: 80e9)
    assert sharded.overlaps(small, s) and not sharded.overlaps(paper, s)
    monkeypatch.setattr("mhctool.spread.sharded.device_memory", lambda device: 141e9)
    assert sharded.overlaps(paper, s)


def test_a_job_leaves_this_process_tensors_where_they_are():
    """The queue pickles a job in a thread of its own while this process goes on with the case (the
    float64 reference beside the ranks' native run); pickling a CPU tensor not yet shared moves its
    storage into shared memory, and the reference once read the inputs while they moved (a wrong
    baseline). A job carries copies: the case's own tensors stay where they are."""
    fam, base, ups, _ = _native_case("mapping")
    mine = {k: v for k, v in base.items() if v is not None}
    where = {k: v.untyped_storage().data_ptr() for k, v in mine.items()}
    s = sharded.Sharding(2, "fp32")
    try:
        got = sharded.collect(sharded.submit("mapping", native_impl("mapping"), base, {}, ups, s), 120)
    finally:
        s.close()
    assert got.fwd_error is None and got.bwd_error is None
    assert {k: v.untyped_storage().data_ptr() for k, v in mine.items()} == where
    assert not any(v.is_shared() for v in [*mine.values(), *ups])
