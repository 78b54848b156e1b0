"""A whole ``mhctool train`` run: the implementation's trajectory (isolated or not), the native
and float64 ones, the verdict, the tracing; its report rows and settings."""
from __future__ import annotations

import math
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

from mhctool.analyses.knob_shift import typed_value
from mhctool.analyses.train import first_step as first_step_mod
from mhctool.analyses.train.ensemble import (
    SeedRun,
    ZeroFindings,
    judge_ensemble,
    seeds_of,
    spread_seeds,
    zero_findings,
)
from mhctool.analyses.train.pieces import (
    Piece,
    family_call,
    impl_pieces,
    native_piece,
    reference_piece,
)
from mhctool.analyses.train.setup import FAMILIES, TrainConfig, to_dict
from mhctool.analyses.train.trace import Attribution, Budget, attribute, candidate_knobs
from mhctool.analyses.train.trajectory import (
    FIRST_STEP_S,
    Step,
    StepWatch,
    Trajectory,
    param_count,
    read_log,
    read_phase,
    run,
)
from mhctool.analyses.train.verdict import judge, nonfinite_sentence
from mhctool.core.errors import UsageError, kept_at_once
from mhctool.core.verdict import VerdictRule
from mhctool.spread.isolation import Failure
from mhctool.families import get_family


def rows(trajs: list[Trajectory]) -> list[dict]:
    """Report rows (report.TRAIN_SCHEMA): per trajectory, step and metric; health per layer."""
    out = []

    def row(t: Trajectory, step, layer, metric, value, message=None) -> dict:
        return {"run": t.role, "step": step, "layer": layer, "metric": metric, "value": value, "threshold": None,
                "passed": None, "message": message, "seed": t.seed}
    for t in trajs:
        for s in t.steps:
            for metric, v in s.metrics.items():
                out.append(row(t, s.step, None, metric, float(v)))
            for name, count in s.zeros.items():
                if count:
                    out.append(row(t, s.step, None, f"zeros:{name}", float(count)))
            for layer, h in enumerate(s.health):
                for name, v in h.items():
                    out.append(row(t, s.step, layer, name, float(v)))
            if s.first_nonfinite:
                layer, fam, name = s.first_nonfinite
                out.append(row(t, s.step, layer, "first non-finite", math.nan, f"{fam}.{name}"))
    return out


def verdict_rows(role: str, drifts: list, seed: int | None = None) -> list[dict]:
    """The verdict per judged metric (``seed``: the one seed judged, None for an ensemble's), and
    an ensemble's single-seed judgements as rows without a verdict (``seed-drift:METRIC``)."""
    out = [{"run": role, "step": d.parted_at, "layer": None, "metric": f"drift:{d.metric}", "value": d.median,
            "threshold": d.threshold, "passed": d.passed, "message": d.message, "seed": seed} for d in drifts]
    for d in drifts:
        for s, p in zip(getattr(d, "seeds", []), getattr(d, "per_seed", [])):
            out.append({"run": role, "step": p.parted_at, "layer": None, "metric": f"seed-drift:{d.metric}",
                        "value": p.median, "threshold": p.threshold, "passed": None, "message": p.message, "seed": s})
    return out


