"""Kernel families: each family's call signature (the one Megatron-LM's fused functions use, so
those plug in unchanged), which inputs are differentiable, which live on the fp32 mapping path, its
knobs and conventions, and its float64 reference. Implementations are :mod:`.impl`; mhctool's own
are :mod:`.builtin`; ``--impl`` specs resolve in :mod:`.specs`.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from mhctool.core import names
from mhctool.core.errors import UsageError
from mhctool.kernels.torch.mhc import PRECISIONS  # noqa: F401 - the matmul precisions, named here for mhctool
from mhctool.references import mhc as ref
from mhctool.references import moe as moe_ref


@dataclass(frozen=True)
class Knob:
    default: Any
    choices: tuple | None = None  # allowed values, or None for any number
    kind: type = str
    passed: bool = True  # passed to the implementation (False: it only shapes the inputs)
    signed: bool = False  # a float knob that may be zero or negative
    zero_ok: bool = False  # a float knob that may be zero (Sinkhorn without eps, as TransformerEngine's)

    def check(self, kernel: str, name: str, value):
        if self.choices is not None:
            if value not in self.choices or (isinstance(value, bool) and self.kind is not bool):
                raise UsageError(
                    f"knob {name}={value!r} is not accepted by kernel {kernel}; accepted: "
                    + ", ".join(map(repr, self.choices))
                )
            return self.kind(value)
        if self.kind in (int, float) and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise UsageError(f"knob {name}={value!r} of kernel {kernel} must be a number")
        if self.kind is int and (int(value) != value or value < 1):
            raise UsageError(f"knob {name}={value!r} of kernel {kernel} must be a positive integer")
        if self.kind is float and not math.isfinite(value):
            raise UsageError(f"knob {name}={value!r} of kernel {kernel} must be finite")
        if self.kind is float and not self.signed and not (value > 0 or (self.zero_ok and value == 0)):
            raise UsageError(f"knob {name}={value!r} of kernel {kernel} must be "
                             + ("zero or positive" if self.zero_ok else "positive"))
        return self.kind(value)


@dataclass(frozen=True)
class Family:
    name: str
    inputs: tuple[str, ...]  # positional call order
    differentiable: tuple[str, ...]
    mapping: tuple[str, ...]  # inputs kept in fp32 whatever the case dtype
    outputs: tuple[str, ...]
    knobs: dict[str, Knob]
    positional_knobs: tuple[str, ...]  # knobs that follow the inputs positionally (Megatron order)
    reference: Callable
    # optional: (float64 inputs, float64 upstream grads, knobs) -> {tensor: sum of |terms|}, for
    # outputs that are long cancelling sums; the verdict floor then scales with the terms, not
    # with the (smaller) result (see verdict.py)
    term_scale: Callable | None = None
    shape_kind: str = "mhc"  # mhc: SxBxNxC; moe: TxHxFxE (shapes.parse_shape_for)
    forward_only: bool = False  # the operation is itself a gradient (grouped_wgrad): no backward
    # trailing outputs an implementation may leave out (judged where returned; their upstream
    # gradient is zero, so the other gradients do not depend on whether they are returned)
    optional_outputs: tuple[str, ...] = ()
    # knobs that a legitimate implementation may choose (DESIGN.md, "conventions"): declared with
    # --convention or by an adapter, applied to the reference and the native baseline
    conventions: tuple[str, ...] = ()

    def arguments(self, args: dict, knobs: dict, accepted,
                  bind: Callable[[str], str | int | None] = lambda k: k) -> tuple[list, dict]:
        """(positional, keyword) arguments of a call with the family's signature: the inputs, then
        every knob the function takes (at the case's value or the default; knobs it does not
        accept are left out). ``bind`` names the parameter a knob goes to (an alias), or its
        position for positional-only ones."""
        pos = [args[k] for k in self.inputs]
        kw, at = {}, {}
        for k, knob in self.knobs.items():
            v = knobs.get(k, knob.default)
            if not (knob.passed and accepted(k)):
                continue
            target = bind(k)
            if isinstance(target, int):
                at[target] = v
            elif target is not None:
                kw[target] = v
        for i in sorted(at):  # positional-only knobs, contiguous after the inputs (Impl.bind checks)
            pos.append(at[i])
        return pos, kw

    def call(self, fn: Callable, args: dict[str, torch.Tensor], knobs: dict, accepted,
             bind: Callable[[str], str | int | None] = lambda k: k) -> tuple:
        """Call ``fn`` with the family's signature (:meth:`arguments`); its outputs as a tuple."""
        pos, kw = self.arguments(args, knobs, accepted, bind)
        out = fn(*pos, **kw)
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def signature(fam: "Family") -> str:
    """How a plain function of the family is called and what it returns, for error messages:
    ``sinkhorn(logits, iters=20, eps=1e-06, ...) -> out``."""
    knobs = [f"{k}={fam.knobs[k].default!r}" for k in fam.positional_knobs]
    by_name = [k for k, kn in fam.knobs.items() if kn.passed and k not in fam.positional_knobs]
    args = [*fam.inputs, *knobs] + ([f"*, any of {', '.join(by_name)} it takes"] if by_name else [])
    outs = ", ".join(f"{o} (optional)" if o in fam.optional_outputs else o for o in fam.outputs)
    return f"{fam.name}({', '.join(args)}) -> {outs}"


