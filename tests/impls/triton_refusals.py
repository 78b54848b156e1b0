"""A Triton kernel whose compiler refuses some shapes: ``tl.arange`` over n entries, which must be
a power of two. The kernel copies the logits a row at a time (n = 2 or 4 only); the Sinkhorn is
then the native one's (a fixture for the refusal's handling, not a kernel under test)."""
import torch
import triton
import triton.language as tl

from mhctool.kernels.torch import mhc as native


@triton.jit
def _copy_rows(x_ptr, o_ptr, N: tl.constexpr):
    row = tl.program_id(0)
    i = tl.arange(0, N)
    tl.store(o_ptr + row * N + i, tl.load(x_ptr + row * N + i))


def sinkhorn_pow2_only(logits, iters=20, eps=1e-6):
    n = logits.shape[-1]
    x = logits.detach().contiguous()
    copy = torch.empty_like(x)
    _copy_rows[(x.numel() // n,)](x, copy, n)
    return native.sinkhorn(logits + (copy - x), iters, eps)
