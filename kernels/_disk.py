"""What mhctool's kernels keep on disk from one process to the next: cuTile's compilations
(``cutile/_cache.py``) and the Triton tiles picked by timing (``triton/_common.pick_config``).

Both live under ``$MHCTOOL_CACHE`` (default ``~/.cache/mhctool``; ``XDG_CACHE_HOME`` moves it;
``0`` or ``off`` turns both off). An entry is written whole under another name and renamed, and a
process that needs an entry another process is making waits on a lock for it, so workers spread
over a node make each entry once and all use that one."""
from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from pathlib import Path

_ROOT = Path(__file__).resolve().parent  # the kernels' package folder
_sources: str | None = None


def root(kind: str) -> Path | None:
    """The folder of ``kind`` (``cutile``, ``tiles``), or None where the cache is turned off."""
    value = os.environ.get("MHCTOOL_CACHE")
    if value is not None and value.strip().lower() in ("", "0", "off", "none", "false"):
        return None
    if not value:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        value = os.path.join(base, "mhctool")
    return Path(value) / kind


def source_digest() -> str:
    """Every source file of the kernels' package, read once a process: any edit makes new keys."""
    global _sources
    if _sources is None:
        h = hashlib.sha256()
        for p in sorted(_ROOT.rglob("*.py")):
            h.update(str(p.relative_to(_ROOT)).encode() + b"\0" + p.read_bytes() + b"\0")
        _sources = h.hexdigest()
    return _sources


@contextlib.contextmanager
def locked(path: Path):
    """An exclusive lock on ``path`` (the system releases it if this process dies holding it)."""
    try:
        import fcntl
        f = open(path, "a+b")
    except (ImportError, OSError):  # no flock here, or a folder this process cannot write: no lock
        yield
        return
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX)
        except OSError:  # a file system without locks
            yield
            return
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def write(path: Path, data: bytes) -> None:
    """``data`` to ``path`` whole or not at all (a full disk leaves no entry, not half of one)."""
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    except OSError:  # a folder this process cannot write: nothing kept
        return
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def folder(kind: str) -> Path | None:
    """``root(kind)``, made; None where the cache is off or the folder cannot be made."""
    where = root(kind)
    if where is None:
        return None
    try:
        where.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    return where
