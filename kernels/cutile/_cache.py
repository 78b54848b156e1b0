"""mhctool's own cuTile kernels, compiled once per machine: a disk cache of the whole compilation.

cuTile keeps the last step on disk (tileiras's cubin, found by the Tile IR it is given), but every
new process runs the front end again, the Python that turns a kernel into Tile IR. For the
per-token Sinkhorn backward, which unrolls its steps at compile time, that front end takes 11 s
(n = 3, fp32) to 32 s (n = 4, bf16) a signature on an H200's host; a gate spread over four
workers paid it in each worker that met the kernel, 110 s of first calls where one process paid
54 (2026-11-26). This cache keeps the cubin and its symbol for the kernels defined in this package,
keyed by everything that decides them:

- the source of every file of ``mhctool.kernels``, and the plain values (numbers, strings, enums,
  tuples of them) at the top of the cuTile modules and the schedule, which kernels read at compile
  time (``RECIP``);
- the kernel's module and name, its signature (each argument's dtype, rank, alignment and
  divisibility as the launch specialised it, and each constant's value) and compiler hints;
- cuda-tile's version, the tileiras compiler's version, and the GPU's compute capability.

Two processes asking for one signature at once: the second waits on a lock for the first and then
reads its result, so spread workers compile each signature once. Anything the cache cannot vouch
for compiles as cuTile would: another package's kernel, a compile with library linking, an
unknown compiler version, an unreadable entry, or ``MHCTOOL_CACHE=0``. The entries live in
``$MHCTOOL_CACHE/cutile`` (:mod:`mhctool.kernels._disk`; default ``~/.cache/mhctool/cutile``).
"""
from __future__ import annotations

import enum
import hashlib
from pathlib import Path

from .. import _disk

_PACKAGE = __name__.rpartition(".")[0].rpartition(".")[0]  # mhctool.kernels
_FORMAT = 1  # the entries' layout; a change makes new keys
stats = {"hits": 0, "stored": 0, "bypassed": 0}


def _plain(v) -> bool:
    if isinstance(v, (bool, int, float, str, type(None), enum.Enum)):
        return True
    return isinstance(v, tuple) and all(_plain(x) for x in v)


def _module_values() -> str:
    """The plain values at the top of the cuTile kernels' modules and of the schedule they share,
    as they are now (a sweep may set one before compiling). Every such module is imported, so that
    a process that has loaded one kernel and a process that has loaded them all make one key."""
    import importlib
    import pkgutil
    here = __name__.rpartition(".")[0]  # the cuTile kernels' package
    names = [f"{_PACKAGE}.schedule"] + [f"{here}.{m.name}" for m in pkgutil.iter_modules([str(Path(__file__).parent)])
                                        if m.name != "_cache"]
    parts = []
    for name in sorted(names):
        for k, v in sorted(vars(importlib.import_module(name)).items()):
            if not k.startswith("__") and _plain(v):
                parts.append(f"{name}.{k}={v!r}")
    return "\n".join(parts)


def key(func, signature, options, capability, cutile_version: str, compiler_version: str) -> str:
    """The entry's name: a digest of everything that decides the compiled kernel."""
    h = hashlib.sha256()
    for part in (str(_FORMAT), _disk.source_digest(), _module_values(), f"{func.__module__}.{func.__qualname__}",
                 repr(signature), repr(options), repr(tuple(capability)), cutile_version, compiler_version):
        h.update(part.encode() + b"\0")
    return h.hexdigest()


def ours(func) -> bool:
    return getattr(func, "__module__", "").startswith(_PACKAGE + ".")


_MAGIC = b"mhctool-cutile-1\0"  # an entry: this, the kernel's symbol, a NUL, the cubin


def _read(path: Path) -> tuple[bytes, str] | None:
    try:
        data = path.read_bytes()
    except OSError:
        return None
    head, sep, cubin = data[len(_MAGIC):].partition(b"\0")
    if not data.startswith(_MAGIC) or not sep or not cubin:
        return None
    try:
        return cubin, head.decode()
    except UnicodeDecodeError:
        return None


def cached_compile(compile_, self, signature, context, compute_capability=None):
    """``compile_`` (cuTile's ``kernel._compile``) through the cache, for this package's kernels."""
    func = getattr(self, "_pyfunc", None)
    root = _disk.folder("cutile") if func is not None and ours(func) else None
    versions = _versions() if root is not None else None
    if versions is None:
        stats["bypassed"] += 1
        return compile_(self, signature, context, compute_capability)
    capability = compute_capability or _capability()
    name = key(func, signature, getattr(self, "_compiler_options", None), capability, *versions)
    entry = root / f"{name}.bin"
    with _disk.locked(root / f"{name}.lock"):
        found = _read(entry)
        if found is not None:
            stats["hits"] += 1
            return found[0], found[1], None, ()
        result = compile_(self, signature, context, compute_capability)
        cubin, symbol, extra, providers = result
        if extra is None and not providers and isinstance(cubin, bytes) and cubin and isinstance(symbol, str) \
                and "\0" not in symbol:
            _disk.write(entry, _MAGIC + symbol.encode() + b"\0" + cubin)
            stats["stored"] += 1
        return result


def _versions() -> tuple[str, str] | None:
    """cuda-tile's and the tileiras compiler's versions (None: unknown, the cache is not used)."""
    try:
        from importlib.metadata import version

        from cuda.tile._compile import _get_compiler_version_string
        compiler = _get_compiler_version_string()
        return (version("cuda-tile"), compiler.strip()) if compiler else None
    except Exception:  # noqa: BLE001 - another cuda-tile than this was written for: compile as it would
        return None


def _capability() -> tuple:
    from cuda.tile._cext import get_compute_capability
    return tuple(get_compute_capability())


def install() -> bool:
    """Route cuTile's compilation of a kernel through the cache (once a process). False where this
    cuda-tile has no ``kernel._compile`` of the form the cache wraps (it then compiles as always)."""
    import inspect

    from cuda.tile import _execution
    cls = _execution.kernel
    original = cls.__dict__.get("_compile")
    if original is None or getattr(original, "_mhctool_cached", False):
        return original is not None
    params = list(inspect.signature(original).parameters)
    if params[:3] != ["self", "signature", "context"]:
        return False

    def _compile(self, signature, context, compute_capability=None):
        return cached_compile(original, self, signature, context, compute_capability)
    _compile._mhctool_cached = True
    cls._compile = _compile
    return True
