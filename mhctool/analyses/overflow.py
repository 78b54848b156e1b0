"""Headroom of every intermediate as the input scale grows (``mhctool stability overflow``).

The float64 reference of a kernel reports its named intermediates through its ``trace`` hook
(exp and the row/column sums of Sinkhorn, the squares and their sum in proj_rms, the products of
the mixing kernels, ...). For each input scale this records each intermediate's largest magnitude
and, per dtype, its headroom ``log2(max_finite / amax)``: how many doublings of the input are left
before a kernel that holds that intermediate in the dtype overflows. It also runs an
implementation at each dtype on the same scaled inputs and measures its output: an intermediate
whose headroom is gone at a scale where that output is still finite but wrong (off the float64
reference by more than ``WRONG_ROUNDOFFS`` unit roundoffs of the dtype) is a silent overflow
(``r = 1 / inf = 0`` looks like a number). An implementation that holds the intermediate wider
than the dtype (fp32 math for fp16 inputs) stays right there, and is not flagged.
"""
from __future__ import annotations

import functools
import math

import torch

from mhctool.analyses.stability import NEAR_OVERFLOW, first_scale
from mhctool.core.dtypes import FORMATS
from mhctool.core.errors import UsageError
from mhctool.core.shapes import Shape
from mhctool.families import generate, get_family
from mhctool.registry.impl import Impl
from mhctool.runner.call import cast_inputs

SHAPES = {
    "sinkhorn": Shape(128, 1, 4, 1),
    "h_aggregate": Shape(16, 2, 4, 96),
    "h_post_bda": Shape(16, 2, 4, 96),
    "proj_rms": Shape(32, 1, 4, 64),
    "mapping": Shape(32, 1, 4, 64),
}
# which inputs the scale multiplies (mixing coefficients and weights keep their range)
SCALED = {
    "sinkhorn": ("logits",),
    "h_aggregate": ("x",),
    "h_post_bda": ("x", "y", "bias"),
    "proj_rms": ("x2d",),
    "mapping": ("x2d",),
}
KERNELS = tuple(SHAPES)
WRONG_ROUNDOFFS = 64


def default_scales(kernel: str, points: int) -> tuple[float, ...]:
    """Logit amplitude 0.1 to 1000 for Sinkhorn; input scale 0.1 to 1e21 (past fp32's sum of
    squares) for the others."""
    lo, hi = (-1.0, 3.0) if kernel == "sinkhorn" else (-1.0, 21.0)
    grid = {float(f"{10 ** (lo + (hi - lo) * i / (points - 1)):.4g}") for i in range(points)}
    if kernel == "sinkhorn":  # dense around the exp overflow of fp16 and of fp32/bf16
        grid |= set(NEAR_OVERFLOW)
    return tuple(sorted(grid))


def check_kernel(kernel: str) -> None:
    get_family(kernel)
    if kernel not in SHAPES:
        raise UsageError(f"kernel {kernel} has no overflow analysis; accepted: {', '.join(KERNELS)}")


def _base_inputs(kernel: str, family: str, seed: int) -> dict[str, torch.Tensor | None]:
    fam = get_family(kernel)
    knobs = {k: v.default for k, v in fam.knobs.items() if not v.passed}
    _, raw = generate(kernel, family, SHAPES[kernel], seed, knobs)
    raw = {k: (None if v is None else v.double()) for k, v in raw.items()}
    if kernel == "sinkhorn":  # unit amplitude per matrix, so the scale is the largest |logit|
        L = raw["logits"]
        raw["logits"] = L / L.abs().amax(dim=(-1, -2), keepdim=True)
    return raw


def intermediates(kernel: str, args64: dict, knobs: dict) -> tuple[dict[str, float], tuple]:
    """Largest |value| of each traced intermediate (over every call, e.g. every iteration), the
    scaled inputs and the outputs included; and the reference outputs."""
    fam = get_family(kernel)
    amax: dict[str, float] = {}

    def trace(name: str, t: torch.Tensor):
        v = float(t.abs().max()) if t.numel() else 0.0
        amax[name] = max(amax.get(name, 0.0), v)

    for name in SCALED[kernel]:
        if args64.get(name) is not None:
            trace(f"input:{name}", args64[name])
    with torch.no_grad():
        outs = fam.call(functools.partial(fam.reference, trace=trace), args64, knobs, lambda k: True)
    for name, o in zip(fam.outputs, outs):
        trace(f"output:{name}", o)
    return amax, outs


