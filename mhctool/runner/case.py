"""A case (kernel x family x dtype x shape x knobs x seed x device) and what its run gives back;
what a case needs of the device (footprint, fits) and how long one may take."""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field

import torch

from mhctool.core.errors import UsageError
from mhctool.core.shapes import Shape
from mhctool.registry.costs import model
from mhctool.registry.impl import Impl


@dataclass(frozen=True)
class Case:
    kernel: str
    family: str  # input family
    dtype: str
    shape: Shape
    knobs: tuple  # sorted (name, value) pairs
    seed: int
    device: str = "cpu"
    scenario: str = "cli"

    @property
    def knob_dict(self) -> dict:
        return dict(self.knobs)

    @property
    def knobs_json(self) -> str:
        return json.dumps(self.knob_dict, sort_keys=True)

    @property
    def case_id(self) -> str:
        key = f"{self.kernel}|{self.family}|{self.dtype}|{self.shape}|{self.knobs_json}|{self.seed}"
        return hashlib.sha1(key.encode()).hexdigest()[:12]


@dataclass
class ImplResult:
    outputs: list[torch.Tensor] | None = None
    grads: dict[str, torch.Tensor] | None = None
    fwd_error: str | None = None
    fwd_refused: str | None = None  # an outside implementation refused the case (a limit it states)
    bwd_error: str | None = None
    bwd_unsupported: str | None = None
    # the forward returned, but its outputs could not come back: a fault of the backward took the
    # isolation worker's CUDA context with them (the backward's error is bwd_error)
    fwd_lost: str | None = None
    returned: dict[str, str] = field(default_factory=dict)  # output -> dtype it came back in, where converted
    failure: str | None = None  # what the code under test did to its process (isolation: crash, timeout, ...)

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass
class CaseResult:
    case: Case
    shape: Shape  # after the input family's reshape
    rows: list[dict] = field(default_factory=list)
    abandoned: bool = False  # an isolated implementation was stopped because the run was interrupted
    timings: dict = field(default_factory=dict)  # phase -> seconds (mhctool.core.profile)


def check_runnable(impls: dict[str, list[Impl]], targets) -> None:
    """Implementations asked for by name: one that can run none of the ``targets`` (cases, or
    anything with ``kernel``, ``device`` and ``dtype``) is a UsageError naming the reason; one that
    runs some of them is skipped, with the reason, on the others (parity and bench alike)."""
    reasons: dict[str, str] = {}
    runnable: set[str] = set()
    for c in targets:
        for i in impls.get(c.kernel, []):
            key = i.spec or i.name  # what was asked for: a library spec stands for all it offers
            why = i.unsupported(c.device, c.dtype)
            if why is None:
                runnable.add(key)
            else:
                reasons.setdefault(key, why)
    for name, why in reasons.items():
        if name not in runnable:
            kernels = sorted({c.kernel for c in targets})
            raise UsageError(f"--impl {name} cannot run {', '.join(kernels)} here: {why}")


def footprint(case: Case) -> float:
    """Bytes a parity case needs at the least: the float64 reference's inputs, outputs, upstream
    gradients and gradients (the bench bytes model at 8 bytes an element). The native and fused
    runs, autograd's saved tensors and the metrics need more on top."""
    m = model(case.kernel, case.shape, "fp64")
    return m.bytes_fwd + m.bytes_bwd


def device_memory(device: str) -> float:
    """Bytes the device has: the GPU's total memory, or the machine's physical memory."""
    if device == "cuda":
        return float(torch.cuda.mem_get_info()[1])
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def check_fits(cases: list[Case]) -> None:
    """Refuse, before anything runs, a case that cannot fit in the device's memory."""
    if not cases:
        return
    need, case = max(((footprint(c), c) for c in cases), key=lambda t: t[0])
    have = device_memory(case.device)
    if need > have:
        raise UsageError(
            f"shape {case.shape} of {case.kernel} needs at least {need / 2**30:,.1f} GiB for the float64 reference "
            f"alone; the {'GPU' if case.device == 'cuda' else 'machine'} has {have / 2**30:,.1f} GiB")


# what a library that compiles at its first call of each shape gets on top (Triton autotuning,
# cuTile compiling every tile config: Megatron-LM dev's h_post_bda took over 120 s at a 13x3x4x67
# case on an H100 before its first result)
COMPILE_ALLOWANCE_S = 300.0
# an outside implementation's case on a CPU (whole default runs of the TE and Megatron stand-ins,
# interpreted Triton, took 16-23 s on a 2-core AMD EPYC: no case near this)
CPU_OUTSIDE_S = 30.0


def default_timeout(footprint_bytes: float, device: str, external: bool = False) -> float:
    """The default time limit of one isolated case. On a GPU: two minutes for compilation and small
    cases, plus 30 s per GiB the case needs (the float64 reference's footprint); code mhctool did
    not write (``external``) gets :data:`COMPILE_ALLOWANCE_S` more: kernel libraries compile and
    autotune inside the call, per shape, and every case of a scenario is a new shape. On a CPU:
    mhctool's own kernels run in Triton's interpreter, four times the GPU's limit; outside code
    compiles nothing there and is judged on small shapes: :data:`CPU_OUTSIDE_S` plus 120 s per
    GiB, so that a hung stranger costs seconds, not half an hour (one hang stops it:
    :mod:`mhctool.spread.streaks`)."""
    gib = footprint_bytes / 2**30
    if device == "cpu":
        return CPU_OUTSIDE_S + 120.0 * gib if external else 4.0 * (120.0 + 30.0 * gib)
    return 120.0 + 30.0 * gib + (COMPILE_ALLOWANCE_S if external else 0.0)


def row_fields(case: Case, shape: Shape, impl: Impl, precision: str, knobs: dict, sharding=None) -> dict:
    """The columns that name a row's case, implementation and knobs (every row of the case has them)."""
    return {
        "scenario": case.scenario, "case_id": case.case_id, "kernel": case.kernel,
        "impl": impl.name, "backend": impl.backend, "precision": precision,
        "family": case.family, "dtype": case.dtype, "dtype_out": None, "shape": str(shape),
        "knobs": json.dumps(knobs, sort_keys=True), "seed": case.seed, "device": case.device,
        **(sharding.row() if sharding is not None else {}),
    }

