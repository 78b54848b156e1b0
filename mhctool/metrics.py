"""Error metrics: one pure function each, ``(out, ref) -> float``.

``out`` is an implementation's tensor at its own dtype, ``ref`` the float64 reference. Errors are
measured where the reference is finite; a non-finite output there makes the error infinite, except
an infinity of the reference's sign where the reference lies past the largest finite value of the
output's dtype (the correctly rounded result: the contract's value is not finite in that dtype).
"""
from __future__ import annotations

import math

import torch

from .dtypes import fmt_of, is_poison


def _pair(out: torch.Tensor, ref: torch.Tensor):
    o = out.detach().to(torch.float64)
    r = ref.detach().to(torch.float64)
    keep = torch.isfinite(r)
    if bool(keep.all()):  # the usual case: no copies (paper-shape tensors are gigabytes in float64)
        return o.reshape(-1), r.reshape(-1)
    return o[keep], r[keep]


def finite_amax(t: torch.Tensor) -> float:
    """``max |t|`` over the finite elements (0.0 if none), without a copy of ``t`` when every
    element is finite: a masked copy of one paper-shape float64 gradient (7.5 GB) and its ``abs``
    ran an 80 GB GPU out of memory while judging h_post_bda."""
    t = t.detach()
    if not t.numel():
        return 0.0
    if bool(torch.isfinite(t).all()):
        lo, hi = torch.aminmax(t)
        return float(torch.maximum(lo.abs(), hi.abs()))
    fin = t[torch.isfinite(t)]
    return float(fin.abs().max()) if fin.numel() else 0.0


def _rounded_overflow(o: torch.Tensor, r: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Where ``o`` is the infinity that rounding the finite ``r`` to ``dtype`` gives."""
    if not dtype.is_floating_point or dtype == torch.float64:
        return torch.zeros_like(o, dtype=torch.bool)
    big = torch.finfo(dtype).max
    return torch.isinf(o) & (r.abs() > big) & (torch.sign(o) == torch.sign(r))


def _abs_err(out, ref):
    o, r = _pair(out, ref)
    d = (o - r).abs_()
    bad = ~torch.isfinite(o)
    if bool(bad.any()):
        over = _rounded_overflow(o, r, out.dtype)
        d = torch.where(over, 0.0, d.masked_fill_(bad, math.inf))
    return d, r


def max_abs(out, ref) -> float:
    d, _ = _abs_err(out, ref)
    return float(d.max()) if d.numel() else 0.0


def max_rel(out, ref) -> float:
    """Largest ``|out - ref| / |ref|`` over elements whose reference is not tiny."""
    d, r = _abs_err(out, ref)
    if not d.numel():
        return 0.0
    ra = r.abs()
    big = ra > ra.max() * 1e-6
    return float((d / ra).masked_fill_(~big, 0.0).max())


def rel_l2(out, ref) -> float:
    d, r = _abs_err(out, ref)
    if not d.numel():
        return 0.0
    den = torch.linalg.vector_norm(r)
    num = torch.linalg.vector_norm(d)
    if den == 0:
        return float(num)
    return float(num / den)


def ulp_size(values: torch.Tensor, f) -> torch.Tensor:
    """The unit in the last place of format ``f`` at each of ``values`` (float64)."""
    exp = torch.floor(torch.log2(values.abs().clamp_min(2.0 ** f.min_exponent)))
    return 2.0 ** (exp - f.mantissa_bits)


def ulp(out, ref) -> float:
    """Largest error in units of the last place of ``out``'s dtype at the reference value."""
    d, r = _abs_err(out, ref)
    if not d.numel():
        return 0.0
    return float((d / ulp_size(r, fmt_of(out.dtype))).max())


def nonfinite(out, ref) -> float:
    """Non-finite output elements where the reference is finite in the output's dtype (poisoned
    ones excluded; an infinity that rounding the reference to that dtype gives is not counted)."""
    r, o = ref.detach(), out.detach()
    bad = ~torch.isfinite(o) & torch.isfinite(r) & ~is_poison(o)
    if not bool(bad.any()):
        return 0.0
    return float((bad & ~_rounded_overflow(o.double(), r.double(), o.dtype)).sum())


def unwritten(out, ref) -> float:
    """Output elements that still hold the poison NaN written before the kernel ran."""
    return float(is_poison(out.detach()).sum())


def extra_zeros(out, ref) -> float:
    """Elements exactly zero in the output where the reference is not (underflow, skipped writes)."""
    o, r = out.detach(), ref.detach()
    return float(((o == 0) & (r != 0)).sum())


def row_residual(out, ref=None) -> float:
    """Sinkhorn: ``max |rowsum - 1|`` of the output itself."""
    s = out.detach().to(torch.float64).sum(-1)
    return float((s - 1).abs().max()) if s.numel() else 0.0


def col_residual(out, ref=None) -> float:
    """Sinkhorn: ``max |colsum - 1|`` of the output itself."""
    s = out.detach().to(torch.float64).sum(-2)
    return float((s - 1).abs().max()) if s.numel() else 0.0


ERROR_METRICS = {"max_abs": max_abs, "rel_l2": rel_l2, "max_rel": max_rel, "ulp": ulp}
COUNT_METRICS = {"nonfinite": nonfinite, "unwritten": unwritten, "extra_zeros": extra_zeros}
SINKHORN_METRICS = {"row_residual": row_residual, "col_residual": col_residual}


def _errors(out: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """The four error metrics from one difference and one float64 copy (each metric alone
    computes them again; shared, the default scenario's Triton kernels on 2 cores judged in 4.8 s
    instead of 6.5, the same values)."""
    d, r = _abs_err(out, ref)
    if not d.numel():
        return dict.fromkeys(ERROR_METRICS, 0.0)
    ra = r.abs()
    big = ra > ra.max() * 1e-6
    den = torch.linalg.vector_norm(r)
    num = torch.linalg.vector_norm(d)
    return {"max_abs": float(d.max()),
            "rel_l2": float(num) if den == 0 else float(num / den),
            # masked, not indexed: an index compacts a copy (and waits for the device to count it),
            # a third of the time here on 2^24 elements; the same maximum (every ratio is >= 0)
            "max_rel": float((d / ra).masked_fill_(~big, 0.0).max()),
            "ulp": float((d / ulp_size(r, fmt_of(out.dtype))).max())}


def measure(out: torch.Tensor, ref: torch.Tensor, sinkhorn_output: bool = False) -> dict[str, float]:
    vals = _errors(out, ref) | {name: fn(out, ref) for name, fn in COUNT_METRICS.items()}
    if sinkhorn_output:
        vals.update({name: fn(out) for name, fn in SINKHORN_METRICS.items()})
    return vals
