"""The fused mapping path: the projection and RMS, then compute_h (h_pre, h_post and the H_res
logits from alpha, h_bias and the sigmoid), in fp32, with the rows' RMS as an optional output."""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import torch

from mhctool.core.inputs import InputFamily, rand, randn
from mhctool.families import proj_rms
from mhctool.families.contract import Cost, Family, Knob
from mhctool.references import mhc as ref


def blocks(name: str, value: torch.Tensor, n: int) -> dict[str, torch.Tensor]:
    """A projection parameter's tensor (its gradient) split by the block of h its rows feed,
    ``[pre(n) | post(n) | res(n^2)]`` (alpha, three values, by its gates): ``NAME:h_pre``,
    ``NAME:h_post``, ``NAME:h_res``."""
    if value.dim() == 1 and value.shape[0] == 3:
        return {f"{name}:{b}": value[i:i + 1] for i, b in enumerate(("h_pre", "h_post", "h_res"))}
    return {f"{name}:h_pre": value[:n], f"{name}:h_post": value[n:2 * n], f"{name}:h_res": value[2 * n:]}


def token_sum_term_scale(fam: Family) -> Callable:
    """grad_alpha[k] sums g_h * (r * proj) over every token and the k-th group of columns, and
    grad_h_bias[j] sums g_h[:, j] over every token: their terms are far larger than the result
    when they cancel. ``fam``'s reference, traced, gives h (for g_h) and r * proj. (On an H200,
    mix_aggregate's fp32 grad_h_bias at 9x2x2x40 erred by 2.4 roundoffs of its terms' sum, PyTorch's
    on other columns by up to 2.6, ``dev/bias_probe.py``: a sum of 18 terms cancelling 3.5x,
    each term a product of sums itself.)"""
    def scale(args: dict, upstream: list, knobs: dict) -> dict[str, float]:
        seen: dict[str, torch.Tensor] = {}
        traced = functools.partial(fam.reference, trace=lambda name, t: seen.setdefault(name, t))
        with torch.enable_grad():
            outs = fam.call(traced, args, knobs, lambda k: True)
            (gh,) = torch.autograd.grad(outs, [seen["h"]], list(upstream)[:len(outs)])
        n = round((seen["h"].shape[-1] + 1) ** 0.5 - 1)
        terms = (gh * seen["r_proj"]).abs().detach()
        return {"grad_alpha": float(max(terms[:, :n].sum(), terms[:, n:2 * n].sum(), terms[:, 2 * n:].sum())),
                "grad_h_bias": float(gh.abs().detach().sum(0).max())}
    return scale


def _reference(x2d, weight, alpha, h_bias, eps=1e-6, **kw):
    return (*ref.mapping(x2d, weight, alpha, h_bias, eps, **kw), ref.rms(x2d))


def _with_h(make):
    """A proj_rms family plus the compute_h parameters: alpha in [0.5, 1.5], h_bias ~ N(0, 1)."""
    def gen(shape, g, knobs):
        out = make(shape, g, knobs)
        out["alpha"] = 0.5 + rand(g, 3)
        out["h_bias"] = randn(g, shape.n_h)
        return out
    return gen


def cost(shape, e: int, f: int) -> Cost:
    """proj_rms + compute_h (mapping_sinkhorn: then Sinkhorn on chip): the same x traffic, 2n + n^2
    fp32 outputs."""
    T, K, N = shape.tokens, shape.k, shape.n_h
    return Cost(T * K * e + N * K * e + T * N * f, 2 * T * K * e + N * K * e + N * K * f + 2 * T * N * f,
                2.0 * T * N * K, 4.0 * T * N * K)


_FAMILY = Family(
    "mapping", ("x2d", "weight", "alpha", "h_bias"), ("x2d", "weight", "alpha", "h_bias"),
    ("alpha", "h_bias"), ("h_pre", "h_post", "h_res_logits", "rms"),
    {"eps": Knob(1e-6, kind=float, zero_ok=True), "rms_eps": proj_rms.RMS_EPS,
     "compute_h_eps": Knob(0.0, kind=float, zero_ok=True)},
    ("eps",),
    _reference,
    optional_outputs=("rms",),
    conventions=("eps", "rms_eps", "compute_h_eps"),
    # the projection's families with the compute_h parameters
    input_families={name: InputFamily(name, f.doc, _with_h(f.make), f.reshape)
                    for name, f in proj_rms.INPUTS.items()},
    kernels={"triton": "mhctool.kernels.triton.mapping:mapping", "cutile": "mhctool.kernels.cutile.mapping:mapping",
             "triton-tf32": "mhctool.kernels.triton.mapping:mapping_tf32"},
    cost=cost,
    matmul=True,
)
FAMILY = dataclasses.replace(_FAMILY, term_scale=token_sum_term_scale(_FAMILY))
