"""The candidate space of ``mhctool identify``: per kernel, the convention knobs to fit (discrete
and continuous), the variants that are no knobs of the family (a dropped bias, a scale applied
elsewhere), the probes and guards that tell them apart; the known conventions of real kernels,
and how a fitted value is classified (as asked, a known convention, a variant, likely a defect)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from mhctool.analyses.knob_shift import typed_value
from mhctool.core import names
from mhctool.core.errors import UsageError
from mhctool.families import get_family
from mhctool.references import mhc as ref
from mhctool.references.moe import split_glu

FP32_EPS = float(torch.finfo(torch.float32).eps)


# eps: zero, then 1e-12 .. 1e-3 by half decades
EPS_GRID = (0.0,) + tuple(10.0 ** (e / 2) for e in range(-24, -5))


# Sinkhorn's iteration counts: 1 to 64 (a kernel may fix any of them), and around the asked value
ITERS_MAX = 64


# where a kernel floors its logits below their matrix's max (log values floored after the max is
# subtracted); 0 is none, the rest a rarer knob
FLOOR_GRID = (10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0, 100.0)

# an absolute floor on the exponentials, max(exp(x), F), as a kernel guards against an underflow to
# zero; 0 is none, the rest a rarer knob
EXP_FLOOR_GRID = (1e-30, 1e-20, 1e-15, 1e-12, 1e-10, 1e-8, 1e-6)

# an early stop (rows and columns within tol of one), common in Sinkhorn libraries: its forward is
# within rounding of the full count's, its backward is not, so it is tried where the forward fits
# and the backward fails the verdict
TOL_GRID = (1e-9, 1e-8, 1e-7, 1e-6, 1e-5, 1e-4, 1e-3)

# knobs said only where set (at any other value than this one): a floor of 0 is no floor
UNSAID = {"floor": 0.0, "tol": 0.0, "exp_floor": 0.0}

LIMIT_GRID = (1.0, 2.0, 3.0, 5.0, 7.0, 10.0, 20.0, 1e9)

# where a kernel clamps the exponential's argument (stabilize=clamp): 20 and 88 (fp32's exp
# overflow, rounded) the common bounds, the rest a grid between
CLAMP_GRID = (5.0, 10.0, 15.0, 20.0, 30.0, 50.0, 88.0)


def _drop_bias(fn: Callable, keep: bool) -> Callable:
    if keep:
        return fn

    def no_bias(h_res, x, h_post, y, bias=None, transpose_res=False, matmul_precision="ieee", **knobs):
        kw = {"matmul_precision": matmul_precision} if matmul_precision != "ieee" else {}
        out = fn(h_res, x, h_post, y, None, transpose_res=transpose_res, **kw, **knobs)
        # the bias still gets a (zero) gradient, as from a kernel that takes it and ignores it
        return out if bias is None else out + (0.0 * bias.sum()).to(out.dtype)
    return no_bias


def _scale_at(fn: Callable, where: str) -> Callable:
    if where == "output":
        return fn

    def scaled_input(x, scale=None, **kw):
        if scale is not None:
            x = (x * scale.unsqueeze(-1)).to(x.dtype)
        return fn(x, None, **kw)
    return scaled_input


@dataclass(frozen=True)
class Variant:
    """A candidate knob that no family knob expresses: how a value rewrites a function of the
    family's signature (the reference and the native baseline alike)."""

    values: tuple
    wrap: Callable[[Callable, object], Callable]


