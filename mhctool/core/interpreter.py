"""Triton's CPU interpreter, checked before it judges anything.

The interpreter runs every program of a Triton kernel in numpy. Some of its operations compute
something else than the GPU does; a kernel run through them would be blamed for the
interpreter's fault. This module probes, once per process, the operations known to go wrong,
mends what mhctool can mend from outside the kernel, and says what stays wrong:

- ``tl.dot`` on bf16 operands: Triton's interpreter keeps bf16 tiles as their raw 16-bit
  patterns (numpy has no bf16) and hands those integers to ``np.matmul`` (Triton 3.6 and 3.9:
  a 16x32 by 32x16 product off by about 4e10). The mend widens bf16 operands to fp32 before the
  product, which is what the GPU's tensor cores compute (exact bf16 products, fp32 sums).

- fp32 -> bf16 casts (``x.to(tl.bfloat16)``, and so every bf16 store of an fp32 value): the
  interpreter truncates (Triton 3.6 and 3.9 pass no rounding mode on that path), where the GPU
  rounds to nearest, ties to even; asked for ``rtne`` explicitly, it rounds half up and, when the
  rounding carries into the exponent, can return a value off by a factor of two (1.99999 -> 1.0).
  The mend converts with integer arithmetic that rounds to nearest even (NaN stays NaN) and
  widens bf16 -> fp32 exactly, as the GPU does; :func:`cast_errors` probes it on values that
  round down, up, to even on ties, and across a power of two.

- ``tl.sum`` over any axis but a tile's last: numpy adds the rows one after another, so the
  error of a sum over a tile's tokens grows with their number; a GPU reduces a tile as a tree.
  The mend lays the summed axis out last and contiguous, where numpy sums pairwise (a tree of
  blocks of eight), so a kernel's reduction error grows as on the GPU: with the log of the count.

One more mend is for speed, not numbers: every call of a ``@triton.jit`` helper inside a kernel
patches ``triton.language`` again (hundreds of attributes, about 1.4 ms a call) although the
kernel's launch has already patched the same modules. Skipping the repeat changes nothing a
kernel computes (the patch depends only on which language modules the helper sees) and took a
third off h_post_bda's run on the CPU.

:func:`prepare` runs the probe, the mend and the probe again; :func:`fault` is why a 16-bit case
of an implementation that runs on the interpreter cannot be judged here (None when it can).
"""
from __future__ import annotations

import functools
import importlib.metadata
import inspect
import math
import os

import numpy as np
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
    import triton.language as tl
    from triton.runtime.interpreter import TensorHandle
    bits = np.asarray(handle.data).astype(np.uint32) << np.uint32(16)
    return TensorHandle(bits.view(np.float32), tl.float32)


def _mend(owner, name: str, make) -> bool:
    """Replace ``owner.name`` by ``make(original)``, once: the original stays reachable as the
    replacement's ``__wrapped__``. False where it was mended already."""
    original = getattr(owner, name)
    if getattr(original, "_mhctool_mend", False):
        return False
    new = make(original)
    new._mhctool_mend = True
    new.__wrapped__ = original
    setattr(owner, name, new)
    return True


def _mend_bf16_dot() -> None:
    import triton.language as tl
    from triton.runtime.interpreter import InterpreterBuilder

    def make(original):
        def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
            if a.dtype == tl.bfloat16:
                a = _widened(a)
            if b.dtype == tl.bfloat16:
                b = _widened(b)
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        return create_dot

    if _mend(InterpreterBuilder, "create_dot", make):
        _state["mended"] = True


def _mend_repeated_patching() -> None:
    """A helper's call skips ``_patch_lang`` when the launch in progress has patched the same
    language modules (see the module's docstring); the launch's own patch and its restore, and a
    helper that sees other modules, are as Triton does them."""

    from triton.runtime import interpreter as ti
    launches: list[frozenset] = []  # the language modules patched by the launch in progress

    class _Unchanged:
        def restore(self) -> None:
            pass

    def make(original):
        def patch_lang(fn):
            key = frozenset(id(v) for v in fn.__globals__.values()
                            if inspect.ismodule(v) and (v is ti.tl or v is ti.tl.core))
            if launches and key <= launches[-1]:
                return _Unchanged()
            scope = original(fn)
            if launches:  # a helper that sees other modules (Triton's own tl.sum sees tl.core): patched,
                launches[-1] = launches[-1] | key  # and left so until the launch ends, as Triton does
                return scope
            launches.append(key)
            restore = scope.restore

            def restore_and_end():
                try:
                    restore()
                finally:
                    launches.pop()
            scope.restore = restore_and_end
            return scope
        return patch_lang

    _mend(ti, "_patch_lang", make)


