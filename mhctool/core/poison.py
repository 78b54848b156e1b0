"""Output poisoning: kernels allocate outputs through :func:`empty`, which fills them with a
signalling-NaN bit pattern while the runner checks parity, so an element a kernel never writes
shows up as ``unwritten`` instead of passing as whatever the allocator left there."""
from __future__ import annotations

import contextlib

import torch

from mhctool.core.dtypes import poison

# process-wide, not per thread or context: autograd runs a CUDA backward on its own device thread,
# which a ContextVar set on the calling thread does not reach (an H200 with torch 2.11: a backward
# inside ``poisoning()`` saw it off, so its gradients were allocated unpoisoned); the device
# threads only read the flag while the caller waits in ``torch.autograd.grad``
_state = {"on": False}


@contextlib.contextmanager
def poisoning(enabled: bool = True):
    before, _state["on"] = _state["on"], enabled
    try:
        yield
    finally:
        _state["on"] = before


def enabled() -> bool:
    return _state["on"]


def empty(shape, dtype, device) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype, device=device)
    if _state["on"]:
        poison(t)
    return t


def empty_like(t: torch.Tensor, dtype=None) -> torch.Tensor:
    return empty(t.shape, dtype or t.dtype, t.device)
