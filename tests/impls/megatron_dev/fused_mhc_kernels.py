"""A stand-in for Megatron-LM's later (dev) fused mHC module, in plain PyTorch from its public
signatures and documented conventions: Sinkhorn starts from a row softmax plus eps, h_post_bda
mixes with H_res^T, and the mapping path is fused_proj_rms_compute_h with compute_h_eps on h_pre
and r = ||x|| / sqrt(K) as a fourth output. None of Megatron's code. Correct."""
import math
from typing import Optional, Tuple

import torch
from torch import Tensor


def fused_sinkhorn(input_logits: Tensor, num_iterations: int, eps: float = 1e-6) -> Tensor:
    p = torch.softmax(input_logits.float(), dim=-1) + eps
    p = p / (p.sum(dim=-2, keepdim=True) + eps)
    for _ in range(num_iterations - 1):
        p = p / (p.sum(dim=-1, keepdim=True) + eps)
        p = p / (p.sum(dim=-2, keepdim=True) + eps)
    return p.to(input_logits.dtype)


def fused_h_aggregate(x: Tensor, h_pre: Tensor) -> Tensor:
    return torch.einsum("sbnc,sbn->sbc", x.float(), h_pre.float()).to(x.dtype)


def fused_h_post_bda(h_res: Tensor, original_residual: Tensor, h_post: Tensor, x: Tensor,
                     bias: Optional[Tensor]) -> Tensor:
    branch = x.float() if bias is None else x.float() + bias.float()
    mixed = torch.einsum("sbji,sbjc->sbic", h_res.float(), original_residual.float())
    return (mixed + h_post.float().unsqueeze(-1) * branch.unsqueeze(-2)).to(original_residual.dtype)


def fused_proj_rms_compute_h(x: Tensor, weight: Tensor, alpha_pre: Tensor, alpha_post: Tensor, alpha_res: Tensor,
                             bias: Tensor, n: int, eps: float = 1e-6,
                             compute_h_eps: float = 1e-6) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    xf = x.float()
    proj = xf @ weight.float().t()
    r = xf.norm(dim=-1, keepdim=True) / math.sqrt(x.shape[-1])
    scale = torch.cat([alpha_pre.expand(n), alpha_post.expand(n), alpha_res.expand(weight.shape[0] - 2 * n)])
    h = proj * scale / (r + eps) + bias
    return h[:, :n].sigmoid() + compute_h_eps, 2 * h[:, n:2 * n].sigmoid(), h[:, 2 * n:], r
