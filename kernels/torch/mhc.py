"""Native PyTorch mHC primitives, written the way a PyTorch user would write them.

They compute at the input dtype (the mapping tensors ``h_pre``, ``h_post``, ``h_res`` are cast
to the activation dtype), except ``proj_rms``, whose mapping path is fp32 whatever the activation
dtype (DESIGN.md). These are the baseline of the verdict rule: a fused kernel may be at most
``kappa`` times less accurate than these at the same dtype.
"""
from __future__ import annotations

import math
import math as _math  # the Sinkhorn's knob named math shadows the module in it

import torch

from mhctool.references import dropout as _dropout
from mhctool.references.mhc import converged as _converged  # the early stop's test, the contract's


_LOG2E = 1.4426950408889634


def _fast_exp(x):
    """``__expf`` as nvcc's ``--use_fast_math`` computes it: 2 to the power of ``x * log2(e)``, the
    product rounded to ``x``'s format, which costs about ``|x|`` units of the last place at large
    ``|x|``. ``ex2.approx`` itself is nearly IEEE's ``expf`` (0.54 against 0.47 ulp rms on [-1, 1],
    measured on an H200 by dev/fast_math_probe.py), so the power is computed exactly here."""
    return torch.exp2(x * _LOG2E)


def sinkhorn(logits, iters: int = 20, eps: float = 1e-6, stabilize: str = "rowmax",
             eps_mode: str = "add", order: str = "row_first", domain: str = "linear", clamp_at: float = 20.0,
             math: str = "ieee", floor: float = 0.0, tol: float = 0.0, exp_floor: float = 0.0):
    if floor:  # a floor on the logits, below the matrix's max
        logits = torch.maximum(logits, logits.amax(dim=(-1, -2), keepdim=True) - floor)
    if domain == "log":
        if exp_floor:  # exp(L) >= exp_floor: L >= log(exp_floor)
            logits = logits.clamp(min=_math.log(exp_floor))
        return _sinkhorn_log(logits, iters, order, tol)
    # ``math`` is the knob's name (math=fast): in this function it shadows the module, which it does not use
    fast = math == "fast"  # a kernel built with fast math: __expf and a reciprocal-multiply per division
    exp = _fast_exp if fast else torch.exp
    if stabilize == "rowmax":
        p = exp(logits - logits.max(dim=-1, keepdim=True).values)
    elif stabilize == "none":
        p = exp(logits)
    elif stabilize == "colmax":
        p = exp(logits - logits.max(dim=-2, keepdim=True).values)
    elif stabilize == "softmax":
        p = logits.softmax(dim=-1) + eps
    elif stabilize == "clamp":  # a hand-written kernel's __expf(fminf(x, bound))
        p = exp(logits.clamp(max=clamp_at))
    else:
        raise ValueError(f"unknown stabilize {stabilize!r}")
    if exp_floor:  # an absolute floor on the exponentials: max(exp(x), exp_floor)
        p = p.clamp(min=exp_floor)

    def div(p, d):
        return p * torch.reciprocal(d) if fast else p / d

    def norm(p, dim):
        s = p.sum(dim=dim, keepdim=True)
        if eps_mode == "add":
            return div(p, s + eps)
        if eps_mode == "clamp":
            return div(p, s.clamp_min(eps))
        above = s > eps  # threshold: at or below eps kept (threshold) or zeroed (threshold_zero)
        q = div(p, torch.where(above, s, torch.ones_like(s)))
        return q if eps_mode == "threshold" else torch.where(above, q, torch.zeros_like(q))

    first, second = (-1, -2) if order == "row_first" else (-2, -1)
    done = None  # with tol: the matrices that have stopped
    for it in range(iters):
        q = p
        if not (it == 0 and stabilize == "softmax" and first == -1):
            q = norm(q, first)
        q = norm(q, second)
        p = q if done is None else torch.where(done, p, q)
        if tol:
            done = _converged(p, tol) if done is None else done | _converged(p, tol)
    return p


def _sinkhorn_log(logits, iters: int, order: str, tol: float = 0.0):
    """Log-domain Sinkhorn (no eps; ``stabilize`` and ``eps_mode`` have no meaning there): row and
    column potentials ``f``, ``g`` updated by logsumexp, ``exp(L + f + g)`` at the end, at the
    input dtype, the way TransformerEngine's kernel computes it."""
    f = torch.zeros_like(logits[..., :, 0])
    g = torch.zeros_like(logits[..., 0, :])

    def rows(f, g):
        return -torch.logsumexp(logits + g.unsqueeze(-2), dim=-1), g

    def cols(f, g):
        return f, -torch.logsumexp(logits + f.unsqueeze(-1), dim=-2)

    steps = (rows, cols) if order == "row_first" else (cols, rows)
    done = None  # with tol: the matrices that have stopped (their potentials held)
    for _ in range(iters):
        f1, g1 = f, g
        for step in steps:
            f1, g1 = step(f1, g1)
        if done is None:
            f, g = f1, g1
        else:
            f, g = torch.where(done[..., 0], f, f1), torch.where(done[..., 0], g, g1)
        if tol:
            now = _converged(torch.exp(logits + f.unsqueeze(-1) + g.unsqueeze(-2)), tol)
            done = now if done is None else done | now
    return torch.exp(logits + f.unsqueeze(-1) + g.unsqueeze(-2))


