"""Run code under test in a child process, so that it cannot decide mhctool's verdict.

A :class:`Worker` is a spawned Python process (CUDA initialised afresh there) that calls
``module:function`` jobs and sends the result back. Whatever the code under test does to its
process (exits, a signal such as SIGSEGV or SIGABRT, a hang, a CUDA fault that poisons the
context) becomes a :class:`Failure` with one sentence saying what happened; the worker is then
replaced and the next job runs in a fresh one.

Tensors cross the process boundary through one of two transports:

- ``shm`` (default): tensors are copied to host shared memory and only their handles are pickled
  (torch.multiprocessing's reductions); the receiver copies them to its device;
- ``file``: tensors are saved with ``torch.save`` into a temporary folder (``/dev/shm`` where it
  exists) and loaded onto the receiver's device.

``SystemExit`` raised by code under test is caught in the child (and in-process by the runner
without isolation): "the implementation called sys.exit(0)" is a failed row, never an exit code.
"""
from __future__ import annotations

import importlib
import os
import signal
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as tmp

TRANSPORTS = ("shm", "file")


@dataclass(frozen=True)
class Failure:
    """What the code under test did to its process, in one sentence."""

    kind: str  # exit, signal, timeout, cuda, raised, lost
    message: str


def describe_exitcode(code: int | None) -> Failure:
    if code is None:
        return Failure("lost", "the worker process vanished")
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return Failure("signal", f"crashed: signal {-code} ({name})")
    return Failure("exit", f"the implementation ended its process with exit code {code} (os._exit or a C-level exit)")


def system_exit_message(e: SystemExit) -> str:
    return f"the implementation called sys.exit({e.code!r})"


# --- tensors across the boundary -------------------------------------------------------------

def _map_tensors(obj, fn):
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(v, fn) for v in obj)
    return obj


def _devices(obj, out: set):
    _map_tensors(obj, lambda t: out.add(str(t.device)) or t)
    return out


class _Packed:
    """A payload whose tensors travel by the chosen transport; ``unpack`` restores their devices."""

    def __init__(self, obj, transport: str, folder: str):
        self.transport = transport
        self.devices: list[str] = []

        def strip(t: torch.Tensor):
            self.devices.append(str(t.device))
            return t.detach()

        plain = _map_tensors(obj, strip)
        if transport == "shm":
            self.payload = _map_tensors(plain, lambda t: t.to("cpu").contiguous().share_memory_())
            self.path = None
        else:
            fd, self.path = tempfile.mkstemp(prefix="mhctool-iso-", suffix=".pt", dir=folder)
            os.close(fd)
            torch.save(plain, self.path)
            self.payload = None

    def unpack(self):
        if self.transport == "shm":
            obj = self.payload
        else:
            obj = torch.load(self.path, map_location="cpu", weights_only=True)
            Path(self.path).unlink(missing_ok=True)
        devices = iter(self.devices)
        return _map_tensors(obj, lambda t: t.to(next(devices)))


def _folder() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


# --- the child ---------------------------------------------------------------------------------

def _resolve(target: str):
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def _cuda_healthy() -> str | None:
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    try:
        torch.cuda.synchronize()
        return None
    except Exception as e:  # a sticky error: the context is unusable from now on
        return f"{type(e).__name__}: {e}".splitlines()[0]


