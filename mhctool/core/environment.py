"""What is installed and usable here: backends for `doctor`, metadata for reports."""
from __future__ import annotations

import functools
import importlib.metadata
import os
import platform
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch

from mhctool import __version__
from mhctool.core import interpreter
from mhctool.core.errors import UsageError
from mhctool.core.host import cores


@dataclass(frozen=True)
class BackendStatus:
    name: str
    usable: bool
    mode: str  # e.g. "native", "interpreter", "unavailable"
    version: str | None
    reason: str | None  # why unusable (None when usable)


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def cuda_available() -> bool:
    return torch.cuda.is_available()


def resolve_device(name: str | None) -> str:
    """A ``--device`` value -> ``cpu`` or ``cuda`` (None: cuda where a GPU is visible); a device
    named that is not here is a UsageError."""
    if name is None:
        return "cuda" if cuda_available() else "cpu"
    if name not in ("cpu", "cuda"):
        raise UsageError(f"unknown device {name!r}; accepted: cpu, cuda")
    if name == "cuda" and not cuda_available():
        raise UsageError("--device cuda was asked for but no CUDA GPU is visible here; use --device cpu")
    return name


def ensure_triton_mode() -> None:
    """With no GPU, run Triton kernels through its interpreter (set before any kernel is defined:
    mhctool's own, a library adapter's and a plain ``FILE:function``'s alike); then probe the
    interpreter's known-wrong operations and mend what can be mended (:mod:`mhctool.core.interpreter`)."""
    if not cuda_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if triton_interpreted() and _version("triton") is not None:
        interpreter.prepare()


def triton_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _release(version: str) -> tuple[int, int]:
    parts = [int("".join(ch for ch in p if ch.isdigit()) or 0) for p in version.split(".")[:2]]
    return (parts + [0, 0])[0], (parts + [0, 0])[1]


def interpreter_incompatibility(triton_version: str, numpy_version: str) -> str | None:
    """Why Triton's CPU interpreter cannot run with these versions, or None.

    Triton 3.6 and older turn scalar kernel arguments (1-element arrays in the interpreter) into
    loop bounds with ``int(array)``, which numpy 2.4 refuses; Triton 3.7 squeezes them first.
    """
    if _release(triton_version) < (3, 7) and _release(numpy_version) >= (2, 4):
        return (f"Triton {triton_version}'s CPU interpreter does not run with numpy {numpy_version} (it calls "
                "int() on 1-element arrays, which numpy 2.4 refuses); pip install 'triton>=3.7' or 'numpy<2.4'")
    return None


@functools.lru_cache(maxsize=None)
def triton_status() -> BackendStatus:
    v = _version("triton")
    if v is None:
        return BackendStatus("triton", False, "unavailable", None, "triton is not installed")
    ensure_triton_mode()
    if triton_interpreted():
        why = interpreter_incompatibility(v, _version("numpy") or "0")
        return BackendStatus("triton", why is None, "interpreter", v, why)
    return BackendStatus("triton", True, "native", v, None)


def tileiras_path() -> str | None:
    return shutil.which("tileiras")


@functools.lru_cache(maxsize=None)
def cutile_status() -> BackendStatus:
    v = _version("cuda-tile")
    if v is None:
        return BackendStatus("cutile", False, "unavailable", None, "cuda-tile is not installed")
    try:
        import cuda.tile  # noqa: F401
    except Exception as e:  # pragma: no cover - depends on the install
        return BackendStatus("cutile", False, "unavailable", v, f"import cuda.tile failed: {e}")
    if not cuda_available():
        return BackendStatus("cutile", False, "unavailable", v, "cuTile needs a CUDA GPU and none is visible")
    if tileiras_path() is None:
        return BackendStatus("cutile", False, "unavailable", v,
                             "cuTile needs the tileiras compiler on PATH and none was found")
    return BackendStatus("cutile", True, "native", v, None)


def torch_status() -> BackendStatus:
    mode = "cuda" if cuda_available() else "cpu"
    return BackendStatus("torch", True, mode, torch.__version__, None)


def compile_status() -> BackendStatus:
    return BackendStatus("compile", True, "inductor", torch.__version__, None)


def backends() -> list[BackendStatus]:
    return [torch_status(), compile_status(), triton_status(), cutile_status()]


def _git(*args: str) -> str | None:
    here = Path(__file__).resolve().parent.parent
    try:
        out = subprocess.run(["git", "-C", str(here), *args], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def git_commit() -> str | None:
    return (_git("rev-parse", "HEAD") or "").strip() or None


def git_dirty() -> bool | None:
    """Whether mhctool's tracked files differ from that commit (None: not a git checkout). A
    checkout copied onto another machine with an older ``.git`` reports the older commit: the
    commit alone would name code that did not run."""
    status = _git("status", "--porcelain", "--untracked-files=no")
    return None if status is None else bool(status.strip())


def gpu_info() -> dict:
    if not cuda_available():
        return {"gpu": None}
    p = torch.cuda.get_device_properties(0)
    info = {"gpu": p.name, "sm": f"{p.major}{p.minor}", "gpu_memory_bytes": p.total_memory,
            "cuda": torch.version.cuda}
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        info["driver"] = out.stdout.strip().splitlines()[0] if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, IndexError):
        info["driver"] = None
    return info


@functools.lru_cache(maxsize=1)
def cpu_model() -> str | None:
    """The host CPU's model name (Linux's /proc/cpuinfo; else what platform says, or None): a step's
    time depends on the host that issues its launches as well as on the GPU."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def metadata() -> dict:
    """Environment recorded in every report."""
    return {
        "mhctool": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "torch": torch.__version__,
        "torch_deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        # the cores this process may use, and PyTorch's threads in each of the run's processes
        # (mhctool.spread.machine: one on the CPU, so that the rows do not depend on the machine)
        "cores": cores(),
        "threads": torch.get_num_threads(),
        "triton": _version("triton"),
        "cuda_tile": _version("cuda-tile"),
        "triton_mode": triton_status().mode,
        "git_commit": git_commit(),
        "git_dirty": git_dirty(),
        **gpu_info(),
    }


def cuda_mem_info() -> tuple[int, int]:
    """(free, total) bytes on the current GPU."""
    return torch.cuda.mem_get_info()


def l2_bytes() -> int:
    p = torch.cuda.get_device_properties(0)
    return int(getattr(p, "L2_cache_size", 50 * 2**20))
