"""Seed ensembles: the verdict's noise model.

Training is chaotic: two correct runs part a little more every step, and by how much depends on
the seed. One trajectory's verdict can flip with the seed, so ``mhctool train --seeds K`` trains
the implementation, native and float64 trajectories from K seeds (the initial model and the
synthetic tokens both move with the seed) and judges the implementation over the ensemble.

The test, per judged metric (lm loss, grad-norm, num-zeros): for each seed s, the single-seed rule
(:func:`mhctool.analyses.train.verdict.judge`) gives the implementation's median distance from the
float64 trajectory over the steps, ``d_s``, and what it may be, ``a_s = kappa * n_s + floor``
(``n_s`` native's median distance). The ratios ``d_s / a_s`` are paired over the seeds (the same
seed's data and initial model in all three runs), and the metric drifts when both say so: their
geometric mean is above 1 (how far, pooled over the seeds), and the single-seed rule fails in a
majority of the seeds (how consistently: more than half; every seed for num-zeros, see
:func:`seeds_needed`). A correct kernel's distance is native's
in distribution, so its ratios sit around ``1 / kappa``; in a chaotic run one seed's native
distance can be small by chance, and its ratio alone can lift the mean past 1, which the
majority condition does not let decide. A run that ended early in any seed fails. The message
says in how many seeds the single-seed rule fails, with the distances' median and range over
the seeds against native's.

The zero counts are judged the same way (:func:`zero_findings`): a num-zeros series with two
levels or jumps is a finding of the implementation where its runs show one in more seeds than the
float64 runs do, by at least half the seeds; the parameters whose gradients hold more zeros in
the implementation's runs than in every float64 run are named with their largest counts.

The seeds run over ``workers`` processes (one per GPU, or per core), each seed in one; the rows are
the same whatever the spread (each seed's runs are what one process computes alone).
"""
from __future__ import annotations

import math
import statistics
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from mhctool.analyses.goldens import check
from mhctool.analyses.train.pieces import impl_pieces, native_piece, reference_piece
from mhctool.analyses.train.setup import (
    JUDGED,
    TrainConfig,
    from_dict,
    to_dict,
)
from mhctool.analyses.train.trajectory import (
    StepWatch,
    Trajectory,
    logged_run,
    run,
    to_golden,
)
from mhctool.analyses.train.verdict import Drift, judge
from mhctool.core.errors import kept_at_once
from mhctool.core.verdict import VerdictRule
from mhctool.spread.isolation import Worker
from mhctool.spread.pool import worker_env

ROLES = ("impl", "native", "reference")
# a ratio of 0 (a run equal to the reference at every step) has no logarithm: it counts as this
_LEAST_RATIO = 1e-6


@dataclass
class SeedRun:
    """One seed's trajectories: the implementation's, native's and float64's (None: not run)."""

    seed: int
    impl: Trajectory
    native: Trajectory | None = None
    reference: Trajectory | None = None

    def trajectories(self) -> list[Trajectory]:
        return [t for t in (self.impl, self.native, self.reference) if t is not None]


def seeds_of(cfg: TrainConfig, count: int) -> list[int]:
    """The ensemble's seeds: the base seed and the ``count - 1`` after it."""
    return [cfg.seed + k for k in range(count)]


def seed_job(cfg_dict: dict, specs: dict, knobs: dict, conventions: dict, compare: bool, as_used: bool,
             log: str | None = None) -> dict:
    """One seed's trajectories (what a worker process runs): the implementation's (each step also
    in ``log``, which the parent watches for a hang), then with ``compare`` native's and float64's;
    as dicts."""
    cfg = from_dict(cfg_dict)
    pieces, eff = impl_pieces(specs, knobs, conventions, cfg.device, cfg.dtype, as_used)
    impl = logged_run(cfg, specs, knobs, conventions, log, as_used) if log else run(cfg, pieces, "impl")
    out = {"impl": impl.to_dict()}
    if compare:
        out["native"] = run(cfg, {f: native_piece(f, eff[f], pieces[f].precision) for f in pieces},
                            "native").to_dict()
        out["reference"] = run(cfg, {f: reference_piece(f, eff[f]) for f in pieces}, "reference").to_dict()
    return out