def _serve(conn, transport: str, folder: str) -> None:  # pragma: no cover - runs in the child
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides what Ctrl-C does
    from .environment import ensure_triton_mode
    ensure_triton_mode()
    conn.send(("ready", os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        target, packed = msg
        try:
            args, kwargs = packed.unpack()
            value = _resolve(target)(*args, **kwargs)
            reply = ("ok", _Packed(value, transport, folder))
        except SystemExit as e:
            reply = ("raised", system_exit_message(e))
        except BaseException as e:  # noqa: BLE001 - everything the code under test raises is a result
            reply = ("raised", "".join(traceback.format_exception_only(type(e), e)).strip())
        sick = _cuda_healthy()
        if sick:
            conn.send(("cuda", sick))
            os._exit(3)
        conn.send(reply)


# --- the parent --------------------------------------------------------------------------------

class Worker:
    """One spawned worker; ``call`` runs a job in it, replacing it after any failure."""

    def __init__(self, transport: str = "shm", start_timeout: float = 300.0):
        if transport not in TRANSPORTS:
            raise ValueError(f"unknown transport {transport!r}")
        self.transport = transport
        self.folder = _folder()
        self.start_timeout = start_timeout
        self._proc = None
        self._conn = None

    def _start(self) -> None:
        ctx = tmp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_serve, args=(child, self.transport, self.folder), daemon=True)
        proc.start()
        child.close()
        try:
            if not parent.poll(self.start_timeout):
                raise EOFError
            parent.recv()
        except (EOFError, OSError):
            proc.kill()
            proc.join(10)
            raise RuntimeError(f"the isolation worker did not start (exit code {proc.exitcode})") from None
        self._proc, self._conn = proc, parent

    def stop(self) -> None:
        if self._proc is None:
            return
        try:
            self._conn.send(None)
            self._proc.join(5)
        except (OSError, BrokenPipeError):
            pass
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
        self._conn.close()
        self._proc = self._conn = None

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join(10)
            self._conn.close()
        self._proc = self._conn = None

    def call(self, target: str, args: tuple = (), kwargs: dict | None = None,
             timeout: float | None = None, interrupted=lambda: False) -> tuple[Any, Failure | None]:
        """``(value, None)`` or ``(None, failure)``. ``interrupted()`` is polled while waiting: when
        it turns true the job is abandoned (the worker killed) as a ``lost`` failure."""
        if self._proc is None:
            try:
                self._start()
            except RuntimeError as e:
                return None, Failure("lost", str(e))
        packed = _Packed((tuple(args), dict(kwargs or {})), self.transport, self.folder)
        try:
            self._conn.send((target, packed))
        except (OSError, BrokenPipeError):
            failure = describe_exitcode(self._proc.exitcode)
            self._kill()
            return None, failure
        start = time.monotonic()
        while True:
            remaining = None if timeout is None else timeout - (time.monotonic() - start)
            if remaining is not None and remaining <= 0:
                self._kill()
                return None, Failure("timeout", f"timed out after {timeout:g} s")
            if interrupted():
                self._kill()
                return None, Failure("lost", "abandoned: the run was interrupted")
            if self._conn.poll(0.05 if remaining is None else min(0.05, remaining)):
                break
        try:
            kind, payload = self._conn.recv()
        except (EOFError, OSError):
            self._proc.join(10)
            failure = describe_exitcode(self._proc.exitcode)
            self._kill()
            return None, failure
        if kind == "ok":
            return payload.unpack(), None
        if kind == "cuda":
            self._kill()
            return None, Failure("cuda", payload)
        return None, Failure("raised", payload)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


# what a library that compiles at its first call of each shape gets on top (Triton autotuning,
# cuTile compiling every tile config: Megatron-LM dev's h_post_bda took over 120 s at a 13x3x4x67
# case on an H100 before its first result)
COMPILE_ALLOWANCE_S = 300.0


def default_timeout(footprint_bytes: float, device: str, external: bool = False) -> float:
    """The default time limit of one isolated case: two minutes for compilation and small cases,
    plus 30 s per GiB the case needs (the float64 reference's footprint); the CPU interpreter is
    slower, so the CPU gets four times as long. Code mhctool did not write (``external``) gets
    :data:`COMPILE_ALLOWANCE_S` more: kernel libraries compile and autotune inside the call, per
    shape, and every case of a scenario is a new shape; a hang is still caught."""
    t = 120.0 + 30.0 * footprint_bytes / 2**30 + (COMPILE_ALLOWANCE_S if external else 0.0)
    return t * (4.0 if device == "cpu" else 1.0)
