"""The pass/fail rule, and which part of it decided each row.

A fused implementation is judged against the native PyTorch implementation at the same dtype
(the rule FlashAttention's tests use): its error may be at most ``kappa`` times the native error,
plus a small floor of ``floor_roundoffs`` unit roundoffs of the output dtype (relative to the
reference's largest magnitude for ``max_abs``), so that a kernel that merely rounds in another
order is not flagged. For outputs that are long cancelling sums (a family names them through its
``term_scale``), the floor is relative to the sum of the terms' magnitudes instead: there two
correct summation orders differ by a few roundoffs of the terms, which the ratio to the native
error, itself a noisy maximum over a handful of elements, does not bound. It may not leave
elements unwritten or produce many more exact zeros than the native one, and it may never produce
a non-finite value where the float64 contract's value is finite in the output's dtype: whatever
the native implementation does there and whatever convention is declared, an overflow is never a
convention (``nonfinite`` fails at one element, and an error metric made infinite by it fails
however large its threshold).

The native implementation itself is checked against a loose per-dtype tolerance: a sanity bound
on the baseline, not the point of the tool.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from mhctool.core.dtypes import FloatFormat

GATED_ERRORS = ("max_abs", "rel_l2")
GATED_COUNTS = ("nonfinite", "unwritten", "extra_zeros", "mask_mismatch")
NONFINITE_RULE = "non-finite where the contract is finite"

# a dropout kernel's mask is part of the contract (the counter-based one its seed and offset draw)
MASK_RULE = "the contract's dropout mask"
MASK_FAILED = "another dropout mask than the contract's seed and offset draw"

BASELINE_TOL = {"fp32": 1e-4, "bf16": 2e-1, "fp16": 5e-2, "fp64": 1e-10}


@dataclass(frozen=True)
class Judgement:
    threshold: float | None
    passed: bool | None  # None: informational metric
    rule: str


@dataclass(frozen=True)
class VerdictRule:
    kappa: float = 2.0
    floor_roundoffs: float = 2.0
    baseline_tol: dict = field(default_factory=lambda: dict(BASELINE_TOL))

    def floor(self, metric: str, fmt: FloatFormat, ref_amax: float, term_scale: float | None = None) -> float:
        """``term_scale``: the sum of |terms| of a cancelling reduction (the family says which
        tensors are ones); rounding each term costs up to a unit roundoff of *it*, so the floor
        scales with the terms rather than with the result."""
        f = self.floor_roundoffs * fmt.unit_roundoff
        scale = max(ref_amax, term_scale or 0.0)
        if metric == "max_abs":
            return f * scale
        return f * (scale / ref_amax if ref_amax > 0 else 1.0)

    def judge(self, metric: str, value: float, fmt: FloatFormat, ref_amax: float,
              native: dict[str, float] | None, case_fmt: FloatFormat | None = None,
              numel: int = 0, term_scale: float | None = None) -> Judgement:
        """``fmt`` is the measured tensor's format, ``case_fmt`` the case's activation format;
        ``native`` is the native implementation's metrics on the same case, or None when the row
        *is* the native implementation (judged by the tolerance of the coarser of the two)."""
        coarse = fmt if case_fmt is None or fmt.mantissa_bits < case_fmt.mantissa_bits else case_fmt
        if native is None:
            return self._judge_baseline(metric, value, coarse, ref_amax)
        if metric in GATED_ERRORS and not math.isfinite(native[metric]):
            # native went non-finite where the reference is finite: kappa x inf would bound
            # nothing, so the implementation is held to the tolerance native itself is judged by
            j = self._judge_baseline(metric, value, coarse, ref_amax)
            rule = f"{j.rule} (native non-finite)"
            if math.isinf(value):  # non-finite itself, where the reference is finite
                rule = NONFINITE_RULE
            return Judgement(j.threshold, j.passed, rule)
        if metric in GATED_ERRORS:
            ratio_part = self.kappa * native[metric]
            floor = self.floor(metric, fmt, ref_amax, term_scale)
            thr = ratio_part + floor
            if ratio_part >= floor:
                rule = f"kappa={self.kappa:g} x native"
            else:
                rule = "reduction floor" if (term_scale or 0.0) > ref_amax else "dtype floor"
            if not math.isfinite(value):  # a non-finite output where the reference is finite
                return Judgement(thr, False, NONFINITE_RULE if math.isinf(value) else rule)
            return Judgement(thr, value <= thr, rule)
        if metric == "nonfinite":
            return Judgement(0.0, value == 0, "no non-finite" if value == 0 else NONFINITE_RULE)
        if metric == "unwritten":
            return Judgement(0.0, value == 0, "all written")
        if metric == "mask_mismatch":
            return Judgement(0.0, value == 0, MASK_RULE if value == 0 else MASK_FAILED)
        if metric == "extra_zeros":
            # an exact cancellation now and then is rounding, not a defect: allow 2u of the elements
            # (rounded up, so one stray zero in a small tensor)
            ratio_part = self.kappa * native["extra_zeros"]
            floor = float(math.ceil(numel * 2 * fmt.unit_roundoff))
            thr = ratio_part + floor
            rule = f"kappa={self.kappa:g} x native zeros" if ratio_part >= floor else "dtype floor"
            return Judgement(thr, value <= thr, rule)
        return Judgement(None, None, "info")

    def _judge_baseline(self, metric, value, fmt, ref_amax) -> Judgement:
        tol = self.baseline_tol[fmt.name]
        if metric in GATED_ERRORS:
            thr = tol * ref_amax if metric == "max_abs" else tol
            return Judgement(thr, math.isfinite(value) and value <= thr, f"baseline tol {tol:g}")
        if metric == "nonfinite":
            return Judgement(0.0, value == 0, "no non-finite" if value == 0 else NONFINITE_RULE)
        if metric == "unwritten":
            return Judgement(0.0, value == 0, "all written")
        if metric == "mask_mismatch":
            return Judgement(0.0, value == 0, MASK_RULE if value == 0 else MASK_FAILED)
        return Judgement(None, None, "info")
