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
            bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            x = bits.to(tl.float32, bitcast=True)
    return x.to(DTYPE)


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
