"""Tracing a drift to a knob: the native implementation rerun with each convention in which the
kernel differs from the contract (declared, or fitted by ``mhctool identify``)."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from mhctool.analyses.train.pieces import Piece, _pick, native_piece
from mhctool.analyses.train.setup import FAMILIES, TrainConfig
from mhctool.analyses.train.trajectory import Trajectory, run
from mhctool.analyses.train.verdict import judge
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
    from mhctool.analyses.identify import IDENTIFIABLE, Identifier, fmt_value
    out = []
    for family, piece in pieces.items():
        if piece.fallback or family not in IDENTIFIABLE:
            continue
        impl, _ = _pick(family, specs[family], device, "fp32")
        if impl is None:
            continue
        try:
            ident = Identifier(family, impl, dtype="fp32", device=device, asked=dict(eff[family])).run()
        except Exception:  # noqa: BLE001 - no candidate from a family identify cannot run
            continue
        if ident.best is None or not (ident.best.passed or ident.best.fwd_passed):
            continue
        for k, v in ident.conventions().items():
            out.append((family, k, v, f"identify fits {k}={fmt_value(v)}"))
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
    return {f: piece(f) for f in FAMILIES}


def attribute(traj: Trajectory, native: Trajectory, reference: Trajectory, cfg: TrainConfig,
              eff: dict[str, dict], candidates: list[tuple], rule: VerdictRule, params: int,
              interrupted: Callable[[], bool] = lambda: False,
              precision: dict[str, str] | None = None) -> tuple[list[Attribution], list[Trajectory]]:
    """Rerun the native implementation with each candidate knob; it reproduces the drift where
    the implementation's trajectory stays with that run as it would with the reference (every
    judged metric within kappa times the native noise)."""
    found, runs = [], []
    prec = precision or {}
    for family, knob, value, why in candidates:
        if interrupted():
            break
        pieces = _with_knob(eff, prec, family, knob, value)
        role = f"native:{family}.{knob}={value}"
        alt = run(cfg, pieces, role, interrupted)
        runs.append(alt)
        same = all(d.passed for d in judge(traj, native, replace(alt, role="as-reference"), cfg, rule, params))
        # the knob must also be what moves native: a knob that changes nothing explains nothing
        moves = not all(d.passed for d in judge(alt, native, reference, cfg, rule, params))
        ok = same and moves
        found.append(Attribution(family, knob, value, ok,
                                 f"the native run with {family}.{knob}={value} ({why}) "
                                 + ("drifts the same way" if ok else "does not drift the same way"
                                    if moves else "does not drift from the reference")))
    return found, runs


def attribute_ensemble(runs: list, cfg: TrainConfig, eff: dict[str, dict], candidates: list[tuple], rule: VerdictRule,
                       params: int, interrupted: Callable[[], bool] = lambda: False,
                       precision: dict[str, str] | None = None) -> tuple[list[Attribution], list[Trajectory]]:
    """:func:`attribute` over a seed ensemble: the native implementation with each candidate knob
    from every seed; it reproduces the drift where the implementation's runs stay with those runs
    over the ensemble (as they would with the reference) and those runs drift from the reference
    over the ensemble."""
    from mhctool.analyses.train.ensemble import SeedRun, judge_ensemble
    found, made = [], []
    prec = precision or {}
    for family, knob, value, why in candidates:
        if interrupted():
            break
        pieces = _with_knob(eff, prec, family, knob, value)
        role = f"native:{family}.{knob}={value}"
        alts = []
        for r in runs:
            if interrupted():
                break
            alts.append(run(replace(cfg, seed=r.seed), pieces, role, interrupted))
        made.extend(alts)
        if len(alts) < len(runs):
            break
        as_ref = [SeedRun(r.seed, r.impl, r.native, replace(a, role="as-reference")) for r, a in zip(runs, alts)]
        same = all(d.passed for d in judge_ensemble(as_ref, cfg, rule, params))
        moved = [SeedRun(r.seed, a, r.native, r.reference) for r, a in zip(runs, alts)]
        moves = not all(d.passed for d in judge_ensemble(moved, cfg, rule, params))
        ok = same and moves
        found.append(Attribution(family, knob, value, ok,
                                 f"the native runs with {family}.{knob}={value} ({why}) "
                                 + ("drift the same way" if ok else "do not drift the same way"
                                    if moves else "do not drift from the reference")
                                 + f" over {len(runs)} seeds"))
    return found, made