def _bf16_bits(data):
    """fp32 values (a numpy array) as bf16 bit patterns, rounded to nearest, ties to even."""
    bits = np.ascontiguousarray(data, dtype=np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    nan = (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    out = np.where(nan, (bits >> np.uint32(16)) | np.uint32(0x0040), rounded)
    return out.astype(np.uint16)


def _fp32_of_bf16(data):
    return (np.ascontiguousarray(data).view(np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def _mend_bf16_casts() -> None:
    import triton.language as tl
    from triton._C.libtriton import ir
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    def convert(src, dst_type, rounding_mode=None):
        a, b = src.dtype.scalar, dst_type.scalar
        if a == tl.float32 and b == tl.bfloat16:
            if rounding_mode == ir.ROUNDING_MODE.RTZ:
                bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32) >> np.uint32(16)
                return TensorHandle(bits.astype(np.uint16).reshape(np.shape(src.data)), b)
            return TensorHandle(_bf16_bits(src.data).reshape(np.shape(src.data)), b)
        if a == tl.bfloat16 and b == tl.float32:
            return TensorHandle(_fp32_of_bf16(src.data).reshape(np.shape(src.data)), b)
        return None

    def make(original):  # cast_impl(self, src, dst_type) and create_fp_to_fp(..., rounding_mode)
        def cast(self, src, dst_type, *rounding_mode):
            out = convert(src, dst_type, *rounding_mode)  # (a TensorHandle's truth is its elements')
            return original(self, src, dst_type, *rounding_mode) if out is None else out
        return cast

    if _mend(InterpreterBuilder, "cast_impl", make) | _mend(InterpreterBuilder, "create_fp_to_fp", make):
        _state["casts_mended"] = True


def _mend_sequential_sums() -> None:
    from triton.runtime.interpreter import ReduceOps

    def make(original):
        def pairwise_sum(self, input):
            data = input.handle.data
            axis = self.axis
            if axis is None or not np.issubdtype(data.dtype, np.floating) or data.ndim < 2 \
                    or axis in (-1, data.ndim - 1):
                return original(self, input)
            total = np.sum(np.ascontiguousarray(np.moveaxis(data, axis, -1)), axis=-1)
            if self.keep_dims:
                total = np.expand_dims(total, axis)
            return self.to_tensor(total, input.dtype)
        return pairwise_sum

    _mend(ReduceOps, "sum", make)


@functools.lru_cache(maxsize=1)
def _cast_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def cast_probe(x_ptr, y_ptr, z_ptr, w_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        x = tl.load(x_ptr + i)
        tl.store(y_ptr + i, x.to(tl.bfloat16))
        tl.store(z_ptr + i, x.to(tl.bfloat16, fp_downcast_rounding="rtne"))
        tl.store(w_ptr + i, tl.load(y_ptr + i).to(tl.float32))

    return cast_probe


CAST_PROBES = 3 * 64


def cast_errors() -> int:
    """How many of the interpreter's :data:`CAST_PROBES` casts (64 values, fp32 -> bf16 by
    default and with explicit rtne, bf16 -> fp32) differ from PyTorch's (round to nearest, ties
    to even; exact widening)."""
    g = torch.Generator().manual_seed(4321)
    special = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.0 + 2**-8 + 2**-9, 1.99999, -1.99999, 3.0e38,
                            -2.5, 1e-40, -3e-39, 0.0, -0.0, math.inf, -math.inf], dtype=torch.float32)
    x = torch.cat([special, torch.randn(64 - special.numel(), generator=g) * 100]).to(torch.float32)
    y = torch.empty(64, dtype=torch.bfloat16)
    z = torch.empty(64, dtype=torch.bfloat16)
    w = torch.empty(64, dtype=torch.float32)
    try:
        _cast_kernel()[(1,)](x, y, z, w, 64)
    except Exception:  # noqa: BLE001 - a probe that cannot run says the operation cannot be trusted
        return CAST_PROBES
    want = x.to(torch.bfloat16).view(torch.int16)
    bad = sum(int((got.view(torch.int16) != want).sum()) for got in (y, z))
    return bad + int((w.view(torch.int32) != y.to(torch.float32).view(torch.int32)).sum())


# a product's error beyond this (relative to its largest element) is a wrong operation, not rounding
TOLERANCE = 1e-3


def prepare() -> dict[str, float]:
    """Probe the interpreter's 16-bit ``tl.dot`` (once per process), mend bf16 where it is wrong,
    probe again: ``{dtype: error after the mend}``. Nothing when the interpreter is off."""
    if _state["errors"] is not None or not active():
        return _state["errors"] or {}
    try:
        _mend_repeated_patching()
    except Exception:  # noqa: BLE001 - another Triton's interpreter: it runs as it is, only slower
        pass
    try:
        _mend_sequential_sums()
    except Exception:  # noqa: BLE001 - another Triton's interpreter: its sums stay as they are
        pass
    if not _state.get("casts_mended"):  # probed again after the mend (a test's fresh probe), the count before it stays
        _state["casts_before"] = cast_errors()
    if _state["casts_before"]:
        try:
            _mend_bf16_casts()
        except Exception:  # noqa: BLE001 - another Triton's interpreter: leave it, the probe says so
            pass
    _state["casts"] = cast_errors()
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


def casts() -> tuple[int, int, bool]:
    """(wrong bf16 casts of 64 before any mend, after, whether mhctool mended them)."""
    prepare()
    return _state.get("casts_before", 0), _state.get("casts", 0), bool(_state.get("casts_mended"))


def fault(dtype: str) -> str | None:
    """Why a ``dtype`` case of a Triton kernel on the interpreter cannot be judged here, or None."""
    if dtype not in _DTYPES or not active():
        return None
    err = prepare().get(dtype, 0.0)
    try:
        version = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        version = "?"
    if dtype == "bf16" and _state.get("casts"):
        return (f"Triton {version}'s interpreter casts fp32 to bf16 wrong here ({_state['casts']} of {CAST_PROBES} probe casts "
                "differ from round to nearest even): judge bf16 on a GPU")
    if err <= TOLERANCE:
        return None
    m, k, n = PROBE_SHAPE
    return (f"Triton {version}'s interpreter computes {dtype} tl.dot wrong here (relative error {err:.2g} on a "
            f"{m}x{k}x{n} product): judge {dtype} on a GPU")