def spread_seeds(cfg: TrainConfig, seeds: list[int], workers: int, one_seed: Callable[[TrainConfig], SeedRun],
                 job_args: tuple, interrupted: Callable[[], bool] = lambda: False,
                 finished: Callable[[SeedRun], None] | None = None, step_timeout: float | None = None,
                 hung: Callable[[TrainConfig, str, str], SeedRun] | None = None) -> list[SeedRun]:
    """The seeds' runs, in seed order. ``workers`` > 1: each seed in a worker process (``seed_job``
    with ``job_args``; one per GPU, round-robin, on a GPU machine); a worker that dies or fails
    has its seed run again here by ``one_seed``, which isolates the implementation. A worker whose
    implementation stops ending steps (:class:`StepWatch`, ``step_timeout``) is stopped, and the
    seed is ``hung(cfg, its step log, why)``, never run again. One worker: ``one_seed`` for every
    seed, here."""
    out: list[SeedRun | None] = [None] * len(seeds)
    if workers <= 1 or len(seeds) <= 1:
        with kept_at_once():  # a second signal: the seeds finished are kept
            for k, s in enumerate(seeds):
                if interrupted():
                    break
                out[k] = one_seed(replace(cfg, seed=s))
                if finished:
                    finished(out[k])
        return [r for r in out if r is not None]
    n = min(workers, len(seeds))
    todo = list(range(len(seeds)))
    lock = threading.Lock()
    retry: list[int] = []

    def serve(index: int) -> None:
        def started() -> Worker:
            return Worker(daemon=False, env=worker_env(index, cfg.device, n))
        w = started()
        try:
            while not interrupted():
                with lock:
                    if not todo:
                        return
                    k = todo.pop(0)
                c = replace(cfg, seed=seeds[k])
                log = str(Path(logs) / f"seed-{seeds[k]}.jsonl")
                value, failure = w.call("mhctool.analyses.train.ensemble:seed_job", (to_dict(c), *job_args, log),
                                        timeout=None, interrupted=interrupted, stalled=StepWatch(log, step_timeout))
                if failure is not None and failure.kind == "timeout" and hung is not None:
                    run = hung(c, log, failure.message)  # a hang: never run again
                    with lock:
                        out[k] = run
                        if finished:
                            finished(run)
                    w.stop()  # it is still in the hang: a fresh worker for the next seed
                    w = started()
                    continue
                if failure is not None:
                    with lock:
                        retry.append(k)
                    continue
                got = {role: Trajectory.from_dict(d) for role, d in value.items()}
                run = SeedRun(seeds[k], got["impl"], got.get("native"), got.get("reference"))
                for t in run.trajectories():
                    t.seed = seeds[k]
                with lock:
                    out[k] = run
                    if finished:
                        finished(run)
        finally:
            w.stop()

    threads = [threading.Thread(target=serve, args=(i,), name=f"mhctool-seed-{i}", daemon=True) for i in range(n)]
    with tempfile.TemporaryDirectory(prefix="mhctool-seeds-") as logs:
        for t in threads:
            t.start()
        with kept_at_once():  # a second signal: the seeds in hand are abandoned (their workers stopped)
            for t in threads:
                while t.is_alive():
                    t.join(0.1)
        for t in threads:  # after an abandonment they stop at their next poll of interrupted()
            t.join()
    with kept_at_once():
        for k in sorted(retry):  # the seed's worker died: again here, the implementation isolated
            if interrupted():
                break
            out[k] = one_seed(replace(cfg, seed=seeds[k]))
            if finished:
                finished(out[k])
    return [r for r in out if r is not None]


# --- the ensemble's verdict -------------------------------------------------------------------

@dataclass
class EnsembleDrift:
    """One metric of the implementation over the seeds (the module docstring's test)."""

    metric: str
    passed: bool
    ratio: float  # the geometric mean over the seeds of distance / allowed (drifts above 1)
    per_seed: list[Drift]  # the single-seed verdicts, in seed order
    seeds: list[int]
    parted_at: int | None  # where the first seed that drifts parted from the reference
    message: str
    anomaly: str | None = None  # the zero-count finding (num-zeros)
    findings: list[str] = field(default_factory=list)  # per parameter, zeros beyond the reference's

    @property
    def drifting(self) -> int:
        return sum(not d.passed for d in self.per_seed)

    # the fields a single-seed Drift has, for what prints and writes both
    @property
    def median(self) -> float:
        return self.ratio

    @property
    def threshold(self) -> float:
        return 1.0


def pooled(metric: str, seeds: list[tuple[float, float]]) -> tuple[float, bool]:
    """The test over the seeds from each seed's (median distance, allowed): the geometric mean of
    their ratios, and whether the metric drifts (the mean above 1 and the single-seed rule failing
    in :func:`seeds_needed` of them). Also what ``dev/train_ensembles.py`` judges recorded seeds with."""
    ratios = [_ratio(m, a) for m, a in seeds]
    logs = [math.log(r) if math.isfinite(r) else math.inf for r in ratios]
    mean_log = sum(logs) / len(logs) if logs else 0.0
    g = math.exp(mean_log) if math.isfinite(mean_log) else math.inf
    if max(ratios, default=0.0) <= _LEAST_RATIO:
        g = 0.0  # equal to the reference in every seed
    failing = sum(not m <= a for m, a in seeds)
    return g, g > 1.0 and failing >= seeds_needed(metric, len(seeds))


