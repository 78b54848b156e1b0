"""``mhctool identify``: which convention does an implementation compute?

An implementation runs once per probe (input families chosen so the candidate conventions give
visibly different results: dead rows and columns make eps visible, a slowly converging matrix
separates iteration counts and orders, tiny norms separate eps placements, asymmetric mixing
matrices separate H from H^T). Its outputs are then compared with the float64 reference under
every candidate convention: the discrete knobs exhaustively, the continuous ones on a coarse grid,
then refined and snapped to a round value where the fit is as good. The best candidates are judged
by mhctool's verdict rule, forward and backward (the native implementation under the same
convention sets the threshold), so a match is a pass, and a kernel that no convention fits is a
defect.

The implementation is always called with the knobs asked for (``--knob``, else the family's
defaults); only the reference and the native baseline change with the candidate. A knob whose
asked value does not change its outputs (a function that takes no iteration count, or takes one
and runs its own) is said to be ignored, and its value is fitted over its whole range like any
other.

Some probes are guards (Sinkhorn's large logits): never fitted, but judged. An implementation that
returns non-finite values there, where the float64 contract is finite, fits no convention,
whatever its finite outputs match: an overflow is never a convention. A candidate whose native
baseline overflows on a guard where the implementation stays finite is not what it computes.
"""
from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from mhctool.core import inputs as inputs_mod
from mhctool.core import names
from mhctool.runner.baseline import judged_rows, make_baseline
from mhctool.runner.call import cast_inputs, native_at, output_specs, run_impl, upstream_for
from mhctool.core.dtypes import FORMATS
from mhctool.core.errors import UsageError
from mhctool.core.metrics import max_rel, nonfinite
from mhctool.registry.families import Family, get_family
from mhctool.registry.impl import Impl
from mhctool.registry.builtin import native_impl
from mhctool.runner.case import Case, ImplResult
from mhctool.core.shapes import parse_shape_for
from mhctool.core.verdict import VerdictRule

FP32_EPS = float(torch.finfo(torch.float32).eps)
# eps: zero, then 1e-12 .. 1e-3 by half decades
EPS_GRID = (0.0,) + tuple(10.0 ** (e / 2) for e in range(-24, -5))
# Sinkhorn's iteration counts: 1 to 64 (a kernel may fix any of them), and around the asked value
ITERS_MAX = 64
LIMIT_GRID = (1.0, 2.0, 3.0, 5.0, 7.0, 10.0, 20.0, 1e9)


def _drop_bias(fn: Callable, keep: bool) -> Callable:
    if keep:
        return fn

    def no_bias(h_res, x, h_post, y, bias=None, transpose_res=False, matmul_precision="ieee"):
        kw = {"matmul_precision": matmul_precision} if matmul_precision != "ieee" else {}
        out = fn(h_res, x, h_post, y, None, transpose_res=transpose_res, **kw)
        # the bias still gets a (zero) gradient, as from a kernel that takes it and ignores it
        return out if bias is None else out + (0.0 * bias.sum()).to(out.dtype)
    return no_bias


def _scale_at(fn: Callable, where: str) -> Callable:
    if where == "output":
        return fn

    def scaled_input(x, scale=None, **kw):
        if scale is not None:
            x = (x * scale.unsqueeze(-1)).to(x.dtype)
        return fn(x, None, **kw)
    return scaled_input


@dataclass(frozen=True)
class Variant:
    """A candidate knob that no family knob expresses: how a value rewrites a function of the
    family's signature (the reference and the native baseline alike)."""

    values: tuple
    wrap: Callable[[Callable, object], Callable]


@dataclass(frozen=True)
class Space:
    probes: tuple[str, ...]  # input families
    shape: str  # default probe shape
    discrete: dict = field(default_factory=dict)  # knob -> values tried exhaustively
    continuous: dict = field(default_factory=dict)  # knob -> coarse grid, then refined
    variants: dict = field(default_factory=dict)  # knob -> Variant
    # a continuous knob the reference takes as a tensor along a new leading axis, so its whole grid
    # is one reference call (the reference is reused where only that knob changes)
    batched: str | None = None
    # a discrete knob whose values share a prefix of the computation (Sinkhorn's iteration count):
    # the reference takes the increasing values as a tuple and stacks its outputs along a leading
    # axis in front of the batched knob's, so the values of both are one reference call
    prefix: str | None = None
    # the input whose leading axis holds independent problems (Sinkhorn's matrices): probes of one
    # shape go to the reference as one input along it, one call for all of them
    stackable: str | None = None
    # knobs that change no float64 value but the native baseline (how a kernel computes), tried when
    # a candidate fails the verdict: candidate knobs -> {knob: value} to judge it again with, or None
    judge_also: Callable[[dict], dict | None] = lambda knobs: None
    # input families run and judged but never fitted: where an overflow shows (a non-finite output
    # fits nothing, so fitting on it would blur every candidate's score)
    guards: tuple[str, ...] = ()


def _clamped_swiglu_at(fn: Callable, where: str) -> Callable:
    """Where clamped SwiGLU's limit applies: ``both`` (the contract: the gate from above, the
    linear half both ways), ``gate`` only, ``linear`` only, ``none``."""
    if where == "both":
        return fn
    from mhctool.references.moe import split_glu

    def variant(x, scale=None, interleave=0, limit=7.0, alpha=1.702, offset=1.0):
        xf = x if x.dtype == torch.float64 else x.float()
        a, b = split_glu(xf, interleave)
        if where == "gate":
            a = a.clamp(max=limit)
        elif where == "linear":
            b = b.clamp(-limit, limit)
        f = a * torch.sigmoid(alpha * a) * (b + offset)
        if scale is not None:
            f = f * scale.unsqueeze(-1)
        return f.to(x.dtype)
    return variant


