"""What every command module shares: the consoles, the error guard and option parsers."""
from __future__ import annotations

import functools
import math
from typing import Optional

import typer
from rich.console import Console

from . import environment
from .errors import UsageError

out = Console(highlight=False, soft_wrap=False, width=160)
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


def device(name: Optional[str]) -> str:
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