@dataclass(frozen=True)
class Space:
    probes: tuple[str, ...]  # input families
    shape: str  # default probe shape
    discrete: dict = field(default_factory=dict)  # knob -> values tried exhaustively
    continuous: dict = field(default_factory=dict)  # knob -> coarse grid, then refined
    variants: dict = field(default_factory=dict)  # knob -> Variant
    # a continuous knob the reference takes as a tensor along a new leading axis, so its whole grid
    # is one reference call (the reference is reused where only that knob changes)
    batched: str | None = None
    # a discrete knob whose values share a prefix of the computation (Sinkhorn's iteration count):
    # the reference takes the increasing values as a tuple and stacks its outputs along a leading
    # axis in front of the batched knob's, so the values of both are one reference call
    prefix: str | None = None
    # the input whose leading axis holds independent problems (Sinkhorn's matrices): probes of one
    # shape go to the reference as one input along it, one call for all of them
    stackable: str | None = None
    # knobs that change no float64 value but the native baseline (how a kernel computes), tried when
    # a candidate fails the verdict: candidate knobs -> the {knob: value}s to judge it again with,
    # in order (none: an empty list)
    judge_also: Callable[[dict], list[dict]] = lambda knobs: []
    # of those, the knobs that only round differently (fast math: a few times IEEE's error at most,
    # measured), tried only on a near miss: a candidate whose error is within this many native
    # noise units
    rounding_only: tuple[str, ...] = ("math",)
    near_miss: float = 8.0
    # input families run and judged but never fitted: where an overflow shows (a non-finite output
    # fits nothing, so fitting on it would blur every candidate's score)
    guards: tuple[str, ...] = ()
    # discrete values rarer kernels compute, tried only where nothing in the first grid comes near
    # (Sinkhorn's eps as a threshold): knob -> the values added
    later: dict = field(default_factory=dict)
    # discrete values tried only where a guard's outputs are finite but collapsed (Sinkhorn's
    # clamped exponential), fitted with the probes named: (knob -> the values added, the probes)
    saturating: tuple = ({}, ())
    # knobs that mean something under one value of another only (Knob.only_with): knob -> its grid,
    # the candidates with that value tried at each point (a clamped exponential's bound)
    depends: dict = field(default_factory=dict)
    # knobs that change no float64 value, only how the native baseline computes (Sinkhorn's domain
    # and math): never held at the asked value for every candidate (a log-domain baseline has no
    # eps, so a candidate with one would be judged against a baseline that is itself off); each
    # candidate is judged at the family's value, then with ``judge_also``'s
    how: tuple[str, ...] = ()
    # continuous knobs held at the best common fit's values while the rarer conventions are
    # searched (a composite's mapping knobs: the rarer ones are Sinkhorn's, and the mapping's grid
    # would multiply their search many times over); refined with the rest afterwards
    hold_later: tuple[str, ...] = ()
    # knobs whose values change the backward far more than the forward (Sinkhorn's early stop):
    # knob -> values, each judged with the best candidate where its forward fits and its
    # backward fails the verdict
    backward: dict = field(default_factory=dict)


def _clamped_swiglu_at(fn: Callable, where: str) -> Callable:
    """Where clamped SwiGLU's limit applies: ``both`` (the contract: the gate from above, the
    linear half both ways), ``gate`` only, ``linear`` only, ``none``."""
    if where == "both":
        return fn

    def variant(x, scale=None, interleave=0, limit=7.0, alpha=1.702, offset=1.0):
        xf = x if x.dtype == torch.float64 else x.float()
        a, b = split_glu(xf, interleave)
        if where == "gate":
            a = a.clamp(max=limit)
        elif where == "linear":
            b = b.clamp(-limit, limit)
        f = a * torch.sigmoid(alpha * a) * (b + offset)
        if scale is not None:
            f = f * scale.unsqueeze(-1)
        return f.to(x.dtype)
    return variant