# what a call that cannot fit the family's signature says (a TypeError binding the arguments, or
# outputs the contract cannot take): bad input, not a numerics failure
CALL_PROBLEMS = ("outputs, expected", "TypeError: ", "not a tensor")


def call_problem(message: str | None) -> bool:
    """Whether a failed call's message says it cannot take or give the family's signature."""
    m = message or ""
    if m.startswith("TypeError: "):
        return any(w in m for w in ("positional argument", "required argument", "unexpected keyword",
                                    "takes no arguments", "missing", "got multiple values"))
    return m.startswith("returned ") and "outputs, expected" in m or " is " in m and m.endswith(", not a tensor")


def _token_sum_term_scale(family: str) -> Callable:
    """grad_alpha[k] sums g_h * (r * proj) over every token and the k-th group of columns, and
    grad_h_bias[j] sums g_h[:, j] over every token: their terms are far larger than the result
    when they cancel. The family's reference, traced, gives h (for g_h) and r * proj. (On an H200,
    mix_aggregate's fp32 grad_h_bias at 9x2x2x40 erred by 2.4 roundoffs of its terms' sum, PyTorch's
    on other columns by up to 2.6, ``dev/bias_probe.py``: a sum of 18 terms cancelling 3.5x,
    each term a product of sums itself.)"""
    def scale(args: dict, upstream: list, knobs: dict) -> dict[str, float]:
        fam = FAMILIES[family]
        seen: dict[str, torch.Tensor] = {}
        traced = functools.partial(fam.reference, trace=lambda name, t: seen.setdefault(name, t))
        with torch.enable_grad():
            outs = fam.call(traced, args, knobs, lambda k: True)
            (gh,) = torch.autograd.grad(outs, [seen["h"]], list(upstream)[:len(outs)])
        n = round((seen["h"].shape[-1] + 1) ** 0.5 - 1)
        terms = (gh * seen["r_proj"]).abs().detach()
        return {"grad_alpha": float(max(terms[:, :n].sum(), terms[:, n:2 * n].sum(), terms[:, 2 * n:].sum())),
                "grad_h_bias": float(gh.abs().detach().sum(0).max())}
    return scale


def _ref_sinkhorn(logits, iters=20, eps=1e-6, **kw):
    return ref.sinkhorn(logits, iters, eps, **kw)


def _ref_mapping(x2d, weight, alpha, h_bias, eps=1e-6, **kw):
    return (*ref.mapping(x2d, weight, alpha, h_bias, eps, **kw), ref.rms(x2d))


_RMS_EPS = Knob("outside", ref.RMS_EPS)


