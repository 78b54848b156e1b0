"""`mhctool train --seeds K`: the verdict over a seed ensemble (mhctool.analyses.train.ensemble):
a correct kernel stays with the reference in every seed, a kernel without a gradient drifts in
every seed and its zeros are named, the rows are the same whatever the spread, and the test is
the one the guide states."""
import json
import math
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from mhctool.analyses import goldens as G
from mhctool.analyses import train as T
from mhctool.cli.app import app

IMPLS = Path(__file__).resolve().parents[1] / "impls"
runner = CliRunner()
SMALL = ["--steps", "6", "--layers", "2", "--seq", "8", "--device", "cpu"]


def test_a_correct_kernel_stays_with_the_reference_over_an_ensemble(tmp_path, train):
    """mhctool's Triton kernels through the interpreter, from two seeds: every mHC family runs
    them, the drift is the native one's in both, the report has each seed's runs and judgement and
    the ensemble's verdict, and the golden values are the first seed's run."""
    res, text = train(tmp_path, "--impl", "triton", "--steps", "6", "--layers", "1", "--seq", "8", "--device", "cpu",
                      "--seeds", "2", "--goldens", tmp_path / "a.json")
    assert res.exit_code == 0, text
    assert "PASSED stays with the float64 reference (kappa 2 x native's drift, over 2 seeds" in text
    for metric in T.JUDGED:
        assert f"ok {metric}: stays with the reference in 2 of 2 seeds: median distance" in text
    rows = pq.read_table(tmp_path / "t.parquet").to_pylist()
    assert {r["run"] for r in rows} == {"impl", "native", "reference", "first-step"}
    assert {r["seed"] for r in rows if r["metric"] == "lm loss"} == {0, 1}
    meta = json.loads(pq.read_schema(tmp_path / "t.parquet").metadata[b"mhctool.run"])
    assert meta["pieces"] == {f: "triton" for f in T.FAMILIES}
    assert meta["seeds"] == [0, 1] and "geometric mean" in meta["test"]
    assert [d["seed"] for d in meta["distances"]["lm loss"]] == [0, 1]
    drifts = [r for r in rows if r["metric"].startswith("drift:")]
    assert len(drifts) == 3 and all(r["passed"] and r["seed"] is None and r["threshold"] == 1.0 for r in drifts)
    per_seed = [r for r in rows if r["metric"].startswith("seed-drift:")]
    assert sorted((r["metric"], r["seed"]) for r in per_seed) == sorted((f"seed-drift:{m}", s) for m in T.JUDGED
                                                                        for s in (0, 1))
    assert all(r["passed"] is None for r in per_seed)  # the ensemble decides
    # the loss falls: the synthetic source is learnable
    loss = {r["step"]: r["value"] for r in rows if r["run"] == "reference" and r["metric"] == "lm loss"
            and r["seed"] == 0}
    assert loss[6] < loss[1] - 0.3
    golden = G.load(tmp_path / "a.json")
    assert set(golden) >= {"lm loss", "num-zeros", "grad-norm", "iteration-time"}
    assert golden["lm loss"].start_step == 1 and golden["lm loss"].end_step == 6
    first = {r["step"]: r["value"] for r in rows if r["run"] == "impl" and r["metric"] == "lm loss" and r["seed"] == 0}
    assert golden["lm loss"].values == first


def test_a_missing_backward_is_the_kernels_own_drift(tmp_path, train):
    """A Sinkhorn whose outputs carry no gradient: H_res's rows of the mapping weight learn nothing
    (their gradients are exact zeros: num-zeros jumps by n^2 x nC a layer), and no convention
    explains it."""
    res, text = train(tmp_path, "--impl", IMPLS / "train_faults.py:sinkhorn_detached", *SMALL, "--seeds", "2")
    assert res.exit_code == 1, text
    # the whole block, zero in every seed where no native or float64 run has a zero there
    assert ("DRIFT num-zeros: a block of exact-zero gradients the native and float64 runs do not have: layers.0.phi "
            "(and 1 more parameter) holds 2,048 or more zeros at the median step of every seed (2 of 2), the native "
            "and float64 runs at most 0 at any step; median distance 4.13e+03 (4.13e+03-4.13e+03)") in text
    assert "the drift is the kernel's own error" in text
    rows = pq.read_table(tmp_path / "t.parquet").to_pylist()
    per_seed = [r for r in rows if r["metric"] == "seed-drift:num-zeros"]
    # a layer: phi's H_res rows, their biases, alpha_res; the same in every seed
    assert [r["value"] for r in per_seed] == [2 * (16 * 4 * 32 + 16 + 1)] * 2
    zeros = {r["metric"]: r["value"] for r in rows if r["run"] == "impl" and r["step"] == 1 and r["seed"] == 1}
    assert zeros["zeros:layers.0.phi"] == 16 * 4 * 32
    (finding,) = [r for r in rows if r["metric"] == "zeros-finding"]
    assert "layers.0.phi: up to 2,048 zeros in 2 of 2 seeds (the float64 runs at most 0)" in finding["message"]


