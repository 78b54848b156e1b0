"""Implementations written the ways public code writes them, none of them mhctool's contract, for
`mhctool identify`: which are legitimate variants (to be named, never accused) and which carry
a defect that their own outputs show. Plain PyTorch, fp32 math."""
import torch
import torch.nn.functional as F

from mhctool.kernels.torch import mhc as native
from mhctool.kernels.torch.mhc import truncate_to_tf32


def sinkhorn_colmax_col_first(logits, iters=20, eps=1e-6):
    """A common PyTorch form: subtract each column's max, exponentiate, then normalise columns
    first (``F.normalize(p=1)``), then rows. Never overflows; with columns first the column max is
    cancelled by the first normalisation, so in exact arithmetic it is also ``stabilize=none``."""
    p = torch.exp(logits - logits.amax(dim=-2, keepdim=True))
    for _ in range(iters):
        p = F.normalize(p, p=1, dim=-2)
        p = F.normalize(p, p=1, dim=-1)
    return p


def sinkhorn_exp_col_first(logits, iters=20, eps=1e-6):
    """The same without any max subtraction: overflows on large logits (a defect its outputs show)."""
    p = torch.exp(logits)
    for _ in range(iters):
        p = F.normalize(p, p=1, dim=-2)
        p = F.normalize(p, p=1, dim=-1)
    return p


def sinkhorn_log_col_first(logits, iters=20, eps=1e-6):
    """Log-domain iterations, columns first: ``log_softmax`` over columns, then rows. Nothing is
    exponentiated raw, so nothing can overflow."""
    lg = logits.float()
    for _ in range(iters):
        lg = torch.log_softmax(lg, dim=-2)
        lg = torch.log_softmax(lg, dim=-1)
    return torch.exp(lg).to(logits.dtype)


class _FixedPointBackward(torch.autograd.Function):
    """The contract's forward; a backward that differentiates only the converged matrix: the
    gradient is projected through the row and column normalisations with the final output, not
    with the iterates (right at convergence, off where the iteration has not converged)."""

    @staticmethod
    def forward(ctx, logits, iters, eps):
        out = native.sinkhorn(logits, iters, eps)
        ctx.save_for_backward(out)
        ctx.iters = iters
        return out

    @staticmethod
    def backward(ctx, g):
        (p,) = ctx.saved_tensors
        for _ in range(ctx.iters):
            g = g - (g * p).sum(dim=-2, keepdim=True)
            g = g - (g * p).sum(dim=-1, keepdim=True)
        return g * p, None, None


def sinkhorn_fixed_point_backward(logits, iters=20, eps=1e-6):
    return _FixedPointBackward.apply(logits, iters, eps)


class _TruncatedTf32(torch.autograd.Function):
    """Operands truncated to TF32 in the forward, the gradient too in the backward: what the
    tensor cores compute under Triton's ``tl.dot`` default on fp32."""

    @staticmethod
    def forward(ctx, t):
        return truncate_to_tf32(t)

    @staticmethod
    def backward(ctx, g):
        return truncate_to_tf32(g)


def proj_rms_tf32_trunc(x2d, weight, eps=1e-6):
    """A projection that multiplies at TF32 with truncated operands and sums K in chunks of 64 (a
    kernel's order, not PyTorch's), with the contract's RMS."""
    x = _TruncatedTf32.apply(x2d.float())
    w = _TruncatedTf32.apply(weight.float())
    k = x.shape[-1]
    proj = sum(x[:, i:i + 64] @ w[:, i:i + 64].t() for i in range(0, k, 64))
    xf = x2d.float()
    r = 1.0 / (xf.norm(dim=-1) / k ** 0.5 + eps)
    return proj, r


def mapping_sinkhorn_liger_like(x, weight, alpha, h_bias, eps=1e-6, iters=20, sinkhorn_eps=1e-6):
    """The mixing matrices the way Liger-Kernel computes them (eps inside the square root, a row
    softmax plus eps first), as a plain function nobody wrote an adapter for."""
    return native.mapping_sinkhorn(x, weight, alpha, h_bias, eps, iters, sinkhorn_eps, rms_eps="inside",
                                   stabilize="softmax")


def mix_aggregate_te_like(x, weight, alpha, h_bias, eps=1e-6, iters=20, sinkhorn_eps=1e-6):
    """The pre-path the way TransformerEngine computes it: eps = fp32 machine epsilon inside the
    square root, log-domain Sinkhorn without eps."""
    return native.mix_aggregate(x, weight, alpha, h_bias, torch.finfo(torch.float32).eps, iters, 0.0,
                                rms_eps="inside", domain="log")


def mapping_sinkhorn_eps_1e8(x, weight, alpha, h_bias, eps=1e-6, iters=20, sinkhorn_eps=1e-6):
    """Ignores the RMS eps it is asked for and uses 1e-8 (a defect that tiny norms show)."""
    return native.mapping_sinkhorn(x, weight, alpha, h_bias, 1e-8, iters, sinkhorn_eps)
