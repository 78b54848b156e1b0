"""Foreign kernel libraries judged unchanged through their adapters (mhctool/libraries/), with
stand-ins written from Megatron-LM's and TransformerEngine's public signatures (tests/impls/), and
TE's real Triton kernels through the interpreter when they are staged in .anchors/te."""
import os
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from mhctool.families import get_family
from mhctool.registry.impl import Impl
from mhctool.registry.specs import load_external, resolve_impls
from mhctool.cli.app import app

ROOT = Path(__file__).resolve().parents[2]
IMPLS = ROOT / "tests" / "impls"
SCENARIO = ROOT / "tests" / "data" / "libraries.toml"
MHC = "sinkhorn,h_aggregate,h_post_bda,proj_rms,mapping,mix_aggregate"
cli = CliRunner()


def parity(tmp_path, *args, kernel=MHC, scenario=SCENARIO):
    tmp_path.mkdir(parents=True, exist_ok=True)
    out = tmp_path / "r.parquet"
    res = cli.invoke(app, ["parity", "--kernel", kernel, "--device", "cpu", "--scenario", str(scenario),
                           "-o", str(out), *map(str, args)])
    return res, (pq.read_table(out).to_pylist() if out.exists() else [])


def failures(rows):
    return Counter((r["kernel"], r["family"], r["dtype"], r["direction"], r["tensor"])
                   for r in rows if r["passed"] is False and r["impl"] != "torch")


def test_megatron_pr3828_shaped_module_passes_unchanged_but_for_its_16_bit_projection(tmp_path):
    res, rows = parity(tmp_path, "--impl", f"megatron:{IMPLS / 'megatron_pr3828'}")
    # its projection writes proj and r in x's dtype, as PR 3828's does: at bf16 that rounding is
    # judged at the fp32 contract, and the rows say the dtype they came back in
    assert res.exit_code == 1, res.output
    bad = [r for r in rows if r["passed"] is False]
    assert bad and {(r["kernel"], r["dtype"], r["direction"]) for r in bad} == {("proj_rms", "bf16", "fwd")}
    assert {r["dtype_out"] for r in bad} == {"bf16"}
    judged = {r["kernel"] for r in rows if r["impl"].startswith("megatron[pr3828]") and r["passed"] is not None}
    assert judged == {"sinkhorn", "h_aggregate", "h_post_bda", "proj_rms"}
    skipped = {r["kernel"]: r["message"] for r in rows if r["impl"].startswith("megatron") and r["metric"] == "unsupported"}
    assert skipped == {"mapping": "megatron (pr3828) has no mapping kernel",
                       "mix_aggregate": "megatron (pr3828) has no mix_aggregate kernel"}
    assert not [r for r in rows if r["metric"] == "error"]


def test_megatron_pr3828_defects_fail_on_measurements_not_errors(tmp_path):
    res, rows = parity(tmp_path, "--impl", f"megatron:{IMPLS / 'megatron_pr3828_defects' / 'fused_mhc_kernels.py'}")
    assert res.exit_code == 1, res.output
    assert not [r for r in rows if r["metric"] == "error"]
    failed = set(failures(rows))
    # the backward's eps=1e-8: dx on rows with tiny norms, in both dtypes
    assert {("proj_rms", "tiny_norm", d, "bwd", "grad_x2d") for d in ("fp32", "bf16")} <= failed
    # bf16 partial sums of the h_pre gradient
    assert ("h_aggregate", "long_c", "bf16", "bwd", "grad_h_pre") in failed
    # proj returned in bf16: converted, judged at the fp32 contract, and the row names bf16
    assert ("proj_rms", "random", "bf16", "fwd", "proj") in failed
    assert {r["dtype_out"] for r in rows if r["tensor"] == "proj" and r["dtype"] == "bf16"
            and r["impl"] != "torch"} == {"bf16"}
    assert {k for k, *_ in failed} == {"proj_rms", "h_aggregate"}


def test_megatron_dev_passes_under_its_declared_conventions(tmp_path):
    res, rows = parity(tmp_path, "--impl", f"megatron:{IMPLS / 'megatron_dev'}")
    assert res.exit_code == 0, res.output
    knobs = {r["kernel"]: r["knobs"] for r in rows if r["impl"].startswith("megatron[dev]") and r["passed"]}
    assert '"stabilize": "softmax"' in knobs["sinkhorn"]
    assert '"transpose_res": true' in knobs["h_post_bda"]
    assert '"compute_h_eps": 1e-06' in knobs["mapping"]
    # the fourth output (r = ||x|| / sqrt(K), [M, 1]) is judged too
    assert any(r["kernel"] == "mapping" and r["tensor"] == "rms" and r["passed"] for r in rows)