@dataclass
class Outcome:
    cfg: TrainConfig
    spec: str
    # per seed the implementation's, native's and float64's (the first seed's first), then the
    # native runs the tracing made
    trajectories: list[Trajectory]
    eff: dict[str, dict]  # per family, the knobs every trajectory computed
    drifts: list = field(default_factory=list)  # Drift (one seed) or EnsembleDrift (several)
    nonfinite: str | None = None  # where the implementation went non-finite and the reference did not
    attributions: list[Attribution] = field(default_factory=list)
    interrupted: bool = False
    traced_asked: bool = True  # the drift was to be traced (--trace)
    runs: list[SeedRun] = field(default_factory=list)  # per seed, its trajectories
    zeros: ZeroFindings | None = None  # the zero counts over the ensemble (several seeds)
    first_step: first_step_mod.Check | None = None  # every tensor of the first step judged (compared runs)
    trace_stopped: str | None = None  # where the tracing's budget ended it before every candidate was tried

    @property
    def impl(self) -> Trajectory:
        """The implementation's first trajectory; stopped before any seed finished, an empty one
        that says it was interrupted (the report is written all the same)."""
        return self.trajectories[0] if self.trajectories else Trajectory("impl", {}, error="interrupted")

    @property
    def seeds(self) -> list[int]:
        return [r.seed for r in self.runs] or [self.cfg.seed]

    @property
    def ensemble(self) -> bool:
        return len(self.runs) > 1

    def role(self, name: str) -> Trajectory | None:
        return next((t for t in self.trajectories if t.role == name), None)

    @property
    def compared(self) -> bool:
        return self.role("reference") is not None

    @property
    def errors(self) -> list[Trajectory]:
        """The implementation's runs that ended early, by a raise or a crash (not an interrupt)."""
        return [r.impl for r in self.runs if r.impl.error and r.impl.error != "interrupted"] or \
            ([self.impl] if not self.runs and self.impl.error and self.impl.error != "interrupted" else [])

    @property
    def passed(self) -> bool:
        return (not self.errors and self.impl.error is None and self.nonfinite is None
                and all(d.passed for d in self.drifts) and not self.interrupted
                and (self.first_step is None or self.first_step.passed))

    def traced(self) -> str | None:
        """The sentence that names the knob a drift comes from, or says it is the kernel's own."""
        if not self.traced_asked or not self.drifts or all(d.passed for d in self.drifts) or self.nonfinite \
                or self.errors:
            return None
        hits = [a for a in self.attributions if a.reproduces]
        if hits:
            a = hits[0]
            return f"{a.message}: the drift is {a.family}.{a.knob}"
        tried = ", ".join(f"{a.family}.{a.knob}={a.value}" for a in self.attributions)
        if self.trace_stopped:  # not every candidate tried: no claim that the kernel's own error is left
            return f"not traced: {self.trace_stopped}" + (f" (none reproduces it of those tried: {tried})"
                                                          if tried else "")
        return ("no convention in which it differs reproduces it" + (f" (tried: {tried})" if tried else
                " (identify fits it no other convention)") + ": the drift is the kernel's own error")


def parse_knobs(items: list[tuple[str, str]], flag: str, conventions_only: bool = False) -> dict[str, dict]:
    """``FAMILY.KNOB=VALUE`` or ``KNOB=VALUE`` (every family of the model that has it) -> per family,
    each value checked; a knob no family of the model has (or no convention, for --convention) is
    a UsageError."""
    out: dict[str, dict] = {}
    for name, raw in items:
        family, _, knob = name.rpartition(".")
        takers = [family] if family else [f for f in FAMILIES if knob in get_family(f).knobs]
        for f in takers:
            if f not in FAMILIES:
                raise UsageError(f"{flag} {name}: the model's mHC families are {', '.join(FAMILIES)}")
            fam = get_family(f)
            ok = knob in (fam.conventions if conventions_only else fam.knobs)
            if not ok:
                raise UsageError(f"{flag} {name}: {knob} is no {'convention' if conventions_only else 'knob'} of {f}; "
                                 f"accepted: {', '.join(fam.conventions if conventions_only else fam.knobs) or 'none'}")
            out.setdefault(f, {})[knob] = fam.knobs[knob].check(f, knob, typed_value(fam.knobs[knob].kind, knob, raw))
        if not takers:
            raise UsageError(f"{flag} {name}: no mHC family of the model has the knob {knob}")
    return out


