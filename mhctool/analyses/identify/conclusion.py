"""What ``mhctool identify`` concludes and how it says so: a probe's run, a candidate's fit and
verdict, the identification (the line a user reads, the conventions to declare), and its report
rows."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from mhctool.analyses.identify.derivative import OwnDerivative
from mhctool.analyses.identify.space import (
    LOOSENESS,
    PRECISION_NOTES,
    SUSPICIOUS_VALUES,
    knob_key,
    same_value,
    knob_signature,
    fmt_knobs,
    fmt_value,
)
from mhctool.families import get_family
from mhctool.registry.impl import Impl
from mhctool.runner.case import Case, ImplResult


# how far past the verdict's threshold a backward whose forward fits is wrong on the verdict alone
# (a backward that rounds worse than native's is a few times past; a fixed-point backward of a
# 20-iteration Sinkhorn 8e4 times, one detached from a sum 6e6 times); nearer, its own forward's
# finite differences decide (derivative.py)
FAR_PAST = 100.0


@dataclass
class Probe:
    case: Case
    base: dict
    upstream: list
    res: ImplResult
    noise: list  # per output: the native implementation's error at the asked knobs (normalised max abs)
    refs: list = field(default_factory=list)  # the float64 reference's outputs at the asked knobs
    noise_at: str = "ieee"  # the matmul precision ``noise`` was measured at (the declared or asked one)


@dataclass
class Candidate:
    knobs: dict  # the fitted knobs, in the space's order
    score: float  # worst error of its outputs against this candidate's reference, in native noise units
    max_rel: float  # worst max_rel of its outputs against this candidate's reference
    stage: str  # grid, refine, snap, judged
    native_score: float | None = None
    passed: bool | None = None
    worst: str | None = None  # the failing row, when judged and failed
    level: str | None = None
    note: str | None = None
    fwd_passed: bool | None = None  # the forward alone passes the verdict (judged candidates)
    bwd_worst: str | None = None  # the backward's first failing row, when it fails
    bwd_row: tuple | None = None  # that row's (probe family, metric, value, threshold)
    # judged candidates: its native baseline is non-finite on a guard where the implementation is
    # (it explains an overflow, which is still no convention)
    overflows: bool | None = None
    # its score on each probe, in the fit's probe order (what a partial fit is told from)
    per_probe: tuple = ()
    # judged candidates: the knobs it takes no parameter for (or ignores) whose fitted value its
    # outputs do not tell from the asked one: no convention to declare
    untold: tuple = ()
    # where judged at another matmul precision than the fit's noise was measured at: its score on
    # each probe in the native noise at that precision (what a claim of a fit is checked against)
    fit_at: tuple = ()

    @property
    def key(self) -> tuple:
        return knob_key(self.knobs)

    @property
    def bwd_far(self) -> bool:
        """Its backward fails by far more than rounding (past :data:`FAR_PAST` times the rule's
        threshold): with the forward matching, that alone says it is not the forward's derivative."""
        if not self.bwd_row:
            return False
        value, threshold = self.bwd_row[2], self.bwd_row[3]
        return not (value <= FAR_PAST * threshold)

    @property
    def spread(self) -> float:
        """How far it is over all probes at once: the sum of log(1 + score) per probe. Where every
        candidate is far off on one probe, the worst score ranks them by that probe alone; this
        still sees which fit the others (what a search over knobs that fit only together follows)."""
        return sum(math.log1p(s) for s in self.per_probe) if self.per_probe else math.log1p(self.score)


@dataclass
class Partial:
    """A candidate that fits most probes within native noise and not the rest: a finding of its
    own where no convention fits every probe."""

    candidate: Candidate
    fits: list  # the probe families it fits
    within: float  # its worst score there, in native noise
    fails: list  # (family, its description, its score there, where the outputs differ)

    def sentence(self) -> str:
        def listed(xs):
            return xs[0] if len(xs) == 1 else ", ".join(xs[:-1]) + " and " + xs[-1]
        misses = "; ".join(f"not on {fam} ({doc}), {score:.3g}x off: {where}" for fam, doc, score, where in self.fails)
        return (f"it computes {fmt_knobs(self.candidate.knobs) or 'the contract'} on {listed(self.fits)} (within "
                f"{self.within:.3g}x native noise), {misses}")


