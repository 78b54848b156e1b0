"""The fork server every worker process is forked from: what it imports once for all of them,
the variables it started with, and its start in the background at a command's start."""
from __future__ import annotations

import multiprocessing as mp
import os
import threading
from multiprocessing import forkserver

# what the fork server imports once for all the processes forked from it (workers, isolation
# workers, ranks): first what keeps signals to mhctool's process group off them
# (mhctool.spread.shield); torch, with mhctool.spread.isolation; and the module PyTorch's autograd imports at its
# first grad with given gradients, which imports sympy: 0.25 s a process on a CPU machine, 3 s on
# the GPU machine, whose packages have no compiled bytecode (there it was most of every worker's
# "native first call"); on a GPU machine, Triton's hash of itself (mhctool.spread.prewarm). A module that
# fails to import is left out (the server goes on).
FORKSERVER_PRELOAD = ["mhctool.spread.shield", "mhctool.spread.isolation", "torch.fx.experimental.symbolic_shapes",
                      "mhctool.spread.preload"]

_forkserver_env: dict | None = None  # the variables the fork server started with
# the warnings filter Python's resource tracker starts with (start_resource_tracker_quietly)
TRACKER_QUIET = "ignore::UserWarning:multiprocessing.resource_tracker"


def forkserver_started(environ) -> None:
    """Note the variables of the fork server as it starts (the first call wins)."""
    global _forkserver_env
    if _forkserver_env is None:
        _forkserver_env = dict(environ)


def forkserver_has(name: str, value: str) -> bool:
    """Whether the fork server started with ``name=value`` (its children then have it too)."""
    return _forkserver_env is not None and _forkserver_env.get(name) == value


def start_forkserver() -> None:
    """Start this process's fork server in the background (nothing where it runs already, or where
    there is no fork server): the first child forked from it then waits only for what is left of
    its imports. A pool worker that isolates starts its own at its first case, while the case's
    inputs, reference and native run come first (its isolation workers are forked from it)."""
    if "forkserver" not in mp.get_all_start_methods():
        return
    forkserver.set_forkserver_preload(FORKSERVER_PRELOAD)
    forkserver_started(os.environ)
    threading.Thread(target=forkserver.ensure_running, name="mhctool-forkserver", daemon=True).start()


def start_resource_tracker_quietly() -> None:
    """Start Python's resource tracker (the process that removes the semaphores and shared memory
    a process left registered; the fork server starts it otherwise) with its own warnings off, as
    the first thing a command does (:func:`mhctool.spread.setup.warm`; a pool worker inherits it). It
    keeps the stderr it starts with, at a command's start the terminal, and warns there as the last
    process it serves ends: "There appear to be N leaked semaphore objects" where a worker died
    holding one (an isolation worker that crashed or was stopped by a signal), after mhctool's
    conclusion, where no redirection of this process reaches. Such a worker is already a failed
    row; the tracker still removes what it left. Its warnings are turned off through the
    environment it starts with (this process's stderr is left alone: a signal's sentence must
    reach the terminal whenever it lands). Nothing where it runs already."""
    if os.name != "posix":  # no resource tracker elsewhere
        return
    from multiprocessing import resource_tracker
    before = os.environ.get("PYTHONWARNINGS")
    os.environ["PYTHONWARNINGS"] = f"{before},{TRACKER_QUIET}" if before else TRACKER_QUIET
    try:
        resource_tracker.ensure_running()
    except Exception:  # noqa: BLE001 - without it the fork server starts one as before
        pass
    finally:
        if before is None:
            os.environ.pop("PYTHONWARNINGS", None)
        else:
            os.environ["PYTHONWARNINGS"] = before
