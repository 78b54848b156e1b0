"""``--impl`` specs -> implementations: built-in names, ``module:function``,
``FILE.py:function``, a file of family-named functions, and ``LIBRARY:TARGET`` through an adapter
(:mod:`mhctool.registry.adapters`). The one parser of implementation specs."""
from __future__ import annotations

import importlib
import os
from dataclasses import replace
from pathlib import Path

from mhctool.core.environment import ensure_triton_mode
from mhctool.core.errors import UsageError
from mhctool.families import KERNELS
from mhctool.registry import adapters, loading
from mhctool.registry.builtin import BACKEND_NAMES, impls_for
from mhctool.registry.impl import Impl, check_callable


def resolve_impls(kernel: str, specs: list[str] | None) -> list[Impl]:
    """The implementations to run for ``kernel``: builtin names or external ``module:function``.

    A built-in name that another kernel has but ``kernel`` lacks (``cutile`` for ``swiglu``)
    resolves to an implementation that is never runnable and says why, so a multi-kernel run
    reports it as skipped for that kernel; a name that no kernel has is a UsageError."""
    known = {i.name: i for i in impls_for(kernel)}
    if not specs:
        return [i for i in known.values() if i.default]
    chosen = []
    for spec in specs:
        if spec in known:
            chosen.append(known[spec])
        elif is_library_spec(spec):
            chosen.extend(adapters.impls(spec, kernel))
        elif ":" in spec:
            chosen.append(load_external(spec, kernel))
        elif is_functions_file(spec):
            chosen.append(functions_file(spec, kernel))
        elif any(spec == i.name for k in KERNELS for i in impls_for(k)):
            why = f"mhctool has no {BACKEND_NAMES.get(spec, spec)} implementation of {kernel}"
            chosen.append(Impl(spec, kernel, spec, _absent, requires=lambda why=why: why, default=False, exists=False))
        else:
            names = sorted({i.name for k in KERNELS for i in impls_for(k)})
            raise UsageError(
                f"unknown implementation {spec!r}; accepted: {', '.join(names)}, "
                "or module.path:function, or path/to/file.py:function"
            )
    return chosen


def _absent(*args, **kwargs):  # the target of an implementation that does not exist for a kernel
    raise RuntimeError("no such implementation")


def is_library_spec(spec: str) -> bool:
    """``NAME:FILE_OR_MODULE`` where NAME is a library adapter (``megatron:``, ``te:``, ``liger:``,
    an installed adapter's entry point, or an adapter file ``path/to/adapter.py``)."""
    prefix, sep, _ = spec.partition(":")
    return bool(sep) and adapters.find(prefix) is not None


def is_functions_file(spec: str) -> bool:
    """``path/to/kernels.py`` with no ``:function``: a file of functions named after the families
    (``sinkhorn``, ``h_aggregate``, ...), judged like a library, one implementation per family."""
    return spec.endswith(".py") and ":" not in spec


def functions_file(spec: str, kernel: str) -> Impl:
    """The function named ``kernel`` in the file ``spec``; a file without one stands for an
    implementation that does not exist (skipped, said why); a file with no family-named function
    at all is bad input."""
    path = Path(spec)
    module = _file_module(spec, path)
    defined = [k for k in KERNELS if callable(getattr(module, k, None))]
    if not defined:
        raise UsageError(f"--impl {spec!r}: the file defines no function named after a family ("
                         + ", ".join(KERNELS) + "); name one function with :function, e.g. "
                         f"{spec}:my_sinkhorn")
    if kernel not in defined:
        why = f"{path.name} defines no function {kernel} (it has {', '.join(defined)})"
        return Impl(f"{spec}:{kernel}", kernel, "external", _absent, requires=lambda why=why: why, default=False,
                    spec=spec, exists=False)
    return replace(load_external(f"{spec}:{kernel}", kernel), spec=spec)


def _file_module(spec: str, path: Path):
    """The Python file an ``--impl`` spec names, imported (once per process), with Triton in its
    interpreter first on a CPU; a missing file or one that fails to import is bad input."""
    if not path.is_file():
        raise UsageError(f"--impl {spec!r}: no file {path}")
    ensure_triton_mode()  # before the file defines its Triton kernels: on a CPU, the interpreter
    try:
        return loading.load_file(path)
    except UsageError as e:  # the user's file failed to import: that is bad input
        raise UsageError(f"--impl {spec!r}: {e}") from e


def is_function_spec(spec: str) -> bool:
    """``module:function`` or ``file.py:function``: one function, so one kernel."""
    return ":" in spec and not is_library_spec(spec)


def resolve_one(kernel: str, spec: str, name: str) -> Impl:
    """The implementation named ``name`` among those ``spec`` resolves to (isolation workers)."""
    for impl in resolve_impls(kernel, [spec]):
        if impl.name == name:
            return impl
    raise UsageError(f"--impl {spec!r} has no implementation {name!r} for kernel {kernel}")


def load_external(spec: str, kernel: str, check: bool = True) -> Impl:
    """``module.path:function`` or ``path/to/file.py:function`` -> an external Impl (``check``:
    that it can be called with ``kernel``'s signature)."""
    target, _, fn_name = spec.rpartition(":")
    if not target or not fn_name:
        raise UsageError(f"malformed --impl {spec!r}; expected module.path:function or file.py:function")
    if target.endswith(".py") or os.sep in target or "/" in target:
        module = _file_module(spec, Path(target))
    else:
        ensure_triton_mode()  # before the module defines its Triton kernels: on a CPU, the interpreter
        try:
            module = importlib.import_module(target)
        except ImportError as e:
            raise UsageError(f"--impl {spec!r}: cannot import module {target} ({e})") from e
    fn = getattr(module, fn_name, None)
    if fn is None or not callable(fn):
        raise UsageError(f"--impl {spec!r}: {target} has no function {fn_name}")
    impl = Impl(spec, kernel, "external", fn)
    if check:
        check_callable(impl)
    return impl
