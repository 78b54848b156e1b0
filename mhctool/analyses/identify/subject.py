"""The implementation under identification: its family, the knobs asked for, the candidate space,
the probe shape, the matmul precision its native baseline computes at; one call of it, and a
candidate's reference and native functions. The errors of outputs against many references at
once."""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch

from mhctool.analyses.identify.conclusion import Candidate, Probe
from mhctool.analyses.identify.space import checked_knobs, space
from mhctool.analyses.parity import check_precision
from mhctool.core.errors import UsageError
from mhctool.core.shapes import parse_shape_for
from mhctool.core.verdict import VerdictRule
from mhctool.families import MATMUL_KERNELS, Family, get_family
from mhctool.registry.impl import Impl
from mhctool.runner.call import native_at, run_impl
from mhctool.runner.case import Case, ImplResult


class Subject:
    """The implementation, what it is asked for and where it runs: what the probing, the fitting
    and the judging share (:class:`mhctool.analyses.identify.Identifier` is all three)."""

    def __init__(self, kernel: str, impl: Impl, *, dtype: str = "fp32", device: str = "cpu",
                 shape: str | None = None, asked: dict | None = None, seed: int = 0,
                 rule: VerdictRule | None = None, isolation=None, judge_top: int = 3,
                 matmul_precision: str | None = None, progress: Callable[[str], None] | None = None):
        self.fam: Family = get_family(kernel)
        # progress(stage): what the identification does now (a command shows it while it waits)
        self.progress = progress or (lambda stage: None)
        self.kernel, self.impl, self.dtype, self.device = kernel, impl, dtype, device
        # what an adapter declares its function computes is what parity judges it under: the
        # convention it is asked for, unless the caller names another
        asked = checked_knobs(kernel, {**{k: v for k, v in impl.conventions.items() if k in self.fam.knobs},
                                       **(asked or {})})
        self.space = space(kernel, {**{k: kn.default for k, kn in self.fam.knobs.items()}, **asked})
        # an optional input the function has no parameter for (a bias-less h_post_bda) is no
        # question to ask: probed without it (family_knobs below)
        missing = impl.missing_inputs()
        if missing:
            self.space = dataclasses.replace(
                self.space, discrete={k: v for k, v in self.space.discrete.items() if k not in missing},
                variants={k: v for k, v in self.space.variants.items() if k not in missing})
        self.asked = {k: asked.get(k, self._default(k)) for k in self._names()}
        self.shape = parse_shape_for(self.fam.shape_kind, shape or self.space.shape)
        if impl.limit and (why := impl.limit(self.shape)):
            raise UsageError(f"--impl {impl.name} cannot run the probe shape {self.shape}: {why}")
        self.declared_precision = impl.precision_on(device)
        # the precision is fitted where a product's precision can show: fp32 operands of a matmul kernel
        self.fits_precision = matmul_precision is None and kernel in MATMUL_KERNELS and dtype == "fp32"
        self.seed, self.rule, self.isolation, self.judge_top = seed, rule or VerdictRule(), isolation, judge_top
        # the native baseline starts at the precision asked for, else the one the implementation
        # declares (an adapter's); ``run`` fits it, forward and backward, unless it was asked for
        self.precision = matmul_precision or impl.precision_on(device)
        self.precision_bwd = self.precision  # the backward's (fitted apart from the forward's where they differ)
        check_precision(self.precision, "--matmul-precision")
        self.tried: dict[str, Candidate] = {}
        # continuous knobs held at one value in the grids for now (Space.hold_later)
        self.held: dict = {}
        self.family_knobs = {k: v for k, v in asked.items() if k not in self._names()}  # e.g. interleave
        self.family_knobs.update({k: False for k in missing})
        self.guards: list[Probe] = []  # the space's guard probes, run by probes()
        self._stacks: dict = {}  # probes -> their float64 inputs, stacked where the kernel allows
        self._noises: dict = {}  # (probe, matmul precision) -> its native noise there (Probing.noise_in)
        self.overflow: list = []  # Identification.overflow
        self.saturated: list = []  # Identification.saturated
        self.failed: tuple | None = None  # the probe that failed: (direction, error, input family)
        # the first probe in which it ended its isolation worker (a crash, an exit, a hang, a CUDA
        # fault): (direction, error, input family)
        self.ended: tuple | None = None
        self.returned: dict = {}  # output -> the dtype it came back in, where not the contract's (any probe)
        self.without: dict = {}  # an optional input it raised on when given: name -> what it raised
        self.ignored: dict = {}  # Identification.ignored

    def drop_inputs(self, names: list[str]) -> None:
        """Probe without these optional inputs from here on (a function that has a parameter for
        one but raised when given it): as for a function without the parameter."""
        self.space = dataclasses.replace(
            self.space, discrete={k: v for k, v in self.space.discrete.items() if k not in names},
            variants={k: v for k, v in self.space.variants.items() if k not in names})
        self.asked = {k: v for k, v in self.asked.items() if k not in names}
        self.family_knobs.update({k: False for k in names})
        self._stacks, self.failed, self.ended, self.tried = {}, None, None, {}

    def _names(self) -> list[str]:
        """The knobs fitted: the space's discrete and continuous ones, and those that mean something
        under one value of another (a clamped exponential's bound)."""
        return [*self.space.discrete, *self.space.continuous, *self.space.depends, *self.space.backward]

    def _default(self, name: str):
        if name in self.space.variants:
            return self.space.variants[name].values[0]
        return self.fam.knobs[name].default

    def follows(self, name: str) -> bool:
        """Whether the implementation is given knob ``name`` and its outputs follow it: a family
        knob passed to functions, one it takes, and not one it was found to ignore."""
        knob = self.fam.knobs.get(name)
        return (name not in self.space.variants and knob is not None and knob.passed and self.impl.accepts(name)
                and name not in self.ignored)

    def preferred(self) -> dict:
        """The value of each fitted knob that a tie goes to: the asked one where the implementation
        follows the knob (what it was given is what it computes), else the family's default. What is
        asked of a knob the implementation never sees changes what is called a convention, never
        what it is found to compute."""
        return {k: (v if self.follows(k) else self._default(k)) for k, v in self.asked.items()}

    def defaults(self) -> dict:
        """The fitted knobs at the family's defaults: the native noise the fit is measured in."""
        return {k: self._default(k) for k in self.asked}

    def _impl_knobs(self) -> dict:
        """The knobs the implementation is called with: the asked ones (variants are no knobs)."""
        return {**{k: v for k, v in self.asked.items() if k not in self.space.variants}, **self.family_knobs}

    def _call(self, case: Case, base: dict, knobs: dict, upstream: list, expect: list) -> ImplResult:
        """The implementation under test on one probe's inputs (in its worker, where isolated)."""
        if self.isolation is not None and self.impl.backend == "external":
            return self.isolation.run(case, self.impl, base, knobs, upstream, expect)
        return run_impl(self.fam, self.impl, base, knobs, lambda outs: upstream, expect=expect)

    def _split(self, cand: dict, precision: str | None = None) -> tuple[dict, Callable, Callable]:
        """A candidate's family knobs and its reference and native functions (the native one at
        ``precision``, else at the precision the forward is judged at)."""
        # the native baseline at the matmul precision the implementation computes at by design
        ref_fn, nat_fn = self.fam.reference, native_at(self.kernel, precision or self.precision).fn
        knobs = {k: v for k, v in self.family_knobs.items() if k not in self.space.how}
        for k, v in cand.items():
            if k in self.space.variants:
                ref_fn = self.space.variants[k].wrap(ref_fn, v)
                nat_fn = self.space.variants[k].wrap(nat_fn, v)
            else:
                knobs[k] = v
        return knobs, ref_fn, nat_fn


