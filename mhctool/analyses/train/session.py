"""A whole ``mhctool train`` run: the implementation's trajectory (isolated or not), the native
and float64 ones, the verdict, the tracing; its report rows and settings."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from mhctool.analyses.train.pieces import (
    Piece,
    impl_pieces,
    native_piece,
    reference_piece,
)
from mhctool.analyses.train.setup import FAMILIES, TrainConfig, to_dict
from mhctool.analyses.train.trace import Attribution, attribute, candidate_knobs
from mhctool.analyses.train.trajectory import (
    Step,
    Trajectory,
    param_count,
    read_log,
    run,
)
from mhctool.analyses.train.verdict import Drift, judge, nonfinite_sentence
from mhctool.core.errors import UsageError
from mhctool.core.verdict import VerdictRule
from mhctool.registry import families as registry


def rows(trajs: list[Trajectory]) -> list[dict]:
    """Report rows (report.TRAIN_SCHEMA): per trajectory, step and metric; health per layer."""
    out = []
    for t in trajs:
        for s in t.steps:
            for metric, v in s.metrics.items():
                out.append({"run": t.role, "step": s.step, "layer": None, "metric": metric, "value": float(v),
                            "threshold": None, "passed": None, "message": None})
            for name, count in s.zeros.items():
                if count:
                    out.append({"run": t.role, "step": s.step, "layer": None, "metric": f"zeros:{name}",
                                "value": float(count), "threshold": None, "passed": None, "message": None})
            for layer, h in enumerate(s.health):
                for name, v in h.items():
                    out.append({"run": t.role, "step": s.step, "layer": layer, "metric": name, "value": float(v),
                                "threshold": None, "passed": None, "message": None})
            if s.first_nonfinite:
                layer, fam, name = s.first_nonfinite
                out.append({"run": t.role, "step": s.step, "layer": layer, "metric": "first non-finite",
                            "value": math.nan, "threshold": None, "passed": None, "message": f"{fam}.{name}"})
    return out


def verdict_rows(role: str, drifts: list[Drift]) -> list[dict]:
    return [{"run": role, "step": d.parted_at, "layer": None, "metric": f"drift:{d.metric}", "value": d.median,
             "threshold": d.threshold, "passed": d.passed, "message": d.message} for d in drifts]


@dataclass
class Outcome:
    cfg: TrainConfig
    spec: str
    trajectories: list[Trajectory]  # the implementation's first, then native and reference
    eff: dict[str, dict]  # per family, the knobs every trajectory computed
    drifts: list[Drift] = field(default_factory=list)
    nonfinite: str | None = None  # where the implementation went non-finite and the reference did not
    attributions: list[Attribution] = field(default_factory=list)
    interrupted: bool = False
    traced_asked: bool = True  # the drift was to be traced (--trace)

    @property
    def impl(self) -> Trajectory:
        return self.trajectories[0]

    def role(self, name: str) -> Trajectory | None:
        return next((t for t in self.trajectories if t.role == name), None)

    @property
    def compared(self) -> bool:
        return self.role("reference") is not None

    @property
    def passed(self) -> bool:
        return (self.impl.error is None and self.nonfinite is None and all(d.passed for d in self.drifts)
                and not self.interrupted)

    def traced(self) -> str | None:
        """The sentence that names the knob a drift comes from, or says it is the kernel's own."""
        if not self.traced_asked or not self.drifts or all(d.passed for d in self.drifts) or self.nonfinite \
                or self.impl.error:
            return None
        hits = [a for a in self.attributions if a.reproduces]
        if hits:
            a = hits[0]
            return f"{a.message}: the drift is {a.family}.{a.knob}"
        tried = ", ".join(f"{a.family}.{a.knob}={a.value}" for a in self.attributions)
        return ("no convention in which it differs reproduces it" + (f" (tried: {tried})" if tried else
                " (identify fits it no other convention)") + ": the drift is the kernel's own error")