@dataclass(frozen=True)
class SinkhornPart:
    """Where a kernel computes Sinkhorn (itself, or a composite after the mapping): the knob that
    is Sinkhorn's eps, the output that is the doubly stochastic matrix, and the family that shows
    an overflow without max subtraction."""

    eps: str
    output: int
    overflow_probe: str

    def logits(self, base: dict, knobs: dict) -> torch.Tensor:
        """The float64 logits a probe's inputs give at a candidate's knobs (a composite's from the
        reference mapping), ``[..., n, n]``."""
        if "logits" in base:
            return base["logits"].detach().double().cpu()
        x = base["x"].detach().double().cpu()
        s, b, n, c = x.shape
        _, _, logits = ref.mapping(x.reshape(s * b, n * c), *(base[k].detach().double().cpu()
                                                              for k in ("weight", "alpha", "h_bias")),
                                   float(knobs.get("eps", 1e-6)), rms_eps=knobs.get("rms_eps", "outside"),
                                   compute_h_eps=float(knobs.get("compute_h_eps", 0.0)))
        return logits.reshape(s, b, n, n)


# the kernels that compute Sinkhorn, and where
SINKHORN_IN = {"sinkhorn": SinkhornPart("eps", 0, "large_logits"),
               "mapping_sinkhorn": SinkhornPart("sinkhorn_eps", 2, "res_large"),
               "mix_aggregate": SinkhornPart("sinkhorn_eps", 2, "res_large")}


def eps_zero_as_add(kernel: str, knobs: dict) -> dict:
    """``knobs`` with a Sinkhorn's eps at 0 under another mode written as adding 0: the same
    function (max(sum, 0) is the sum; dividing only sums above 0 divides every sum of exponentials,
    never 0 in float64), which the noise alone would tell apart."""
    part = SINKHORN_IN.get(kernel)
    if part and knobs.get(part.eps) == 0.0 and knobs.get("eps_mode", "add") != "add":
        return {**knobs, "eps_mode": "add"}
    return dict(knobs)


def _sinkhorn_also(eps: str) -> Callable[[dict], list[dict]]:
    """How a Sinkhorn kernel may compute what a candidate names: without eps (its eps knob named
    ``eps``), in the log domain (its rounding is the log-domain baseline's), unless the candidate
    exponentiates raw logits (a clamped exponential) or takes eps as a threshold, which the
    log-domain baseline does not; otherwise with fast math (__expf, a reciprocal-multiply per division)."""
    def also(knobs: dict) -> list[dict]:
        log = knobs.get(eps) == 0.0 and knobs.get("stabilize") != "clamp" and knobs.get("eps_mode") in (None, "add", "clamp")
        return [{"domain": "log"}] if log else [{"math": "fast"}]
    return also