def h_aggregate(x, h_pre, matmul_precision: str = "ieee"):
    """``matmul_precision`` other than ``ieee`` (:data:`PRECISIONS`): both operands rounded as such
    a kernel's products take them (TF32 tensor cores, as TransformerEngine's multiply by default),
    then summed at the input dtype."""
    if matmul_precision != "ieee":
        x, h_pre = _operands_at(matmul_precision, x, h_pre)
    return torch.einsum("sbnc,sbn->sbc", x, h_pre.to(x.dtype))


def h_post_bda(h_res, x, h_post, y, bias=None, transpose_res: bool = False, matmul_precision: str = "ieee",
               dropout: float = 0.0, dropout_seed: int = 0, dropout_offset: int = 0):
    if matmul_precision != "ieee":
        x, h_res = _operands_at(matmul_precision, x, h_res)
    h = h_res.to(x.dtype)
    if transpose_res:
        h = h.transpose(-1, -2)
    branch = y if bias is None else y + bias
    post = h_post.to(x.dtype).unsqueeze(-1) * branch.unsqueeze(-2)
    # the contract's mask (integer arithmetic: the same bits at every dtype), scaled as torch's dropout
    post = _dropout.apply(post, dropout, dropout_seed, dropout_offset)
    return torch.matmul(h, x) + post


# the precisions a kernel's matrix products may compute at (DESIGN.md: a convention, declared or
# fitted): ``ieee`` full fp32; ``tf32`` operands rounded to TF32 (10 mantissa bits) to nearest
# even, as cuBLAS and PyTorch's ``allow_tf32`` do; ``tf32_trunc`` operands truncated to TF32, as
# the tensor cores take fp32 operands under Triton's ``tl.dot`` default (``input_precision="tf32"``,
# measured by dev/tf32_rounding.py); ``bf16`` operands rounded to bf16 (a kernel that casts fp32
# tiles to bf16 before its products). Sums stay fp32 in every one.
PRECISIONS = ("ieee", "tf32", "tf32_trunc", "bf16")


def round_operand(t: torch.Tensor, precision: str) -> torch.Tensor:
    """An fp32 operand as a product at ``precision`` takes it (fp32 out)."""
    if precision == "tf32":
        return round_to_tf32(t)
    if precision == "tf32_trunc":
        return truncate_to_tf32(t)
    if precision == "bf16":
        return t.float().to(torch.bfloat16).float()
    if precision == "ieee":
        return t.float()
    raise ValueError(f"matmul precision must be one of {PRECISIONS}, got {precision!r}")


class _Rounded(torch.autograd.Function):
    """An fp32 operand rounded at a precision in the forward, its gradient rounded the same way in
    the backward: the products such a kernel computes, forward and backward, emulated."""

    @staticmethod
    def forward(ctx, t, precision: str):
        ctx.precision = precision
        return round_operand(t, precision)

    @staticmethod
    def backward(ctx, g):
        return (round_operand(g, ctx.precision) if g.dtype == torch.float32 else g), None


def _operands_at(precision: str, *ts):
    """fp32 operands rounded at ``precision``; lower-precision ones are representable already
    (bf16 and fp16 values are TF32 values; an fp16 one rounded to bf16 is not, and stays fp16)."""
    return tuple(_Rounded.apply(t, precision) if t.dtype == torch.float32 else t for t in ts)


def _ieee_mm(a, b):
    """``a @ b`` in full fp32 on every device (cuBLAS may otherwise pick TF32)."""
    if not a.is_cuda:
        return a @ b
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        return a @ b
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


class _MatmulNT(torch.autograd.Function):
    """``a @ b^T`` in fp32, forward *and* backward at one precision (:data:`PRECISIONS`), whatever
    the global ``allow_tf32`` flags: every product's operands rounded as such a kernel takes them,
    the gradient too; sums in fp32. Emulated the same way on every device, so that a CPU run and a
    GPU run judge against the same baseline. (Setting ``allow_tf32`` around the forward alone left
    PyTorch's backward at IEEE: a TF32 kernel's gradients were judged against an IEEE baseline and
    failed at TF32's error, its design.)"""

    @staticmethod
    def forward(ctx, a, b, precision: str):
        if precision != "ieee":
            a, b = round_operand(a, precision), round_operand(b, precision)
        ctx.precision = precision
        ctx.save_for_backward(a, b)
        return _ieee_mm(a, b.t())

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        if ctx.precision != "ieee":
            g = round_operand(g, ctx.precision)
        return _ieee_mm(g, b), _ieee_mm(g.t(), a), None


def truncate_to_tf32(t: torch.Tensor) -> torch.Tensor:
    """fp32 values with their 13 low mantissa bits dropped (toward zero): the TF32 operand a
    tensor core takes from an fp32 register under Triton's ``tl.dot`` default."""
    bits = t.float().contiguous().view(torch.int32)
    finite = torch.isfinite(t.float())
    return torch.where(finite, (bits & ~0x1FFF).view(torch.float32), t.float())


