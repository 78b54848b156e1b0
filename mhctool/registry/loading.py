"""Loading code from outside mhctool: a Python file as a module, a folder holding a package,
or an import path, each a UsageError in one sentence when it cannot be loaded."""
from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

from mhctool.core.errors import UsageError


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
    """A Python file as a module (once per process and path), its folder on ``sys.path`` after
    what is installed: its own imports find its sibling files, and a file named like what it wraps
    (``NAME.py`` importing the installed ``NAME``) finds that, not itself."""
    mod_name = f"mhctool_file_{abs(hash(str(path.resolve())))}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    folder = str(path.parent.resolve())
    if folder not in sys.path:
        sys.path.append(folder)
    spec = importlib.util.spec_from_file_location(mod_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001
        del sys.modules[mod_name]
        raise UsageError(f"importing {path} failed: {type(e).__name__}: {e}") from e
    return module
