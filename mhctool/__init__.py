"""mhctool: numerics validation for fused mHC and grouped-MLP kernels.

From Python (the command line is ``mhctool``; ``mhctool --help``)::

    from mhctool import assert_parity
    assert_parity(my_sinkhorn, "sinkhorn")         # raises AssertionError with the worst rows

    from mhctool import read_report
    table, meta = read_report("mhctool-parity.parquet")   # pyarrow.Table, metadata dict

What is public is listed in ``__all__``; the rest may change between versions. Importing
mhctool is cheap: the names below load their modules (and torch) on first use.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

__all__ = ["ParityResult", "UsageError", "__version__", "assert_parity", "check_parity", "read_report"]

_LAZY = {
    "ParityResult": ("mhctool.testing", "ParityResult"),
    "assert_parity": ("mhctool.testing", "assert_parity"),
    "check_parity": ("mhctool.testing", "check_parity"),
    "read_report": ("mhctool.core.report", "read"),
    "UsageError": ("mhctool.core.errors", "UsageError"),
}


def __getattr__(name: str):
    if name in _LAZY:
        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'mhctool' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
