"""What each mHC family of the model runs in a trajectory: the implementation under test (its
outputs conformed to what the model takes), the native one, or the float64 reference; and
which ``--impl`` spec runs which family."""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from mhctool.analyses.train import module_spec
from mhctool.analyses.train.setup import FAMILIES, families_of
from mhctool.core.dtypes import dtype_named, fmt_of
from mhctool.core.environment import ensure_triton_mode
from mhctool.core.errors import UsageError
from mhctool.families import get_family
from mhctool.kernels.torch.mhc import compute_h
from mhctool.registry.specs import is_function_spec, load_external, resolve_impls
from mhctool.runner.call import native_at


@dataclass
class Piece:
    """What one family runs in a trajectory: ``call(args dict) -> outputs`` and how it was named."""

    family: str
    name: str  # e.g. "triton", "torch", "float64", "megatron[m3828]:fused_sinkhorn"
    call: Callable[[dict], tuple]
    note: str = ""  # why it runs what it runs (a family the implementation lacks: natively)
    # not the implementation's own function for the family (run natively, or its projection with
    # the native compute_h): identify has nothing of its to fit
    fallback: bool = False
    # the matmul precision it computes at by design (an adapter's declaration): the native
    # trajectory computes the family at it too, as parity's baseline does
    precision: str = "ieee"
    # an output its implementation returned in another dtype than the model takes (output name ->
    # the dtype it came in: PR 3828's projection writes proj and r in x's dtype), filled as it runs
    returned: dict = field(default_factory=dict)


def family_call(family: str, fn, knobs: dict, accepts=lambda k: True, bind=lambda k: k,
                 takes=lambda name: True) -> Callable[[dict], tuple]:
    return get_family(family).caller(fn, knobs, accepts, bind, takes)


def _expected(family: str, args: dict) -> list[tuple]:
    """(shape, dtype) of each output the model takes from ``family``, as the native one gives them:
    the mapping path in fp32, the streams at theirs."""
    if family == "mapping":
        t, n = args["x2d"].shape[0], int(round((args["weight"].shape[0] + 1) ** 0.5 - 1))
        return [((t, n), torch.float32), ((t, n), torch.float32), ((t, n, n), torch.float32)]
    if family == "sinkhorn":
        return [(tuple(args["logits"].shape), torch.float32)]
    if family == "proj_rms":  # an engine's entry point: the projection and r of the mapping path
        t = args["x2d"].shape[0]
        return [((t, args["weight"].shape[0]), torch.float32), ((t,), torch.float32)]
    x = args["x"]
    if family == "mix_aggregate":  # the layer's input, then H_post and H_res in fp32
        n = x.shape[-2]
        return [((*x.shape[:-2], x.shape[-1]), x.dtype), ((*x.shape[:-2], n), torch.float32),
                ((*x.shape[:-2], n, n), torch.float32)]
    return [((*x.shape[:-2], x.shape[-1]) if family == "h_aggregate" else tuple(x.shape), x.dtype)]


def came_in(got: torch.dtype, want: torch.dtype, where: str = "the model takes") -> str:
    """How an output that came back in another dtype than the model takes is said."""
    return f"{fmt_of(got).name}, where {where} {fmt_of(want).name}"


def _conformed(family: str, call: Callable[[dict], tuple], returned: dict) -> Callable[[dict], tuple]:
    """Outputs taken by value, as parity takes them: size-1 dimensions and another dtype (Megatron's
    h_post_bda writes in h_res's dtype) conformed to what the model expects, so the rest of the
    model computes as in the other trajectories (an output in another dtype noted in ``returned``);
    an output that cannot be is an error."""
    names = get_family(family).outputs

    def run(args: dict) -> tuple:
        outs = call(args)
        want = _expected(family, args)
        if len(outs) < len(want):
            raise RuntimeError(f"{family} returned {len(outs)} outputs, expected {len(want)}")
        fixed = []
        for name, o, (shape, dtype) in zip(names, outs, want):
            if tuple(o.shape) != shape:
                if o.numel() != math.prod(shape):
                    raise RuntimeError(f"{family} returned an output of shape {tuple(o.shape)}, expected {shape}")
                o = o.reshape(shape)
            if o.dtype != dtype:
                returned[name] = came_in(o.dtype, dtype)
            fixed.append(o if o.dtype == dtype else o.to(dtype))
        return tuple(fixed)
    return run


