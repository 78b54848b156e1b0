"""Output poisoning: kernels allocate outputs through :func:`empty`, which fills them with a
signalling-NaN bit pattern while the runner checks parity, so an element a kernel never writes
shows up as ``unwritten`` instead of passing as whatever the allocator left there."""
from __future__ import annotations

import contextlib
import contextvars

import torch

from .dtypes import poison

_ENABLED = contextvars.ContextVar("mhctool_poison", default=False)


@contextlib.contextmanager
def poisoning(enabled: bool = True):
    token = _ENABLED.set(enabled)
    try:
        yield
    finally:
        _ENABLED.reset(token)


def enabled() -> bool:
    return _ENABLED.get()


def empty(shape, dtype, device) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype, device=device)
    if _ENABLED.get():
        poison(t)
    return t


def empty_like(t: torch.Tensor, dtype=None) -> torch.Tensor:
    return empty(t.shape, dtype or t.dtype, t.device)