def session(cfg: TrainConfig, spec: str | dict[str, str], knobs: dict[str, dict] | None = None,
            conventions: dict[str, dict] | None = None, rule: VerdictRule | None = None, compare: bool = True,
            trace: bool = True, isolation=None, interrupted: Callable[[], bool] = lambda: False,
            progress: Callable[[str, Step], None] | None = None, as_used: bool = False, seeds: int = 1,
            workers: int = 1, isolation_factory: Callable[[], object] | None = None,
            shared: dict | None = None, engine=None, isolated: bool = False,
            step_timeout: float | None = None, phase: Callable[[str], None] = lambda line: None,
            trace_budget: float | None = None) -> Outcome:
    """The implementation's trajectory, then (``compare``) the native and float64 ones, the
    verdict, and (``trace``) the attribution of a drift; from ``seeds`` seeds (the base seed and
    those after it), judged over the ensemble where there are several (:mod:`.ensemble`).
    ``isolation``: an isolation Worker the implementation's trajectories run in (a crash or a hang
    ends one with its steps kept). ``workers``: processes the seeds are spread over;
    ``isolation_factory``: a Worker for a seed run again here after its worker died. ``shared``: a
    dict that keeps the native and float64 trajectories of the seeds run in this process, by seed,
    configuration, knobs and precision, for the next session given it (a sweep over
    implementations at one configuration runs them once). ``engine``: an
    :class:`~mhctool.analyses.train.engine.EngineRunner` whose trainer runs the three trajectories
    (each in a process of its own, side by side), judged and traced the same way. Before the
    trajectories, where they are compared, the first step is judged per tensor
    (:mod:`.first_step`); ``isolated``: the implementation runs in an isolation worker there too
    (``isolation``, else one from ``isolation_factory``). ``step_timeout``: seconds an isolated
    step may take (None: :class:`~.trajectory.StepWatch`'s defaults); an implementation that hung
    in its trajectory is not called again for the first step. ``phase(line)``: what the run does
    beyond its steps, as it starts (judging the first step, tracing the drift: which knob and
    seed). ``trace_budget``: seconds the tracing may take (None: :data:`~.trace.TRACE_BUDGET` times
    what the trajectories took); no rerun starts after it, and the verdict says the drift was not traced."""
    rule = rule or VerdictRule()
    knobs, conventions = knobs or {}, conventions or {}
    specs = spec if isinstance(spec, dict) else {f: spec for f in FAMILIES}
    say = (lambda role: (lambda step: progress(role, step))) if progress else (lambda role: None)
    started = time.monotonic()
    if engine is not None:
        return _engine_session(cfg, engine, rule, compare, interrupted, say, seeds, trace, phase, trace_budget)
    pieces, eff = impl_pieces(specs, knobs, conventions, cfg.device, cfg.dtype, as_used)

    def one_seed(c: TrainConfig, worker=None, impl: Trajectory | None = None) -> SeedRun:
        worker = worker if worker is not None else isolation
        if impl is not None:
            pass  # its trajectory ended elsewhere (a seed worker's hang)
        elif worker is not None:
            impl = _isolated(c, specs, knobs, conventions, pieces, worker, interrupted, as_used, step_timeout)
        else:
            impl = run(c, pieces, "impl", interrupted, say("impl"))
        impl.seed = c.seed
        r = SeedRun(c.seed, impl)
        if compare and not interrupted():
            key = repr((to_dict(c), eff, {f: p.precision for f, p in pieces.items()}))
            r.native, r.reference = shared.get(key, (None, None)) if shared is not None else (None, None)
            if r.native is None:
                r.native = run(c, {f: native_piece(f, eff[f], pieces[f].precision) for f in pieces}, "native",
                               interrupted, say("native"))
                r.reference = run(c, {f: reference_piece(f, eff[f]) for f in pieces}, "reference", interrupted,
                                  say("reference"))
                if shared is not None and not interrupted():
                    shared[key] = (r.native, r.reference)
        return r

    def again(c: TrainConfig) -> SeedRun:  # a seed whose worker died, here with the implementation isolated
        w = isolation if isolation is not None else (isolation_factory() if isolation_factory else None)
        try:
            return one_seed(c, w)
        finally:
            if w is not None and w is not isolation:
                w.stop()

    def hung(c: TrainConfig, log: str, why: str) -> SeedRun:
        """A seed whose implementation hung in a seed worker (unisolated there): the steps it
        logged and the hang, then native's and float64's trajectories here; never run again."""
        return one_seed(c, impl=_from_log(c, pieces, log, why, hung=True))

    def finished(r: SeedRun) -> None:  # a seed run in a worker: its steps, for the progress
        if progress:
            for t in r.trajectories():
                for s in t.steps:
                    progress(t.role, s)

    seed_list = seeds_of(cfg, seeds)
    if len(seed_list) == 1:
        runs = [one_seed(cfg)]
    else:
        runs = spread_seeds(cfg, seed_list, workers, again if workers > 1 else one_seed,
                            (specs, knobs, conventions, compare, as_used), interrupted,
                            finished if workers > 1 else None, step_timeout, hung)
    first = None
    hung = any(t.role == "impl" and t.hung for r in runs for t in r.trajectories())
    if compare and runs and not interrupted() and not hung:  # the seed's initial weights, whenever it runs
        phase("judging the first step: each family's calls in every layer")
        with kept_at_once():  # a second signal: no first-step check, the trajectories kept
            first = _first_step(cfg, specs, knobs, conventions, pieces, eff, rule, as_used, interrupted,
                                isolation if isolation is not None else
                                (isolation_factory() if isolated and isolation_factory else None),
                                own=isolation is None, timeout=step_timeout or FIRST_STEP_S)
    name = " ".join(dict.fromkeys(specs.values()))
    if "mix_aggregate" in specs:  # a whole-module variant: what it was asked as (a planted path: its function)
        name = next((s for s in specs.values() if s != "torch"), "torch") + "[module]"
    out = Outcome(cfg, name, [t for r in runs for t in r.trajectories()], eff,
                  traced_asked=trace, runs=runs, first_step=first)
    complete = compare and runs and all(r.reference is not None for r in runs) and len(runs) == len(seed_list)
    if complete and not interrupted():
        params = param_count(cfg)
        _set_verdict(out, runs, cfg, rule, params)
        if _drift_to_trace(out) and trace and not interrupted():
            cands = candidate_knobs(specs, eff, pieces, cfg.device)
            precision = {f: p.precision for f, p in pieces.items()}
            budget = Budget.of(trace_budget, time.monotonic() - started)
            out.attributions, alts = attribute(runs, cfg, eff, cands, rule, params, interrupted, precision,
                                               phase=phase, budget=budget)
            out.trajectories.extend(alts)
            out.trace_stopped = budget.said
    out.interrupted = interrupted() or any(t.error == "interrupted" for t in out.trajectories) or \
        len(runs) < len(seed_list)
    return out


