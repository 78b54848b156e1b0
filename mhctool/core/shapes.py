"""Problem shapes: ``SxBxNxC`` for the mHC kernels (tokens s*b, n streams of width C) and
``TxHxFxE`` for the grouped-MLP kernels (tokens, hidden, ffn, experts)."""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from mhctool.core.errors import UsageError

PAPER_SHAPE = "8192x4x4x7168"


@dataclass(frozen=True)
class Shape:
    s: int
    b: int
    n: int
    c: int

    @property
    def tokens(self) -> int:
        return self.s * self.b

    @property
    def k(self) -> int:
        """Projection input width ``n * C``."""
        return self.n * self.c

    @property
    def n_h(self) -> int:
        """Mapping coefficients per token: ``n^2 + 2n``."""
        return self.n * self.n + 2 * self.n

    def replace(self, **kw) -> "Shape":
        return dataclasses.replace(self, **kw)

    def __str__(self) -> str:
        return f"{self.s}x{self.b}x{self.n}x{self.c}"


_SHAPE_RE = re.compile(r"^\s*(\d+)x(\d+)x(\d+)x(\d+)\s*$")


def _four_ints(text: str, expected: str) -> tuple[int, int, int, int]:
    m = _SHAPE_RE.match(str(text))
    if not m:
        raise UsageError(f"malformed shape {text!r}; {expected}")
    dims = tuple(int(g) for g in m.groups())
    if min(dims) < 1:
        raise UsageError(f"shape {text!r} has a zero dimension; every dimension must be at least 1")
    return dims


def parse_shape(text: str) -> Shape:
    return Shape(*_four_ints(text, "expected SxBxNxC with four positive integers, e.g. 8192x4x4x7168"))


MOE_PAPER_SHAPE = "4096x2048x1024x8"


@dataclass(frozen=True)
class MoeShape:
    """Grouped MLP problem: ``tokens`` rows of width ``hidden``, FC1 to ``ffn`` (2 * ffn rows for
    GLU activations), ``experts`` groups. The activation kernels use ``tokens`` and ``ffn``; the
    grouped GEMM multiplies ``[tokens, hidden]`` by per-expert ``[ffn, hidden]`` weights."""

    tokens: int
    hidden: int
    ffn: int
    experts: int

    def replace(self, **kw) -> "MoeShape":
        return dataclasses.replace(self, **kw)

    def __str__(self) -> str:
        return f"{self.tokens}x{self.hidden}x{self.ffn}x{self.experts}"


def parse_moe_shape(text: str) -> MoeShape:
    return MoeShape(*_four_ints(text, "the grouped-MLP kernels take TxHxFxE (tokens x hidden x ffn x "
                                      f"experts), e.g. {MOE_PAPER_SHAPE}"))


def parse_shape_for(kind: str, text: str):
    """A shape string in the form the kernel kind takes (``mhc``: SxBxNxC, ``moe``: TxHxFxE)."""
    return parse_moe_shape(text) if kind == "moe" else parse_shape(text)
