"""The one table of floating-point formats mhctool knows."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from mhctool.core.errors import UsageError
from mhctool.core.names import DTYPE_ALIASES


@dataclass(frozen=True)
class FloatFormat:
    name: str
    torch_dtype: torch.dtype
    mantissa_bits: int  # explicit bits
    min_exponent: int  # of the smallest normal
    max_finite: float
    poison_bits: int  # a signalling NaN no arithmetic produces: marks unwritten output

    @property
    def unit_roundoff(self) -> float:
        return 2.0 ** -(self.mantissa_bits + 1)


FORMATS = {
    "fp32": FloatFormat("fp32", torch.float32, 23, -126, 3.4028234663852886e38, 0x7FBADBAD),
    "bf16": FloatFormat("bf16", torch.bfloat16, 7, -126, 3.3895313892515355e38, 0x7FAB),
    "fp16": FloatFormat("fp16", torch.float16, 10, -14, 65504.0, 0x7DAB),
    "fp64": FloatFormat("fp64", torch.float64, 52, -1022, 1.7976931348623157e308, 0x7FF4BADBADBADBAD),
}
_BY_TORCH = {f.torch_dtype: f for f in FORMATS.values()}
_INT_VIEW = {1: None, 2: torch.int16, 4: torch.int32, 8: torch.int64}
ALIASES = DTYPE_ALIASES


def parse_dtype(name: str, allowed=("fp32", "bf16", "fp16")) -> FloatFormat:
    key = ALIASES.get(name.strip().lower(), name.strip().lower())
    if key not in allowed:
        raise UsageError(f"unknown dtype {name!r}; accepted: {', '.join(allowed)}")
    return FORMATS[key]


def fmt_of(dtype: torch.dtype) -> FloatFormat:
    return _BY_TORCH[dtype]


def _poison_int(t: torch.Tensor) -> int:
    """The poison pattern as the signed integer of the same width (what an int view holds)."""
    bits, width = fmt_of(t.dtype).poison_bits, 8 * t.element_size()
    return bits - 2 ** width if bits >= 2 ** (width - 1) else bits


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill ``t`` in place with the format's poison NaN (bit pattern, not a computed NaN)."""
    return t.view(_INT_VIEW[t.element_size()]).fill_(_poison_int(t))


def is_poison(t: torch.Tensor) -> torch.Tensor:
    """Boolean mask of the elements that still hold the poison pattern."""
    if t.dtype not in _BY_TORCH:
        return torch.zeros(t.shape, dtype=torch.bool, device=t.device)
    return t.contiguous().view(_INT_VIEW[t.element_size()]) == _poison_int(t)


def dtype_named(name: str, activation: str) -> torch.dtype:
    """The torch dtype an input is declared at: ``activation`` (the run's activation dtype) or a
    format name (fp32, bf16, fp16); adapters' ``Binding.dtypes`` and ``--input-dtypes`` say these."""
    return FORMATS[activation if name == "activation" else name].torch_dtype

