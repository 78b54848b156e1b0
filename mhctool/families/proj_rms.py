"""The mapping's projection and RMS: x2d @ weight^T and the rows' RMS (with eps inside or outside
the square root: a convention), in fp32 on the mapping path."""
from __future__ import annotations

from mhctool.core.inputs import InputFamily, beside, log_uniform, randn
from mhctool.core.shapes import Shape
from mhctool.families.contract import Cost, Family, Knob
from mhctool.references import mhc as ref

# where RMS's eps sits: outside (Megatron-LM, the default) or inside the square root
RMS_EPS = Knob("outside", ref.RMS_EPS)


def _proj(shape, g, knobs, row_scale=None):
    m, k, nh = shape.tokens, shape.k, shape.n_h
    x = randn(g, m, k)
    if row_scale is not None:
        x = x * beside(x, row_scale)
    return {"x2d": x, "weight": randn(g, nh, k) / k ** 0.5}


def _proj_tiny(shape, g, knobs):
    # rms from 1e-8 to 1e-4: eps (1e-6) dominates r, and where it sits in the formula shows
    return _proj(shape, g, knobs, log_uniform(g, -8, -4, shape.tokens, 1))


def _proj_huge(shape, g, knobs):
    # rms from 1e2 to 1e4: the sum of squares overflows fp16 and is large for bf16 accumulation
    return _proj(shape, g, knobs, log_uniform(g, 2, 4, shape.tokens, 1))


def long_k(shape: Shape) -> Shape:
    return shape.replace(c=max(shape.c, -(-8192 // shape.n) + 1))


def _cost(shape, e: int, f: int) -> Cost:
    T, K, N = shape.tokens, shape.k, shape.n_h
    return Cost(T * K * e + N * K * e + T * (N + 1) * f, 2 * T * K * e + N * K * e + N * K * f + T * (N + 1) * f,
                2.0 * T * N * K, 4.0 * T * N * K)


INPUTS = {f.name: f for f in [
    InputFamily("random", "unit normal x, weight scaled by 1/sqrt(K)", _proj),
    InputFamily("tiny_norm", "row rms 1e-8 to 1e-4: eps dominates r", _proj_tiny),
    InputFamily("huge_norm", "row rms 1e2 to 1e4: the sum of squares is huge", _proj_huge),
    InputFamily("long_k", "K of at least 8192: long reductions", _proj, long_k),
]}


FAMILY = Family(
    "proj_rms", ("x2d", "weight"), ("x2d", "weight"), (), ("proj", "r"),
    {"eps": Knob(1e-6, kind=float, zero_ok=True), "rms_eps": RMS_EPS},
    ("eps",),
    ref.proj_rms,
    conventions=("eps", "rms_eps"),
    input_families=INPUTS,
    kernels={"triton": "mhctool.kernels.triton.proj_rms:proj_rms", "cutile": "mhctool.kernels.cutile.proj_rms:proj_rms",
             # the TF32 variant: every product a TF32 product of operands rounded to TF32 (the precision the
             # mHC paper specifies; beside the IEEE one, what IEEE accuracy costs shows in one bench table)
             "triton-tf32": "mhctool.kernels.triton.proj_rms:proj_rms_tf32"},
    cost=_cost,
    matmul=True,
)
