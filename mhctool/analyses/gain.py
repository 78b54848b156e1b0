"""Composite gain of the residual mixing over depth (``mhctool stability gain``).

The mHC paper's stability measure: the Amax Gain Magnitude of the composite
``H^(L) ... H^(2) H^(1)`` of the per-layer residual mixing matrices, per token: its largest
absolute row sum (forward gain: how much a signal can grow through the stack) and its largest
absolute column sum (backward gain: the same for gradients), averaged over tokens (and their
largest value over tokens beside it).

Sinkhorn-projected ``H_res`` (mHC) is close to doubly stochastic, so the composite stays so and
the gains stay near 1; how near depends on the iteration count and knobs. The contrast is
Hyper-Connections' unconstrained ``H_res``: identity plus a learned dynamic part, here
``I + hc_scale * tanh(logits)`` on the same logits, whose composite grows with depth.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from mhctool.core.dtypes import FORMATS
from mhctool.core.shapes import Shape
from mhctool.families import generate
from mhctool.registry.impl import Impl


@dataclass(frozen=True)
class GainConfig:
    """One way of making H_res: ``sinkhorn`` with its knobs, or ``hc`` (unconstrained)."""

    kind: str  # "sinkhorn" or "hc"
    iters: int | None = None
    knobs: tuple = ()  # sorted (name, value) pairs besides iters
    hc_scale: float | None = None

    @property
    def label(self) -> str:
        if self.kind == "hc":
            return f"HC: I + {self.hc_scale:g} tanh(L)"
        extra = "".join(f", {k}={v}" for k, v in self.knobs)
        return f"sinkhorn iters={self.iters}{extra}"


def layer_logits(family: str, depth: int, tokens: int, n: int, seed: int) -> list[torch.Tensor]:
    """Per layer, seeded logits ``[tokens, n, n]`` of a Sinkhorn input family."""
    shape = Shape(tokens, 1, n, 1)
    return [generate("sinkhorn", family, shape, seed + 1000 * layer, {})[1]["logits"].reshape(tokens, n, n)
            for layer in range(depth)]


def _h_res(cfg: GainConfig, logits: torch.Tensor, impl: Impl | None, dtype: str, device: str) -> torch.Tensor:
    if cfg.kind == "hc":
        eye = torch.eye(logits.shape[-1], dtype=torch.float64)
        return eye + cfg.hc_scale * torch.tanh(logits.double())
    knobs = dict(cfg.knobs)
    kw = {k: v for k, v in knobs.items() if impl.accepts(k)}
    with torch.no_grad():
        h = impl.fn(logits.to(dtype=FORMATS[dtype].torch_dtype, device=device), cfg.iters, knobs.get("eps", 1e-6), **kw)
    return h.double().cpu()


def composite_gain(cfg: GainConfig, layers: list[torch.Tensor], impl: Impl | None, dtype: str,
                   device: str) -> list[dict]:
    """Rows per depth: forward and backward gain of the composite, mean and max over tokens.
    The product is taken in float64 whatever dtype produced each H_res."""
    rows = []
    comp = None
    for depth, logits in enumerate(layers, start=1):
        h = _h_res(cfg, logits, impl, dtype, device)
        comp = h if comp is None else h @ comp  # the new layer mixes after the earlier ones
        fwd = comp.abs().sum(-1).amax(-1)  # max absolute row sum, per token
        bwd = comp.abs().sum(-2).amax(-1)  # max absolute column sum, per token
        for metric, v in (("fwd_gain", fwd.mean()), ("bwd_gain", bwd.mean()),
                          ("fwd_gain_max", fwd.max()), ("bwd_gain_max", bwd.max())):
            rows.append(dict(config=cfg.label, kind=cfg.kind, iters=cfg.iters, depth=depth, metric=metric,
                             value=float(v)))
    return rows
