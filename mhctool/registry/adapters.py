"""Where mhctool finds the adapter an ``--impl NAME:TARGET`` spec names, first match wins:

1. built in (:data:`BUILT_IN`: the adapters in :mod:`mhctool.libraries`);
2. installed packages' entry points in the group ``mhctool.adapters`` (``name = "pkg.module"``
   in the package's ``[project.entry-points."mhctool.adapters"]``), as pytest finds plugins;
3. a file on the command line: ``--impl path/to/my_adapter.py:TARGET`` where the file defines
   ``load`` and ``recognise`` (a file without them is a plain ``FILE.py:function``).

The adapters are found through this one table and imported by name: the registry never imports
an adapter module, and an adapter imports only :mod:`mhctool.libraries` (its public API). Each
:class:`~mhctool.libraries.Binding` an adapter recognises becomes an :class:`~mhctool.registry.impl.Impl`."""
from __future__ import annotations

import functools
import sys
import importlib
import importlib.util
import inspect
from importlib.metadata import entry_points
from pathlib import Path
from typing import Callable

from mhctool.core.environment import ensure_triton_mode
from mhctool.core.errors import UsageError
from mhctool.families import get_family
from mhctool.registry.impl import Impl
from mhctool.registry.loading import load_file

# an adapter's bindings are mhctool.libraries.Binding objects (the adapters' public API, a layer
# above this one): read here by their attributes, never imported
Binding = object

# the built-in adapters: NAME -> module (imported by name, never by an import of the registry's)
BUILT_IN = {name: f"mhctool.libraries.{name}" for name in ("megatron", "te", "liger", "tilekernels")}
NAMES = tuple(BUILT_IN)


ENTRY_POINT_GROUP = "mhctool.adapters"


def _entry_points() -> dict:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def is_adapter(obj) -> bool:
    return callable(getattr(obj, "load", None)) and callable(getattr(obj, "recognise", None))


@functools.lru_cache(maxsize=None)
def find(prefix: str):
    """The adapter that an ``--impl`` prefix names (built in, an entry point, or an adapter file),
    or None when it names none (then the spec is a ``module:function`` or ``FILE.py:function``)."""
    if prefix in NAMES:
        return importlib.import_module(BUILT_IN[prefix])
    ensure_triton_mode()  # an adapter's module or file may define Triton kernels as it is imported
    eps = _entry_points()
    if prefix in eps:
        try:
            found = eps[prefix].load()
        except Exception as e:  # noqa: BLE001 - the adapter's own import failed: bad input, said so
            raise UsageError(f"the mhctool adapter {prefix!r} (entry point {eps[prefix].value}) failed to load: "
                             f"{type(e).__name__}: {e}") from e
        if not is_adapter(found):
            raise UsageError(f"the entry point {prefix!r} = {eps[prefix].value} is no mhctool adapter "
                             "(it defines no load and recognise)")
        return found
    path = Path(prefix)
    if path.suffix == ".py" and path.is_file():
        module = load_file(path)
        return module if is_adapter(module) else None
    return None


def names() -> list[str]:
    """Every adapter name this environment knows: the built-in ones, then the entry points'."""
    return [*NAMES, *sorted(n for n in _entry_points() if n not in NAMES)]


def adapter(name: str):
    found = find(name)
    if found is None:
        raise UsageError(f"unknown kernel library {name!r}; accepted: {', '.join(names())}, "
                         "or an adapter file (path/to/adapter.py defining load and recognise)")
    return found


def label(name: str) -> str:
    """How an adapter is named in implementation names: its ``NAME``, else the prefix itself."""
    return getattr(find(name), "NAME", None) or name


_LOADED: dict = {}


def _load(name: str, target: str):
    """The library ``target`` names, loaded once; again where another copy of it has taken its
    place in ``sys.modules`` since (the adapter then finds the submodules of this copy by name,
    not of the other one)."""
    module = _LOADED.get((name, target))
    if module is None or sys.modules.get(module.__name__, module) is not module:
        ensure_triton_mode()  # before the library defines its Triton kernels
        module = _LOADED[(name, target)] = adapter(name).load(target)
    return module


def recognised(spec: str) -> tuple[str, list[Binding]]:
    """``NAME:TARGET`` -> (generation, bindings); a target that is not such a library is a UsageError."""
    name, _, target = spec.partition(":")
    if not target:
        raise UsageError(f"--impl {spec!r}: name the library's file, folder or module after '{name}:'")
    lib = adapter(name)
    module = _load(name, target)
    generation, bindings = lib.recognise(module)
    if not bindings:
        raise UsageError(f"--impl {spec!r}: {target} has none of the public functions mhctool knows for {name}")
    return generation, bindings


def impls(spec: str, kernel: str) -> list:
    """The implementations ``spec`` offers for ``kernel`` (one per variant), or one that is never
    runnable and says why, when the library has no such kernel."""
    name = spec.partition(":")[0]
    generation, bindings = recognised(spec)
    module = _load(name, spec.partition(":")[2])
    found = [b for b in bindings if b.family == kernel]
    shown = label(name)
    if not found:
        why = f"{shown} ({generation}) has no {kernel} kernel"
        return [Impl(f"{shown}:{kernel}", kernel, "external", _absent, requires=lambda why=why: why,
                     default=False, spec=spec, adapter=name, exists=False)]
    out = []
    for b in found:
        impl_name = f"{shown}[{generation}]:{b.function}" + (f"[{b.variant}]" if b.variant else "")
        out.append(Impl(impl_name, kernel, "external", _bound(module, b, kernel), devices=b.devices,
                        precision=b.precision, default=False, conventions=dict(b.conventions), spec=spec,
                        adapter=name, limit=b.limit, requires=lambda why=b.unavailable: why,
                        staged=_staged(module, b, kernel) if b.layouts else None,
                        input_dtypes=dict(b.dtypes), dtypes=tuple(b.activations), glue=b.glue))
    return out


def _absent(*args, **kwargs):
    raise RuntimeError("the library has no such kernel")


def _bound(module, binding: Binding, kernel: str, convert: bool = True) -> Callable:
    """A function with the family's signature (its inputs, then the knobs the binding takes);
    ``convert``: it puts its inputs in the library's layouts itself (else they come converted)."""
    fam = get_family(kernel)
    at = [(fam.inputs.index(k), f) for k, f in binding.layouts.items()] if convert else []

    def run(*args, **knobs):
        if at:
            args = list(args)
            for i, f in at:
                args[i] = f(args[i])
        return binding.call(module, *args, **knobs)

    params = [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in fam.inputs]
    params += [inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY, default=fam.knobs[k].default)
               for k in binding.knobs]
    run.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    run.__name__ = binding.function
    return run


def _staged(module, binding: Binding, kernel: str):
    """(stage, fn): ``stage(inputs)`` converts a case's inputs to the library's layouts once;
    ``fn`` takes them so converted. Bench times ``fn`` alone."""
    def stage(inputs: dict) -> dict:
        return {k: (binding.layouts[k](v) if k in binding.layouts and v is not None else v) for k, v in inputs.items()}
    return stage, _bound(module, binding, kernel, convert=False)
