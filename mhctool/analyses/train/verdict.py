"""The drift of one trajectory from the float64 one, judged against the native trajectory's, per
metric; a zero-count anomaly the reference has not; where a run went non-finite."""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import torch

from mhctool.analyses.goldens import check
from mhctool.analyses.train.setup import JUDGED, TrainConfig
from mhctool.analyses.train.trajectory import (
    Trajectory,
    nonfinite,
    to_golden,
    where_nonfinite,
)
from mhctool.core.dtypes import FORMATS
from mhctool.core.metrics import ulp_size
from mhctool.core.verdict import VerdictRule


@dataclass
class Drift:
    """One metric of one trajectory against the reference trajectory."""

    metric: str
    passed: bool
    median: float  # the median distance from the reference over the steps (what is judged)
    threshold: float  # kappa times the native trajectory's median distance, plus the floor
    largest: float  # the largest distance
    parted_at: int | None  # where it first left native's envelope (kappa x native's largest so far)
    parted_by: float | None  # the distance there
    allowed: float | None  # the envelope there
    message: str
    native: float | None = None  # native's median distance from the reference


def _distances(a: Trajectory, b: Trajectory, metric: str) -> dict[int, float]:
    """Per common step, ``|a - b|``: inf where one is finite and the other is not."""
    sa, sb = a.series(metric), b.series(metric)
    out = {}
    for k in sorted(set(sa) & set(sb)):
        x, y = sa[k], sb[k]
        if math.isfinite(x) and math.isfinite(y):
            out[k] = abs(x - y)
        else:
            out[k] = 0.0 if not (math.isfinite(x) or math.isfinite(y)) else math.inf
    return out


def _floor(metric: str, value: float, cfg: TrainConfig, rule: VerdictRule, params: int) -> float:
    """What two correct runs may differ by where native's distance is 0. The metrics are fp32
    numbers (the loss from fp32 logits, the grad norm over fp32 gradients), so two runs whose pieces
    round differently land on the same fp32 number or at least one spacing (ulp) of it apart: the
    floor is ``rule.floor_roundoffs`` spacings of the value, and no less than as many unit
    roundoffs of the activations' dtype (bf16's are coarser). For a zero count, that share of the
    gradients' elements at their dtype (fp32: the parameters' and the gradients')."""
    if metric == "num-zeros":
        return math.ceil(rule.floor_roundoffs * FORMATS["fp32"].unit_roundoff * params)
    if not math.isfinite(value):
        return 0.0
    ulp = float(ulp_size(torch.tensor([value], dtype=torch.float64), FORMATS["fp32"])) if value else 0.0
    return rule.floor_roundoffs * max(FORMATS[cfg.dtype].unit_roundoff * abs(value), ulp)


def judge(traj: Trajectory, native: Trajectory, reference: Trajectory, cfg: TrainConfig,
          rule: VerdictRule | None = None, params: int = 0) -> list[Drift]:
    """The drift of ``traj`` from the reference trajectory, per metric: its median distance over
    the steps may be at most ``kappa`` times the native trajectory's, plus the floor. Training is
    chaotic (two correct runs part a little more every step, and the largest distance of one run is
    a noisy maximum), so the median is judged; where the verdict fails, the first step where the
    run left native's envelope (kappa times native's largest distance so far, plus the floor) says
    where it parted and by how much. A trajectory that ended before the reference's last step
    fails; so does a zero-count series with two levels or jumps the reference's has not."""
    rule = rule or VerdictRule()
    out = []
    ref_steps = len(reference.steps)
    for metric in JUDGED:
        d_own, d_nat = _distances(traj, reference, metric), _distances(native, reference, metric)
        refs = reference.series(metric)
        steps = sorted(d_own)
        scale = statistics.median([abs(v) for v in refs.values() if math.isfinite(v)] or [0.0])
        floor = _floor(metric, scale, cfg, rule, params)
        nat = [d_nat[k] for k in steps if k in d_nat and math.isfinite(d_nat[k])]  # non-finite bounds nothing
        med_own = statistics.median(d_own.values()) if d_own else 0.0
        med_nat = statistics.median(nat) if nat else 0.0
        threshold = rule.kappa * med_nat + floor
        worst_nat, parted, at, allowed_at = 0.0, None, None, None
        for k in steps:
            if math.isfinite(d_nat.get(k, 0.0)):
                worst_nat = max(worst_nat, d_nat.get(k, 0.0))
            allowed = rule.kappa * worst_nat + _floor(metric, refs.get(k, math.nan), cfg, rule, params)
            if parted is None and not d_own[k] <= allowed:
                parted, at, allowed_at = k, d_own[k], allowed
        short = len(traj.steps) < ref_steps and traj.error != "interrupted"
        anomaly = _zero_anomaly(traj, reference) if metric == "num-zeros" else None
        passed = med_own <= threshold and not short and anomaly is None
        largest = max(d_own.values(), default=0.0)
        judged = (f"median distance {med_own:.3g} over {len(steps)} steps against {threshold:.3g} allowed "
                  f"(kappa x native's {med_nat:.3g}, plus the floor)")
        if short:
            msg = f"ended at step {len(traj.steps)} of {ref_steps}: {traj.error}"
        elif anomaly:
            msg = f"{anomaly}, which the reference's has not; {judged}"
        elif passed:
            msg = f"stays with the reference: {judged}; largest {largest:.3g}, native's {worst_nat:.3g}"
        else:
            where = (f"; parts from the reference at step {parted}: off by {at:.3g} against {allowed_at:.3g} allowed "
                     f"there (native: {d_nat.get(parted, math.nan):.3g})") if parted is not None else ""
            msg = f"{judged}{where}"
        out.append(Drift(metric, passed, med_own, threshold, largest, parted if not passed else None,
                         at if not passed else None, allowed_at if not passed else None, msg, med_nat))
    return out


def _zero_anomaly(traj: Trajectory, reference: Trajectory) -> str | None:
    """A num-zeros series with two levels or jumps (``goldens check``) where the reference's has none
    of that kind: the kernel's own zero-count anomaly, whatever its median."""
    if len(traj.steps) < 4:
        return None
    ref_kinds = {a.kind for a in check(to_golden(reference)) if a.metric == "num-zeros"}
    own = [a for a in check(to_golden(traj)) if a.metric == "num-zeros" and a.kind in ("bimodal", "jump")
           and a.kind not in ref_kinds]
    return own[0].message if own else None


def nonfinite_sentence(traj: Trajectory, reference: Trajectory) -> str | None:
    """Where a trajectory went non-finite while the reference did not: the step, the first layer
    and mHC output, and how many of its elements."""
    s = traj.nonfinite_step
    if s is None:
        return None
    ref_step = next((r for r in reference.steps if r.step == s.step), None)
    if ref_step is not None and nonfinite(ref_step):
        return None  # the reference went non-finite there too: not the implementation's
    return f"goes non-finite at step {s.step}: " + where_nonfinite(s)
