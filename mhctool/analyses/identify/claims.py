"""What ``mhctool identify`` says, as claims: each sentence with the check that earned it (which
candidate, probes and numbers, the threshold) and whether that check held. Only the claims
whose check held are printed; the report keeps every one with its evidence, so a reader can see
why a sentence was said, or was not.

The checks (issue 100's five faces, each a sentence its own numbers contradicted):

- a fit ("fits", "its finite outputs fit") needs the candidate within :data:`FIT_WITHIN` native
  noise units on every probe it covers;
- a precision ("multiplies at TF32") needs a convention that fits at that precision, and the
  implementation's outputs nearest to that precision's products among all of them (a precision
  asked for and only passed, because its thresholds are looser, is not claimed: the nearest one is);
- "a variant" is never said of the contract's own value (the classification says "computes the
  contract's ..." there);
- an ask that was dropped (an optional input the implementation takes no parameter for) is said;
- a continuous value the probes do not pin is said with the range that fits as well (``told``).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from mhctool.analyses.identify.space import PRECISION_NOTES, fmt_knobs, fmt_value, same_value

# a fit is a candidate within this many native noise units on every probe (Space.near_miss)
FIT_WITHIN = 8.0


@dataclass
class Claim:
    """One sentence and the check behind it. ``kind``: identification, note, precision, ties, ask,
    input, dtype, judge, defect. ``check``: the check in words, with its numbers; ``held``:
    whether it held (only those are printed)."""

    kind: str
    text: str
    check: str
    held: bool
    evidence: dict = field(default_factory=dict)

    def row(self, impl: str) -> dict:
        return {"impl": impl, **asdict(self)}


def fits(cand) -> tuple[bool, str]:
    """Whether ``cand`` fits every probe it covers within :data:`FIT_WITHIN` native noise, and the check's words."""
    scores = list(cand.fit_at or cand.per_probe) or [cand.score]
    worst = max(scores)
    unit = "native noise at the precision it is judged at" if cand.fit_at else "native noise"
    return worst <= FIT_WITHIN, (f"{fmt_knobs(cand.knobs) or 'the contract'}: worst probe {worst:.3g}x {unit} "
                                 f"(a fit: every probe within {FIT_WITHIN:g}x)")


def identification(ident) -> Claim:
    """The identification's line: what fits, or that nothing does (and what its finite outputs fit,
    only where they fit within noise)."""
    b = ident.best
    if ident.error or b is None:
        return Claim("identification", ident.line(), "the implementation failed on a probe", True)
    ok, words = fits(b)
    if ident.overflow:
        if ok:
            return Claim("identification", ident.line(), "its finite outputs: " + words, True, {"score": b.score})
        # its finite outputs fit nothing either: that, not the nearest, is said
        text = (f"no convention fits: {ident.overflow_sentence()}; its finite outputs fit no convention either "
                f"(the nearest, {fmt_knobs(b.knobs)}, is {b.score:.3g}x native noise off); a defect: an overflow "
                "is never a convention")
        return Claim("identification", text, "its finite outputs: " + words, True, {"score": b.score})
    verdict = ("judged: passes the verdict rule" if b.passed else "judged: the forward passes the verdict rule"
               if b.fwd_passed else "judged: no candidate passes the verdict rule")
    return Claim("identification", ident.line(), f"{words}; {verdict}", True, {"score": b.score})


def precision(ident) -> Claim | None:
    """The matmul precision it multiplies at, where that is not what it declares: only under a
    convention that fits, and where its outputs are nearest that precision's products
    (``ident.nearest_precision``, where it was measured)."""
    nearest = ident.nearest_precision
    note = ident.precision_note() if ident.best is not None else None
    if note is None:
        return None
    b = ident.best
    if not (b.passed or b.fwd_passed):
        return Claim("precision", note, "no convention fits, so no precision is identified", False)
    if ident.split_precision or nearest is None or nearest == ident.precision or ident.asked_precision:
        return Claim("precision", note, f"fitted: {fmt_knobs(b.knobs) or 'the contract'} passes at "
                                        f"{ident.judged_precision()}" + (f", nearest {nearest}" if nearest else ""),
                     True, {"nearest": nearest})
    return Claim("precision", note, f"asked at {ident.precision}, but its outputs are nearest {nearest}'s products",
                 False, {"nearest": nearest, "asked": ident.precision})


def nearest_precision(ident) -> Claim | None:
    """Where a precision was asked and its outputs are nearer another's products, and pass there:
    what it multiplies at (it was identified at that one)."""
    if ident.asked_precision is None:
        return None
    text = (f"asked at matmul_precision={ident.asked_precision}, it {PRECISION_NOTES[ident.precision]}: its outputs "
            f"are nearest those products and pass there; at {ident.asked_precision} they passed only because "
            "its thresholds are looser")
    return Claim("precision", text, f"the native products at each precision ranked by their distance from its "
                                    f"outputs: {ident.nearest_precision} first; judged there: passes", True,
                 {"nearest": ident.nearest_precision, "asked": ident.asked_precision})


def told(ident) -> Claim | None:
    """Where the probes tell a continuous knob of the best fit only within a range: the range, so
    that the one value printed is not taken for a finding (another seed's probes may land elsewhere
    in it)."""
    if not ident.told:
        return None
    parts = [f"{k}: any value from {fmt_value(a)} to {fmt_value(b)} fits as well" for k, (a, b) in ident.told.items()]
    return Claim("range", "the probes do not pin " + "; ".join(parts) + " (within native noise)",
                 "every value scored in that run, the other knobs held, within native noise of the best of them",
                 True, {k: [a, b] for k, (a, b) in ident.told.items()})


def dropped_asks(ident, user: dict) -> list[Claim]:
    """Each knob the user asked for that the identification could not hold: said, with why."""
    out = []
    held = ident.asked_all
    for k, v in user.items():
        if k in held and not same_value(v, held[k]):
            why = (f"it takes no {k} input, so it was identified without one" if ident.fixed.get(k) is False
                   else f"identified at {k}={fmt_value(held[k])}")
            out.append(Claim("ask", f"asked {k}={fmt_value(v)}: dropped; {why}",
                             f"asked {fmt_value(v)}, held {fmt_value(held[k])}", True))
    return out


def printed(claims: list[Claim]) -> list[str]:
    return [c.text for c in claims if c.held]
