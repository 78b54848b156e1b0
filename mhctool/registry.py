"""Kernel families -> implementations and their float64 reference.

A family states its call signature (the one Megatron-LM's fused functions use, so those plug in
unchanged), which inputs are differentiable, which inputs live on the fp32 mapping path, and its
knobs. An implementation states its backend and what it supports; the runner asks it and skips an
unsupported combination with the reason. External implementations come from
``module.path:function`` or ``path/to/file.py:function``.
"""
from __future__ import annotations

import functools
import importlib
import inspect
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import torch

from . import names
from .errors import UsageError
from .kernels.torch.mhc import PRECISIONS  # noqa: F401 - the matmul precisions, named here for mhctool
from .references import mhc as ref
from .references import moe as moe_ref


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


def check_callable(impl: "Impl") -> None:
    """A UsageError naming the family's signature when ``impl`` cannot be called with the family's
    inputs and the knobs it takes (Python binds the parameters before it runs: no case would
    judge anything)."""
    fam = FAMILIES[impl.kernel]
    try:
        sig = inspect.signature(impl.fn)
    except (TypeError, ValueError):
        return
    # the call's arguments, each named by what it stands for
    pos, kw = fam.arguments({k: k for k in fam.inputs}, {k: k for k in fam.knobs}, impl.accepts, impl.bind)
    try:
        sig.bind(*pos, **kw)
    except TypeError as e:
        raise UsageError(f"--impl {impl.name} cannot be called as {impl.kernel}: {e}; expected {signature(fam)}") \
            from None


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


@dataclass
class Impl:
    """One implementation of a family."""

    name: str
    kernel: str
    backend: str  # torch, compile, triton, cutile, external
    target: str | Callable  # "module:function" (resolved lazily) or the function
    devices: tuple[str, ...] = ("cpu", "cuda")
    dtypes: tuple[str, ...] = ("fp32", "bf16", "fp16")
    # matmul precision it computes at by design (PRECISIONS), or {device: precision} where that
    # differs by device (Triton's fp32 tl.dot: TF32 on a GPU, IEEE through the CPU interpreter)
    precision: str | dict = "ieee"
    native: bool = False
    default: bool = True  # run when no --impl is given
    requires: Callable[[], str | None] = field(default=lambda: None)  # why unusable here, or None
    conventions: dict = field(default_factory=dict)  # convention knobs it computes (declared by an adapter)
    spec: str | None = None  # the --impl spec that resolves to it (None: its name)
    adapter: str | None = None  # the library adapter that maps it (mhctool/libraries/<name>.py)
    limit: Callable | None = None  # limit(shape) -> why it cannot run that shape (n = 4 only, ...), or None
    # (stage, fn) where an adapter converts layouts: stage(inputs) -> the inputs in the library's
    # layouts, fn takes those (bench times fn alone; parity calls ``fn`` of the Impl, which converts)
    staged: tuple | None = None
    # input name -> "activation" or a format name: the dtypes a library is used with where they
    # differ from the contract's (declared by its adapter; bench times it at these)
    input_dtypes: dict = field(default_factory=dict)
    exists: bool = True  # False: it stands for a kernel its backend or library does not have (skipped, said why)
    glue: str = ""  # what an adapter computes around the library's call (bench times it with the call, says so)
    _fn: Callable | None = None

    @property
    def fn(self) -> Callable:
        if self._fn is None:
            self._fn = self.target if callable(self.target) else _import_target(self.target)
        return self._fn

    def unavailable(self) -> str | None:
        return self.requires()

    def precision_on(self, device: str) -> str:
        """The matmul precision it computes at on ``device``."""
        p = self.precision
        return p if isinstance(p, str) else p.get("cuda" if device.startswith("cuda") else device, "ieee")

    def unsupported(self, device: str, dtype: str) -> str | None:
        why = self.unavailable()
        if why:
            return why
        if device not in self.devices:
            return f"{self.name} runs on {', '.join(self.devices)}, not {device}"
        if self.backend == "triton":
            from .environment import triton_interpreted
            if device == "cpu" and not triton_interpreted():
                return "Triton runs on the CPU only through its interpreter (set TRITON_INTERPRET=1)"
            if device == "cuda" and triton_interpreted():
                return "TRITON_INTERPRET=1 is set: Triton kernels run on the CPU only"
        if dtype not in self.dtypes:
            return f"{self.name} takes {', '.join(self.dtypes)}, not {dtype}"
        if device == "cpu" and self.backend in ("triton", "external"):
            # a 16-bit product the interpreter computes wrong would blame the kernel: skipped, said why
            from . import interpreter
            return interpreter.fault(dtype)
        return None

    @functools.cached_property
    def _params(self):
        try:
            sig = inspect.signature(self.fn)
        except (TypeError, ValueError):
            return None
        if any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
            return None
        return list(sig.parameters.values())

    def bind(self, knob: str) -> str | int | None:
        """Where ``knob`` goes in a call, the way Python binds it: its own name or a known alias
        (``iters`` <-> ``num_iterations``), or, for a positional-only parameter, its position
        (only right after the family's inputs, in the family's positional-knob order)."""
        params = self._params
        if params is None:
            return knob
        names = (knob, *KNOB_ALIASES.get(knob, ()))
        for i, p in enumerate(params):
            if p.name in names:
                if p.kind is not p.POSITIONAL_ONLY:
                    return p.name
                fam = FAMILIES[self.kernel]
                expected = len(fam.inputs) + (fam.positional_knobs.index(knob) if knob in fam.positional_knobs else -99)
                return i if i == expected else None
        return None

    def accepts(self, knob: str) -> bool:
        return self.bind(knob) is not None