def space(kernel: str, asked: dict) -> Space:
    """What identification tries for ``kernel``; ``iters`` around the asked value."""
    if kernel == "sinkhorn":
        it = int(asked.get("iters", 20))
        return Space(("random", "eps_sweep", "dead_rows_cols", "near_perm"), "16x4x4x1",
                     {"stabilize": ref.STABILIZE, "eps_mode": ("add", "clamp"), "order": ref.ORDERS,
                      "floor": (0.0,), "exp_floor": (0.0,),
                      "iters": tuple(range(1, max(ITERS_MAX, it + 3) + 1))},
                     {"eps": EPS_GRID}, batched="eps", prefix="iters",
                     judge_also=_sinkhorn_also(SINKHORN_IN[kernel].eps),
                     guards=("large_logits",), stackable="logits",
                     later={"eps_mode": ("threshold", "threshold_zero"), "floor": FLOOR_GRID,
                            "exp_floor": EXP_FLOOR_GRID},
                     backward={"tol": TOL_GRID},
                     saturating=({"stabilize": ref.STABILIZE_RARE}, ("clamp_sweep",)),
                     depends={"clamp_at": CLAMP_GRID}, how=("domain", "math"))
    if kernel == "h_post_bda":
        return Space(("random",), "4x3x4x67", {"transpose_res": (False, True), "bias": (True, False)},
                     variants={"bias": Variant((True, False), _drop_bias)})
    if kernel == "proj_rms":
        return Space(("random", "tiny_norm"), "4x3x4x67", {"rms_eps": ref.RMS_EPS}, {"eps": EPS_GRID})
    if kernel == "mapping":
        return Space(("random", "tiny_norm"), "4x3x4x67", {"rms_eps": ref.RMS_EPS},
                     {"eps": EPS_GRID, "compute_h_eps": EPS_GRID})
    if kernel in ("mapping_sinkhorn", "mix_aggregate"):
        # the mapping's knobs and Sinkhorn's at once: the common discrete ones exhaustively, the
        # mapping's eps on the grid, Sinkhorn's eps batched, compute_h's eps at the values libraries
        # use; Sinkhorn's rarer knobs (eps clamped or a threshold, a floor, a clamped exponential,
        # fast math) as for Sinkhorn alone, on H_res logits the mapping computes (res_depths: the
        # dead columns of Sinkhorn's probes; res_large its guard; res_levels its clamp sweep), with
        # the mapping's eps held at the best common fit's. Sums clamped at eps are a rarer value
        # here: at the 20 iterations a composite runs they converge as eps=0's do on its probes
        # (Sinkhorn alone fits the count on a slowly converging probe)
        return Space(("random", "tiny_norm", "res_depths"), "4x3x4x67",
                     {"rms_eps": ref.RMS_EPS, "stabilize": ref.STABILIZE, "eps_mode": ("add",),
                      "order": ref.ORDERS, "floor": (0.0,)},
                     {"eps": EPS_GRID, "compute_h_eps": (0.0, 1e-8, 1e-6, 1e-4), "sinkhorn_eps": EPS_GRID},
                     batched="sinkhorn_eps", judge_also=_sinkhorn_also(SINKHORN_IN[kernel].eps), guards=("res_large",),
                     later={"eps_mode": ("clamp", "threshold", "threshold_zero"), "floor": FLOOR_GRID},
                     saturating=({"stabilize": ref.STABILIZE_RARE}, ("res_levels",)),
                     depends={"clamp_at": CLAMP_GRID}, how=("domain", "math"), hold_later=("eps", "compute_h_eps"))
    if kernel == "h_aggregate":
        return Space(("random",), "4x3x4x67")
    if kernel == "swiglu":
        return Space(("random",), "37x1x96x1", {"scale_at": ("output", "input")},
                     variants={"scale_at": Variant(("output", "input"), _scale_at)})
    if kernel == "clamped_swiglu":
        return Space(("random",), "37x1x96x1",
                     {"scale_at": ("output", "input"), "clamp_at": ("both", "gate", "linear", "none")},
                     {"limit": LIMIT_GRID},
                     variants={"scale_at": Variant(("output", "input"), _scale_at),
                               "clamp_at": Variant(("both", "gate", "linear", "none"), _clamped_swiglu_at)})
    raise AssertionError(kernel)  # check_kernel first


IDENTIFIABLE = names.IDENTIFIABLE


def checked_knobs(kernel: str, values: dict, from_text: bool = False) -> dict:
    """The knob values an implementation is asked for, each checked (``from_text``: typed from
    ``--knob`` strings first); a name that is no knob of the kernel is a UsageError."""
    fam = get_family(kernel)
    out = {}
    for name, v in values.items():
        if name not in fam.knobs:
            raise UsageError(f"knob {name} is no knob of {kernel}; accepted: " + (", ".join(fam.knobs) or "none"))
        knob = fam.knobs[name]
        out[name] = knob.check(kernel, name, typed_value(knob.kind, name, v) if from_text else v)
    return out


def check_kernel(kernel: str) -> str:
    """``kernel`` when identify knows its conventions; an unknown kernel or another one is a UsageError."""
    get_family(kernel)
    if kernel not in IDENTIFIABLE:
        raise UsageError(f"mhctool identify knows no conventions of {kernel}; it identifies " + ", ".join(IDENTIFIABLE))
    return kernel


