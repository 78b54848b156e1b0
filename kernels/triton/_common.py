"""Helpers shared by the Triton kernels: launch configuration and layout checks."""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..schedule import next_pow2  # noqa: F401  (the kernels import it from here)


def interpreted() -> bool:
    """True when Triton runs through its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# fixed at import: the kernels branch on it at compile time
INTERPRETED = tl.constexpr(interpreted())


@triton.jit
def cast(x, DTYPE: tl.constexpr):
    """``x.to(DTYPE)`` with round-to-nearest-even everywhere. Triton's CPU interpreter (3.6)
    converts fp32 to bf16 by truncating the low 16 bits, which doubles the rounding error of every
    bf16 store; there the rounding is done on the bits first. Compiled code converts directly."""
    if INTERPRETED:
        if DTYPE == tl.bfloat16:
            x = round_low_bits(x.to(tl.float32), 16)
    return x.to(DTYPE)


@triton.jit
def round_low_bits(v, DROP: tl.constexpr):
    """fp32 ``v`` rounded to nearest (ties to even) at ``DROP`` bits above the bottom of its
    mantissa, kept in fp32 with those bits zero: 16 is bf16, 13 is TF32. On the bits, so a
    finite value that rounds past the largest one becomes inf; callers that must keep inf and NaN
    as they are select them back."""
    bits = v.to(tl.uint32, bitcast=True)
    bits = (bits + ((1 << (DROP - 1)) - 1) + ((bits >> DROP) & 1)) & (0xFFFFFFFF ^ ((1 << DROP) - 1))
    return bits.to(tl.float32, bitcast=True)


# ln 2 split in two: the high part has 16 significant bits, so k * _LN2_HI is exact for |k| < 256
_LN2_HI = tl.constexpr(0.693145751953125)
_LN2_LO = tl.constexpr(1.428606820309417e-06)
_LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def exp(x):
    """``e**x`` in fp32 with an error of a few ulp whatever ``x``. ``tl.exp`` compiles to
    ``exp2(x * log2(e))``, and the rounding of that product is an error of ``|x| * 2**-24``
    relative, 5e-6 at x = -80: on rows 20-80 below their max (Sinkhorn's dead rows) it doubled
    the backward's error against PyTorch's ``exp`` on the GPU (the interpreter's ``tl.exp`` is
    numpy's and hides it; ``exp2`` of the rounded product there gives the GPU's bits). Here
    ``x = k ln2 + r`` with k an integer (Cody-Waite): ``k * ln2_hi`` is exact and so is the
    subtraction; only ``|r| <= ln2 / 2`` goes through the product, and ``2**k`` is exact. ``x``
    is held to [-150, 150] first (e**x is 0 or inf in fp32 well before; inf - inf would be NaN);
    NaN stays NaN."""
    x = tl.where(x < -150.0, -150.0, tl.where(x > 150.0, 150.0, x))
    k = tl.floor(x * _LOG2E + 0.5)
    r = (x - k * _LN2_HI) - k * _LN2_LO
    kh = tl.minimum(k, 127.0)  # 2**128 is inf in fp32: near the top, the rest joins r's factor
    return tl.exp2(r * _LOG2E + (k - kh)) * tl.exp2(kh)


def check_device(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t is None:
            continue
        if t.is_cuda == interpreted():
            where = "CPU tensors (the interpreter is on)" if interpreted() else "CUDA tensors"
            raise ValueError(f"the Triton kernels take {where}; got a tensor on {t.device}")


def require_contiguous(name: str, t: torch.Tensor) -> torch.Tensor:
    """The kernels index memory directly: they take contiguous tensors (the ``[s, b, n*C]`` view of
    a contiguous ``[s, b, n, C]`` tensor is one). Anything else is refused, never copied silently."""
    if not t.is_contiguous():
        raise ValueError(
            f"{name} must be contiguous for the Triton kernels (shape {tuple(t.shape)}, "
            f"strides {t.stride()}); call .contiguous() first"
        )
    return t


_BEST: dict = {}


def pick_config(key, configs: list, run, work: int = 1 << 30):
    """The fastest of ``configs`` for ``key`` (timed once per process on the GPU with CUDA events,
    then cached). The first one under the interpreter, where nothing can be timed, and for small
    problems (``work`` elements under 2^24), where the choice does not matter and compiling every
    candidate would. ``run(cfg)`` launches the kernel(s) and may be called several times."""
    if interpreted() or len(configs) == 1 or work < (1 << 24):
        return configs[0]
    if key in _BEST:
        return _BEST[key]
    best, best_t = configs[0], float("inf")
    for cfg in configs:
        try:
            run(cfg)  # compile and warm up
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(3):
                run(cfg)
            end.record()
            torch.cuda.synchronize()
            t = start.elapsed_time(end)
        except Exception:  # a configuration that does not compile (resources) is skipped
            continue
        if t < best_t:
            best, best_t = cfg, t
    _BEST[key] = best
    return best
