"""Native PyTorch grouped MLP: what a model does without fused kernels (the baseline of parity and
bench). Activations compute in fp32 and round once; the grouped GEMM is a loop over experts, which
reads ``m_splits`` on the host (one synchronisation per call)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _halves(x: torch.Tensor, interleave: int):
    if interleave == 0:
        return x.chunk(2, dim=-1)
    v = x.unflatten(-1, (-1, 2, interleave))
    return v.select(-2, 0).flatten(-2), v.select(-2, 1).flatten(-2)


def _finish(f: torch.Tensor, scale, dtype):
    if scale is not None:
        f = f * scale.float()[:, None]
    return f.to(dtype)


def swiglu(x, scale=None, interleave: int = 0):
    a, b = _halves(x.float(), interleave)
    return _finish(F.silu(a) * b, scale, x.dtype)


def clamped_swiglu(x, scale=None, interleave: int = 0, limit: float = 7.0, alpha: float = 1.702, offset: float = 1.0):
    a, b = _halves(x.float(), interleave)
    a = a.clamp(max=limit)
    return _finish(a * torch.sigmoid(alpha * a) * (b.clamp(-limit, limit) + offset), scale, x.dtype)


def srelu(x, scale=None):
    return _finish(torch.square(F.relu(x.float())), scale, x.dtype)


def grouped_gemm(x, weight, m_splits, bias=None):
    parts = torch.split(x, m_splits.tolist())
    outs = [p @ weight[e].t() if bias is None else torch.addmm(bias[e], p, weight[e].t())
            for e, p in enumerate(parts)]
    return torch.cat(outs)


def grouped_wgrad(x, grad_out, m_splits, main_grad=None, accumulate=None):
    counts = m_splits.tolist()
    xs, gs = torch.split(x, counts), torch.split(grad_out, counts)
    flags = [True] * len(counts) if accumulate is None else accumulate.tolist()
    out = []
    for e, (xe, ge) in enumerate(zip(xs, gs)):
        dw = (ge.t().float() @ xe.float())
        if main_grad is not None and flags[e]:
            dw = main_grad[e].float() + dw
        out.append(dw.to(main_grad.dtype if main_grad is not None else x.dtype))
    return torch.stack(out)


_ACTS = {"swiglu": swiglu, "clamped_swiglu": clamped_swiglu, "srelu": lambda x, scale=None, interleave=0: srelu(x, scale)}


def grouped_mlp(x, fc1_weight, fc2_weight, m_splits, fc1_bias=None, fc2_bias=None, scale=None,
                activation: str = "swiglu", interleave: int = 0):
    h = grouped_gemm(x, fc1_weight, m_splits, fc1_bias)
    return grouped_gemm(_ACTS[activation](h, scale, interleave=interleave), fc2_weight, m_splits, fc2_bias)
