"""What changing one knob does to the numbers (``mhctool stability eps``).

Two settings A and B of one knob of a kernel (eps 1e-6 -> 1e-8, ``order=row_first,col_first``, ...):

* kernel level, per input family and dtype: the output shift ``impl(B) - impl(A)`` in absolute
  terms and in ulps of the output dtype, beside the float64 shift ``ref(B) - ref(A)`` and the
  implementation's own rounding error at A (``noise``): a shift below the noise cannot be told
  from rounding;
* stack level: A and B applied to every layer of a stack of L mHC layers (float64 references,
  the depth of the mHC test recipe by default), the relative shift of the residual stream after
  each layer, against the shift that storing activations in the dtype causes by itself.

Each input family of the kernel has a stack counterpart that puts the same condition into the
mapping path: a dead column or a near-permutation in the H_res logits (through ``h_bias``),
rows of tiny or huge norm (through the scale of the input).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mhctool.core import metrics
from mhctool.core.dtypes import FORMATS, fmt_of
from mhctool.core.errors import UsageError
from mhctool.core.shapes import Shape
from mhctool.families import Family, generate, get_family
from mhctool.references import mhc as ref
from mhctool.registry.impl import Impl
from mhctool.runner.call import cast_inputs

# kernel knob -> keyword of references.mhc.mhc_layer
_LAYER_KW = {
    "sinkhorn": {"iters": "sinkhorn_iters", "eps": "sinkhorn_eps", "stabilize": "stabilize",
                 "eps_mode": "eps_mode", "order": "order"},
    "proj_rms": {"eps": "rms_eps"},
    "mapping": {"eps": "rms_eps"},
    "h_post_bda": {"transpose_res": "transpose_res"},
}
KERNEL_SHAPES = {
    "sinkhorn": Shape(256, 1, 4, 1),
    "proj_rms": Shape(64, 1, 4, 64),
    "mapping": Shape(64, 1, 4, 64),
    "h_post_bda": Shape(32, 2, 4, 128),
}


@dataclass(frozen=True)
class KnobChange:
    kernel: str
    knob: str
    a: object
    b: object

    @property
    def label(self) -> str:
        return f"{self.knob}: {self.a!r} -> {self.b!r}"


def parse_change(kernel: str, knob_spec: str | None, frm: str | None, to: str | None) -> KnobChange:
    """``--knob name=A,B``, or ``--from A --to B`` for eps. Values are typed by the family's knob."""
    fam = get_family(kernel)
    if kernel not in _LAYER_KW:
        raise UsageError(f"kernel {kernel} has no knob to change; accepted: {', '.join(_LAYER_KW)}")
    if knob_spec is not None:
        if frm is not None or to is not None:
            raise UsageError("give either --knob NAME=A,B or --from/--to (for eps), not both")
        name, sep, values = knob_spec.partition("=")
        parts = values.split(",")
        if not sep or len(parts) != 2 or not all(p.strip() for p in parts):
            raise UsageError(f"--knob {knob_spec!r} is not NAME=A,B (e.g. order=row_first,col_first)")
        a, b = (p.strip() for p in parts)
    else:
        if frm is None or to is None:
            raise UsageError("give --from and --to (eps values), or --knob NAME=A,B")
        name, a, b = "eps", frm, to
    name = name.strip()
    if name not in fam.knobs or not fam.knobs[name].passed:
        accepted = [k for k, v in fam.knobs.items() if v.passed]
        raise UsageError(f"unknown knob {name!r} for kernel {kernel}; accepted: {', '.join(accepted)}")
    knob = fam.knobs[name]
    va, vb = (knob.check(kernel, name, typed_value(knob.kind, name, v)) for v in (a, b))
    if va == vb:
        raise UsageError(f"--knob {name}: both settings are {va!r}; give two different values")
    return KnobChange(kernel, name, va, vb)


def typed_value(kind: type, name: str, text: str):
    if kind is bool:
        low = text.lower()
        if low not in ("true", "false"):
            raise UsageError(f"knob {name}={text!r} must be true or false")
        return low == "true"
    if kind in (int, float):
        try:
            v = float(text)
        except ValueError:
            raise UsageError(f"knob {name}={text!r} must be a number") from None
        return int(v) if kind is int and v == int(v) else v
    return text


def _impl_outputs(fam: Family, impl: Impl, args: dict, knobs: dict) -> list[torch.Tensor]:
    with torch.no_grad():
        return [o.detach() for o in fam.call(impl.fn, args, knobs, impl.accepts, impl.bind, impl.takes)]


def kernel_shift(change: KnobChange, impl: Impl, family: str, dtype: str, device: str, seed: int = 0) -> list[dict]:
    """Rows of the kernel-level comparison for one input family and dtype."""
    fam = get_family(change.kernel)
    base_knobs = {k: v.default for k, v in fam.knobs.items() if v.passed}
    ka, kb = dict(base_knobs, **{change.knob: change.a}), dict(base_knobs, **{change.knob: change.b})
    shape_knobs = {k: v.default for k, v in fam.knobs.items() if not v.passed}
    _, raw = generate(change.kernel, family, KERNEL_SHAPES[change.kernel], seed, shape_knobs)
    args = cast_inputs(fam, raw, dtype, device)
    args64 = {n: None if t is None else t.double().cpu() for n, t in args.items()}
    with torch.no_grad():
        ref_a = fam.call(fam.reference, args64, ka, lambda k: True)
        ref_b = fam.call(fam.reference, args64, kb, lambda k: True)
    out_a = _impl_outputs(fam, impl, args, ka)
    out_b = _impl_outputs(fam, impl, args, kb)
    rows = []
    for name, ra, rb, oa, ob in zip(fam.outputs, ref_a, ref_b, out_a, out_b):
        oa, ob = oa.cpu(), ob.cpu()
        noise = metrics.max_abs(oa, ra)
        shift = metrics.max_abs(ob, oa.double())
        vals = {
            "ref_shift_max_abs": metrics.max_abs(rb, ra),
            "shift_max_abs": shift,
            "shift_rel_l2": metrics.rel_l2(ob, oa.double()),
            "shift_ulps": metrics.ulp(ob, oa.double()),
            **_per_token(oa, ob),
            "noise_max_abs": noise,
            "shift_over_noise": _ratio(shift, noise),
        }
        rows += [dict(level="kernel", family=family, dtype=dtype, impl=impl.name, tensor=name, depth=None,
                      metric=m, value=v) for m, v in vals.items()]
    return rows