def test_the_rows_are_the_same_whatever_the_spread(tmp_path, train):
    """Three seeds in this process and over two worker processes: the same rows (times apart)."""
    args = ["--impl", IMPLS / "correct.py:sinkhorn", "--steps", "4", "--layers", "1", "--seq", "8", "--device", "cpu",
            "--seeds", "3", "--no-trace"]
    tables = []
    for workers in ("1", "2"):
        res, text = train(tmp_path, *args, "--workers", workers, name=f"w{workers}")
        assert res.exit_code == 0, text
        tables.append(sorted(tuple(sorted((k, str(v)) for k, v in r.items() if k != "run_id")) for r in
                             pq.read_table(tmp_path / f"w{workers}.parquet").to_pylist()
                             if r["metric"] != "iteration-time"))
    assert tables[0] == tables[1]


def test_a_sweep_runs_native_and_float64_once_a_seed():
    """Two implementations at one configuration given one ``shared`` dict: the second session
    takes the first's native and float64 runs (the same objects), runs only its own, and judges as
    a session of its own would."""
    cfg = T.config("cpu", steps=3, layers=1, seq=8)
    ran: list[str] = []

    def progress(role, step):
        if step.step == cfg.steps:
            ran.append(role)
    shared: dict = {}
    a = T.session(cfg, T.assign([f"{IMPLS}/correct.py:sinkhorn"]), trace=False, seeds=2, shared=shared,
                  progress=progress)
    b = T.session(cfg, T.assign([f"{IMPLS}/defects.py:sinkhorn_eps_1e8"]), trace=False, seeds=2, shared=shared,
                  progress=progress)
    alone = T.session(cfg, T.assign([f"{IMPLS}/defects.py:sinkhorn_eps_1e8"]), trace=False, seeds=2)
    assert ran == ["impl", "native", "reference"] * 2 + ["impl"] * 2
    assert all(x.native is y.native and x.reference is y.reference for x, y in zip(a.runs, b.runs))
    assert [(d.metric, d.passed, d.ratio) for d in b.drifts] == [(d.metric, d.passed, d.ratio) for d in alone.drifts]


def _traj(role: str, seed: int, loss: list[float], zeros: list[float] | None = None) -> "T.Trajectory":
    t = T.Trajectory(role, {}, seed=seed)
    zeros = zeros or [0.0] * len(loss)
    t.steps = [T.Step(i + 1, {"lm loss": v, "grad-norm": 1.0, "num-zeros": z}, {}, [])
               for i, (v, z) in enumerate(zip(loss, zeros))]
    return t


@pytest.mark.parametrize("offsets,drifts", [
    ([1.0, 1.0, 1.0, 1.0], False),    # the implementation as far from the reference as native: passes
    ([4.0, 4.0, 4.0, 4.0], True),     # four times native's distance in every seed: drifts
    ([3.0, 0.5, 0.5, 0.5], False),    # past kappa in one seed of four, closer in the others: passes
    ([4.0, 4.0, 4.0, 0.5], True),     # twice kappa in three seeds of four: drifts
    ([12.0, 12.0, 0.5, 0.5], False),  # the mean past 1 from two seeds of four: no majority, passes
])
def test_the_ensemble_verdict_takes_the_geometric_mean_and_a_majority_of_seeds(offsets, drifts):
    """The test the guide states, on made-up trajectories: per seed, the implementation's median
    distance from the reference over what kappa x native's allows; drifts where their geometric
    mean over the seeds is above 1 and the one-seed rule fails in most seeds, and says in how
    many."""
    from mhctool.analyses.train.ensemble import SeedRun, judge_ensemble
    cfg = T.config("cpu", steps=8)
    runs = []
    for seed, off in enumerate(offsets):
        ref = [3.0 - 0.1 * i for i in range(8)]
        native = [v + 1e-3 for v in ref]
        impl = [v + off * 1e-3 for v in ref]
        runs.append(SeedRun(seed, _traj("impl", seed, impl), _traj("native", seed, native),
                            _traj("reference", seed, ref)))
    (loss, _, _) = judge_ensemble(runs, cfg, params=1000)
    assert loss.passed is not drifts
    over = sum(o > 2.0 for o in offsets)
    assert loss.drifting == over
    words = f"drifts in {over} of 4 seeds" if drifts else f"stays with the reference in {4 - over} of 4 seeds"
    assert loss.message.startswith(words), loss.message
    assert math.isclose(loss.ratio, math.prod(o / 2.0 for o in offsets) ** 0.25, rel_tol=1e-3)