def space(kernel: str, asked: dict) -> Space:
    """What identification tries for ``kernel``; ``iters`` around the asked value."""
    from mhctool.references import mhc as ref
    if kernel == "sinkhorn":
        it = int(asked.get("iters", 20))
        return Space(("random", "eps_sweep", "dead_rows_cols", "near_perm"), "16x4x4x1",
                     {"stabilize": ref.STABILIZE, "eps_mode": ref.EPS_MODES, "order": ref.ORDERS,
                      "iters": tuple(range(1, max(ITERS_MAX, it + 3) + 1))},
                     {"eps": EPS_GRID}, batched="eps", prefix="iters",
                     # without eps, as in the log domain: its rounding is the log-domain baseline's
                     judge_also=lambda knobs: {"domain": "log"} if knobs.get("eps") == 0.0 else None,
                     guards=("large_logits",), stackable="logits")
    if kernel == "h_post_bda":
        return Space(("random",), "4x3x4x67", {"transpose_res": (False, True), "bias": (True, False)},
                     variants={"bias": Variant((True, False), _drop_bias)})
    if kernel == "proj_rms":
        return Space(("random", "tiny_norm"), "4x3x4x67", {"rms_eps": ref.RMS_EPS}, {"eps": EPS_GRID})
    if kernel == "mapping":
        return Space(("random", "tiny_norm"), "4x3x4x67", {"rms_eps": ref.RMS_EPS},
                     {"eps": EPS_GRID, "compute_h_eps": EPS_GRID})
    if kernel in ("mapping_sinkhorn", "mix_aggregate"):
        # the mapping's knobs and Sinkhorn's at once: the discrete ones exhaustively, the mapping's
        # eps on the grid, Sinkhorn's eps batched, compute_h's eps at the values libraries use
        return Space(("random", "tiny_norm"), "4x3x4x67",
                     {"rms_eps": ref.RMS_EPS, "stabilize": ref.STABILIZE, "order": ref.ORDERS},
                     {"eps": EPS_GRID, "compute_h_eps": (0.0, 1e-8, 1e-6, 1e-4), "sinkhorn_eps": EPS_GRID},
                     batched="sinkhorn_eps",
                     judge_also=lambda knobs: {"domain": "log"} if knobs.get("sinkhorn_eps") == 0.0 else None)
    if kernel == "h_aggregate":
        return Space(("random",), "4x3x4x67")
    if kernel == "swiglu":
        return Space(("random",), "37x1x96x1", {"scale_at": ("output", "input")},
                     variants={"scale_at": Variant(("output", "input"), _scale_at)})
    if kernel == "clamped_swiglu":
        return Space(("random",), "37x1x96x1",
                     {"scale_at": ("output", "input"), "clamp_at": ("both", "gate", "linear", "none")},
                     {"limit": LIMIT_GRID},
                     variants={"scale_at": Variant(("output", "input"), _scale_at),
                               "clamp_at": Variant(("both", "gate", "linear", "none"), _clamped_swiglu_at)})
    raise AssertionError(kernel)  # check_kernel first


IDENTIFIABLE = names.IDENTIFIABLE


def checked_knobs(kernel: str, values: dict, from_text: bool = False) -> dict:
    """The knob values an implementation is asked for, each checked (``from_text``: typed from
    ``--knob`` strings first); a name that is no knob of the kernel is a UsageError."""
    from mhctool.analyses.knob_shift import typed_value
    fam = get_family(kernel)
    out = {}
    for name, v in values.items():
        if name not in fam.knobs:
            raise UsageError(f"knob {name} is no knob of {kernel}; accepted: " + (", ".join(fam.knobs) or "none"))
        knob = fam.knobs[name]
        out[name] = knob.check(kernel, name, typed_value(knob.kind, name, v) if from_text else v)
    return out


def check_kernel(kernel: str) -> str:
    """``kernel`` when identify knows its conventions; an unknown kernel or another one is a UsageError."""
    get_family(kernel)
    if kernel not in IDENTIFIABLE:
        raise UsageError(f"mhctool identify knows no conventions of {kernel}; it identifies " + ", ".join(IDENTIFIABLE))
    return kernel

# conventions real libraries use: (kernel, knob, value) -> who
KNOWN = {
    ("sinkhorn", "stabilize", "softmax"): "as in Megatron-LM's dev branch (a row softmax plus eps first)",
    ("sinkhorn", "stabilize", "colmax"): "max subtraction along the axis normalised first (x - x.amax(dim=-2) with "
                                         "columns first, a common PyTorch form)",
    ("sinkhorn", "eps", 0.0): "as in TransformerEngine (log-domain iterations, no eps)",
    ("sinkhorn", "domain", "log"): "as in TransformerEngine (judged against the log-domain native baseline)",
    ("h_post_bda", "transpose_res", True): "as in Megatron-LM's dev branch and TransformerEngine (H_res^T)",
    ("proj_rms", "rms_eps", "inside"): "as in TransformerEngine and RMSNorm (eps inside the square root)",
    ("proj_rms", "eps", FP32_EPS): "as in TransformerEngine (eps = fp32 machine epsilon)",
    ("mapping", "rms_eps", "inside"): "as in TransformerEngine and RMSNorm (eps inside the square root)",
    ("mapping", "eps", FP32_EPS): "as in TransformerEngine (eps = fp32 machine epsilon)",
    ("mapping", "compute_h_eps", 1e-6): "as in Megatron-LM's dev branch (sigmoid + 1e-6)",
}
for _k in ("mapping_sinkhorn", "mix_aggregate"):  # the composites: the mapping's and Sinkhorn's conventions
    KNOWN.update({
        (_k, "rms_eps", "inside"): "as in TransformerEngine and Liger-Kernel (eps inside the square root)",
        (_k, "eps", FP32_EPS): "as in TransformerEngine (eps = fp32 machine epsilon)",
        (_k, "compute_h_eps", 1e-6): "as in Megatron-LM's dev branch (sigmoid + 1e-6)",
        (_k, "stabilize", "softmax"): "as in Liger-Kernel and Megatron-LM's dev branch (a row softmax plus eps first)",
        (_k, "stabilize", "colmax"): KNOWN[("sinkhorn", "stabilize", "colmax")],
        (_k, "sinkhorn_eps", 0.0): "as in TransformerEngine (log-domain iterations, no eps)",
        (_k, "domain", "log"): "as in TransformerEngine (judged against the log-domain native baseline)",
    })
