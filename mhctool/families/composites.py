"""The composites: the mapping then Sinkhorn (the three mixing matrices: Liger-Kernel's
coefficients), and that then the aggregation (the whole pre-path: TransformerEngine's
mhc_generate_mix_and_aggregate)."""
from __future__ import annotations

import dataclasses

from mhctool.core.inputs import InputFamily
from mhctool.families import mapping, proj_rms
from mhctool.families.contract import Cost, Family, Knob
from mhctool.references import mhc as ref

# the mapping's knobs, then Sinkhorn's (its eps named sinkhorn_eps)
_KNOBS = {
    "eps": Knob(1e-6, kind=float, zero_ok=True), "rms_eps": proj_rms.RMS_EPS,
    "compute_h_eps": Knob(0.0, kind=float, zero_ok=True), "iters": Knob(20, kind=int),
    "sinkhorn_eps": Knob(1e-6, kind=float, zero_ok=True), "stabilize": Knob("rowmax", ref.STABILIZE),
    "order": Knob("row_first", ref.ORDERS), "domain": Knob("linear", ref.DOMAINS),
}
_CONVENTIONS = ("eps", "rms_eps", "compute_h_eps", "sinkhorn_eps", "stabilize", "order", "domain", "iters")


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


def _mix_cost(shape, e: int, f: int) -> Cost:
    # x read twice (projection, aggregation); out written
    T, n, C, K, N = shape.tokens, shape.n, shape.c, shape.k, shape.n_h
    return Cost(2 * T * K * e + N * K * e + T * C * e + T * (n + n * n) * f,
                3 * T * K * e + T * C * e + N * K * e + N * K * f + 2 * T * (n + n * n) * f,
                2.0 * T * N * K + 2.0 * T * K, 4.0 * T * N * K + 4.0 * T * K)


def _composite(name, outputs, reference, kernels, cost):
    fam = Family(name, ("x", "weight", "alpha", "h_bias"), ("x", "weight", "alpha", "h_bias"), ("alpha", "h_bias"),
                 outputs, dict(_KNOBS), (), reference, conventions=_CONVENTIONS, input_families=dict(_INPUTS),
                 kernels=kernels, cost=cost, matmul=True)
    return dataclasses.replace(fam, term_scale=mapping.token_sum_term_scale(fam))


MAPPING_SINKHORN = _composite("mapping_sinkhorn", ("h_pre", "h_post", "h_res"), ref.mapping_sinkhorn,
                              {"triton": "mhctool.kernels.triton.mix_aggregate:mapping_sinkhorn"}, mapping.cost)
MIX_AGGREGATE = _composite("mix_aggregate", ("out", "h_post", "h_res"), ref.mix_aggregate,
                           {"triton": "mhctool.kernels.triton.mix_aggregate:mix_aggregate",
                            "cutile": "mhctool.kernels.cutile.mix_aggregate:mix_aggregate"}, _mix_cost)
