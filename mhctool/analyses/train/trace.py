"""Tracing a drift to a knob: the native implementation rerun with each convention in which the
kernel differs from the contract (declared, or fitted by ``mhctool identify``)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable

from mhctool.analyses.identify import IDENTIFIABLE, Identifier, fmt_value
from mhctool.analyses.train.ensemble import SeedRun, judge_ensemble
from mhctool.analyses.train.pieces import Piece, pick_impl, native_piece
from mhctool.analyses.train.setup import TrainConfig
from mhctool.analyses.train.trajectory import Trajectory, run
from mhctool.analyses.train.verdict import judge
from mhctool.core.errors import kept_at_once
from mhctool.core.verdict import VerdictRule


@dataclass
class Attribution:
    family: str
    knob: str
    value: object
    reproduces: bool
    message: str


def candidate_knobs(specs: dict[str, str], eff: dict[str, dict], pieces: dict[str, Piece], device: str) -> list[tuple]:
    """(family, knob, value, why) for every convention in which the implementation differs from
    the contract where the run does not already compute it: fitted by ``mhctool identify`` on each
    family the implementation has (fp32, its default probes), and its matmul precision."""
    out = []
    for family, piece in pieces.items():
        if not piece.fallback:
            out += fitted(family, specs[family], eff[family], device)
    return out


def fitted(family: str, spec: str, asked: dict, device: str) -> list[tuple]:
    """(family, knob, value, why) for each convention (and matmul precision) ``mhctool identify``
    fits to ``spec``'s implementation of ``family`` beside what ``asked`` says; none where identify
    cannot run it or nothing passes."""
    if family not in IDENTIFIABLE:
        return []
    impl, _ = pick_impl(family, spec, device, "fp32")
    if impl is None:
        return []
    try:
        ident = Identifier(family, impl, dtype="fp32", device=device, asked=dict(asked)).run()
    except Exception:  # noqa: BLE001 - no candidate from a family identify cannot run
        return []
    if ident.best is None or not (ident.best.passed or ident.best.fwd_passed):
        return []
    out = [(family, k, v, f"identify fits {k}={fmt_value(v)}") for k, v in ident.conventions().items()]
    if ident.judged_precision() != ident.declared_precision:
        out.append((family, "matmul_precision", ident.judged_precision(),
                    f"identify fits matmul_precision={ident.judged_precision()}"))
    return out


def _with_knob(eff: dict[str, dict], precision: dict[str, str], family: str, knob: str, value) -> dict[str, Piece]:
    """The native pieces with one candidate convention (or matmul precision) for ``family``."""
    def piece(f: str) -> Piece:
        if f != family:
            return native_piece(f, eff[f], precision.get(f, "ieee"))
        if knob == "matmul_precision":
            return native_piece(f, eff[f], value)
        return native_piece(f, {**eff[f], knob: value}, precision.get(f, "ieee"))
    return {f: piece(f) for f in eff}


# the tracing's default budget, as a multiple of what the trajectories (and the first step) took: a
# train run that traces takes at most about (1 + TRACE_BUDGET) times its runs, plus one rerun
TRACE_BUDGET = 1.0


@dataclass
class Budget:
    """Seconds the tracing may take: no rerun starts once they are spent. ``said``: where it
    stopped the tracing before every candidate was tried (None while it has not)."""

    seconds: float | None  # None: no limit
    start: float = field(default_factory=time.monotonic)
    said: str | None = None

    @classmethod
    def of(cls, asked: float | None, runs_took: float) -> "Budget":
        """The asked seconds (0: no limit), or :data:`TRACE_BUDGET` times what the runs took."""
        if asked == 0:
            return cls(None)
        return cls(asked if asked is not None else max(1.0, TRACE_BUDGET * runs_took))

    def spent(self, tried: int, candidates: int) -> bool:
        if self.seconds is None or time.monotonic() - self.start < self.seconds:
            return False
        self.said = (f"the tracing stopped at its budget of {self.seconds:.0f} s after {tried} of {candidates} "
                     "candidate conventions (--trace-budget)")
        return True


def attribute(runs: list[SeedRun], cfg: TrainConfig, eff: dict[str, dict], candidates: list[tuple],
              rule: VerdictRule, params: int, interrupted: Callable[[], bool] = lambda: False,
              precision: dict[str, str] | None = None,
              rerun: Callable[[int, str, str, object, str], Trajectory] | None = None,
              phase: Callable[[str], None] = lambda line: None,
              budget: Budget | None = None) -> tuple[list[Attribution], list[Trajectory]]:
    """Rerun the native implementation with each candidate knob from every seed of ``runs``; it
    reproduces the drift where the implementation's runs stay with those runs as they would with
    the reference, and those runs drift from the reference (a knob that moves nothing explains
    nothing). One seed is judged by the single-seed rule, several over the ensemble. ``rerun(seed,
    family, knob, value, role)``: another trainer's native run with the knob (an engine's), in
    place of mhctool's model's. ``phase(line)``: each rerun as it starts (which knob, which seed).
    ``budget``: no rerun starts once it is spent (it says so); a candidate not rerun from every
    seed is no evidence and is left out."""
    found, made = [], []
    prec = precision or {}
    several = len(runs) > 1
    for k, (family, knob, value, why) in enumerate(candidates, 1):
        if interrupted():
            break
        pieces = _with_knob(eff, prec, family, knob, value) if rerun is None else None
        role = f"native:{family}.{knob}={value}"
        alts = []
        with kept_at_once():  # a second signal: the knobs traced so far are kept
            for j, r in enumerate(runs, 1):
                if interrupted() or (budget is not None and budget.spent(k - 1, len(candidates))):
                    break
                phase(f"tracing the drift: knob {k} of {len(candidates)} ({family}.{knob}={value}), "
                      f"seed {j} of {len(runs)}")
                alt = rerun(r.seed, family, knob, value, role) if rerun is not None else \
                    run(replace(cfg, seed=r.seed), pieces, role, interrupted)
                if alt.error == "interrupted":  # cut short: no evidence either way
                    break
                alts.append(alt)
        made.extend(alts)
        if len(alts) < len(runs):
            break
        same = _stays(cfg, rule, params, [SeedRun(r.seed, r.impl, r.native, replace(a, role="as-reference"))
                                          for r, a in zip(runs, alts)])
        moves = not _stays(cfg, rule, params, [SeedRun(r.seed, a, r.native, r.reference) for r, a in zip(runs, alts)])
        ok = same and moves
        if several:
            said = "drift the same way" if ok else "do not drift the same way" if moves else "do not drift from the reference"
            message = f"the native runs with {family}.{knob}={value} ({why}) {said} over {len(runs)} seeds"
        else:
            said = "drifts the same way" if ok else "does not drift the same way" if moves else "does not drift from the reference"
            message = f"the native run with {family}.{knob}={value} ({why}) {said}"
        found.append(Attribution(family, knob, value, ok, message))
    return found, made


def _stays(cfg: TrainConfig, rule: VerdictRule, params: int, runs: list[SeedRun]) -> bool:
    """Every judged metric of the runs' implementation stays with their reference: one seed by the
    single-seed rule, several over the ensemble."""
    if len(runs) == 1:
        r = runs[0]
        return all(d.passed for d in judge(r.impl, r.native, r.reference, replace(cfg, seed=r.seed), rule, params))
    return all(d.passed for d in judge_ensemble(runs, cfg, rule, params))
