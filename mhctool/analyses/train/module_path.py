"""The fused mHC path: a whole hyper-connection module computed by two calls a direction, swapped
in by an engine at the module's level as the entry points are swapped at theirs.

- ``pre_path(x[s, b, n, C], weight, alpha[3], h_bias) -> (aggregated[s, b, C], h_res[s, b, n, n],
  h_post[s, b, n])``: the projection, RMS, mapping, Sinkhorn and aggregation (the ``mix_aggregate``
  family: mhctool's fused pre-path);
- ``post_path(h_res, residual[s, b, n, C], h_post, y[s, b, C], bias[C] | None, dropout, seed,
  offset) -> out[s, b, n, C]``: ``H_res residual + dropout(H_post (y + bias))`` (the
  ``h_post_bda`` family with its dropout: the mask the contract's, keyed by the engine's
  ``(seed, offset)``, drawn inside the kernel).

The engine draws the dropout's key from its own random state as the call starts, so that a
recompute that restores that state (Megatron's ``CheckpointWithoutOutput``) draws the same mask.

A spec ``X[module]`` names what computes the two calls: ``triton[module]`` and ``cutile[module]``
mhctool's kernels, ``torch[module]`` its native pieces (the baseline on a CPU); a function (or a
library) for one of the two families computes that one, mhctool's native pieces the other (a
planted post-path: ``defects.py:h_post_bda_transposed[module]``). The same path with mhctool's
native pieces and with the float64 references is what the native and float64 trajectories of a
module variant run, so that the three draw the very same masks.
"""
from __future__ import annotations

from typing import Callable

import torch

# the specs' side (a module variant's name, what computes each family) is module_spec's, which the
# model's pieces read too; its names stay reachable here, where the engine looks for them
from mhctool.analyses.train.module_spec import FAMILIES, KEY, POST, PRE, SUFFIX, assigned, backend_of  # noqa: F401
from mhctool.core.errors import UsageError
from mhctool.families import get_family


def pre_knobs(eff: dict[str, dict]) -> dict:
    """The pre-path's knobs from the entry points' effective ones (the projection's eps and RMS
    form, Sinkhorn's iterations, eps, start, eps mode and order)."""
    proj, sk = eff.get("proj_rms", {}), eff.get("sinkhorn", {})
    out = {"eps": proj.get("eps", 1e-6), "rms_eps": proj.get("rms_eps", "outside"), "iters": sk.get("iters", 20),
           "sinkhorn_eps": sk.get("eps", 1e-6)}
    out.update({k: sk[k] for k in ("stabilize", "eps_mode", "order") if k in sk})
    return out


# the pre-path's knobs as the entry points' that set them (pre_knobs, the other way)
AT_ENTRY = {"eps": ("proj_rms", "eps"), "rms_eps": ("proj_rms", "rms_eps"), "iters": ("sinkhorn", "iters"),
            "sinkhorn_eps": ("sinkhorn", "eps"), "stabilize": ("sinkhorn", "stabilize"),
            "eps_mode": ("sinkhorn", "eps_mode"), "order": ("sinkhorn", "order")}


def candidates(spec: str, eff: dict[str, dict], device: str, fitted: Callable) -> list[tuple]:
    """The tracing's candidates for a module variant: what identify fits to each of its two calls,
    as (entry point family, knob, value, why), the knobs the native module path is rerun with
    (:func:`knobs` reads them from the entry points': the pre-path's at the projection's and
    Sinkhorn's, the post-path's at h_post_bda's). Not a matmul precision: the native module path
    has none to change. ``fitted(family, spec, asked, device)``: trace.fitted."""
    out = []
    for family, s in assigned(spec).items():
        if family == "h_post_bda":
            out += [c for c in fitted(family, s, eff.get(family, {}), device) if c[1] != "matmul_precision"] \
                if family in eff else []
            continue
        for _, knob, value, why in fitted(family, s, pre_knobs(eff), device):
            at = AT_ENTRY.get(knob)
            if at is not None and at[0] in eff:
                out.append((at[0], at[1], value, why))
    return out


def knobs(eff: dict[str, dict]) -> dict[str, dict]:
    """Per family of the module path, the knobs it computes."""
    return {"mix_aggregate": pre_knobs(eff),
            "h_post_bda": {"transpose_res": eff.get("h_post_bda", {}).get("transpose_res", False)}}


def pieces(role: str, spec: str, eff: dict[str, dict], device: str) -> tuple[dict[str, Callable], dict[str, str]]:
    """Family calls (``call(args) -> outputs``, the dropout's key among ``args``) of the module's
    two families for ``role`` (``impl``: ``spec``'s; ``native``: mhctool's native pieces;
    ``reference``: the float64 references, their outputs back at the dtypes the kernels give), and
    how each is named."""
    from mhctool.analyses.train.pieces import family_call, pick_impl
    kn = knobs(eff)
    out, names = {}, {}
    for family, s in (assigned(spec) if role == "impl" else {f: "torch" for f in FAMILIES.values()}).items():
        fam = get_family(family)
        if role == "reference":
            call = family_call(family, fam.reference, kn[family])
            out[family], names[family] = _widened(call), "float64"
            continue
        impl, why = pick_impl(family, s, device, "bf16")
        if impl is None:
            raise UsageError(f"{spec}{SUFFIX}: {family} cannot run here: {why}")
        out[family] = family_call(family, impl.fn, kn[family], impl.accepts, impl.bind, impl.takes)
        names[family] = impl.name
    return out, names


def _widened(call: Callable[[dict], tuple]) -> Callable[[dict], tuple]:
    """A float64 call on the inputs upcast, its outputs back at the inputs' dtypes (the streams at
    theirs, the mapping path fp32)."""
    def run(args: dict) -> tuple:
        wide = {k: (v.double() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in args.items()}
        outs = call(wide)
        x = args["x"]
        return tuple(o.to(x.dtype) if i == 0 else o.float() for i, o in enumerate(outs))
    return run


def ops(calls: dict[str, Callable[[dict], tuple]]) -> dict[str, Callable]:
    """The module's two calls over family calls (:func:`pieces`, recorded or not): inputs at the
    dtypes the kernels take (the mapping path fp32; the weight in x's dtype where it comes so,
    PR 3828's, for the kernels' tensor-core path), outputs as the engine's module takes them."""
    pre, post = calls["mix_aggregate"], calls["h_post_bda"]

    def pre_path(x, weight, alpha, h_bias):
        w = weight if weight.dtype == x.dtype else weight.float()
        out, h_post, h_res = pre({"x": x, "weight": w, "alpha": alpha.float(), "h_bias": h_bias.float()})[:3]
        return out.to(x.dtype), h_res.float(), h_post.float()

    def post_path(h_res, residual, h_post, y, bias, dropout=0.0, seed=0, offset=0):
        args = {"h_res": h_res.float(), "x": residual, "h_post": h_post.float(), "y": y, "bias": bias,
                "dropout": float(dropout), "dropout_seed": int(seed), "dropout_offset": int(offset)}
        return post(args)[0].to(residual.dtype)
    return {PRE: pre_path, POST: post_path}
