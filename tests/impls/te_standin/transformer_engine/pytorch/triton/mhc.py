"""A stand-in for TransformerEngine's transformer_engine/pytorch/triton/mhc.py in plain PyTorch,
written from its public signatures and documented conventions (streams innermost, log-domain
Sinkhorn without eps, H_res^T mixing, eps = fp32 machine epsilon inside the square root,
projection padded to 32 columns): none of TE's code. Correct."""
from typing import Optional

import torch

EPS = torch.finfo(torch.float32).eps


def mhc_fused_sinkhorn(H_res: torch.Tensor, n: int = 4, recompute_hist: bool = True, iters: int = 20):
    assert n == 4
    la = H_res.float()
    f = torch.zeros_like(la[..., :, 0])
    g = torch.zeros_like(la[..., 0, :])
    for _ in range(iters):
        f = -torch.logsumexp(la + g.unsqueeze(-2), dim=-1)
        g = -torch.logsumexp(la + f.unsqueeze(-1), dim=-2)
    return torch.exp(la + f.unsqueeze(-1) + g.unsqueeze(-2)).to(H_res.dtype)


def mhc_fused_aggregate(x: torch.Tensor, H_pre: torch.Tensor, n: int, use_tf32: bool = True,
                        fused_grad_x_acc_buffer: Optional[torch.Tensor] = None):
    """x (s, b, C, n) -> (s, b, C)."""
    return (x.float() @ H_pre.float().unsqueeze(-1)).squeeze(-1).to(x.dtype)


def mhc_fused_expand_combine(f: torch.Tensor, bias: Optional[torch.Tensor], H_post: torch.Tensor, x: torch.Tensor,
                             H_res: torch.Tensor, n: int, use_tf32: bool = True,
                             fused_grad_x_acc_buffer: Optional[torch.Tensor] = None):
    """(f + bias) H_post + x H_res, x (s, b, C, n) -> (s, b, C, n)."""
    branch = f.float() if bias is None else f.float() + bias.float()
    out = branch.unsqueeze(-1) * H_post.float().unsqueeze(-2) + x.float() @ H_res.float()
    return out.to(x.dtype)


def mhc_fused_projection(x: torch.Tensor, phi: torch.Tensor, use_tf32: bool = True,
                         norm_weight: Optional[torch.Tensor] = None,
                         fused_grad_x_acc_buffer: Optional[torch.Tensor] = None, use_split_k: bool = False):
    """(H [M, 32] fp32, zero beyond N; ms [M] = mean(x^2))."""
    xf = x.float()
    h = xf @ phi.float().t()
    padded = torch.nn.functional.pad(h, (0, 32 - h.shape[1]))
    return padded, xf.pow(2).mean(dim=-1)


def mhc_fused_scale(H: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor, ms: torch.Tensor, n: int):
    N = 2 * n + n * n
    scale = torch.cat([alpha[0:1].expand(n), alpha[1:2].expand(n), alpha[2:3].expand(n * n)])
    h = H[:, :N] * scale / torch.sqrt(ms + EPS).unsqueeze(-1) + beta
    return h[:, :n].sigmoid(), 2 * h[:, n:2 * n].sigmoid(), h[:, 2 * n:]


def _mix_and_aggregate(pieces, x, phi, alpha, beta, norm_weight=None, use_tf32=True):
    """The pre-path from ``pieces`` = (projection, scale, sinkhorn, aggregate): x (s, b, C, n) ->
    (out (s, b, C), H_post (s, b, n), H_res (s, b, n, n))."""
    projection, scale, sinkhorn, aggregate = pieces
    s, b, C, n = x.shape
    H, ms = projection(x.reshape(s * b, C * n), phi, use_tf32, norm_weight)
    H_pre, H_post, H_res = scale(H, alpha, beta, ms, n)
    H_res = sinkhorn(H_res.reshape(s, b, n, n), n, True, 20)
    return aggregate(x, H_pre.reshape(s, b, n), n, use_tf32), H_post.reshape(s, b, n), H_res


def mhc_generate_mix_and_aggregate(x: torch.Tensor, phi: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor,
                                   norm_weight: Optional[torch.Tensor] = None, use_tf32: bool = True,
                                   fused_grad_x_acc_buffer: Optional[torch.Tensor] = None, use_split_k: bool = False):
    """The pre-path from the pieces above."""
    return _mix_and_aggregate((mhc_fused_projection, mhc_fused_scale, mhc_fused_sinkhorn, mhc_fused_aggregate),
                              x, phi, alpha, beta, norm_weight, use_tf32)
