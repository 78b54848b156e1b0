"""`mhctool train`: a correct kernel stays with the float64 trajectory, planted ones drift and are
traced to their knob or named at their layer and step, and the golden values round-trip."""
import json
import re
import tempfile
import math
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from mhctool.analyses import train as T
from mhctool.cli.app import app

IMPLS = Path(__file__).resolve().parents[1] / "impls"
runner = CliRunner()
# a small model: Triton's interpreter runs its steps in about a tenth of a second
SMALL = ["--steps", "6", "--layers", "2", "--seq", "8", "--device", "cpu"]


def test_a_transposed_h_post_bda_drifts_and_is_traced_to_transpose_res(tmp_path, train):
    """The default model (its streams start equal and are averaged, so H^T's effect is small at
    first: 1.5e-4 in the loss at step 1, against 5.7e-7 allowed)."""
    res, text = train(tmp_path, "--impl", IMPLS / "defects.py:h_post_bda_transposed", "--device", "cpu", "--seeds", "1")
    assert res.exit_code == 1, text
    assert "mapping: torch (natively: no --impl for it)" not in text  # -q: only verdict lines
    assert "DRIFT lm loss: median distance" in text and "parts from the reference at step 1: off by" in text
    assert ("traced: the native run with h_post_bda.transpose_res=True (identify fits transpose_res=true) drifts "
            "the same way: the drift is h_post_bda.transpose_res") in text
    assert "one seed: a single sample of a chaotic run, --seeds 4 judges over an ensemble" in text
    rows = pq.read_table(tmp_path / "t.parquet").to_pylist()
    traced = [r for r in rows if r["metric"] == "traced:h_post_bda.transpose_res"]
    assert traced and traced[0]["passed"] is True
    assert "native:h_post_bda.transpose_res=True" in {r["run"] for r in rows}


def test_a_tracing_past_its_budget_stops_and_claims_no_cause(tmp_path, train):
    """The same drift with a budget spent before the first rerun: no knob is tried, and the verdict
    says the drift was not traced (never "the kernel's own error", which only a full tracing earns)."""
    res, text = train(tmp_path, "--impl", IMPLS / "defects.py:h_post_bda_transposed", "--device", "cpu", "--seeds", "1",
                      "--trace-budget", "1e-9")
    assert res.exit_code == 1, text
    assert ("traced: not traced: the tracing stopped at its budget of 0 s after 0 of 1 candidate conventions "
            "(--trace-budget)") in text, text
    assert "kernel's own error" not in text
    rows = pq.read_table(tmp_path / "t.parquet").to_pylist()
    assert not any(r["metric"].startswith("traced:") for r in rows)
    assert not any(r["run"].startswith("native:") for r in rows)


def test_the_tracing_budget_defaults_to_what_the_runs_took_and_zero_means_none():
    from mhctool.analyses.train.trace import TRACE_BUDGET, Budget
    assert Budget.of(None, 30.0).seconds == TRACE_BUDGET * 30.0 and Budget.of(0, 30.0).seconds is None
    assert Budget.of(5.0, 30.0).seconds == 5.0 and Budget.of(None, 0.1).seconds == 1.0  # a floor of a second
    assert not Budget.of(0, 30.0).spent(3, 5) and not Budget.of(100.0, 1.0).spent(0, 5)