def native_piece(family: str, knobs: dict, precision: str = "ieee") -> Piece:
    impl = native_at(family, precision)
    return Piece(family, impl.name, family_call(family, impl.fn, knobs))


def reference_piece(family: str, knobs: dict) -> Piece:
    """The family's float64 reference on the inputs upcast; each output back at the dtype the
    native implementation gives it (the mapping path fp32, the streams at theirs)."""
    fam = get_family(family)
    call = family_call(family, fam.reference, knobs)

    def run(args: dict) -> tuple:
        wide = {k: (v.double() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in args.items()}
        return tuple(o.to(dtype) for o, (_, dtype) in zip(call(wide), _expected(family, args)))
    return Piece(family, "float64", run)


def assign(specs: list[str], kernel: str | None = None) -> dict[str, str]:
    """Which ``--impl`` spec each family of the model runs: a function spec (``FILE.py:fn``,
    ``module:fn``) implements one family (``kernel``, else the family whose inputs its first
    parameters are named after); a built-in name or a library stands for every family it has.
    A function spec wins over a library for its family; a family no spec has runs natively. A
    whole-module variant (``X[module]``, alone) computes the model's pre-path in one call and its
    post-path in another (:data:`~.setup.MODULE_FAMILIES`)."""
    whole = [s for s in specs if module_spec.backend_of(s) is not None]
    if whole:
        if len(specs) > 1 or kernel is not None:
            raise UsageError(f"--impl {whole[0]} computes the whole module: it does not combine with another "
                             f"--impl{' or --kernel' if kernel is not None else ''}")
        return module_spec.assigned(module_spec.backend_of(whole[0]))
    out: dict[str, str] = {}
    functions = [s for s in specs if is_function_spec(s)]
    if kernel is not None and kernel not in FAMILIES:
        raise UsageError(f"--kernel {kernel}: the model's mHC families are {', '.join(FAMILIES)}")
    if kernel is not None and len(functions) > 1:
        raise UsageError("--kernel names the family of one function; with several, name each after its "
                         "family's inputs (logits; x, h_pre; h_res, x, h_post, y; x2d, weight, alpha, h_bias)")
    for spec in functions:
        family = kernel
        if family is None:
            fn = load_external(spec, "sinkhorn", check=False).fn
            try:
                params = list(inspect.signature(fn).parameters)
            except (TypeError, ValueError):
                params = []
            family = next((f for f in FAMILIES if params[:len(get_family(f).inputs)]
                           == list(get_family(f).inputs)), None)
            if family is None:
                raise UsageError(f"--impl {spec}: which mHC family is it? Its parameters ({', '.join(params)}) "
                                 f"are named after none of {', '.join(FAMILIES)}'s inputs; say it with --kernel")
        if family in out:
            raise UsageError(f"--impl: two functions for {family} ({out[family]}, {spec})")
        out[family] = spec
    for spec in (s for s in specs if not is_function_spec(s)):
        for family in FAMILIES:
            out.setdefault(family, spec)
    return out


def _as_used(call: Callable[[dict], tuple], dtypes: dict, activation: str) -> Callable[[dict], tuple]:
    """The inputs a library takes in other dtypes than the contract's (its adapter's
    ``Binding.dtypes``: Megatron's h_pre, h_res, h_post in the activations' dtype) converted first."""
    want = {k: dtype_named(v, activation) for k, v in dtypes.items()}
    return lambda args: call({k: (v.to(want[k]) if k in want and torch.is_tensor(v) else v) for k, v in args.items()})


def impl_pieces(spec: str | dict[str, str], knobs: dict[str, dict], conventions: dict[str, dict], device: str,
                dtype: str, as_used: bool = False) -> tuple[dict[str, Piece], dict[str, dict]]:
    """The pieces the ``--impl`` specs give the model (``spec``: one for every family, or per
    family as :func:`assign` gives them), and each family's knobs with what it declares: a family
    no spec has (or cannot run here) runs natively, and says so; a mapping a library lacks beside
    a projection it has runs its projection with the native compute_h."""
    ensure_triton_mode()
    specs = spec if isinstance(spec, dict) else {f: spec for f in FAMILIES}
    if "mix_aggregate" in specs:
        knobs, conventions = module_knobs(knobs), module_knobs(conventions)
    pieces, eff = {}, {}
    for family in families_of(specs):
        if family not in specs:
            eff[family] = {**knobs.get(family, {}), **conventions.get(family, {})}
            pieces[family] = replace(native_piece(family, eff[family]), note="natively: no --impl for it",
                                     fallback=True)
            continue
        spec_ = specs[family]
        impl, why = pick_impl(family, spec_, device, dtype)
        eff[family] = {**knobs.get(family, {}), **(impl.conventions if impl and impl.backend == "external" else {}),
                       **conventions.get(family, {})}
        if impl is not None:
            call = family_call(family, impl.fn, eff[family], impl.accepts, impl.bind, impl.takes)
            if as_used and impl.input_dtypes:
                call = _as_used(call, impl.input_dtypes, dtype)
            returned: dict = {}
            pieces[family] = Piece(family, impl.name, _conformed(family, call, returned),
                                   precision=impl.precision_on(device),
                                   note="its inputs at the dtypes its library is used with" if as_used and
                                   impl.input_dtypes else "", returned=returned)
            continue
        proj = pick_impl("proj_rms", spec_, device, dtype)[0] if family == "mapping" and \
            not is_function_spec(spec_) else None
        if proj is not None:
            pieces[family] = replace(_projection_mapping(proj, eff[family]), precision=proj.precision_on(device),
                                     fallback=True)
            continue
        pieces[family] = replace(native_piece(family, eff[family]), note=f"natively: {why}", fallback=True)
    return pieces, eff


def module_knobs(given: dict[str, dict]) -> dict[str, dict]:
    """Knobs given the model's families (``--knob sinkhorn.eps=...``) as a whole-module variant
    takes them: the mapping's and Sinkhorn's are the pre-path's (Sinkhorn's eps its
    ``sinkhorn_eps``), h_post_bda's its own; one the pre-path does not have is a UsageError."""
    pre = {**given.get("mapping", {}), **{("sinkhorn_eps" if k == "eps" else k): v
                                         for k, v in given.get("sinkhorn", {}).items()}}
    lacking = [k for k in pre if k not in get_family("mix_aggregate").knobs]
    if lacking:
        raise UsageError(f"{lacking[0]}: the whole module's pre-path (mix_aggregate) has no such knob; "
                         f"it takes {', '.join(get_family('mix_aggregate').knobs)}")
    return {"mix_aggregate": pre, "h_post_bda": dict(given.get("h_post_bda", {}))}


def pick_impl(family: str, spec: str, device: str, dtype: str):
    """The first implementation ``spec`` gives ``family`` that can run here, or (None, why not)."""
    impls = resolve_impls(family, [spec])
    why = None
    for impl in impls:
        why = impl.unsupported(device, dtype)
        if why is None and impl.exists:
            return impl, None
    return None, why or f"{spec} has no {family}"


def _projection_mapping(proj, knobs: dict) -> Piece:
    """The mapping as a library without one computes it: its proj_rms, then the native compute_h."""
    fam = get_family("proj_rms")
    pk = {k: v for k, v in knobs.items() if k in fam.knobs}
    returned: dict = {}

    def run(args: dict) -> tuple:
        w = args["weight"]
        n = int(round((w.shape[0] + 1) ** 0.5 - 1))
        p, r = fam.call(proj.fn, {"x2d": args["x2d"], "weight": w}, pk, proj.accepts, proj.bind)[:2]
        late = {k: v.dtype for k, v in (("proj", p), ("r", r)) if v.dtype != torch.float32}
        if late:  # said once for both where they came back alike
            returned[f"its proj_rms's {' and '.join(late)}"] = came_in(next(iter(late.values())), torch.float32)
        return compute_h(p.float(), r.float().reshape(p.shape[0]), args["alpha"].float(), args["h_bias"].float(),
                         n, knobs.get("compute_h_eps", 0.0))
    return Piece("mapping", f"{proj.name}+torch:compute_h", run, note="its proj_rms with the native compute_h",
                 returned=returned)
