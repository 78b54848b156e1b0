"""A stand-in for Megatron-LM's PR 3828 fused mHC module, written in plain PyTorch from its public
signatures (names, argument order, output shapes and dtypes): none of Megatron's code. Correct."""
import math
from typing import Optional, Tuple

import torch
from torch import Tensor


def fused_sinkhorn(input_logits: Tensor, num_iterations: int, eps: float = 1e-6) -> Tensor:
    lf = input_logits.float()
    p = torch.exp(lf - lf.amax(dim=-1, keepdim=True))
    for _ in range(num_iterations):
        p = p / (p.sum(dim=-1, keepdim=True) + eps)
        p = p / (p.sum(dim=-2, keepdim=True) + eps)
    return p.to(input_logits.dtype)


class _HAggregate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, h_pre):
        ctx.save_for_backward(x, h_pre)
        return (x.float() * h_pre.float().unsqueeze(-1)).sum(dim=-2).to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x, h_pre = ctx.saved_tensors
        g = grad_out.float().unsqueeze(-2)
        # both gradients in x's dtype, as PR 3828's kernel writes them (autograd casts h_pre's back)
        return (g * h_pre.float().unsqueeze(-1)).to(x.dtype), (g * x.float()).sum(-1).to(x.dtype)


def fused_h_aggregate(x: Tensor, h_pre: Tensor) -> Tensor:
    return _HAggregate.apply(x, h_pre)


def fused_h_post_bda(h_res: Tensor, original_residual: Tensor, h_post: Tensor, x: Tensor,
                     bias: Optional[Tensor]) -> Tensor:
    """Returns the dtype of h_res, as PR 3828's does (fp32 ones: an fp32 output)."""
    branch = x.float() if bias is None else x.float() + bias.float()
    mixed = torch.einsum("sbij,sbjc->sbic", h_res.float(), original_residual.float())
    return (mixed + h_post.float().unsqueeze(-1) * branch.unsqueeze(-2)).to(h_res.dtype)


class _ProjRms(torch.autograd.Function):
    BACKWARD_EPS = None  # None: the forward's eps

    @staticmethod
    def forward(ctx, x, weight, eps):
        xf, wf = x.float(), weight.float()
        norm = xf.norm(dim=-1, keepdim=True)
        r = 1.0 / (norm / math.sqrt(x.shape[-1]) + eps)
        ctx.save_for_backward(x, weight, norm)
        ctx.eps = eps
        # proj and r [M, 1] in x's dtype, as PR 3828's cuTile kernel writes them (the contract's mapping
        # path is fp32: at 16-bit activations that rounding is the distance mhctool's model sees)
        return (xf @ wf.t()).to(x.dtype), r.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_proj, grad_r):
        x, weight, norm = ctx.saved_tensors
        xf, wf, k = x.float(), weight.float(), x.shape[-1]
        eps = ctx.eps if _ProjRms.BACKWARD_EPS is None else _ProjRms.BACKWARD_EPS
        rms = norm / math.sqrt(k)
        # r = 1 / (rms + eps): dr/dx = -x / (K rms (rms + eps)^2)
        dr = -grad_r.float() / (rms + eps) ** 2 * xf / (k * rms.clamp_min(1e-30))
        gx = grad_proj.float() @ wf + dr
        gw = grad_proj.float().t() @ xf
        return gx.to(x.dtype), gw.to(weight.dtype), None


def fused_proj_rms(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tuple[Tensor, Tensor]:
    return _ProjRms.apply(x, weight, eps)
