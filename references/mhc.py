"""float64 references for the mHC primitives (the numerics contract of DESIGN.md).

Every function here is plain PyTorch in whatever dtype it is given; the runner calls them on
float64 inputs and differentiates them with autograd. Nothing here is fused or clever: each line
is meant to be checked against the formula it implements.

Shapes: ``x`` is ``[s, b, n, C]`` (n residual streams of width C), mapping tensors are
``h_pre[s, b, n]``, ``h_post[s, b, n]``, ``h_res[s, b, n, n]``.

``trace``, where a function takes it, is called as ``trace(name, tensor)`` with each named
intermediate (``mhctool stability overflow`` records their magnitudes); it changes nothing.
"""
from __future__ import annotations

from typing import Callable

import torch

from . import dropout as _dropout

Trace = Callable[[str, torch.Tensor], None] | None

STABILIZE = ("rowmax", "none", "softmax", "colmax")
# rarer starts a hand-written kernel uses: the exponential clamped at ``clamp_at`` (no max subtraction)
STABILIZE_RARE = ("clamp",)
RMS_EPS = ("outside", "inside")
EPS_MODES = ("add", "clamp", "threshold", "threshold_zero")
DOMAINS = ("linear", "log")
# how a kernel computes its elementwise math: ieee, or fast (--use_fast_math: __expf, reciprocal-multiply);
# like ``domain``, it changes no float64 value, only the native baseline a kernel is compared with
MATHS = ("ieee", "fast")
ORDERS = ("row_first", "col_first")


def _normalize(p: torch.Tensor, dim: int, eps: float, eps_mode: str, trace: Trace = None) -> torch.Tensor:
    s = p.sum(dim=dim, keepdim=True)
    if eps_mode == "add":
        den = s + eps
    elif eps_mode == "clamp":
        # eps may be a tensor of several values along a leading axis (mhctool identify's grid)
        den = torch.maximum(s, eps) if torch.is_tensor(eps) else s.clamp(min=eps)
    elif eps_mode in ("threshold", "threshold_zero"):
        # eps as a threshold: a sum above it divides; a row or column at or below it is left as it
        # is (threshold) or set to zero (threshold_zero)
        above = s > eps
        den = torch.where(above, s, torch.ones_like(s))
        if eps_mode == "threshold_zero":
            if trace:
                trace("row_sum" if dim == -1 else "col_sum", s)
                trace("reciprocal", 1.0 / den)
            return torch.where(above, p / den, torch.zeros_like(p))
    else:
        raise ValueError(f"eps_mode must be one of {EPS_MODES}, got {eps_mode!r}")
    if trace:
        trace("row_sum" if dim == -1 else "col_sum", s)
        trace("reciprocal", 1.0 / den)  # what a reciprocal-multiply kernel holds
    return p / den


def floored(logits: torch.Tensor, floor: float) -> torch.Tensor:
    """Each logit raised to at least ``floor`` below its matrix's max (0: as it is)."""
    if not floor:
        return logits
    return torch.maximum(logits, logits.amax(dim=(-1, -2), keepdim=True) - floor)


