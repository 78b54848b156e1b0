"""A stand-in for Liger-Kernel's mHC public API (``liger_kernel.transformers.functional``) in plain
PyTorch, written from its public signatures and documented conventions: x is ``[..., n, C]``, phi
``[n*C, n^2+2n]``, three scalar alphas, eps inside the square root, a row softmax (plus eps) then
column-first Sinkhorn of ``tmax`` steps, ``H_post = post_mult * sigmoid``, post_res mixing with H
and taking no bias. None of Liger's code. Correct."""
import torch


def liger_mhc_coeffs(x, phi, b, alpha_pre, alpha_post, alpha_res, *, allow_fp32: bool = False, tmax: int = 20,
                     rms_eps: float = 1e-6, pre_eps: float = 0.0, sinkhorn_eps: float = 1e-6, post_mult: float = 2.0):
    if not allow_fp32:
        assert x.dtype in (torch.bfloat16, torch.float16), "x should be BF16/FP16 (set allow_fp32=True for FP32)"
    *lead, n, c = x.shape
    xf = x.reshape(-1, n * c).float()
    mix = (xf @ phi.float()) * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + rms_eps)
    pre = torch.sigmoid(mix[:, :n] * alpha_pre + b[:n]) + pre_eps
    post = torch.sigmoid(mix[:, n:2 * n] * alpha_post + b[n:2 * n]) * post_mult
    logits = (mix[:, 2 * n:] * alpha_res + b[2 * n:]).reshape(-1, n, n)
    mat = torch.softmax(logits, dim=-1) + sinkhorn_eps
    mat = mat / (mat.sum(dim=-2, keepdim=True) + sinkhorn_eps)
    for _ in range(tmax - 1):
        mat = mat / (mat.sum(dim=-1, keepdim=True) + sinkhorn_eps)
        mat = mat / (mat.sum(dim=-2, keepdim=True) + sinkhorn_eps)
    return pre.reshape(*lead, n), post.reshape(*lead, n), mat.reshape(*lead, n, n)


def liger_mhc_pre(x, h_pre):
    return torch.einsum("...nc,...n->...c", x.float(), h_pre.float()).to(x.dtype)


def liger_mhc_post_res(x, f_out, h_post, h_res):
    out = h_res.float() @ x.float() + h_post.float().unsqueeze(-1) * f_out.float().unsqueeze(-2)
    return out.to(x.dtype)
