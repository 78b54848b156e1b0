"""Kernel families, one module each: a family's contract (call signature, differentiable and
mapping-path inputs, knobs and conventions, float64 reference), its input families, mhctool's
fused kernels of it and its bytes model, in one place. A new family is one module here (its
:class:`~mhctool.families.contract.Family`), listed in :data:`FAMILIES`, plus its kernels and its
float64 reference (``references/``).

Implementations are :mod:`mhctool.registry` (mhctool's own in ``registry.builtin``, ``--impl``
specs in ``registry.specs``)."""
from __future__ import annotations

import torch

from mhctool.core import names
from mhctool.core.errors import UsageError
from mhctool.core.inputs import InputFamily, Tensors, drawing_on
from mhctool.core.shapes import Shape
from mhctool.families import (
    activations,
    composites,
    grouped,
    h_aggregate,
    h_post_bda,
    mapping,
    proj_rms,
    sinkhorn,
)
from mhctool.families.contract import (
    CALL_PROBLEMS,
    Cost,
    Family,
    Knob,
    call_problem,
    signature,
)
from mhctool.kernels.torch.mhc import (
    PRECISIONS,  # the matmul precisions, named here for mhctool
)

__all__ = ["CALL_PROBLEMS", "Cost", "FAMILIES", "Family", "GROUPS", "KERNELS", "Knob", "MATMUL_KERNELS",
           "MHC_KERNELS", "MOE_KERNELS", "PRECISIONS", "call_problem", "generate", "get_family", "input_families",
           "input_family", "kernels_named", "signature"]

FAMILIES: dict[str, Family] = {f.name: f for f in (
    sinkhorn.FAMILY, h_aggregate.FAMILY, h_post_bda.FAMILY, proj_rms.FAMILY, mapping.FAMILY,
    composites.MAPPING_SINKHORN, composites.MIX_AGGREGATE,
    activations.SWIGLU, activations.CLAMPED_SWIGLU, activations.SRELU,
    grouped.GROUPED_GEMM, grouped.GROUPED_WGRAD, grouped.GROUPED_MLP,
)}


KERNELS = tuple(FAMILIES)


MHC_KERNELS = tuple(k for k, f in FAMILIES.items() if f.shape_kind == "mhc")


MOE_KERNELS = tuple(k for k, f in FAMILIES.items() if f.shape_kind == "moe")


if (KERNELS, MHC_KERNELS, MOE_KERNELS) != (names.KERNELS, names.MHC_KERNELS, names.MOE_KERNELS):
    raise AssertionError("mhctool.core.names lists other kernels than the families")


# kernels whose products may run at TF32 by design (Family.matmul)
MATMUL_KERNELS = tuple(k for k, f in FAMILIES.items() if f.matmul)


# names that stand for several kernels: every one, or every one that takes one form of shape
GROUPS = {"all": KERNELS, "mhc": MHC_KERNELS, "moe": MOE_KERNELS}


def get_family(name: str) -> Family:
    if name not in FAMILIES:
        raise UsageError(f"unknown kernel {name!r}; accepted: {', '.join(KERNELS)}, or a group: {', '.join(GROUPS)}")
    return FAMILIES[name]


def kernels_named(names: list[str]) -> list[str]:
    """Kernel names and groups (``all``, ``mhc``, ``moe``) -> kernel names, checked, in order, once each."""
    out: list[str] = []
    for name in names:
        for k in GROUPS.get(name, (name,)):
            k = get_family(k).name
            if k not in out:
                out.append(k)
    return out


def input_families(kernel: str) -> dict[str, InputFamily]:
    """The input families a kernel's cases run by default (every one; not the stress or probe ones)."""
    return FAMILIES[kernel].input_families


def input_family(kernel: str, name: str) -> InputFamily:
    """One of a kernel's input families, stress families (run where a scenario names them) or
    identify's probe families."""
    fam = FAMILIES[kernel]
    fams = {**fam.input_families, **fam.stress, **fam.probes}
    if name not in fams:
        raise UsageError(f"unknown input family {name!r} for kernel {kernel}; accepted: {', '.join(fams)}")
    return fams[name]


def generate(kernel: str, family: str, shape: Shape, seed: int, knobs: dict,
             device: str = "cpu", draw_on: str | None = None) -> tuple[Shape, Tensors]:
    """The (possibly reshaped) shape and the fp32 tensors of one case. Parity draws from a CPU
    generator, tensors of BIG values or more on ``draw_on`` (the case's device; the
    others stay on the CPU, the same values on every device); bench draws everything from a
    generator on ``device`` (paper-shape inputs are gigabytes)."""
    fam = input_family(kernel, family)
    g = torch.Generator(device=device).manual_seed(seed)
    shape = fam.reshape(shape)
    with drawing_on(draw_on):
        return shape, fam.make(shape, g, knobs)
