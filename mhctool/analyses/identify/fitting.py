"""The fit: every candidate convention's float64 reference against the implementation's outputs
on the probes, in units of the native noise; the discrete knobs exhaustively, the continuous
ones on a grid (batched along a knob where the reference takes a tensor of values), refined and
snapped to a round value; the pick among fits within noise."""
from __future__ import annotations

import itertools
import json
import math
from dataclasses import replace
from typing import Callable

import torch

from mhctool.analyses.identify.conclusion import Candidate, Probe
from mhctool.analyses.identify.space import (
    KNOWN,
    eps_zero_as_add,
    knob_key,
    roundness,
    same_value,
    knob_signature,
    classify,
)
from mhctool.analyses.identify.subject import (
    Subject,
    batched_errors,
    float64_inputs,
    nan_as_inf,
)


class Fitting(Subject):
    """Scores candidates (cached in ``self.tried``) and picks among them."""

    def score(self, probes: list[Probe], cand: dict, stage: str) -> Candidate:
        """The candidate's fit (cached): its reference on every probe against the implementation's outputs."""
        key = knob_key(cand)
        if key not in self.tried:
            knobs, ref_fn, _ = self._split(cand)
            self.tried[key] = self._fit(probes, [cand], knobs, ref_fn, lambda outs: [o.unsqueeze(0) for o in outs], stage)[0]
        return self.tried[key]

    def _scores(self, probes: list[Probe], cands: list[dict], name: str, stage: str) -> list[Candidate]:
        """:meth:`score` of candidates that differ only in the continuous knob ``name``: those not
        yet scored in one reference call per probe where the space batches that knob."""
        if name != self.space.batched:
            return [self.score(probes, c, stage) for c in cands]
        new = [c for c in {knob_key(c): c for c in cands}.values() if knob_key(c) not in self.tried]
        if new:
            for c in self.score_batch(probes, new, name):
                self.tried[c.key] = replace(c, stage=stage)
        return [self.tried[knob_key(c)] for c in cands]

    def _tol(self, best: float) -> float:
        """Scores within this of the best are the same fit (one unit of native rounding noise)."""
        return 1.25 * best + 1.0

    def _cost(self, cand: dict) -> float:
        """How far a candidate is from what a tie goes to (:meth:`Subject.preferred`)."""
        preferred = self.preferred()
        level = classify(self.kernel, cand, preferred)[0]
        return {"as asked": 0, "known convention": 1, "variant": 2, "likely a defect": 3}[level] + \
            0.01 * sum(not same_value(v, preferred[k]) for k, v in cand.items() if k in preferred)

    def grid(self, probes: list[Probe], discrete: dict | None = None, depends: dict | None = None) -> list[Candidate]:
        """Every discrete combination (``discrete``: other values for some knobs, default the
        space's) with the continuous knobs on their grids, scored; ``depends``: other values for
        the knobs that mean something under one value of another (default the space's)."""
        discrete = {**self.space.discrete, **(discrete or {})}
        names = list(discrete) + list(self.space.continuous)
        preferred = self.preferred()
        values = [discrete[k] for k in discrete] + \
                 [[self.held[k]] if k in self.held else sorted({*self.space.continuous[k], preferred[k], *self._known(k)})
                  for k in self.space.continuous]
        cands = [dict(zip(names, combo)) for combo in itertools.product(*values)]
        # max(sum, 0) is add with eps 0 (eps as a threshold at 0 stays: a floor is searched from it)
        cands = [c for c in cands if not (c.get("eps_mode") == "clamp" and eps_zero_as_add(self.kernel, c) != c)]
        for name, values in {**self.space.depends, **(depends or {})}.items():  # a clamped exponential at each bound
            knob, expanded = self.fam.knobs[name], []
            for c in cands:
                expanded += [{**c, name: v} for v in values] if knob.applies(c) else [c]
            cands = expanded
        keyed = [(knob_key(c), c) for c in cands]
        done = [self.tried[k] for k, c in keyed if k in self.tried]
        cands = [c for k, c in keyed if k not in self.tried]
        if not cands:
            return done
        return done + self._grid(probes, cands, preferred)

    def _grid(self, probes: list[Probe], cands: list[dict], preferred: dict) -> list[Candidate]:
        """:meth:`grid`'s candidates not scored before, scored."""
        b = self.space.batched
        if b is None:
            return [self.score(probes, c, "grid") for c in cands]
        pre = self.space.prefix
        groups: dict[str, list[dict]] = {}
        for c in cands:
            groups.setdefault(json.dumps({k: v for k, v in c.items() if k not in (b, pre)}, sort_keys=True), []).append(c)
        if pre is None:
            return [c for group in groups.values() for c in self._score_group(probes, group, b, pre)]
        # the prefix knob's values up to just past the preferred one for every combination, then the
        # rest of its range for the combinations that fit best there (Sinkhorn: every iteration
        # count to 64 for the four best of sixteen, a third of the work of all sixteen)
        near = preferred[pre] + 3
        first = [c for group in groups.values()
                 for c in self._score_group(probes, [c for c in group if c[pre] <= near], b, pre)]
        ranked = dict.fromkeys(json.dumps({k: v for k, v in c.knobs.items() if k not in (b, pre)}, sort_keys=True)
                               for c in sorted(first, key=lambda c: c.score))
        rest = []
        for sig in list(ranked)[: self.judge_top + 1]:
            far = [c for c in groups[sig] if c[pre] > near]
            rest += self._score_group(probes, far, b, pre) if far else []
        return first + rest

    def descend(self, probes: list[Probe], grid: list[Candidate], starts: int = 2, rounds: int = 3) -> list[Candidate]:
        """The discrete knobs searched together, by coordinate descent from the ``starts`` best
        combinations of ``grid``: each knob in turn over all its values (the others held at the
        best so far, the continuous ones and the prefix knob on their grids), until a round moves
        none (at most ``rounds``). Rare values that only fit together (a clamped exponential with
        eps as a zeroing threshold) are found without the whole product's cost."""
        out: list[Candidate] = []
        knobs = [k for k in self.space.discrete if k != self.space.prefix and len(self.space.discrete[k]) > 1]
        reached: set = set()
        for cur in self._combos(grid, starts, key=lambda c: c.spread):
            if any(c.score <= self.space.near_miss for c in out):
                break  # a start found a fit: the others would only find it again
            for _ in range(rounds):
                if cur.key in reached:
                    break  # where an earlier start went
                reached.add(cur.key)
                moved = False
                for knob in [*knobs, *self.space.depends]:
                    if knob in self.space.depends and knob not in cur.knobs:
                        continue  # a bound that means nothing under the current best
                    held = {k: (cur.knobs[k],) for k in knobs if k != knob}
                    # a dependent knob is held too, but where what it depends on moves
                    dep = {k: (cur.knobs[k],) for k in self.space.depends
                           if k in cur.knobs and k != knob and self.fam.knobs[k].only_with[0] != knob}
                    if knob in self.space.depends:
                        tried = self.grid(probes, held, {knob: self.space.depends[knob]})
                    else:
                        tried = self.grid(probes, {**held, knob: self.space.discrete[knob]}, dep)
                    out += tried
                    best = min(tried, key=lambda c: c.spread)
                    if best.spread < cur.spread - 1e-9:
                        cur, moved = best, True
                if not moved:  # (a round after a fit is found finds its ties: the pick among them)
                    break
        return out

    def _score_group(self, probes: list[Probe], cands: list[dict], knob: str, pre: str | None) -> list[Candidate]:
        """Candidates that differ only in ``knob`` and ``pre``: one reference call per probe where
        every value of ``pre`` has the same values of ``knob``, else one a value of ``pre``."""
        if not cands:
            return []
        if pre is None:
            return self.score_batch(probes, cands, knob)
        by_pre: dict = {}
        for c in cands:
            by_pre.setdefault(c[pre], []).append(c)
        rows = [by_pre[v] for v in sorted(by_pre)]
        if all([c[knob] for c in r] == [c[knob] for c in rows[0]] for r in rows):
            return self.score_batch(probes, [c for r in rows for c in r], knob, pre)
        return [c for r in rows for c in self.score_batch(probes, r, knob)]

    def score_batch(self, probes: list[Probe], cands: list[dict], knob: str, pre: str | None = None) -> list[Candidate]:
        """:meth:`score` of candidates that differ only in ``knob``, with one reference call per probe:
        the reference takes the knob's values as a tensor along a new leading axis. With ``pre``,
        ``cands`` are the values of ``knob`` repeated for each increasing value of ``pre``, which the
        reference takes as a tuple (an axis in front of ``knob``'s)."""
        pv = sorted({c[pre] for c in cands}) if pre else []
        per = len(cands) // max(1, len(pv))
        knobs, ref_fn, _ = self._split({**cands[0], knob: 0.0})
        knobs[knob] = torch.tensor([c[knob] for c in cands[:per]], dtype=torch.float64)
        if pre:
            knobs[pre] = tuple(pv)
        out = self._fit(probes, cands, knobs, ref_fn,
                        (lambda outs: [o.flatten(0, 1) for o in outs]) if pre else (lambda outs: outs), "grid")
        for c in out:
            self.tried[c.key] = c
        return out

    def rescored(self, probes: list[Probe], cand: Candidate, precision: str) -> tuple:
        """``cand``'s score on each probe in the native noise at ``precision`` (the fit is made in
        the noise at the declared precision; a kernel judged at another is a fit in that one's)."""
        knobs, ref_fn, _ = self._split(cand.knobs)
        return self._fit(probes, [cand.knobs], knobs, ref_fn, lambda outs: [o.unsqueeze(0) for o in outs], "judged",
                         noise_of=lambda p: self.noise_in(p, precision))[0].per_probe

    def _fit(self, probes: list[Probe], cands: list[dict], knobs: dict, ref_fn: Callable, stacked: Callable, stage: str,
             noise_of: Callable | None = None) -> list[Candidate]:
        """Candidates from one reference call per probe (per stack of probes, where the space
        stacks them); ``stacked(outs)`` gives each output with the candidates along a leading axis.
        Ranked by error in units of the native noise (``noise_of(probe)``, default the probe's own)."""
        ratio, rel = [0.0] * len(cands), [0.0] * len(cands)
        per = {id(p): [0.0] * len(cands) for p in probes}  # each probe's worst, in its native noise
        with torch.no_grad():
            for group, args in self._stacked(probes):
                first = next(t for t in args.values() if t is not None)
                kn = {k: (v.to(first.device).reshape(-1, *([1] * first.dim())) if torch.is_tensor(v) else v)
                      for k, v in knobs.items()}
                outs = stacked(self.fam.call(ref_fn, args, kn, lambda k: True))
                at = 0
                for p in group:
                    rows = next(t for t in p.base.values() if t is not None).shape[0]
                    for o, r, noise in zip(p.res.outputs, outs, p.noise if noise_of is None else noise_of(p)):
                        if r.dim() == o.dim():  # an output the batched knob does not change: one fit for all
                            r = r.unsqueeze(0)
                        q, m = batched_errors(o, r.narrow(1, at, rows) if len(group) > 1 else r)
                        if len(q) == 1 < len(cands):
                            q, m = q * len(cands), m * len(cands)
                        if len(q) != len(cands):
                            raise AssertionError(f"{len(q)} fits for {len(cands)} candidates")
                        ratio = [max(a, b / noise) for a, b in zip(ratio, q)]
                        rel = [max(a, b) for a, b in zip(rel, m)]
                        per[id(p)] = [max(a, b / noise) for a, b in zip(per[id(p)], q)]
                    at += rows
        return [Candidate(dict(c), nan_as_inf(q), nan_as_inf(m), stage,
                          per_probe=tuple(nan_as_inf(per[id(p)][i]) for p in probes))
                for i, (c, q, m) in enumerate(zip(cands, ratio, rel))]

    def _stacked(self, probes: list[Probe]) -> list[tuple[list[Probe], dict]]:
        """The probes as (group, its float64 inputs): where the space names a stackable input (its
        leading axis independent problems), probes of one shape are one input along it, so one
        reference call serves them all; otherwise each probe goes alone."""
        key = tuple(id(p) for p in probes)
        name = self.space.stackable
        if key not in self._stacks:
            if name is None or len(self.fam.inputs) != 1:
                self._stacks[key] = [([p], float64_inputs(p.base)) for p in probes]
            else:
                groups: dict = {}
                for p in probes:
                    groups.setdefault(tuple(p.base[name].shape[1:]), []).append(p)
                self._stacks[key] = [(g, {name: torch.cat([float64_inputs(p.base)[name] for p in g])})
                                     for g in groups.values()]
        return self._stacks[key]

    def _known(self, name: str) -> list:
        return [kv for (kk, kn, kv) in KNOWN if kk == self.kernel and kn == name]

    def pick(self, cands: list[Candidate]) -> Candidate:
        """The best fit; among fits within rounding noise of it, the one closest to what was asked."""
        best = min(c.score for c in cands)
        tied = [c for c in cands if c.score <= self._tol(best)]
        return min(tied, key=lambda c: (self._cost(c.knobs), self._canonical(c.knobs), c.score))

    def _canonical(self, knobs: dict) -> tuple:
        """A fixed order among fits alike (within native noise) and as far from the asked: which of
        them the noise favours moves with the probes' seed, so it never decides. Each discrete knob
        by its value's place in the space (the family's order), each continuous one by roundness."""
        preferred = self.preferred()
        out = []
        for k, v in knobs.items():
            values = self.space.discrete.get(k)
            if values is not None:
                out.append(next((i for i, w in enumerate(values) if same_value(w, v)), len(values)))
            elif k in self.space.continuous and isinstance(v, float):
                out.append(roundness(v, [preferred[k], *self._known(k)]) if v else 0)
        return tuple(out)

    def refine(self, probes: list[Probe], cand: Candidate) -> Candidate:
        """Each continuous knob on finer log grids around its value, then snapped to a round value
        (1, 2 or 5 times a power of ten, or a known convention's) that fits as well."""
        cur = cand
        for name in self.space.continuous:
            v = cur.knobs[name]
            if v == 0.0 or v >= 1e9:
                continue
            for half_width in (0.5, 0.05):
                lv = math.log10(cur.knobs[name])
                trial = self._scores(probes, [{**cur.knobs, name: 10 ** (lv + half_width * (i / 10 - 1))}
                                              for i in range(21)], name, "refine")
                cur = min(trial + [cur], key=lambda c: c.score)
            preferred = [self.preferred()[name], *self._known(name)]
            e = math.floor(math.log10(cur.knobs[name]))
            around = preferred + [m * 10.0 ** p for p in (e - 1, e, e + 1) for m in (1, 2, 5)]
            snaps = self._scores(probes, [{**cur.knobs, name: float(a)} for a in dict.fromkeys(around) if a], name,
                                 "snap")
            tol = self._tol(cur.score)
            fits = [s for s in snaps if s.score <= tol]
            if fits:
                cur = min(fits, key=lambda c: (self._cost(c.knobs), roundness(c.knobs[name], preferred), c.score))
        return cur

    def told(self, cand: Candidate, wide: float = 2.0) -> dict:
        """Each continuous knob of ``cand`` whose value the probes tell only within a wide range:
        knob -> (lowest, highest) of the values scored with its other knobs that fit alike (within
        native noise of the best of them), the run of such values around its own. Only ranges
        wider than ``wide`` times (or reaching zero) are kept: a value the probes pin is no range."""
        out = {}
        for name in self.space.continuous:
            v = cand.knobs.get(name)
            if not isinstance(v, float) or v >= 1e9:
                continue
            others = knob_key({k: w for k, w in cand.knobs.items() if k != name})
            scored = sorted({c.knobs[name]: c.score for c in self.tried.values()
                             if isinstance(c.knobs.get(name), float)
                             and knob_key({k: w for k, w in c.knobs.items() if k != name}) == others}.items())
            if not scored:
                continue
            tol = self._tol(min(s for _, s in scored))
            at = min(range(len(scored)), key=lambda i: abs(scored[i][0] - v))
            if not scored[at][1] <= tol:
                continue
            lo = hi = at
            while lo > 0 and scored[lo - 1][1] <= tol:
                lo -= 1
            while hi + 1 < len(scored) and scored[hi + 1][1] <= tol:
                hi += 1
            a, b = scored[lo][0], scored[hi][0]
            if b > 0 and (a == 0 or b / a > wide):
                out[name] = (a, b)
        return out

    def _combos(self, cands: list[Candidate], n: int, key=lambda c: c.score) -> list[Candidate]:
        """The best candidate of each of the ``n`` best-fitting discrete combinations."""
        seen, out = set(), []
        for c in sorted(cands, key=key):
            sig = knob_signature(c.knobs, self.space.discrete)
            if sig not in seen:
                seen.add(sig)
                out.append(c)
            if len(out) >= n:
                break
        return out
