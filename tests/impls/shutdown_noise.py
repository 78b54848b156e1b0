"""A correct Sinkhorn from a module that writes a line to the process's stderr descriptor as the
process shuts down (as PyTorch's C++ destructors do: CUDA IPC's "Producer process has been
terminated ...") and that leaves a semaphore registered with Python's resource tracker, as a worker
that died holding one does (the tracker warns at shutdown "There appear to be 1 leaked semaphore
objects"): mhctool's conclusion must stay the terminal's last line."""
import atexit
import os
from multiprocessing import resource_tracker

from mhctool.kernels.torch import mhc as native

atexit.register(lambda: os.write(2, b"[W shutdown_noise.py] a third-party line at shutdown\n"))
resource_tracker.register(f"/mhctool-shutdown-noise-{os.getpid()}", "semaphore")  # never unregistered


def sinkhorn(logits, iters=20, eps=1e-6):
    return native.sinkhorn(logits, iters, eps)


def sinkhorn_chatty(logits, iters=20, eps=1e-6):
    """Writes a line to its process's stdout at every call, as a library's compile log does."""
    print("[chatty] compiling a kernel", flush=True)
    return native.sinkhorn(logits, iters, eps)