def _set_verdict(out: Outcome, runs: list[SeedRun], cfg: TrainConfig, rule: VerdictRule, params: int) -> None:
    """The verdict on ``runs`` into ``out``: one seed by the single-seed rule, several over the
    ensemble (with its zero findings), and where the implementation went non-finite."""
    if len(runs) == 1:
        r = runs[0]
        out.drifts = judge(r.impl, r.native, r.reference, cfg, rule, params)
        out.nonfinite = nonfinite_sentence(r.impl, r.reference)
    else:
        out.zeros = zero_findings(runs)
        out.drifts = judge_ensemble(runs, cfg, rule, params, out.zeros)
        out.nonfinite = _nonfinite_ensemble(runs)


def _drift_to_trace(out: Outcome) -> bool:
    """Whether a judged drift is left to trace: the run stayed finite, no run failed, a metric drifted."""
    return not out.nonfinite and not out.errors and not all(d.passed for d in out.drifts)


def _engine_session(cfg: TrainConfig, engine, rule: VerdictRule, compare: bool, interrupted, say,
                    seeds: int, trace: bool = True, phase: Callable[[str], None] = lambda line: None,
                    trace_budget: float | None = None) -> Outcome:
    """:func:`session` with another trainer's trajectories (``engine``), judged and traced as
    mhctool's (the tracing's reruns: the engine's own path with mhctool's native piece computing
    the knob at one entry point)."""
    roles = ("impl", "native", "reference") if compare else ("impl",)
    started = time.monotonic()
    got = engine.side_by_side([(seed, role) for seed in seeds_of(cfg, seeds) for role in roles], say, interrupted)
    runs = []
    for seed in seeds_of(cfg, seeds):
        if (seed, "impl") not in got:
            break
        runs.append(SeedRun(seed, got[(seed, "impl")], got.get((seed, "native")), got.get((seed, "reference"))))
        if compare and (runs[-1].native is None or runs[-1].reference is None):
            break
    eff = engine.effective("impl")
    cfg = replace(cfg, dtype=engine.dtype)  # the floors of the dtype it trained at
    out = Outcome(cfg, engine.spec_text, [t for r in runs for t in r.trajectories()], eff, traced_asked=trace,
                  runs=runs)
    if compare and runs and len(runs) == seeds and all(r.reference is not None for r in runs) and not interrupted():
        phase("judging the first step: each entry point's recorded calls")
        with kept_at_once():  # a second signal: no first-step check, the trajectories kept
            out.first_step = engine.first_step(cfg.seed, rule)
        _set_verdict(out, runs, cfg, rule, engine.params)
        if _drift_to_trace(out) and trace and not interrupted():
            budget = Budget.of(trace_budget, time.monotonic() - started)
            out.attributions, alts = attribute(runs, cfg, eff, engine.candidates(), rule, engine.params, interrupted,
                                               rerun=engine.alternative, phase=phase, budget=budget)
            out.trajectories.extend(alts)
            out.trace_stopped = budget.said
    out.interrupted = interrupted() or len(runs) < seeds
    return out


