"""How values and names read in a table or a sentence, the same in every command and analysis."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Iterable, Optional


def fmt(v) -> str:
    """A value for a table cell: three significant digits, integers as integers, ``-`` for none."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, float):
        if math.isinf(v):
            return "inf"
        return f"{v:.3g}" if v != int(v) or abs(v) >= 1e6 else f"{int(v)}"
    return str(v)


# metrics whose values are element counts (mhctool.core.metrics)
COUNT_METRICS = ("nonfinite", "unwritten", "extra_zeros")


def measured(metric: str, v) -> str:
    """A judged value in a sentence: a count as an integer ("nonfinite 670", never 6.7e+02), an
    error that non-finite elements made infinite said so, NaN as NaN; else two significant digits."""
    if v is None:
        return "-"
    v = float(v)
    if math.isnan(v):
        return "NaN"
    if metric in COUNT_METRICS:
        return str(int(v))
    if math.isinf(v):
        return "inf (non-finite elements)"
    return f"{v:.2g}"


def short_impl(name: str) -> str:
    """``path/to/file.py:fn`` -> ``file.py:fn`` for tables (the report keeps the full spec)."""
    target, sep, fn = name.rpartition(":")
    return f"{Path(target).name}:{fn}" if sep else name


def split(values: Optional[Iterable[str]]) -> list[str]:
    """Repeated and comma-separated option values, flattened."""
    return [v.strip() for item in (values or []) for v in item.split(",") if v.strip()]
