"""Seeded draws for the input families (each family's own are in its module of
:mod:`mhctool.families`).

Plain random inputs at unit scale hide most numerics defects, so each kernel family has input
families chosen to amplify one knob of its contract (DESIGN.md, "Inputs that expose defects").
A generator draws float32 values from a seeded CPU ``torch.Generator``, then the runner casts them:
activations to the case dtype, mapping tensors (``h_pre``, ``h_post``, ``h_res``) to fp32, the
mapping path's precision. A tensor of :data:`BIG` values or more is drawn on the case's device
(:func:`generate`'s ``draw_on``): on the CPU blockwise on threads, on a GPU by a counter-based
generator in one launch (:mod:`mhctool.core.philox`), so a GPU case's large tensors have other values
than a CPU case's at the same seed.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import math
import os
from dataclasses import dataclass, field
from typing import Callable

import torch

from mhctool.core.shapes import Shape

Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True)
class InputFamily:
    name: str
    doc: str
    make: Callable[[Shape, torch.Generator, dict], Tensors]
    reshape: Callable[[Shape], Shape] = field(default=lambda s: s)


# A CPU generator draws one value after another on one core: the 940 million values of a
# paper-shape activation took 5 s, and a paper-shape case's inputs and upstream gradients more
# than half of its run on an H200. A tensor of BIG values or more is drawn in blocks of BLOCK
# values instead, each from a generator of its own seeded from one draw of the case's, the blocks
# on threads: the values depend on the seed and the shape only, not on the thread count.
BIG = 1 << 24
BLOCK = 1 << 22
# On a GPU, four workers drawing gigabytes on the host and copying them over contended for the
# host's cores and memory (the inputs phase doubled from one worker to four on an H200 node), so
# parity draws a large tensor on the case's device, one launch a tensor (mhctool.core.philox: a value
# depends on the seed and its index alone, not on the GPU's size).

# where large tensors are drawn (generate's draw_on); None: on the CPU
_DRAW_ON: contextvars.ContextVar = contextvars.ContextVar("mhctool_draw_on", default=None)


@contextlib.contextmanager
def drawing_on(device):
    """Large tensors drawn on ``device`` (a ``torch.device`` or name) within the block."""
    token = _DRAW_ON.set(None if device is None else torch.device(device))
    try:
        yield
    finally:
        _DRAW_ON.reset(token)


def randn(g, *shape):
    if _blockwise(g, shape):
        return _blocks(g, shape, normal=True)
    return torch.randn(shape, generator=g, dtype=torch.float32, device=g.device)


def rand(g, *shape):
    if _blockwise(g, shape):
        return _blocks(g, shape, normal=False)
    return torch.rand(shape, generator=g, dtype=torch.float32, device=g.device)


def _blockwise(g, shape) -> bool:
    return g.device.type == "cpu" and math.prod(shape) >= BIG


def beside(big: torch.Tensor, *small):
    """``small`` on ``big``'s device: a large tensor may be drawn on the GPU while the small ones
    that scale or shift it stay where the case generator drew them (the same values as before)."""
    moved = tuple(t.to(big.device) if isinstance(t, torch.Tensor) else t for t in small)
    return moved[0] if len(moved) == 1 else moved


def draw_threads() -> int:
    """Threads that draw a large tensor's blocks: ``MHCTOOL_DRAW_THREADS`` where set (a pool's
    workers share the host's cores: each gets its share), else PyTorch's thread count, at most 32."""
    value = os.environ.get("MHCTOOL_DRAW_THREADS", "")
    return int(value) if value.isdigit() and int(value) > 0 else min(torch.get_num_threads(), 32)


def _blocks(g, shape, normal: bool) -> torch.Tensor:
    """A float32 tensor of ``shape`` of standard normal (``normal``) or uniform [0, 1) values
    from one seed drawn from ``g``: on the CPU a block of BLOCK values at a time on threads, each
    block from a generator seeded ``seed + k``; on a GPU in one launch (:mod:`mhctool.core.philox`)."""
    seed = int(torch.randint(0, 1 << 62, (1,), generator=g))
    device = _DRAW_ON.get() or torch.device("cpu")
    out = torch.empty(math.prod(shape), dtype=torch.float32, device=device)
    if device.type != "cpu":
        from mhctool.core import philox
        return philox.fill(out, seed, normal).view(*shape)

    def one(k: int) -> None:
        block, gb = out[k * BLOCK:(k + 1) * BLOCK], torch.Generator().manual_seed(seed + k)
        block.normal_(generator=gb) if normal else block.uniform_(generator=gb)

    blocks = -(-out.numel() // BLOCK)
    with concurrent.futures.ThreadPoolExecutor(max(1, min(blocks, draw_threads()))) as ex:
        list(ex.map(one, range(blocks)))  # the fills release the GIL
    return out.view(*shape)


def log_uniform(g, lo, hi, *shape):
    return 10.0 ** (lo + (hi - lo) * rand(g, *shape))


def upstream_grads(outputs: list[torch.Tensor], seed: int) -> list[torch.Tensor]:
    """Seeded upstream gradients, one per output, at the output's dtype and device, laid out in
    memory like the output (as the next layer's backward would hand them over): an output that is a
    view in another memory order (a library's layout, seen through the adapter's transpose) gets its
    gradient in that order, so the library's backward is not charged for a copy into its layout."""
    g = torch.Generator().manual_seed(seed + 0x5EED)
    out = []
    for o in outputs:  # a large one drawn on the output's device
        with drawing_on(o.device):
            out.append(torch.empty_like(o).copy_(randn(g, *o.shape)))
    return out