def sinkhorn(
    logits: torch.Tensor,
    iters: int = 20,
    eps: float = 1e-6,
    *,
    stabilize: str = "rowmax",
    eps_mode: str = "add",
    order: str = "row_first",
    domain: str = "linear",
    clamp_at: float = 20.0,
    math: str = "ieee",
    floor: float = 0.0,
    tol: float = 0.0,
    exp_floor: float = 0.0,
    trace: Trace = None,
) -> torch.Tensor:
    """Sinkhorn-Knopp projection of ``exp(logits[..., n, n])`` towards a doubly stochastic matrix.

    ``math`` (``ieee`` or ``fast``), like ``domain``, changes nothing here: it picks the native
    baseline a kernel built with fast math is compared with.

    ``domain`` (``linear`` or ``log``) says how an implementation iterates; in exact arithmetic
    (and so in this float64 reference) both give the same matrix, so it changes nothing here: it
    picks the native baseline that a log-domain kernel is compared with.

    ``iters`` may be a tuple of increasing counts: the matrices after each, stacked along a new
    leading axis (one run to the largest count).

    ``stabilize`` picks the starting matrix:
      * ``rowmax``: ``exp(L - max_j L[i, j])`` (max subtraction, per row);
      * ``none``: ``exp(L)`` (overflows for large logits: the bug this knob exists to show);
      * ``colmax``: ``exp(L - max_i L[i, j])`` (max subtraction per column: a kernel that
        normalises columns first subtracts the max along that axis);
      * ``clamp``: ``exp(min(L, clamp_at))`` (no max subtraction; the exponential clamped, as a
        CUDA kernel writes ``__expf(fminf(x, 20.f))``: finite, but a row whose logits pass the
        bound loses their differences);
      * ``softmax``: ``softmax(L, -1) + eps``. The softmax *is* the first row normalisation, so
        with ``row_first`` the sequence is softmax, col, then ``iters - 1`` (row, col) pairs
        (DeepSeek's order); with ``col_first`` it is softmax then ``iters`` (col, row) pairs.

    ``floor`` (0: none): every logit more than ``floor`` below its matrix's max is raised to that
    level first, ``max(L, max(L) - floor)``, as a log-domain kernel that floors its log values
    after subtracting the matrix's max does (exp of what lies below is never taken).

    ``exp_floor`` (0: none): the starting matrix raised to at least this value, ``max(exp(.),
    exp_floor)``, as a kernel that guards its exponentials with an absolute floor does (a logit
    below ``log(exp_floor)`` after the stabilisation counts as that level).

    ``tol`` (0: none): a matrix stops iterating once every row and column sum is within ``tol``
    of one, checked after each (row, column) iteration, at most ``iters`` iterations: the early stop
    common Sinkhorn libraries offer (its count then depends on the data; the gradient is that of
    the iterations it ran).

    Each iteration normalises rows then columns (``row_first``) or columns then rows
    (``col_first``); a normalisation divides by ``sum + eps`` (``add``) or ``max(sum, eps)``
    (``clamp``), or by the sum where it is above eps, leaving a row or column at or below eps as
    it is (``threshold``) or zeroing it (``threshold_zero``).
    """
    if stabilize not in STABILIZE + STABILIZE_RARE:
        raise ValueError(f"stabilize must be one of {STABILIZE + STABILIZE_RARE}, got {stabilize!r}")
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    if domain not in DOMAINS:
        raise ValueError(f"domain must be one of {DOMAINS}, got {domain!r}")
    if math not in MATHS:
        raise ValueError(f"math must be one of {MATHS}, got {math!r}")
    row, col = -1, -2
    logits = floored(logits, floor)
    if stabilize == "rowmax":
        p = torch.exp(logits - logits.amax(dim=-1, keepdim=True))
    elif stabilize == "none":
        p = torch.exp(logits)
    elif stabilize == "colmax":
        p = torch.exp(logits - logits.amax(dim=-2, keepdim=True))
    elif stabilize == "clamp":
        p = torch.exp(logits.clamp(max=clamp_at))
    else:
        p = torch.softmax(logits, dim=-1) + eps
    if exp_floor:
        p = p.clamp(min=exp_floor)
    if trace:
        trace("exp", p)
    # several iteration counts at once (mhctool identify's grid): one run to the largest, the matrix
    # after each count stacked along a new leading axis, in the counts' order
    counts = tuple(iters) if isinstance(iters, (tuple, list)) else None
    if counts is not None and list(counts) != sorted(set(counts)):
        raise ValueError(f"iteration counts must be increasing, got {counts}")
    last = counts[-1] if counts else iters
    steps = [row, col] * last if order == "row_first" else [col, row] * last
    skip = 1 if stabilize == "softmax" and order == "row_first" else 0
    steps = steps[skip:]  # the softmax was the first row step
    snaps = []
    done = None  # with tol: the matrices that have stopped (their rows and columns within tol of one)
    for i, dim in enumerate(steps):
        q = _normalize(p, dim, eps, eps_mode, trace)
        p = q if done is None else torch.where(done, p, q)
        if tol and (i + 1 + skip) % 2 == 0:
            now = converged(p, tol)
            done = now if done is None else done | now
        if counts and (i + 1 + skip) % 2 == 0 and (i + 1 + skip) // 2 in counts:
            snaps.append(p)
    return torch.stack(snaps) if counts else p


def converged(p: torch.Tensor, tol: float) -> torch.Tensor:
    """Per matrix of ``p[..., n, n]`` (kept as ``[..., 1, 1]``): every row and column sum within
    ``tol`` of one."""
    off = torch.maximum((p.sum(-1) - 1).abs().amax(-1), (p.sum(-2) - 1).abs().amax(-1))
    return (off <= tol)[..., None, None]


def h_aggregate(x: torch.Tensor, h_pre: torch.Tensor, *, trace: Trace = None) -> torch.Tensor:
    """``out[s, b, C] = sum_j h_pre[s, b, j] * x[s, b, j, C]``."""
    if trace:
        trace("products", h_pre.unsqueeze(-1) * x)
    return torch.einsum("sbj,sbjc->sbc", h_pre, x)


