"""mHC code as strangers write it (issue 60's table): plain PyTorch, fp32, each a form that
public code takes. mhctool must call the overflow a defect whatever is declared, find the knobs a
kernel fixes for itself, claim nothing its outputs do not show, and say in one sentence what it
cannot call."""
import torch

from mhctool.kernels.torch import mhc as native


def sinkhorn_raw_exp(logits, iters=20):
    """No max subtraction, rows first, no eps: every output NaN once a logit passes about 88."""
    p = torch.exp(logits)
    for _ in range(iters):
        p = p / p.sum(-1, keepdim=True)
        p = p / p.sum(-2, keepdim=True)
    return p


def _rowmax_iterations(logits, iters, eps):
    p = torch.exp(logits - logits.amax(-1, keepdim=True))
    for _ in range(iters):
        p = p / (p.sum(-1, keepdim=True) + eps)
        p = p / (p.sum(-2, keepdim=True) + eps)
    return p


def sinkhorn_fixed_knobs(logits):
    """Takes neither an iteration count nor an eps: 10 iterations and eps 1e-9 inside."""
    return _rowmax_iterations(logits, 10, 1e-9)


def sinkhorn_fixed_eps(logits, iters=20):
    """Takes its iteration count; eps 1e-9 fixed."""
    return _rowmax_iterations(logits, iters, 1e-9)


def sinkhorn_global_max(logits, iters=20, eps=1e-6):
    """Subtracts the whole matrix's max, not each row's: tiny rows underflow to eps's mercy."""
    p = torch.exp(logits - logits.amax(dim=(-1, -2), keepdim=True))
    for _ in range(iters):
        p = p / (p.sum(-1, keepdim=True) + eps)
        p = p / (p.sum(-2, keepdim=True) + eps)
    return p


def sinkhorn_col_clamp(logits, iters=20):
    """Columns first, each sum clamped at 1e-6 (never active after a column max subtraction)."""
    p = torch.exp(logits - logits.amax(-2, keepdim=True))
    for _ in range(iters):
        p = p / p.sum(-2, keepdim=True).clamp_min(1e-6)
        p = p / p.sum(-1, keepdim=True).clamp_min(1e-6)
    return p


def h_aggregate_bmm(x, h_pre):
    """One batched product: torch.bmm takes its operands in one dtype."""
    s, b, n, c = x.shape
    return torch.bmm(h_pre.reshape(s * b, 1, n), x.reshape(s * b, n, c)).reshape(s, b, c)


def sinkhorn_wrong_signature(logits, temperature, iters):
    """Takes two required parameters the family does not pass."""
    return torch.softmax(logits / temperature, -1)


def sinkhorn_two_outputs(logits, iters=20, eps=1e-6):
    """Returns the matrix and its log: one output more than the family's."""
    p = _rowmax_iterations(logits, iters, eps)
    return p, p.log()


def h_aggregate_streams_reversed(x, h_pre):
    """Correct, in another order: the streams summed last to first in fp32, rounded once to x's
    dtype (its error is the dtype's rounding, as the native one's)."""
    xf, hf = x.float(), h_pre.float()
    out = xf[..., -1, :] * hf[..., -1:]
    for j in range(x.shape[-2] - 2, -1, -1):
        out = out + xf[..., j, :] * hf[..., j:j + 1]
    return out.to(x.dtype)


def sinkhorn_clamped_exp(logits, iters=20, eps=1e-6):
    """No max subtraction: the exponential of the logits clamped at 20 (``__expf(fminf(x, 20))``),
    mhctool's ``stabilize=clamp clamp_at=20``; its backward is autograd's."""
    p = logits.clamp(max=20.0).exp()
    for _ in range(iters):
        p = p / (p.sum(-1, keepdim=True) + eps)
        p = p / (p.sum(-2, keepdim=True) + eps)
    return p


def sinkhorn_soft_clamped_exp(logits, iters=20, eps=1e-6):
    """The exponential of ``20 tanh(x / 20)``: a smooth clamp, no convention of mhctool's (nor a
    clamp at any bound) computes it; finite everywhere, uniform where the logits are large.
    Its backward is autograd's, the derivative of that forward."""
    p = (20.0 * torch.tanh(logits / 20.0)).exp()
    for _ in range(iters):
        p = p / (p.sum(-1, keepdim=True) + eps)
        p = p / (p.sum(-2, keepdim=True) + eps)
    return p