# other names public kernels give a knob (Megatron's fused_sinkhorn takes ``num_iterations``)
KNOB_ALIASES: dict[str, tuple[str, ...]] = {
    "iters": ("num_iterations", "num_iters", "iterations", "n_iters", "sinkhorn_iters"),
    "eps": ("epsilon",),
    "transpose_res": ("transpose", "h_res_transposed"),
}


def _import_target(target: str) -> Callable:
    mod_name, _, fn_name = target.partition(":")
    return getattr(importlib.import_module(mod_name), fn_name)


def _triton_requires() -> str | None:
    from .environment import triton_status
    return triton_status().reason


def _cutile_requires() -> str | None:
    from .environment import cutile_status
    return cutile_status().reason


def _builtin_impls() -> dict[str, list[Impl]]:
    out: dict[str, list[Impl]] = {}
    for k in KERNELS:
        native = f"mhctool.kernels.torch.{'moe' if k in MOE_KERNELS else 'mhc'}:{k}"
        impls = [
            Impl("torch", k, "torch", native, native=True),
            # torch.compile on CPU costs tens of seconds per graph: asked for by name there
            Impl("compile", k, "compile", _compiled(native), default=False),
        ]
        if k in TRITON_KERNELS:
            impls.append(Impl("triton", k, "triton", TRITON_KERNELS[k], requires=_triton_requires))
        if k in CUTILE_KERNELS:
            impls.append(Impl("cutile", k, "cutile", CUTILE_KERNELS[k], devices=("cuda",),
                              requires=_cutile_requires))
        if k in TRITON_TF32_KERNELS:
            # asked for by name (--impl triton-tf32): judged at TF32, benched beside the IEEE kernel
            impls.append(Impl("triton-tf32", k, "triton", TRITON_TF32_KERNELS[k], precision="tf32",
                              default=False, requires=_triton_requires))
        out[k] = impls
    return out


def _compiled(target: str) -> Callable:
    cache: dict = {}

    def run(*args, **kwargs):
        if "fn" not in cache:
            cache["fn"] = torch.compile(_import_target(target), dynamic=False)
        return cache["fn"](*args, **kwargs)

    run.__signature__ = inspect.signature(_import_target(target))  # type: ignore[attr-defined]
    return run