@pytest.mark.parametrize("kernel,fn,convention", [
    ("sinkhorn", "fused_sinkhorn", "stabilize=softmax"),
    ("h_post_bda", "fused_h_post_bda", "transpose_res=true"),
])
def test_convention_turns_dev_from_fail_to_pass_and_nothing_else_changes(tmp_path, kernel, fn, convention):
    spec = f"{IMPLS / 'megatron_dev' / 'fused_mhc_kernels.py'}:{fn}"
    plain, rows_a = parity(tmp_path / "a", "--impl", spec, kernel=kernel)
    assert plain.exit_code == 1, plain.output
    assert "--convention" in plain.output  # the failure points the way
    declared, rows_b = parity(tmp_path / "b", "--impl", spec, "--convention", convention, kernel=kernel)
    assert declared.exit_code == 0, declared.output
    native = lambda rows: [(r["case_id"], r["tensor"], r["metric"], r["value"]) for r in rows if r["impl"] == "torch"]  # noqa: E731
    assert native(rows_a) == native(rows_b)


def test_knobs_bind_by_alias_for_a_plain_function(tmp_path):
    """fused_sinkhorn(input_logits, num_iterations, eps): iters goes to num_iterations."""
    res, rows = parity(tmp_path, "--impl", f"{IMPLS / 'megatron_pr3828' / 'fused_mhc_kernels.py'}:fused_sinkhorn",
                       kernel="sinkhorn")
    assert res.exit_code == 0, res.output
    impl = load_external(f"{IMPLS / 'megatron_pr3828' / 'fused_mhc_kernels.py'}:fused_sinkhorn", "sinkhorn")
    assert impl.bind("iters") == "num_iterations" and impl.bind("eps") == "eps" and impl.bind("order") is None


def test_positional_only_knobs_bind_by_position():
    def kernel(logits, iters, eps, /):
        return logits
    impl = Impl("x", "sinkhorn", "external", kernel)
    assert impl.bind("iters") == 1 and impl.bind("eps") == 2


def test_megatron_module_path_in_a_folder(tmp_path):
    pkg = tmp_path / "site" / "megatron" / "core" / "fusions"
    pkg.mkdir(parents=True)
    for d in (pkg, pkg.parent, pkg.parent.parent):
        (d / "__init__.py").write_text("")
    (pkg / "fused_mhc_kernels.py").write_text((IMPLS / "megatron_dev" / "fused_mhc_kernels.py").read_text())
    res, rows = parity(tmp_path, "--impl", f"megatron:{tmp_path / 'site'}", kernel="sinkhorn")
    assert res.exit_code == 0, res.output
    assert any(r["impl"] == "megatron[dev]:fused_sinkhorn" and r["passed"] for r in rows)


def test_te_shaped_module_passes_with_its_layouts_and_conventions(tmp_path):
    res, rows = parity(tmp_path, "--impl", f"te:{IMPLS / 'te_standin'}")
    assert res.exit_code == 0, res.output
    impls = {r["impl"] for r in rows if r["passed"]}
    assert {"te[main]:mhc_fused_aggregate[tf32]", "te[main]:mhc_fused_aggregate[ieee]",
            "te[main]:mhc_fused_expand_combine[ieee]", "te[main]:mhc_fused_sinkhorn",
            "te[main]:mhc_fused_projection+mhc_fused_scale[ieee]",
            "te[main]:mhc_generate_mix_and_aggregate[ieee]", "te[main]:mhc_generate_mix_and_aggregate[tf32]"} <= impls
    # on the CPU the interpreter multiplies fp32 at IEEE; on a GPU Triton's TF32 truncates its operands
    assert {r["precision"] for r in rows if r["impl"].endswith("[tf32]")} == {"ieee"}
    (impl, _) = resolve_impls("h_aggregate", [f"te:{IMPLS / 'te_standin'}"])
    assert impl.name.endswith("[tf32]") and impl.precision_on("cuda") == "tf32_trunc"


def test_te_defects_fail_on_measurements(tmp_path):
    res, rows = parity(tmp_path, "--impl", f"te:{IMPLS / 'te_standin_defects'}", "--no-hint")  # no hint asserted
    assert res.exit_code == 1, res.output
    failed = failures(rows)
    # the composite carries both defects: the short Sinkhorn everywhere, eps outside the root on tiny norms
    assert {k for k, *_ in failed} == {"sinkhorn", "mapping", "mix_aggregate"}
    assert {f for k, f, *_ in failed if k == "mapping"} == {"tiny_norm"}  # eps outside the square root
    assert {f for k, f, *_ in failed if k == "mix_aggregate"} == {"random", "tiny_norm"}
    assert not [r for r in rows if r["metric"] == "error"]


def test_adapter_implementations_run_isolated(tmp_path):
    """An isolation worker re-resolves the adapter's implementation from its spec."""
    res, rows = parity(tmp_path, "--impl", f"te:{IMPLS / 'te_standin'}", "--isolate", kernel="h_aggregate")
    assert res.exit_code == 0, res.output
    assert sum(r["passed"] is True for r in rows if r["impl"].startswith("te[")) > 0


