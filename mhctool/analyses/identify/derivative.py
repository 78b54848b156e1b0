"""The backward judged against the kernel's own forward, where no convention fits the forward.

A directional finite-difference test: for a random direction ``v`` of the differentiable inputs,
the upstream gradients ``u`` (the probe's) and a step ``h``, the central difference
``<u, f(x + h v) - f(x - h v)> / 2h`` is what ``<backward(u), v>`` must be, whatever ``f`` computes.
Both sides are scalars, formed in float64 from the kernel's own outputs and gradients. The central
difference is trusted only where it is stable: computed at ``h`` and ``h / 2``, the two must agree
(else the forward is not smooth there, or rounding dominates, and the direction is left out). fp32
inputs only (a bf16 input cannot carry a small step); the step is 1e-3 of each input's root mean
square.

What a direction may differ by is the difference's own error plus a floor: the truncation error
of the finer difference, estimated from the two steps (``|D(h) - D(h/2)| / 3``, the error being of
order ``h^2``), and its rounding (each fp32 output off by half a unit in the last place, divided by
the step), four times over, on top of 1e-2 relative. The floor is far above what a correct backward
shows (a Sinkhorn stand-in whose backward is autograd's agreed to 5e-5) and far below a wrong
formula's (0.68 for one that forgets the normalisations); the margin keeps a rough difference from
calling a right backward wrong.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mhctool.runner.call import output_specs

STEP = 1e-3  # times each input's root mean square
TOLERANCE = 1e-2  # relative, the floor
MARGIN = 4.0  # times the difference's own estimated error, on top of the floor
FP32_HALF_ULP = 2.0 ** -24
DIRECTIONS = 3


@dataclass
class OwnDerivative:
    agrees: bool | None  # None: no direction was smooth enough, or nothing to check
    worst: float  # the relative difference in the direction nearest failing (furthest past, where it fails)
    used: int  # directions where the forward was smooth
    tried: int
    why: str | None = None  # why nothing was checked
    allowed: float = TOLERANCE  # what the worst direction was allowed (the floor plus its own margin)

    def sentence(self) -> str:
        if self.agrees is None:
            return f"its backward could not be checked against its own forward ({self.why})"
        how = (f"directional finite differences of its forward, {self.used} of {self.tried} directions, "
               f"the worst differs by {self.worst:.2g} relative, {self.allowed:.2g} allowed there")
        if self.agrees:
            return f"its backward is the derivative of its own forward ({how})"
        return f"its backward is not the derivative of its own forward ({how})"


def _dot(a: list, b: list) -> float:
    return float(sum((x.double() * y.double()).sum() for x, y in zip(a, b) if x is not None and y is not None))


def own_derivative(subject, probe, seed: int = 0) -> OwnDerivative:
    """``subject``: the identification's Subject (it calls the implementation, isolated where it
    is); ``probe``: a probe it has run, forward and backward."""
    res = probe.res
    if res.grads is None or res.bwd_error or res.bwd_unsupported:
        return OwnDerivative(None, math.nan, 0, 0, "it has no backward here")
    names = [k for k, g in res.grads.items() if g is not None and probe.base.get(k) is not None]
    if not names:
        return OwnDerivative(None, math.nan, 0, 0, "no input has a gradient")
    if any(probe.base[k].dtype != torch.float32 for k in names):
        return OwnDerivative(None, math.nan, 0, 0, "the check needs fp32 inputs: run identify with --dtype fp32")
    knobs, expect = subject._impl_knobs(), output_specs(res.outputs)
    g = torch.Generator().manual_seed(seed + 0xD1FF)
    worst, used, allowed, excess = math.nan, 0, TOLERANCE, -math.inf
    for _ in range(DIRECTIONS):
        v = {k: torch.randn(probe.base[k].shape, generator=g).to(probe.base[k].device) for k in names}
        scale = {k: float(probe.base[k].double().pow(2).mean().sqrt()) or 1.0 for k in names}

        def central(h: float) -> float | None:
            outs = []
            for sign in (1.0, -1.0):
                shifted = dict(probe.base)
                for k in names:
                    shifted[k] = (probe.base[k].double() + sign * h * scale[k] * v[k].double()).float()
                r = subject._call(probe.case, shifted, knobs, probe.upstream, expect)
                if r.fwd_error or r.outputs is None:
                    return None
                outs.append(r.outputs)
            diff = [a.double() - b.double() for a, b in zip(*outs)]
            # the rounding of the fp32 outputs, carried through the dot product and the step
            rounding = sum(float((u.double().abs() * (a.double().abs() + b.double().abs())).sum())
                           for u, a, b in zip(probe.upstream, *outs)) * FP32_HALF_ULP / (2 * h)
            return _dot(probe.upstream, diff) / (2 * h), rounding

        at_h, at_half = central(STEP), central(STEP / 2)
        if at_h is None or at_half is None or not (math.isfinite(at_h[0]) and math.isfinite(at_half[0])):
            continue
        (coarse, _), (fine, rounding) = at_h, at_half
        size = max(abs(coarse), abs(fine), 1e-30)
        if abs(coarse - fine) > TOLERANCE * size / 4:
            continue  # not smooth along this direction at these steps
        analytic = _dot([res.grads[k] for k in names], [scale[k] * v[k] for k in names])
        used += 1
        rel = abs(analytic - fine) / max(abs(fine), abs(analytic), 1e-30)
        ok = TOLERANCE + MARGIN * (abs(coarse - fine) / 3 + rounding) / size
        if rel - ok > excess:  # the direction nearest failing (or furthest past it) is the one said
            excess, allowed, worst = rel - ok, ok, rel
    if not used:
        return OwnDerivative(None, math.nan, 0, DIRECTIONS, "its forward is not smooth along any direction tried")
    return OwnDerivative(excess <= 0, worst, used, DIRECTIONS, allowed=allowed)