# the mapping's knobs, then Sinkhorn's (its eps named sinkhorn_eps), for the composite families
_COMPOSITE_KNOBS = {
    "eps": Knob(1e-6, kind=float, zero_ok=True), "rms_eps": _RMS_EPS,
    "compute_h_eps": Knob(0.0, kind=float, zero_ok=True), "iters": Knob(20, kind=int),
    "sinkhorn_eps": Knob(1e-6, kind=float, zero_ok=True), "stabilize": Knob("rowmax", ref.STABILIZE),
    "order": Knob("row_first", ref.ORDERS), "domain": Knob("linear", ref.DOMAINS),
}


_COMPOSITE_CONVENTIONS = ("eps", "rms_eps", "compute_h_eps", "sinkhorn_eps", "stabilize", "order", "domain", "iters")


FAMILIES: dict[str, Family] = {
    "sinkhorn": Family(
        "sinkhorn", ("logits",), ("logits",), (), ("out",),
        {
            "iters": Knob(20, kind=int),
            "eps": Knob(1e-6, kind=float, zero_ok=True),
            "stabilize": Knob("rowmax", ref.STABILIZE),
            "eps_mode": Knob("add", ref.EPS_MODES),
            "order": Knob("row_first", ref.ORDERS),
            "domain": Knob("linear", ref.DOMAINS),
        },
        ("iters", "eps"),
        _ref_sinkhorn,
        # iters too: a kernel may fix its own count (declared, it is judged at it, called without it
        # where it takes no such parameter)
        conventions=("stabilize", "eps_mode", "eps", "order", "domain", "iters"),
    ),
    "h_aggregate": Family(
        "h_aggregate", ("x", "h_pre"), ("x", "h_pre"), ("h_pre",), ("out",), {}, (), ref.h_aggregate,
    ),
    "h_post_bda": Family(
        "h_post_bda", ("h_res", "x", "h_post", "y", "bias"), ("h_res", "x", "h_post", "y", "bias"),
        ("h_res", "h_post"), ("out",),
        {"transpose_res": Knob(False, (False, True), bool), "bias": Knob(True, (False, True), bool, passed=False)},
        (),
        ref.h_post_bda,
        conventions=("transpose_res",),
    ),
    "proj_rms": Family(
        "proj_rms", ("x2d", "weight"), ("x2d", "weight"), (), ("proj", "r"),
        {"eps": Knob(1e-6, kind=float, zero_ok=True), "rms_eps": _RMS_EPS},
        ("eps",),
        ref.proj_rms,
        conventions=("eps", "rms_eps"),
    ),
    "mapping": Family(
        "mapping", ("x2d", "weight", "alpha", "h_bias"), ("x2d", "weight", "alpha", "h_bias"),
        ("alpha", "h_bias"), ("h_pre", "h_post", "h_res_logits", "rms"),
        {"eps": Knob(1e-6, kind=float, zero_ok=True), "rms_eps": _RMS_EPS,
         "compute_h_eps": Knob(0.0, kind=float, zero_ok=True)},
        ("eps",),
        _ref_mapping,
        _token_sum_term_scale("mapping"),
        optional_outputs=("rms",),
        conventions=("eps", "rms_eps", "compute_h_eps"),
    ),
    # the composites: the mapping then Sinkhorn (the three mixing matrices: Liger-Kernel's
    # coefficients), and that then the aggregation (the whole pre-path: TransformerEngine's
    # mhc_generate_mix_and_aggregate)
    "mapping_sinkhorn": Family(
        "mapping_sinkhorn", ("x", "weight", "alpha", "h_bias"), ("x", "weight", "alpha", "h_bias"),
        ("alpha", "h_bias"), ("h_pre", "h_post", "h_res"), dict(_COMPOSITE_KNOBS), (),
        ref.mapping_sinkhorn, _token_sum_term_scale("mapping_sinkhorn"), conventions=_COMPOSITE_CONVENTIONS,
    ),
    "mix_aggregate": Family(
        "mix_aggregate", ("x", "weight", "alpha", "h_bias"), ("x", "weight", "alpha", "h_bias"),
        ("alpha", "h_bias"), ("out", "h_post", "h_res"), dict(_COMPOSITE_KNOBS), (),
        ref.mix_aggregate, _token_sum_term_scale("mix_aggregate"), conventions=_COMPOSITE_CONVENTIONS,
    ),
}


