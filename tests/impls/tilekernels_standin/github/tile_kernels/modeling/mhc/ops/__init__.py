"""Stand-in for ``tile_kernels.modeling.mhc.ops``: the autograd ops (PyTorch autograd here)."""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "..", ".."))
import tk_standin_math as M  # noqa: E402


def _round_tf32(t):
    """Round to nearest TF32 (10 mantissa bits), ties away, as a kernel that rounds its operands."""
    bits = t.float().contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32)


def sinkhorn_normalize(x, repeat=10, eps=1e-6):
    return M.sinkhorn(x, repeat, eps)


def mhc_pre_apply_mix(x, mix, out=None):
    assert mix.shape[-1] == 1
    assert x.dtype == torch.bfloat16
    return (x.float() * mix).sum(-2).bfloat16()


def mhc_post(x, residual, post_layer_mix, comb_res_mix, out=None):
    return M.post(x, residual, post_layer_mix, comb_res_mix)


def mhc_pre_norm_fn(residual, mhc_fn, mhc_norm_weight, mhc_norm_eps, fuse_grad_acc=True, n_splits=16):
    assert residual.dtype == torch.bfloat16 and mhc_fn.dtype == torch.float32
    assert not fuse_grad_acc, "the stand-in has no mhc_post buffer to accumulate into"
    x = residual.flatten(-2).float()
    fn = mhc_fn + (_round_tf32(mhc_fn) - mhc_fn).detach()  # TF32 operands, the gradient straight through
    return M.norm(x @ fn.t(), x.square().sum(-1), x.shape[-1], mhc_norm_eps)


def mhc_pre_split_mixes(input_mixes, mhc_scale, mhc_base, mhc_mult, mhc_post_mult_value, mhc_pre_eps):
    assert input_mixes.ndim == 3
    a, b = input_mixes.shape[:2]
    pre, post, comb = M.split(input_mixes.view(a * b, -1), mhc_scale, mhc_base, mhc_mult, mhc_post_mult_value,
                              mhc_pre_eps)
    return (pre.view(a, b, mhc_mult, 1), post.view(a, b, mhc_mult, 1), comb.reshape(a, b, mhc_mult, mhc_mult))


def mhc_pre_big_fuse(residual, fn, mhc_scale, mhc_base, rms_eps, mhc_pre_eps, mhc_sinkhorn_eps, mhc_post_mult_value,
                     sinkhorn_repeat, n_splits=16):
    with torch.no_grad():
        n = residual.shape[-2]
        mixes = mhc_pre_norm_fn(residual, fn, None, rms_eps, fuse_grad_acc=False)
        pre, post, comb = M.split(mixes.view(-1, mixes.shape[-1]), mhc_scale, mhc_base, n, mhc_post_mult_value,
                                  mhc_pre_eps)
        comb = M.sinkhorn(comb.view(-1, n, n), sinkhorn_repeat, mhc_sinkhorn_eps)
        out = M.apply_mix(residual.reshape(-1, n, residual.shape[-1]), pre)
    outer = residual.shape[:-2]
    return post.view(*outer, n, 1), comb.view(*outer, n, n), out.view(*outer, residual.shape[-1])
