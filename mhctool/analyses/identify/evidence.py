"""What a kernel's outputs show where no convention comes near them: how far each
probe's outputs are from the contract at the asked knobs, and for Sinkhorn, whether the rows and
columns sum to one and whether the matrices have collapsed to uniform. A ranking of candidates
that are all far off says nothing; these do."""
from __future__ import annotations

import torch

from mhctool.analyses.identify.conclusion import Probe
from mhctool.analyses.identify.space import SINKHORN_IN
from mhctool.analyses.identify.subject import in_noise

# no candidate within this many times native noise, and the nearest off by an order-one share of
# the outputs (max_rel at least NOTHING_NEAR_REL): none is named as the nearest. A kernel that
# computes the asked convention imprecisely (sums in bf16: 4e4x noise, max_rel 0.1) still is
NOTHING_NEAR = 100.0
NOTHING_NEAR_REL = 0.5


def nothing_near(score: float, max_rel: float) -> bool:
    return score > NOTHING_NEAR and max_rel >= NOTHING_NEAR_REL


def uniform(out: torch.Tensor, tol: float = 1e-3) -> torch.Tensor:
    """Per matrix of a Sinkhorn output ``[..., n, n]``: whether every entry is within ``tol`` of 1/n."""
    n = out.shape[-1]
    return (out.double().cpu().reshape(-1, n * n) - 1.0 / n).abs().amax(-1) < tol


def _sums(kernel: str, probes: list[Probe]) -> str | None:
    """Sinkhorn (alone or in a composite): the largest distance of its matrices' row and column
    sums from one, and how many are uniform (every entry 1/n: an exponential that saturates)."""
    part = SINKHORN_IN.get(kernel)
    if part is None:
        return None
    outs = [p.res.outputs[part.output].double().cpu() for p in probes if p.res.outputs]
    if not outs:
        return None
    rows = max(float((o.sum(-1) - 1).abs().max()) for o in outs)
    cols = max(float((o.sum(-2) - 1).abs().max()) for o in outs)
    n = outs[0].shape[-1]
    flat = torch.cat([uniform(o) for o in outs])
    part = [f"rows sum to one within {rows:.2g}" if rows < 1e-3 else f"rows sum to one only within {rows:.2g}",
            f"columns within {cols:.2g}" if cols < 1e-3 else f"columns only within {cols:.2g}"]
    if int(flat.sum()):
        part.append(f"{int(flat.sum())} of {flat.numel()} matrices uniform (1/{n} everywhere)")
    return ", ".join(part)


def shown(kernel: str, probes: list[Probe]) -> str:
    """One clause: each probe's distance from the contract at the asked knobs (in native noise
    units), then what the output's structure shows."""
    parts = []
    for p in probes:
        if not p.res.outputs or not p.refs:
            continue
        worst = in_noise(p.res.outputs, p.refs, p.noise)
        parts.append(f"{p.case.family} {worst:.3g}x")
    text = "its distance from the contract as asked, in native noise: " + ", ".join(parts)
    sums = _sums(kernel, probes)
    return text + (f"; {sums}" if sums else "")


# a matrix whose error against a candidate is past this many times the native noise differs there
DIFFERS = 10.0

# how far a matrix's logits reach below its max, measured three ways (what a floor, an underflow or
# a threshold would act on): what sets the matrices where a partial fit fails apart, if one does
_DEPTHS = {
    "its row's max": lambda L: (L.amax(-1, keepdim=True) - L).amax((-1, -2)),
    "its column's max": lambda L: (L.amax(-2, keepdim=True) - L).amax((-1, -2)),
    "its matrix's max": lambda L: L.amax((-1, -2)) - L.amin((-1, -2)),
}


def where_differs(kernel: str, base: dict, knobs: dict, output: int, out: torch.Tensor, ref: torch.Tensor,
                  noise: float) -> str:
    """Where the implementation's ``output`` differs from a candidate's (``knobs``) float64 one on
    a probe it fails: for Sinkhorn's matrices (alone or in a composite), which matrices, and whether
    how far their logits reach below a row's, a column's or the matrix's max sets them apart from
    the matrices where it agrees; otherwise how far off the output is."""
    o, r = out.detach().double().cpu(), ref.detach().double().cpu()
    part = SINKHORN_IN.get(kernel)
    if part is None or output != part.output:
        err = float((o - r).abs().max() / r.abs().max().clamp_min(1e-300))
        return f"its outputs are off there by {err:.2g} of their largest magnitude ({err / noise:.3g}x native noise)"
    n = r.shape[-1]
    o, r = o.reshape(-1, n, n), r.reshape(-1, n, n)
    L = part.logits(base, knobs).reshape(-1, n, n)
    # per matrix, in the unit the noise is in (the whole output's largest magnitude)
    err = (o - r).abs().amax((-1, -2)) / r.abs().max().clamp_min(1e-300)
    bad = ~(err <= DIFFERS * noise)  # NaN differs
    k, total = int(bad.sum()), bad.numel()
    if k in (0, total):
        return f"it differs on {k} of {total} matrices"
    # the depth below which every matrix it differs on reaches, per measure: the measure under which
    # the fewest matrices that reach as deep agree (a value just past a floor changes little, so
    # some may); said where at least half of those that reach it differ
    best = None
    for name, depth_of in _DEPTHS.items():
        depth = depth_of(L)
        lo = float(depth[bad].min())
        reach = int((depth >= lo).sum())
        if best is None or k / reach > best[0]:
            best = (k / reach, name, lo, reach)
    share, name, lo, reach = best
    if share < 0.5:
        return f"it differs on {k} of {total} matrices, which how far their logits reach below a max does not set apart"
    return (f"it differs on {k} of {total} matrices, each with a logit {lo:.3g} or more below {name}; of the {reach} "
            f"that reach that far it differs on {k}, and on none that do not: what lies that far below {name} is "
            "computed otherwise (a floor or an underflow there would do this)")