# how loose a precision's baseline is (parity judges a kernel whose forward and backward differ at the looser)
LOOSENESS = {"ieee": 0, "tf32": 1, "tf32_trunc": 1, "bf16": 2}
# what a matrix product at each precision is (the hint names it; ieee is the contract)
PRECISION_NOTES = {
    "ieee": "multiplies at IEEE fp32",
    "tf32": "multiplies at TF32 rounded to nearest (cuBLAS, PyTorch's allow_tf32)",
    "tf32_trunc": ("multiplies at TF32 with truncated operands: Triton's default for tl.dot on fp32 "
                   "(or build it with input_precision='ieee')"),
    "bf16": "multiplies bf16 operands (fp32 values rounded to bf16 before the product)",
}
# knobs where a value other than the one asked for is no library's convention
DEFECT_KNOBS = {"iters", "eps", "compute_h_eps", "limit", "bias", "scale_at", "sinkhorn_eps"}
# values that would be a defect if the implementation's own outputs show it: (kernel, knob, value)
# -> (the defect, the probe family that shows it); without that evidence the fit is a tie, not a claim
SUSPICIOUS_VALUES = {("sinkhorn", "stabilize", "none"): ("no max subtraction: exp overflows for large logits",
                                                        "large_logits")}


def _same(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        a, b = float(a), float(b)
        return a == b or (a != 0 and b != 0 and abs(a - b) <= 1e-3 * max(abs(a), abs(b)))
    return a == b


def fmt_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return "inf" if v >= 1e9 else f"{v:g}"
    return str(v)


def _signature(knobs: dict, names) -> tuple:
    """A candidate's values of the knobs ``names`` (its discrete combination)."""
    return tuple(fmt_value(knobs[k]) for k in names)


def fmt_knobs(knobs: dict) -> str:
    return " ".join(f"{k}={fmt_value(v)}" for k, v in knobs.items())


def classify(kernel: str, fitted: dict, asked: dict, evidence: dict | None = None,
             ignored: dict | None = None, shown_only: bool = False) -> tuple[str, str]:
    """(``as asked`` | ``known convention`` | ``variant`` | ``likely a defect``, the sentence).

    ``evidence``: knob -> (shown, what was measured), from :meth:`Identifier.evidence` on the
    implementation's own outputs. A value that would be a defect is called one only where its
    evidence shows it; without evidence (the unit's own use) the sentence says it is unconfirmed.
    ``ignored``: knob -> how (``takes no`` / ``ignores``): the implementation runs its own value
    whatever it is asked, which the sentence says first. ``shown_only``: only the claims that
    evidence shows (a candidate that fails its own judging explains nothing else). In the log
    domain nothing is exponentiated raw, so no stabilisation is claimed at all."""
    ignored = ignored or {}
    diff = {k: v for k, v in fitted.items() if not _same(v, asked.get(k))}
    if fitted.get("domain") == "log" and "stabilize" in diff:
        del diff["stabilize"]  # a log-domain iteration never exponentiates the raw logits
    fixed = [f"ignores {k}: runs {fmt_value(fitted[k])} whatever it is asked, which is what was asked"
             + _param_note(k, ignored[k]) for k in fitted if k in ignored and k not in diff]
    if not diff:
        return "as asked", "; ".join(["computes what it was asked for", *fixed])
    notes, level = [], 0
    for k, v in diff.items():
        known = next((who for (kk, kn, kv), who in KNOWN.items() if kk == kernel and kn == k and _same(kv, v)), None)
        odd = SUSPICIOUS_VALUES.get((kernel, k, v))
        shown, measured = (evidence or {}).get(k, (None, None))
        own = (f"ignores {k}: runs {fmt_value(v)} whatever it is asked (asked for {fmt_value(asked.get(k))}"
               f"{_param_note(k, ignored[k])})") if k in ignored else None
        if shown_only and not (odd and shown):
            continue
        if known:
            notes.append(f"{own}: a known convention, {known}" if own else f"{k}={fmt_value(v)}: a known convention, {known}")
        elif (odd or k in DEFECT_KNOBS) and shown is False:
            level = max(level, 1)
            notes.append(f"{own}; no difference shows on its outputs: {measured}" if own
                         else f"{k}={fmt_value(v)} fits, but no defect is shown: {measured}")
        elif odd or k in DEFECT_KNOBS:
            level = 2
            what = f" ({odd[0]})" if odd else ""
            head = own or f"matches with {k}={fmt_value(v)} — asked for {fmt_value(asked.get(k))}"
            notes.append(f"{head}: likely a defect{what}"
                         + (f"; shown: {measured}" if shown else "; not yet shown on its outputs"))
        else:
            level = max(level, 1)
            notes.append(f"{own}: a variant no library mhctool knows uses (check it is intended)" if own
                         else f"{k}={fmt_value(v)}: a variant no library mhctool knows uses (check it is intended)")
    return ("known convention", "variant", "likely a defect")[level], "; ".join(notes + fixed)


def _param_note(knob: str, how: str) -> str:
    return f"; it takes no {knob} parameter" if how == "takes no" else ""


@dataclass
class Probe:
    case: Case
    base: dict
    upstream: list
    res: ImplResult
    noise: list  # per output: the native implementation's error at the asked knobs (normalised max abs)
    refs: list = field(default_factory=list)  # the float64 reference's outputs at the asked knobs


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
    # judged candidates: its native baseline is non-finite on a guard where the implementation is
    # (it explains an overflow, which is still no convention)
    overflows: bool | None = None

    @property
    def key(self) -> tuple:
        return _key(self.knobs)


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

    @property
    def asked_all(self) -> dict:
        """Everything it was asked for: the searched knobs' asked values and the held ones."""
        return {**self.asked, **self.fixed}

    def shown(self, top: int) -> list[Candidate]:
        """The judged candidates, then the best fit of each other discrete combination (``top`` in all)."""
        judged = [c for c in self.candidates if c.stage == "judged"]
        seen = {_signature(c.knobs, self.discrete) for c in judged}
        rest = []
        for c in self.candidates:
            sig = _signature(c.knobs, self.discrete)
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

    def line(self) -> str:
        if self.error:
            return f"no convention fits: the implementation failed: {self.error}"
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
            return (f"forward matches {self._knobs()}; the backward is not the derivative of that forward"
                    + (f" ({b.worst})" if b.worst else ""))
        return (f"no convention fits: closest {self._knobs()}, error {b.max_rel:.2g}"
                + (f"; the forward is off first: {b.worst}" if b.worst else ""))

    def precision_note(self) -> str | None:
        """What the fitted matmul precision is, where it is not what the implementation declares."""
        if self.split_precision:
            return (f"the forward {PRECISION_NOTES[self.precision]}; the backward "
                    f"{PRECISION_NOTES[self.precision_bwd]}; parity takes one "
                    f"precision for both: judge it at {self.judged_precision()}, the looser")
        if self.precision == self.declared_precision:
            return None
        return f"matmul_precision={self.precision}: {PRECISION_NOTES[self.precision]}"

    def flags(self) -> str:
        """The ``parity`` options that judge it as identified (conventions, then the precision)."""
        out = [f"--convention {k}={fmt_value(v)}" for k, v in self.conventions().items()]
        if self.judged_precision() != self.declared_precision:
            out.append(f"--matmul-precision {self.judged_precision()}")
        return " ".join(out)

    def conventions(self) -> dict:
        """The fitted knobs that ``--convention`` can declare and that differ from the asked ones.
        Not a knob the implementation takes and follows (a declared value is passed to it, so it
        would compute something else again): those are what it was asked for, or a defect."""
        fam = get_family(self.kernel)
        return {k: v for k, v in (self.best.knobs if self.best else {}).items()
                if k in fam.conventions and not _same(v, self.asked.get(k))
                and (k in self.ignored or not (fam.knobs[k].passed and self.impl.accepts(k)))}


class Identifier:
    """Fits the convention knobs of one implementation; see the module docstring."""

    def __init__(self, kernel: str, impl: Impl, *, dtype: str = "fp32", device: str = "cpu",
                 shape: str | None = None, asked: dict | None = None, seed: int = 0,
                 rule: VerdictRule | None = None, isolation=None, judge_top: int = 3,
                 matmul_precision: str | None = None):
        self.fam: Family = get_family(kernel)
        self.kernel, self.impl, self.dtype, self.device = kernel, impl, dtype, device
        # what an adapter declares its function computes is what parity judges it under: the
        # convention it is asked for, unless the caller names another
        asked = checked_knobs(kernel, {**{k: v for k, v in impl.conventions.items() if k in self.fam.knobs},
                                       **(asked or {})})
        self.space = space(kernel, {**{k: kn.default for k, kn in self.fam.knobs.items()}, **asked})
        self.asked = {k: asked.get(k, self._default(k)) for k in self._names()}
        self.shape = parse_shape_for(self.fam.shape_kind, shape or self.space.shape)
        if impl.limit and (why := impl.limit(self.shape)):
            raise UsageError(f"--impl {impl.name} cannot run the probe shape {self.shape}: {why}")
        from mhctool.registry.families import MATMUL_KERNELS
        self.declared_precision = impl.precision_on(device)
        # the precision is fitted where a product's precision can show: fp32 operands of a matmul kernel
        self.fits_precision = matmul_precision is None and kernel in MATMUL_KERNELS and dtype == "fp32"
        self.seed, self.rule, self.isolation, self.judge_top = seed, rule or VerdictRule(), isolation, judge_top
        # the native baseline starts at the precision asked for, else the one the implementation
        # declares (an adapter's); ``run`` fits it, forward and backward, unless it was asked for
        self.precision = matmul_precision or impl.precision_on(device)
        self.precision_bwd = self.precision  # the backward's (fitted apart from the forward's where they differ)
        from mhctool.analyses.parity import check_precision
        check_precision(self.precision, "--matmul-precision")
        self.tried: dict[str, Candidate] = {}
        self.family_knobs = {k: v for k, v in asked.items() if k not in self._names()}  # e.g. interleave
        self.guards: list[Probe] = []  # the space's guard probes, run by probes()
        self._stacks: dict = {}  # probes -> their float64 inputs, stacked where the kernel allows
        self.overflow: list = []  # Identification.overflow
        self.ignored: dict = {}  # Identification.ignored

    def _names(self) -> list[str]:
        return [*self.space.discrete, *self.space.continuous]

    def _default(self, name: str):
        if name in self.space.variants:
            return self.space.variants[name].values[0]
        return self.fam.knobs[name].default

    # --- the implementation, once per probe ---------------------------------------------------

    def _impl_knobs(self) -> dict:
        """The knobs the implementation is called with: the asked ones (variants are no knobs)."""
        return {**{k: v for k, v in self.asked.items() if k not in self.space.variants}, **self.family_knobs}

    def _call(self, case: Case, base: dict, knobs: dict, upstream: list, expect: list) -> ImplResult:
        """The implementation under test on one probe's inputs (in its worker, where isolated)."""
        if self.isolation is not None and self.impl.backend == "external":
            return self.isolation.run(case, self.impl, base, knobs, upstream, expect)
        return run_impl(self.fam, self.impl, base, knobs, lambda outs: upstream, expect=expect)

    def _run_on(self, fam_name: str):
        """The native implementation and the one under test on one input family, at the asked knobs:
        (case, shape, base inputs, native result, upstream gradients, its result)."""
        knobs = self._impl_knobs()
        case = Case(self.kernel, fam_name, self.dtype, self.shape, tuple(sorted(knobs.items())), self.seed,
                    self.device, "identify")
        shape, raw = inputs_mod.generate(self.kernel, fam_name, self.shape, self.seed, knobs, draw_on=self.device)
        base = cast_inputs(self.fam, raw, self.dtype, self.device)
        nat = run_impl(self.fam, native_at(self.kernel, self.precision), base, knobs,
                              lambda outs: upstream_for(self.fam, outs, self.seed))
        if nat.fwd_error:
            raise RuntimeError(f"the native {self.kernel} failed on {fam_name}: {nat.fwd_error}")
        upstream, expect = upstream_for(self.fam, nat.outputs, self.seed), output_specs(nat.outputs)
        return case, shape, base, nat, upstream, self._call(case, base, knobs, upstream, expect)

    def _probe(self, fam_name: str) -> tuple[Probe | None, str | None]:
        case, shape, base, nat, upstream, res = self._run_on(fam_name)
        if res.fwd_error:
            return None, f"{res.fwd_error} (probe {fam_name})"
        with torch.no_grad():
            refs = self.fam.call(self.fam.reference, _float64(base), self._split(self.asked)[0], lambda k: True)
        floor = 2 * FORMATS[self.dtype].unit_roundoff
        noise = [max(_batched_errors(o, r.unsqueeze(0))[0][0], floor) for o, r in zip(nat.outputs, refs)]
        return Probe(replace(case, shape=shape), base, upstream, res, noise, list(refs)), None

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
        self.ignored = self._ignored(out)
        return out, None

    def _overflow(self) -> list:
        """Per guard where the implementation returned non-finite values that the float64 contract
        (what it was asked for) does not have: (family, its description, how many, of how many)."""
        out = []
        for p in self.guards:
            bad = sum(int(nonfinite(o, r)) for o, r in zip(p.res.outputs, p.refs))
            if bad:
                total = sum(int(torch.isfinite(r).sum()) for r in p.refs)
                out.append((p.case.family, inputs_mod.get_family(self.kernel, p.case.family).doc, bad, total))
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
            if k in self.space.variants or knob is None or not knob.passed or knob.kind not in (int, float):
                continue
            if not self.impl.accepts(k):
                out[k] = "takes no"
                continue
            alt = _far_from(knob.kind, self.asked[k])
            same = True
            for p in probes:
                res = self._call(p.case, p.base, {**knobs, k: alt}, p.upstream, output_specs(p.res.outputs))
                if res.fwd_error or not all(torch.equal(a, b) for a, b in zip(res.outputs, p.res.outputs)):
                    same = False
                    break
            if same:
                out[k] = "ignores"
        return out

    # --- candidates ---------------------------------------------------------------------------

    def _split(self, cand: dict, precision: str | None = None) -> tuple[dict, Callable, Callable]:
        """A candidate's family knobs and its reference and native functions (the native one at
        ``precision``, else at the precision the forward is judged at)."""
        # the native baseline at the matmul precision the implementation computes at by design
        ref_fn, nat_fn = self.fam.reference, native_at(self.kernel, precision or self.precision).fn
        knobs = dict(self.family_knobs)
        for k, v in cand.items():
            if k in self.space.variants:
                ref_fn = self.space.variants[k].wrap(ref_fn, v)
                nat_fn = self.space.variants[k].wrap(nat_fn, v)
            else:
                knobs[k] = v
        return knobs, ref_fn, nat_fn

    def score(self, probes: list[Probe], cand: dict, stage: str) -> Candidate:
        """The candidate's fit (cached): its reference on every probe against the implementation's outputs."""
        key = _key(cand)
        if key not in self.tried:
            knobs, ref_fn, _ = self._split(cand)
            self.tried[key] = self._fit(probes, [cand], knobs, ref_fn, lambda outs: [o.unsqueeze(0) for o in outs], stage)[0]
        return self.tried[key]

    def _scores(self, probes: list[Probe], cands: list[dict], name: str, stage: str) -> list[Candidate]:
        """:meth:`score` of candidates that differ only in the continuous knob ``name``: those not
        yet scored in one reference call per probe where the space batches that knob."""
        if name != self.space.batched:
            return [self.score(probes, c, stage) for c in cands]
        new = [c for c in {_key(c): c for c in cands}.values() if _key(c) not in self.tried]
        if new:
            for c in self.score_batch(probes, new, name):
                self.tried[c.key] = replace(c, stage=stage)
        return [self.tried[_key(c)] for c in cands]

    def _tol(self, best: float) -> float:
        """Scores within this of the best are the same fit (one unit of native rounding noise)."""
        return 1.25 * best + 1.0

    def _cost(self, cand: dict) -> float:
        level = classify(self.kernel, cand, self.asked)[0]
        return {"as asked": 0, "known convention": 1, "variant": 2, "likely a defect": 3}[level] + \
            0.01 * sum(not _same(v, self.asked[k]) for k, v in cand.items())

    def grid(self, probes: list[Probe]) -> list[Candidate]:
        names = list(self.space.discrete) + list(self.space.continuous)
        values = [self.space.discrete[k] for k in self.space.discrete] + \
                 [sorted({*self.space.continuous[k], self.asked[k], *self._known(k)}) for k in self.space.continuous]
        cands = [dict(zip(names, combo)) for combo in itertools.product(*values)]
        # max(sum, 0) is add with eps 0
        cands = [c for c in cands if not (c.get("eps_mode") == "clamp" and c.get("eps") == 0.0)]
        b = self.space.batched
        if b is None:
            return [self.score(probes, c, "grid") for c in cands]
        pre = self.space.prefix
        groups: dict[str, list[dict]] = {}
        for c in cands:
            groups.setdefault(json.dumps({k: v for k, v in c.items() if k not in (b, pre)}, sort_keys=True), []).append(c)
        if pre is None:
            return [c for group in groups.values() for c in self._score_group(probes, group, b, pre)]
        # the prefix knob's values up to just past the asked one for every combination, then the
        # rest of its range for the combinations that fit best there (Sinkhorn: every iteration
        # count to 64 for the four best of sixteen, a third of the work of all sixteen)
        near = self.asked[pre] + 3
        first = [c for group in groups.values()
                 for c in self._score_group(probes, [c for c in group if c[pre] <= near], b, pre)]
        ranked = dict.fromkeys(json.dumps({k: v for k, v in c.knobs.items() if k not in (b, pre)}, sort_keys=True)
                               for c in sorted(first, key=lambda c: c.score))
        rest = []
        for sig in list(ranked)[: self.judge_top + 1]:
            far = [c for c in groups[sig] if c[pre] > near]
            rest += self._score_group(probes, far, b, pre) if far else []
        return first + rest

    def _score_group(self, probes: list[Probe], cands: list[dict], knob: str, pre: str | None) -> list[Candidate]:
        """Candidates that differ only in ``knob`` and ``pre``: one reference call per probe where
        every value of ``pre`` has the same values of ``knob``, else one a value of ``pre``."""
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

    def _fit(self, probes: list[Probe], cands: list[dict], knobs: dict, ref_fn: Callable, stacked: Callable, stage: str) -> list[Candidate]:
        """Candidates from one reference call per probe (per stack of probes, where the space
        stacks them); ``stacked(outs)`` gives each output with the candidates along a leading axis.
        Ranked by error in units of the native noise."""
        ratio, rel = [0.0] * len(cands), [0.0] * len(cands)
        with torch.no_grad():
            for group, args in self._stacked(probes):
                first = next(t for t in args.values() if t is not None)
                kn = {k: (v.to(first.device).reshape(-1, *([1] * first.dim())) if torch.is_tensor(v) else v)
                      for k, v in knobs.items()}
                outs = stacked(self.fam.call(ref_fn, args, kn, lambda k: True))
                at = 0
                for p in group:
                    rows = next(t for t in p.base.values() if t is not None).shape[0]
                    for o, r, noise in zip(p.res.outputs, outs, p.noise):
                        if r.dim() == o.dim():  # an output the batched knob does not change: one fit for all
                            r = r.unsqueeze(0)
                        q, m = _batched_errors(o, r.narrow(1, at, rows) if len(group) > 1 else r)
                        if len(q) == 1 < len(cands):
                            q, m = q * len(cands), m * len(cands)
                        if len(q) != len(cands):
                            raise AssertionError(f"{len(q)} fits for {len(cands)} candidates")
                        ratio = [max(a, b / noise) for a, b in zip(ratio, q)]
                        rel = [max(a, b) for a, b in zip(rel, m)]
                    at += rows
        return [Candidate(dict(c), _nan_inf(q), _nan_inf(m), stage) for c, q, m in zip(cands, ratio, rel)]

    def _stacked(self, probes: list[Probe]) -> list[tuple[list[Probe], dict]]:
        """The probes as (group, its float64 inputs): where the space names a stackable input (its
        leading axis independent problems), probes of one shape are one input along it, so one
        reference call serves them all; otherwise each probe goes alone."""
        key = tuple(id(p) for p in probes)
        name = self.space.stackable
        if key not in self._stacks:
            if name is None or len(self.fam.inputs) != 1:
                self._stacks[key] = [([p], _float64(p.base)) for p in probes]
            else:
                groups: dict = {}
                for p in probes:
                    groups.setdefault(tuple(p.base[name].shape[1:]), []).append(p)
                self._stacks[key] = [(g, {name: torch.cat([_float64(p.base)[name] for p in g])})
                                     for g in groups.values()]
        return self._stacks[key]

    def _known(self, name: str) -> list:
        return [kv for (kk, kn, kv) in KNOWN if kk == self.kernel and kn == name]

    def pick(self, cands: list[Candidate]) -> Candidate:
        """The best fit; among fits within rounding noise of it, the one closest to what was asked."""
        best = min(c.score for c in cands)
        tied = [c for c in cands if c.score <= self._tol(best)]
        return min(tied, key=lambda c: (self._cost(c.knobs), c.score))

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
            preferred = [self.asked[name], *self._known(name)]
            e = math.floor(math.log10(cur.knobs[name]))
            around = preferred + [m * 10.0 ** p for p in (e - 1, e, e + 1) for m in (1, 2, 5)]
            snaps = self._scores(probes, [{**cur.knobs, name: float(a)} for a in dict.fromkeys(around) if a], name,
                                 "snap")
            tol = self._tol(cur.score)
            fits = [s for s in snaps if s.score <= tol]
            if fits:
                cur = min(fits, key=lambda c: (self._cost(c.knobs), _roundness(c.knobs[name], preferred), c.score))
        return cur

    def judge(self, probes: list[Probe], cand: Candidate) -> Candidate:
        """The verdict rule on every probe and guard, forward and backward, under the candidate;
        failing, once more with the space's ``judge_also`` knobs (the float64 reference is the same,
        the native baseline computes the way such a kernel does), which join the fit when that
        passes. A candidate that fails explains nothing but what its evidence shows."""
        c = self._judge(probes, cand, {})
        also = None if c.passed else self.space.judge_also(cand.knobs)
        if also:
            other = self._judge(probes, cand, also)
            if other.passed or (other.fwd_passed and not c.fwd_passed):
                c = replace(other, knobs={**other.knobs, **also})
        c.level, c.note = classify(self.kernel, c.knobs, self.asked, self.evidence(probes, c), self.ignored,
                                   shown_only=not (c.passed or c.fwd_passed))
        self.tried[c.key] = c
        return c

    def _judge(self, probes: list[Probe], cand: Candidate, extra: dict) -> Candidate:
        """The verdict on every probe: the forward's rows against the native baseline at the
        forward's precision, the backward's at the backward's (the same unless fitted apart)."""
        fwd = self._judge_at(probes, cand, extra, self.precision)
        if self.precision_bwd == self.precision:
            return fwd
        bwd = self._judge_at(probes, cand, extra, self.precision_bwd)
        failed = (None if fwd.fwd_passed else fwd.worst) or bwd.bwd_worst
        return replace(fwd, passed=failed is None, worst=failed, bwd_worst=bwd.bwd_worst)

    def _judge_at(self, probes: list[Probe], cand: Candidate, extra: dict, precision: str) -> Candidate:
        knobs, ref_fn, nat_fn = self._split(cand.knobs, precision)
        knobs.update(extra)
        nat = replace(native_impl(self.kernel), target=nat_fn, _fn=nat_fn)
        native_worst, fwd_failed, bwd_failed, overflows = 0.0, None, None, None
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
                for o, r in zip(judged.native.outputs, judged.ref_outs):
                    native_worst = max(native_worst, max_rel(o, r))
            # a non-finite count says what an infinite error does
            rows = sorted(judged_rows(judged, p.res, {}, self.rule, self.dtype),
                          key=lambda r: r["metric"] != "nonfinite")
            if p.res.bwd_error:
                bwd_failed = bwd_failed or f"backward failed: {p.res.bwd_error}"
            for r in rows:
                if r["passed"] is False:
                    msg = f"{r['tensor']} {r['metric']} {r['value']:.2g} > {r['threshold']:.2g} on {p.case.family}"
                    if r["direction"] == "fwd":
                        fwd_failed = fwd_failed or msg
                    else:
                        bwd_failed = bwd_failed or msg
        failed = fwd_failed or bwd_failed
        return replace(cand, stage="judged", native_score=native_worst, passed=failed is None, worst=failed,
                       fwd_passed=fwd_failed is None, bwd_worst=bwd_failed, overflows=overflows)

    # --- evidence for what would be a defect, on the implementation's own outputs ------------

    def evidence(self, probes: list[Probe], cand: Candidate) -> dict:
        """knob -> (shown, what was measured) for each fitted value that would be a defect."""
        out = {}
        for k, v in cand.knobs.items():
            if _same(v, self.asked.get(k)):
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
        doc = inputs_mod.get_family(self.kernel, family).doc
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
        return at_asked.score > self._tol(at_fit.score), said

    # --- the matmul precision -----------------------------------------------------------------

    def fit_precision(self, probes: list[Probe], cand: Candidate) -> tuple[str, str]:
        """The matmul precision of the forward and of the backward: the closest precision (below)
        under which that direction passes the verdict, else the closest."""
        order_f, order_b = self.closest_precisions(probes, cand)
        verdicts: dict[str, Candidate] = {}  # each precision judged once, where it is reached

        def first(order, ok):
            for p in order:
                if p not in verdicts:
                    verdicts[p] = self._judge_at(probes, cand, {}, p)
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
        from mhctool.registry.families import PRECISIONS
        fwd: dict[str, list[float]] = {}
        bwd: dict[str, list[float]] = {}
        for prec in PRECISIONS:
            knobs, _, nat_fn = self._split(cand.knobs, prec)
            nat = replace(native_impl(self.kernel), target=nat_fn, _fn=nat_fn)
            fwd[prec], bwd[prec] = [], []
            for p in probes:
                res = run_impl(self.fam, nat, p.base, knobs, lambda outs, p=p: p.upstream)
                for o, r in zip(p.res.outputs, res.outputs):
                    fwd[prec].append(_nan_inf(_batched_errors(o, r.detach().double().unsqueeze(0))[0][0]))
                for k, g in (p.res.grads or {}).items():
                    r = (res.grads or {}).get(k)
                    if r is not None:
                        bwd[prec].append(_nan_inf(_batched_errors(g, r.detach().double().unsqueeze(0))[0][0]))

        def ranked(dist: dict[str, list[float]]) -> list[str]:
            if not any(dist.values()):
                return [self.precision, *(p for p in PRECISIONS if p != self.precision)]
            floor = [min(col) for col in zip(*dist.values())]
            excess = {prec: sum(d - f for d, f in zip(ds, floor)) for prec, ds in dist.items()}
            least = min(excess.values())
            near = [p for p, e in excess.items() if e <= 2.0 * least + 1e-12]
            return near + sorted((p for p in PRECISIONS if p not in near), key=lambda p: excess[p])
        return ranked(fwd), ranked(bwd)

    def _combos(self, cands: list[Candidate], n: int) -> list[Candidate]:
        """The best candidate of each of the ``n`` best-fitting discrete combinations."""
        seen, out = set(), []
        for c in sorted(cands, key=lambda c: c.score):
            sig = _signature(c.knobs, self.space.discrete)
            if sig not in seen:
                seen.add(sig)
                out.append(c)
            if len(out) >= n:
                break
        return out

    def run(self) -> Identification:
        probes, error = self.probes()
        if error:
            return Identification(self.kernel, self.impl, self.asked, [], None, error, fixed=self.family_knobs)
        grid = self.grid(probes)
        # the continuous knobs of the few best discrete combinations are refined before the pick:
        # a sensitive knob (eps inside a square root) can sit between two grid points
        refined = [self.refine(probes, c) for c in self._combos(grid, self.judge_top)]
        first = self.pick(refined + [self.refine(probes, self.pick(grid))])
        if self.fits_precision:
            self.precision, self.precision_bwd = self.fit_precision(probes, first)
        others = [c for c in self._combos(refined + grid, self.judge_top + 1) if c.key != first.key]
        judged = [self.judge(probes, c) for c in [first, *others][: self.judge_top]]
        if self.overflow and not any(c.overflows for c in judged):
            # the candidate whose native baseline overflows as it does (no max subtraction): what its
            # finite outputs fit, judged so that the line can say so (it fails, as every one does)
            odd = [c for c in self.tried.values() if c.stage != "judged" and self._suspicious(c.knobs)]
            if odd:
                judged.append(self.judge(probes, min(odd, key=lambda c: c.score)))
        passing = [c for c in judged if c.passed]
        if passing:
            best = passing[0]
        elif self.overflow:
            best = next((c for c in judged if c.overflows), judged[0])
        else:
            best = next((c for c in judged if c.fwd_passed), judged[0])
        ties = self._ties(best) if (best.passed or best.fwd_passed) else []
        ranked = sorted(self.tried.values(), key=lambda c: (c is not best, c.stage != "judged", c.score))
        return Identification(self.kernel, self.impl, self.asked, ranked, best, discrete=tuple(self.space.discrete),
                              fixed=self.family_knobs, precision=self.precision, precision_bwd=self.precision_bwd,
                              declared_precision=self.declared_precision, ties=ties, overflow=self.overflow,
                              ignored=self.ignored)

    def _suspicious(self, knobs: dict) -> bool:
        return any((self.kernel, k, v) in SUSPICIOUS_VALUES for k, v in knobs.items())

    def _ties(self, best: Candidate) -> list[Candidate]:
        """Other discrete combinations that fit as well: every judged candidate that passed, then,
        of each other combination within native noise of the best fit, the candidate nearest what
        was asked. Where the guards showed the implementation finite, no candidate that would
        overflow there (the guard tells the two apart)."""
        tol = self._tol(min(c.score for c in self.tried.values()))
        seen = {_signature(best.knobs, self.space.discrete)}
        judged: list[Candidate] = []
        close: dict[tuple, list[Candidate]] = {}
        for c in sorted(self.tried.values(), key=lambda c: c.score):
            sig = _signature(c.knobs, self.space.discrete)
            if sig in seen or c is best or (self.guards and self._suspicious(c.knobs)):
                continue  # (judged in the log domain, no stabilisation is one: the same tie again)
            if c.stage == "judged" and c.passed:
                seen.add(sig)
                judged.append(c)
            elif c.stage != "judged" and c.score <= tol:
                close.setdefault(sig, []).append(c)
        nearest = [min(cs, key=lambda c: (self._cost(c.knobs), c.score)) for sig, cs in close.items() if sig not in seen]
        return (judged + sorted(nearest, key=lambda c: c.score))[:4]


def _key(knobs: dict) -> tuple:
    """A candidate's identity: its knob values by name (the cache of fits, the table's rows)."""
    return tuple(sorted((k, str(v)) for k, v in knobs.items()))


def _far_from(kind: type, v):
    """A value of a knob far from ``v``: one iteration (two where ``v`` is one), or 1e-3 times
    (1e3 times, for values under 1e-4; 1e-3 for zero) a float."""
    if kind is int:
        return 1 if v != 1 else 2
    if v == 0:
        return 1e-3
    return v * 1e3 if abs(v) < 1e-4 else v * 1e-3


def _float64(base: dict) -> dict:
    return {k: (None if t is None else t.double() if t.is_floating_point() else t) for k, t in base.items()}


def _batched_errors(out: torch.Tensor, refs: torch.Tensor) -> tuple[list[float], list[float]]:
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


def _roundness(v: float, preferred: list) -> int:
    """0 for an asked or known value, 1 for a power of ten, 2 for 2 or 5 times one, 3 otherwise."""
    if any(_same(v, p) for p in preferred):
        return 0
    if v <= 0:
        return 3
    m = v / 10.0 ** math.floor(math.log10(v) + 1e-9)
    return 1 if _same(m, 1.0) else 2 if _same(m, 2.0) or _same(m, 5.0) else 3


def _nan_inf(v: float) -> float:
    return math.inf if math.isnan(v) else v


def identify(kernel: str, impl: Impl, **kw) -> Identification:
    return Identifier(kernel, impl, **kw).run()


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