def headroom_log2(amax: float, dtype: str) -> float:
    if amax == 0:
        return math.inf
    return math.log2(FORMATS[dtype].max_finite) - math.log2(amax)


def sweep(kernel: str, impl: Impl | None, family: str, dtypes: tuple[str, ...], scales: tuple[float, ...],
          knobs: dict, device: str, seed: int = 0, progress=None, rows: list | None = None) -> list[dict]:
    """Rows: per scale, intermediate amax (dtype "fp64") and per-dtype headroom; per scale and
    dtype, the share of non-finite outputs of ``impl`` (when given); appended to ``rows`` as they
    are measured (a run stopped by ``progress`` raising keeps what it has)."""
    fam = get_family(kernel)
    base = _base_inputs(kernel, family, seed)
    rows = [] if rows is None else rows
    for scale in scales:
        if progress:
            progress(f"{kernel} x{scale:g}")
        args64 = {k: (v * scale if k in SCALED[kernel] and v is not None else v) for k, v in base.items()}
        args64 = {k: args64.get(k) for k in fam.inputs}
        common = dict(kernel=kernel, family=family, scale=scale)
        amax, ref_outs = intermediates(kernel, args64, knobs)
        for name, a in amax.items():
            rows.append({**common, "impl": "reference", "dtype": "fp64", "intermediate": name, "metric": "amax", "value": a})
            for dt in dtypes:
                rows.append({**common, "impl": "reference", "dtype": dt, "intermediate": name,
                             "metric": "headroom_log2", "value": headroom_log2(a, dt)})
        if impl is None:
            continue
        for dt in dtypes:
            if impl.unsupported(device, dt):
                continue
            share, err = _run_impl(fam, impl, args64, knobs, dt, device, ref_outs)
            rows.append({**common, "impl": impl.name, "dtype": dt, "intermediate": "output",
                         "metric": "output_nonfinite_share", "value": share})
            rows.append({**common, "impl": impl.name, "dtype": dt, "intermediate": "output",
                         "metric": "output_rel_error", "value": err})
    return rows


def _run_impl(fam, impl: Impl, args64: dict, knobs: dict, dtype: str, device: str, ref_outs) -> tuple[float, float]:
    """The share of non-finite output elements, and the largest error of the finite ones relative
    to each reference output's largest magnitude (where the reference is finite)."""
    args = cast_inputs(fam, args64, dtype, device)
    try:
        with torch.no_grad():
            outs = fam.call(impl.fn, args, knobs, impl.accepts, impl.bind, impl.takes)
    except Exception:  # an implementation that refuses non-finite input: the output is lost
        return 1.0, math.inf
    bad = sum(int((~torch.isfinite(o)).sum()) for o in outs)
    err = 0.0
    for o, r in zip(outs, ref_outs):
        o = o.double().cpu()
        keep = torch.isfinite(r) & torch.isfinite(o)
        if keep.any():
            scale = float(r[torch.isfinite(r)].abs().max()) or 1.0
            err = max(err, float((o[keep] - r[keep]).abs().max()) / scale)
    return bad / max(1, sum(o.numel() for o in outs)), err


def summary(rows: list[dict]) -> list[dict]:
    """Per intermediate and dtype: the first scale with no headroom left, the first scale at which
    the implementation's output has a non-finite value, and whether the overflow is silent: at
    some scale from the overflow on, the output is all finite but wrong."""
    first_out = {k[0]: v for k, v in first_scale(rows, "output_nonfinite_share", ("dtype",), lambda v: v > 0).items()}
    nonfinite = {(r["dtype"], r["scale"]): r["value"] for r in rows if r["metric"] == "output_nonfinite_share"}
    quiet_wrong: dict[str, list[float]] = {}  # scales where the output is finite but wrong
    for r in rows:
        if (r["metric"] == "output_rel_error" and nonfinite.get((r["dtype"], r["scale"])) == 0
                and r["value"] > WRONG_ROUNDOFFS * FORMATS[r["dtype"]].unit_roundoff):
            quiet_wrong.setdefault(r["dtype"], []).append(r["scale"])
    out = []
    for (name, dt), s in first_scale(rows, "headroom_log2", ("intermediate", "dtype"), lambda v: v <= 0).items():
        silent = (s is not None and not name.startswith("input:")
                  and any(q >= s for q in quiet_wrong.get(dt, [])))
        out.append(dict(intermediate=name, dtype=dt, first_overflow_scale=s,
                        output_first_nonfinite=first_out.get(dt), silent=silent))
    return out
