"""Implementations with real defects, each of which parity must flag."""
import torch

from mhctool.kernels.torch import mhc as native


def sinkhorn_eps_1e8(logits, iters=20, eps=1e-6):
    """Uses eps=1e-8 whatever it is asked for (the silent eps change)."""
    return native.sinkhorn(logits, iters, 1e-8)


def sinkhorn_one_iteration_short(logits, iters=20, eps=1e-6):
    """Runs one Sinkhorn iteration fewer than it is asked (a loop bound off by one)."""
    return native.sinkhorn(logits, iters - 1, eps)


def sinkhorn_col_first(logits, iters=20, eps=1e-6):
    """Normalises columns before rows."""
    return native.sinkhorn(logits, iters, eps, order="col_first")


def sinkhorn_no_max(logits, iters=20, eps=1e-6):
    """Skips the max subtraction (the bare-exp fallback)."""
    return native.sinkhorn(logits, iters, eps, stabilize="none")


def proj_rms_eps_in_sqrt(x2d, weight, eps=1e-6):
    """``1 / sqrt(mean(x^2) + eps)`` instead of ``1 / (sqrt(mean(x^2)) + eps)``."""
    xf = x2d.float()
    return xf @ weight.float().t(), torch.rsqrt((xf * xf).mean(-1) + eps)


def h_post_bda_transposed(h_res, x, h_post, y, bias=None):
    """Mixes the streams with H^T when H is asked for."""
    return native.h_post_bda(h_res.transpose(-1, -2), x, h_post, y, bias)


class _BdaBf16BiasGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_res, x, h_post, y, bias):
        ctx.save_for_backward(h_res, x, h_post, y, bias)
        return native.h_post_bda(h_res, x, h_post, y, bias)

    @staticmethod
    def backward(ctx, g):
        h_res, x, h_post, y, bias = ctx.saved_tensors
        gf = g.float()
        grad_y = torch.einsum("sbic,sbi->sbc", gf, h_post.float())
        grad_h_post = torch.einsum("sbic,sbc->sbi", gf, (y + bias).float())
        grad_h_res = torch.einsum("sbic,sbjc->sbij", gf, x.float())
        grad_x = torch.einsum("sbij,sbic->sbjc", h_res.float(), gf).to(x.dtype)
        # the defect: the bias gradient is a running sum over tokens kept in bf16
        rows = grad_y.reshape(-1, grad_y.shape[-1]).to(torch.bfloat16)
        acc = torch.zeros(rows.shape[-1], dtype=torch.bfloat16, device=g.device)
        for t in range(rows.shape[0]):
            acc = acc + rows[t]
        return grad_h_res, grad_x, grad_h_post, grad_y.to(y.dtype), acc.to(bias.dtype)


def h_post_bda_bf16_bias_grad(h_res, x, h_post, y, bias=None):
    """Forward right; backward accumulates the bias gradient over tokens in bf16."""
    if bias is None:
        return native.h_post_bda(h_res, x, h_post, y, None)
    return _BdaBf16BiasGrad.apply(h_res, x, h_post, y, bias)


def sinkhorn_no_backward(logits, iters=20, eps=1e-6):
    """Correct forward, computed without autograd: backward rows must say unsupported."""
    with torch.no_grad():
        return native.sinkhorn(logits, iters, eps)


class _UpstreamAsGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, iters, eps):
        return native.sinkhorn(logits, iters, eps)

    @staticmethod
    def backward(ctx, g):
        return g, None, None


def sinkhorn_grad_is_upstream(logits, iters=20, eps=1e-6):
    """Correct forward; backward hands the upstream gradient itself back as the logits' gradient
    (wrong, and the very tensor it was given: a rank must copy it to send it on)."""
    return _UpstreamAsGrad.apply(logits, iters, eps)


def sinkhorn_raises(logits, iters=20, eps=1e-6):
    raise RuntimeError("kernel launch failed")


def sinkhorn_wrong_shape(logits, iters=20, eps=1e-6):
    return native.sinkhorn(logits, iters, eps)[..., :-1]


def sinkhorn_wrong_dtype(logits, iters=20, eps=1e-6):
    """Returns float64: judged by value (a higher precision is fine), the report names the dtype."""
    return native.sinkhorn(logits, iters, eps).double()


def _tf32_tiles(a, b):
    """``a @ b`` with the operands rounded to TF32 and fp32 sums, as a TF32 tensor-core kernel."""
    return native.round_to_tf32(a) @ native.round_to_tf32(b)


