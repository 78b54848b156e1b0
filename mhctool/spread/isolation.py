"""Run code under test in a child process, so that it cannot decide mhctool's verdict.

A :class:`Worker` is a child Python process (CUDA initialised afresh there) that calls
``module:function`` jobs and sends the result back. It is forked from a fork server that has
imported torch once (a worker starts in about 0.3 s instead of 1.5 s on a 2-core CPU), and
takes the parent's environment as it is when the worker starts, with the worker's own variables
(``env``) on top where they are read after the fork (``CUDA_VISIBLE_DEVICES``: CUDA starts in the
child); a worker with variables read when torch is imported (thread counts, OpenMP's wait
policy) is spawned from a fresh interpreter instead. Whatever
the code under test does to its process (exits, a signal such as SIGSEGV or SIGABRT, a hang, a CUDA fault that poisons the
context) becomes a :class:`Failure` with one sentence saying what happened; the worker is then
replaced and the next job runs in a fresh one.

Tensors cross the process boundary through one of three transports:

- ``shm`` (default): tensors stay where they are. A CUDA tensor travels as a CUDA IPC handle
  (PyTorch's CUDA tensor sharing): the receiver maps the sender's device memory and copies it on
  the device, so nothing goes through the host. A CPU tensor travels through host shared memory
  (one copy into a shared segment; the receiver maps it). The sender's inputs are copied first,
  so code under test never holds mhctool's own tensors;
- ``host``: every tensor is copied to host shared memory and back to its device (what ``shm``
  did for CUDA tensors before it used CUDA IPC; kept to measure the difference);
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
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as tmp

from mhctool.core import partial
from mhctool.core.environment import ensure_triton_mode
from mhctool.core.errors import short_error, system_exit_message
from mhctool.core.library_log import ENV as LIBRARY_LOG
from mhctool.core.library_log import to_log
from mhctool.spread.forkserver import (
    FORKSERVER_PRELOAD,
    forkserver_has,
    forkserver_started,
)
from mhctool.spread import procs
from mhctool.spread.machine import THREADS_ENV, apply_threads

TRANSPORTS = ("shm", "host", "file")
_ENVIRON_LOCK = threading.Lock()
# variables a child may set after the fork server's fork: read when CUDA starts, not at import
# (dev/forkserver_gpu.py: a child of the fork server sees the GPU its CUDA_VISIBLE_DEVICES names)
# MHCTOOL_THREADS: set with torch.set_num_threads by _serve
LATE_VARIABLES = {"CUDA_VISIBLE_DEVICES", "MHCTOOL_DRAW_THREADS", "MHCTOOL_SHARED_GPU", THREADS_ENV}


@dataclass(frozen=True)
class Failure:
    """What the code under test did to its process, in one sentence."""

    kind: str  # exit, signal, timeout, cuda, raised, lost; stopped (case_isolation: not run, its streak)
    message: str
    # cuda: what the call had returned before the context was lost, its tensors left behind
    # (the one-case runner's errors: which direction the fault was in)
    partial: dict | None = None
    # what the job had handed over before it failed (mhctool.core.partial.report: the forward's
    # outputs), in this process's own memory
    progress: Any = None


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

    def __init__(self, obj, transport: str, folder: str, copy_cuda: bool = False, received: set | None = None):
        """``copy_cuda``: send copies of CUDA tensors (the parent's inputs); ``received``: storage
        addresses this process mapped from another one, which must be copied to be sent on (a
        kernel that returns an input, or a view of one)."""
        self.transport = transport
        self.devices: list[str] = []
        received = received or set()

        def mapped(t: torch.Tensor) -> bool:
            return t.untyped_storage().data_ptr() in received

        def strip(t: torch.Tensor):
            self.devices.append(str(t.device))
            return t.detach()

        plain = _map_tensors(obj, strip)
        self.path = self.payload = None
        if transport == "shm":  # CUDA tensors as IPC handles (copied first where asked), CPU ones in shared memory
            self.payload = _map_tensors(plain, lambda t: (t.clone() if copy_cuda or mapped(t) else t) if t.is_cuda
                                        else shared_copy(t) if copy_cuda else t.contiguous().share_memory_())
        elif transport == "host":
            self.payload = _map_tensors(plain, lambda t: t.to("cpu").contiguous().share_memory_())
        else:
            fd, self.path = tempfile.mkstemp(prefix="mhctool-iso-", suffix=".pt", dir=folder)
            os.close(fd)
            torch.save(plain, self.path)

    def unpack(self, copy_cuda: bool = True):
        """The payload on its devices; ``copy_cuda``: copy what was mapped from the sender's device
        memory (the parent does: a worker that dies takes its memory with it)."""
        if self.transport == "file":
            obj = torch.load(self.path, map_location="cpu", weights_only=True)
            Path(self.path).unlink(missing_ok=True)
        else:
            obj = self.payload
        devices = iter(self.devices)
        return _map_tensors(obj, lambda t: _own(t, next(devices), copy_cuda))


def shared_copy(t: torch.Tensor) -> torch.Tensor:
    """``t`` copied once into a new host shared-memory segment (``share_memory_`` would move the
    sender's own storage there, and the receiver could write into it)."""
    storage = torch.UntypedStorage._new_shared(t.numel() * t.element_size())
    out = torch.empty(0, dtype=t.dtype).set_(storage, 0, t.shape)
    return out.copy_(t)


def _own(t: torch.Tensor, device: str, copy_cuda: bool) -> torch.Tensor:
    if t.is_cuda and str(t.device) == device:
        return t.clone() if copy_cuda else t
    return t.to(device)


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


def _plain(value) -> dict | None:
    """A result's fields that are no tensors (strings, numbers, None), or None where it is no dict."""
    if not isinstance(value, dict):
        return None
    return {k: v for k, v in value.items() if v is None or isinstance(v, (str, bool, int, float))}


def child_context(spawn: bool = False) -> tuple[Any, dict | None]:
    """How to start a child process: ``(context, environ)``. The fork server's context, torch
    imported once in the server (children start in a fraction of a second rather than importing
    torch each), with the parent's variables of this moment for :func:`adopt_environment`; or,
    with ``spawn`` or where there is no fork server (Windows), a fresh interpreter and None."""
    if spawn or "forkserver" not in tmp.get_all_start_methods():
        return tmp.get_context("spawn"), None
    ctx = tmp.get_context("forkserver")
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    forkserver_started(os.environ)  # where the server starts now: with these variables
    return ctx, dict(os.environ)


def adopt_environment(environ: dict | None) -> None:
    """In a child forked from the fork server: the parent's variables as they were when it started
    the child (the server has those of the moment it started). None: a spawned child, which has them."""
    if environ is not None:
        os.environ.clear()
        os.environ.update(environ)


def _serve(conn, transport: str, folder: str, environ: dict | None = None) -> None:  # pragma: no cover - runs in the child
    for s in (signal.SIGINT, signal.SIGTERM):  # the parent decides what a signal does (and stops it by SIGKILL)
        signal.signal(s, signal.SIG_IGN)
    adopt_environment(environ)
    apply_threads()  # the run's PyTorch thread count (machine.py: the rows the same on any machine)
    to_log(os.environ.get(LIBRARY_LOG))  # the libraries' own lines to the command's log, where it keeps one
    ensure_triton_mode()
    conn.send(("ready", os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        except Exception as e:  # noqa: BLE001 - the inputs could not be mapped here (device memory full)
            conn.send(("raised", f"the worker could not take its inputs: {type(e).__name__}: {str(e).splitlines()[0]}"))
            continue
        if msg is None:
            return
        target, packed = msg
        try:
            args, kwargs = packed.unpack(copy_cuda=False)  # the parent sent copies of its own
            received = set()
            _map_tensors((args, kwargs), lambda t: received.add(t.untyped_storage().data_ptr()) if t.is_cuda else None)

            def hand_over(obj, received=received):  # the parent copies it, then answers
                conn.send(("partial", _Packed(obj, transport, folder, received=received)))
                conn.recv()
            partial.set_sender(hand_over)
            value = _resolve(target)(*args, **kwargs)
            sick = _cuda_healthy()  # before packing: tensors of a lost context cannot be copied
            reply = ("cuda", (sick, _plain(value))) if sick else ("ok", _Packed(value, transport, folder,
                                                                                   received=received))
        except SystemExit as e:
            reply = ("raised", system_exit_message(e))
        except BaseException as e:  # noqa: BLE001 - everything the code under test raises is a result
            reply = ("raised", short_error(e))
        partial.set_sender(None)
        sick = _cuda_healthy()
        if sick:
            conn.send(reply if reply[0] == "cuda" else ("cuda", (sick, None)))
            os._exit(3)
        conn.send(reply)
        msg = packed = args = kwargs = value = reply = None  # the parent's memory is released here


# --- the parent --------------------------------------------------------------------------------

class Worker:
    """One spawned worker; ``call`` runs a job in it, replacing it after any failure.

    ``daemon`` False: a worker that may start workers of its own (:mod:`mhctool.spread.pool`'s, which
    isolate the implementations under test inside); ``env``: variables set in it first."""

    def __init__(self, transport: str = "shm", start_timeout: float = 300.0, daemon: bool = True,
                 env: dict | None = None):
        if transport not in TRANSPORTS:
            raise ValueError(f"unknown transport {transport!r}")
        self.daemon, self.env = daemon, dict(env or {})
        self.transport = transport
        self.folder = _folder()
        self.start_timeout = start_timeout
        self._proc = None
        self._conn = None
        self.progress = None  # what the last job handed over before it ended (mhctool.core.partial)

    def start(self) -> Failure | None:
        """Start the process now (a call starts it otherwise); None, or why it did not start."""
        if self._proc is None:
            try:
                self._start()
            except RuntimeError as e:
                return Failure("lost", str(e))
        return None

    def _start(self) -> None:
        # Variables read when torch is imported (thread counts, OpenMP's wait policy) need a fresh
        # interpreter unless the fork server started with them; the LATE_VARIABLES are read after
        # the fork, so a child of the fork server takes them from ``environ`` (a copy of this
        # environment). A spawned child takes this process's environment: its variables are set
        # here for the moment of its start, under the lock the copy is taken under too, so that no
        # child ever gets another worker's variables.
        with _ENVIRON_LOCK:
            ctx, environ = child_context(spawn=any(k not in LATE_VARIABLES and not forkserver_has(k, v)
                                                   for k, v in self.env.items()))
            if environ is not None:
                environ.update(self.env)
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(child, self.transport, self.folder, environ), daemon=self.daemon)
            saved = {k: os.environ.get(k) for k in self.env} if environ is None else {}
            if environ is None:
                os.environ.update(self.env)
            try:
                proc.start()
            finally:
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
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
        """Asked to end, else killed; what it started (a fork server, an isolation worker hung
        in the code under test) ends with it (:mod:`mhctool.spread.procs`)."""
        # claimed first: a signal's exception in a join below, and the stop that follows it (a
        # finally, another thread), see no worker; the old order crashed there with 'NoneType' object
        # has no attribute 'is_alive' (parity stopped by timeout -s INT, 3 of 24 runs)
        proc, conn = self._proc, self._conn
        self._proc = self._conn = None
        if proc is None:
            return
        kin = procs.descendants(proc.pid)
        try:
            try:
                conn.send(None)
                proc.join(5)
            except (OSError, BrokenPipeError):
                pass
        finally:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
            procs.end(kin)
            conn.close()

    def _kill(self) -> None:
        proc, conn = self._proc, self._conn
        self._proc = self._conn = None
        if proc is not None:
            kin = procs.descendants(proc.pid)
            proc.kill()
            procs.end(kin)
            proc.join(10)
            conn.close()

    def call(self, target: str, args: tuple = (), kwargs: dict | None = None,
             timeout: float | None = None, interrupted=lambda: False, stalled=None) -> tuple[Any, Failure | None]:
        """``(value, None)`` or ``(None, failure)``. ``interrupted()`` is polled while waiting: when
        it turns true the job is abandoned (the worker killed) as a ``lost`` failure. ``stalled()``,
        where given, is polled too: a sentence from it ends the job as a ``timeout`` (a job that
        stopped making progress, however long it has run). What the job hands over before it ends
        (:func:`mhctool.core.partial.report`) is copied here as it comes: ``self.progress``, and
        the failure's ``progress``."""
        self.progress = None
        failure = self.start()
        if failure is not None:
            return None, failure
        packed = _Packed((tuple(args), dict(kwargs or {})), self.transport, self.folder, copy_cuda=True)
        try:
            self._conn.send((target, packed))
        except (OSError, BrokenPipeError):
            failure = describe_exitcode(self._proc.exitcode)
            self._kill()
            return None, failure
        start = time.monotonic()
        try:
            return self._answer(start, timeout, interrupted, stalled)
        except BaseException:  # a second signal (Interrupted) while the job runs: the job abandoned with its worker
            self._kill()
            raise

    def _answer(self, start: float, timeout, interrupted, stalled) -> tuple[Any, Failure | None]:
        """:meth:`call`'s wait for the job's answer, its partial reports copied as they come."""
        while True:
            failure = self._wait(start, timeout, interrupted, stalled)
            if failure is None:
                try:
                    kind, payload = self._conn.recv()
                except (EOFError, OSError):
                    self._proc.join(10)
                    failure = describe_exitcode(self._proc.exitcode)
            if failure is not None:
                self._kill()
                return None, replace(failure, progress=self.progress)
            if kind != "partial":
                break
            self.progress = payload.unpack()  # copied before the job goes on (and may take its memory with it)
            try:
                self._conn.send("taken")
            except (OSError, BrokenPipeError):
                pass  # it died meanwhile: the next wait says how
        if kind == "ok":
            return payload.unpack(), None
        if kind == "cuda":
            self._kill()
            sick, done = payload
            return None, Failure("cuda", sick, done, self.progress)
        return None, Failure("raised", payload, progress=self.progress)

    def _wait(self, start: float, timeout, interrupted, stalled) -> Failure | None:
        """Until the job's next message: None, or why the job is to be abandoned."""
        while True:
            remaining = None if timeout is None else timeout - (time.monotonic() - start)
            if remaining is not None and remaining <= 0:
                return Failure("timeout", f"timed out after {timeout:g} s")
            if interrupted():
                return Failure("lost", "abandoned: the run was interrupted")
            why = stalled() if stalled is not None else None
            if why:
                return Failure("timeout", why)
            if self._conn.poll(0.05 if remaining is None else min(0.05, remaining)):
                return None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
