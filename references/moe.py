"""float64 references for the grouped MoE MLP (the grouped-MLP section of DESIGN.md).

Plain PyTorch, one formula a line, in whatever dtype it is given (the runner passes float64).

* Activations take the FC1 output ``x[M, 2F]`` (GLU) or ``x[M, F]`` (sReLU). GLU inputs hold the
  activated half ``a`` and the linear half ``b``: ``[a | b]`` when ``interleave == 0``, else blocks
  of ``interleave`` columns ``[a0:k, b0:k, ak:2k, bk:2k, ...]``. An optional per-token ``scale[M]``
  multiplies the output; its gradient is ``sum_j g_ij f_ij`` with ``f`` the unscaled output.
* ``grouped_gemm``: rows of ``x`` are grouped by expert, ``m_splits[e]`` rows each, in order;
  ``y_e = x_e W_e^T``. ``grouped_wgrad``: ``dW_e = dy_e^T x_e``, written, or added to ``main_grad``
  for the experts whose ``accumulate`` flag is set (a zero-token expert adds nothing).
* ``grouped_mlp``: FC1 -> activation -> FC2 per expert, optional biases.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = ("swiglu", "clamped_swiglu", "srelu")


def split_glu(x: torch.Tensor, interleave: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(a, b)``: the activated and the linear half of a GLU input ``[..., 2F]``."""
    two_f = x.shape[-1]
    if interleave == 0:
        return x[..., : two_f // 2], x[..., two_f // 2:]
    blocks = x.reshape(*x.shape[:-1], two_f // (2 * interleave), 2, interleave)
    return blocks[..., 0, :].flatten(-2), blocks[..., 1, :].flatten(-2)


def deinterleave(x: torch.Tensor, interleave: int, dim: int = -1) -> torch.Tensor:
    """Interleaved ``[a0:k, b0:k, ...]`` along ``dim`` -> ``[a | b]``."""
    xm = x.movedim(dim, -1)
    a, b = split_glu(xm, interleave)
    return torch.cat([a, b], dim=-1).movedim(-1, dim)


def interleave_glu(x: torch.Tensor, interleave: int, dim: int = -1) -> torch.Tensor:
    """``[a | b]`` along ``dim`` -> interleaved ``[a0:k, b0:k, ...]`` (the inverse of deinterleave)."""
    xm = x.movedim(dim, -1)
    half = xm.shape[-1] // 2
    a = xm[..., :half].reshape(*xm.shape[:-1], half // interleave, 1, interleave)
    b = xm[..., half:].reshape(*xm.shape[:-1], half // interleave, 1, interleave)
    return torch.cat([a, b], dim=-2).flatten(-3).movedim(-1, dim)


def _scaled(f: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    return f if scale is None else f * scale.unsqueeze(-1)


def swiglu(x: torch.Tensor, scale: torch.Tensor | None = None, *, interleave: int = 0) -> torch.Tensor:
    """``silu(a) * b`` (times ``scale`` per token)."""
    a, b = split_glu(x, interleave)
    return _scaled(F.silu(a) * b, scale)


def clamped_swiglu(x: torch.Tensor, scale: torch.Tensor | None = None, *, interleave: int = 0,
                   limit: float = 7.0, alpha: float = 1.702, offset: float = 1.0) -> torch.Tensor:
    """``a_c * sigmoid(alpha * a_c) * (clamp(b, -limit, limit) + offset)`` with ``a_c = min(a, limit)``."""
    a, b = split_glu(x, interleave)
    a_c = torch.clamp(a, max=limit)
    b_c = torch.clamp(b, min=-limit, max=limit) + offset
    return _scaled(a_c * torch.sigmoid(alpha * a_c) * b_c, scale)


def srelu(x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """``relu(x)^2`` (times ``scale`` per token)."""
    return _scaled(torch.relu(x) ** 2, scale)


def apply_activation(name: str, x: torch.Tensor, scale: torch.Tensor | None = None, interleave: int = 0) -> torch.Tensor:
    if name == "swiglu":
        return swiglu(x, scale, interleave=interleave)
    if name == "clamped_swiglu":
        return clamped_swiglu(x, scale, interleave=interleave)
    if name == "srelu":
        return srelu(x, scale)
    raise ValueError(f"activation must be one of {ACTIVATIONS}, got {name!r}")


def _segments(m_splits: torch.Tensor) -> list[tuple[int, int]]:
    bounds = [0] + torch.cumsum(m_splits.to("cpu", torch.int64), 0).tolist()
    return list(zip(bounds[:-1], bounds[1:]))


def grouped_gemm(x: torch.Tensor, weight: torch.Tensor, m_splits: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """``y[rows of e] = x[rows of e] @ weight[e]^T (+ bias[e])``; ``weight`` is ``[G, N, K]``."""
    outs = []
    for e, (lo, hi) in enumerate(_segments(m_splits)):
        y = x[lo:hi] @ weight[e].transpose(0, 1)
        outs.append(y if bias is None else y + bias[e])
    return torch.cat(outs, dim=0)


def grouped_wgrad(x: torch.Tensor, grad_out: torch.Tensor, m_splits: torch.Tensor,
                  main_grad: torch.Tensor | None = None, accumulate: torch.Tensor | None = None) -> torch.Tensor:
    """``dW[e] = grad_out[rows of e]^T @ x[rows of e]`` (``[G, N, K]``); with ``main_grad``, the
    result is ``main_grad[e] + dW[e]`` for experts whose ``accumulate[e]`` is set, ``dW[e]`` for
    the others."""
    dws = [grad_out[lo:hi].transpose(0, 1) @ x[lo:hi] for lo, hi in _segments(m_splits)]
    dw = torch.stack(dws)
    if main_grad is None:
        return dw
    acc = torch.ones(len(dws), dtype=torch.bool) if accumulate is None else accumulate.to("cpu", torch.bool)
    return torch.where(acc.view(-1, 1, 1).to(dw.device), main_grad + dw, dw)


def grouped_mlp(x: torch.Tensor, fc1_weight: torch.Tensor, fc2_weight: torch.Tensor, m_splits: torch.Tensor,
                fc1_bias: torch.Tensor | None = None, fc2_bias: torch.Tensor | None = None,
                scale: torch.Tensor | None = None, *, activation: str = "swiglu",
                interleave: int = 0) -> torch.Tensor:
    """FC1 ``[G, 2F, H]`` (``[G, F, H]`` for sReLU) -> activation (times ``scale``) -> FC2 ``[G, H, F]``."""
    h = grouped_gemm(x, fc1_weight, m_splits, fc1_bias)
    a = apply_activation(activation, h, scale, interleave)
    return grouped_gemm(a, fc2_weight, m_splits, fc2_bias)