def round_to_tf32(t: torch.Tensor) -> torch.Tensor:
    """Round fp32 values to TF32 (10 explicit mantissa bits, round to nearest even)."""
    bits = t.float().contiguous().view(torch.int32)
    lsb = (bits >> 13) & 1
    rounded = (bits + 0xFFF + lsb) & ~0x1FFF
    finite = torch.isfinite(t.float())
    return torch.where(finite, rounded.view(torch.float32), t.float())


def proj_rms(x2d, weight, eps: float = 1e-6, matmul_precision: str = "ieee", rms_eps: str = "outside"):
    """fp32 mapping path: ``proj = x W^T`` and ``r = 1 / (rms(x) + eps)``.

    ``matmul_precision="tf32"`` gives the products at TF32, the precision the mHC paper specifies,
    forward and backward, emulated by rounding every operand to TF32 (:class:`_MatmulNT`); the
    other :data:`PRECISIONS` likewise.
    """
    xf, wf = x2d.float(), weight.float()
    proj = _MatmulNT.apply(xf, wf, matmul_precision)
    if rms_eps == "inside":  # RMSNorm's placement: 1 / sqrt(mean(x^2) + eps)
        r = torch.rsqrt(xf.pow(2).mean(dim=-1) + eps)
    else:
        r = 1.0 / (xf.norm(dim=-1) / math.sqrt(xf.shape[-1]) + eps)
    return proj, r


def compute_h(proj, r, alpha, bias, n: int, compute_h_eps: float = 0.0):
    """``H_pre, H_post, H_res_logits`` from ``proj``, ``r`` (fp32)."""
    scale = torch.cat([alpha[0:1].expand(n), alpha[1:2].expand(n), alpha[2:3].expand(n * n)])
    h = proj * r[:, None] * scale + bias
    h_pre = h[:, :n].sigmoid() + compute_h_eps if compute_h_eps else h[:, :n].sigmoid()
    return h_pre, 2 * h[:, n:2 * n].sigmoid(), h[:, 2 * n:].unflatten(-1, (n, n))


def mapping(x2d, weight, alpha, h_bias, eps: float = 1e-6, matmul_precision: str = "ieee",
            rms_eps: str = "outside", compute_h_eps: float = 0.0):
    """The mapping path ``proj_rms`` then ``compute_h``: ``(H_pre, H_post, H_res_logits, rms)``,
    fp32; ``rms = ||x|| / sqrt(K)`` is the optional fourth output (Megatron's later generation
    returns it)."""
    n = int(round((weight.shape[0] + 1) ** 0.5 - 1))
    proj, r = proj_rms(x2d, weight, eps, matmul_precision, rms_eps)
    xf = x2d.float()
    return (*compute_h(proj, r, alpha.float(), h_bias.float(), n, compute_h_eps),
            xf.norm(dim=-1) / math.sqrt(xf.shape[-1]))


def mapping_sinkhorn(x, weight, alpha, h_bias, eps: float = 1e-6, iters: int = 20, sinkhorn_eps: float = 1e-6,
                     matmul_precision: str = "ieee", rms_eps: str = "outside", compute_h_eps: float = 0.0,
                     stabilize: str = "rowmax", order: str = "row_first", domain: str = "linear",
                     eps_mode: str = "add", clamp_at: float = 20.0, math: str = "ieee", floor: float = 0.0):
    """The mixing matrices composed of the native pieces: mapping, then Sinkhorn (with every one
    of Sinkhorn's knobs)."""
    s, b, n, c = x.shape
    h_pre, h_post, logits, _ = mapping(x.reshape(s * b, n * c), weight, alpha, h_bias, eps, matmul_precision,
                                       rms_eps, compute_h_eps)
    h_res = sinkhorn(logits.reshape(s, b, n, n), iters, sinkhorn_eps, stabilize, eps_mode, order, domain, clamp_at,
                     math, floor)
    return h_pre.reshape(s, b, n), h_post.reshape(s, b, n), h_res


def mix_aggregate(x, weight, alpha, h_bias, eps: float = 1e-6, iters: int = 20, sinkhorn_eps: float = 1e-6,
                  matmul_precision: str = "ieee", rms_eps: str = "outside", compute_h_eps: float = 0.0,
                  stabilize: str = "rowmax", order: str = "row_first", domain: str = "linear",
                  eps_mode: str = "add", clamp_at: float = 20.0, math: str = "ieee", floor: float = 0.0):
    """The pre-path composed of the native pieces: mapping, Sinkhorn, aggregation."""
    h_pre, h_post, h_res = mapping_sinkhorn(x, weight, alpha, h_bias, eps, iters, sinkhorn_eps, matmul_precision,
                                            rms_eps, compute_h_eps, stabilize, order, domain, eps_mode, clamp_at,
                                            math, floor)
    return h_aggregate(x, h_pre, matmul_precision), h_post, h_res
