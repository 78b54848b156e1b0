"""A stand-in for issue 89's unofficial extension, wrapped as a file of functions (no
``:function``): its Sinkhorn and its post-mix are PyTorch's math; its aggregate's backward sums
``grad_h_pre`` four floats at a time through 8-byte loads, never checking that a row starts on an
8-byte boundary, which holds only where C is even (elsewhere: "CUDA error: misaligned address").
GPU only (the CPU interpreter loads at any address)."""
import torch
import triton
import triton.language as tl

from mhctool.kernels.torch import mhc as native


@triton.jit
def _halves(v):
    """An int64 holding two floats: (the float at the lower address, the one at the higher)."""
    lo = (v & 0xFFFFFFFF).to(tl.uint32).to(tl.float32, bitcast=True)
    hi = (v >> 32).to(tl.uint32).to(tl.float32, bitcast=True)
    return lo, hi


@triton.jit
def _grad_h_wide(g_ptr, x_ptr, out_ptr, C, N: tl.constexpr):
    """out[t, j] = sum_c g[t, c] x[t, j, c]; one token a program."""
    t = tl.program_id(0)
    two = tl.arange(0, 2)
    four = tl.arange(0, 4)
    for j in tl.static_range(N):
        x_row = x_ptr + (t * N + j) * C
        g_row = g_ptr + t * C
        acc = tl.zeros([2], tl.float32)
        for c0 in range(0, C - 3, 4):
            x_lo, x_hi = _halves(tl.load((x_row + c0).to(tl.pointer_type(tl.int64), bitcast=True) + two))
            g_lo, g_hi = _halves(tl.load((g_row + c0).to(tl.pointer_type(tl.int64), bitcast=True) + two))
            acc += x_lo * g_lo + x_hi * g_hi
        tail = (C // 4) * 4 + four
        rest = tl.load(x_row + tail, mask=tail < C, other=0.0) * tl.load(g_row + tail, mask=tail < C, other=0.0)
        tl.store(out_ptr + t * N + j, tl.sum(acc, 0) + tl.sum(rest, 0))


class _Aggregate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, h_pre):
        ctx.save_for_backward(x, h_pre)
        return native.h_aggregate(x, h_pre)

    @staticmethod
    def backward(ctx, g):
        x, h_pre = ctx.saved_tensors
        n, c = x.shape[-2], x.shape[-1]
        xf = x.float().contiguous().reshape(-1, n, c)
        gf = g.float().contiguous().reshape(-1, c)
        gh = torch.empty(xf.shape[0], n, dtype=torch.float32, device=x.device)
        _grad_h_wide[(xf.shape[0],)](gf, xf, gh, c, N=n)
        gx = (h_pre.float().unsqueeze(-1) * g.float().unsqueeze(-2)).to(x.dtype)
        return gx, gh.reshape(h_pre.shape).to(h_pre.dtype)


def sinkhorn(logits, iters=20, eps=1e-6):
    return native.sinkhorn(logits, iters, eps)


def h_aggregate(x, h_pre):
    return _Aggregate.apply(x, h_pre)


def h_post_bda(h_res, x, h_post, y, bias=None):
    return native.h_post_bda(h_res, x, h_post, y, bias)
