"""H-aggregate in cuTile: ``out[t, c] = sum_j h_pre[t, j] x[t, j, c]``, forward and backward.

Tiles: each stream j of x is read as a ``(BT, 1, BC)`` tile reshaped to ``(BT, BC)``, h_pre as
``(BT, NP)`` (fp32, streams padded to a power of two with zeros) split into ``(BT, 1)`` columns.
The forward program takes BT tokens and CB consecutive C chunks, adding the streams one slice at
a time in fp32. The backward is one program per token block walking C with x as ``(BT, NP, BC)``
tiles: it writes grad_x chunk by chunk and reduces grad_h_pre over C in fp32 on chip.

Tile shapes matter more than anything else here: on an H200 at 8192x4x4x7168 bf16 the forward
ran from 28% to 100% of copy bandwidth over 21 (BT, BC, CB) choices with the same code
(docs/perf-notes.md); (2, 512, 4) is the fastest seen.
"""
from __future__ import annotations

import cuda.tile as ct
import torch

from mhctool.core.poison import empty

from ..schedule import next_pow2
from ._common import array, cdiv, check_cuda, launch, require_contiguous, tile_ir

ConstInt = ct.Constant[int]
ZERO = ct.PaddingMode.ZERO
# tiles picked on an H200 at 8192x4x4x7168 bf16 (docs/perf-notes.md has the sweep)
BT, BC, CB = 2, 512, 4  # forward tile, C chunks per program
BT_BWD, BC_BWD = 8, 256


@ct.kernel
def _h_aggregate_fwd(x, h, out, N: ConstInt, NP: ConstInt, BT: ConstInt, BC: ConstInt, CB: ConstInt):
    i, cb = ct.bid(0), ct.bid(1)
    ht = ct.load(h, index=(i, 0), shape=(BT, NP), padding_mode=ZERO).astype(ct.float32)
    for k in range(CB):  # chunks past the end of C load zeros and store nothing
        c = cb * CB + k
        acc = ct.zeros((BT, BC), dtype=ct.float32)
        for j in ct.static_iter(range(N)):  # one stream at a time: no reduction across tile rows
            xj = ct.reshape(ct.load(x, index=(i, j, c), shape=(BT, 1, BC), padding_mode=ZERO), (BT, BC))
            acc = acc + xj.astype(ct.float32) * ct.extract(ht, (0, j), shape=(BT, 1))
        ct.store(out, index=(i, c), tile=acc.astype(out.dtype))


@ct.kernel
def _h_aggregate_bwd(x, h, g, dx, dh, NP: ConstInt, BT: ConstInt, BC: ConstInt, WRITE_DX: ct.Constant[bool]):
    """grad_h_pre, and with ``WRITE_DX`` grad_x (without, x and the gradient are read and nothing
    but grad_h_pre written: mix_aggregate's projection backward adds grad_x's term itself)."""
    i = ct.bid(0)
    ht = ct.reshape(ct.load(h, index=(i, 0), shape=(BT, NP), padding_mode=ZERO).astype(ct.float32), (BT, NP, 1))
    acc = ct.zeros((BT, NP), dtype=ct.float32)
    for c in range(ct.num_tiles(g, axis=1, shape=(BT, BC))):
        gt = ct.reshape(ct.load(g, index=(i, c), shape=(BT, BC), padding_mode=ZERO).astype(ct.float32), (BT, 1, BC))
        xt = ct.load(x, index=(i, 0, c), shape=(BT, NP, BC), padding_mode=ZERO).astype(ct.float32)
        if WRITE_DX:
            ct.store(dx, index=(i, 0, c), tile=(ht * gt).astype(dx.dtype))
        acc = acc + ct.sum(xt * gt, axis=2)
    ct.store(dh, index=(i, 0), tile=acc.astype(dh.dtype))


def _views(x: torch.Tensor):
    s, b, n, c = x.shape
    return x.view(s * b, n, c), s * b, n, c


def h_aggregate_forward(x, h_pre):
    """``out[s, b, C]`` (inputs checked here)."""
    check_cuda(x, h_pre)
    require_contiguous("x", x)
    if x.dim() != 4 or h_pre.shape != x.shape[:3]:
        raise ValueError(f"x must be [s, b, n, C] and h_pre [s, b, n]; got {tuple(x.shape)}, {tuple(h_pre.shape)}")
    h = h_pre.contiguous()
    x3, t, n, c = _views(x)
    out = empty((x.shape[0], x.shape[1], c), x.dtype, x.device)
    if t and c:
        launch(_h_aggregate_fwd, (cdiv(t, BT), cdiv(cdiv(c, BC), CB)),
               (x3, h.view(t, n), out.view(t, c), n, next_pow2(n), BT, BC, CB))
    return out


class _HAggregate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, h_pre):
        out = h_aggregate_forward(x, h_pre)
        ctx.save_for_backward(x, h_pre.contiguous())
        return out

    @staticmethod
    def backward(ctx, g):
        x, h = ctx.saved_tensors
        return backward(x, h, g)


def backward(x, h, g, write_dx: bool = True):
    """``(grad_x, grad_h_pre)`` of h_aggregate (h contiguous); without ``write_dx`` grad_x is None."""
    x3, t, n, c = _views(x)
    g = g.contiguous()
    dx = empty(x.shape, x.dtype, x.device) if write_dx else None
    dh = empty(h.shape, h.dtype, h.device)
    if t:
        launch(_h_aggregate_bwd, (cdiv(t, BT_BWD),),
               (x3, h.view(t, n), g.view(t, c), x3 if dx is None else dx.view(t, n, c), dh.view(t, n), next_pow2(n),
                BT_BWD, BC_BWD, write_dx))
    return dx, dh


def h_aggregate(x, h_pre):
    """``[s, b, n, C] x [s, b, n] -> [s, b, C]`` (h_pre fp32; its gradient accumulated in fp32)."""
    return _HAggregate.apply(x, h_pre)


def compile_checks() -> dict[str, bytes]:
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        for n in (4, 3):
            np_ = next_pow2(n)
            out[f"fwd-{dtype}-{n}"] = tile_ir(_h_aggregate_fwd, [array(dtype, 3), array(torch.float32, 2),
                                                                   array(dtype, 2), n, np_, BT, BC, CB])
            for write_dx in (True, False):
                out[f"bwd-{dtype}-{n}-{write_dx}"] = tile_ir(_h_aggregate_bwd, [array(dtype, 3), array(torch.float32, 2),
                                                                               array(dtype, 2), array(dtype, 3),
                                                                               array(torch.float32, 2), np_, BT_BWD,
                                                                               BC_BWD, write_dx])
    return out
