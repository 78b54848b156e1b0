"""Foreign kernel libraries, judged as they ship: one small adapter file per library.

An adapter is a module (or any object with these attributes) that defines:

- ``NAME``: the prefix of its ``--impl NAME:FILE_OR_MODULE`` spec;
- ``load(target) -> module``: the library's module from a file, a folder or an import path;
- ``recognise(module) -> (generation, [Binding, ...])``: which public functions it found and how
  each maps onto an mhctool family.

A :class:`Binding` states, for one public function, the family it implements, how mhctool's
inputs (in the family's call order) become its arguments and how its outputs come back (``call``:
permutes, pads, split scalars happen there, outside the library's own code), the family knobs it
takes, the conventions it computes, the matmul precision it computes at and, where they differ
from mhctool's contract, the dtypes its inputs have where it is used (bench times it at those).
The library's code is called unchanged.

Where mhctool finds adapters, first match wins:

1. built in (``NAMES``: this folder's ``megatron``, ``te``, ``liger``, ``tilekernels``);
2. installed packages' entry points in the group ``mhctool.adapters`` (``name = "pkg.module"``
   in the package's ``[project.entry-points."mhctool.adapters"]``), as pytest finds plugins;
3. a file on the command line: ``--impl path/to/my_adapter.py:TARGET`` where the file defines
   ``load`` and ``recognise`` (a file without them is a plain ``FILE.py:function``).

The adapter API is public: :class:`Binding`, :func:`load_path_or_module` and :func:`n_of` are
what an adapter of one's own imports from here.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..errors import UsageError

NAMES = ("megatron", "te", "liger", "tilekernels")
ENTRY_POINT_GROUP = "mhctool.adapters"
# Triton's tl.dot on fp32 operands at its default precision: TF32 with truncated operands on a GPU,
# IEEE through the CPU interpreter (whatever input_precision asks); a Binding's precision
TRITON_FP32_DOT = {"cpu": "ieee", "cuda": "tf32_trunc"}


@dataclass(frozen=True)
class Binding:
    family: str
    function: str  # the library's public name (or names joined by '+', for a composed path)
    call: Callable  # call(module, *family inputs, **knobs) -> outputs in the family's order
    knobs: tuple[str, ...] = ()  # family knobs the function takes
    conventions: dict = field(default_factory=dict)  # convention knobs it computes
    # matmul precision it computes at by design (registry.PRECISIONS), or {device: precision}
    precision: str | dict = "ieee"
    variant: str = ""  # told apart in the implementation's name, e.g. "tf32"
    devices: tuple[str, ...] = ("cpu", "cuda")
    limit: Callable | None = None  # limit(shape) -> why it cannot run that shape, or None
    unavailable: str | None = None  # why the library says it cannot run here (its own availability check)
    # input name -> its conversion to the library's layout; ``call`` takes the converted tensors.
    # Conversions run outside the library's code, and bench runs them outside the timed region
    layouts: dict = field(default_factory=dict)
    # input name -> the dtype the library is used with where that differs from mhctool's contract:
    # ``"activation"`` (the run's activation dtype) or a format name (fp32, bf16, fp16). bench times
    # the library at these (parity keeps the contract's dtypes, which its reference is built on)
    dtypes: dict = field(default_factory=dict)
    # the activation dtypes of the cases it takes (a bf16-only kernel: ("bf16",)); others are skipped
    activations: tuple[str, ...] = ("fp32", "bf16", "fp16")
    # what the adapter computes around the library's own call beyond layouts (an add, a zeroed
    # buffer, a GEMM the library leaves to another package): bench times it with the call, says so
    glue: str = ""


def _entry_points() -> dict:
    from importlib.metadata import entry_points
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def is_adapter(obj) -> bool:
    return callable(getattr(obj, "load", None)) and callable(getattr(obj, "recognise", None))


@functools.lru_cache(maxsize=None)
def find(prefix: str):
    """The adapter that an ``--impl`` prefix names (built in, an entry point, or an adapter file),
    or None when it names none (then the spec is a ``module:function`` or ``FILE.py:function``)."""
    if prefix in NAMES:
        return importlib.import_module(f"{__name__}.{prefix}")
    from ..environment import ensure_triton_mode
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


@functools.lru_cache(maxsize=None)
def _load(name: str, target: str):
    from ..environment import ensure_triton_mode
    ensure_triton_mode()  # before the library defines its Triton kernels
    return adapter(name).load(target)


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
    from ..registry import Impl
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
    from ..registry import get_family
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


def load_path_or_module(target: str, module_name: str, file_name: str):
    """The common loader: ``target`` is a ``.py`` file, a folder that holds ``module_name`` (put on
    ``sys.path``) or ``file_name``, or an importable module path."""
    path = Path(target)
    if path.suffix == ".py":
        if not path.is_file():
            raise UsageError(f"no file {target}")
        return load_file(path)
    if path.is_dir():
        direct = path / file_name
        if direct.is_file():
            return load_file(direct)
        top = module_name.split(".")[0]
        if (path / top).is_dir():
            _forget_other_copies(top, path / top)
            here = str(path.resolve())
            if here in sys.path:  # first on the path, so that this copy is the one found
                sys.path.remove(here)
            sys.path.insert(0, here)
            return _import(module_name, target)
        raise UsageError(f"{target} holds neither {file_name} nor a {top}/ package")
    if "/" in target or target.endswith(".py"):
        raise UsageError(f"no file or folder {target}")
    return _import(target, target)


def _forget_other_copies(top: str, folder: Path) -> None:
    """A package of the same name imported from another folder (another copy of the library) is
    dropped from ``sys.modules``, so that this folder's copy is the one imported; modules already
    loaded keep working through their own references."""
    loaded = sys.modules.get(top)
    where = getattr(loaded, "__file__", None) or next(iter(getattr(loaded, "__path__", []) or []), None)
    if loaded is None or (where and Path(where).resolve().is_relative_to(folder.resolve())):
        return
    for name in [m for m in sys.modules if m == top or m.startswith(top + ".")]:
        del sys.modules[name]


def _import(module_name: str, target: str):
    try:
        return importlib.import_module(module_name)
    except ImportError as e:
        raise UsageError(f"cannot import {module_name} from {target} ({e})") from e
    except Exception as e:  # noqa: BLE001 - the library's import itself failed
        raise UsageError(f"importing {module_name} from {target} failed: {type(e).__name__}: {e}") from e


def load_file(path: Path):
    """A Python file as a module (once per process and path), its folder first on ``sys.path``."""
    mod_name = f"mhctool_file_{abs(hash(str(path.resolve())))}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    folder = str(path.parent.resolve())  # what a script's own imports see: its folder first
    if folder in sys.path:
        sys.path.remove(folder)
    sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location(mod_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001
        del sys.modules[mod_name]
        raise UsageError(f"importing {path} failed: {type(e).__name__}: {e}") from e
    return module


def n_of(weight) -> int:
    """n from a mapping weight of n^2 + 2n rows."""
    return int(round((weight.shape[0] + 1) ** 0.5 - 1))