class _RowsOnlyWrongBackward(torch.autograd.Function):
    """A row softmax with a backward that forgets its second term: ``g * p``."""

    @staticmethod
    def forward(ctx, logits, iters, eps):
        out = torch.softmax(logits, dim=-1)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, g):
        (out,) = ctx.saved_tensors
        return g * out, None, None


def sinkhorn_rows_only_wrong_backward(logits, iters=20, eps=1e-6):
    """``sinkhorn_rows_only``'s forward, a backward that is not its derivative."""
    return _RowsOnlyWrongBackward.apply(logits, iters, eps)


def h_post_bda_without_bias(h_res, x, h_post, y):
    """H_res x + h_post y, with no bias parameter at all (a layer without a bias): correct where
    the case has no bias."""
    mixed = torch.einsum("sbij,sbjc->sbic", h_res.float(), x.float())
    return (mixed + h_post.float().unsqueeze(-1) * y.float().unsqueeze(-2)).to(x.dtype)


def sinkhorn_rows_only(logits, iters=20, eps=1e-6):
    """A softmax over each row and nothing more: the rows sum to one, the columns do not. No
    iteration count, order or eps of Sinkhorn computes it."""
    return torch.softmax(logits, dim=-1)


class _AggregateAlignedBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, h_pre):
        ctx.save_for_backward(x, h_pre)
        return torch.einsum("sbj,sbjc->sbc", h_pre, x)

    @staticmethod
    def backward(ctx, g):
        x, h_pre = ctx.saved_tensors
        if x.shape[-1] % 4:
            raise RuntimeError("misaligned address")  # as a float4 load without an alignment check
        return h_pre.unsqueeze(-1) * g.unsqueeze(-2), (x * g.unsqueeze(-2)).sum(-1)


def h_aggregate_backward_needs_c4(x, h_pre):
    """Correct, but its backward fails unless C % 4 == 0 (a vectorised load that assumes it)."""
    return _AggregateAlignedBackward.apply(x, h_pre)


def sinkhorn_eps_threshold(logits, iters=20, eps=1e-6):
    """Max subtraction, then rows and columns divided by their sums where a sum is above eps; a row
    or column whose sum is at or below eps is left as it is (eps as a threshold, not an addend)."""
    p = torch.exp(logits - logits.amax(-1, keepdim=True))
    for _ in range(iters):
        for dim in (-1, -2):
            s = p.sum(dim, keepdim=True)
            p = p / torch.where(s > eps, s, torch.ones_like(s))
    return p


def sinkhorn_fast_math(logits, iters=20, eps=1e-6):
    """A hand-written CUDA Sinkhorn built with nvcc's --use_fast_math: ``__expf(fminf(x, 20))`` (2 to
    the power of ``x * log2(e)``, the product rounded in fp32) without max subtraction, and each
    division a multiply by the reciprocal. mhctool's ``stabilize=clamp math=fast``."""
    p = torch.exp2(torch.clamp(logits, max=20.0) * 1.4426950408889634)
    for _ in range(iters):
        p = p * torch.reciprocal(p.sum(-1, keepdim=True) + eps)
        p = p * torch.reciprocal(p.sum(-2, keepdim=True) + eps)
    return p


def sinkhorn_returns_none(logits, iters=20, eps=1e-6):
    """Runs, and returns nothing: what the kernel did, a failed row (never mhctool's bad input)."""
    return None


def sinkhorn_returns_a_list(logits, iters=20, eps=1e-6):
    """Runs, and returns its output in a list: not the contract's form (a tensor, or a tuple)."""
    return [native.sinkhorn(logits, iters, eps)]


def h_aggregate_in_fp32(x, h_pre):
    """The right sums, returned in fp32 whatever the activations' dtype (bf16 inputs, fp32 out)."""
    return native.h_aggregate(x.float(), h_pre.float())


def h_post_bda_refuses_bias(h_res, x, h_post, y, bias=None):
    """A bias parameter its library does not support: given a bias, it raises."""
    if bias is not None:
        raise NotImplementedError("bias is not supported")
    return native.h_post_bda(h_res, x, h_post, y)
