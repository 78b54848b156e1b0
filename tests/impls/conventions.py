"""Implementations for `mhctool identify`: legitimate variants (other conventions) and defects
that no convention explains. Plain PyTorch, fp32 math."""
import torch

from mhctool.kernels.torch import mhc as native


def sinkhorn_softmax_first(logits, iters=20, eps=1e-6):
    """Starts with a row softmax plus eps (the row step it replaces), as Megatron-LM's dev branch."""
    return native.sinkhorn(logits, iters, eps, stabilize="softmax")


def sinkhorn_clamp(logits, iters=20, eps=1e-6):
    """Divides by max(sum, eps) instead of sum + eps."""
    return native.sinkhorn(logits, iters, eps, eps_mode="clamp")


def sinkhorn_one_short(logits, iters=20, eps=1e-6):
    """Runs one iteration fewer than asked (an off-by-one in the loop bound)."""
    return native.sinkhorn(logits, iters - 1, eps)


def sinkhorn_log_domain(logits, iters=20, eps=1e-6):
    """Log-domain iterations with no eps at all (TransformerEngine's way), written here in torch."""
    lg = logits.float()
    for _ in range(iters):
        lg = lg - torch.logsumexp(lg, dim=-1, keepdim=True)
        lg = lg - torch.logsumexp(lg, dim=-2, keepdim=True)
    return torch.exp(lg).to(logits.dtype)


def sinkhorn_bf16_sums(logits, iters=20, eps=1e-6):
    """The defect: the matrix is kept in bf16 between steps (bf16 accumulation)."""
    p = torch.exp(logits.float() - logits.float().amax(-1, keepdim=True)).bfloat16()
    for _ in range(iters):
        p = p / (p.sum(-1, keepdim=True) + eps)
        p = p / (p.sum(-2, keepdim=True) + eps)
    return p.to(logits.dtype)


def sinkhorn_detached_sum(logits, iters=20, eps=1e-6):
    """The defect: the forward is right, but the sums are detached, so the backward is wrong."""
    lf = logits.float()
    p = torch.exp(lf - lf.amax(-1, keepdim=True).detach())
    for _ in range(iters):
        p = p / (p.sum(-1, keepdim=True).detach() + eps)
        p = p / (p.sum(-2, keepdim=True).detach() + eps)
    return p.to(logits.dtype)


def proj_rms_te(x2d, weight, eps=1e-6):
    """eps inside the square root and eps = fp32 machine epsilon, whatever it is asked for."""
    xf = x2d.float()
    return xf @ weight.float().t(), torch.rsqrt((xf * xf).mean(-1) + torch.finfo(torch.float32).eps)


def mapping_sigmoid_eps(x2d, weight, alpha, h_bias, eps=1e-6):
    """h_pre = sigmoid(.) + 1e-6, as Megatron-LM's dev branch."""
    return native.mapping(x2d, weight, alpha, h_bias, eps, compute_h_eps=1e-6)


from mhctool.kernels.torch import moe as native_moe  # noqa: E402


def clamped_swiglu_gate_only(x, scale=None, interleave=0, limit=7.0, alpha=1.702, offset=1.0):
    """Clamps the gate half only; the linear half is not clamped."""
    a, b = native_moe._halves(x.float(), interleave)
    a = a.clamp(max=limit)
    f = a * torch.sigmoid(alpha * a) * (b + offset)
    return (f if scale is None else f * scale[:, None]).to(x.dtype)


def clamped_swiglu_limit_10(x, scale=None, interleave=0, limit=7.0, alpha=1.702, offset=1.0):
    """Clamps at 10 whatever limit it is asked for."""
    return native_moe.clamped_swiglu(x, scale, interleave, 10.0, alpha, offset)