class _Tf32Proj(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return _tf32_tiles(x, w.t())

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors  # the backward's products at TF32 as well
        return _tf32_tiles(g, w), _tf32_tiles(g.t(), x)


def proj_rms_tf32(x2d, weight, eps=1e-6):
    """A correct kernel that multiplies at TF32 by design (as the mHC paper specifies), forward and
    backward (no call into the native baseline)."""
    xf = x2d.float()
    proj = _Tf32Proj.apply(xf, weight.float())
    r = 1.0 / (xf.norm(dim=-1) / xf.shape[-1] ** 0.5 + eps)
    return proj, r


def sinkhorn_skips_last_token(logits, iters=20, eps=1e-6):
    """Allocates its output the way the fused kernels do (poisoned during parity) and never
    writes the last token's matrix, like a grid that is one block short."""
    from mhctool.core.poison import empty_like
    out = empty_like(logits)
    flat_in, flat_out = logits.reshape(-1, *logits.shape[-2:]), out.view(-1, *logits.shape[-2:])
    with torch.no_grad():
        flat_out[:-1] = native.sinkhorn(flat_in[:-1], iters, eps)
    return out


def sinkhorn_nan_last_token(logits, iters=20, eps=1e-6):
    """Right everywhere but the last token's matrix, which is NaN (a tile run past the end that
    writes garbage): a run goes non-finite at the first Sinkhorn it is called in."""
    out = native.sinkhorn(logits, iters, eps)
    last = torch.zeros(out.shape[:-2].numel(), dtype=torch.bool, device=out.device)
    last[-1] = True
    return torch.where(last.view(*out.shape[:-2], 1, 1), torch.nan, out)


class _PerTokenAlphaBf16Sum(torch.autograd.Function):
    """Broadcasts a vector (alpha, h_bias) to every token; the backward sums the per-token
    gradients in bf16."""

    @staticmethod
    def forward(ctx, alpha, m):
        return alpha.unsqueeze(0).expand(m, alpha.shape[0]).clone()

    @staticmethod
    def backward(ctx, g):
        acc = torch.zeros(g.shape[-1], dtype=torch.bfloat16, device=g.device)
        for row in g.to(torch.bfloat16):
            acc = acc + row
        return acc.to(g.dtype), None


def _mapping_of(x2d, weight, eps, alpha_rows, bias):
    """compute_h from per-token alpha rows ``[M, 3]`` and a bias ``[N]`` or ``[M, N]``."""
    n = round((weight.shape[0] + 1) ** 0.5 - 1)
    proj, r = native.proj_rms(x2d, weight, eps)
    a = alpha_rows
    cols = torch.cat([a[:, :1].expand(-1, n), a[:, 1:2].expand(-1, n), a[:, 2:].expand(-1, n * n)], dim=1)
    h = r.float().unsqueeze(-1) * proj.float() * cols + bias
    return torch.sigmoid(h[:, :n]), 2.0 * torch.sigmoid(h[:, n:2 * n]), h[:, 2 * n:].reshape(-1, n, n)


def mapping_alpha_grad_bf16(x2d, weight, alpha, h_bias, eps=1e-6):
    """Forward right; the alpha gradient is a running sum over tokens kept in bf16."""
    return _mapping_of(x2d, weight, eps, _PerTokenAlphaBf16Sum.apply(alpha, x2d.shape[0]), h_bias)


def mapping_bias_grad_bf16(x2d, weight, alpha, h_bias, eps=1e-6):
    """Forward right; the h_bias gradient is a running sum over tokens kept in bf16 (what the
    reduction floor of grad_h_bias, 2 roundoffs of its terms' sum, must still fail)."""
    rows = alpha.unsqueeze(0).expand(x2d.shape[0], 3)
    return _mapping_of(x2d, weight, eps, rows, _PerTokenAlphaBf16Sum.apply(h_bias, x2d.shape[0]))


# --- grouped MLP ---------------------------------------------------------------------------------

from mhctool.kernels.torch import moe as native_moe  # noqa: E402


def swiglu_scale_before(x, scale=None, interleave=0):
    """Multiplies the input by the per-token scale, then activates: silu(s a) * (s b)."""
    if scale is None:
        return native_moe.swiglu(x, None, interleave)
    return native_moe.swiglu((x.float() * scale[:, None]).to(x.dtype), None, interleave)


def swiglu_halves_swapped(x, scale=None, interleave=0):
    """Activates the linear half: silu(b) * a."""
    a, b = native_moe._halves(x, interleave)
    swapped = torch.cat([b, a], dim=-1) if interleave == 0 else torch.stack(
        [b.unflatten(-1, (-1, interleave)), a.unflatten(-1, (-1, interleave))], dim=-2).flatten(-3)
    return native_moe.swiglu(swapped.contiguous(), scale, interleave)


def swiglu_ignores_interleave(x, scale=None, interleave=0):
    """Reads an interleaved input as if it were [a | b]."""
    return native_moe.swiglu(x, scale, 0)


def grouped_wgrad_overwrites_idle_experts(x, grad_out, m_splits, main_grad=None, accumulate=None):
    """Writes a zero gradient over an accumulating expert's buffer when the expert has no token."""
    out = native_moe.grouped_wgrad(x, grad_out, m_splits, main_grad, accumulate)
    if main_grad is not None:
        out[(m_splits == 0).to(out.device)] = 0
    return out


class _SoftmaxBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, iters, eps):
        ctx.save_for_backward(logits)
        return native.sinkhorn(logits, iters, eps)

    @staticmethod
    def backward(ctx, g):
        (logits,) = ctx.saved_tensors
        p = torch.softmax(logits.float(), dim=-1)
        return (p * (g - (g * p).sum(-1, keepdim=True))).to(logits.dtype), None, None


