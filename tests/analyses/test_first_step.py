"""The first step judged per tensor inside mhctool's model (mhctool.analyses.train.first_step): a
wrong backward that the trajectories' global scalars hide fails at once, named; a correct one
passes; the trajectories' floor is what the metric resolves."""
import json
import math
import re
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from mhctool.analyses import train as T
from mhctool.analyses.train import first_step
from mhctool.analyses.train.trajectory import Step, Trajectory
from mhctool.analyses.train.verdict import judge
from mhctool.core.dtypes import FORMATS
from mhctool.core.metrics import ulp_size
from mhctool.core import report
from mhctool.core.verdict import VerdictRule

DEFECTS = Path(__file__).parents[1] / "impls" / "defects.py"


def test_a_backward_that_skips_the_normalisations_fails_at_the_first_step_naming_h_res(tmp_path, train):
    res, text = train(tmp_path, "--device", "cpu", "--steps", "1", "--seeds", "1", "--layers", "2",
                      "--impl", f"{DEFECTS}:sinkhorn_softmax_backward")
    assert res.exit_code == 1, text
    assert re.search(r"FAIL first step: \d+ of \d+ tensors fail parity's rule at the first step \(seed 0\): "
                     r"layer \d sinkhorn\.grad_logits \(the H_res logits' gradient: what the projection's H_res rows "
                     r"receive\): max_abs", text), text
    rows = [r for r in pq.read_table(tmp_path / "t.parquet").to_pylist() if r["run"] == "first-step"]
    failed = {r["metric"].split(":", 2)[2] for r in rows if r["passed"] is False}
    assert failed and all(name.endswith("sinkhorn.grad_logits") for name in failed), failed

def test_mhctools_own_kernels_pass_the_first_step_check(tmp_path, train):
    res, text = train(tmp_path, "--device", "cpu", "--steps", "1", "--seeds", "1", "--layers", "1", "--seq", "4")
    assert res.exit_code == 0, text
    assert ("ok first step: every entry point's outputs and gradients in every layer, and the parameters' "
            "gradients, at the first step") in text, text


def test_a_projection_that_writes_16_bit_outputs_fails_at_the_mapping_and_says_the_dtype(tmp_path, train):
    """PR 3828's projection writes proj and r in x's dtype (the stand-in does too): at bf16
    activations mhctool's fp32 mapping path sees that rounding, and the line says why; with the
    native mapping the library's other kernels pass."""
    lib = f"megatron:{DEFECTS.parent / 'megatron_pr3828'}"
    base = ("--device", "cpu", "--dtype", "bf16", "--steps", "1", "--seeds", "1", "--layers", "1", "--seq", "4")
    res, text = train(tmp_path, *base, "--impl", lib, name="a")
    assert res.exit_code == 1, text
    assert re.search(r"FAIL first step: .*layer 0 mapping\.\S+: max_abs .*\(mapping: its proj_rms's proj and r came "
                     r"back in bf16, where the model takes fp32\)", text), text
    res, text = train(tmp_path, *base, "--impl", lib, "--impl", "mhctool.kernels.torch.mhc:mapping", name="b")
    assert res.exit_code == 0 and "ok first step" in text, text


def test_a_tensor_written_at_16_bits_and_widened_is_named_by_its_grid():
    import torch
    g = torch.Generator().manual_seed(0)
    native = torch.randn(256, generator=g)
    assert first_step.sixteen_bit_grid(native.bfloat16().float(), native) == "bf16"
    assert first_step.sixteen_bit_grid(native.half().float(), native) == "fp16"
    assert first_step.sixteen_bit_grid(native + 1e-3, native) is None
    assert first_step.sixteen_bit_grid(native.bfloat16().float(), native.bfloat16().float()) is None  # native's too
    # bf16 values within fp16's range are fp16's too: native on bf16's grid says nothing of fp16
    assert first_step.sixteen_bit_grid((native * 1.001).bfloat16().float(), native.bfloat16().float()) is None
    assert first_step.sixteen_bit_grid(native[:8].bfloat16().float(), native[:8]) is None  # too few to tell


def test_an_engine_entry_point_returning_r_as_a_column_is_judged_and_its_16_bit_outputs_named():
    """Megatron hands its projection bf16 activations and takes r as [M, 1]; the float64 run
    recorded r as [M]: the shapes are conformed, never broadcast, and the dtypes said."""
    import torch
    from mhctool.analyses.train.pieces import family_call, native_piece, pick_impl
    from mhctool.families import get_family
    m, k, nh = 64, 32, 24
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = (torch.randn(nh, k, generator=g) / k ** 0.5).bfloat16()
    call = first_step.Call(0, "proj_rms", {"x2d": x, "weight": w},
                           [torch.randn(m, nh, generator=g).bfloat16(), torch.randn(m, generator=g).bfloat16()],
                           ("proj", "r"))
    impl = pick_impl("proj_rms", f"megatron:{DEFECTS.parent / 'megatron_pr3828'}", "cpu", "bf16")[0]
    knobs = {"proj_rms": {"eps": 1e-6}}
    mine = {"proj_rms": family_call("proj_rms", impl.fn, knobs["proj_rms"], impl.accepts, impl.bind, impl.takes)}
    native = {"proj_rms": native_piece("proj_rms", knobs["proj_rms"]).call}
    wide = {"proj_rms": family_call("proj_rms", get_family("proj_rms").reference, knobs["proj_rms"])}
    returned = {}
    judged = first_step.judge_calls([call], mine, native, wide, VerdictRule(), knobs, returned)
    assert {j.tensor for j in judged} == {f"layer 0 proj_rms.{t}" for t in ("proj", "r", "grad_x2d", "grad_weight:h_pre",
                                                                          "grad_weight:h_post", "grad_weight:h_res")}
    assert returned == {"proj_rms": {o: "bf16, where mhctool's native one gives fp32" for o in ("proj", "r")}}