@pytest.mark.parametrize("offsets,drifts", [
    ([4.0, 4.0, 4.0, 0.5], False),  # twice kappa in three seeds of four: a majority, not every seed
    ([4.0, 4.0, 4.0, 4.0], True),   # in every seed: drifts
])
def test_num_zeros_drifts_only_where_every_seed_does(offsets, drifts):
    """Zero counts move by discrete events that one native run a seed samples poorly: num-zeros
    drifts where the single-seed rule fails in every seed (lm loss and grad-norm: a majority)."""
    from mhctool.analyses.train.ensemble import SeedRun, judge_ensemble
    cfg = T.config("cpu", steps=8)
    runs = []
    loss = [3.0 - 0.1 * i for i in range(8)]
    for seed, off in enumerate(offsets):
        ref = [100.0] * 8
        runs.append(SeedRun(seed, _traj("impl", seed, loss, [v + 10 * off for v in ref]),
                            _traj("native", seed, loss, [v + 10 for v in ref]), _traj("reference", seed, loss, ref)))
    (_, _, zeros) = judge_ensemble(runs, cfg, params=1000)
    assert zeros.passed is not drifts and zeros.drifting == sum(o > 2.0 for o in offsets)
    assert zeros.ratio > 1.0
    assert "drifts above 1 with every seed" in zeros.message


def test_the_same_seed_twice_writes_the_same_golden_values(tmp_path, train):
    """goldens diff --deterministic passes on two runs of one seed (the data and the initial model
    come from the seed alone)."""
    for name in ("a", "b"):
        res, text = train(tmp_path, "--impl", IMPLS / "correct.py:sinkhorn", *SMALL, "--seeds", "1", "--no-compare",
                          "--goldens", tmp_path / f"{name}.json", name=name)
        assert res.exit_code == 0, text
    res = runner.invoke(app, ["goldens", "diff", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--deterministic"])
    assert res.exit_code == 0, res.output


def test_a_zeroed_block_fails_num_zeros_only_when_every_seed_has_it_far_beyond_native_and_float64():
    """The zero findings' block rule: a parameter's zeros at the implementation's median step, in
    every seed, above twice the most any native or float64 run had plus a hundred (inside
    Megatron's model the planted H^T h_post_bda zeroed layer 0's attention H_res rows this way)."""
    from mhctool.analyses.train.ensemble import SeedRun, zero_findings
    from mhctool.analyses.train.trajectory import Step, Trajectory

    def run(role, seed, counts):
        t = Trajectory(role, {}, seed=seed)
        t.steps = [Step(i + 1, {"num-zeros": float(n)}, {"L0.w:h_res": n, "L0.w": n + 3, "L1.w": 5}, []) for i, n in enumerate(counts)]
        return t

    def runs(impl_counts):
        return [SeedRun(s, run("impl", s, c), run("native", s, [40, 300, 40, 40]), run("reference", s, [20] * 4))
                for s, c in enumerate(impl_counts)]
    zeroed = [16384, 16384, 0, 16384]  # the median step: 16,384
    f = zero_findings(runs([zeroed] * 4))
    assert f.anomaly.startswith("a block of exact-zero gradients the native and float64 runs do not have: L0.w:h_res "
                                "holds 16,384 or more zeros at the median step of every seed "
                                "(4 of 4), the native and float64 runs at most 300 at any step")
    assert zero_findings(runs([zeroed] * 3 + [[40] * 4])).anomaly is None  # one seed without it
    assert zero_findings(runs([[650] * 4] * 4)).anomaly is None  # within 2 x 300 + 100: chaotic counts
    assert zero_findings(runs([[16384, 0, 0, 0]] * 4)).anomaly is None  # the typical (median) step has none