def _nonfinite_ensemble(runs: list[SeedRun]) -> str | None:
    """Where the implementation went non-finite and the float64 run of its seed did not: in how
    many seeds, and the first one's step, layer and mHC output."""
    said = [(r.seed, s) for r in runs if (s := nonfinite_sentence(r.impl, r.reference))]
    if not said:
        return None
    seed, first = said[0]
    return f"{first} (seed {seed}; non-finite in {len(said)} of {len(runs)} seeds)"


def _first_step(cfg: TrainConfig, spec: dict, knobs: dict, conventions: dict, pieces: dict[str, Piece], eff: dict,
                rule: VerdictRule, as_used: bool, interrupted, worker=None, own: bool = False,
                timeout: float | None = None) -> first_step_mod.Check:
    """The first step judged per tensor; the implementation's side in ``worker`` where given (a
    crash there is the check's failure; ``own``: the worker was started for it, and is stopped)."""
    native = {f: native_piece(f, eff[f], pieces[f].precision) for f in pieces}
    ref = {f: reference_piece(f, eff[f]) for f in pieces}
    wide = {f: family_call(f, get_family(f).reference, eff[f]) for f in pieces}
    isolated = None
    if worker is not None:
        def isolated(calls: list) -> tuple | str:
            try:
                value, failure = worker.call("mhctool.analyses.train.first_step:job",
                                             (to_dict(cfg), spec, knobs, conventions, [asdict(c) for c in calls],
                                              as_used), timeout=timeout, interrupted=interrupted)
            finally:
                if own:
                    worker.stop()
            return failure.message if failure is not None else (value["each"], value["grads"], value["returned"])
    return first_step_mod.check(cfg, pieces, native, ref, wide, rule, eff, isolated)