@pytest.mark.parametrize("args,needle", [
    (["--impl", "megatron:no/such/file.py"], "no file"),
    (["--impl", f"megatron:{IMPLS / 'correct.py'}"], "none of the public functions"),
    (["--impl", "cudnn:x.py"], None),
    (["--impl", f"megatron:{IMPLS / 'megatron_dev'}", "--convention", "stabilise=softmax"], "no convention of"),
    (["--impl", f"megatron:{IMPLS / 'megatron_dev'}", "--convention", "stabilize=log"], "not accepted"),
    (["--convention", "stabilize=softmax"], "name one with --impl"),
    (["--impl", f"megatron:{IMPLS / 'megatron_dev'}", "--convention", "transpose_res"], "malformed --convention"),
])
def test_bad_library_input_is_exit_2(tmp_path, args, needle):
    res, _ = parity(tmp_path, *args)
    assert res.exit_code == 2, res.output
    if needle:
        assert needle in res.output
    assert "Traceback" not in res.output


TE_STAGED = ROOT / ".anchors" / "te"


@pytest.mark.skipif(not TE_STAGED.is_dir(), reason="TE is not staged (../shared/anchors/stage.sh te GIT_DIR)")
def test_real_te_triton_kernels_through_the_interpreter(tmp_path, monkeypatch):
    """TE's own Sinkhorn, aggregate and expand_combine, unchanged, at fp32 (the interpreter's bf16
    tl.dot is unusable) on small n = 4 shapes."""
    monkeypatch.setenv("NVTE_DISABLE_TRITON_AUTOTUNING", "1")
    sc = tmp_path / "te.toml"
    sc.write_text('name = "te-cpu"\n'
                  '[[cases]]\nkernel = "sinkhorn"\nshapes = ["6x1x4x1"]\nfamilies = ["random", "large_logits"]\n'
                  '[[cases]]\nkernel = "h_aggregate"\nshapes = ["3x1x4x40"]\nfamilies = ["random"]\n'
                  '[[cases]]\nkernel = "h_post_bda"\nshapes = ["3x1x4x40"]\nfamilies = ["random"]\n')
    res, rows = parity(tmp_path, "--impl", f"te:{TE_STAGED}", "--dtype", "fp32",
                       kernel="sinkhorn,h_aggregate,h_post_bda", scenario=sc)
    assert res.exit_code == 0, res.output
    assert {r["kernel"] for r in rows if r["impl"].startswith("te[") and r["passed"]} == \
        {"sinkhorn", "h_aggregate", "h_post_bda"}
    assert os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.parametrize("kernel", ["h_aggregate", "h_post_bda", "mix_aggregate"])
def test_te_layouts_staged_once_give_what_the_converting_call_gives(kernel):
    """bench converts TE's layouts once, outside the timed region, and times the library call
    alone: that call on the staged inputs is the converting call on mhctool's inputs, bit for bit."""
    import torch

    from mhctool.families import generate

    impl = resolve_impls(kernel, [f"te:{IMPLS / 'te_standin'}"])[0]
    assert impl.staged is not None
    stage, fn = impl.staged
    fam = get_family(kernel)
    from mhctool.core.shapes import parse_shape_for
    _, raw = generate(kernel, "random", parse_shape_for("mhc", "3x2x4x40"), 0, {}, device="cpu")
    staged = stage(raw)
    assert staged["x"].shape == (3, 2, 40, 4) and raw["x"].shape == (3, 2, 4, 40)
    want = fam.call(impl.fn, raw, {}, impl.accepts, impl.bind)
    got = fam.call(fn, staged, {}, impl.accepts, impl.bind)
    for w, g in zip(want, got):
        assert torch.equal(w, g)


def test_upstream_gradients_come_in_the_outputs_memory_order():
    """TE's expand_combine returns its (s, b, C, n) output as an (s, b, n, C) view; the upstream
    gradient bench hands its backward is laid out the same way (as TE's next layer would hand it),
    with the values a contiguous one has, so TE's backward is not timed copying it into its layout."""
    import torch

    from mhctool.core import inputs as inputs_mod
    from mhctool.families import generate
    from mhctool.core.shapes import parse_shape_for

    impl = resolve_impls("h_post_bda", [f"te:{IMPLS / 'te_standin'}"])[0]
    stage, fn = impl.staged
    fam = get_family("h_post_bda")
    _, raw = generate("h_post_bda", "random", parse_shape_for("mhc", "3x2x4x40"), 0, {}, device="cpu")
    out = fam.call(fn, stage(raw), {}, impl.accepts, impl.bind)[0]
    assert not out.is_contiguous()  # the adapter's view back to mhctool's layout
    up = inputs_mod.upstream_grads([out], seed=7)[0]
    assert up.stride() == out.stride()
    assert torch.equal(up, inputs_mod.upstream_grads([out.contiguous()], seed=7)[0])
