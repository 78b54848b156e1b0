"""A kernel family's contract: its call signature (the one Megatron-LM's fused functions use, so
those plug in unchanged), which inputs are differentiable and which live on the fp32 mapping
path, its knobs and conventions, its float64 reference, its input families, mhctool's kernels of
it and its bytes model. Each family's module in this package fills one in."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from mhctool.core.errors import UsageError
from mhctool.core.inputs import InputFamily


@dataclass(frozen=True)
class Cost:
    """Bytes and flops of one call at a shape (the memory-roofline model bench times against, and
    the footprint that decides where a case fits)."""
    bytes_fwd: float
    bytes_bwd: float
    flops_fwd: float
    flops_bwd: float


@dataclass(frozen=True)
class Knob:
    default: Any
    choices: tuple | None = None  # allowed values, or None for any number
    kind: type = str
    passed: bool = True  # passed to the implementation (False: it only shapes the inputs)
    signed: bool = False  # a float knob that may be zero or negative
    zero_ok: bool = False  # a float knob that may be zero (Sinkhorn without eps, as TransformerEngine's)
    # (knob, value): this knob means something only where that knob has that value (a clamped
    # exponential's bound, under stabilize=clamp); said with it, never asked or claimed apart
    only_with: tuple | None = None
    below: float | None = None  # a number knob's values lie below this (dropout's probability: 1)

    def applies(self, knobs: dict) -> bool:
        """Whether this knob means something under ``knobs`` (always, unless :attr:`only_with`)."""
        return self.only_with is None or knobs.get(self.only_with[0]) == self.only_with[1]

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
        if self.kind is int and (int(value) != value or value < (0 if self.zero_ok else 1)):
            raise UsageError(f"knob {name}={value!r} of kernel {kernel} must be a "
                             + ("non-negative" if self.zero_ok else "positive") + " integer")
        if self.below is not None and not value < self.below:
            raise UsageError(f"knob {name}={value!r} of kernel {kernel} must be below {self.below:g}")
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
    # the seeded input families parity runs (every one of them by default), the stress families a
    # scenario runs only where it names them (regimes where the native baseline itself fails), and
    # identify's probe families: name -> InputFamily (mhctool.core.inputs)
    input_families: dict[str, InputFamily] = field(default_factory=dict)
    stress: dict[str, InputFamily] = field(default_factory=dict)
    probes: dict[str, InputFamily] = field(default_factory=dict)
    # mhctool's fused kernels of the family: backend (triton, cutile, triton-tf32) -> "module:function"
    kernels: dict[str, str] = field(default_factory=dict)
    # the memory-roofline model: (shape, activation bytes, fp32 bytes) -> Cost
    cost: Callable[[Any, int, int], "Cost"] | None = None
    # its products may run at TF32 by design (DESIGN.md: the projection; TransformerEngine's mixing
    # kernels multiply with TF32 by default too)
    matmul: bool = False
    # trailing inputs a function may have no parameter for (h_post_bda's bias): it is called without
    # them where they are None, and a case that has one is not for it. Each is a knob of the same
    # name too (passed=False: it shapes the inputs)
    optional_inputs: tuple[str, ...] = ()
    # outputs whose elements take one of two branches the knobs choose (h_post_bda's dropout: the
    # branch kept or dropped): (float64 inputs, knobs) -> {output: (the kept branch's share of
    # each element, which elements the contract keeps)}, or {} where no knob chooses; an output
    # nearer the other branch than the contract's at an element is a ``mask_mismatch``
    branches: Callable[[dict, dict], dict] | None = None
    # knobs a caller gives call by call among the call's arguments (the dropout's probability and
    # key, which an engine draws afresh for every call): taken from the arguments where there
    keyed: tuple[str, ...] = ()

    def arguments(self, args: dict, knobs: dict, accepted,
                  bind: Callable[[str], str | int | None] = lambda k: k,
                  takes: Callable[[str], bool] = lambda name: True) -> tuple[list, dict]:
        """(positional, keyword) arguments of a call with the family's signature: the inputs, then
        every knob the function takes (at the case's value or the default; knobs it does not
        accept are left out). ``bind`` names the parameter a knob goes to (an alias), or its
        position for positional-only ones; ``takes`` says whether the function has a parameter for
        an optional input (left out of the call when it has none and the input is None)."""
        return self._plan(knobs, accepted, bind, takes)(args)

    def _plan(self, knobs: dict, accepted, bind, takes) -> Callable[[dict], tuple[list, dict]]:
        """:meth:`arguments` for calls that differ in their inputs and keyed knobs only: what the
        knobs and the function's signature decide is worked out once."""
        taken = [k for k in self.inputs if takes(k)]
        refused = [k for k in self.inputs if not takes(k)]
        fixed_kw, fixed_at, keyed = {}, {}, []
        for k, knob in self.knobs.items():
            if not (knob.passed and accepted(k)):
                continue
            target = bind(k)
            if target is None:
                continue
            v = knobs.get(k, knob.default)
            if k in self.keyed:
                keyed.append((k, target, v))
            elif isinstance(target, int):
                fixed_at[target] = v
            else:
                fixed_kw[target] = v

        def plan(args: dict) -> tuple[list, dict]:
            for k in refused:
                if args[k] is not None:
                    raise ValueError(f"the function takes no {k} input, and this call has one")
            pos, kw, at = [args[k] for k in taken], dict(fixed_kw), fixed_at
            if keyed:
                at = dict(fixed_at)
                for k, target, v in keyed:
                    (at if isinstance(target, int) else kw)[target] = args[k] if k in args else v
            for i in sorted(at):  # positional-only knobs, contiguous after the inputs (Impl.bind checks)
                pos.append(at[i])
            return pos, kw
        return plan

    def call(self, fn: Callable, args: dict[str, torch.Tensor], knobs: dict, accepted,
             bind: Callable[[str], str | int | None] = lambda k: k,
             takes: Callable[[str], bool] = lambda name: True) -> tuple:
        """Call ``fn`` with the family's signature (:meth:`arguments`); its outputs as a tuple."""
        return self.caller(fn, knobs, accepted, bind, takes)(args)

    def caller(self, fn: Callable, knobs: dict, accepted,
               bind: Callable[[str], str | int | None] = lambda k: k,
               takes: Callable[[str], bool] = lambda name: True) -> Callable[[dict], tuple]:
        """:meth:`call` for many calls of one function with one knobs dict (a model's layer, call
        after call): the arguments planned once, and again whenever ``knobs`` changes."""
        state: dict = {}

        def call(args: dict) -> tuple:
            snap = tuple(knobs.items())
            if state.get("snap") != snap:
                state["snap"], state["plan"] = snap, self._plan(knobs, accepted, bind, takes)
            pos, kw = state["plan"](args)
            out = fn(*pos, **kw)
            if isinstance(out, list):  # a wrong return is the implementation's failed row, never a guess
                raise TypeError(f"it returned a list of {len(out)}, where the contract's outputs are a tensor "
                                f"or a tuple of tensors ({', '.join(self.outputs)})")
            return tuple(out) if isinstance(out, tuple) else (out,)
        return call


