"""DeepSeek's TileKernels (pip ``tile-kernels``, TileLang kernels; the people who published mHC).

``--impl tilekernels:tile_kernels`` (the installed package) or ``tilekernels:FOLDER`` (a folder
holding ``tile_kernels/``). Two layouts are recognised:

- **pip 2.1.0** (``tile_kernels.mhc``): forward and backward kernel functions that write into
  buffers the caller allocates (``mhc_sinkhorn_fwd(x, out, repeat, eps)``, ``mhc_post_bwd(...)``,
  ...). The autograd glue here allocates the buffers and calls them; nothing of the library is
  changed. Its projection GEMM is not in the package (it moved to DeepGEMM): the split-K partials
  that ``mhc_reduce_partials_and_rmsnorm_fwd`` and ``mhc_pre_big_fuse_fwd`` take, and their
  backward, are computed here by PyTorch in fp32 (IEEE), one split, as TileKernels' own reference
  builds them; the mapping is judged with that glue, and says so in its name (``[gemm:torch]``).
- **GitHub** (``tile_kernels.modeling.mhc.ops``): the library's own autograd ops
  (``sinkhorn_normalize``, ``mhc_pre_apply_mix``, ``mhc_post``, ``mhc_pre_norm_fn`` with its
  TileLang GEMM, ``mhc_pre_split_mixes``, ``mhc_pre_big_fuse``).

The families, and what differs from mhctool's contracts:

- sinkhorn: ``softmax`` first (the row step it replaces), then repeat - 1 row/column pairs
  (``stabilize=softmax``); fp32; n a power of two (TileLang's butterfly all-reduce);
- h_aggregate (``mhc_pre_apply_mix``): bf16 activations only, h_pre in fp32, the output in bf16;
- h_post_bda (``mhc_post``): mixes with ``H_res^T`` (``transpose_res=true``); no bias argument: a
  case's bias is added to the branch here (``y + bias``, one PyTorch add outside its code, the add
  the contract makes before the product); bf16 activations; C a multiple of 128; its backward
  takes n = 4 only (other n: the forward is judged, the backward skipped with its reason);
- mapping (``mhc_reduce_partials_and_rmsnorm`` or ``mhc_pre_norm_fn``, then
  ``mhc_pre_split_mixes``): eps inside the square root (``rms_eps=inside``), ``pre_eps`` is
  ``compute_h_eps``, ``post_mult_value`` 2 (the contract's ``H_post = 2 sigmoid``); bf16 x;
- mix_aggregate: the training pre-path (mapping, Sinkhorn, ``mhc_pre_apply_mix``), as
  ``tile_kernels.modeling.mhc.mhc_pre`` composes it. In a model TileKernels accumulates x's
  gradient from ``mhc_post``'s backward into the same buffer (``grad_from_mhc_post``); alone, the
  glue starts it at zero (what bench's note says it added);
- mix_aggregate's forward, ``[inference]``: ``mhc_pre_big_fuse`` (the fused inference pre-path,
  no backward).

Precision: the GitHub layout's GEMM rounds its weight to TF32 (``round_to_tf32``; bf16 x is exact in
TF32): ``tf32``; the pip layout's GEMM is the glue's, IEEE.
"""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

import torch

from . import Binding, load_path_or_module, n_of

NAME = "tilekernels"
MODULE = "tile_kernels"
POST_MULT = 2.0  # the contract's H_post = 2 sigmoid(...)
BF16 = ("bf16",)


def load(target: str):
    """The ``tile_kernels`` package: installed (``tile_kernels``), or from a folder that holds it
    (a GitHub checkout), or that folder's ``tile_kernels/`` itself."""
    path = Path(target)
    if path.is_dir() and path.name == MODULE:
        target = str(path.parent)
    return load_path_or_module(target, MODULE, f"{MODULE}.py")


def layout(m) -> tuple[str, object]:
    """("github", its modeling ops) or ("pip", its kernel functions) or ("", None)."""
    for kind, sub, marker in (("github", "modeling.mhc.ops", "sinkhorn_normalize"), ("pip", "mhc", "mhc_sinkhorn_fwd")):
        try:
            found = importlib.import_module(f"{m.__name__}.{sub}")
        except ImportError:
            continue
        if hasattr(found, marker):
            return kind, found
    return "", None


