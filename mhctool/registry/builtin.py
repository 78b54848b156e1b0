"""mhctool's own implementations of every family: native PyTorch (the baseline), torch.compile,
Triton and cuTile (with the projection's TF32 variants)."""
from __future__ import annotations

import functools
import inspect
from typing import Callable

import torch

from mhctool.core.environment import cutile_status, triton_status
from mhctool.families import FAMILIES, KERNELS, MOE_KERNELS
from mhctool.registry.impl import Impl, import_target


def _triton_requires() -> str | None:
    return triton_status().reason


def _cutile_requires() -> str | None:
    return cutile_status().reason


def _builtin_impls() -> dict[str, list[Impl]]:
    out: dict[str, list[Impl]] = {}
    for k in KERNELS:
        native = f"mhctool.kernels.torch.{'moe' if k in MOE_KERNELS else 'mhc'}:{k}"
        impls = [
            Impl("torch", k, "torch", native, native=True),
            # torch.compile on CPU costs tens of seconds per graph: asked for by name there
            Impl("compile", k, "compile", _compiled(native), default=False),
        ]
        if k in TRITON_KERNELS:
            impls.append(Impl("triton", k, "triton", TRITON_KERNELS[k], requires=_triton_requires))
        if k in CUTILE_KERNELS:
            impls.append(Impl("cutile", k, "cutile", CUTILE_KERNELS[k], devices=("cuda",),
                              requires=_cutile_requires))
        if k in TRITON_TF32_KERNELS:
            # asked for by name (--impl triton-tf32): judged at TF32, benched beside the IEEE kernel
            impls.append(Impl("triton-tf32", k, "triton", TRITON_TF32_KERNELS[k], precision="tf32",
                              default=False, requires=_triton_requires))
        out[k] = impls
    return out


def _compiled(target: str) -> Callable:
    cache: dict = {}

    def run(*args, **kwargs):
        if "fn" not in cache:
            cache["fn"] = torch.compile(import_target(target), dynamic=False)
        return cache["fn"](*args, **kwargs)

    run.__signature__ = inspect.signature(import_target(target))  # type: ignore[attr-defined]
    return run


# Fused kernels shipped with mhctool, from each family's module: family -> "module:function"
# (autograd-aware entry points); the projection's TF32 variants are asked for by name
TRITON_KERNELS: dict[str, str] = {k: f.kernels["triton"] for k, f in FAMILIES.items() if "triton" in f.kernels}
TRITON_TF32_KERNELS: dict[str, str] = {k: f.kernels["triton-tf32"] for k, f in FAMILIES.items()
                                       if "triton-tf32" in f.kernels}
CUTILE_KERNELS: dict[str, str] = {k: f.kernels["cutile"] for k, f in FAMILIES.items() if "cutile" in f.kernels}


@functools.lru_cache(maxsize=None)
def builtin() -> dict[str, list[Impl]]:
    return _builtin_impls()


def impls_for(kernel: str) -> list[Impl]:
    return builtin()[kernel]


def native_impl(kernel: str) -> Impl:
    return next(i for i in impls_for(kernel) if i.native)


BACKEND_NAMES = {"torch": "PyTorch", "compile": "torch.compile", "triton": "Triton", "cutile": "cuTile",
                 "triton-tf32": "Triton TF32"}