def _isolated(cfg: TrainConfig, spec: dict, knobs: dict, conventions: dict, pieces: dict[str, Piece], worker,
              interrupted, as_used: bool = False, step_timeout: float | None = None) -> Trajectory:
    with tempfile.TemporaryDirectory(prefix="mhctool-train-") as d:
        log = str(Path(d) / "steps.jsonl")
        value, failure = None, Failure("lost", "abandoned: the run was interrupted")
        with kept_at_once():  # a second signal: the worker killed, the steps it logged kept
            value, failure = worker.call("mhctool.analyses.train.trajectory:trajectory_job",
                                         (to_dict(cfg), spec, knobs, conventions, log, as_used),
                                         timeout=None, interrupted=interrupted, stalled=StepWatch(log, step_timeout))
        if failure is None:
            return Trajectory.from_dict(value)
        traj = _from_log(cfg, pieces, log, failure.message, hung=failure.kind == "timeout")
        if failure.kind == "lost" and interrupted():  # the signal ended it, not the implementation
            traj.error = "interrupted"
        return traj


def _from_log(cfg: TrainConfig, pieces: dict[str, Piece], log: str, why: str, hung: bool) -> Trajectory:
    """The implementation's trajectory from the steps its worker logged before it failed: ``why``,
    named by the step and phase it was in; ``hung``: its step limit ended it."""
    traj = Trajectory("impl", {f: p.name for f, p in pieces.items()},
                      {f: p.note for f, p in pieces.items() if p.note})
    traj.steps = read_log(log)
    traj.error = f"{read_phase(log) or f'step {len(traj.steps) + 1}'}: {why}"
    traj.seed, traj.hung = cfg.seed, hung
    return traj


def report_rows(out: Outcome) -> list[dict]:
    """Every trajectory's rows, then the verdict's (report.TRAIN_SCHEMA)."""
    rs = rows(out.trajectories) + (out.first_step.rows() if out.first_step is not None else [])
    seed = None if out.ensemble else out.cfg.seed
    rs += verdict_rows("impl", out.drifts, seed)

    def verdict(step, metric, passed, message, seed=seed) -> dict:
        return {"run": "impl", "step": step, "layer": None, "metric": metric, "value": math.nan, "threshold": None,
                "passed": passed, "message": message, "seed": seed}
    if out.nonfinite:
        first = next((r.impl for r in out.runs if r.impl.nonfinite_step is not None
                      and nonfinite_sentence(r.impl, r.reference)), out.impl)
        rs.append(verdict(first.nonfinite_step.step, "nonfinite", False, out.nonfinite, first.seed))
    for t in out.errors:
        rs.append(verdict(len(t.steps) + 1, "error", False, t.error, t.seed))
    for a in out.attributions:
        rs.append(verdict(None, f"traced:{a.family}.{a.knob}", a.reproduces, a.message))
    if out.zeros is not None:
        rs.append(verdict(None, "zeros-finding", None if out.zeros.anomaly is None else False,
                          "; ".join([out.zeros.sentence, *out.zeros.parameters])))
    return rs


def settings(out: Outcome, **extra) -> dict:
    ensemble = {}
    if out.ensemble and out.drifts:
        ensemble = {"test": "per metric, the geometric mean over the seeds of the single-seed distance / allowed "
                            "(allowed: kappa x native's median distance from the float64 run, plus the floor); "
                            "drifts above 1 where the single-seed rule fails in more than half the seeds (in every seed for "
                            "num-zeros)",
                    "distances": {d.metric: [{"seed": s, "impl": p.median, "native": p.native, "allowed": p.threshold}
                                             for s, p in zip(d.seeds, d.per_seed)] for d in out.drifts}}
    return {"command": "train", "impl": out.spec, "config": to_dict(out.cfg), "knobs": out.eff,
            "pieces": out.impl.pieces, "notes": out.impl.notes, "traced": out.traced(),
            "interrupted": out.interrupted, "seeds": out.seeds, **ensemble, **extra}
