"""The TE stand-in with planted defects: the Sinkhorn runs one iteration short, and the scale
puts eps outside the square root (1 / (sqrt(ms) + eps)); the rest is the correct stand-in."""
import importlib.util
from pathlib import Path
from typing import Optional

import torch

_spec = importlib.util.spec_from_file_location(
    "_te_standin", Path(__file__).resolve().parents[3].parent / "te_standin" / "transformer_engine" / "pytorch"
    / "triton" / "mhc.py")
_base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_base)

mhc_fused_aggregate = _base.mhc_fused_aggregate
mhc_fused_expand_combine = _base.mhc_fused_expand_combine
mhc_fused_projection = _base.mhc_fused_projection


def mhc_fused_sinkhorn(H_res, n=4, recompute_hist=True, iters=20):
    return _base.mhc_fused_sinkhorn(H_res, n, recompute_hist, iters - 1)


def mhc_fused_scale(H, alpha, beta, ms, n):
    N = 2 * n + n * n
    scale = torch.cat([alpha[0:1].expand(n), alpha[1:2].expand(n), alpha[2:3].expand(n * n)])
    h = H[:, :N] * scale / (torch.sqrt(ms) + _base.EPS).unsqueeze(-1) + beta
    return h[:, :n].sigmoid(), 2 * h[:, n:2 * n].sigmoid(), h[:, 2 * n:]


def mhc_generate_mix_and_aggregate(x: torch.Tensor, phi: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor,
                                   norm_weight: Optional[torch.Tensor] = None, use_tf32: bool = True,
                                   fused_grad_x_acc_buffer: Optional[torch.Tensor] = None, use_split_k: bool = False):
    """The correct stand-in's composition over this module's pieces: it carries both defects."""
    return _base._mix_and_aggregate((mhc_fused_projection, mhc_fused_scale, mhc_fused_sinkhorn, mhc_fused_aggregate),
                                    x, phi, alpha, beta, norm_weight, use_tf32)
