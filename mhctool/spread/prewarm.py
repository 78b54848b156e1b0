"""Work a process does once, before its first Triton kernel on a GPU, started early.

At a process's first kernel, compiled or read from the cache, Triton hashes its own sources and
its shared library (``triton.runtime.cache.triton_key``): 0.42 s of each process's first calls on
an H200 host, most of it reading and hashing the 500 MB ``libtriton``. The hash is kept for the
process. So the fork server computes it once, before it forks any child (``_forkserver``, one of
``forkserver.FORKSERVER_PRELOAD``), and every pool worker, isolation worker and rank inherits it; and a
command's own process computes it on a thread (:func:`start`) while it plans and draws its first
inputs (the hash releases the GIL). Nothing here touches CUDA: a fork server that had initialised
CUDA would hand its children a driver they cannot use. Only on a machine with an NVIDIA driver:
Triton's interpreter (the CPU) never computes the hash.
"""
from __future__ import annotations

import os
import threading

_thread: threading.Thread | None = None


def gpu_machine() -> bool:
    """An NVIDIA driver is present and CUDA_VISIBLE_DEVICES does not hide every GPU (no CUDA call)."""
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    return os.path.exists("/dev/nvidiactl") and (hidden is None or hidden.strip() not in ("", "-1"))


def triton_hash() -> bool:
    """Triton's hash of itself, computed and kept for the process; whether it could be."""
    try:
        from triton.runtime.cache import triton_key
        triton_key()
    except Exception:  # noqa: BLE001 - another Triton, or none: its first kernel computes what it needs
        return False
    return True


def start(device: str | None = None) -> None:
    """Compute Triton's hash on a thread of this process, once, where a GPU may run kernels
    (``device`` is the command's ``--device``; ``cpu`` or no GPU: nothing)."""
    global _thread
    if _thread is not None or device == "cpu" or not gpu_machine():
        return
    _thread = threading.Thread(target=triton_hash, name="mhctool-prewarm", daemon=True)
    _thread.start()
