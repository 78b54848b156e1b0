"""The GPU fault matrix's stand-ins (issue 89; tests/kernels/test_fault_matrix.py): Sinkhorns
correct in both directions (PyTorch's math) except for one fault, in the forward or in the
backward. ``sinkhorn_<fault>_<fwd|bwd>`` for each fault of :data:`FAULTS`:

- ``misaligned``: a Triton kernel loads a float32 one byte past an aligned address;
- ``illegal_address``: a Triton kernel stores 4 TiB past its output;
- ``device_assert``: an index out of range on the device (PyTorch's own index kernel asserts);
- ``segfault``: host code reads address 0;
- ``os_exit``: the process ends at once (exit code 7);
- ``hang``: a kernel that spins on the GPU for days (the host then waits for it);
- ``oom``: an allocation of a petabyte;
- ``unsynced_stream``: the result is copied into a zeroed output on a side stream after a 100 ms
  spin, and the caller's stream is never told to wait for it. (An output whose memory already
  held the result's bytes could not show the race: a Sinkhorn converged in fp32 leaves its last
  iterate, bit for bit, in the block the allocator hands out next.)

GPU only (the CUDA faults); loaded by file path."""
import ctypes
import os

import torch
import triton
import triton.language as tl

from mhctool.kernels.torch import mhc as native

FAULTS = ("misaligned", "illegal_address", "device_assert", "segfault", "os_exit", "hang", "oom", "unsynced_stream")


@triton.jit
def _load_misaligned(src, dst):
    p = (src.to(tl.pointer_type(tl.int8), bitcast=True) + 1).to(tl.pointer_type(tl.float32), bitcast=True)
    tl.store(dst, tl.load(p))


@triton.jit
def _store_far(dst, offset):
    tl.store(dst + offset + tl.arange(0, 16), tl.zeros([16], tl.float32))


def _misaligned(t):
    scratch = torch.zeros(64, dtype=torch.float32, device=t.device)
    _load_misaligned[(1,)](scratch, scratch)
    return t


def _illegal_address(t):
    _store_far[(1,)](t, 1 << 40)
    return t


def _device_assert(t):
    idx = torch.full((1,), 1 << 30, dtype=torch.long, device=t.device)
    t.reshape(-1)[idx] = 0.0  # PyTorch's index kernel: "index out of bounds" asserted on the device
    return t


def _segfault(t):
    ctypes.string_at(0)
    return t


def _os_exit(t):
    os._exit(7)


def _hang(t):
    torch.cuda._sleep(1 << 62)  # cycles: days at any clock; returns at once, the host waits at its next sync
    return t


def _oom(t):
    torch.empty(1 << 50, dtype=torch.uint8, device=t.device)
    return t


def _unsynced_stream(t):
    torch.cuda._sleep(1)  # the kernels it launches below, loaded before (a first launch may wait for the device)
    torch.empty_like(t).copy_(t)
    out = torch.zeros_like(t)  # on the caller's stream
    side = torch.cuda.Stream(device=t.device)
    side.wait_stream(torch.cuda.current_stream(t.device))  # t and out are ready there; the caller never waits on side
    t.record_stream(side)  # t's memory is not handed out again before side has read it
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # about 100 ms
        out.copy_(t)
    return out


_FAULT = {f: globals()[f"_{f}"] for f in FAULTS}


class _Sinkhorn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, iters, eps, fault):
        ctx.save_for_backward(logits)
        ctx.iters, ctx.eps, ctx.fault = iters, eps, fault
        out = native.sinkhorn(logits, iters, eps)
        return _FAULT[fault[0]](out) if fault[1] == "fwd" else out

    @staticmethod
    def backward(ctx, g):
        (logits,) = ctx.saved_tensors
        with torch.enable_grad():
            x = logits.detach().requires_grad_(True)
            (gx,) = torch.autograd.grad(native.sinkhorn(x, ctx.iters, ctx.eps), x, g)
        if ctx.fault[1] == "bwd":
            gx = _FAULT[ctx.fault[0]](gx)
        return gx, None, None, None


def _make(fault: str, direction: str):
    def sinkhorn(logits, iters=20, eps=1e-6):
        return _Sinkhorn.apply(logits, iters, eps, (fault, direction))
    sinkhorn.__name__ = sinkhorn.__qualname__ = f"sinkhorn_{fault}_{direction}"
    sinkhorn.__doc__ = f"Sinkhorn, correct but for {fault.replace('_', ' ')} in the {direction}."
    return sinkhorn


for _f in FAULTS:
    for _d in ("fwd", "bwd"):
        globals()[f"sinkhorn_{_f}_{_d}"] = _make(_f, _d)