def test_a_raw_exp_sinkhorn_goes_non_finite_where_the_logits_grow(tmp_path, train):
    """At lr 0.2 the Sinkhorn logits pass 88 within the run: the bare exponential overflows there,
    the float64 trajectory (and the native one) stay finite. Behaviour only: the step and the logit
    are a chaotic trajectory's (step 14 at 102.3 on an Intel CPU, 15 at 106.3 on an AMD EPYC)."""
    res, text = train(tmp_path, "--impl", IMPLS / "strangers.py:sinkhorn_raw_exp", "--device", "cpu", "--lr", "0.2",
                      "--seeds", "2")
    assert res.exit_code == 1, text
    found = re.search(r"the implementation goes non-finite at step (\d+): first layer \d+, sinkhorn output h_res "
                      r"\(\d+ elements non-finite\); the largest Sinkhorn logit there was ([\d.]+) "
                      r"\(seed (\d+); non-finite in [12] of 2 seeds\)", text)
    assert found, text
    step, logit, seed = int(found.group(1)), float(found.group(2)), int(found.group(3))
    assert logit > 88.0  # past where exp overflows in fp32: the cause, named
    assert "note: the native run goes non-finite" not in text
    rows = pq.read_table(tmp_path / "t.parquet").to_pylist()
    (bad,) = [r for r in rows if r["metric"] == "nonfinite"]
    assert bad["step"] == step and bad["passed"] is False and bad["seed"] == seed
    impl_steps = [r["step"] for r in rows if r["run"] == "impl" and r["metric"] == "lm loss" and r["seed"] == seed]
    assert max(impl_steps) == step < 20
    assert max(r["step"] for r in rows if r["run"] == "reference" and r["metric"] == "lm loss") == 20


def test_a_kernel_at_the_bf16_floor_does_not_drift(tmp_path, train):
    """The streams summed in another order and rounded once to bf16: the native run's rounding,
    so no false alarm, though both are far from the float64 run."""
    res, text = train(tmp_path, "--impl", IMPLS / "strangers.py:h_aggregate_streams_reversed", *SMALL,
                      "--dtype", "bf16", "--seeds", "2")
    assert res.exit_code == 0, text
    rows = pq.read_table(tmp_path / "t.parquet").to_pylist()
    (loss,) = [r for r in rows if r["metric"] == "drift:lm loss"]
    assert loss["passed"] and loss["value"] <= 1.0
    # bf16's median distance from the reference, within native's, in each seed
    assert all(r["value"] > 1e-4 for r in rows if r["metric"] == "seed-drift:lm loss")


@pytest.mark.parametrize("isolate,fn,words", [
    ("--no-isolate", "sinkhorn_raises_at_step_5", "step 5, forward: RuntimeError: the kernel's launch failed"),
    ("--isolate", "sinkhorn_exits_at_step_5", "step 5, forward: the implementation ended its process with exit code 3"),
    ("--isolate", "sinkhorn_backward_exits_at_step_5",
     "step 5, backward: the implementation ended its process with exit code 3"),
])
def test_a_kernel_that_fails_mid_run_ends_it_with_the_steps_so_far(tmp_path, isolate, fn, words, train):
    res, text = train(tmp_path, "--impl", IMPLS / f"train_faults.py:{fn}", *SMALL, isolate, "--seeds", "1")
    assert res.exit_code == 1, text
    assert f"the implementation's run ended at {words}" in text
    rows = pq.read_table(tmp_path / "t.parquet").to_pylist()
    assert sorted({r["step"] for r in rows if r["run"] == "impl" and r["metric"] == "lm loss"}) == [1, 2, 3, 4]
    assert any(r["metric"] == "error" and r["passed"] is False for r in rows)


def test_a_hung_step_ends_the_run_and_is_not_called_again(tmp_path, train):
    """An isolated implementation that hangs: its run ends at the step limit, named by step and
    phase, the native and float64 runs beside it kept; the first step's check does not call it
    again (a second hang)."""
    res, text = train(tmp_path, "--impl", IMPLS / "process.py:sinkhorn_hangs", "--kernel", "sinkhorn", *SMALL,
                      "--seeds", "1", "--step-timeout", "2")
    assert res.exit_code == 1, text
    # (", forward" where the worker reached the forward within the 2 s; building the model may take
    # them on a loaded CPU)
    assert re.search(r"the implementation's run ended at step 1(, forward)?: timed out: no step ended in 2 s",
                     text), text
    rows = pq.read_table(tmp_path / "t.parquet").to_pylist()
    assert {r["step"] for r in rows if r["run"] == "native" and r["metric"] == "lm loss"} == set(range(1, 7))
    assert not [r for r in rows if r["run"] == "first-step"]