def h_post_bda(
    h_res: torch.Tensor,
    x: torch.Tensor,
    h_post: torch.Tensor,
    y: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    transpose_res: bool = False,
    dropout: float = 0.0,
    dropout_seed: int = 0,
    dropout_offset: int = 0,
    trace: Trace = None,
) -> torch.Tensor:
    """``out[i] = sum_j H[i, j] x[j] + h_post[i] * (y + bias)``; ``H = h_res^T`` with ``transpose_res``.

    With ``dropout = p > 0`` the branch is dropped out over the n streams, as Megatron's
    bias-dropout-add drops ``H_post (y + bias)`` over ``n * C``: ``out[i] = sum_j H[i, j] x[j] +
    keep[i] / (1 - p) * h_post[i] * (y + bias)``, the mask drawn by the contract's counter-based
    generator from ``(dropout_seed, dropout_offset)`` (:mod:`mhctool.references.dropout`)."""
    h = h_res.transpose(-1, -2) if transpose_res else h_res
    mixed = torch.einsum("sbij,sbjc->sbic", h, x)
    branch = y if bias is None else y + bias
    post = h_post.unsqueeze(-1) * branch.unsqueeze(-2)
    post = _dropout.apply(post, dropout, dropout_seed, dropout_offset)
    if trace:
        trace("mix_products", h.unsqueeze(-1) * x.unsqueeze(-3))
        trace("mixed", mixed)
        trace("branch", branch)
        trace("post_products", post)
    return mixed + post


def proj_rms(x2d: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, rms_eps: str = "outside",
             trace: Trace = None):
    """``proj = x2d @ weight^T`` and ``r = 1 / (||x||_2 / sqrt(K) + eps)`` (``rms_eps="outside"``,
    Megatron's), or ``r = 1 / sqrt(||x||^2 / K + eps)`` (``"inside"``, RMSNorm's and TransformerEngine's)."""
    if rms_eps not in RMS_EPS:
        raise ValueError(f"rms_eps must be one of {RMS_EPS}, got {rms_eps!r}")
    k = x2d.shape[-1]
    proj = x2d @ weight.transpose(0, 1)
    sum_sq = (x2d * x2d).sum(dim=-1)
    rms = torch.sqrt(sum_sq / k)
    if trace:
        trace("squares", x2d * x2d)
        trace("sum_sq", sum_sq)
        trace("proj", proj)
        trace("rms", rms)
    if rms_eps == "inside":
        return proj, 1.0 / torch.sqrt(sum_sq / k + eps)
    return proj, 1.0 / (rms + eps)


def alpha_columns(alpha: torch.Tensor, n: int) -> torch.Tensor:
    """The per-column scale of ``h``: ``[a_pre]*n ++ [a_post]*n ++ [a_res]*n^2``."""
    return torch.cat([alpha[0].expand(n), alpha[1].expand(n), alpha[2].expand(n * n)])


def compute_h(
    proj: torch.Tensor,
    r: torch.Tensor,
    alpha: torch.Tensor,
    bias: torch.Tensor,
    n: int,
    *,
    compute_h_eps: float = 0.0,
    trace: Trace = None,
):
    """Mapping coefficients from the projection.

    ``alpha = [a_pre, a_post, a_res]``; ``h = r * proj * ([a_pre]*n ++ [a_post]*n ++ [a_res]*n^2) + bias``
    ordered ``[pre(n) | post(n) | res(n^2)]``. Returns ``H_pre = sigmoid(h_pre) + compute_h_eps``
    (0 in the contract; Megatron's later generation adds 1e-6), ``H_post = 2 sigmoid(h_post)`` and
    the Sinkhorn logits ``H_res_logits[..., i, j] = h[2n + i n + j]``.
    """
    h = r.unsqueeze(-1) * proj * alpha_columns(alpha, n) + bias
    if trace:
        trace("r_proj", r.unsqueeze(-1) * proj)
        trace("h", h)
    h_pre = torch.sigmoid(h[..., :n]) + compute_h_eps
    h_post = 2.0 * torch.sigmoid(h[..., n : 2 * n])
    logits = h[..., 2 * n :].reshape(*h.shape[:-1], n, n)
    return h_pre, h_post, logits


def mapping(x2d: torch.Tensor, weight: torch.Tensor, alpha: torch.Tensor, h_bias: torch.Tensor,
            eps: float = 1e-6, *, rms_eps: str = "outside", compute_h_eps: float = 0.0, trace: Trace = None):
    """``compute_h(proj_rms(x2d, weight, eps), alpha, h_bias)`` with n from ``weight``'s n^2 + 2n rows."""
    n = round((weight.shape[0] + 1) ** 0.5 - 1)
    proj, r = proj_rms(x2d, weight, eps, rms_eps=rms_eps, trace=trace)
    return compute_h(proj, r, alpha, h_bias, n, compute_h_eps=compute_h_eps, trace=trace)