def parse_knobs(items: list[tuple[str, str]], flag: str, conventions_only: bool = False) -> dict[str, dict]:
    """``FAMILY.KNOB=VALUE`` or ``KNOB=VALUE`` (every family of the model that has it) -> per family,
    each value checked; a knob no family of the model has (or no convention, for --convention) is
    a UsageError."""
    from mhctool.analyses.knob_shift import typed_value
    out: dict[str, dict] = {}
    for name, raw in items:
        family, _, knob = name.rpartition(".")
        takers = [family] if family else [f for f in FAMILIES if knob in registry.get_family(f).knobs]
        for f in takers:
            if f not in FAMILIES:
                raise UsageError(f"{flag} {name}: the model's mHC families are {', '.join(FAMILIES)}")
            fam = registry.get_family(f)
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
            progress: Callable[[str, Step], None] | None = None, as_used: bool = False) -> Outcome:
    """The implementation's trajectory, then (``compare``) the native and float64 ones, the
    verdict, and (``trace``) the attribution of a drift. ``isolation``: an isolation Worker the
    implementation's trajectory runs in (a crash or a hang ends it with its steps kept)."""
    rule = rule or VerdictRule()
    knobs, conventions = knobs or {}, conventions or {}
    specs = spec if isinstance(spec, dict) else {f: spec for f in FAMILIES}
    pieces, eff = impl_pieces(specs, knobs, conventions, cfg.device, cfg.dtype, as_used)
    say = (lambda role: (lambda step: progress(role, step))) if progress else (lambda role: None)
    if isolation is not None:
        impl = _isolated(cfg, specs, knobs, conventions, pieces, isolation, interrupted, as_used)
    else:
        impl = run(cfg, pieces, "impl", interrupted, say("impl"))
    out = Outcome(cfg, " ".join(dict.fromkeys(specs.values())), [impl], eff, traced_asked=trace)
    if compare and not interrupted():
        out.trajectories.append(run(cfg, {f: native_piece(f, eff[f], pieces[f].precision) for f in FAMILIES},
                                    "native", interrupted, say("native")))
        out.trajectories.append(run(cfg, {f: reference_piece(f, eff[f]) for f in FAMILIES}, "reference",
                                    interrupted, say("reference")))
        native, reference = out.trajectories[1], out.trajectories[2]
        params = param_count(cfg)
        out.drifts = judge(impl, native, reference, cfg, rule, params)
        out.nonfinite = nonfinite_sentence(impl, reference)
        if trace and not out.nonfinite and impl.error is None and not all(d.passed for d in out.drifts) \
                and not interrupted():
            cands = candidate_knobs(specs, eff, pieces, cfg.device)
            precision = {f: p.precision for f, p in pieces.items()}
            out.attributions, alts = attribute(impl, native, reference, cfg, eff, cands, rule, params, interrupted,
                                               precision)
            out.trajectories.extend(alts)
    out.interrupted = interrupted() or any(t.error == "interrupted" for t in out.trajectories)
    return out


def _isolated(cfg: TrainConfig, spec: dict, knobs: dict, conventions: dict, pieces: dict[str, Piece], worker,
              interrupted, as_used: bool = False) -> Trajectory:
    import tempfile
    with tempfile.TemporaryDirectory(prefix="mhctool-train-") as d:
        log = str(Path(d) / "steps.jsonl")
        value, failure = worker.call("mhctool.analyses.train.trajectory:trajectory_job", (to_dict(cfg), spec, knobs, conventions, log,
                                                                       as_used),
                                     timeout=None, interrupted=interrupted)
        if failure is None:
            return Trajectory.from_dict(value)
        traj = Trajectory("impl", {f: p.name for f, p in pieces.items()},
                          {f: p.note for f, p in pieces.items() if p.note})
        traj.steps = read_log(log)
        traj.error = f"step {len(traj.steps) + 1}: {failure.message}"
        return traj


def report_rows(out: Outcome) -> list[dict]:
    """Every trajectory's rows, then the verdict's (report.TRAIN_SCHEMA)."""
    rs = rows(out.trajectories)
    rs += verdict_rows("impl", out.drifts)
    if out.nonfinite:
        rs.append({"run": "impl", "step": out.impl.nonfinite_step.step, "layer": None, "metric": "nonfinite",
                   "value": math.nan, "threshold": None, "passed": False, "message": out.nonfinite})
    if out.impl.error and out.impl.error != "interrupted":
        rs.append({"run": "impl", "step": len(out.impl.steps) + 1, "layer": None, "metric": "error",
                   "value": math.nan, "threshold": None, "passed": False, "message": out.impl.error})
    for a in out.attributions:
        rs.append({"run": "impl", "step": None, "layer": None, "metric": f"traced:{a.family}.{a.knob}",
                   "value": math.nan, "threshold": None, "passed": a.reproduces, "message": a.message})
    return rs


def settings(out: Outcome, **extra) -> dict:
    return {"command": "train", "impl": out.spec, "config": to_dict(out.cfg), "knobs": out.eff,
            "pieces": out.impl.pieces, "notes": out.impl.notes, "traced": out.traced(),
            "interrupted": out.interrupted, **extra}
