"""Sweeps and analyses: where and why a computation breaks (``mhctool stability``).

``sinkhorn_sweep`` runs Sinkhorn implementations over logit amplitude (the largest |logit| of
each matrix), input family, dtype and the knobs, and measures per point: the non-finite rate, the
doubly-stochastic residuals (max |row sum - 1|, max |col sum - 1|, max |log col sum|, which shows
an attenuated lane that a max-abs sum hides), the error against the same-configuration float64
reference, the error against a converged float64 reference (``CONVERGED_ITERS`` iterations), and
the shift from the sweep's first eps setting (``shift_vs_first_eps``: what the eps change alone
does at that point).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from mhctool.core.dtypes import FORMATS
from mhctool.core.errors import UsageError
from mhctool.core.shapes import Shape
from mhctool.families import generate
from mhctool.references import mhc as ref
from mhctool.registry.impl import Impl

CONVERGED_ITERS = 500
# the largest logit whose exp is finite, per dtype: ln(max finite)
OVERFLOW_LOGIT = {name: math.log(f.max_finite) for name, f in FORMATS.items()}


@dataclass(frozen=True)
class SweepSpec:
    scales: tuple[float, ...]
    families: tuple[str, ...]
    dtypes: tuple[str, ...]
    stabilize: tuple[str, ...]
    eps: tuple[float, ...]
    eps_mode: tuple[str, ...]
    order: tuple[str, ...]
    iters: tuple[int, ...]
    tokens: int = 256
    n: int = 4
    seed: int = 0


# amplitudes around the exp overflow of fp16 (ln 65504 = 11.09) and of fp32/bf16 (88.72)
NEAR_OVERFLOW = (10.5, 11.0, 11.25, 11.5, 12.0, 86.0, 88.0, 88.5, 89.0, 90.0)


def _grid(points: int) -> tuple[float, ...]:
    logs = {float(f"{10 ** (-1 + 4 * i / (points - 1)):.4g}") for i in range(points)}  # 0.1 .. 1000
    return tuple(sorted(logs | set(NEAR_OVERFLOW)))


def quick_spec() -> SweepSpec:
    scales = _grid(17)
    return SweepSpec(scales, ("random", "near_perm", "dead_rows_cols"), ("fp32", "bf16", "fp16"),
                     ("rowmax", "none"), (1e-6, 1e-8), ("add",), ("row_first",), (1, 5, 20, 100), tokens=128)


def full_spec() -> SweepSpec:
    scales = _grid(41)
    return SweepSpec(scales, ("random", "near_perm", "dead_rows_cols"), ("fp32", "bf16", "fp16"),
                     ("rowmax", "none", "softmax"), (1e-6, 1e-8), ("add", "clamp"), ("row_first", "col_first"),
                     (1, 2, 5, 10, 20, 50, 100), tokens=1024)


MAX_ITERS = 10_000


def parse_range(text: str, option: str, max_points: int = 1000) -> tuple[float, ...]:
    """``LO:HI`` or ``LO:HI:POINTS``: POINTS log-spaced values from LO to HI (default 25)."""
    parts = text.split(":")
    try:
        if len(parts) not in (2, 3):
            raise ValueError
        lo, hi = float(parts[0]), float(parts[1])
        points = int(parts[2]) if len(parts) == 3 else 25
    except ValueError:
        raise UsageError(f"{option} {text!r} is not LO:HI or LO:HI:POINTS (e.g. 0.1:1000:41)") from None
    if not (lo > 0 and math.isfinite(hi)):
        raise UsageError(f"{option} {text!r}: the range must be positive and finite (log-spaced)")
    if lo >= hi:
        raise UsageError(f"{option} {text!r} goes from {lo:g} down to {hi:g}; give LO:HI with LO < HI")
    if not 2 <= points <= max_points:
        raise UsageError(f"{option} {text!r}: POINTS must be between 2 and {max_points}")
    step = (math.log10(hi) - math.log10(lo)) / (points - 1)
    return tuple(float(f"{10 ** (math.log10(lo) + i * step):.4g}") for i in range(points))


def parse_iters(values: list[str], option: str = "--iters") -> tuple[int, ...]:
    """Iteration counts, each a whole number from 1 to MAX_ITERS."""
    out = []
    for v in values:
        try:
            f = float(v)
        except ValueError:
            raise UsageError(f"{option} {v!r} is not a number of iterations") from None
        if f != int(f) or not 1 <= f <= MAX_ITERS:
            raise UsageError(f"{option} {v!r} is not a possible iteration count; give a whole number from 1 to {MAX_ITERS}")
        out.append(int(f))
    return tuple(sorted(set(out)))


def _base_logits(family: str, spec: SweepSpec) -> torch.Tensor:
    """Unit-amplitude logits of the family: each matrix divided by its largest |entry|."""
    shape = Shape(spec.tokens, 1, spec.n, 1)
    _, raw = generate("sinkhorn", family, shape, spec.seed, {})
    L = raw["logits"].double()
    return L / L.abs().amax(dim=(-1, -2), keepdim=True)


def _call(impl: Impl, logits: torch.Tensor, knobs: dict) -> torch.Tensor:
    """Megatron's call order (logits, iters, eps), the other knobs by keyword where taken."""
    kw = {k: v for k, v in knobs.items() if k not in ("iters", "eps") and impl.accepts(k)}
    with torch.no_grad():
        return impl.fn(logits, knobs["iters"], knobs["eps"], **kw)


