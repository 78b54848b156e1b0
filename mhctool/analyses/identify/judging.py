"""The verdict on a fitted candidate: mhctool's rule on every probe and guard, forward and
backward, against the native baseline under the candidate; the evidence for a fitted value that
would be a defect, on the implementation's own outputs; the matmul precision fitted per direction."""
from __future__ import annotations

from dataclasses import replace

import torch

from mhctool.analyses.identify.conclusion import Candidate, Probe
from mhctool.analyses.identify.evidence import nothing_near
from mhctool.analyses.identify.fitting import Fitting
from mhctool.analyses.identify.probing import Probing
from mhctool.analyses.identify.space import (
    DEFECT_KNOBS,
    SUSPICIOUS_VALUES,
    classify,
    fmt_value,
    same_value,
)
from mhctool.analyses.identify.subject import batched_errors, in_noise, nan_as_inf
from mhctool.core.metrics import max_rel, nonfinite
from mhctool.core.text import measured
from mhctool.families import PRECISIONS, input_family
from mhctool.registry.builtin import native_impl
from mhctool.runner.baseline import judged_rows, make_baseline
from mhctool.runner.call import run_impl


class Judging(Fitting, Probing):
    """Judges candidates, gathers the evidence for defects, fits the matmul precision."""

    def judge(self, probes: list[Probe], cand: Candidate) -> Candidate:
        """The verdict rule on every probe and guard, forward and backward, under the candidate;
        failing, once more with the space's ``judge_also`` knobs (the float64 reference is the same,
        the native baseline computes the way such a kernel does), which join the fit when that
        passes. A candidate that fails explains nothing but what its evidence shows."""
        c = self._verdict(probes, cand, {})
        for also in ([] if c.passed else self.space.judge_also(cand.knobs)):
            if set(also) <= set(self.space.rounding_only) and not cand.score <= self.space.near_miss:
                continue  # rounding alone does not explain an error this far from native's
            other = self._verdict(probes, cand, also)
            if other.passed or (other.fwd_passed and not c.fwd_passed):
                c = replace(other, knobs={**other.knobs, **also})
            if c.passed:
                break
        # against everything asked, the held knobs too (a log domain asked is asked, though held apart)
        evidence = self.evidence(probes, c)
        c.level, c.note = classify(self.kernel, c.knobs, {**self.family_knobs, **self.asked}, evidence,
                                   self.ignored, shown_only=not (c.passed or c.fwd_passed),
                                   takes=self.impl.accepts if self.impl.backend == "external" else lambda knob: True)
        c.untold = tuple(k for k, (shown, _) in evidence.items() if shown is False and k in self.ignored)
        self.tried[c.key] = c
        return c

    def _verdict(self, probes: list[Probe], cand: Candidate, extra: dict) -> Candidate:
        """The verdict on every probe: the forward's rows against the native baseline at the
        forward's precision, the backward's at the backward's (the same unless fitted apart)."""
        fwd = self._verdict_at(probes, cand, extra, self.precision)
        if self.precision_bwd == self.precision:
            return fwd
        bwd = self._verdict_at(probes, cand, extra, self.precision_bwd)
        failed = (None if fwd.fwd_passed else fwd.worst) or bwd.bwd_worst
        return replace(fwd, passed=failed is None, worst=failed, bwd_worst=bwd.bwd_worst, bwd_row=bwd.bwd_row)

    def _verdict_at(self, probes: list[Probe], cand: Candidate, extra: dict, precision: str) -> Candidate:
        knobs, ref_fn, nat_fn = self._split(cand.knobs, precision)
        knobs.update(extra)
        nat = replace(native_impl(self.kernel), target=nat_fn, _fn=nat_fn)
        native_worst, fwd_failed, bwd_failed, overflows, bwd_row = 0.0, None, None, None, None
        for p, guard in [*((p, False) for p in probes), *((g, True) for g in self.guards)]:
            judged = make_baseline(self.fam, p.case, p.base, knobs, native_impl_=nat, reference=ref_fn)
            if guard:  # does the candidate overflow where the implementation does, and only there?
                nat_bad = any(nonfinite(o, r) for o, r in zip(judged.native.outputs, judged.ref_outs))
                own_bad = any(nonfinite(o, r) for o, r in zip(p.res.outputs, judged.ref_outs))
                overflows = bool(overflows) or (nat_bad and own_bad)
                if nat_bad and not own_bad:
                    fwd_failed = fwd_failed or (f"its native baseline overflows on {p.case.family} where the "
                                                "implementation stays finite: not what it computes")
            else:
                off = max((max_rel(o, r) for o, r in zip(judged.native.outputs, judged.ref_outs)), default=0.0)
                native_worst = max(native_worst, off)
                # in units of the native noise on that probe too, at the precision judged: a bf16
                # baseline's rounding is an order-one share of an output's small entries (max_rel
                # 2.7 on TileKernels' pre-path at bf16 on an H200), and a TF32 one's thousands of
                # IEEE noise units (a TF32 composite at probe seed 1), never a sign that it
                # computes something else
                ratio = in_noise(judged.native.outputs, judged.ref_outs, self.noise_in(p, precision))
                if nothing_near(ratio, off):
                    # a baseline that does not compute the candidate sets no threshold for it
                    fwd_failed = fwd_failed or (f"no verdict on {p.case.family}: the native baseline there is itself "
                                                f"off from this candidate's float64 result by max_rel {measured('max_rel', off)}"
                                                f" ({ratio:.3g}x native noise)")
            # a non-finite count says what an infinite error does
            rows = sorted(judged_rows(judged, p.res, {}, self.rule, self.dtype),
                          key=lambda r: r["metric"] != "nonfinite")
            if p.res.bwd_error:
                bwd_failed = bwd_failed or f"backward failed: {p.res.bwd_error}"
            for r in rows:
                if r["passed"] is False:
                    msg = (f"{r['tensor']} {r['metric']} {measured(r['metric'], r['value'])} > "
                           f"{measured(r['metric'], r['threshold'])} on {p.case.family}")
                    if r["direction"] == "fwd":
                        fwd_failed = fwd_failed or msg
                    elif bwd_failed is None:
                        bwd_failed, bwd_row = msg, (p.case.family, r["metric"], r["value"], r["threshold"])
        failed = fwd_failed or bwd_failed
        return replace(cand, stage="judged", native_score=native_worst, passed=failed is None, worst=failed,
                       fwd_passed=fwd_failed is None, bwd_worst=bwd_failed, overflows=overflows, bwd_row=bwd_row)

    def evidence(self, probes: list[Probe], cand: Candidate) -> dict:
        """knob -> (shown, what was measured) for each fitted value that would be a defect."""
        out = {}
        for k, v in cand.knobs.items():
            if same_value(v, self.asked.get(k)):
                continue
            odd = SUSPICIOUS_VALUES.get((self.kernel, k, v))
            if odd:
                out[k] = self._nonfinite_evidence(odd[1])
            elif k in DEFECT_KNOBS:
                out[k] = self._knob_evidence(probes, cand, k)
        return out

    def _nonfinite_evidence(self, family: str) -> tuple[bool, str]:
        """Whether the implementation returns non-finite values on ``family`` (a guard, else run
        now) where the float64 contract (what it was asked for) is finite."""
        doc = input_family(self.kernel, family).doc
        p = next((g for g in self.guards if g.case.family == family), None)
        if p is None:
            p, error = self._probe(family)
            if error:
                return True, f"it failed on {family} ({doc}): {error}"
        bad = sum(int(nonfinite(o, r)) for o, r in zip(p.res.outputs, p.refs))
        total = sum(int(torch.isfinite(r).sum()) for r in p.refs)
        if bad:
            return True, f"{bad} of {total} outputs non-finite on {family} ({doc}) where the float64 contract is finite"
        return False, (f"its outputs on {family} ({doc}) are finite, so it subtracts a max or works in logs; "
                       "exact arithmetic cannot tell that from none where the first normalisation cancels it "
                       "(a tie, not an overflow)")

    def _knob_evidence(self, probes: list[Probe], cand: Candidate, knob: str) -> tuple[bool, str]:
        """The probe where the asked value of ``knob`` (the rest as fitted) is furthest from the
        implementation's outputs, against the fitted value there: shown unless the two fit alike."""
        alt = {**cand.knobs, knob: self.asked[knob]}
        worst = None
        for p in probes:
            fits = []
            for c in (alt, cand.knobs):
                kn, ref_fn, _ = self._split(c)
                fits.append(self._fit([p], [c], kn, ref_fn, lambda outs: [o.unsqueeze(0) for o in outs], "evidence")[0])
            if worst is None or fits[0].score - fits[1].score > worst[1].score - worst[2].score:
                worst = (p, *fits)
        p, at_asked, at_fit = worst
        said = (f"on {p.case.family}: at {knob}={fmt_value(self.asked[knob])} the outputs are off by max_rel "
                f"{at_asked.max_rel:.2g} ({at_asked.score:.3g}x native noise), at {knob}={fmt_value(cand.knobs[knob])} "
                f"by {at_fit.max_rel:.2g} ({at_fit.score:.3g}x)")
        # shown only where the fitted value fits there and the asked one is further off: two
        # values both far from the outputs show nothing of the knob
        return not nothing_near(at_fit.score, at_fit.max_rel) and at_asked.score > self._tol(at_fit.score), said

    def fit_precision(self, probes: list[Probe], cand: Candidate) -> tuple[str, str]:
        """The matmul precision of the forward and of the backward: the closest precision (below)
        under which that direction passes the verdict, else the closest."""
        order_f, order_b = self.closest_precisions(probes, cand)
        verdicts: dict[str, Candidate] = {}  # each precision judged once, where it is reached

        def first(order, ok):
            for p in order:
                if p not in verdicts:
                    verdicts[p] = self._verdict_at(probes, cand, {}, p)
                if ok(verdicts[p]):
                    return p
            return order[0]
        return (first(order_f, lambda c: c.fwd_passed),
                first(order_b, lambda c: c.fwd_passed is not None and c.bwd_worst is None))

    def closest_precisions(self, probes: list[Probe], cand: Candidate) -> tuple[list[str], list[str]]:
        """The precisions ranked by how close the native implementation computing at each (under
        ``cand``'s knobs) comes to the implementation's forward outputs, and to its gradients: per
        output, the excess of the distance over the least distance, summed; among precisions
        within twice the least excess, the strictest (PRECISIONS' order) first."""
        fwd: dict[str, list[float]] = {}
        bwd: dict[str, list[float]] = {}
        for prec in PRECISIONS:
            knobs, _, nat_fn = self._split(cand.knobs, prec)
            nat = replace(native_impl(self.kernel), target=nat_fn, _fn=nat_fn)
            fwd[prec], bwd[prec] = [], []
            for p in probes:
                res = run_impl(self.fam, nat, p.base, knobs, lambda outs, p=p: p.upstream)
                for o, r in zip(p.res.outputs, res.outputs):
                    fwd[prec].append(nan_as_inf(batched_errors(o, r.detach().double().unsqueeze(0))[0][0]))
                for k, g in (p.res.grads or {}).items():
                    r = (res.grads or {}).get(k)
                    if r is not None:
                        bwd[prec].append(nan_as_inf(batched_errors(g, r.detach().double().unsqueeze(0))[0][0]))

        def ranked(dist: dict[str, list[float]]) -> list[str]:
            if not any(dist.values()):
                return [self.precision, *(p for p in PRECISIONS if p != self.precision)]
            floor = [min(col) for col in zip(*dist.values())]
            excess = {prec: sum(d - f for d, f in zip(ds, floor)) for prec, ds in dist.items()}
            least = min(excess.values())
            near = [p for p, e in excess.items() if e <= 2.0 * least + 1e-12]
            return near + sorted((p for p in PRECISIONS if p not in near), key=lambda p: excess[p])
        return ranked(fwd), ranked(bwd)
