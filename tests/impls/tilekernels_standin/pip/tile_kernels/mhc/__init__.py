"""Stand-in for ``tile_kernels.mhc`` (pip 2.1.0): kernel functions that write into the caller's buffers."""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".."))
import tk_standin_math as M  # noqa: E402


def mhc_sinkhorn_fwd(comb_res_mix, comb_res_mix_out, repeat: int, eps: float):
    assert comb_res_mix.dtype == torch.float32
    comb_res_mix_out.copy_(M.sinkhorn(comb_res_mix, repeat, eps))


def mhc_sinkhorn_bwd(grad_output, x, grad_input, repeat: int, eps: float):
    grad_input.copy_(M.grads(lambda t: M.sinkhorn(t, repeat, eps), [x], [grad_output])[0])


def mhc_pre_apply_mix_fwd(x, mix, o):
    o.copy_(M.apply_mix(x, mix))


def mhc_pre_apply_mix_bwd(o_grad, x, mix, x_grad):
    gx, gm = M.grads(lambda a, b: (a * b.unsqueeze(-1)).sum(-2), [x, mix], [o_grad])
    x_grad.copy_((x_grad.float() + gx).to(x_grad.dtype))
    return gm


def mhc_post_fwd(x, residual, post_layer_mix, comb_res_mix, out=None):
    assert post_layer_mix.dtype == torch.float32 and comb_res_mix.dtype == torch.float32
    res = M.post(x, residual, post_layer_mix, comb_res_mix)
    if out is None:
        return res
    out.copy_(res)
    return out


def mhc_post_bwd(x, residual, post_layer_mix, comb_res_mix, d_o):
    assert residual.shape[-2] == 4, "the backward kernel is written for mhc = 4"

    def f(a, b, c, d):
        return (a.unsqueeze(-2) * c + torch.einsum("...mn,...mc->...nc", d, b))
    d_x, d_res, d_post, d_comb = M.grads(f, [x, residual, post_layer_mix, comb_res_mix], [d_o])
    return d_x.bfloat16(), d_res.bfloat16(), d_post, d_comb


def mhc_reduce_partials_and_rmsnorm_fwd(out_mul_splitted, sqrsum_splitted, out_mul, sqrsum, out,
                                        rms_group_size: int, rms_eps: float, n_splits: int):
    out_mul.copy_(out_mul_splitted[:n_splits].sum(0))
    sqrsum.copy_(sqrsum_splitted[:n_splits].sum(0))
    out.copy_(M.norm(out_mul.view(out.shape), sqrsum.view(-1), rms_group_size, rms_eps))


def mhc_reduce_partials_and_rmsnorm_bwd(out_grad, out_mul, sqrsum, out_mul_grad, sqrsum_grad,
                                        rms_group_size: int, rms_eps: float):
    g_mul, g_sq = M.grads(lambda a, b: M.norm(a, b, rms_group_size, rms_eps),
                          [out_mul.view(out_grad.shape), sqrsum.view(-1)], [out_grad])
    out_mul_grad.copy_(g_mul.view(out_mul_grad.shape))
    sqrsum_grad.copy_(g_sq.view(sqrsum_grad.shape))


def mhc_pre_split_mixes_fwd(input_mixes, mhc_scale, mhc_base, pre_layer_mix, post_layer_mix, comb_res_mix,
                            mhc_post_mult_value: float, mhc_pre_eps: float):
    n = pre_layer_mix.shape[-1]
    pre, post, comb = M.split(input_mixes, mhc_scale, mhc_base, n, mhc_post_mult_value, mhc_pre_eps)
    pre_layer_mix.copy_(pre)
    post_layer_mix.copy_(post)
    comb_res_mix.copy_(comb)


def mhc_pre_split_mixes_bwd(pre_layer_mix_grad, post_layer_mix_grad, comb_res_mix_grad, input_mixes, post_layer_mix,
                            mhc_scale, mhc_base, input_mixes_grad, mhc_scale_grad, mhc_base_grad,
                            mhc_post_mult_value: float):
    n = pre_layer_mix_grad.shape[-1]
    g = M.grads(lambda a, b, c: M.split(a, b, c, n, mhc_post_mult_value, 0.0), [input_mixes, mhc_scale, mhc_base],
                [pre_layer_mix_grad, post_layer_mix_grad, comb_res_mix_grad])
    input_mixes_grad.copy_(g[0])
    mhc_scale_grad.copy_(g[1])
    mhc_base_grad.copy_(g[2])


def mhc_pre_big_fuse_fwd(gemm_out_mul, gemm_out_sqrsum, mhc_scale, mhc_base, residual, post_mix, comb_mix,
                         layer_input, rms_eps: float, mhc_pre_eps: float, mhc_sinkhorn_eps: float,
                         mhc_post_mult_value: float, sinkhorn_repeat: int, n_splits: int = 16):
    n, hidden = residual.shape[-2], residual.shape[-1]
    mixes = M.norm(gemm_out_mul[:n_splits].sum(0), gemm_out_sqrsum[:n_splits].sum(0), n * hidden, rms_eps)
    pre, post, comb = M.split(mixes, mhc_scale, mhc_base, n, mhc_post_mult_value, mhc_pre_eps)
    post_mix.copy_(post)
    comb_mix.copy_(M.sinkhorn(comb.view(-1, n, n), sinkhorn_repeat, mhc_sinkhorn_eps).view(comb_mix.shape))
    layer_input.copy_(M.apply_mix(residual, pre))