def test_a_hang_in_a_seed_worker_ends_that_seeds_run_at_the_step_limit(tmp_path, train):
    """Seeds spread over workers run the implementation inside each worker, unisolated there: its
    step log is watched as an isolated trajectory's is, so a hang ends the seed's run at the limit
    (never waits for ever, never runs again), with native's and float64's runs kept."""
    res, text = train(tmp_path, "--impl", IMPLS / "process.py:sinkhorn_hangs", "--kernel", "sinkhorn", *SMALL,
                      "--seeds", "2", "--workers", "2", "--step-timeout", "2")
    assert res.exit_code == 1, text
    # ("step 1, forward: ..." where the worker reached the forward within the 2 s, "step 1: ..." where
    # building the model took them, as on a loaded CPU)
    assert re.search(r"step 1(, forward)?: timed out: no step ended in 2 s", text), text
    rows = pq.read_table(tmp_path / "t.parquet").to_pylist()
    errors = [r for r in rows if r["metric"] == "error"]
    assert len(errors) == 2 and all("timed out" in r["message"] for r in errors), errors
    for seed in {r["seed"] for r in errors}:
        assert {r["step"] for r in rows if r["run"] == "native" and r["metric"] == "lm loss"
                and r["seed"] == seed} == set(range(1, 7))


def test_the_step_watch_stops_watching_once_the_trajectory_ended():
    """A seed worker runs native's and float64's trajectories after the implementation's: the
    log's end line tells the watch that no step of the implementation is left to time."""
    import json

    from mhctool.analyses.train import trajectory as tr
    now = [0.0]
    log = Path(tempfile.mkdtemp()) / "steps.jsonl"
    watch = tr.StepWatch(log, limit=3.0, clock=lambda: now[0])
    log.write_text("1\n")
    assert watch() is None
    log.write_text("1\n" + json.dumps(tr.LOG_END) + "\n")
    assert watch() is None
    now[0] += 1000.0
    assert watch() is None and tr.read_log(log) == []  # ("1" is no step: the end line is never one)


def test_the_step_watch_allows_compiling_then_judges_by_the_pace():
    """No limit given: the first step may take FIRST_STEP_S, a later one 10x the slowest step
    before it, at least LATER_STEP_MIN_S; a limit given holds for every step."""
    from mhctool.analyses.train import trajectory as tr
    now = [0.0]
    log = Path(tempfile.mkdtemp()) / "steps.jsonl"
    watch = tr.StepWatch(log, clock=lambda: now[0])
    now[0] = tr.FIRST_STEP_S - 1
    assert watch() is None
    log.write_text("1\n")  # the first step ended after 599 s of compiling
    assert watch() is None and watch.allowed() == tr.LATER_STEP_MIN_S
    now[0] += 10.0
    log.write_text("1\n2\n")  # a 10 s step: 100 s allowed from now on
    assert watch() is None and watch.allowed() == 100.0
    now[0] += 100.5
    assert "no step ended in 100 s" in watch()
    # a limit given holds from the moment the job opened its log (the worker's start is apart)
    other = log.with_name("other.jsonl")
    fixed = tr.StepWatch(other, limit=3.0, clock=lambda: now[0])
    now[0] += 50.0
    assert fixed() is None
    other.write_text("")
    now[0] += 2.0
    assert fixed() is None
    now[0] += 1.5
    assert "no step ended in 3 s" in fixed()
    never = tr.StepWatch(log.with_name("never.jsonl"), limit=3.0, clock=lambda: now[0])
    now[0] += tr.FIRST_STEP_S + 1
    assert "had not started after 600 s" in never()


def test_a_step_timeout_without_isolation_is_bad_input(tmp_path, train):
    res, text = train(tmp_path, "--impl", "torch", *SMALL, "--step-timeout", "5", "--no-isolate")
    assert res.exit_code == 2 and "--step-timeout needs isolation" in text, text


def test_an_interrupt_keeps_the_steps_so_far():
    cfg = T.config("cpu", steps=6, layers=2, seq=8)
    seen = []
    out = T.session(cfg, "torch", interrupted=lambda: len(seen) >= 3,
                    progress=lambda role, step: seen.append(step.step))
    assert out.interrupted and [s.step for s in out.impl.steps] == [1, 2, 3]
    assert not out.compared


