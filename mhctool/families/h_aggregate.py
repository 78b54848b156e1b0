"""H-aggregate: the n residual streams weighted by h_pre into the sublayer's input (the pre-path's
aggregation)."""
from __future__ import annotations

from mhctool.core.inputs import InputFamily, beside, log_uniform, rand, randn
from mhctool.core.shapes import Shape
from mhctool.families.contract import Cost, Family
from mhctool.references import mhc as ref


def long_c(shape: Shape) -> Shape:
    """At least 4099 channels: long reductions and odd tiles over C (h_post_bda's too)."""
    return shape.replace(c=max(shape.c, 4099))


def _agg(shape, g, knobs, x_scale=None):
    s, b, n, c = shape.s, shape.b, shape.n, shape.c
    x = randn(g, s, b, n, c)
    if x_scale is not None:
        x = x * beside(x, x_scale)
    return {"x": x, "h_pre": rand(g, s, b, n)}


def _agg_wide(shape, g, knobs):
    # per token and stream magnitudes from 1e-3 to 1e3
    return _agg(shape, g, knobs, log_uniform(g, -3, 3, shape.s, shape.b, shape.n, 1))


def _cost(shape, e: int, f: int) -> Cost:
    T, n, C = shape.tokens, shape.n, shape.c
    return Cost(T * n * C * e + T * C * e + T * n * f, 2 * T * n * C * e + T * C * e + 2 * T * n * f,
                2.0 * T * n * C, 4.0 * T * n * C)


FAMILY = Family(
    "h_aggregate", ("x", "h_pre"), ("x", "h_pre"), ("h_pre",), ("out",), {}, (), ref.h_aggregate,
    input_families={f.name: f for f in [
        InputFamily("random", "unit normal x, h_pre in (0, 1)", _agg),
        InputFamily("wide_range", "stream magnitudes 1e-3 to 1e3", _agg_wide),
        InputFamily("long_c", "C of at least 4099: long reductions, odd tiles", _agg, long_c),
    ]},
    kernels={"triton": "mhctool.kernels.triton.h_aggregate:h_aggregate",
             "cutile": "mhctool.kernels.cutile.h_aggregate:h_aggregate"},
    cost=_cost,
    matmul=True,
)
