"""Triton's CPU interpreter, checked before it judges anything.

The interpreter runs every program of a Triton kernel in numpy. Some of its operations compute
something else than the GPU does; a kernel run through them would be blamed for the
interpreter's fault. This module probes, once per process, the operations known to go wrong,
mends what mhctool can mend from outside the kernel, and says what stays wrong:

- ``tl.dot`` on bf16 operands: Triton's interpreter keeps bf16 tiles as their raw 16-bit
  patterns (numpy has no bf16) and hands those integers to ``np.matmul`` (Triton 3.6 and 3.9:
  a 16x32 by 32x16 product off by about 4e10). The mend widens bf16 operands to fp32 before the
  product, which is what the GPU's tensor cores compute (exact bf16 products, fp32 sums).

:func:`prepare` runs the probe, the mend and the probe again; :func:`fault` is why a 16-bit case
of an implementation that runs on the interpreter cannot be judged here (None when it can).
"""
from __future__ import annotations

import functools
import math
import os

import torch

PROBE_SHAPE = (16, 32, 16)  # M, K, N of the probe's product
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
_state: dict = {"mended": False, "errors": None}


def active() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=1)
def _dot_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def dot_probe(a_ptr, b_ptr, c_ptr, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr):
        m = tl.arange(0, M)
        k = tl.arange(0, K)
        n = tl.arange(0, N)
        a = tl.load(a_ptr + m[:, None] * K + k[None, :])
        b = tl.load(b_ptr + k[:, None] * N + n[None, :])
        tl.store(c_ptr + m[:, None] * N + n[None, :], tl.dot(a, b))

    return dot_probe


def dot_error(dtype: str) -> float:
    """The largest error of the interpreter's ``tl.dot`` on ``dtype`` operands against the exact
    product of the same (rounded) values, relative to the largest |product|; inf if it raised."""
    m, k, n = PROBE_SHAPE
    g = torch.Generator().manual_seed(1234)
    a = torch.randn(m, k, generator=g).to(_DTYPES[dtype])
    b = torch.randn(k, n, generator=g).to(_DTYPES[dtype])
    c = torch.full((m, n), math.nan, dtype=torch.float32)
    try:
        _dot_kernel()[(1,)](a, b, c, m, k, n)
    except Exception:  # noqa: BLE001 - a probe that cannot run says the operation cannot be trusted
        return math.inf
    exact = a.double() @ b.double()
    err = (c.double() - exact).abs().max().item()
    return err / exact.abs().max().item() if math.isfinite(err) else math.inf


def _widened(handle):
    """A bf16 operand handle as an fp32 one holding the same values."""
    import numpy as np
    import triton.language as tl
    from triton.runtime.interpreter import TensorHandle
    bits = np.asarray(handle.data).astype(np.uint32) << np.uint32(16)
    return TensorHandle(bits.view(np.float32), tl.float32)


def _mend_bf16_dot() -> None:
    import triton.language as tl
    from triton.runtime.interpreter import InterpreterBuilder
    original = InterpreterBuilder.create_dot
    if getattr(original, "_mhctool_mend", False):
        return

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype == tl.bfloat16:
            a = _widened(a)
        if b.dtype == tl.bfloat16:
            b = _widened(b)
        return original(self, a, b, d, input_precision, max_num_imprecise_acc)

    create_dot._mhctool_mend = True  # type: ignore[attr-defined]
    create_dot.__wrapped__ = original  # type: ignore[attr-defined]
    InterpreterBuilder.create_dot = create_dot
    _state["mended"] = True


# a product's error beyond this (relative to its largest element) is a wrong operation, not rounding
TOLERANCE = 1e-3


def prepare() -> dict[str, float]:
    """Probe the interpreter's 16-bit ``tl.dot`` (once per process), mend bf16 where it is wrong,
    probe again: ``{dtype: error after the mend}``. Nothing when the interpreter is off."""
    if _state["errors"] is not None or not active():
        return _state["errors"] or {}
    errors = {d: dot_error(d) for d in _DTYPES}
    if errors["bf16"] > TOLERANCE:
        try:
            _mend_bf16_dot()
        except Exception:  # noqa: BLE001 - another Triton's interpreter: leave it, the probe says so
            pass
        else:
            errors["bf16"] = dot_error("bf16")
    _state["errors"] = errors
    return errors


def mended() -> bool:
    """Whether mhctool widened the interpreter's bf16 products (``mhctool doctor`` says so)."""
    return bool(_state["mended"])


def fault(dtype: str) -> str | None:
    """Why a ``dtype`` case of a Triton kernel on the interpreter cannot be judged here, or None."""
    if dtype not in _DTYPES or not active():
        return None
    err = prepare().get(dtype, 0.0)
    if err <= TOLERANCE:
        return None
    import importlib.metadata
    try:
        version = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        version = "?"
    m, k, n = PROBE_SHAPE
    return (f"Triton {version}'s interpreter computes {dtype} tl.dot wrong here (relative error {err:.2g} on a "
            f"{m}x{k}x{n} product): judge {dtype} on a GPU")
