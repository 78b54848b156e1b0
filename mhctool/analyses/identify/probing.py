"""The probes: the implementation and the native one run once per probe input family at the asked
knobs; the guards (where an overflow would show), and the knobs the implementation ignores."""
from __future__ import annotations

from dataclasses import replace

import torch

from mhctool.analyses.identify.conclusion import Probe
from mhctool.analyses.identify.evidence import uniform
from mhctool.analyses.identify.space import SINKHORN_IN, UNSAID, far_from
from mhctool.analyses.identify.subject import Subject, batched_errors, float64_inputs
from mhctool.core.dtypes import FORMATS
from mhctool.core.metrics import nonfinite
from mhctool.families import generate, input_family
from mhctool.runner.call import (
    cast_inputs,
    native_at,
    output_specs,
    run_impl,
    upstream_for,
)
from mhctool.runner.case import Case


class Probing(Subject):
    """Runs the probes and the guards; finds the overflows and the ignored knobs."""

    def _run_on(self, fam_name: str):
        """The native implementation and the one under test on one input family, at the asked knobs:
        (case, shape, base inputs, native result, upstream gradients, its result)."""
        knobs = self._impl_knobs()
        case = Case(self.kernel, fam_name, self.dtype, self.shape, tuple(sorted(knobs.items())), self.seed,
                    self.device, "identify")
        shape, raw = generate(self.kernel, fam_name, self.shape, self.seed, knobs, draw_on=self.device)
        base = cast_inputs(self.fam, raw, self.dtype, self.device)
        nat = run_impl(self.fam, native_at(self.kernel, self.precision), base, knobs,
                              lambda outs: upstream_for(self.fam, outs, self.seed))
        if nat.fwd_error:
            raise RuntimeError(f"the native {self.kernel} failed on {fam_name}: {nat.fwd_error}")
        upstream, expect = upstream_for(self.fam, nat.outputs, self.seed), output_specs(nat.outputs)
        return case, shape, base, nat, upstream, self._call(case, base, knobs, upstream, expect)

    def _probe(self, fam_name: str) -> tuple[Probe | None, str | None]:
        case, shape, base, nat, upstream, res = self._run_on(fam_name)
        self.returned.update(res.returned)
        if res.failure == "stopped" and self.ended is not None:
            # stopped after it ended its process: the conclusion is what it did the first time
            direction, error, family = self.failed = self.ended
            return None, f"its {direction} failed: {error} (probe {family}); on the later probes {res.fwd_error}"
        if res.failure not in (None, "stopped") and self.ended is None:
            self.ended = ("forward" if res.fwd_error else "backward", res.fwd_error or res.bwd_error, fam_name)
        if res.fwd_error:
            self.failed = ("forward", res.fwd_error, fam_name)
            return None, f"its forward failed: {res.fwd_error} (probe {fam_name})"
        if res.fwd_lost:  # its backward faulted and took the forward's outputs (an isolation worker's context)
            self.failed = ("backward", res.bwd_error, fam_name)
            return None, f"its backward failed: {res.bwd_error} (probe {fam_name})"
        with torch.no_grad():
            refs = self.fam.call(self.fam.reference, float64_inputs(base), self._split(self.asked)[0], lambda k: True)
        return Probe(replace(case, shape=shape), base, upstream, res, self._noise(base, nat.outputs, refs), list(refs),
                     self.precision), None

    def _noise(self, base: dict, nat_outs=None, refs=None, precision: str | None = None) -> list[float]:
        """Per output, the native implementation's error at the family's default knobs (at
        ``precision``, else the one the forward is judged at): the unit every candidate's fit is
        measured in, the same whatever was asked (``nat_outs`` and ``refs``, the run at the asked
        knobs, serve where they are the defaults)."""
        if nat_outs is None or self.defaults() != self.asked or \
                self.space.how and any(k in self.family_knobs for k in self.space.how):
            knobs, ref_fn, nat_fn = self._split(self.defaults(), precision)
            with torch.no_grad():
                nat_outs = self.fam.call(nat_fn, base, knobs, lambda k: True)
                refs = self.fam.call(ref_fn, float64_inputs(base), knobs, lambda k: True)
        floor = 2 * FORMATS[self.dtype].unit_roundoff
        return [max(batched_errors(o, r.unsqueeze(0))[0][0], floor) for o, r in zip(nat_outs, refs)]

    def noise_in(self, p: Probe, precision: str) -> list[float]:
        """``p``'s native noise at ``precision`` (its own where measured there; cached)."""
        if precision == p.noise_at:
            return p.noise
        key = (id(p), precision)
        if key not in self._noises:
            self._noises[key] = self._noise(p.base, precision=precision)
        return self._noises[key]

    def probes(self) -> tuple[list[Probe], str | None]:
        """The probes the fit is made on; also runs the guards (``self.guards``, ``self.overflow``)
        and finds the knobs the implementation ignores (``self.ignored``)."""
        out = []
        for fam_name in self.space.probes:
            p, error = self._probe(fam_name)
            if error:
                return out, error
            out.append(p)
        self.guards = []
        for fam_name in self.space.guards:
            p, error = self._probe(fam_name)
            if error:
                return out, error
            self.guards.append(p)
        self.overflow = self._overflow()
        self.saturated = self._saturated()
        self.ignored = self._ignored(out)
        return out, None

    def _saturated(self) -> list:
        """Sinkhorn's guards (its own or a composite's) where the implementation's matrices are
        uniform (1/n everywhere: an exponential that saturates, finite but collapsed) and the
        float64 contract's are not: (family, its description, how many matrices, of how many)."""
        part = SINKHORN_IN.get(self.kernel)
        if part is None:
            return []
        out = []
        for p in self.guards:
            if not p.res.outputs:
                continue
            collapsed = uniform(p.res.outputs[part.output]) & ~uniform(p.refs[part.output], 1e-2)
            if int(collapsed.sum()):
                out.append((p.case.family, input_family(self.kernel, p.case.family).doc, int(collapsed.sum()),
                            collapsed.numel()))
        return out

    def _overflow(self) -> list:
        """Per guard where the implementation returned non-finite values that the float64 contract
        (what it was asked for) does not have: (family, its description, how many, of how many)."""
        out = []
        for p in self.guards:
            bad = sum(int(nonfinite(o, r)) for o, r in zip(p.res.outputs, p.refs))
            if bad:
                total = sum(int(torch.isfinite(r).sum()) for r in p.refs)
                out.append((p.case.family, input_family(self.kernel, p.case.family).doc, bad, total))
        return out

    def _ignored(self, probes: list[Probe]) -> dict:
        """The numeric knobs whose asked value does not change an external implementation's outputs:
        knob -> ``takes no`` (no such parameter) or ``ignores`` (the outputs are bit for bit the same
        at another value, far from the asked one, on every probe)."""
        if self.impl.backend != "external":
            return {}
        out = {}
        knobs = self._impl_knobs()
        for k in self._names():
            knob = self.fam.knobs.get(k)
            if k in self.space.variants or knob is None or not knob.passed or knob.kind not in (int, float) \
                    or knob.only_with is not None or k in UNSAID:  # said with what it depends on, or where set
                continue
            if not self.impl.accepts(k):
                out[k] = "takes no"
                continue
            alt = far_from(knob.kind, self.asked[k])
            same = True
            for p in probes:
                res = self._call(p.case, p.base, {**knobs, k: alt}, p.upstream, output_specs(p.res.outputs))
                if res.fwd_error or not all(torch.equal(a, b) for a, b in zip(res.outputs, p.res.outputs)):
                    same = False
                    break
            if same:
                out[k] = "ignores"
        return out
