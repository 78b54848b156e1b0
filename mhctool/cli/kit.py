"""What every command module shares: the consoles, the error guard and option parsers."""
from __future__ import annotations

import functools
import math
import signal
import threading
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from mhctool.core.errors import UsageError

# soft_wrap: a line is never broken (a command or path copied from a CI log must work); tables still
# lay out at the width
out = Console(highlight=False, soft_wrap=True, width=160)
err = Console(stderr=True, highlight=False, soft_wrap=True)
state = {"debug": False}


def guard(fn):
    """Turn UsageError into one sentence and exit 2 (a traceback only with --debug)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UsageError as e:
            if state["debug"]:
                raise
            err.print(f"error: {e}", markup=False)
            raise typer.Exit(2)

    return wrapper


def split(values: Optional[list[str]]) -> list[str]:
    """Repeated and comma-separated option values, flattened."""
    return [v.strip() for item in (values or []) for v in item.split(",") if v.strip()]




def precheck(kernel: Optional[str] = None, dtypes: Optional[list[str]] = None, shape: Optional[str] = None,
             device_name: Optional[str] = None) -> None:
    """The options a command's arguments alone decide, checked before torch is imported, so that
    such a usage error answers at once: kernel names and groups, dtype names, the shape's form for
    the kernels' kind, the device's name (whether it is present is asked later)."""
    kernels: list[str] = []
    from mhctool.core import names
    for k in ([x.strip() for x in kernel.split(",") if x.strip()] if kernel else []):
        if k in names.GROUPS:
            kernels += list(names.KERNELS if k == "all" else names.MHC_KERNELS if k == "mhc" else names.MOE_KERNELS)
        elif k in names.KERNELS:
            kernels.append(k)
        else:
            raise UsageError(f"unknown kernel {k!r}; accepted: {', '.join(names.KERNELS)}, or a group: "
                             f"{', '.join(names.GROUPS)}")
    for d in dtypes or []:
        if names.DTYPE_ALIASES.get(d.strip().lower(), d.strip().lower()) not in names.DTYPES:
            raise UsageError(f"unknown dtype {d!r}; accepted: {', '.join(names.DTYPES)}")
    if shape is not None and kernels:
        kinds = {"moe" if k in names.MOE_KERNELS else "mhc" for k in kernels}
        if len(kinds) == 1:
            from mhctool.core.shapes import parse_shape_for
            parse_shape_for(kinds.pop(), shape)
    if device_name is not None and device_name not in names.DEVICES:
        raise UsageError(f"unknown device {device_name!r}; accepted: {', '.join(names.DEVICES)}")


def device(name: Optional[str]) -> str:
    from mhctool.core import environment
    if name is None:
        return "cuda" if environment.cuda_available() else "cpu"
    if name not in ("cpu", "cuda"):
        raise UsageError(f"unknown device {name!r}; accepted: cpu, cuda")
    if name == "cuda" and not environment.cuda_available():
        raise UsageError("--device cuda was asked for but no CUDA GPU is visible here; use --device cpu")
    return name


def fmt(v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, float):
        if math.isinf(v):
            return "inf"
        return f"{v:.3g}" if v != int(v) or abs(v) >= 1e6 else f"{int(v)}"
    return str(v)


from mhctool.core.errors import Interrupted  # noqa: E402,F401


class LogProgress:
    """Progress for a log that is no terminal (a CI job's): a line on stderr every ``every``
    seconds while the work runs, from a background thread, so a case that compiles for a minute
    still shows the run is alive: what is done of how much, the time, the failures so far and what
    runs now. Silent where ``enabled`` is false (a terminal has the progress bar; --quiet).
    ``MHCTOOL_PROGRESS_SECONDS`` sets how often (default 10)."""

    def __init__(self, label: str, total: int | None, enabled: bool, every: float | None = None, unit: str = "done"):
        import os
        # MHCTOOL_PROGRESS_SECONDS: how often (default 10 s)
        every = every if every is not None else float(os.environ.get("MHCTOOL_PROGRESS_SECONDS", "10"))
        self.label, self.total, self.every, self.enabled, self.unit = label, total, every, enabled, unit
        self.done, self.failed, self.now = 0, 0, ""
        self._stop = threading.Event()
        self._thread = None
        self._t0 = 0.0

    def __enter__(self):
        import time
        self._t0 = time.monotonic()
        if self.enabled:
            self._thread = threading.Thread(target=self._beat, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(1.0)
            self.line()

    def _beat(self) -> None:
        while not self._stop.wait(self.every):
            self.line()

    def line(self) -> None:
        import time
        of = f"/{self.total}" if self.total is not None else ""
        failed = f", {self.failed} failed so far" if self.failed else ""
        now = f"; now {self.now}" if self.now and not self._stop.is_set() else ""
        err.print(f"{self.label}: {self.done}{of} {self.unit}, {time.monotonic() - self._t0:.0f} s{failed}{now}",
                  markup=False)


from mhctool.spread.setup import Interrupts  # noqa: E402,F401


def isolation_for(isolate: Optional[bool], specs: list[str], device: str, case_timeout: Optional[float],
                  transport: Optional[str], interrupts: Interrupts, default_on: bool = False):
    """The runner's Isolation, or None. Default: on where ``default_on`` (the gate), when an
    external implementation runs on a GPU, or when a case time limit is asked for. ``transport``:
    None where the user named none (shm)."""
    external = any(":" in s for s in specs)
    asked = isolate
    if isolate is None:
        isolate = default_on or (external and device == "cuda") or case_timeout is not None
    if not isolate:
        if case_timeout is not None:
            raise UsageError("--case-timeout needs --isolate (a time limit needs a child process to stop)")
        if transport is not None:
            raise UsageError(f"--isolate-transport {transport} needs isolation, which "
                             + ("--no-isolate turns off" if asked is False else "is off here: add --isolate"))
        return None
    transport = transport or "shm"
    from mhctool.spread.isolation import TRANSPORTS
    if transport not in TRANSPORTS:
        raise UsageError(f"unknown --isolate-transport {transport!r}; accepted: {', '.join(TRANSPORTS)}")
    from mhctool.spread.case_isolation import Isolation
    return Isolation(transport=transport, case_timeout=case_timeout, interrupted=interrupts)


def spread_for(workers: Optional[str], backend: str, device: str, plan, alone: bool = False) -> tuple[int, str]:
    """``--workers`` and ``--backend`` for a parity plan -> (worker processes, backend), checked
    before anything runs. ``alone``: the run keeps its cases in this process (``--ranks``); with
    ``--workers`` unset, so does a plan whose implementations cannot be spread (Python callables)."""
    from mhctool.spread import pool
    pool.check_backend(backend)
    asked = pool.parse_workers(workers)
    from mhctool.analyses.parity import check_poolable
    if asked == pool.DEFAULT and backend == "local":
        try:
            check_poolable(plan)
        except UsageError:
            alone = True
        if alone:
            return 1, backend
    n = pool.worker_count(asked, device, max(len(plan.cases), 1))
    if n > 1 or backend == "ray":
        check_poolable(plan)
    return n, backend


def knob_items(items: Optional[list[str]], flag: str, example: str) -> list[tuple[str, str]]:
    """``KNOB=VALUE`` option items (repeated or comma-separated) -> ``(knob, raw value)`` pairs."""
    out = []
    for item in split(items):
        name, sep, raw = item.partition("=")
        if not sep or not name.strip() or not raw.strip():
            raise UsageError(f"malformed {flag} {item!r}; expected KNOB=VALUE, e.g. {example}")
        out.append((name.strip(), raw.strip()))
    return out


def conventions(items: Optional[list[str]], kernels: list[str]) -> dict[str, dict]:
    """``--convention KNOB=VALUE`` items -> {kernel: {knob: value}} for the kernels that have the
    knob as a convention (values checked like scenario knobs); a knob none of them has is an error."""
    out: dict[str, dict] = {}
    from mhctool.analyses.knob_shift import typed_value
    from mhctool.families import get_family
    for name, raw in knob_items(items, "--convention", "stabilize=softmax"):
        takers = [k for k in kernels if name in get_family(k).conventions]
        if not takers:
            known = sorted({c for k in kernels for c in get_family(k).conventions})
            raise UsageError(f"--convention {name} is no convention of {', '.join(kernels)}; accepted: "
                             + (", ".join(known) or "none"))
        for k in takers:
            knob = get_family(k).knobs[name]
            out.setdefault(k, {})[name] = knob.check(k, name, typed_value(knob.kind, name, raw))
    return out


def input_dtypes(items: Optional[list[str]], kernels: list[str]) -> dict[str, dict]:
    """``--input-dtypes NAME=DTYPE`` items -> {kernel: {input: dtype}} for the kernels that have the
    input (each checked by parity.check_input_dtypes); an input none of them has is an error."""
    out: dict[str, dict] = {}
    from mhctool.analyses.parity import check_input_dtypes
    from mhctool.families import get_family
    for name, raw in knob_items(items, "--input-dtypes", "h_pre=activation"):
        takers = [k for k in kernels if name in get_family(k).inputs]
        if not takers:
            known = sorted({i for k in kernels for i in get_family(k).inputs})
            raise UsageError(f"--input-dtypes {name} is no input of {', '.join(kernels)}; accepted: {', '.join(known)}")
        for k in takers:
            out.setdefault(k, {}).update(check_input_dtypes(k, {name: raw}))
    return out


def short_impl(name: str) -> str:
    """``path/to/file.py:fn`` -> ``file.py:fn`` for tables (the report keeps the full spec)."""
    target, sep, fn = name.rpartition(":")
    return f"{Path(target).name}:{fn}" if sep else name


def parse_dtype(name: str):
    """A dtype option's value (the dtypes module imports torch: imported at the call)."""
    from mhctool.core.dtypes import parse_dtype as parse
    return parse(name)


def write_summary(path: Path, md: str) -> None:
    """A Markdown summary, written atomically and appended to ``$GITHUB_STEP_SUMMARY`` when set."""
    import os

    from mhctool.core import report
    report.atomic(path, lambda tmp: Path(tmp).write_text(md))
    if os.environ.get("GITHUB_STEP_SUMMARY"):
        with open(os.environ["GITHUB_STEP_SUMMARY"], "a") as f:
            f.write(md)
