"""Helpers shared by the Triton kernels: launch configuration and layout checks."""
from __future__ import annotations

import os

import torch
import triton


def interpreted() -> bool:
    """True when Triton runs through its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


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


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))
