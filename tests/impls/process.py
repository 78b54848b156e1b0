"""Implementations that misbehave as processes rather than numerically: each must end in a
failed row with the reason, a written report and exit code 1 (or 130 when interrupted)."""
import ctypes
import os
import sys
import time
from pathlib import Path

import torch

from mhctool.kernels.torch import mhc as native


def sinkhorn_sys_exit(logits, iters=20, eps=1e-6):
    """Calls sys.exit(0): a gate built on mhctool must not pass because of it."""
    sys.exit(0)


def sinkhorn_os_exit(logits, iters=20, eps=1e-6):
    """Ends the process at once, past every handler."""
    os._exit(0)


def sinkhorn_segfault(logits, iters=20, eps=1e-6):
    """Reads address 0, as a bad pointer in an extension does."""
    ctypes.string_at(0)


def sinkhorn_hangs(logits, iters=20, eps=1e-6):
    """Never returns (a deadlock, a spin on a flag)."""
    while True:
        time.sleep(1)


def sinkhorn_crashes_on_large_inputs(logits, iters=20, eps=1e-6):
    """Correct, except that it crashes on inputs with more than 100 tokens: the cases after the
    crash must still be judged (and pass)."""
    if logits.numel() // (logits.shape[-1] ** 2) > 100:
        ctypes.string_at(0)
    return native.sinkhorn(logits, iters, eps)


def sinkhorn_hangs_marked(logits, iters=20, eps=1e-6):
    """Hangs in every call; tells a test it started through $MHCTOOL_TEST_MARKER."""
    marker = os.environ.get("MHCTOOL_TEST_MARKER")
    if marker:
        Path(marker).touch()
    while True:
        time.sleep(1)


def sinkhorn_hangs_later(logits, iters=20, eps=1e-6):
    """Correct for its first $MHCTOOL_TEST_CALLS calls (12 unset; counted in a file beside
    $MHCTOOL_TEST_MARKER, over every process), then touches the marker and hangs: a run has
    measured something when only a second signal can stop it."""
    marker = os.environ.get("MHCTOOL_TEST_MARKER")
    if marker:
        with open(f"{marker}.calls", "a") as f:
            f.write(".")
        if Path(f"{marker}.calls").stat().st_size > int(os.environ.get("MHCTOOL_TEST_CALLS", "12")):
            Path(marker).touch()
            while True:
                time.sleep(1)
    return native.sinkhorn(logits, iters, eps)


def sinkhorn_slow(logits, iters=20, eps=1e-6):
    """Correct but slow (0.5 s a call); tells a test it started through $MHCTOOL_TEST_MARKER."""
    marker = os.environ.get("MHCTOOL_TEST_MARKER")
    if marker:
        Path(marker).touch()
    time.sleep(0.5)
    return native.sinkhorn(logits, iters, eps)


class _BackwardEnds(torch.autograd.Function):
    """PyTorch's Sinkhorn forward; the backward ends the process as ``how`` says."""

    @staticmethod
    def forward(ctx, logits, iters, eps, how):
        ctx.how = how
        return native.sinkhorn(logits, iters, eps)

    @staticmethod
    def backward(ctx, g):
        if ctx.how == "exit":
            os._exit(5)
        if ctx.how == "segfault":
            ctypes.string_at(0)
        while True:
            time.sleep(1)


def sinkhorn_backward_exits(logits, iters=20, eps=1e-6):
    """A correct forward whose backward calls os._exit(5)."""
    return _BackwardEnds.apply(logits, iters, eps, "exit")


def sinkhorn_backward_segfaults(logits, iters=20, eps=1e-6):
    """A correct forward whose backward reads address 0."""
    return _BackwardEnds.apply(logits, iters, eps, "segfault")


def sinkhorn_backward_hangs(logits, iters=20, eps=1e-6):
    """A correct forward whose backward never returns."""
    return _BackwardEnds.apply(logits, iters, eps, "hang")