def _ratio(median: float, allowed: float) -> float:
    if not math.isfinite(median):
        return math.inf
    if allowed <= 0:
        return math.inf if median > 0 else _LEAST_RATIO
    return max(median / allowed, _LEAST_RATIO)


def _spread(values: list[float]) -> str:
    """``median (least-largest)`` of the seeds' values (an infinite one sorts last)."""
    med = statistics.median(values)
    if len(values) == 1:
        return f"{med:.3g}"
    return f"{med:.3g} ({min(values):.3g}-{max(values):.3g})"


def judge_ensemble(runs: list[SeedRun], cfg: TrainConfig, rule: VerdictRule | None = None,
                   params: int = 0, zeros: ZeroFindings | None = None) -> list[EnsembleDrift]:
    """The implementation's drift over the seeds, per judged metric (the module docstring's test);
    ``zeros``: :func:`zero_findings` of ``runs`` where the caller has them already."""
    rule = rule or VerdictRule()
    per_seed = [judge(r.impl, r.native, r.reference, replace(cfg, seed=r.seed), rule, params) for r in runs]
    zeros = zeros or zero_findings(runs)
    out = []
    k = len(runs)
    for i, metric in enumerate(JUDGED):
        ds = [p[i] for p in per_seed]
        # the zero-count anomaly is judged over the ensemble below, not seed by seed
        plain = [replace(d, passed=d.median <= d.threshold) if d.metric == "num-zeros" and not _short(d)
                 else d for d in ds]
        g, over = pooled(metric, [(d.median, d.threshold) for d in plain])
        short = [r.seed for r, d in zip(runs, ds) if _short(d)]
        anomaly = zeros.anomaly if metric == "num-zeros" else None
        drifting = sum(not d.passed for d in plain)
        needed = seeds_needed(metric, k)
        passed = not over and not short and anomaly is None
        natives = [d.native for d in plain]
        evidence = (f"median distance {_spread([d.median for d in plain])} against native's "
                    f"{_spread(natives)}; distance / allowed {g:.3g} over the seeds (geometric mean; "
                    f"drifts above 1 with {'every seed' if needed == k and k > 2 else 'a majority of the seeds'})")
        if short:
            msg = (f"ended early in {len(short)} of {k} seeds (seed {short[0]}: "
                   f"{next(d.message for r, d in zip(runs, ds) if r.seed == short[0])})")
        elif anomaly:
            msg = f"{anomaly}; {evidence}"
        elif passed:
            msg = f"stays with the reference in {k - drifting} of {k} seeds: {evidence}"
        else:
            msg = f"drifts in {drifting} of {k} seeds: {evidence}"
        first = next((d for d in plain if not d.passed and d.parted_at is not None), None)
        if not passed and first is not None and not short:
            seed = runs[plain.index(first)].seed
            msg += (f"; seed {seed} parts from the reference at step {first.parted_at}: off by {first.parted_by:.3g} "
                    f"against {first.allowed:.3g} allowed there")
        out.append(EnsembleDrift(metric, passed, g, ds, [r.seed for r in runs],
                                 None if passed or first is None else first.parted_at, msg, anomaly,
                                 zeros.parameters if metric == "num-zeros" else []))
    return out


def seeds_needed(metric: str, k: int) -> int:
    """In how many of k seeds the single-seed rule must fail for the metric to drift: more than half,
    and every seed for num-zeros. A zero count moves by discrete events (a unit that dies zeroes its
    row of the weight's gradient), so one seed's native run bounds its distance poorly: on the GPU
    default model at lr 0.05 a correct kernel's single-seed num-zeros rule failed in 26 of 160 seeds,
    three of four in one ensemble. A kernel that writes zeros it should not (an unwritten or
    detached gradient) does so in every seed; dead units beyond the float64 runs' are the zero
    findings' to judge."""
    return k if metric == "num-zeros" else k // 2 + 1


def _short(d: Drift) -> bool:
    return d.message.startswith("ended at step")


# --- the zero counts over the ensemble --------------------------------------------------------

@dataclass
class ZeroFindings:
    impl_seeds: int  # seeds whose implementation run has a num-zeros jump or two levels
    reference_seeds: int  # the same for the float64 runs
    seeds: int
    anomaly: str | None  # the finding that fails num-zeros, or None
    sentence: str  # what the counts show, whichever way it goes
    parameters: list[str] = field(default_factory=list)  # zeros beyond every float64 run's, per parameter