@pytest.mark.parametrize("args,words", [
    (["--impl", "nope"], "unknown implementation 'nope'"),
    (["--impl", "torch", "--steps", "0"], "--steps 0 must be at least 1"),
    (["--impl", "torch", "--hidden", "30", "--heads", "4"], "--hidden 30 must be a multiple of the attention heads"),
    (["--impl", "torch", "--knob", "sinkhorn.colour=1"], "colour is no knob of sinkhorn"),
    (["--impl", "torch", "--dtype", "fp8"], "unknown dtype 'fp8'"),
    (["--impl", str(IMPLS / "strangers.py:sinkhorn_wrong_signature"), "--kernel", "h_aggregate"],
     "cannot be called as h_aggregate"),
    (["--impl", str(IMPLS / "defects.py:sinkhorn_raises"), "--impl", str(IMPLS / "defects.py:sinkhorn_eps_1e8")],
     "two functions for sinkhorn"),
])
def test_bad_input_is_one_sentence_and_exit_2(tmp_path, args, words):
    res = runner.invoke(app, ["train", *args, "--device", "cpu", "-o", str(tmp_path / "x.parquet")])
    assert res.exit_code == 2, res.output
    assert words in " ".join(res.output.split()) and "Traceback" not in res.output


def test_a_gate_trains_and_diffs_against_stored_golden_values(tmp_path, train):
    res, _ = train(tmp_path, "--impl", "torch", *SMALL, "--goldens", tmp_path / "golden.json", "--no-compare",
                   "--seeds", "1")
    assert res.exit_code == 0
    suite = tmp_path / "suite.toml"
    suite.write_text('name = "t"\n[[train]]\nimpls = ["torch"]\ngolden = "golden.json"\nsteps = 6\nlayers = 2\n'
                     'seq = 8\ndevice = "cpu"\ncompare = true\n')
    res = runner.invoke(app, ["gate", "--suite", str(suite), "--no-isolate", "-q", "--junit", str(tmp_path / "g.xml"),
                              "--summary", str(tmp_path / "g.md"), "-o", str(tmp_path / "g.parquet")])
    assert res.exit_code == 0, res.output
    assert "PASSED 3 passed, 0 failed" in res.output  # lm loss, num-zeros, and the drift
    md = (tmp_path / "g.md").read_text()
    assert "| train-torch | train | 3 |" in md


def test_the_model_reads_the_families_signatures():
    """One layer calls the four families with their signatures; the float64 pieces return each
    output at the dtype the native one does."""
    cfg = T.config("cpu", steps=1, layers=1, seq=4, batch=1, dtype="bf16")
    calls = []
    pieces = {f: T.reference_piece(f, {}) for f in T.FAMILIES}
    for f in T.FAMILIES:
        inner = pieces[f].call
        pieces[f].call = (lambda args, f=f, inner=inner: calls.append((f, sorted(args))) or inner(args))
    traj = T.run(cfg, pieces, "reference")
    assert [c[0] for c in calls] == list(T.FAMILIES)
    # h_post_bda's call carries its dropout's key (counters going on from call to call), used where a dropout is set
    assert calls[0][1] == ["alpha", "h_bias", "weight", "x2d"] and \
        calls[3][1] == ["bias", "dropout_offset", "dropout_seed", "h_post", "h_res", "x", "y"]
    assert math.isfinite(traj.steps[0].metrics["lm loss"])


def test_without_an_implementation_it_trains_mhctools_triton_kernels(tmp_path, train):
    """As parity has a default: ``mhctool train`` alone runs mhctool's Triton kernels."""
    res, text = train(tmp_path, "--device", "cpu", "--steps", "2", "--layers", "1", "--seq", "4", "--seeds", "1")
    assert res.exit_code == 0, text
    meta = json.loads(pq.read_schema(tmp_path / "t.parquet").metadata[b"mhctool.run"])
    assert meta["pieces"] == {f: "triton" for f in T.FAMILIES}
