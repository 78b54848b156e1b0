"""Each family's bytes and flops at a shape: the memory-roofline model that bench times against
and the footprint that decides where a case fits."""
from __future__ import annotations

from dataclasses import dataclass

from mhctool.core.dtypes import FORMATS
from mhctool.core.errors import UsageError
from mhctool.core.shapes import MoeShape


@dataclass(frozen=True)
class Model:
    bytes_fwd: float
    bytes_bwd: float
    flops_fwd: float
    flops_bwd: float


def _moe_model(kernel: str, shape: MoeShape, e: int, f: int) -> Model:
    T, H, F, G = shape.tokens, shape.hidden, shape.ffn, shape.experts
    if kernel in ("swiglu", "clamped_swiglu", "srelu"):
        W = F if kernel == "srelu" else 2 * F
        return Model(T * W * e + T * f + T * F * e, 2 * T * W * e + T * F * e + 2 * T * f, 0.0, 0.0)
    if kernel == "grouped_gemm":
        return Model(T * H * e + G * F * H * e + T * F * e, 2 * T * H * e + 2 * G * F * H * e + T * F * e,
                     2.0 * T * H * F, 4.0 * T * H * F)
    if kernel == "grouped_wgrad":
        return Model(T * H * e + T * F * e + 2 * G * F * H * f, 0.0, 2.0 * T * H * F, 0.0)
    W = 2 * F  # grouped_mlp with its default SwiGLU
    fwd = T * H * e + G * W * H * e + G * H * F * e + 2 * T * W * e + 2 * T * F * e + T * H * e + T * f
    return Model(fwd, 2 * fwd, 2.0 * T * H * (W + F), 4.0 * T * H * (W + F))


def model(kernel: str, shape, dtype: str) -> Model:
    e = FORMATS[dtype].torch_dtype.itemsize
    f = 4
    if isinstance(shape, MoeShape):
        return _moe_model(kernel, shape, e, f)
    T, n, C = shape.tokens, shape.n, shape.c
    K, N = shape.k, shape.n_h
    if kernel == "sinkhorn":
        # the mapping path: logits are fp32 in the model whatever the activation dtype
        return Model(2 * T * n * n * f, 3 * T * n * n * f, 0.0, 0.0)
    if kernel == "h_aggregate":
        return Model(T * n * C * e + T * C * e + T * n * f,
                     2 * T * n * C * e + T * C * e + 2 * T * n * f,
                     2.0 * T * n * C, 4.0 * T * n * C)
    if kernel == "h_post_bda":
        small = T * (n * n + n) * f
        return Model(2 * T * n * C * e + T * C * e + small + C * e,
                     3 * T * n * C * e + 2 * T * C * e + 2 * small + 2 * C * e,
                     2.0 * T * n * (n + 1) * C, 4.0 * T * n * (n + 1) * C)
    if kernel in ("mapping", "mapping_sinkhorn"):
        # proj_rms + compute_h (then Sinkhorn on chip): the same x traffic, 2n + n^2 fp32 outputs
        return Model(T * K * e + N * K * e + T * N * f,
                     2 * T * K * e + N * K * e + N * K * f + 2 * T * N * f,
                     2.0 * T * N * K, 4.0 * T * N * K)
    if kernel == "mix_aggregate":  # x read twice (projection, aggregation); out written
        return Model(2 * T * K * e + N * K * e + T * C * e + T * (n + n * n) * f,
                     3 * T * K * e + T * C * e + N * K * e + N * K * f + 2 * T * (n + n * n) * f,
                     2.0 * T * N * K + 2.0 * T * K, 4.0 * T * N * K + 4.0 * T * K)
    if kernel == "proj_rms":
        return Model(T * K * e + N * K * e + T * (N + 1) * f,
                     2 * T * K * e + N * K * e + N * K * f + T * (N + 1) * f,
                     2.0 * T * N * K, 4.0 * T * N * K)
    raise UsageError(f"no bytes/flops model for kernel {kernel}")
