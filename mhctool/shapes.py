"""Problem shapes: ``SxBxNxC`` (tokens s*b, n streams of width C)."""
from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import UsageError

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
        d = dict(s=self.s, b=self.b, n=self.n, c=self.c)
        d.update(kw)
        return Shape(**d)

    def __str__(self) -> str:
        return f"{self.s}x{self.b}x{self.n}x{self.c}"


_SHAPE_RE = re.compile(r"^\s*(\d+)x(\d+)x(\d+)x(\d+)\s*$")


def parse_shape(text: str) -> Shape:
    m = _SHAPE_RE.match(str(text))
    if not m:
        raise UsageError(
            f"malformed shape {text!r}; expected SxBxNxC with four positive integers, e.g. 8192x4x4x7168"
        )
    s, b, n, c = (int(g) for g in m.groups())
    if min(s, b, n, c) < 1:
        raise UsageError(f"shape {text!r} has a zero dimension; every dimension must be at least 1")
    return Shape(s, b, n, c)
