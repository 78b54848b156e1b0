"""The CUDA context on autograd's device thread, before the code under test runs there.

Autograd runs a CUDA backward on a thread of its own per device. PyTorch makes the device
current there through the runtime API, which skips the call when the device number already
matches: a new thread then has no current *driver* context. PyTorch's own kernels cope (cuBLAS
prints "Attempting to run cuBLAS, but there was no current CUDA context!" and binds one); a
library that launches through the driver API (cuTile) fails with "invalid device context". On a
fresh isolation worker, where that thread made no CUDA call before, the first backward of such
a library would be an error row of mhctool's own making.

:func:`bound` wraps a function's CUDA outputs in an identity whose backward runs first on that
thread and makes the device's primary context current there (``cuCtxSetCurrent`` through the
driver library), so whatever the implementation's backward launches has its context.
"""
from __future__ import annotations

import ctypes
import functools

import torch


@functools.lru_cache(maxsize=1)
def _driver():
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:  # no driver library: nothing to bind (a CPU machine)
        return None


def bind_primary_context(device: torch.device) -> bool:
    """Make ``device``'s primary context current on the calling thread, if none is; True if one is
    current afterwards."""
    lib = _driver()
    if lib is None or device.type != "cuda":
        return False
    current = ctypes.c_void_p()
    if lib.cuCtxGetCurrent(ctypes.byref(current)) == 0 and current.value:
        return True
    index = device.index if device.index is not None else torch.cuda.current_device()
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    if lib.cuDeviceGet(ctypes.byref(dev), index) != 0:
        return False
    if lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) != 0:
        return False
    return lib.cuCtxSetCurrent(ctx) == 0


class _Bind(torch.autograd.Function):
    """Identity forward; the backward binds the context on the thread it runs on, then passes the
    gradients on unchanged."""

    @staticmethod
    def forward(ctx, *outs):
        ctx.device = next(o.device for o in outs)
        return tuple(o.view_as(o) for o in outs)

    @staticmethod
    def backward(ctx, *grads):
        bind_primary_context(ctx.device)
        return grads


def bound(outs: list) -> list:
    """``outs`` with the CUDA ones that carry a graph passed through :class:`_Bind` (values, shapes,
    strides and dtypes unchanged)."""
    at = [i for i, o in enumerate(outs) if isinstance(o, torch.Tensor) and o.is_cuda and o.requires_grad]
    if not at:
        return outs
    wrapped = _Bind.apply(*[outs[i] for i in at])
    out = list(outs)
    for i, w in zip(at, wrapped):
        out[i] = w
    return out