# --- the pip layout: autograd glue around the kernel functions ---------------------------------

class _PipSinkhorn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, k, x, repeat, eps):
        out = torch.empty_like(x)
        k.mhc_sinkhorn_fwd(x, out, repeat, eps)
        ctx.save_for_backward(x)
        ctx.k, ctx.repeat, ctx.eps = k, repeat, eps
        return out

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        grad = torch.empty_like(x)
        ctx.k.mhc_sinkhorn_bwd(g.contiguous(), x, grad, ctx.repeat, ctx.eps)
        return None, grad, None, None


class _PipApplyMix(torch.autograd.Function):
    @staticmethod
    def forward(ctx, k, x, mix):
        out = torch.empty(x.shape[0], x.shape[2], dtype=torch.bfloat16, device=x.device)
        k.mhc_pre_apply_mix_fwd(x, mix, out)
        ctx.save_for_backward(x, mix)
        ctx.k = k
        return out

    @staticmethod
    def backward(ctx, g):
        x, mix = ctx.saved_tensors
        x_grad = torch.zeros_like(x)  # in a model: the buffer mhc_post's backward wrote x's gradient into
        mix_grad = ctx.k.mhc_pre_apply_mix_bwd(g.contiguous(), x, mix, x_grad)
        return None, x_grad, mix_grad


class _PipPost(torch.autograd.Function):
    @staticmethod
    def forward(ctx, k, x, residual, post, comb):
        out = k.mhc_post_fwd(x, residual, post, comb)
        ctx.save_for_backward(x, residual, post, comb)
        ctx.k = k
        return out

    @staticmethod
    def backward(ctx, g):
        x, residual, post, comb = ctx.saved_tensors
        _n4_backward(residual.shape[-2])
        d_x, d_residual, d_post, d_comb = ctx.k.mhc_post_bwd(x, residual, post, comb, g.contiguous())
        return None, d_x, d_residual, d_post, d_comb


def _n4_backward(n: int) -> None:
    if n != 4:  # its backward kernel is written for four streams: a limit it states, said as such
        raise NotImplementedError(f"TileKernels' mhc_post backward takes n = 4 only, not {n}")


class _PipNormFn(torch.autograd.Function):
    """The projection's partials (the glue's fp32 GEMM, one split), then TileKernels' reduction
    and RMS norm; its backward, then the GEMM's backward (glue)."""

    @staticmethod
    def forward(ctx, k, x2d, fn, eps):
        xf = x2d.float()
        n3 = fn.shape[0]
        tokens, hidden = xf.shape
        out_mul_split = (xf @ fn.t()).view(1, tokens, 1, n3).contiguous()
        sqrsum_split = xf.square().sum(-1).view(1, tokens, 1).contiguous()
        out_mul = torch.empty(tokens, 1, n3, dtype=torch.float32, device=x2d.device)
        sqrsum = torch.empty(tokens, 1, dtype=torch.float32, device=x2d.device)
        out = torch.empty(tokens, n3, dtype=torch.float32, device=x2d.device)
        k.mhc_reduce_partials_and_rmsnorm_fwd(out_mul_split, sqrsum_split, out_mul, sqrsum, out, hidden, eps, 1)
        ctx.save_for_backward(x2d, fn, out_mul, sqrsum)
        ctx.k, ctx.eps = k, eps
        return out

    @staticmethod
    def backward(ctx, g):
        x2d, fn, out_mul, sqrsum = ctx.saved_tensors
        out_mul_grad = torch.empty_like(out_mul)
        sqrsum_grad = torch.empty_like(sqrsum)
        ctx.k.mhc_reduce_partials_and_rmsnorm_bwd(g.contiguous(), out_mul, sqrsum, out_mul_grad, sqrsum_grad,
                                                  x2d.shape[-1], ctx.eps)
        xf = x2d.float()
        gm = out_mul_grad.view(xf.shape[0], -1)
        grad_x = gm @ fn + 2.0 * sqrsum_grad.view(-1, 1) * xf
        grad_fn = gm.t() @ xf
        return None, grad_x.to(x2d.dtype), grad_fn, None


