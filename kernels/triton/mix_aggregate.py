"""The mHC pre-path from mhctool's Triton kernels: mapping, then Sinkhorn (``mapping_sinkhorn``),
then aggregation (``mix_aggregate``).

Not one fused launch: the three kernels with their own forward and backward, composed so the
pre-path as a whole can be judged (and benched) beside composite kernels such as
TransformerEngine's ``mhc_generate_mix_and_aggregate``. Autograd connects them.
"""
from __future__ import annotations

from .h_aggregate import h_aggregate
from .mapping import mapping
from .sinkhorn import sinkhorn


def mapping_sinkhorn(x, weight, alpha, h_bias, eps: float = 1e-6, iters: int = 20, sinkhorn_eps: float = 1e-6):
    """``(h_pre[s, b, n], h_post[s, b, n], h_res[s, b, n, n])`` from ``x[s, b, n, C]`` (contiguous)."""
    s, b, n, c = x.shape
    h_pre, h_post, logits = mapping(x.reshape(s * b, n * c), weight, alpha, h_bias, eps)
    h_res = sinkhorn(logits.reshape(s, b, n, n), iters, sinkhorn_eps)
    return h_pre.reshape(s, b, n), h_post.reshape(s, b, n), h_res


def mix_aggregate(x, weight, alpha, h_bias, eps: float = 1e-6, iters: int = 20, sinkhorn_eps: float = 1e-6):
    """``(out[s, b, C], h_post[s, b, n], h_res[s, b, n, n])`` from ``x[s, b, n, C]`` (contiguous)."""
    h_pre, h_post, h_res = mapping_sinkhorn(x, weight, alpha, h_bias, eps, iters, sinkhorn_eps)
    return h_aggregate(x, h_pre), h_post, h_res