def sinkhorn_sweep(impls: list[Impl], spec: SweepSpec, device: str, progress=None,
                   rows: list | None = None) -> list[dict]:
    """The sweep's rows, appended to ``rows`` as they are measured (a run stopped by ``progress``
    raising keeps what it has)."""
    rows = [] if rows is None else rows
    knob_grid = list(itertools.product(spec.stabilize, spec.eps, spec.eps_mode, spec.order, spec.iters))
    first_eps: dict[tuple, torch.Tensor] = {}
    counts = tuple(sorted(set(spec.iters)))
    for family in spec.families:
        base = _base_logits(family, spec)
        # the float64 references of every amplitude at once (a leading axis), and of every swept
        # iteration count from one run: [count, scale, ...] and, converged, [scale, ...]
        every = torch.stack([base * scale for scale in spec.scales])
        converged: dict[tuple, torch.Tensor] = {}  # depends on neither stabilize nor iters
        same_all: dict[tuple, torch.Tensor] = {}
        for si, scale in enumerate(spec.scales):
            L64 = every[si]
            for stab, eps, mode, order, iters in knob_grid:
                knobs = dict(iters=iters, eps=eps, stabilize=stab, eps_mode=mode, order=order)
                if (stab, eps, mode, order) not in same_all:
                    same_all[stab, eps, mode, order] = ref.sinkhorn(every, counts, eps, stabilize=stab,
                                                                    eps_mode=mode, order=order)
                same = same_all[stab, eps, mode, order][counts.index(iters), si]
                if (eps, mode, order) not in converged:
                    converged[eps, mode, order] = ref.sinkhorn(every, CONVERGED_ITERS, eps, stabilize="rowmax",
                                                               eps_mode=mode, order=order)
                conv = converged[eps, mode, order][si]
                for dtype in spec.dtypes:
                    Lq = L64.to(FORMATS[dtype].torch_dtype).to(device)
                    for impl in impls:
                        if progress:
                            progress(f"{family} x{scale:g} {dtype} {impl.name}")
                        why = impl.unsupported(device, dtype)
                        if not why and any(not impl.accepts(k) and v != d for k, v, d in (
                                ("stabilize", stab, "rowmax"), ("eps_mode", mode, "add"), ("order", order, "row_first"))):
                            why = f"{impl.name} does not take these knobs"
                        base_row = dict(impl=impl.name, family=family, dtype=dtype, scale=scale, stabilize=stab,
                                        eps=eps, eps_mode=mode, order=order, iters=iters)
                        if why:
                            continue
                        try:
                            out = _call(impl, Lq, knobs).double().cpu()
                        except Exception as e:  # an implementation that raises is a data point
                            rows.append({**base_row, "metric": "error", "value": math.nan, "message": str(e)[:200]})
                            continue
                        vals = _measure(out, same, conv)
                        # the shift that changing eps from the sweep's first setting causes
                        key = (family, scale, stab, mode, order, iters, dtype, impl.name)
                        if eps == spec.eps[0]:
                            first_eps[key] = out
                        if key in first_eps:
                            vals["shift_vs_first_eps"] = _shift(out, first_eps[key])
                        for metric, value in vals.items():
                            rows.append({**base_row, "metric": metric, "value": value, "message": None})
    return rows


def _measure(out: torch.Tensor, same: torch.Tensor, conv: torch.Tensor) -> dict[str, float]:
    finite = torch.isfinite(out)
    rate = 1.0 - finite.double().mean().item()
    vals = {"nonfinite_rate": rate}
    if finite.all():
        rs, cs = out.sum(-1), out.sum(-2)
        vals["row_residual"] = (rs - 1).abs().max().item()
        vals["col_residual"] = (cs - 1).abs().max().item()
        vals["max_abs_log_colsum"] = cs.clamp_min(1e-300).log().abs().max().item()
        vals["err_same_config"] = (out - same).abs().max().item()
        vals["err_converged"] = (out - conv).abs().max().item()
    else:
        for m in ("row_residual", "col_residual", "max_abs_log_colsum", "err_same_config", "err_converged"):
            vals[m] = math.inf
    return vals


def _shift(out: torch.Tensor, base: torch.Tensor) -> float:
    both = torch.isfinite(out) & torch.isfinite(base)
    if not both.all():
        return math.inf
    return float((out - base).abs().max())


def first_scale(rows: list[dict], metric: str, keys: tuple[str, ...], hit) -> dict[tuple, float | None]:
    """Per value of ``keys``, the smallest ``scale`` among the rows of ``metric`` whose value
    satisfies ``hit`` (None where none does)."""
    best: dict[tuple, float | None] = {}
    for r in rows:
        if r["metric"] != metric:
            continue
        k = tuple(r[c] for c in keys)
        best.setdefault(k, None)
        if hit(r["value"]) and (best[k] is None or r["scale"] < best[k]):
            best[k] = r["scale"]
    return best


def first_nonfinite(rows: list[dict]) -> list[dict]:
    """Per configuration, the smallest amplitude with a non-finite output (None: finite throughout)."""
    keys = ("impl", "family", "dtype", "stabilize", "eps", "eps_mode", "order", "iters")
    best = first_scale(rows, "nonfinite_rate", keys, lambda v: v > 0)
    return [dict(zip(keys, k), first_nonfinite_scale=v) for k, v in best.items()]
