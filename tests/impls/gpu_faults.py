"""A GPU kernel that faults: a Triton Sinkhorn wrapper whose kernel writes far out of bounds on
inputs with more than 100 tokens (an illegal memory access poisons the CUDA context, so only
isolation can judge the cases after it). Correct otherwise (the native math, so the later cases
pass)."""
import torch
import triton
import triton.language as tl

from mhctool.kernels.torch import mhc as native


@triton.jit
def _scribble(ptr, offset):
    tl.store(ptr + offset + tl.arange(0, 16), tl.zeros([16], tl.float32))


def sinkhorn_faults_on_large_inputs(logits, iters=20, eps=1e-6):
    out = native.sinkhorn(logits, iters, eps)
    if logits.numel() // (logits.shape[-1] ** 2) > 100:
        _scribble[(1,)](out, 1 << 40)  # 4 TiB past the output: never mapped
    return out


class _AggregateBackwardFaults(torch.autograd.Function):
    """The native aggregation; its backward writes far out of bounds unless C % 4 == 0, as a
    backward that loads float4 without checking the alignment faults (issue 76's table)."""

    @staticmethod
    def forward(ctx, x, h_pre):
        ctx.save_for_backward(x, h_pre)
        return native.h_aggregate(x, h_pre)

    @staticmethod
    def backward(ctx, g):
        x, h_pre = ctx.saved_tensors
        gx = h_pre.unsqueeze(-1) * g.unsqueeze(-2)
        gh = (x * g.unsqueeze(-2)).sum(-1)
        if x.shape[-1] % 4:
            _scribble[(1,)](gx, 1 << 40)  # asynchronous: the fault surfaces at the next synchronisation
        return gx, gh


def h_aggregate_backward_faults_unless_c4(x, h_pre):
    return _AggregateBackwardFaults.apply(x, h_pre)
