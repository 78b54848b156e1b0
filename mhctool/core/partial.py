"""What a job in an isolation worker hands its parent before it ends: the forward's outputs,
before the backward runs, so that a backward that ends the process (a segfault, ``os._exit``, a
hang, a fault that takes the CUDA context) leaves the forward judged and the failure placed in the
backward. :mod:`mhctool.spread.isolation` sets the sender in its workers; elsewhere nothing is sent."""
from __future__ import annotations

from typing import Any, Callable

_sender: Callable[[Any], None] | None = None


def set_sender(fn: Callable[[Any], None] | None) -> None:
    global _sender
    _sender = fn


def report(obj: Any) -> bool:
    """Hand ``obj`` (tensors in it travel as the worker's transport sends them) to the parent, and
    return once it holds its own copy; False where this process is no isolation worker."""
    if _sender is None:
        return False
    _sender(obj)
    return True
