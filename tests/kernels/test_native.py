"""Native PyTorch implementations against the float64 references."""
import pytest
import torch

from mhctool.kernels.torch import mhc as native
from mhctool.references import mhc as ref


@pytest.mark.parametrize("stabilize", ["rowmax", "none", "softmax"])
@pytest.mark.parametrize("eps_mode", ["add", "clamp"])
@pytest.mark.parametrize("order", ["row_first", "col_first"])
def test_sinkhorn_matches_reference(stabilize, eps_mode, order):
    L = torch.randn(64, 4, 4, dtype=torch.float64)
    kw = dict(stabilize=stabilize, eps_mode=eps_mode, order=order)
    torch.testing.assert_close(native.sinkhorn(L, 7, 1e-6, **kw), ref.sinkhorn(L, 7, 1e-6, **kw))
    out32 = native.sinkhorn(L.float(), 7, 1e-6, **kw)
    assert out32.dtype == torch.float32
    torch.testing.assert_close(out32.double(), ref.sinkhorn(L, 7, 1e-6, **kw), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("transpose_res", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_h_primitives_match_reference(transpose_res, with_bias):
    s, b, n, c = 5, 2, 4, 33
    x, y = torch.randn(s, b, n, c, dtype=torch.float64), torch.randn(s, b, c, dtype=torch.float64)
    h_res, h_post, h_pre = torch.rand(s, b, n, n, dtype=torch.float64), torch.rand(s, b, n, dtype=torch.float64), torch.rand(s, b, n, dtype=torch.float64)
    bias = torch.randn(c, dtype=torch.float64) if with_bias else None
    torch.testing.assert_close(native.h_aggregate(x, h_pre), ref.h_aggregate(x, h_pre))
    torch.testing.assert_close(native.h_post_bda(h_res, x, h_post, y, bias, transpose_res),
                               ref.h_post_bda(h_res, x, h_post, y, bias, transpose_res=transpose_res))


def test_native_keeps_activation_dtype():
    x = torch.randn(3, 2, 4, 16, dtype=torch.bfloat16)
    assert native.h_aggregate(x, torch.rand(3, 2, 4)).dtype == torch.bfloat16
    out = native.h_post_bda(torch.rand(3, 2, 4, 4), x, torch.rand(3, 2, 4), torch.randn(3, 2, 16, dtype=torch.bfloat16), None)
    assert out.dtype == torch.bfloat16


def test_proj_rms_fp32_mapping_path_and_tf32():
    x = torch.randn(17, 96, dtype=torch.bfloat16)
    w = torch.randn(24, 96, dtype=torch.bfloat16)
    proj, r = native.proj_rms(x, w)
    assert proj.dtype == torch.float32 and r.dtype == torch.float32
    rp, rr = ref.proj_rms(x.double(), w.double())
    torch.testing.assert_close(proj.double(), rp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(r.double(), rr, rtol=1e-6, atol=0)
    xf = torch.randn(17, 96)
    p32, _ = native.proj_rms(xf, w.float())
    p_tf32, _ = native.proj_rms(xf, w.float(), matmul_precision="tf32")
    rel = ((p_tf32 - p32).norm() / p32.norm()).item()
    assert 1e-5 < rel < 5e-3  # TF32 keeps 10 mantissa bits: about 1e-4 relative, not fp32's 1e-7


def test_tf32_proj_is_tf32_in_the_backward_too():
    # a TF32 kernel's gradients are products at TF32 as well; a baseline whose backward ran at
    # IEEE failed every correct TF32 kernel on grad_x and grad_weight
    x, w = torch.randn(13, 80).requires_grad_(), torch.randn(24, 80).requires_grad_()
    g = torch.randn(13, 24)
    gx, gw = torch.autograd.grad(native.proj_rms(x, w, matmul_precision="tf32")[0], [x, w], g)
    t = native.round_to_tf32
    torch.testing.assert_close(gx, t(g) @ t(w), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gw, t(g).t() @ t(x), rtol=1e-6, atol=1e-6)
    gx_ieee = torch.autograd.grad(native.proj_rms(x, w)[0], [x], g)[0]
    assert 1e-5 < ((gx - gx_ieee).norm() / gx_ieee.norm()).item() < 5e-3


def test_round_to_tf32_keeps_ten_mantissa_bits():
    t = torch.tensor([1.0 + 2 ** -10, 1.0 + 2 ** -11, 1.0 + 3 * 2 ** -11, float("inf")])
    out = native.round_to_tf32(t)
    # 1 + 2^-10 is representable; 1 + 2^-11 is a tie and rounds to even (1.0); 1 + 3*2^-11 rounds up
    assert out.tolist() == [1.0 + 2 ** -10, 1.0, 1.0 + 2 ** -9, float("inf")]


def test_compute_h_matches_reference():
    n = 4
    proj, r = torch.randn(9, n * n + 2 * n, dtype=torch.float64), torch.rand(9, dtype=torch.float64)
    alpha, bias = torch.rand(3, dtype=torch.float64), torch.randn(n * n + 2 * n, dtype=torch.float64)
    for a, b in zip(native.compute_h(proj, r, alpha, bias, n), ref.compute_h(proj, r, alpha, bias, n)):
        torch.testing.assert_close(a, b)
