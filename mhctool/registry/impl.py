"""An implementation of a kernel family: its backend, the devices, dtypes and knobs it supports,
the conventions and matmul precision it computes, and how the runner calls it."""
from __future__ import annotations

import functools
import importlib
import inspect
from dataclasses import dataclass, field
from typing import Callable

from mhctool.core import interpreter
from mhctool.core.environment import triton_interpreted
from mhctool.core.errors import UsageError
from mhctool.families import FAMILIES, signature


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
            self._fn = self.target if callable(self.target) else import_target(self.target)
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
            if device == "cpu" and not triton_interpreted():
                return "Triton runs on the CPU only through its interpreter (set TRITON_INTERPRET=1)"
            if device == "cuda" and triton_interpreted():
                return "TRITON_INTERPRET=1 is set: Triton kernels run on the CPU only"
        if dtype not in self.dtypes:
            return f"{self.name} takes {', '.join(self.dtypes)}, not {dtype}"
        if device == "cpu" and self.backend in ("triton", "external"):
            # a 16-bit product the interpreter computes wrong would blame the kernel: skipped, said why
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

    def takes(self, name: str) -> bool:
        """Whether the function has a parameter for input ``name``: by name, or at its position
        where no knob sits there. Only a family's optional inputs (h_post_bda's bias) may be
        missing; a function whose parameters cannot be read, or that takes ``**kwargs``, takes all."""
        fam = FAMILIES[self.kernel]
        params = self._params
        if name not in fam.optional_inputs or params is None or any(p.name == name for p in params):
            return True
        knobs = {k for knob in fam.knobs for k in (knob, *KNOB_ALIASES.get(knob, ()))}
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        i = fam.inputs.index(name)
        return i < len(positional) and positional[i].name not in knobs

    def missing_inputs(self) -> list[str]:
        """The family's optional inputs it has no parameter for (a bias-less h_post_bda's bias):
        it is called, probed and timed without them."""
        return [k for k in FAMILIES[self.kernel].optional_inputs if not self.takes(k)]

    def refuses(self, knobs: dict) -> str | None:
        """Why a case with these knobs is not for it (an optional input it has no parameter for,
        which the case has), or None."""
        fam = FAMILIES[self.kernel]
        for name in self.missing_inputs():
            if knobs.get(name, fam.knobs[name].default):
                return f"it takes no {name}: judged on the cases without one ({name}=False)"
        return None


# other names public kernels give a knob (Megatron's fused_sinkhorn takes ``num_iterations``)
KNOB_ALIASES: dict[str, tuple[str, ...]] = {
    "iters": ("num_iterations", "num_iters", "iterations", "n_iters", "sinkhorn_iters"),
    "eps": ("epsilon",),
    "transpose_res": ("transpose", "h_res_transposed"),
}


def import_target(target: str) -> Callable:
    """``"module:function"`` -> the function (a built-in implementation's target)."""
    mod_name, _, fn_name = target.partition(":")
    return getattr(importlib.import_module(mod_name), fn_name)


def check_callable(impl: Impl) -> None:
    """A UsageError naming the family's signature when ``impl`` cannot be called with the family's
    inputs and the knobs it takes (Python binds the parameters before it runs: no case would
    judge anything)."""
    fam = FAMILIES[impl.kernel]
    try:
        sig = inspect.signature(impl.fn)
    except (TypeError, ValueError):
        return
    # the call's arguments, each named by what it stands for
    pos, kw = fam.arguments({k: k if impl.takes(k) else None for k in fam.inputs}, {k: k for k in fam.knobs},
                            impl.accepts, impl.bind, impl.takes)
    try:
        sig.bind(*pos, **kw)
    except TypeError as e:
        raise UsageError(f"--impl {impl.name} cannot be called as {impl.kernel}: {e}; expected {signature(fam)}") \
            from None
