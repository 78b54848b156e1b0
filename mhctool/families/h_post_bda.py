"""H_post * bias-dropout-add: the layer's output mixed back into the n streams, out = H_res x +
h_post (y + bias), with H_res^T as Megatron-LM's dev branch and TransformerEngine write it (a
convention), and the branch dropped out over the n streams where ``dropout`` is set, by the
contract's counter-based mask (:mod:`mhctool.references.dropout`): part of the contract, keyed by
``dropout_seed`` and ``dropout_offset``, never a convention."""
from __future__ import annotations

import torch

from mhctool.core.inputs import InputFamily, beside, log_uniform, rand, randn
from mhctool.core.shapes import Shape
from mhctool.families.contract import Cost, Family, Knob
from mhctool.families.h_aggregate import long_c
from mhctool.references import dropout
from mhctool.references import mhc as ref


def _long_tokens(shape: Shape) -> Shape:
    return shape.replace(s=max(shape.s, -(-4099 // shape.b)))


def _mixing(g, s, b, n):
    return torch.softmax(2.0 * randn(g, s, b, n, n), dim=-1)


def _bda(shape, g, knobs, x_scale=None):
    s, b, n, c = shape.s, shape.b, shape.n, shape.c
    x = randn(g, s, b, n, c)
    y = randn(g, s, b, c)
    if x_scale is not None:
        x = x * beside(x, x_scale)
        y = y * beside(y, x_scale[..., 0, :])
    out = {"h_res": _mixing(g, s, b, n), "x": x, "h_post": 2 * rand(g, s, b, n), "y": y}
    out["bias"] = randn(g, c) if knobs.get("bias", True) else None
    return out


def _bda_wide(shape, g, knobs):
    return _bda(shape, g, knobs, log_uniform(g, -3, 3, shape.s, shape.b, shape.n, 1))


def _cost(shape, e: int, f: int) -> Cost:
    T, n, C = shape.tokens, shape.n, shape.c
    small = T * (n * n + n) * f
    return Cost(2 * T * n * C * e + T * C * e + small + C * e,
                3 * T * n * C * e + 2 * T * C * e + 2 * small + 2 * C * e,
                2.0 * T * n * (n + 1) * C, 4.0 * T * n * (n + 1) * C)


def _branches(inputs: dict, knobs: dict) -> dict:
    """With dropout, each output element is the mixed streams plus, where the contract keeps it,
    the scaled branch ``h_post (y + bias) / (1 - p)``: that share and the contract's mask."""
    p = knobs.get("dropout", 0.0)
    if not p:
        return {}
    x, y, bias = inputs["x"], inputs["y"], inputs.get("bias")
    s, b, n, c = x.shape
    branch = (y if bias is None else y + bias).unsqueeze(-2) * inputs["h_post"].unsqueeze(-1) * dropout.scale(p)
    kept = dropout.keep((s * b, n, c), p, knobs.get("dropout_seed", 0), knobs.get("dropout_offset", 0), x.device)
    return {"out": (branch.detach(), kept.view(x.shape))}


FAMILY = Family(
    "h_post_bda", ("h_res", "x", "h_post", "y", "bias"), ("h_res", "x", "h_post", "y", "bias"),
    ("h_res", "h_post"), ("out",),
    {"transpose_res": Knob(False, (False, True), bool), "bias": Knob(True, (False, True), bool, passed=False),
     "dropout": Knob(0.0, kind=float, zero_ok=True, below=1.0),
     "dropout_seed": Knob(0, kind=int, zero_ok=True, below=2.0**63),
     "dropout_offset": Knob(0, kind=int, zero_ok=True, below=2.0**62)},
    (),
    ref.h_post_bda,
    conventions=("transpose_res",),
    optional_inputs=("bias",),
    input_families={f.name: f for f in [
        InputFamily("random", "unit normal x, y, bias; row-stochastic h_res; h_post in (0, 2)", _bda),
        InputFamily("wide_range", "stream magnitudes 1e-3 to 1e3", _bda_wide),
        InputFamily("long_c", "C of at least 4099: odd tiles over C", _bda, long_c),
        InputFamily("long_tokens", "at least 4099 tokens: the bias gradient reduces over them", _bda, _long_tokens),
    ]},
    kernels={"triton": "mhctool.kernels.triton.h_post_bda:h_post_bda",
             "cutile": "mhctool.kernels.cutile.h_post_bda:h_post_bda"},
    cost=_cost,
    matmul=True,
    branches=_branches,
    keyed=("dropout", "dropout_seed", "dropout_offset"),
)
