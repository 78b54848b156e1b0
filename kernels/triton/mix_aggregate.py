"""The mHC pre-path from mhctool's Triton kernels: mapping, then Sinkhorn (``mapping_sinkhorn``),
then aggregation (``mix_aggregate``).

``mapping_sinkhorn`` composes the mapping and Sinkhorn kernels through autograd. ``mix_aggregate``
is one autograd function over the same kernels, so that its backward writes x's gradient once:
the aggregation's backward reads x and the upstream gradient for ``grad_h_pre`` and writes nothing
else, and the projection's backward computes the aggregation's part of x's gradient (``h_pre[t, i]
* grad_out[t, c]``) in the pass that writes dx (``agg``). Composed by autograd, the aggregation's
backward wrote its part of dx and a third pass added the two (about 13 GB against 7.5 at the
paper shape). Linked to the module's post-path (``schedule.residual_link``), that pass adds the
residual's other gradient too, which autograd would add in a pass of its own.
"""
from __future__ import annotations

import torch

from ..schedule import beside, linked, mapped
from .h_aggregate import h_aggregate_backward, h_aggregate_forward
from .mapping import mapping, mapping_backward, mapping_forward
from .sinkhorn import sinkhorn, sinkhorn_backward, sinkhorn_forward


def mapping_sinkhorn(x, weight, alpha, h_bias, eps: float = 1e-6, iters: int = 20, sinkhorn_eps: float = 1e-6,
                     stabilize: str = "rowmax", eps_mode: str = "add", order: str = "row_first"):
    """``(h_pre[s, b, n], h_post[s, b, n], h_res[s, b, n, n])`` from ``x[s, b, n, C]`` (contiguous);
    Sinkhorn's start, eps mode and order as its kernel takes them."""
    s, b, n, c = x.shape
    h_pre, h_post, logits = mapping(x.reshape(s * b, n * c), weight, alpha, h_bias, eps)
    h_res = sinkhorn(logits.reshape(s, b, n, n), iters, sinkhorn_eps, stabilize, eps_mode, order)
    return h_pre.reshape(s, b, n), h_post.reshape(s, b, n), h_res


class MixAggregateFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, alpha, h_bias, eps, iters, sinkhorn_eps, stabilize="rowmax", eps_mode="add",
                order="row_first"):
        s, b, n, c = x.shape
        x2d = x.reshape(s * b, n * c)
        knobs = (iters, sinkhorn_eps, stabilize, eps_mode, order)
        # the mapping's results and h_res, or those its forward kept where this is its recompute
        (pre, post, logits), saved, h_res = mapped(lambda: mapping_forward(x2d, weight, alpha, h_bias, eps),
                                                   lambda lg: sinkhorn_forward(lg.reshape(s, b, n, n), *knobs))
        logits = logits.reshape(s, b, n, n)
        pre = pre.reshape(s, b, n)
        out = h_aggregate_forward(x, pre)
        ctx.save_for_backward(x, weight, alpha, h_bias, pre, logits, *saved)
        ctx.knobs = knobs
        ctx.link = linked()  # the residual's gradient from the module's post-path, added to dx
        return out, post.reshape(s, b, n), h_res

    @staticmethod
    def backward(ctx, g_out, g_post, g_res):
        x, weight, alpha, h_bias, pre, logits, *saved = ctx.saved_tensors
        s, b, n, c = x.shape
        # Sinkhorn's backward (latency-bound, tens of us) beside the aggregation's (memory-bound)
        g_log, g_pre = beside(
            lambda: None if g_res is None else sinkhorn_backward(logits, g_res.contiguous(), *ctx.knobs),
            lambda: None if g_out is None else h_aggregate_backward(x, pre, g_out, write_dx=False)[1], x.device)
        extra = None if ctx.link is None else ctx.link.take()
        dx, dw, d_alpha, d_bias = mapping_backward(
            x.reshape(s * b, n * c), weight, alpha, h_bias, saved,
            (None if g_pre is None else g_pre.reshape(s * b, n), None if g_post is None else g_post.reshape(s * b, n),
             None if g_log is None else g_log.reshape(s * b, n, n)),
            agg=None if g_out is None else (pre.reshape(s * b, n), g_out.reshape(s * b, c)),
            extra=None if extra is None else extra.reshape(s * b, n * c))
        return dx.reshape(x.shape), dw, d_alpha, d_bias, None, None, None, None, None, None


def mix_aggregate(x, weight, alpha, h_bias, eps: float = 1e-6, iters: int = 20, sinkhorn_eps: float = 1e-6,
                  stabilize: str = "rowmax", eps_mode: str = "add", order: str = "row_first"):
    """``(out[s, b, C], h_post[s, b, n], h_res[s, b, n, n])`` from ``x[s, b, n, C]`` (contiguous);
    Sinkhorn's start, eps mode and order as its kernel takes them (PR 3828's native path: the row
    max subtracted, the sums clamped at eps)."""
    return MixAggregateFunction.apply(x, weight, alpha, h_bias, eps, iters, sinkhorn_eps, stabilize, eps_mode, order)
