"""Error metrics: one pure function each, ``(out, ref) -> float``.

``out`` is an implementation's tensor at its own dtype, ``ref`` the float64 reference. Errors are
measured where the reference is finite; a non-finite output there makes the error infinite, except
an infinity of the reference's sign where the reference lies past the largest finite value of the
output's dtype (the correctly rounded result: the contract's value is not finite in that dtype).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mhctool.core.dtypes import fmt_of, is_poison


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


_EXPONENT_BITS = 0x7FF0000000000000  # of a float64: with the rest cleared, 2 ** floor(log2 |x|)


def ulp_size(values: torch.Tensor, f) -> torch.Tensor:
    """The unit in the last place of format ``f`` at each of ``values``: ``2 ** (e - mantissa
    bits)``, ``e`` the exponent of ``|value|`` (at least the format's smallest normal's).

    For float64 values the exponent is read from the bits (three passes; ``floor(log2 |x|)``
    took six, and gave the next binade for a value a float64 rounding below a power of two
    ``2**k``, ``|k| >= 2``: half the errors in ulps there). An infinity gives an infinite ulp,
    a NaN an infinite one too (the NaN of an error over it stays NaN)."""
    if values.dtype != torch.float64:
        exp = torch.floor(torch.log2(values.abs().clamp_min(2.0 ** f.min_exponent)))
        return 2.0 ** (exp - f.mantissa_bits)
    power = torch.bitwise_and(values.detach().view(torch.int64), _EXPONENT_BITS).view(torch.float64)
    return power.clamp_min_(2.0 ** f.min_exponent).mul_(2.0 ** -f.mantissa_bits)


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
    """Elements exactly zero in the output where the reference is not, even rounded to the output's
    dtype (underflow, skipped writes; a reference below the dtype's smallest number rounds to zero)."""
    o, r = out.detach(), ref.detach()
    return float(((o == 0) & _nonzero_at(r, o.dtype)).sum())


def _nonzero_at(ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return ref.to(dtype) != 0 if dtype.is_floating_point else ref != 0


def row_residual(out, ref=None) -> float:
    """Sinkhorn: ``max |rowsum - 1|`` of the output itself."""
    s = out.detach().to(torch.float64).sum(-1)
    return float((s - 1).abs().max()) if s.numel() else 0.0


def col_residual(out, ref=None) -> float:
    """Sinkhorn: ``max |colsum - 1|`` of the output itself."""
    s = out.detach().to(torch.float64).sum(-2)
    return float((s - 1).abs().max()) if s.numel() else 0.0


def h_res_health(h: torch.Tensor) -> dict[str, torch.Tensor]:
    """A doubly stochastic H_res's health in training, as 0-d float64 tensors on its device (read
    them where a sync is due): its largest row- and column-sum deviation from 1 and its smallest
    entry, a non-finite entry counting as infinitely far off (never as the smallest)."""
    m = h.detach().double()
    return {"row-sum deviation": (m.sum(-1) - 1).abs().nan_to_num(math.inf).max(),
            "col-sum deviation": (m.sum(-2) - 1).abs().nan_to_num(math.inf).max(),
            "smallest entry": m.nan_to_num(math.inf).min()}


ERROR_METRICS = {"max_abs": max_abs, "rel_l2": rel_l2, "max_rel": max_rel, "ulp": ulp}
COUNT_METRICS = {"nonfinite": nonfinite, "unwritten": unwritten, "extra_zeros": extra_zeros}
SINKHORN_METRICS = {"row_residual": row_residual, "col_residual": col_residual}


@dataclass(frozen=True)
class Reference:
    """What judging needs of one float64 reference whatever the output judged against it: worked
    out once per reference (:func:`reference`) and shared by every implementation's tensor."""

    finite: bool  # every element finite: the errors need no compacted copy
    amax: float  # :func:`finite_amax`: the scale of the verdict and of max_rel's "tiny"
    norm: float  # the L2 norm (when ``finite``): rel_l2's denominator


def reference(ref: torch.Tensor) -> Reference:
    r = ref.detach()
    finite = bool(r.numel()) and bool(torch.isfinite(r).all())
    # over the flattened reference, as the compacted form takes it (a strided one sums in another order)
    norm = float(torch.linalg.vector_norm(r.reshape(-1).to(torch.float64))) if finite else 0.0
    return Reference(finite, finite_amax(r), norm)


def _errors(out: torch.Tensor, ref: torch.Tensor, of: Reference | None = None) -> dict[str, float]:
    """The four error metrics (the values of :func:`max_abs`, :func:`rel_l2`, :func:`max_rel` and
    :func:`ulp`) from one difference; each metric alone computes it again. With a finite
    reference (``of``: its facts, worked out once) the difference is taken whole, with no copy of
    the output and no pass that depends on the reference alone; a non-finite reference or output
    (its largest error not finite) takes the compacted form, over the finite references."""
    of = of or reference(ref)
    r = ref.detach().reshape(-1)
    if of.finite and r.dtype == torch.float64:
        # torch.sub converts the output to float64 as it reads it (exact): no float64 copy of it
        d = torch.sub(out.detach().reshape(-1), r).abs_()
        if math.isfinite(largest := float(d.max())):
            return _from_difference(d, r, out.dtype, largest, of.amax, of.norm)
    d, r = _abs_err(out, ref)
    if not d.numel():
        return dict.fromkeys(ERROR_METRICS, 0.0)
    return _from_difference(d, r, out.dtype, float(d.max()), float(r.abs().max()),
                            float(torch.linalg.vector_norm(r)))


def _from_difference(d: torch.Tensor, r: torch.Tensor, dtype: torch.dtype, largest: float, amax: float,
                     norm: float) -> dict[str, float]:
    """The four error metrics from ``d = |out - r|`` (consumed: divided in place), the float64
    reference ``r`` over the same elements, ``max d``, ``max |r|`` and ``||r||``."""
    num = float(torch.linalg.vector_norm(d))
    unit = ulp_size(r, fmt_of(dtype))
    ulps = float(torch.div(d, unit, out=unit).max())
    del unit
    ra = r.abs()
    # masked, not indexed: an index compacts a copy (and waits for the device to count it); the
    # same maximum (every ratio is >= 0)
    rel = float(d.div_(ra).masked_fill_(ra <= amax * 1e-6, 0.0).max())
    return {"max_abs": largest, "rel_l2": num if norm == 0 else num / norm, "max_rel": rel, "ulp": ulps}


def measure(out: torch.Tensor, ref: torch.Tensor, sinkhorn_output: bool = False,
            of: Reference | None = None) -> dict[str, float]:
    """Every metric of ``out`` against ``ref`` (``of``: the reference's facts, where known)."""
    of = of or reference(ref)
    vals = _errors(out, ref, of)
    if of.finite and math.isfinite(vals["max_abs"]):
        # a finite output: no non-finite element, no poison (a NaN); zeros looked for in its own dtype
        zero = out.detach() == 0
        vals |= {"nonfinite": 0.0, "unwritten": 0.0,
                 "extra_zeros": float((zero & _nonzero_at(ref.detach(), out.dtype)).sum()) if bool(zero.any()) else 0.0}
    else:
        vals |= {name: fn(out, ref) for name, fn in COUNT_METRICS.items()}
    if sinkhorn_output:
        vals.update({name: fn(out) for name, fn in SINKHORN_METRICS.items()})
    return vals


def mask_mismatch(out: torch.Tensor, ref: torch.Tensor, branch: torch.Tensor, kept: torch.Tensor,
                  native_err: float, amax: float) -> float:
    """How many elements of ``out`` take the other branch than the contract's (dropped where the
    contract keeps, or kept where it drops): another mask. An element is *off* where it lies
    further than ``tol`` from the contract's value, ``tol`` being 16 times the native run's
    largest error plus four roundoffs of the output's format at the output's scale (a correct
    kernel's error stays within a few times native's, so none of its elements is off); an off
    element *at the other branch* lies within ``tol`` of that branch's value. The count is said
    only where the other branch explains the output: at least eight of nine off elements are at
    it. An output wrong otherwise (a bias outside the dropout, an unscaled branch) is near
    neither branch: its error rows say so, and this count is zero."""
    tol = 16.0 * native_err + 4.0 * fmt_of(out.dtype).unit_roundoff * amax
    flat = [t.detach().reshape(-1) for t in (out, ref, branch, kept)]
    count = off = 0
    step = 1 << 24  # float64 temporaries of 128 MiB (a paper-shape output is 940 M elements)
    for a in range(0, flat[0].numel(), step):
        o, r, d, k = (t[a:a + step] for t in flat)
        o, r, d = o.double(), r.double(), d.double()
        far = (o - r).abs() > tol
        at_alt = (o - torch.where(k, r - d, r + d)).abs() <= tol
        count += int((far & at_alt).sum())
        off += int((far & ~at_alt).sum())
    return float(count) if count and 8 * off <= count else 0.0
