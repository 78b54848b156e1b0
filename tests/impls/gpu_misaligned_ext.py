"""A stand-in for issue 89's unofficial extension, wrapped as a file of functions (no
``:function``): its Sinkhorn and its post-mix are PyTorch's math; its aggregate's backward sums
``grad_h_pre`` with float4 loads, and tells the compiler every row starts float4-aligned, which
holds only where C % 4 == 0 (elsewhere: "CUDA error: misaligned address"). GPU only."""
import torch
import triton
import triton.language as tl

from mhctool.kernels.torch import mhc as native


@triton.jit
def _grad_h_float4(g_ptr, x_ptr, out_ptr, C, N: tl.constexpr):
    """out[t, j] = sum_c g[t, c] x[t, j, c], four floats a load; one token a program."""
    t = tl.program_id(0)
    four = tl.arange(0, 4)
    g_row = tl.multiple_of(t * C, 4)  # the unchecked claim
    for j in tl.static_range(N):
        x_row = tl.multiple_of((t * N + j) * C, 4)
        acc = tl.zeros([4], tl.float32)
        for c0 in range(0, C - 3, 4):
            c4 = tl.multiple_of(c0, 4)
            acc += tl.load(x_ptr + x_row + c4 + four) * tl.load(g_ptr + g_row + c4 + four)
        tail = (C // 4) * 4 + four
        acc += tl.load(x_ptr + x_row + tail, mask=tail < C, other=0.0) * \
            tl.load(g_ptr + g_row + tail, mask=tail < C, other=0.0)
        tl.store(out_ptr + t * N + j, tl.sum(acc, 0))


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
        _grad_h_float4[(xf.shape[0],)](gf, xf, gh, c, N=n)
        gx = (h_pre.float().unsqueeze(-1) * g.float().unsqueeze(-2)).to(x.dtype)
        return gx, gh.reshape(h_pre.shape).to(h_pre.dtype)


def sinkhorn(logits, iters=20, eps=1e-6):
    return native.sinkhorn(logits, iters, eps)


def h_aggregate(x, h_pre):
    return _Aggregate.apply(x, h_pre)


def h_post_bda(h_res, x, h_post, y, bias=None):
    return native.h_post_bda(h_res, x, h_post, y, bias)