def _per_token(oa: torch.Tensor, ob: torch.Tensor) -> dict[str, float]:
    """How widespread the shift is: per token (leading dimension), the largest shift in ulps of
    the output dtype; the median over tokens and the share of tokens shifted by more than 1 ulp."""
    f = fmt_of(oa.dtype)
    a = oa.double().reshape(oa.shape[0], -1)
    d = (ob.double().reshape(ob.shape[0], -1) - a).abs()
    per = (d / metrics.ulp_size(a, f)).amax(dim=1)
    return {"token_shift_ulps_median": float(per.median()), "tokens_shifted_share": float((per > 1).double().mean())}


def _ratio(a: float, b: float) -> float:
    if b > 0:
        return a / b
    return 0.0 if a == 0 else math.inf


# --- the stack -------------------------------------------------------------------------------

STACK_SHAPE = Shape(64, 1, 4, 64)


def _stack_params(family: str, depth: int, shape: Shape, seed: int):
    """Per-layer weights, alphas and biases; the family decides the H_res logits and x's scale."""
    g = torch.Generator().manual_seed(seed)
    n, c = shape.n, shape.c
    nh, k = n * n + 2 * n, n * c
    layers = []
    for _ in range(depth):
        w = torch.randn(nh, k, generator=g, dtype=torch.float64) / k ** 0.5
        alpha = torch.tensor([1.0, 1.0, 1.0], dtype=torch.float64)
        bias = torch.randn(nh, generator=g, dtype=torch.float64)
        res = bias[2 * n:].view(n, n)
        if family == "dead_rows_cols":  # one column far below the rest in every layer
            res[:, int(torch.randint(0, n, (1,), generator=g))] -= 30.0
        elif family == "near_perm":
            res += 8.0 * torch.eye(n, dtype=torch.float64)[torch.randperm(n, generator=g)]
        elif family == "large_logits":
            res += 100.0
        a = torch.randn(c, c, generator=g, dtype=torch.float64) / c ** 0.5
        layers.append((w, alpha, bias, a))
    x_scale = {"tiny_norm": 1e-6, "huge_norm": 1e3}.get(family, 1.0)
    x = torch.randn(shape.s, shape.b, c, generator=g, dtype=torch.float64) * x_scale
    return ref.expand(x, n), layers


def _run_stack(x, layers, kw: dict, store_dtype: torch.dtype | None) -> list[torch.Tensor]:
    states = []
    for w, alpha, bias, a in layers:
        x = ref.mhc_layer(x, w, alpha, bias, lambda z, a=a: 0.5 * (z @ a), **kw)
        if store_dtype is not None:  # activations stored in the dtype between layers
            x = x.to(store_dtype).double()
        states.append(x)
    return states


def stack_shift(change: KnobChange, family: str, dtype: str, depth: int, seed: int = 0) -> list[dict]:
    """Rows of the stack-level comparison: per depth, the relative shift of the residual stream
    between settings A and B (float64), and the shift of storing activations in ``dtype`` at A."""
    kw_name = _LAYER_KW[change.kernel][change.knob]
    x0, layers = _stack_params(family, depth, STACK_SHAPE, seed)
    with torch.no_grad():
        sa = _run_stack(x0, layers, {kw_name: change.a}, None)
        sb = _run_stack(x0, layers, {kw_name: change.b}, None)
        sd = _run_stack(x0, layers, {kw_name: change.a}, FORMATS[dtype].torch_dtype)
    rows = []
    for d, (xa, xb, xd) in enumerate(zip(sa, sb, sd), start=1):
        shift = _rel(xb, xa)
        noise = _rel(xd, xa)
        ulps = (xb - xa).abs() / metrics.ulp_size(xa, FORMATS[dtype])
        vals = {"shift_rel_l2": shift, "noise_rel_l2": noise, "shift_over_noise": _ratio(shift, noise),
                "shift_ulps_median": float(ulps.median()), "shift_ulps_max": float(ulps.max())}
        rows += [dict(level="stack", family=family, dtype=dtype, impl="reference", tensor="x", depth=d,
                      metric=m, value=v) for m, v in vals.items()]
    return rows


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    den = float(torch.linalg.vector_norm(b))
    num = float(torch.linalg.vector_norm(a - b))
    return num / den if den > 0 else num


STACK_FAMILIES = {
    "sinkhorn": ("unit_random", "random", "large_logits", "dead_rows_cols", "near_perm"),
    "proj_rms": ("random", "tiny_norm", "huge_norm"),
    "mapping": ("random", "tiny_norm", "huge_norm"),
    "h_post_bda": ("random",),
}