def test_a_projection_is_judged_by_the_blocks_of_rows_it_feeds():
    """The mapping's weight and bias by the rows feeding H_pre, H_post and H_res; alpha by its gates."""
    import torch
    g = torch.arange(24.0).reshape(8, 3)  # n = 2: [pre(2) | post(2) | res(4)]
    p = first_step.parts("layers.1.phi", g, 2)
    assert list(p) == ["layers.1.phi:h_pre", "layers.1.phi:h_post", "layers.1.phi:h_res"]
    assert p["layers.1.phi:h_res"].shape == (4, 3) and first_step.parts("layers.1.qkv", g, 2) == {"layers.1.qkv": g}
    assert list(first_step.parts("layers.0.alpha", torch.ones(3), 2)) == [f"layers.0.alpha:{b}" for b in
                                                                         ("h_pre", "h_post", "h_res")]


def spacing(v: float) -> float:
    """The fp32 ulp at ``v`` (mhctool's ulp_size)."""
    import torch
    return float(ulp_size(torch.tensor([v], dtype=torch.float64), FORMATS["fp32"]))


def _traj(role, norms):
    t = Trajectory(role, {})
    t.steps = [Step(i + 1, {"lm loss": 3.0, "grad-norm": v, "num-zeros": 0.0}, {}, []) for i, v in enumerate(norms)]
    return t


def test_where_native_lands_on_the_reference_a_kernel_two_fp32_spacings_away_still_passes():
    """The metrics are fp32 numbers: a correct kernel whose pieces round elsewhere lands a spacing or
    two from the reference where native happened to land on it. The floor is two spacings of the
    value, no less (2 unit roundoffs of it are between one and two spacings: at 4.5, 0.54e-6
    against a spacing of 0.48e-6, so two spacings failed on one CPU and passed on another)."""
    v = 4.5
    ref = _traj("reference", [v, v])
    native = _traj("native", [v, v])
    cfg = T.config("cpu", steps=2, layers=1, seq=4)
    two = _traj("impl", [v + 2 * spacing(v), v + spacing(v)])
    three = _traj("impl", [v + 3 * spacing(v), v + 3 * spacing(v)])
    norm = {d.metric: d for d in judge(two, native, ref, cfg, VerdictRule())}["grad-norm"]
    assert norm.passed and math.isclose(norm.threshold, 2 * spacing(v)), norm.message
    assert not {d.metric: d for d in judge(three, native, ref, cfg, VerdictRule())}["grad-norm"].passed


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_train_stopped_by_a_signal_writes_what_it_has_marked_interrupted(tmp_path, sig):
    """A CI time limit (SIGTERM) or a Ctrl-C once the run has started: the report is written, marked
    interrupted, exit 130, no traceback (the seeds spread over two workers: none finished yet)."""
    out = tmp_path / "t.parquet"
    p = subprocess.Popen([sys.executable, "-m", "mhctool.cli", "train", "--device", "cpu", "--seeds", "4",
                          "--workers", "2", "--steps", "20", "--layers", "1", "-o", str(out)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    header = p.stdout.readline()  # printed once the request is checked, before the first step
    assert header.startswith("train: "), header + p.stderr.read()
    p.send_signal(sig)
    rest, err = p.communicate(timeout=120)
    assert p.returncode == 130, rest + err
    assert "Traceback" not in err and "INTERRUPTED" in rest, rest + err
    assert json.loads(pq.read_schema(out).metadata[b"mhctool.run"])["interrupted"] is True


@pytest.mark.slow  # two small trainings with tracing: about 20 s on 2 cores
@pytest.mark.parametrize("phase", ["judging the first step", "tracing the drift"])
def test_two_signals_while_judging_or_tracing_keep_the_trajectories(tmp_path, phase):
    """Two signals (timeout's SIGTERM, then a Ctrl-C seconds later) as the first step is judged or
    the drift traced: the work in hand is abandoned, and the report still holds the trajectories
    trained before, marked interrupted, with exit code 130."""
    import os

    from mhctool.analyses.runs import Watch
    from mhctool.analyses.runs import train as run

    def started(line, detail):
        if line.startswith(phase):
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGINT)
    out = tmp_path / "t.parquet"
    req = run.Request([f"{Path(__file__).resolve().parents[1] / 'impls' / 'defects.py'}:h_post_bda_transposed"],
                      device="cpu", seeds=1, workers=1, isolate=False,
                      out=out)
    watch = Watch(started=started)
    o = run.run(run.prepare(req, watch), watch)
    assert o.exit_code == 130 and o.session.interrupted
    table, meta = report.read(out)
    rows = table.to_pylist()
    assert meta["run"]["interrupted"] is True
    assert {r["run"] for r in rows if r["metric"] == "lm loss"} >= {"impl", "native", "reference"}
    assert not any(r["run"].startswith("native:") for r in rows)  # no rerun the signal cut short is kept