@dataclass
class Identification:
    kernel: str
    impl: Impl
    asked: dict
    candidates: list[Candidate]
    best: Candidate | None
    error: str | None = None  # the implementation failed on a probe
    discrete: tuple[str, ...] = ()  # the knobs searched exhaustively
    fixed: dict = field(default_factory=dict)  # asked knobs held, not searched (Sinkhorn's domain)
    precision: str = "ieee"  # the matmul precision it is judged at (fitted, or as asked / declared)
    precision_bwd: str | None = None  # the backward's, where fitted apart from the forward's
    declared_precision: str = "ieee"  # what its adapter declares (or ieee)
    ties: list = field(default_factory=list)  # other candidates that fit as well (within native noise)
    # guard probes where it returned non-finite values and the float64 contract is finite:
    # (family, its description, non-finite outputs, outputs where the contract is finite)
    overflow: list = field(default_factory=list)
    ignored: dict = field(default_factory=dict)  # knob -> "takes no" / "ignores": it runs its own value
    # where no convention fits the forward: its backward against its own forward (derivative.py)
    derivative: str | None = None
    # where the forward fits and the backward fails the verdict by a finite margin: the same check
    # on the probe it fails (derivative.OwnDerivative), so a right backward is never called wrong
    backward: OwnDerivative | None = None
    # where no convention fits every probe: one that fits most of them (Partial)
    partial: Partial | None = None
    # where no candidate comes near (evidence.nothing_near): what its outputs show instead (evidence.py)
    evidence: str | None = None
    # Sinkhorn's guards where its matrices are uniform and the contract's are not (Probing._saturated)
    saturated: list = field(default_factory=list)
    # a direction that failed at the probe shape and runs at aligned ones (limits.py): the sentence
    limit: str | None = None
    # an output (or gradient) that came back in another dtype than its input's: name -> that dtype
    returned: dict = field(default_factory=dict)
    # an optional input it has a parameter for but raised when given: name -> what it raised
    without: dict = field(default_factory=dict)
    # where a matmul precision was asked (not fitted): the precision whose products its outputs are
    # nearest (what a precision claim is checked against)
    nearest_precision: str | None = None
    # the precision asked for, where its outputs are nearer another's and pass there (identified at that one)
    asked_precision: str | None = None
    # continuous knobs of the best fit that the probes tell only within a range: knob -> (low, high)
    told: dict = field(default_factory=dict)

    @property
    def asked_all(self) -> dict:
        """Everything it was asked for: the searched knobs' asked values and the held ones (a knob
        that means something under another's value only where it has it: Knob.only_with)."""
        out = {**self.asked, **self.fixed}
        knobs = get_family(self.kernel).knobs
        return {k: v for k, v in out.items() if k not in knobs or knobs[k].applies(out)}

    def shown(self, top: int) -> list[Candidate]:
        """The judged candidates, then the best fit of each other discrete combination (``top`` in all)."""
        judged = [c for c in self.candidates if c.stage == "judged"]
        seen = {knob_signature(c.knobs, self.discrete) for c in judged}
        rest = []
        for c in self.candidates:
            sig = knob_signature(c.knobs, self.discrete)
            if sig not in seen:
                seen.add(sig)
                rest.append(c)
        return (judged + rest)[:top]

    @property
    def passed(self) -> bool:
        return self.best is not None and bool(self.best.passed)

    @property
    def split_precision(self) -> bool:
        return self.precision_bwd is not None and self.precision_bwd != self.precision

    def judged_precision(self) -> str:
        """The one precision ``parity`` judges it at: the looser of the forward's and the backward's."""
        if not self.split_precision:
            return self.precision
        return self.precision if LOOSENESS[self.precision] > LOOSENESS[self.precision_bwd] else self.precision_bwd

    def _knobs(self) -> str:
        if not (self.best.passed or self.best.fwd_passed):  # nothing fits: no precision is identified
            return fmt_knobs(self.best.knobs) or "the contract"
        if self.split_precision:
            prec = f" matmul_precision={self.precision} (forward) / {self.precision_bwd} (backward)"
        else:
            prec = f" matmul_precision={self.precision}" if self.precision != "ieee" else ""
        return (fmt_knobs(self.best.knobs) + prec).strip() or "the contract"

    def overflow_sentence(self) -> str | None:
        """The non-finite outputs it returned where the float64 contract is finite, or None."""
        if not self.overflow:
            return None
        parts = [f"{bad} of {total} outputs non-finite on {fam} ({doc})" for fam, doc, bad, total in self.overflow]
        return "; ".join(parts) + " where the float64 contract is finite"

    def saturation_sentence(self) -> str | None:
        """The guards where its outputs collapsed to uniform matrices and the contract's did not."""
        if not self.saturated:
            return None
        parts = [f"on {fam} ({doc}) its outputs are uniform in {k} of {total} matrices where the contract's are not"
                 for fam, doc, k, total in self.saturated]
        return "; ".join(parts) + ": the exponential saturates (clamped, as exp(min(x, bound)) is)"

    def line(self) -> str:
        return self._line() + (f"; {self.limit}" if self.limit else "")

    def _line(self) -> str:
        if self.error:
            return f"no convention fits: {self.error}"
        b = self.best
        if self.overflow:
            why = next((SUSPICIOUS_VALUES[(self.kernel, k, v)][0] for k, v in b.knobs.items()
                        if (self.kernel, k, v) in SUSPICIOUS_VALUES), None) if b.overflows else None
            return (f"no convention fits: {self.overflow_sentence()}; its finite outputs fit {self._knobs()}"
                    + (f" ({why})" if why else "") + "; a defect: an overflow is never a convention")
        if b.passed:
            return f"best match: {self._knobs()} (max_rel {b.max_rel:.2g})"
        if b.fwd_passed and b.worst and b.worst.startswith("backward failed: "):
            return f"forward matches {self._knobs()}; the backward {b.worst[len('backward '):]}"
        if b.fwd_passed:
            return f"forward matches {self._knobs()}; " + self._backward_clause()
        saturation = self.saturation_sentence()
        if self.partial:
            return (f"no convention fits every probe: {self.partial.sentence()}"
                    + (f"; {saturation}" if saturation else "")
                    + (f"; {self.derivative}" if self.derivative else ""))
        if self.evidence:
            return (f"no convention fits, and none comes near: the nearest ({self._knobs()}) is {b.score:.3g}x "
                    f"native noise off, no finding; {self.evidence}"
                    + (f"; {saturation}" if saturation else "")
                    + (f"; {self.derivative}" if self.derivative else ""))
        return (f"no convention fits: closest {self._knobs()}, error {b.max_rel:.2g}"
                + (f"; the forward is off first: {b.worst}" if b.worst else "")
                + (f"; {saturation}" if saturation else "")
                + (f"; {self.derivative}" if self.derivative else ""))

    def _backward_clause(self) -> str:
        """What is wrong with a backward whose forward fits: non-finite gradients, or (checked
        against its own forward) not the derivative, or the derivative but rounded worse than
        native's; never "not the derivative" on the verdict alone."""
        b, row = self.best, f" ({self.best.worst})" if self.best.worst else ""
        if b.bwd_row and b.bwd_row[1] == "nonfinite":
            return f"its backward returns non-finite gradients where the float64 contract's are finite{row}"
        if b.bwd_far:
            return f"the backward is not the derivative of that forward{row}"
        check = self.backward
        if check is None or check.agrees is None:
            return (f"its backward fails the verdict{row}"
                    + (f"; {check.sentence()}" if check is not None else ""))
        if check.agrees:
            return (f"its backward is further from the contract's gradients than native rounding{row}, "
                    f"yet {check.sentence()}: judged at a looser rule, or given a backward that rounds as "
                    "native's does, it would pass")
        return check.sentence() + f"; the verdict: {b.worst}"

    def precision_note(self) -> str | None:
        """What the fitted matmul precision is, where it is not what the implementation declares."""
        if self.split_precision:
            return (f"the forward {PRECISION_NOTES[self.precision]}; the backward "
                    f"{PRECISION_NOTES[self.precision_bwd]}; parity takes one "
                    f"precision for both: judge it at {self.judged_precision()}, the looser")
        if self.precision == self.declared_precision:
            return None
        if self.best is not None and self.best.fwd_passed and not self.best.passed:
            # only the forward fits: what its backward multiplies at is not identified
            return f"the forward {PRECISION_NOTES[self.precision]} (its backward's precision is not identified)"
        return f"matmul_precision={self.precision}: {PRECISION_NOTES[self.precision]}"

    def defect(self) -> bool:
        """What fits is likely a defect in a knob the implementation takes: one it follows to
        another value, or takes and ignores (a knob it takes no parameter for is a fixed choice,
        declared as a convention)."""
        if self.best is None or self.best.level != "likely a defect":
            return False
        return any(self.ignored.get(k) != "takes no" for k, v in self.best.knobs.items()
                   if not same_value(v, self.asked.get(k)) and k in get_family(self.kernel).knobs)

    def flags(self) -> str:
        """The ``parity`` options that judge it as identified (conventions, then the precision)."""
        out = [f"--convention {k}={fmt_value(v)}" for k, v in self.conventions().items()]
        if self.judged_precision() != self.declared_precision:
            out.append(f"--matmul-precision {self.judged_precision()}")
        return " ".join(out)

    def conventions(self) -> dict:
        """The fitted knobs that ``--convention`` can declare and that differ from the asked ones.
        Not a knob the implementation takes and follows (a declared value is passed to it, so it
        would compute something else again): those are what it was asked for, or a defect; nor one
        whose fitted value its outputs do not tell from the asked one (a tie, no finding)."""
        fam = get_family(self.kernel)
        asked = {**self.fixed, **self.asked}  # the held knobs too (Sinkhorn's domain, where asked)
        return {k: v for k, v in (self.best.knobs if self.best else {}).items()
                if k in fam.conventions and not same_value(v, asked.get(k)) and k not in self.best.untold
                and (k in self.ignored or not (fam.knobs[k].passed and self.impl.accepts(k)))}


def rows(ident: Identification, dtype: str, device: str) -> list[dict]:
    """Report rows (report.IDENTIFY_SCHEMA): one per candidate tried."""
    base = {"kernel": ident.kernel, "impl": ident.impl.name, "dtype": dtype, "device": device,
            "asked": json.dumps(ident.asked_all, sort_keys=True, default=str)}
    if ident.error:
        return [{**base, "stage": "error", "candidate": None, "max_rel": math.nan, "native_max_rel": None,
                 "passed": False, "best": False, "classification": None, "message": ident.line()}]
    out = []
    for c in ident.candidates:
        out.append({**base, "stage": c.stage, "candidate": json.dumps(c.knobs, sort_keys=True, default=str),
                    "max_rel": c.max_rel, "noise_ratio": c.score, "native_max_rel": c.native_score, "passed": c.passed,
                    "best": c is ident.best, "classification": c.level,
                    "message": c.worst if c.passed is False else c.note})
    return out
