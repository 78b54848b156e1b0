"""A trajectory's ranks as processes of one group, as torchrun starts them (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_PORT``), each with GPUs of its own: the engine's launcher
(:mod:`mhctool.analyses.train.engine`), and the ablation script's. A rank's crash, exit or hang ends
its group and is said in one line; mhctool carries on.

The ranks are mhctool's to stop: the engine's worker ignores SIGINT and SIGTERM (:data:`PARENT_STOPS`),
so a Ctrl-C in the terminal or ``timeout``'s signal to the process group lets the run in hand end as
it would (the first signal's meaning); a second signal, or ``stop()``, kills the group."""
from __future__ import annotations

import os
import queue
import re
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

# a trajectory whose log has not grown for this long is hung: the first step of Megatron's recipe
# at 12 layers compiles for about a minute on an H200, several side by side for longer
STALL_S = 900.0

# set in a rank's environment: it ignores SIGINT and SIGTERM, its parent decides when it stops
PARENT_STOPS = "MHCTOOL_PARENT_STOPS"


def run_ranks(cmd: list[str], ranks: int, stall: float | None = STALL_S, log: Path | None = None,
               env: dict[str, str] | None = None, stop: Callable[[], bool] = lambda: False,
               line: Callable[[str], None] | None = None) -> str | None:
    """``cmd`` as ``ranks`` processes of one group (RANK, LOCAL_RANK, WORLD_SIZE, one MASTER_PORT),
    as torchrun starts them, with ``env`` added; what ended it early, or None. A rank that fails
    ends the group (the others would wait on it in a collective); ``log`` not growing for ``stall``
    seconds is a hang. A group whose rendezvous port was taken in the meantime (another group side
    by side took the same free port first) starts again on another, up to three times. ``stop()``
    turning true kills the group ("stopped"); so does an exception in this thread (a second signal).
    ``line(text)``: each whole line ``log`` gains, as it comes (a run's progress by steps)."""
    for _attempt in range(3):
        if stop():
            return STOPPED
        error = _run_group(cmd, ranks, stall, log, env, str(_free_port()), stop, line)
        if error is None or "EADDRINUSE" not in error or _steps_in(log):
            return error
    return error


def _steps_in(log: Path | None) -> int:
    if log is None or not log.is_file():
        return 0
    return sum(1 for line in log.read_text().splitlines() if line.startswith('{"step"'))


STOPPED = "stopped: the run was interrupted"


def _run_group(cmd: list[str], ranks: int, stall: float | None, log: Path | None, env: dict[str, str] | None,
               port: str, stop: Callable[[], bool] = lambda: False,
               line: Callable[[str], None] | None = None) -> str | None:
    with tempfile.TemporaryDirectory(prefix="mhctool-ranks-") as d:
        outs = [open(Path(d) / f"rank{r}.txt", "w+") for r in range(ranks)]
        procs = []
        size, since, hung, stopped, read = -1, time.monotonic(), False, False, 0
        try:
            for r in range(ranks):
                procs.append(subprocess.Popen(cmd, stdout=outs[r], stderr=subprocess.STDOUT, env={
                    **os.environ, **(env or {}), PARENT_STOPS: "1", "MASTER_PORT": port, "RANK": str(r),
                    "LOCAL_RANK": str(r), "WORLD_SIZE": str(ranks)}))
            while any(p.poll() is None for p in procs):
                if any(p.returncode not in (None, 0) for p in procs):
                    break
                if stop():
                    stopped = True
                    break
                now = log.stat().st_size if log is not None and log.is_file() else 0
                if now != size:
                    size, since = now, time.monotonic()
                    if line is not None and now:
                        read = _new_lines(log, read, line)
                elif stall is not None and time.monotonic() - since > stall:
                    hung = True
                    break
                time.sleep(0.2)
        finally:  # however it ends (a second signal raises here): no rank is left running
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
        if line is not None and log is not None and log.is_file():
            _new_lines(log, read, line)
        failed = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode not in (None, 0)]
        if stopped:
            return STOPPED
        if hung:
            return f"no step for {stall:g} s (a hang)"
        if not failed:
            return None
        rank, code = failed[0]
        outs[rank].seek(0)
        lines = [ln for ln in outs[rank].read().strip().splitlines() if ln.strip()]
        for f in outs:
            f.close()
    # the exception's line, not a warning printed at the exit after it
    raised = [ln for ln in lines if re.match(r"^(\[rank\d+\]: )?[\w.]*(Error|Exception)\b", ln)]
    tail = (raised or lines)[-1:]
    where = f"rank {rank} " if ranks > 1 else ""
    return f"{where}exit {code}" + (f": {tail[0][:300]}" if tail else "")


def _new_lines(log: Path, read: int, line: Callable[[str], None]) -> int:
    """``line(text)`` for each whole line of ``log`` past byte ``read``; the bytes read now."""
    with open(log, "rb") as f:
        f.seek(read)
        chunk = f.read()
    whole = chunk[:chunk.rfind(b"\n") + 1]
    for text in whole.decode(errors="replace").splitlines():
        if text.strip():
            line(text)
    return read + len(whole)


def gpu_groups(tp: int) -> list[str]:
    """The visible GPUs in groups of ``tp`` (each a ``CUDA_VISIBLE_DEVICES`` value): the GPUs of one
    trajectory's ranks. Trajectories side by side are spread over the groups."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [x.strip() for x in visible.split(",") if x.strip()]
    else:
        ids = [str(i) for i in range(torch.cuda.device_count())]
    tp = max(1, tp)
    return [",".join(ids[k * tp:(k + 1) * tp]) for k in range(len(ids) // tp)] or [",".join(ids)]


def gpu_slots(tp: int, holders: int):
    """A queue of :func:`gpu_groups` dealt round robin, one entry for each of ``holders`` jobs side
    by side (at least one a group): a job takes one (``get``) and puts it back when it ends."""
    groups = gpu_groups(tp)
    slots = queue.Queue()
    for i in range(max(holders, len(groups))):
        slots.put(groups[i % len(groups)])
    return slots


def _free_port() -> int:
    """A port no one listens on now, for the engine's process group (runs side by side differ)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
