"""Sinkhorns of the forms issue 90 met, each written here from its description: identify must give
each the same conclusion whatever it is asked (``--knob``), and claim only what the numbers show."""
import torch


def sinkhorn_floored_log(logits, iters=20):
    """The whole matrix's max subtracted, the log values floored at -60, then log-domain
    iterations without eps, rows first, autograd's backward: TransformerEngine's eps=0 domain=log
    except where entries sit more than 60 below the max (raised to -60)."""
    z = logits - logits.amax(dim=(-1, -2), keepdim=True)
    z = z.clamp_min(-60.0)
    for _ in range(iters):
        z = z - torch.logsumexp(z, -1, keepdim=True)
        z = z - torch.logsumexp(z, -2, keepdim=True)
    return torch.exp(z)


def sinkhorn_clamp_threshold_fast(logits, iters=20, eps=1e-6):
    """A hand-written kernel built with fast math: ``__expf(fminf(x, 20))`` without max
    subtraction, each division a multiply by the reciprocal, and eps a threshold: a row or column
    whose sum is at or below it is zeroed."""
    p = torch.exp2(torch.clamp(logits, max=20.0) * 1.4426950408889634)
    for _ in range(iters):
        for dim in (-1, -2):
            s = p.sum(dim, keepdim=True)
            p = torch.where(s > eps, p * torch.reciprocal(s), torch.zeros_like(p))
    return p


def _log_iterations(logits, iters, first, second):
    z = logits
    for _ in range(iters):
        z = z - torch.logsumexp(z, first, keepdim=True)
        z = z - torch.logsumexp(z, second, keepdim=True)
    return torch.exp(z)


def sinkhorn_log_autograd(logits, iters=20):
    """Log-domain iterations in plain PyTorch, no eps, rows first: autograd's backward."""
    return _log_iterations(logits, iters, -1, -2)


def sinkhorn_log_autograd_cols_first(logits, iters=20):
    """The same, columns first."""
    return _log_iterations(logits, iters, -2, -1)


def sinkhorn_softmax_autograd(logits, iters=20, eps=1e-6):
    """A row softmax plus eps first, then the iterations: autograd's backward."""
    p = torch.softmax(logits, -1) + eps
    for _ in range(iters):
        p = p / (p.sum(-2, keepdim=True) + eps)
        p = p / (p.sum(-1, keepdim=True) + eps)
    return p


def sinkhorn_rowmax_autograd(logits, iters=20, eps=1e-6):
    """Each row's max subtracted, linear iterations with eps added: autograd's backward."""
    p = torch.exp(logits - logits.amax(-1, keepdim=True))
    for _ in range(iters):
        p = p / (p.sum(-1, keepdim=True) + eps)
        p = p / (p.sum(-2, keepdim=True) + eps)
    return p


def sinkhorn_row_floored_log(logits, iters=20):
    """Each row's max subtracted, the log values floored at -30 (below each row's own max, where
    mhctool's floor is below the matrix's), log-domain iterations: no knob of mhctool's, a fit on
    every probe but the one whose entries sit far below their row's max."""
    z = (logits - logits.amax(-1, keepdim=True)).clamp_min(-30.0)
    for _ in range(iters):
        z = z - torch.logsumexp(z, -1, keepdim=True)
        z = z - torch.logsumexp(z, -2, keepdim=True)
    return torch.exp(z)


# the composites (issue 90: they carry every Sinkhorn knob): the native mapping, then the Sinkhorns
# above, as a library that fuses them would compute them
def _mapping(x, weight, alpha, h_bias, eps):
    from mhctool.kernels.torch import mhc as native
    s, b, n, c = x.shape
    h_pre, h_post, logits, _ = native.mapping(x.reshape(s * b, n * c), weight, alpha, h_bias, eps)
    return h_pre.reshape(s, b, n), h_post.reshape(s, b, n), logits.reshape(s, b, n, n)


def mapping_sinkhorn_floored_log(x, weight, alpha, h_bias, eps=1e-6, iters=20):
    """The mixing matrices with :func:`sinkhorn_floored_log` on the H_res logits."""
    h_pre, h_post, logits = _mapping(x, weight, alpha, h_bias, eps)
    return h_pre, h_post, sinkhorn_floored_log(logits, iters)


def mapping_sinkhorn_clamp_threshold_fast(x, weight, alpha, h_bias, eps=1e-6, iters=20, sinkhorn_eps=1e-6):
    """The mixing matrices with :func:`sinkhorn_clamp_threshold_fast` on the H_res logits."""
    h_pre, h_post, logits = _mapping(x, weight, alpha, h_bias, eps)
    return h_pre, h_post, sinkhorn_clamp_threshold_fast(logits, iters, sinkhorn_eps)


def mix_aggregate_clamped_sums(x, weight, alpha, h_bias, eps=1e-6, iters=20, sinkhorn_eps=1e-6):
    """The pre-path with Megatron PR 3828's Sinkhorn (each row's max subtracted, every sum clamped
    at eps: ``p / p.sum().clamp(min=eps)``), autograd's backward."""
    h_pre, h_post, logits = _mapping(x, weight, alpha, h_bias, eps)
    p = torch.exp(logits - logits.amax(-1, keepdim=True))
    for _ in range(iters):
        p = p / p.sum(-1, keepdim=True).clamp(min=sinkhorn_eps)
        p = p / p.sum(-2, keepdim=True).clamp(min=sinkhorn_eps)
    return torch.einsum("sbn,sbnc->sbc", h_pre, x), h_post, p


def mapping_sinkhorn_row_floored_log(x, weight, alpha, h_bias, eps=1e-6, iters=20):
    """The mixing matrices with :func:`sinkhorn_row_floored_log` (a floor below each row's max,
    no knob of mhctool's) on the H_res logits."""
    h_pre, h_post, logits = _mapping(x, weight, alpha, h_bias, eps)
    return h_pre, h_post, sinkhorn_row_floored_log(logits, iters)


def mix_aggregate_te_tf32(x, weight, alpha, h_bias, iters=20):
    """TransformerEngine's pre-path as its [tf32] variant computes it: eps = fp32 epsilon inside
    the square root, log-domain Sinkhorn without eps, the projection at TF32 with truncated
    operands in a kernel's order (``variants.proj_rms_tf32_trunc``'s); it takes no eps."""
    from mhctool.kernels.torch import mhc as native
    from variants import proj_rms_tf32_trunc
    s, b, n, c = x.shape
    x2d = x.reshape(s * b, n * c).float()
    proj, _ = proj_rms_tf32_trunc(x2d, weight)
    r = torch.rsqrt(x2d.pow(2).mean(dim=-1) + torch.finfo(torch.float32).eps)
    h_pre, h_post, logits = native.compute_h(proj, r, alpha.float(), h_bias.float(), n)
    h_res = native.sinkhorn(logits.reshape(s, b, n, n), iters, 0.0, domain="log")
    return native.h_aggregate(x, h_pre.reshape(s, b, n), "tf32_trunc"), h_post.reshape(s, b, n), h_res
