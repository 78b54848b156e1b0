"""The PR 3828 stand-in with planted defects of the kinds the real file has: the proj_rms backward
hard-codes eps=1e-8, proj_rms returns proj in the activation dtype (the fp32 mapping path rounded
to bf16), and h_aggregate sums its h_pre gradient in bf16 partial sums."""
import importlib.util
from pathlib import Path

import torch

_spec = importlib.util.spec_from_file_location(
    "_megatron_pr3828_standin", Path(__file__).resolve().parents[1] / "megatron_pr3828" / "fused_mhc_kernels.py")
_base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_base)

fused_sinkhorn = _base.fused_sinkhorn
fused_h_post_bda = _base.fused_h_post_bda


class _ProjRmsEps8(_base._ProjRms):
    @staticmethod
    def forward(ctx, x, weight, eps):  # proj in the activation dtype, as PR 3828 returns it
        proj, r = _base._ProjRms.forward(ctx, x, weight, eps)
        return proj.to(x.dtype), r

    @staticmethod
    def backward(ctx, grad_proj, grad_r):
        _base._ProjRms.BACKWARD_EPS = 1e-8
        try:
            return _base._ProjRms.backward(ctx, grad_proj, grad_r)
        finally:
            _base._ProjRms.BACKWARD_EPS = None


def fused_proj_rms(x, weight, eps=1e-6):
    return _ProjRmsEps8.apply(x, weight, eps)


class _AggregateBf16Sums(torch.autograd.Function):
    """Forward correct; the h_pre gradient sums over C in 64-wide chunks whose running total is
    kept in the input dtype (bf16 partial sums)."""

    @staticmethod
    def forward(ctx, x, h_pre):
        ctx.save_for_backward(x, h_pre)
        return (x.float() * h_pre.float().unsqueeze(-1)).sum(dim=-2).to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        x, h_pre = ctx.saved_tensors
        gx = (g.float().unsqueeze(-2) * h_pre.float().unsqueeze(-1)).to(x.dtype)
        prod = g.unsqueeze(-2).to(x.dtype) * x
        total = torch.zeros(h_pre.shape, dtype=x.dtype, device=x.device)
        for c0 in range(0, x.shape[-1], 64):
            total = total + prod[..., c0:c0 + 64].float().sum(dim=-1).to(x.dtype)
        return gx, total.to(h_pre.dtype)


def fused_h_aggregate(x, h_pre):
    return _AggregateBf16Sums.apply(x, h_pre)