# Fused kernels shipped with mhctool: family -> "module:function" (autograd-aware entry points).
TRITON_KERNELS: dict[str, str] = {
    "sinkhorn": "mhctool.kernels.triton.sinkhorn:sinkhorn",
    "h_aggregate": "mhctool.kernels.triton.h_aggregate:h_aggregate",
    "h_post_bda": "mhctool.kernels.triton.h_post_bda:h_post_bda",
    "proj_rms": "mhctool.kernels.triton.proj_rms:proj_rms",
    "mapping": "mhctool.kernels.triton.mapping:mapping",
    "mapping_sinkhorn": "mhctool.kernels.triton.mix_aggregate:mapping_sinkhorn",
    "mix_aggregate": "mhctool.kernels.triton.mix_aggregate:mix_aggregate",
    "swiglu": "mhctool.kernels.triton.glu:swiglu",
    "clamped_swiglu": "mhctool.kernels.triton.glu:clamped_swiglu",
    "srelu": "mhctool.kernels.triton.glu:srelu",
    "grouped_gemm": "mhctool.kernels.triton.grouped_gemm:grouped_gemm",
    "grouped_wgrad": "mhctool.kernels.triton.grouped_gemm:grouped_wgrad",
    "grouped_mlp": "mhctool.kernels.triton.grouped_mlp:grouped_mlp",
}
# the projection's TF32 variants: every product a TF32 product of operands rounded to TF32 (the
# precision the mHC paper specifies; issue 20: what IEEE accuracy costs, in one bench table)
TRITON_TF32_KERNELS: dict[str, str] = {
    "proj_rms": "mhctool.kernels.triton.proj_rms:proj_rms_tf32",
    "mapping": "mhctool.kernels.triton.mapping:mapping_tf32",
}
CUTILE_KERNELS: dict[str, str] = {
    "sinkhorn": "mhctool.kernels.cutile.sinkhorn:sinkhorn",
    "h_aggregate": "mhctool.kernels.cutile.h_aggregate:h_aggregate",
    "h_post_bda": "mhctool.kernels.cutile.h_post_bda:h_post_bda",
    "proj_rms": "mhctool.kernels.cutile.proj_rms:proj_rms",
    "mapping": "mhctool.kernels.cutile.mapping:mapping",
    "mix_aggregate": "mhctool.kernels.cutile.mix_aggregate:mix_aggregate",
}


@functools.lru_cache(maxsize=None)
def builtin() -> dict[str, list[Impl]]:
    return _builtin_impls()


def impls_for(kernel: str) -> list[Impl]:
    return builtin()[kernel]


def native_impl(kernel: str) -> Impl:
    return next(i for i in impls_for(kernel) if i.native)


BACKEND_NAMES = {"torch": "PyTorch", "compile": "torch.compile", "triton": "Triton", "cutile": "cuTile",
                 "triton-tf32": "Triton TF32"}


def resolve_impls(kernel: str, specs: list[str] | None) -> list[Impl]:
    """The implementations to run for ``kernel``: builtin names or external ``module:function``.

    A built-in name that another kernel has but ``kernel`` lacks (``cutile`` for ``swiglu``)
    resolves to an implementation that is never runnable and says why, so a multi-kernel run
    reports it as skipped for that kernel; a name that no kernel has is a UsageError."""
    known = {i.name: i for i in impls_for(kernel)}
    if not specs:
        return [i for i in known.values() if i.default]
    chosen = []
    for spec in specs:
        if spec in known:
            chosen.append(known[spec])
        elif is_library_spec(spec):
            from . import libraries
            chosen.extend(libraries.impls(spec, kernel))
        elif ":" in spec:
            chosen.append(load_external(spec, kernel))
        elif is_functions_file(spec):
            chosen.append(functions_file(spec, kernel))
        elif any(spec == i.name for k in KERNELS for i in impls_for(k)):
            why = f"mhctool has no {BACKEND_NAMES.get(spec, spec)} implementation of {kernel}"
            chosen.append(Impl(spec, kernel, spec, _absent, requires=lambda why=why: why, default=False, exists=False))
        else:
            names = sorted({i.name for k in KERNELS for i in impls_for(k)})
            raise UsageError(
                f"unknown implementation {spec!r}; accepted: {', '.join(names)}, "
                "or module.path:function, or path/to/file.py:function"
            )
    return chosen


