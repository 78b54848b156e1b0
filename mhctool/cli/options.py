"""Option text -> values, and the options several commands declare alike. What an option's text
alone decides is checked here, before torch is imported, so that such a usage error answers at
once; what needs the kernels' families is checked by the run the command calls."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from mhctool.core import names
from mhctool.core.errors import UsageError
from mhctool.core.text import split


def precheck(kernel: Optional[str] = None, dtypes: Optional[list[str]] = None, shape: Optional[str] = None,
             device_name: Optional[str] = None, impls: Optional[list[str]] = None) -> None:
    """Kernel names and groups, dtype names, the shape's form for the kernels' kind, the device's
    name (whether it is present is asked later); a ``--kernel`` or ``--impl`` given empty (a CI
    variable that expanded to nothing) names nothing, and is no request for the default."""
    if kernel is not None and not split([kernel]):
        raise UsageError(f"--kernel {kernel!r} names no kernel; accepted: {', '.join(names.KERNELS)}, or a "
                         f"group: {', '.join(names.GROUPS)} (leave the option out for the default)")
    if impls is not None and any(not split([i]) for i in impls):
        raise UsageError("--impl '' names no implementation; give a built-in name, FILE.py:function, "
                         "module:function or a library (leave the option out for the default)")
    kernels: list[str] = []
    for k in split([kernel]) if kernel else []:
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
            from mhctool.core.shapes import parse_shape_for  # torch-free, but read only where a shape is given
            parse_shape_for(kinds.pop(), shape)
    if device_name is not None and device_name not in names.DEVICES:
        raise UsageError(f"unknown device {device_name!r}; accepted: {', '.join(names.DEVICES)}")


def knob_items(items: Optional[list[str]], flag: str, example: str) -> list[tuple[str, str]]:
    """``KNOB=VALUE`` option items (repeated or comma-separated) -> ``(knob, raw value)`` pairs."""
    out = []
    for item in split(items):
        name, sep, raw = item.partition("=")
        if not sep or not name.strip() or not raw.strip():
            raise UsageError(f"malformed {flag} {item!r}; expected KNOB=VALUE, e.g. {example}")
        out.append((name.strip(), raw.strip()))
    return out


def lower(value: Optional[str]) -> Optional[str]:
    """A name given in any case (``--device CPU``, as ``--dtype FP32`` is taken)."""
    return value.strip().lower() if isinstance(value, str) else value


# the options several commands declare with the same meaning
Device = Annotated[Optional[str], typer.Option("--device", callback=lower, help="cpu or cuda (default: cuda when present).")]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="Print only the summary line.")]
Verbose = Annotated[bool, typer.Option("--verbose", help="Let the libraries' own log lines (TileLang, Triton, NCCL) show; by default they go to a log file beside the report, named in its metadata and after the summary.")]
Insist = Annotated[bool, typer.Option("--insist", help="Run an isolated implementation on every case, even after it ended its process in 2 cases in a row or hung past the time limit in one (by default its later cases are rows 'not run', saying why).")]
CaseTimeout = Annotated[Optional[float], typer.Option("--case-timeout", min=0.001, help="Seconds an isolated implementation may take for one case (default: scaled with the case).")]
Backend = Annotated[str, typer.Option("--backend", help="local (worker processes here) or ray: one Ray task per case (needs pip install ray).")]
RayAddress = Annotated[Optional[str], typer.Option("--ray-address", help="With --backend ray: the cluster to join (ray.init's address; default: a local one).")]
Shard = Annotated[Optional[str], typer.Option("--shard", help="I/N: run only the I-th of N deterministic slices (a CI matrix, a Slurm array); join the reports with mhctool report merge.")]
Workers = Annotated[Optional[str], typer.Option("--workers", envvar="MHCTOOL_WORKERS", show_default="spread where it pays", help="N or auto: spread the cases over N worker processes (auto: one per visible GPU, or per core on a CPU). Unset: one per GPU, or per core with at least 4 cases each. The report has the same rows in the same order as one process.")]
ShowProfile = Annotated[bool, typer.Option("--profile", help="Print where the time went: inputs, the native run, the float64 reference, each implementation (its first call in a process, which compiles, apart), judging, checks, and with --workers what was spent outside the cases (the report keeps it in any case).")]
Plot = Annotated[Optional[Path], typer.Option("--plot", help="Folder for PNG plots made from the report.")]

