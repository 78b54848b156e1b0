"""The grouped MoE MLP on the Triton kernels: grouped FC1 (device token counts) -> scaled
activation -> grouped FC2, forward and backward through the kernels' autograd Functions. Three
launches forward, no host synchronisation anywhere, so the whole step can be graph-captured."""
from __future__ import annotations

from . import glu
from .grouped_gemm import grouped_gemm


def grouped_mlp(x, fc1_weight, fc2_weight, m_splits, fc1_bias=None, fc2_bias=None, scale=None,
                activation: str = "swiglu", interleave: int = 0):
    """FC1 ``[G, 2F, H]`` (``[G, F, H]`` for sReLU) -> activation (times ``scale``) -> FC2 ``[G, H, F]``."""
    h = grouped_gemm(x, fc1_weight, m_splits, fc1_bias)
    a = glu.activation(activation, h, scale, interleave if activation != "srelu" else 0)
    return grouped_gemm(a, fc2_weight, m_splits, fc2_bias)