def mapping_sinkhorn(x: torch.Tensor, weight: torch.Tensor, alpha: torch.Tensor, h_bias: torch.Tensor,
                     eps: float = 1e-6, iters: int = 20, sinkhorn_eps: float = 1e-6, *, rms_eps: str = "outside",
                     compute_h_eps: float = 0.0, stabilize: str = "rowmax", order: str = "row_first",
                     domain: str = "linear", eps_mode: str = "add", clamp_at: float = 20.0, math: str = "ieee",
                     floor: float = 0.0, trace: Trace = None):
    """The mapping from the flattened streams (``x[s, b, n, C]`` as ``[T, n*C]``), then Sinkhorn
    on the H_res logits: the three mixing matrices of a layer, ``(h_pre[s, b, n], h_post[s, b, n],
    h_res[s, b, n, n])`` (Liger-Kernel's ``liger_mhc_coeffs``)."""
    s, b, n, c = x.shape
    h_pre, h_post, logits = mapping(x.reshape(s * b, n * c), weight, alpha, h_bias, eps, rms_eps=rms_eps,
                                    compute_h_eps=compute_h_eps, trace=trace)
    h_res = sinkhorn(logits.reshape(s, b, n, n), iters, sinkhorn_eps, stabilize=stabilize, order=order,
                     domain=domain, eps_mode=eps_mode, clamp_at=clamp_at, math=math, floor=floor)
    return h_pre.reshape(s, b, n), h_post.reshape(s, b, n), h_res


def mix_aggregate(x: torch.Tensor, weight: torch.Tensor, alpha: torch.Tensor, h_bias: torch.Tensor,
                  eps: float = 1e-6, iters: int = 20, sinkhorn_eps: float = 1e-6, *, rms_eps: str = "outside",
                  compute_h_eps: float = 0.0, stabilize: str = "rowmax", order: str = "row_first",
                  domain: str = "linear", eps_mode: str = "add", clamp_at: float = 20.0, math: str = "ieee",
                  floor: float = 0.0, trace: Trace = None):
    """The whole pre-path of an mHC layer in one: :func:`mapping_sinkhorn`, then the aggregation
    of the streams with H_pre. Returns ``(out[s, b, C], h_post[s, b, n], h_res[s, b, n, n])``:
    TransformerEngine's ``mhc_generate_mix_and_aggregate``."""
    h_pre, h_post, h_res = mapping_sinkhorn(x, weight, alpha, h_bias, eps, iters, sinkhorn_eps, rms_eps=rms_eps,
                                            compute_h_eps=compute_h_eps, stabilize=stabilize, order=order,
                                            domain=domain, eps_mode=eps_mode, clamp_at=clamp_at, math=math,
                                            floor=floor, trace=trace)
    return h_aggregate(x, h_pre), h_post, h_res


def rms(x2d: torch.Tensor) -> torch.Tensor:
    """``||x||_2 / sqrt(K)`` per row: the fourth output of Megatron's later fused mapping kernel."""
    return torch.sqrt((x2d * x2d).sum(dim=-1) / x2d.shape[-1])


def expand(x: torch.Tensor, n: int) -> torch.Tensor:
    """``[s, b, C] -> [s, b, n, C]``: every stream starts as a copy of the input."""
    return x.unsqueeze(-2).expand(*x.shape[:-1], n, x.shape[-1]).clone()


def contract(x: torch.Tensor) -> torch.Tensor:
    """``[s, b, n, C] -> [s, b, C]``: the mean of the streams."""
    return x.mean(dim=-2)


def mhc_layer(
    x: torch.Tensor,
    weight: torch.Tensor,
    alpha: torch.Tensor,
    h_bias: torch.Tensor,
    layer_fn: Callable[[torch.Tensor], torch.Tensor],
    bias: torch.Tensor | None = None,
    *,
    rms_eps: float = 1e-6,
    sinkhorn_iters: int = 20,
    sinkhorn_eps: float = 1e-6,
    transpose_res: bool = False,
    **sinkhorn_knobs,
) -> torch.Tensor:
    """One mHC layer: ``x' = h_post_bda(H_res, x, H_post, F(h_aggregate(x, H_pre)), bias)``."""
    s, b, n, c = x.shape
    proj, r = proj_rms(x.reshape(s * b, n * c), weight, rms_eps)
    h_pre, h_post, logits = compute_h(proj, r, alpha, h_bias, n)
    h_res = sinkhorn(logits, sinkhorn_iters, sinkhorn_eps, **sinkhorn_knobs)
    shape3 = (s, b, n)
    layer_out = layer_fn(h_aggregate(x, h_pre.reshape(shape3)))
    return h_post_bda(
        h_res.reshape(s, b, n, n), x, h_post.reshape(shape3), layer_out, bias,
        transpose_res=transpose_res,
    )
