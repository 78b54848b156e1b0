"""A whole-module variant's spec (``X[module]``): its name, and which spec computes each of the
module's two families (the pre-path: ``mix_aggregate``; the post-path: ``h_post_bda``). What the
engine swaps in and how it is judged is :mod:`.module_path`'s; the model's pieces
(:mod:`.pieces`) read the spec from here."""
from __future__ import annotations

import inspect

from mhctool.core.errors import UsageError
from mhctool.families import get_family
from mhctool.registry.specs import is_function_spec, load_external

SUFFIX = "[module]"
KEY = "module"  # the specs' entry for a module variant: its spec
PRE, POST = "pre_path", "post_path"
FAMILIES = {PRE: "mix_aggregate", POST: "h_post_bda"}


def backend_of(spec: str) -> str | None:
    """``triton[module]`` -> ``triton``; None for a spec that is no module variant."""
    if not spec.endswith(SUFFIX):
        return None
    inner = spec[:-len(SUFFIX)]
    if not inner:
        raise UsageError(f"--impl {spec}: name what computes the module, e.g. triton{SUFFIX} or cutile{SUFFIX}")
    return inner


def assigned(spec: str) -> dict[str, str]:
    """Which spec computes each of the module's families: a function its family (by its
    parameters' names), the native pieces the other; a built-in or a library both it has."""
    if is_function_spec(spec):
        found = _family_of(spec)
        if found is None:
            raise UsageError(f"--impl {spec}{SUFFIX}: its parameters name neither of the module's families "
                             f"(mix_aggregate: x, weight, alpha, h_bias; h_post_bda: h_res, x, h_post, y, bias)")
        return {f: (spec if f == found else "torch") for f in FAMILIES.values()}
    return {f: spec for f in FAMILIES.values()}


def _family_of(spec: str) -> str | None:
    fn = load_external(spec, "h_post_bda", check=False).fn
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None
    return next((f for f in FAMILIES.values() if params[:len(get_family(f).inputs)] == list(get_family(f).inputs)),
                None)
