"""The mHC pre-path from mhctool's cuTile kernels in one call (``mix_aggregate``): the mapping
(projection, RMS and compute_h), Sinkhorn on its logits, and the aggregation of x's streams by
H_pre.

One autograd function over the cuTile kernels of ``mapping.py``, ``sinkhorn.py`` and
``h_aggregate.py``, with the backward arranged as the Triton one is (``kernels/triton/
mix_aggregate.py``) so that x's gradient is written once: the aggregation's backward reads x and
the upstream gradient for ``grad_h_pre`` and writes nothing else, and the projection's backward
adds the aggregation's part of x's gradient (``h_pre[t, i] * grad_out[t, c]``) in the pass that
writes dx (``proj_rms._agg_half``). Composed through autograd, the aggregation's backward would
write its own dx and a third pass would add the two. Linked to the module's post-path
(``schedule.residual_link``), that pass adds the residual's other gradient too.
"""
from __future__ import annotations

import torch

from ..schedule import beside, linked, mapped
from . import h_aggregate as agg_
from . import mapping as map_
from .sinkhorn import sinkhorn_backward, sinkhorn_forward


class _MixAggregate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, alpha, h_bias, eps, iters, sinkhorn_eps, stabilize="rowmax", eps_mode="add",
                order="row_first"):
        if x.dim() != 4:
            raise ValueError(f"mix_aggregate takes x[s, b, n, C], got {tuple(x.shape)}")
        s, b, n, c = x.shape
        knobs = (iters, sinkhorn_eps, stabilize, eps_mode, order)
        # the mapping's results and h_res, or those its forward kept where this is its recompute
        (pre, post, logits), saved, h_res = mapped(
            lambda: map_.forward(x.reshape(s * b, n * c), weight, alpha, h_bias, eps),
            lambda lg: sinkhorn_forward(lg.reshape(s, b, n, n), *knobs))
        logits = logits.reshape(s, b, n, n)
        pre = pre.reshape(s, b, n)
        out = agg_.h_aggregate_forward(x, pre)
        ctx.save_for_backward(x, pre, logits, *saved)
        ctx.knobs = knobs
        ctx.link = linked()  # the residual's gradient from the module's post-path, added to dx
        return out, post.reshape(s, b, n), h_res

    @staticmethod
    def backward(ctx, g_out, g_post, g_res):
        x, pre, logits, *saved = ctx.saved_tensors
        s, b, n, c = x.shape
        t = s * b
        # Sinkhorn's backward (latency-bound, tens of us) beside the aggregation's (memory-bound)
        g_log, g_pre = beside(
            lambda: None if g_res is None else sinkhorn_backward(logits, g_res.contiguous(), *ctx.knobs),
            lambda: None if g_out is None else agg_.backward(x, pre, g_out, write_dx=False)[1], x.device)
        extra = None if ctx.link is None else ctx.link.take()
        agg = None if g_out is None else (pre.reshape(t, n), g_out.contiguous().reshape(t, c))
        fold = extra is not None and agg is not None  # the kernel adds it to the aggregation's term
        dx, dw, d_alpha, d_bias = map_.backward(
            saved, None if g_pre is None else g_pre.reshape(t, n), None if g_post is None else g_post.reshape(t, n),
            None if g_log is None else g_log.reshape(t, n, n), agg=agg,
            extra=extra.contiguous().reshape(t, n * c) if fold else None)
        dx = dx.reshape(x.shape)
        if extra is not None and not fold:  # no term to carry it: added as autograd would
            dx = dx + extra
        return dx, dw, d_alpha, d_bias, None, None, None, None, None, None


def mix_aggregate(x, weight, alpha, h_bias, eps: float = 1e-6, iters: int = 20, sinkhorn_eps: float = 1e-6,
                  stabilize: str = "rowmax", eps_mode: str = "add", order: str = "row_first"):
    """``(out[s, b, C], h_post[s, b, n], h_res[s, b, n, n])`` from ``x[s, b, n, C]`` (contiguous):
    the signature of mhctool's Triton ``mix_aggregate``."""
    return _MixAggregate.apply(x, weight, alpha, h_bias, eps, iters, sinkhorn_eps, stabilize, eps_mode, order)


def compile_checks() -> dict[str, bytes]:
    """The kernels this path launches beyond the families' own: the aggregation's backward without
    dx and the projection backward with the aggregation term (both of its paths)."""
    out = {k: v for k, v in agg_.compile_checks().items() if k.startswith("bwd") and k.endswith("False")}
    from . import proj_rms
    out.update({k: v for k, v in proj_rms.compile_checks().items() if "agg" in k})
    out["fwd-mapping"] = map_.compile_checks()["fwd-torch.bfloat16"]
    return out
