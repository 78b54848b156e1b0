"""Foreign kernel libraries, judged as they ship: one small adapter file per library, and the
public API an adapter is written with.

An adapter is a module (or any object with these attributes) that defines:

- ``NAME``: the prefix of its ``--impl NAME:FILE_OR_MODULE`` spec;
- ``load(target) -> module``: the library's module from a file, a folder or an import path;
- ``recognise(module) -> (generation, [Binding, ...])``: which public functions it found and how
  each maps onto an mhctool family.

A :class:`Binding` states, for one public function, the family it implements, how mhctool's
inputs (in the family's call order) become its arguments and how its outputs come back (``call``:
permutes, pads, split scalars happen there, outside the library's own code), the family knobs it
takes, the conventions it computes, the matmul precision it computes at and, where they differ
from mhctool's contract, the dtypes its inputs have where it is used (bench times it at those).
The library's code is called unchanged.

The adapter API is public: :class:`Binding`, :func:`load_path_or_module` and :func:`n_of` are
what an adapter of one's own imports from here. Where mhctool finds adapters (built in, entry
points, a file) is :mod:`mhctool.registry.adapters`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from mhctool.registry.loading import load_path_or_module

__all__ = ["TRITON_FP32_DOT", "Binding", "load_path_or_module", "n_of"]


# Triton's tl.dot on fp32 operands at its default precision: TF32 with truncated operands on a GPU,
# IEEE through the CPU interpreter (whatever input_precision asks); a Binding's precision
TRITON_FP32_DOT = {"cpu": "ieee", "cuda": "tf32_trunc"}


@dataclass(frozen=True)
class Binding:
    family: str
    function: str  # the library's public name (or names joined by '+', for a composed path)
    call: Callable  # call(module, *family inputs, **knobs) -> outputs in the family's order
    knobs: tuple[str, ...] = ()  # family knobs the function takes
    conventions: dict = field(default_factory=dict)  # convention knobs it computes
    # matmul precision it computes at by design (registry.PRECISIONS), or {device: precision}
    precision: str | dict = "ieee"
    variant: str = ""  # told apart in the implementation's name, e.g. "tf32"
    devices: tuple[str, ...] = ("cpu", "cuda")
    limit: Callable | None = None  # limit(shape) -> why it cannot run that shape, or None
    unavailable: str | None = None  # why the library says it cannot run here (its own availability check)
    # input name -> its conversion to the library's layout; ``call`` takes the converted tensors.
    # Conversions run outside the library's code, and bench runs them outside the timed region
    layouts: dict = field(default_factory=dict)
    # input name -> the dtype the library is used with where that differs from mhctool's contract:
    # ``"activation"`` (the run's activation dtype) or a format name (fp32, bf16, fp16). bench times
    # the library at these (parity keeps the contract's dtypes, which its reference is built on)
    dtypes: dict = field(default_factory=dict)
    # the activation dtypes of the cases it takes (a bf16-only kernel: ("bf16",)); others are skipped
    activations: tuple[str, ...] = ("fp32", "bf16", "fp16")
    # what the adapter computes around the library's own call beyond layouts (an add, a zeroed
    # buffer, a GEMM the library leaves to another package): bench times it with the call, says so
    glue: str = ""


def n_of(weight) -> int:
    """n from a mapping weight of n^2 + 2n rows."""
    return int(round((weight.shape[0] + 1) ** 0.5 - 1))
