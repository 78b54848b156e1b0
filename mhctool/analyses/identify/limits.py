"""Where a kernel fails at the probe shape: whether it is the shape. The probe is
run again at the nearest channel counts that are multiples of 2, 4, 8 and 16; where those run and
the probe's does not, the failure is an alignment requirement, said as one, and identification
goes on at an aligned shape."""
from __future__ import annotations

from dataclasses import dataclass

from mhctool.core.shapes import Shape

MODULI = (2, 4, 8, 16)


@dataclass
class ShapeLimit:
    modulus: int
    direction: str  # the direction that failed: forward or backward
    error: str
    failed_c: int
    ran_c: tuple[int, ...]
    shape: Shape  # the aligned shape identification goes on at

    def sentence(self) -> str:
        ran = " and ".join(str(c) for c in self.ran_c)
        error = self.error.split(" | ")[0]  # the error's first line (PyTorch's CUDA errors add advice lines)
        return (f"its {self.direction} fails at C = {self.failed_c} (C % {self.modulus} = {self.failed_c % self.modulus}: "
                f"{error}) and runs at C = {ran}: an alignment requirement of its {self.direction} "
                f"(C % {self.modulus} == 0), a limit to state or to lift; identified at {self.shape}")


def _failure(res) -> tuple[str, str] | None:
    if res.fwd_error:
        return "forward", res.fwd_error
    if res.bwd_error or res.fwd_lost:
        return "backward", res.bwd_error
    return None


def shape_limit(subject, family: str, failed) -> ShapeLimit | None:
    """``failed``: the probe's (direction, error) at ``subject.shape``. The smallest modulus whose
    nearest multiples of C (below and above) both run, or None where the channel count is not it."""
    shape = subject.shape
    if subject.fam.shape_kind != "mhc" or shape.c < 2:
        return None
    tried: dict[int, bool] = {}

    def runs(c: int) -> bool:
        if c not in tried:
            subject.shape = shape.replace(c=c)
            try:
                tried[c] = _failure(subject._run_on(family)[-1]) is None
            except Exception:  # noqa: BLE001 - the native run at that shape: no evidence either way
                tried[c] = False
            finally:
                subject.shape = shape
        return tried[c]

    for m in MODULI:
        if shape.c % m == 0:
            continue
        below, above = shape.c - shape.c % m, shape.c - shape.c % m + m
        ran = tuple(c for c in (below, above) if c > 0 and runs(c))
        if len(ran) == len([c for c in (below, above) if c > 0]) and ran:
            return ShapeLimit(m, failed[0], failed[1], shape.c, ran, shape.replace(c=ran[-1]))
    return None