def signature(fam: "Family") -> str:
    """How a plain function of the family is called and what it returns, for error messages:
    ``sinkhorn(logits, iters=20, eps=1e-06, ...) -> out``."""
    knobs = [f"{k}={fam.knobs[k].default!r}" for k in fam.positional_knobs]
    by_name = [k for k, kn in fam.knobs.items() if kn.passed and k not in fam.positional_knobs]
    inputs = [f"{i}=None (optional)" if i in fam.optional_inputs else i for i in fam.inputs]
    args = [*inputs, *knobs] + ([f"*, any of {', '.join(by_name)} it takes"] if by_name else [])
    outs = ", ".join(f"{o} (optional)" if o in fam.optional_outputs else o for o in fam.outputs)
    return f"{fam.name}({', '.join(args)}) -> {outs}"


# what a call that cannot fit the family's signature says (a TypeError binding the arguments, or
# another number of outputs than the contract has): bad input, not a numerics failure. An output
# that is no tensor (a kernel that returns None) is what the kernel did: a failed row
CALL_PROBLEMS = ("outputs, expected", "TypeError: ")


def call_problem(message: str | None) -> bool:
    """Whether a failed call's message says it cannot take or give the family's signature."""
    m = message or ""
    if m.startswith("TypeError: "):
        return any(w in m for w in ("positional argument", "required argument", "unexpected keyword",
                                    "takes no arguments", "missing", "got multiple values"))
    return m.startswith("returned ") and "outputs, expected" in m