class _PipSplit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, k, mixes, scale, base, n, pre_eps):
        tokens = mixes.shape[0]
        pre = torch.empty(tokens, n, dtype=torch.float32, device=mixes.device)
        post = torch.empty_like(pre)
        comb = torch.empty(tokens, n * n, dtype=torch.float32, device=mixes.device)
        k.mhc_pre_split_mixes_fwd(mixes, scale, base, pre, post, comb, POST_MULT, pre_eps)
        ctx.save_for_backward(mixes, post, scale, base)
        ctx.k = k
        return pre, post, comb

    @staticmethod
    def backward(ctx, g_pre, g_post, g_comb):
        mixes, post, scale, base = ctx.saved_tensors
        z = torch.zeros_like
        g_pre = z(post) if g_pre is None else g_pre.contiguous()
        g_post = z(post) if g_post is None else g_post.contiguous()
        g_comb = torch.zeros(mixes.shape[0], post.shape[1] ** 2, device=mixes.device) if g_comb is None \
            else g_comb.contiguous()
        mixes_grad = torch.empty_like(mixes)
        scale_grad = torch.empty_like(scale)
        base_grad = torch.empty_like(base)
        ctx.k.mhc_pre_split_mixes_bwd(g_pre, g_post, g_comb, mixes, post, scale, base, mixes_grad, scale_grad,
                                      base_grad, POST_MULT)
        return None, mixes_grad, scale_grad, base_grad, None, None


class _Pip:
    """The pip layout's kernels as the operations the families are built from."""

    layout = "pip"
    precision = "ieee"  # the projection GEMM is the glue's (PyTorch fp32)
    gemm_tag = "gemm:torch"
    gemm_glue = ("the projection's GEMM and its backward in PyTorch fp32 (the package leaves it to DeepGEMM), "
                 "one split")

    def __init__(self, k):
        self.k = k

    def sinkhorn(self, logits, repeat, eps):
        n = logits.shape[-1]
        x = logits.float().contiguous().view(-1, n, n)
        return _PipSinkhorn.apply(self.k, x, repeat, eps).view(logits.shape)

    def apply_mix(self, x, mix):  # x [T, n, C] bf16, mix [T, n] fp32 -> [T, C] bf16
        return _PipApplyMix.apply(self.k, x.contiguous(), mix.contiguous())

    def post(self, branch, residual, post, comb):  # [s, b, C], [s, b, n, C], [s, b, n], [s, b, n, n]
        return _PipPost.apply(self.k, branch.contiguous(), residual.contiguous(), post.unsqueeze(-1).contiguous(),
                              comb.contiguous())

    def norm_fn(self, x2d, fn, eps):  # [T, n*C] bf16 -> [T, n^2 + 2n] fp32
        return _PipNormFn.apply(self.k, x2d.contiguous(), fn.contiguous(), eps)

    def split(self, mixes, scale, base, n, pre_eps):
        pre, post, comb = _PipSplit.apply(self.k, mixes.contiguous(), scale.contiguous(), base.contiguous(), n,
                                          pre_eps)
        return pre, post, comb.view(-1, n, n)

    def big_fuse(self, residual, fn, scale, base, eps, pre_eps, sinkhorn_eps, repeat):  # no grad
        tokens, n, c = residual.shape
        xf = residual.reshape(tokens, n * c).float()
        mul = (xf @ fn.t()).view(1, tokens, -1).contiguous()
        sqrsum = xf.square().sum(-1).view(1, tokens).contiguous()
        post = torch.empty(tokens, n, dtype=torch.float32, device=residual.device)
        comb = torch.empty(tokens, n * n, dtype=torch.float32, device=residual.device)
        out = torch.empty(tokens, c, dtype=torch.bfloat16, device=residual.device)
        self.k.mhc_pre_big_fuse_fwd(mul, sqrsum, scale, base, residual.contiguous(), post, comb, out, eps, pre_eps,
                                    sinkhorn_eps, POST_MULT, repeat, n_splits=1)
        return out, post, comb.view(tokens, n, n)