# conventions real libraries use: (kernel, knob, value) -> who
KNOWN = {
    ("sinkhorn", "stabilize", "softmax"): "as in Megatron-LM's dev branch (a row softmax plus eps first)",
    ("sinkhorn", "stabilize", "colmax"): "max subtraction along the axis normalised first (x - x.amax(dim=-2) with "
                                         "columns first, a common PyTorch form)",
    ("sinkhorn", "eps", 0.0): "as in TransformerEngine (log-domain iterations, no eps)",
    ("sinkhorn", "domain", "log"): "as in TransformerEngine (judged against the log-domain native baseline)",
    ("sinkhorn", "math", "fast"): "as a kernel built with --use_fast_math computes (__expf, a reciprocal-multiply "
                                  "per division; judged against a native baseline that computes the same way)",
    ("h_post_bda", "transpose_res", True): "as in Megatron-LM's dev branch and TransformerEngine (H_res^T)",
    ("proj_rms", "rms_eps", "inside"): "as in TransformerEngine and RMSNorm (eps inside the square root)",
    ("proj_rms", "eps", FP32_EPS): "as in TransformerEngine (eps = fp32 machine epsilon)",
    ("mapping", "rms_eps", "inside"): "as in TransformerEngine and RMSNorm (eps inside the square root)",
    ("mapping", "eps", FP32_EPS): "as in TransformerEngine (eps = fp32 machine epsilon)",
    ("mapping", "compute_h_eps", 1e-6): "as in Megatron-LM's dev branch (sigmoid + 1e-6)",
}


for _k in ("mapping_sinkhorn", "mix_aggregate"):  # the composites: the mapping's and Sinkhorn's conventions
    KNOWN.update({
        (_k, "rms_eps", "inside"): "as in TransformerEngine and Liger-Kernel (eps inside the square root)",
        (_k, "eps", FP32_EPS): "as in TransformerEngine (eps = fp32 machine epsilon)",
        (_k, "compute_h_eps", 1e-6): "as in Megatron-LM's dev branch (sigmoid + 1e-6)",
        (_k, "stabilize", "softmax"): "as in Liger-Kernel and Megatron-LM's dev branch (a row softmax plus eps first)",
        (_k, "stabilize", "colmax"): KNOWN[("sinkhorn", "stabilize", "colmax")],
        (_k, "sinkhorn_eps", 0.0): "as in TransformerEngine (log-domain iterations, no eps)",
        (_k, "domain", "log"): "as in TransformerEngine (judged against the log-domain native baseline)",
        (_k, "math", "fast"): KNOWN[("sinkhorn", "math", "fast")],
    })


# how loose a precision's baseline is (parity judges a kernel whose forward and backward differ at the looser)
LOOSENESS = {"ieee": 0, "tf32": 1, "tf32_trunc": 1, "bf16": 2}


# what a matrix product at each precision is (the hint names it; ieee is the contract)
PRECISION_NOTES = {
    "ieee": "multiplies at IEEE fp32",
    "tf32": "multiplies at TF32 rounded to nearest (cuBLAS, PyTorch's allow_tf32)",
    "tf32_trunc": ("multiplies at TF32 with truncated operands: Triton's default for tl.dot on fp32 "
                   "(or build it with input_precision='ieee')"),
    "bf16": "multiplies bf16 operands (fp32 values rounded to bf16 before the product)",
}


# knobs where a value other than the one asked for is no library's convention
DEFECT_KNOBS = {"iters", "eps", "compute_h_eps", "limit", "bias", "scale_at", "sinkhorn_eps"}


# values that would be a defect if the implementation's own outputs show it: (kernel, knob, value)
# -> (the defect, the probe family that shows it); without that evidence the fit is a tie, not a claim
SUSPICIOUS_VALUES = {(k, "stabilize", "none"): ("no max subtraction: exp overflows for large logits", part.overflow_probe)
                     for k, part in SINKHORN_IN.items()}


