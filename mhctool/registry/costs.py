"""A family's bytes and flops at a shape and dtype (each family's model is in its module of
:mod:`mhctool.families`): the memory roofline bench times against and the footprint that decides
where a case fits."""
from __future__ import annotations

from mhctool.core.dtypes import FORMATS
from mhctool.core.errors import UsageError
from mhctool.families import FAMILIES, Cost


def model(kernel: str, shape, dtype: str) -> Cost:
    """Activations at ``dtype``'s width, the mapping path's tensors at fp32's."""
    cost = FAMILIES[kernel].cost if kernel in FAMILIES else None
    if cost is None:
        raise UsageError(f"no bytes/flops model for kernel {kernel}")
    return cost(shape, FORMATS[dtype].torch_dtype.itemsize, 4)
