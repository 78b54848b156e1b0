"""The composites: the mapping then Sinkhorn (the three mixing matrices: Liger-Kernel's
coefficients), and that then the aggregation (the whole pre-path: TransformerEngine's
mhc_generate_mix_and_aggregate)."""
from __future__ import annotations

import dataclasses

import torch

from mhctool.core.inputs import InputFamily, beside, rand, randn
from mhctool.families import mapping, proj_rms
from mhctool.families.contract import Cost, Family, Knob
from mhctool.references import mhc as ref

# the mapping's knobs, then every one of Sinkhorn's (its eps named sinkhorn_eps)
_KNOBS = {
    "eps": Knob(1e-6, kind=float, zero_ok=True), "rms_eps": proj_rms.RMS_EPS,
    "compute_h_eps": Knob(0.0, kind=float, zero_ok=True), "iters": Knob(20, kind=int),
    "sinkhorn_eps": Knob(1e-6, kind=float, zero_ok=True),
    "stabilize": Knob("rowmax", ref.STABILIZE + ref.STABILIZE_RARE),
    "clamp_at": Knob(20.0, kind=float, only_with=("stabilize", "clamp")),
    "eps_mode": Knob("add", ref.EPS_MODES),
    "order": Knob("row_first", ref.ORDERS), "domain": Knob("linear", ref.DOMAINS),
    "math": Knob("ieee", ref.MATHS), "floor": Knob(0.0, kind=float, zero_ok=True),
}
_CONVENTIONS = ("eps", "rms_eps", "compute_h_eps", "sinkhorn_eps", "stabilize", "clamp_at", "eps_mode", "order",
                "domain", "math", "floor", "iters")


def _as_streams(make):
    """A mapping family with its ``x2d[T, n*C]`` as the streams ``x[s, b, n, C]`` (mix_aggregate)."""
    def gen(shape, g, knobs):
        out = make(shape, g, knobs)
        out["x"] = out.pop("x2d").reshape(shape.s, shape.b, shape.n, shape.c)
        return {k: out[k] for k in ("x", "weight", "alpha", "h_bias")}
    return gen


# the mapping's families but long_k
_INPUTS = {name: InputFamily(name, f.doc, _as_streams(f.make), f.reshape)
           for name, f in mapping.FAMILY.input_families.items() if name != "long_k"}


def _res_logits(level, depth=None, scale: float = 40.0, spread: float = 1.5):
    """Streams whose H_res logits (``alpha_res * r * (W_res x) + h_bias_res``) are, per token, a
    ``level(g, T)`` plus ``spread`` times unit noise, and where ``depth`` is given, a column (and
    on every other token a row) ``depth(g, T)`` below the rest: Sinkhorn's regimes reached through
    the mapping, whose bias is shared by every token. Three coordinates of x carry the level and
    the two depths, in steps of 1/64 (exact in bf16 and TF32), and the H_res rows of the weight
    read them with a weight of one (exact too): a kernel that multiplies at TF32 or in bf16 rounds
    only the small noise terms, which alpha_res = ``scale`` amplifies no further than the noise
    itself. The pre and post rows are the random family's."""
    def gen(shape, g, knobs):
        s, b, n, c = shape.s, shape.b, shape.n, shape.c
        t, k, nh = s * b, n * c, shape.n_h
        x = randn(g, t, k)
        col = depth(g, t) if depth else torch.zeros(t)
        row = depth(g, t) * (torch.arange(t) % 2 == 1) if depth else torch.zeros(t)
        coords = torch.round(torch.stack([level(g, t), -col, -row], -1) / scale * 64) / 64
        x[:, :3] = beside(x, coords)  # (a large x may be drawn on the GPU: core.inputs.drawing_on)
        weight = randn(g, nh, k) / k ** 0.5
        res = weight[2 * n:].view(n, n, k)
        res.mul_(spread / scale)
        res[..., 0] = 1.0  # every H_res logit reads the level
        res[:, 0, 1] = 1.0  # the first column the column depth
        res[0, :, 2] = 1.0  # the first row the row depth
        alpha = torch.cat([0.5 + rand(g, 2), torch.tensor([scale])])
        h_bias = torch.cat([randn(g, 2 * n), torch.zeros(n * n)])
        return {"x": x.reshape(s, b, n, c), "weight": weight, "alpha": alpha, "h_bias": h_bias}
    return gen


def _levels(lo: float, hi: float, log: bool = False):
    def level(g, t):
        u = rand(g, t)
        return lo * (hi / lo) ** u if log else lo + (hi - lo) * u
    return level


_PROBES = {f.name: f for f in [
    InputFamily("res_depths", "H_res's logits: a column (and a row on every other token) 5 to 80 below the rest: "
                "sums from 1e-2 to far below eps, so eps, its mode and a floor decide the result",
                _res_logits(lambda g, t: torch.zeros(t), _levels(5.0, 80.0))),
    InputFamily("res_levels", "H_res's logits at a level of 3 to 75 per token, a spread of 1.5: where an "
                "exponential clamped at a bound between loses the differences", _res_logits(_levels(3.0, 75.0, True))),
    InputFamily("res_large", "H_res's logits about 90 to 300, a spread of 1.5: exp overflows without max subtraction",
                _res_logits(_levels(90.0, 300.0), scale=100.0)),
]}


def _mix_cost(shape, e: int, f: int) -> Cost:
    # x read twice (projection, aggregation); out written
    T, n, C, K, N = shape.tokens, shape.n, shape.c, shape.k, shape.n_h
    return Cost(2 * T * K * e + N * K * e + T * C * e + T * (n + n * n) * f,
                3 * T * K * e + T * C * e + N * K * e + N * K * f + 2 * T * (n + n * n) * f,
                2.0 * T * N * K + 2.0 * T * K, 4.0 * T * N * K + 4.0 * T * K)


def _composite(name, outputs, reference, kernels, cost):
    fam = Family(name, ("x", "weight", "alpha", "h_bias"), ("x", "weight", "alpha", "h_bias"), ("alpha", "h_bias"),
                 outputs, dict(_KNOBS), (), reference, conventions=_CONVENTIONS, input_families=dict(_INPUTS),
                 probes=dict(_PROBES), kernels=kernels, cost=cost, matmul=True)
    return dataclasses.replace(fam, term_scale=mapping.token_sum_term_scale(fam))


MAPPING_SINKHORN = _composite("mapping_sinkhorn", ("h_pre", "h_post", "h_res"), ref.mapping_sinkhorn,
                              {"triton": "mhctool.kernels.triton.mix_aggregate:mapping_sinkhorn"}, mapping.cost)
MIX_AGGREGATE = _composite("mix_aggregate", ("out", "h_post", "h_res"), ref.mix_aggregate,
                           {"triton": "mhctool.kernels.triton.mix_aggregate:mix_aggregate",
                            "cutile": "mhctool.kernels.cutile.mix_aggregate:mix_aggregate"}, _mix_cost)