def same_value(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        a, b = float(a), float(b)
        return a == b or (a != 0 and b != 0 and abs(a - b) <= 1e-3 * max(abs(a), abs(b)))
    return a == b


def fmt_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return "inf" if v >= 1e9 else f"{v:g}"
    return str(v)


def knob_signature(knobs: dict, names) -> tuple:
    """A candidate's values of the knobs ``names`` (its discrete combination)."""
    return tuple(fmt_value(knobs[k]) for k in names)


def fmt_knobs(knobs: dict) -> str:
    return " ".join(f"{k}={fmt_value(v)}" for k, v in knobs.items() if not (k in UNSAID and UNSAID[k] == v))


def classify(kernel: str, fitted: dict, asked: dict, evidence: dict | None = None,
             ignored: dict | None = None, shown_only: bool = False,
             takes: Callable[[str], bool] = lambda knob: True) -> tuple[str, str]:
    """(``as asked`` | ``known convention`` | ``variant`` | ``likely a defect``, the sentence).

    ``evidence``: knob -> (shown, what was measured), from :meth:`Identifier.evidence` on the
    implementation's own outputs. A value that would be a defect is called one only where its
    evidence shows it; without evidence (the unit's own use) the sentence says it is unconfirmed.
    ``ignored``: knob -> how (``takes no`` / ``ignores``): the implementation runs its own value
    whatever it is asked, which the sentence says first. ``shown_only``: only the claims that
    evidence shows (a candidate that fails its own judging explains nothing else). In the log
    domain nothing is exponentiated raw, so no stabilisation is claimed at all. ``takes(knob)``:
    whether the implementation has a parameter for the knob (said where it computes the contract's
    value of one it was asked otherwise)."""
    ignored = ignored or {}
    knobs = get_family(kernel).knobs
    # a knob that means something under one value of another only is said with it (Knob.only_with)
    diff = {k: v for k, v in fitted.items() if (k not in asked or not same_value(v, asked[k]))
            and (k not in knobs or knobs[k].only_with is None)}
    if fitted.get("domain") == "log" and "stabilize" in diff:
        del diff["stabilize"]  # a log-domain iteration never exponentiates the raw logits
    fixed = [f"ignores {k}: runs {fmt_value(fitted[k])} whatever it is asked, which is what was asked"
             + _param_note(k, ignored[k]) for k in fitted if k in ignored and k not in diff]
    if not diff:
        return "as asked", "; ".join(["computes what it was asked for", *fixed])
    notes, level = [], 0
    for k, v in diff.items():
        known = next((who for (kk, kn, kv), who in KNOWN.items() if kk == kernel and kn == k and same_value(kv, v)), None)
        odd = SUSPICIOUS_VALUES.get((kernel, k, v))
        shown, measured = (evidence or {}).get(k, (None, None))
        own = None
        if k in ignored and shown is False:  # what it runs is not told by its outputs: no claim of it
            own = ((f"it takes no {k} parameter" if ignored[k] == "takes no" else f"ignores {k}")
                   + f", and its outputs do not tell {k}={fmt_value(v)} from the asked {fmt_value(asked.get(k))} "
                   f"({measured})")
        elif k in ignored:
            own = (f"ignores {k}: runs {fmt_value(v)} whatever it is asked (asked for {fmt_value(asked.get(k))}"
                   f"{_param_note(k, ignored[k])})")
        if shown_only and not (odd and shown):
            continue
        if k in knobs and k not in DEFECT_KNOBS and same_value(v, knobs[k].default) and k in asked:
            # the contract's own value, not what was asked: never "a variant"
            notes.append(f"computes the contract's {k}={fmt_value(v)}, not the asked {fmt_value(asked[k])}"
                         + (f" (it takes no {k} parameter)" if ignored.get(k) == "takes no" or not takes(k) else
                            f" (it ignores {k})" if k in ignored else ""))
        elif known:
            notes.append(f"{own}: a known convention, {known}" if own else f"{k}={fmt_value(v)}: a known convention, {known}")
        elif kernel in SINKHORN_IN and k == "tol":
            level = max(level, 1)
            notes.append(f"tol={fmt_value(v)}: it stops early, each matrix once its row and column sums are within "
                         f"{fmt_value(v)} of one, at most iters={fmt_value(fitted.get('iters'))} iterations (the early "
                         "stop Sinkhorn libraries offer; its count depends on the data, and its gradient is that of "
                         "the iterations it ran)")
        elif kernel in SINKHORN_IN and k == "exp_floor":
            level = max(level, 1)
            notes.append(f"exp_floor={fmt_value(v)}: its exponentials floored at {fmt_value(v)} (max(exp(x), "
                         f"{fmt_value(v)}): logits below {math.log(v):.3g} count as {math.log(v):.3g}), a variant no "
                         "library mhctool knows uses: check it is intended")
        elif kernel in SINKHORN_IN and k == "floor":
            level = max(level, 1)
            notes.append(f"floor={fmt_value(v)}: every logit more than {fmt_value(v)} below its matrix's max raised "
                         f"to that level (log values floored after the max is subtracted): finite, but matrices whose "
                         f"logits span more than {fmt_value(v)} lose the differences below (a variant no library "
                         "mhctool knows uses: check it is intended)")
        elif kernel in SINKHORN_IN and (k, v) == ("stabilize", "clamp"):
            level = max(level, 1)
            b = fmt_value(fitted["clamp_at"])
            notes.append(f"stabilize=clamp clamp_at={b}: the exponential clamped at {b} (exp(min(x, {b})), no max "
                         f"subtraction, as a CUDA kernel's __expf(fminf(x, {b}))): finite, but logits past {b} lose "
                         "their differences (a variant no library mhctool knows uses: check it is intended)")
        elif (odd or k in DEFECT_KNOBS) and shown is False:
            level = max(level, 1)
            notes.append(own if own else f"{k}={fmt_value(v)} fits, but no defect is shown: {measured}")
        elif (odd or k in DEFECT_KNOBS) and ignored.get(k) == "takes no":
            # no parameter to follow: a fixed choice of the function's, declared, never its defect
            level = max(level, 1)
            notes.append(f"{own}: a fixed choice, not what was asked (declare it: --convention {k}={fmt_value(v)})"
                         + (f"; shown: {measured}" if shown else ""))
        elif odd or k in DEFECT_KNOBS:
            level = 2
            what = f" ({odd[0]})" if odd else ""
            head = own or f"matches with {k}={fmt_value(v)} — asked for {fmt_value(asked.get(k))}"
            notes.append(f"{head}: likely a defect{what}"
                         + (f"; shown: {measured}" if shown else "; not yet shown on its outputs"))
        else:
            level = max(level, 1)
            notes.append(f"{own}: a variant no library mhctool knows uses (check it is intended)" if own
                         else f"{k}={fmt_value(v)}: a variant no library mhctool knows uses (check it is intended)")
    return ("known convention", "variant", "likely a defect")[level], "; ".join(notes + fixed)


def _param_note(knob: str, how: str) -> str:
    return f"; it takes no {knob} parameter" if how == "takes no" else ""


def knob_key(knobs: dict) -> tuple:
    """A candidate's identity: its knob values by name (the cache of fits, the table's rows)."""
    return tuple(sorted((k, str(v)) for k, v in knobs.items()))


def far_from(kind: type, v):
    """A value of a knob far from ``v``: one iteration (two where ``v`` is one), or 1e-3 times
    (1e3 times, for values under 1e-4; 1e-3 for zero) a float."""
    if kind is int:
        return 1 if v != 1 else 2
    if v == 0:
        return 1e-3
    return v * 1e3 if abs(v) < 1e-4 else v * 1e-3


def roundness(v: float, preferred: list) -> int:
    """0 for an asked or known value, 1 for a power of ten, 2 for 2 or 5 times one, 3 otherwise."""
    if any(same_value(v, p) for p in preferred):
        return 0
    if v <= 0:
        return 3
    m = v / 10.0 ** math.floor(math.log10(v) + 1e-9)
    return 1 if same_value(m, 1.0) else 2 if same_value(m, 2.0) or same_value(m, 5.0) else 3
