"""The residual's gradient handed from a module call's post-path to its pre-path
(``kernels.schedule.ResidualLink``): the projection backward adds it in the pass that writes dx,
instead of autograd's pass over the two; a gradient is never lost, whatever order the two
backwards run in. Triton through the interpreter on the CPU, and on the GPU (bf16, the tensor-core
projection backward at its own tile)."""
import importlib

import pytest
import torch

from mhctool.core.poison import poisoning
from mhctool.core.shapes import parse_shape_for
from mhctool.families import generate
from mhctool.kernels.schedule import ResidualLink, hand_over, residual_link
from mhctool.kernels.triton import proj_rms as tpr
from mhctool.references import mhc as ref


def test_a_link_keeps_the_post_paths_gradient_only_for_a_pre_path_that_takes_it():
    """No taker: the gradient goes to autograd. A taker whose backward has not run: the link keeps
    it and autograd gets none. A taker that has run (the link closed): autograd gets it."""
    for taker, taken_first, kept in ((False, False, False), (True, False, True), (True, True, False)):
        link = ResidualLink()
        link.taker = taker
        if taken_first:
            assert link.take() is None
        x = torch.randn(3, 5, requires_grad=True)
        (hand_over(x, link) * 3).sum().backward()
        if kept:
            assert x.grad is None and torch.equal(link.grad, torch.full((3, 5), 3.0))
            assert torch.equal(link.take(), torch.full((3, 5), 3.0)) and link.grad is None
        else:
            assert torch.equal(x.grad, torch.full((3, 5), 3.0)) and link.grad is None
    y = torch.randn(2, requires_grad=True)
    assert hand_over(y, None) is y


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test; the GPU runs the bf16 case below")
@pytest.mark.parametrize("lowp", [False, True], ids=["generic", "tensor-core"])
def test_the_projection_backward_adds_the_extra_gradient_before_its_one_rounding(lowp):
    """fp32 through the interpreter (both kernels, the aggregation's term too; 37 rows, K = 3 x 29:
    no tile's multiple): dx with ``extra`` is dx without it plus ``extra``, added in the same order
    autograd adds them, so the same bits; dW unchanged; every element written (NaN-poisoned)."""
    g = torch.Generator().manual_seed(3)
    M, n, C, N = 37, 3, 29, 15
    x2d = torch.randn(M, n * C, generator=g)
    w = torch.randn(N, n * C, generator=g) * 0.1
    rms = x2d.square().mean(-1).add(1e-6).sqrt()
    r = 1 / rms
    gp, gr = torch.randn(M, N, generator=g), torch.randn(M, generator=g)
    agg = (torch.rand(M, n, generator=g), torch.randn(M, C, generator=g))
    extra = torch.randn(M, n * C, generator=g)
    with poisoning():
        dx0, dw0 = tpr.proj_rms_backward(x2d, w, r, rms, gp, gr, lowp=lowp, agg=agg)
        dx1, dw1 = tpr.proj_rms_backward(x2d, w, r, rms, gp, gr, lowp=lowp, agg=agg, extra=extra)
    assert torch.isfinite(dx1).all() and torch.isfinite(dw1).all()
    assert torch.equal(dx1, dx0 + extra) and torch.equal(dw1, dw0)
    with pytest.raises(ValueError, match="extra is a gradient of x2d"):
        tpr.proj_rms_backward(x2d, w, r, rms, gp, gr, lowp=lowp, extra=extra[:-1])


# C = 37: no K block's multiple; C = 256: every K block in one stream (the aggregation term's
# one-load form, and on the GPU the streams' programs side by side, as at the step's C = 2048)
# cuTile (GPU only): C = 37 takes the per-K-block kernel with grad_out gathered, C = 256 the streams'
# form (a program per channel block of the four streams)
CASES = [pytest.param("triton", "cpu", torch.float32, "5x3x4x37", id="cpu-fp32"),
         pytest.param("triton", "cpu", torch.bfloat16, "5x3x4x37", id="cpu-bf16"),
         pytest.param("triton", "cpu", torch.float32, "3x2x4x256", id="cpu-fp32-aligned"),
         pytest.param("triton", "cuda", torch.bfloat16, "5x3x4x37", id="gpu-bf16", marks=pytest.mark.gpu),
         pytest.param("triton", "cuda", torch.bfloat16, "67x3x4x256", id="gpu-bf16-aligned", marks=pytest.mark.gpu),
         pytest.param("cutile", "cuda", torch.bfloat16, "5x3x4x37", id="cutile-bf16", marks=pytest.mark.gpu),
         pytest.param("cutile", "cuda", torch.bfloat16, "67x3x4x256", id="cutile-bf16-aligned", marks=pytest.mark.gpu),
         pytest.param("cutile", "cuda", torch.float32, "5x3x4x37", id="cutile-fp32", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("backend,device,dtype,shape", CASES)
def test_linked_mix_aggregate_adds_the_post_paths_gradient_to_dx(backend, device, dtype, shape):
    """x feeds mix_aggregate and, handed over, a stand-in post-path (``x * G``, gradient G): linked,
    the pre-path's backward takes G and dx holds both gradients, autograd adding none. Against the
    float64 reference plus G: within a rounding of dx's dtype (one rounding of the sum, where
    autograd rounds each gradient and then their sum); in fp32 Triton's has the bits of the
    unlinked call (it adds G last, as autograd does; cuTile adds it in the accumulator's start).
    Fresh random inputs of the family, NaN-poisoned outputs."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA")
    mod = importlib.import_module(f"mhctool.kernels.{backend}.mix_aggregate")
    _, t = generate("mix_aggregate", "random", parse_shape_for("mhc", shape), 11, {}, device=device)
    x, w = t["x"].to(dtype), t["weight"].to(dtype)
    inputs = (x, w, t["alpha"], t["h_bias"])
    gen = torch.Generator(device=device).manual_seed(12)
    s, b, n, c = x.shape
    ups = [torch.randn(s, b, c, generator=gen, device=device).to(dtype), torch.randn(s, b, n, generator=gen, device=device),
           torch.randn(s, b, n, n, generator=gen, device=device)]
    G = torch.randn(x.shape, generator=gen, device=device).to(dtype)

    def run(fn, link, wide=False):
        leaves = [(v.double() if wide else v.clone()).requires_grad_() for v in inputs]
        with residual_link(link):
            outs = fn(*leaves)
        post = hand_over(leaves[0], link)
        loss = sum((o.double() * u.double()).sum() for o, u in zip(outs, ups)) + (post.double() * G.double()).sum()
        loss.backward()
        return [v.grad for v in leaves]

    with poisoning():
        link = ResidualLink()
        linked = run(mod.mix_aggregate, link)
        plain = run(mod.mix_aggregate, None)
    assert link.taker and not link.open and link.grad is None  # taken, once
    want = run(ref.mix_aggregate, None, wide=True)
    for name, got, same in zip(("dx", "dweight", "dalpha", "dh_bias"), linked, plain):
        assert torch.isfinite(got).all(), name
        if name != "dx":
            assert torch.equal(got, same), name  # only dx changes
    if dtype == torch.float32 and backend == "triton":
        assert torch.equal(linked[0], plain[0])
    scale = want[0].abs().max()
    for got in (linked[0], plain[0]):
        torch.testing.assert_close(got.double(), want[0], rtol=2 ** -7, atol=2e-3 * float(scale))
