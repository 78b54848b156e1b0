"""Sinkhorns that fail in the middle of a training run (mhctool train keeps the steps before)."""
import os

import torch

from mhctool.kernels.torch import mhc as native

CALLS = {"n": 0}
# mhctool train's small test model calls Sinkhorn once a layer and step: two layers, so the 9th
# call is the first of step 5
FAIL_AT = 9


def sinkhorn_raises_at_step_5(logits, iters=20, eps=1e-6):
    CALLS["n"] += 1
    if CALLS["n"] >= FAIL_AT:
        raise RuntimeError("the kernel's launch failed")
    return native.sinkhorn(logits, iters, eps)


def sinkhorn_exits_at_step_5(logits, iters=20, eps=1e-6):
    CALLS["n"] += 1
    if CALLS["n"] >= FAIL_AT:
        os._exit(3)
    return native.sinkhorn(logits, iters, eps)


class _ExitsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, iters, eps):
        ctx.save_for_backward(logits)
        ctx.iters, ctx.eps = iters, eps
        return native.sinkhorn(logits, iters, eps)

    @staticmethod
    def backward(ctx, g):
        CALLS["backward"] = CALLS.get("backward", 0) + 1
        if CALLS["backward"] >= FAIL_AT:
            os._exit(3)
        (logits,) = ctx.saved_tensors
        with torch.enable_grad():
            x = logits.detach().requires_grad_(True)
            return torch.autograd.grad(native.sinkhorn(x, ctx.iters, ctx.eps), x, g)[0], None, None


def sinkhorn_backward_exits_at_step_5(logits, iters=20, eps=1e-6):
    """Its backward ends the process at step 5 (its forward is whole)."""
    return _ExitsInBackward.apply(logits, iters, eps)


def sinkhorn_detached(logits, iters=20, eps=1e-6):
    """The right forward, no gradient to the logits: the mapping's H_res rows learn nothing."""
    with torch.no_grad():
        out = native.sinkhorn(logits, iters, eps)
    return out