_INTERLEAVE = Knob(0, (0, 32), int)


_SCALED = Knob(True, (False, True), bool, passed=False)


def _moe(name, inputs, differentiable, mapping, outputs, knobs, reference, forward_only=False):
    return Family(name, inputs, differentiable, mapping, outputs, knobs, (), reference,
                  shape_kind="moe", forward_only=forward_only)


FAMILIES.update({
    "swiglu": _moe("swiglu", ("x", "scale"), ("x", "scale"), ("scale",), ("out",),
                   {"interleave": _INTERLEAVE, "scaled": _SCALED}, moe_ref.swiglu),
    "clamped_swiglu": _moe(
        "clamped_swiglu", ("x", "scale"), ("x", "scale"), ("scale",), ("out",),
        {"interleave": _INTERLEAVE, "scaled": _SCALED, "limit": Knob(7.0, kind=float),
         "alpha": Knob(1.702, kind=float), "offset": Knob(1.0, kind=float, signed=True)},
        moe_ref.clamped_swiglu),
    "srelu": _moe("srelu", ("x", "scale"), ("x", "scale"), ("scale",), ("out",), {"scaled": _SCALED}, moe_ref.srelu),
    "grouped_gemm": _moe("grouped_gemm", ("x", "weight", "m_splits", "bias"), ("x", "weight", "bias"), (),
                         ("out",), {"bias": Knob(False, (False, True), bool, passed=False)}, moe_ref.grouped_gemm),
    "grouped_wgrad": _moe("grouped_wgrad", ("x", "grad_out", "m_splits", "main_grad", "accumulate"), (),
                          ("main_grad",), ("wgrad",),
                          {"accumulate": Knob("mask", ("mask", "none"), passed=False)}, moe_ref.grouped_wgrad,
                          forward_only=True),
    "grouped_mlp": _moe(
        "grouped_mlp", ("x", "fc1_weight", "fc2_weight", "m_splits", "fc1_bias", "fc2_bias", "scale"),
        ("x", "fc1_weight", "fc2_weight", "fc1_bias", "fc2_bias", "scale"), ("scale",), ("out",),
        {"activation": Knob("swiglu", moe_ref.ACTIVATIONS), "interleave": _INTERLEAVE,
         "bias": Knob(True, (False, True), bool, passed=False), "scaled": _SCALED},
        moe_ref.grouped_mlp),
})


KERNELS = tuple(FAMILIES)


MHC_KERNELS = tuple(k for k, f in FAMILIES.items() if f.shape_kind == "mhc")


MOE_KERNELS = tuple(k for k, f in FAMILIES.items() if f.shape_kind == "moe")


if (KERNELS, MHC_KERNELS, MOE_KERNELS) != (names.KERNELS, names.MHC_KERNELS, names.MOE_KERNELS):
    raise AssertionError("mhctool.names lists other kernels than the registry's families")


# kernels whose products may run at TF32 by design (DESIGN.md: the projection; TransformerEngine's
# mixing kernels multiply with TF32 by default too)
MATMUL_KERNELS = ("proj_rms", "mapping", "h_aggregate", "h_post_bda", "mapping_sinkhorn", "mix_aggregate")


# names that stand for several kernels: every one, or every one that takes one form of shape
GROUPS = {"all": KERNELS, "mhc": MHC_KERNELS, "moe": MOE_KERNELS}


def get_family(name: str) -> Family:
    if name not in FAMILIES:
        raise UsageError(f"unknown kernel {name!r}; accepted: {', '.join(KERNELS)}, or a group: {', '.join(GROUPS)}")
    return FAMILIES[name]


def kernels_named(names: list[str]) -> list[str]:
    """Kernel names and groups (``all``, ``mhc``, ``moe``) -> kernel names, checked, in order, once each."""
    out: list[str] = []
    for name in names:
        for k in GROUPS.get(name, (name,)):
            k = get_family(k).name
            if k not in out:
                out.append(k)
    return out