def _zero_kinds(t: Trajectory) -> set[str]:
    if t is None or len(t.steps) < 4:
        return set()
    return {a.kind for a in check(to_golden(t)) if a.metric == "num-zeros" and a.kind in ("bimodal", "jump")}


def _largest_zeros(*trajectories: Trajectory) -> dict[str, int]:
    """Per parameter, the most zeros its gradient held at any step of these trajectories."""
    out: dict[str, int] = {}
    for t in trajectories:
        for s in t.steps:
            for name, n in s.zeros.items():
                out[name] = max(out.get(name, 0), n)
    return out


def zero_findings(runs: list[SeedRun]) -> ZeroFindings:
    """How often the implementation's and the float64 runs show zero-count jumps or two levels, and
    which parameters' gradients hold more zeros in the implementation's runs than in any float64
    run (in at least half the seeds)."""
    k = len(runs)
    impl = [r for r in runs if _zero_kinds(r.impl)]
    ref = [r for r in runs if r.reference is not None and _zero_kinds(r.reference)]
    need = max(1, math.ceil(k / 2))
    sentence = (f"num-zeros jumps or two levels in {len(impl)} of {k} of the implementation's runs, "
                f"{len(ref)} of {k} of the float64 runs")
    anomaly = None
    if len(impl) - len(ref) >= need:
        anomaly = (f"zero-count excursions the float64 runs do not have: {sentence}")
    envelope = _largest_zeros(*(r.reference for r in runs if r.reference is not None))
    beyond: dict[str, list[int]] = {}
    for r in runs:
        for name, n in _largest_zeros(r.impl).items():
            if n > envelope.get(name, 0):
                beyond.setdefault(name, []).append(n)
    params = [f"{name}: up to {max(ns):,} zeros in {len(ns)} of {k} seeds (the float64 runs at most "
              f"{envelope.get(name, 0):,})"
              for name, ns in sorted(beyond.items(), key=lambda kv: -max(kv[1])) if len(ns) >= need]
    if anomaly is None:
        anomaly = _zeroed_block(runs)
    return ZeroFindings(len(impl), len(ref), k, anomaly, sentence, params[:5])


# a parameter's zeros at the implementation's typical step, against the most any native or float64
# run of the ensemble had at any step: over ZEROED_FACTOR times that plus ZEROED_FLOOR, in every
# seed, is a block of the gradient the implementation zeroes. A correct kernel's typical count stays
# near the envelope: inside Megatron-core's model (4 layers, lr 0.01, 8 seeds, 2026-11-28) the fused
# kernels' and the Triton kernels' least count over the seeds was at most 1.3x it, for every
# parameter; the planted H^T h_post_bda zeroed layer 0's attention H_res rows (16,384) at the
# median step of 8 of 8 seeds, where the native and float64 runs had at most 40.
ZEROED_FACTOR = 2.0
ZEROED_FLOOR = 100


def _zeroed_block(runs: list[SeedRun]) -> str | None:
    """The parameter whose gradient the implementation zeroes far beyond every native and float64
    run, at its median step in every seed; None when there is none (or no baseline to weigh it)."""
    baselines = [t for r in runs for t in (r.native, r.reference) if t is not None and t.steps]
    if not baselines:
        return None
    envelope = _largest_zeros(*baselines)
    typical: dict[str, list[float]] = {}
    for r in runs:
        names = {name for s in r.impl.steps for name in s.zeros}
        for name in names:
            typical.setdefault(name, []).append(statistics.median(s.zeros.get(name, 0) for s in r.impl.steps))
    k = len(runs)
    zeroed = [(min(ns), name) for name, ns in typical.items()
              if len(ns) == k and min(ns) > ZEROED_FACTOR * envelope.get(name, 0) + ZEROED_FLOOR]
    if not zeroed:
        return None
    zeroed.sort(key=lambda t: (-t[0], t[1]))  # the most zeros first, then the first layer
    least, name = zeroed[0]
    parts = [t for t in zeroed if t[1].startswith(name + ":")]
    if parts:  # the projection's rows that hold them (H_pre, H_post or H_res)
        least, name = parts[0]
    wholes = {nm.partition(":")[0] for _, nm in zeroed}
    more = f" (and {len(wholes) - 1} more parameter{'s' if len(wholes) > 2 else ''})" if len(wholes) > 1 else ""
    return (f"a block of exact-zero gradients the native and float64 runs do not have: {name}{more} holds "
            f"{least:,.0f} or more zeros at the median step of every seed ({k} of {k}), the native and float64 "
            f"runs at most {envelope.get(name, 0):,} at any step")