class _Github:
    """The GitHub layout's autograd ops (the library's own glue)."""

    layout = "github"
    precision = "tf32"  # mhc_pre_norm_fn's TileLang GEMM rounds its weight to TF32
    gemm_tag = ""
    gemm_glue = ""

    def __init__(self, ops):
        self.ops = ops

    def sinkhorn(self, logits, repeat, eps):
        return self.ops.sinkhorn_normalize(logits.float(), repeat=repeat, eps=eps)

    def apply_mix(self, x, mix):
        return self.ops.mhc_pre_apply_mix(x.contiguous(), mix.unsqueeze(-1).contiguous())

    def post(self, branch, residual, post, comb):
        if residual.shape[-2] != 4 and torch.is_grad_enabled():
            return _GithubPost.apply(self.ops, branch, residual, post, comb)
        return self.ops.mhc_post(branch.contiguous(), residual.contiguous(), post.unsqueeze(-1).contiguous(),
                                 comb.contiguous())

    def norm_fn(self, x2d, fn, eps):
        tokens, hidden = x2d.shape
        n = n_of(fn)
        # fuse_grad_acc=False: x's gradient is returned, not added to mhc_post's buffer (none here)
        return self.ops.mhc_pre_norm_fn(x2d.contiguous().view(tokens, n, hidden // n), fn.contiguous(), None, eps,
                                        fuse_grad_acc=False, n_splits=1)

    def split(self, mixes, scale, base, n, pre_eps):
        pre, post, comb = self.ops.mhc_pre_split_mixes(mixes.contiguous().view(mixes.shape[0], 1, -1), scale, base,
                                                       n, POST_MULT, pre_eps)
        return pre.reshape(-1, n), post.reshape(-1, n), comb.reshape(-1, n, n)

    def big_fuse(self, residual, fn, scale, base, eps, pre_eps, sinkhorn_eps, repeat):
        post, comb, out = self.ops.mhc_pre_big_fuse(residual.contiguous(), fn.contiguous(), scale, base, eps, pre_eps,
                                                    sinkhorn_eps, POST_MULT, repeat, n_splits=1)
        n = residual.shape[-2]
        return out, post.reshape(-1, n), comb.reshape(-1, n, n)


class _GithubPost(torch.autograd.Function):
    """The library's mhc_post for n != 4, whose backward states its n = 4 limit before it runs."""

    @staticmethod
    def forward(ctx, ops, branch, residual, post, comb):
        ctx.n = residual.shape[-2]
        with torch.no_grad():
            return ops.mhc_post(branch.contiguous(), residual.contiguous(), post.unsqueeze(-1).contiguous(),
                                comb.contiguous())

    @staticmethod
    def backward(ctx, g):
        _n4_backward(ctx.n)


# --- the families -----------------------------------------------------------------------------

def _sinkhorn(ops, logits, iters=20, eps=1e-6):
    return ops.sinkhorn(logits, iters, eps)


def _h_aggregate(ops, x, h_pre):
    s, b, n, c = x.shape
    return ops.apply_mix(x.reshape(s * b, n, c), h_pre.float().reshape(s * b, n)).view(s, b, c)


def _h_post_bda(ops, h_res, x, h_post, y, bias):
    branch = y if bias is None else y + bias  # no bias argument: the contract's add, outside its code
    return ops.post(branch, x, h_post.float(), h_res.float())


def _mapping(ops, x2d, weight, alpha, h_bias, eps=1e-6, compute_h_eps=0.0):
    # its weight, scale and bias are fp32 parameters: a 16-bit weight is widened (exactly) first
    n = n_of(weight)
    pre, post, comb = ops.split(ops.norm_fn(x2d, weight.float(), eps), alpha.float(), h_bias.float(), n,
                                compute_h_eps)
    return pre, post, comb


def _pre_path(ops, x, weight, alpha, h_bias, eps, iters, sinkhorn_eps, compute_h_eps):
    s, b, n, c = x.shape
    x3 = x.reshape(s * b, n, c)
    pre, post, logits = _mapping(ops, x3.reshape(s * b, n * c), weight, alpha, h_bias, eps, compute_h_eps)
    h_res = ops.sinkhorn(logits, iters, sinkhorn_eps)
    out = ops.apply_mix(x3, pre)
    return out.view(s, b, c), post.view(s, b, n), h_res.view(s, b, n, n)


def _mix_aggregate(ops, x, weight, alpha, h_bias, eps=1e-6, iters=20, sinkhorn_eps=1e-6, compute_h_eps=0.0):
    return _pre_path(ops, x, weight, alpha, h_bias, eps, iters, sinkhorn_eps, compute_h_eps)


def _big_fuse(ops, x, weight, alpha, h_bias, eps=1e-6, iters=20, sinkhorn_eps=1e-6, compute_h_eps=0.0):
    s, b, n, c = x.shape
    with torch.no_grad():  # the inference path: no backward, said so by the verdict's skipped rows
        out, post, h_res = ops.big_fuse(x.reshape(s * b, n, c), weight.float(), alpha.float(), h_bias.float(), eps,
                                        compute_h_eps, sinkhorn_eps, iters)
    return out.view(s, b, c), post.view(s, b, n), h_res.view(s, b, n, n)


def _power_of_two(shape) -> str | None:
    n = shape.n
    return None if n >= 1 and n & (n - 1) == 0 else \
        f"TileKernels' Sinkhorn takes n a power of two (TileLang's butterfly all-reduce), not {shape.n}"


def _c128(shape) -> str | None:
    return None if shape.c % 128 == 0 else \
        f"TileKernels' mhc_post takes a hidden size that is a multiple of 128, not C = {shape.c}"


def _both(*limits):
    def limit(shape):
        return next((why for why in (f(shape) for f in limits) if why), None)
    return limit


SINKHORN = {"stabilize": "softmax", "order": "row_first"}
APPLY_MIX_GLUE = ("x's gradient buffer zeroed before the backward adds into it (in a model mhc_post's backward "
                  "has written it: a write of x's size that a model does not pay here)")
MAPPING = {"rms_eps": "inside"}
PRE_KNOBS = ("eps", "iters", "sinkhorn_eps", "compute_h_eps")


def recognise(m) -> tuple[str, list[Binding]]:
    kind, lib = layout(m)
    if not kind:
        return "", []
    ops = _Github(lib) if kind == "github" else _Pip(lib)
    gemm = f"[{ops.gemm_tag}]" if ops.gemm_tag else ""

    devices = ("cuda",) if _on_tilelang() else ("cpu", "cuda")

    def bound(call):
        return lambda _m, *args, **knobs: call(ops, *args, **knobs)
    found = [
        Binding("sinkhorn", "sinkhorn", bound(_sinkhorn), ("iters", "eps"), dict(SINKHORN), limit=_power_of_two,
                devices=devices),
        Binding("h_aggregate", "mhc_pre_apply_mix", bound(_h_aggregate), activations=BF16,
                devices=devices, glue=APPLY_MIX_GLUE),
        Binding("h_post_bda", "mhc_post", bound(_h_post_bda), (), {"transpose_res": True}, activations=BF16,
                limit=_c128, devices=devices, glue="the bias added to the branch (y + bias), one PyTorch add"),
        Binding("mapping", "mhc_pre_norm_fn+mhc_pre_split_mixes" + gemm, bound(_mapping), ("eps", "compute_h_eps"),
                dict(MAPPING), ops.precision, activations=BF16, devices=devices, glue=ops.gemm_glue),
        Binding("mix_aggregate", "mhc_pre" + gemm, bound(_mix_aggregate), PRE_KNOBS, dict(MAPPING, **SINKHORN),
                ops.precision, activations=BF16, limit=_power_of_two, devices=devices,
                glue="; ".join(g for g in (ops.gemm_glue, APPLY_MIX_GLUE) if g)),
        Binding("mix_aggregate", "mhc_pre_big_fuse" + gemm, bound(_big_fuse), PRE_KNOBS, dict(MAPPING, **SINKHORN),
                ops.precision, variant="inference", activations=BF16, limit=_power_of_two, devices=devices,
                glue=ops.gemm_glue),
    ]
    return f"{kind}-{_version(m)}", found


def _on_tilelang() -> bool:
    """Whether the library loaded TileLang (its kernels then run on a GPU only); a stand-in written
    from its API in PyTorch runs anywhere."""
    return "tilelang" in sys.modules


def _version(m) -> str:
    return str(getattr(m, "__version__", None) or "local")