def sinkhorn_softmax_backward(logits, iters=20, eps=1e-6):
    """Correct forward; the backward skips the normalisations: the gradient of its first row
    softmax only (close to the true one where H is near a row softmax, wrong in the H_res rows)."""
    return _SoftmaxBackward.apply(logits, iters, eps)


class _OnePassBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, iters, eps):
        h = native.sinkhorn(logits, iters, eps)
        ctx.save_for_backward(h)
        return h

    @staticmethod
    def backward(ctx, g):
        (h,) = ctx.saved_tensors
        d = g * h
        d = d - h * d.sum(-2, keepdim=True)
        d = d - h * d.sum(-1, keepdim=True)
        return d, None, None


def sinkhorn_one_pass_backward(logits, iters=20, eps=1e-6):
    """Correct forward; the backward one pass of d -= w colsum(d w); d -= w rowsum(d w) where the
    true one unrolls every iteration."""
    return _OnePassBackward.apply(logits, iters, eps)


def h_post_bda_dropout_next_key(h_res, x, h_post, y, bias=None, dropout=0.0, dropout_seed=0, dropout_offset=0):
    """Draws its dropout mask one counter past the key it is given (an offset off by one)."""
    return native.h_post_bda(h_res, x, h_post, y, bias, dropout=dropout, dropout_seed=dropout_seed,
                             dropout_offset=dropout_offset + 1 if dropout else dropout_offset)


def h_post_bda_dropout_bias_outside(h_res, x, h_post, y, bias=None, dropout=0.0, dropout_seed=0, dropout_offset=0):
    """Adds H_post * bias after the dropout, not inside it (only y is dropped)."""
    out = native.h_post_bda(h_res, x, h_post, y, None, dropout=dropout, dropout_seed=dropout_seed,
                            dropout_offset=dropout_offset)
    return out if bias is None else out + h_post.to(x.dtype).unsqueeze(-1) * bias


def h_post_bda_dropout_unscaled(h_res, x, h_post, y, bias=None, dropout=0.0, dropout_seed=0, dropout_offset=0):
    """Drops by the contract's mask but leaves the kept elements unscaled (no 1 / (1 - p))."""
    keep = native.h_post_bda(h_res, x, h_post, y, bias, dropout=dropout, dropout_seed=dropout_seed,
                             dropout_offset=dropout_offset)
    mixed = native.h_post_bda(h_res, x, torch.zeros_like(h_post), y, None)
    return mixed + (keep - mixed) * (1.0 - dropout)


_KEYS_DRAWN: dict = {}


def h_post_bda_dropout_fresh_mask_again(h_res, x, h_post, y, bias=None, dropout=0.0, dropout_seed=0,
                                        dropout_offset=0):
    """Draws the contract's mask the first time it is given a key, and another on every later call
    with that key (a kernel that counts its draws itself: the recompute, which restores the key,
    gets another mask than the forward's)."""
    again = _KEYS_DRAWN.get((dropout_seed, dropout_offset), 0)
    _KEYS_DRAWN[(dropout_seed, dropout_offset)] = again + 1
    return native.h_post_bda(h_res, x, h_post, y, bias, dropout=dropout, dropout_seed=dropout_seed,
                             dropout_offset=dropout_offset + 7919 * again if dropout else dropout_offset)