def float64_inputs(base: dict) -> dict:
    return {k: (None if t is None else t.double() if t.is_floating_point() else t) for k, t in base.items()}


def in_noise(outputs, refs, noise) -> float:
    """The worst of ``outputs``' normalised errors against ``refs`` (one reference each), each in
    its own unit of native noise."""
    return max((nan_as_inf(batched_errors(o, r.unsqueeze(0))[0][0]) / max(n, 1e-30)
                for o, r, n in zip(outputs, refs, noise)), default=0.0)


def batched_errors(out: torch.Tensor, refs: torch.Tensor) -> tuple[list[float], list[float]]:
    """The normalised max error (max |out - ref| / max |ref|) and ``metrics.max_rel`` of ``out``
    against each ``refs[i]`` at once; inf where a reference is non-finite and the output is not,
    or the output is non-finite where the reference is finite."""
    o = out.detach().double()
    flat = refs.flatten(1)
    d = (o.expand_as(refs).flatten(1) - flat).abs_()
    dmax = d.amax(1)  # NaN and inf carry into the max
    if bool(torch.isfinite(dmax).all()):  # the usual case: every value finite, no masks
        mag = flat.abs()
        amax = mag.amax(1)
        norm = torch.where(amax > 0, dmax / amax.clamp_min(1e-300), dmax)
        rel = d.div_(mag.clamp_min(1e-300)).masked_fill_(mag <= (amax * 1e-6)[:, None], 0.0).amax(1)
        return norm.tolist(), rel.tolist()
    o = o.expand_as(refs)
    fin = torch.isfinite(refs)
    breaks = (~fin & torch.isfinite(o)).flatten(1).any(1)
    d = torch.where(fin, (o - refs).abs(), 0.0)
    d = torch.where(fin & ~torch.isfinite(o), math.inf, d)
    mag = torch.where(fin, refs.abs(), 0.0)
    amax = mag.flatten(1).amax(1)
    dmax = d.flatten(1).amax(1)
    norm = torch.where(amax > 0, dmax / amax.clamp_min(1e-300), dmax)
    big = mag > (amax * 1e-6).reshape(-1, *([1] * out.dim()))
    rel = torch.where(big, d / mag.clamp_min(1e-300), 0.0).flatten(1).amax(1)
    norm = torch.where(breaks, math.inf, norm)
    rel = torch.where(breaks, math.inf, rel)
    return norm.tolist(), rel.tolist()


def nan_as_inf(v: float) -> float:
    return math.inf if math.isnan(v) else v