def _absent(*args, **kwargs):  # the target of an implementation that does not exist for a kernel
    raise RuntimeError("no such implementation")


def is_library_spec(spec: str) -> bool:
    """``NAME:FILE_OR_MODULE`` where NAME is a library adapter (``megatron:``, ``te:``, ``liger:``,
    an installed adapter's entry point, or an adapter file ``path/to/adapter.py``)."""
    from .libraries import find
    prefix, sep, _ = spec.partition(":")
    return bool(sep) and find(prefix) is not None


def is_functions_file(spec: str) -> bool:
    """``path/to/kernels.py`` with no ``:function``: a file of functions named after the families
    (``sinkhorn``, ``h_aggregate``, ...), judged like a library, one implementation per family."""
    return spec.endswith(".py") and ":" not in spec


def functions_file(spec: str, kernel: str) -> Impl:
    """The function named ``kernel`` in the file ``spec``; a file without one stands for an
    implementation that does not exist (skipped, said why); a file with no family-named function
    at all is bad input."""
    path = Path(spec)
    module = _file_module(spec, path)
    defined = [k for k in KERNELS if callable(getattr(module, k, None))]
    if not defined:
        raise UsageError(f"--impl {spec!r}: the file defines no function named after a family ("
                         + ", ".join(KERNELS) + "); name one function with :function, e.g. "
                         f"{spec}:my_sinkhorn")
    if kernel not in defined:
        why = f"{path.name} defines no function {kernel} (it has {', '.join(defined)})"
        return Impl(f"{spec}:{kernel}", kernel, "external", _absent, requires=lambda why=why: why, default=False,
                    spec=spec, exists=False)
    return replace(load_external(f"{spec}:{kernel}", kernel), spec=spec)


def _file_module(spec: str, path: Path):
    """The Python file an ``--impl`` spec names, imported (once per process), with Triton in its
    interpreter first on a CPU; a missing file or one that fails to import is bad input."""
    if not path.is_file():
        raise UsageError(f"--impl {spec!r}: no file {path}")
    from .environment import ensure_triton_mode
    ensure_triton_mode()  # before the file defines its Triton kernels: on a CPU, the interpreter
    from .libraries import load_file
    try:
        return load_file(path)
    except UsageError as e:  # the user's file failed to import: that is bad input
        raise UsageError(f"--impl {spec!r}: {e}") from e


def is_function_spec(spec: str) -> bool:
    """``module:function`` or ``file.py:function``: one function, so one kernel."""
    return ":" in spec and not is_library_spec(spec)


def resolve_one(kernel: str, spec: str, name: str) -> Impl:
    """The implementation named ``name`` among those ``spec`` resolves to (isolation workers)."""
    for impl in resolve_impls(kernel, [spec]):
        if impl.name == name:
            return impl
    raise UsageError(f"--impl {spec!r} has no implementation {name!r} for kernel {kernel}")


def load_external(spec: str, kernel: str, check: bool = True) -> Impl:
    """``module.path:function`` or ``path/to/file.py:function`` -> an external Impl (``check``:
    that it can be called with ``kernel``'s signature)."""
    target, _, fn_name = spec.rpartition(":")
    if not target or not fn_name:
        raise UsageError(f"malformed --impl {spec!r}; expected module.path:function or file.py:function")
    if target.endswith(".py") or os.sep in target or "/" in target:
        module = _file_module(spec, Path(target))
    else:
        from .environment import ensure_triton_mode
        ensure_triton_mode()  # before the module defines its Triton kernels: on a CPU, the interpreter
        try:
            module = importlib.import_module(target)
        except ImportError as e:
            raise UsageError(f"--impl {spec!r}: cannot import module {target} ({e})") from e
    fn = getattr(module, fn_name, None)
    if fn is None or not callable(fn):
        raise UsageError(f"--impl {spec!r}: {target} has no function {fn_name}")
    impl = Impl(spec, kernel, "external", fn)
    if check:
        check_callable(impl)
    return impl
