"""Grouped MoE MLP: references, Triton kernels (interpreter on the CPU), layout conversions."""
import pytest
import torch
from typer.testing import CliRunner

from mhctool.libraries import layouts
from mhctool.cli.app import app
from mhctool.kernels.torch import moe as native
from mhctool.kernels.triton import glu, grouped_gemm as tgg, grouped_mlp as tmlp
from mhctool.core.poison import poisoning
from mhctool.references import moe as ref

runner = CliRunner()


def _leaf(*shape, scale=1.0, dtype=torch.float32):
    return (torch.randn(*shape) * scale).to(dtype).requires_grad_()


def _rel(a, b):
    a, b = a.detach().double(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


# --- references --------------------------------------------------------------------------------

@pytest.mark.parametrize("k", [1, 4, 32])
def test_interleave_round_trip_and_activation_agree(k):
    f = 2 * 32
    x = torch.randn(5, 2 * f, dtype=torch.float64)
    inter = ref.interleave_glu(x, k)
    assert torch.equal(ref.deinterleave(inter, k), x)
    a, b = ref.split_glu(inter, k)
    assert torch.equal(a, x[:, :f]) and torch.equal(b, x[:, f:])
    torch.testing.assert_close(ref.swiglu(inter, interleave=k), ref.swiglu(x), rtol=1e-15, atol=0)


def test_clamped_swiglu_formula_and_scale_gradient():
    a = torch.tensor([[-9.0, 0.5, 9.0]], dtype=torch.float64)
    b = torch.tensor([[-9.0, 0.5, 9.0]], dtype=torch.float64)
    x = torch.cat([a, b], dim=1)
    y = ref.clamped_swiglu(x)
    ac, bc = torch.tensor([-9.0, 0.5, 7.0]), torch.tensor([-7.0, 0.5, 7.0]) + 1.0
    torch.testing.assert_close(y[0], (ac * torch.sigmoid(1.702 * ac) * bc).double())
    # the scale's gradient is sum_j g_ij f_ij with f unscaled
    xs = torch.randn(4, 6, dtype=torch.float64)
    s = torch.rand(4, dtype=torch.float64, requires_grad=True)
    g = torch.randn(4, 3, dtype=torch.float64)
    (gs,) = torch.autograd.grad(ref.swiglu(xs, s), [s], g)
    torch.testing.assert_close(gs, (g * ref.swiglu(xs)).sum(1))


def test_grouped_gemm_and_wgrad_semantics():
    m = torch.tensor([3, 0, 4])
    x, w, dy = torch.randn(7, 5, dtype=torch.float64), torch.randn(3, 2, 5, dtype=torch.float64), torch.randn(7, 2, dtype=torch.float64)
    y = ref.grouped_gemm(x, w, m)
    torch.testing.assert_close(y[:3], x[:3] @ w[0].T)
    torch.testing.assert_close(y[3:], x[3:] @ w[2].T)
    dw = ref.grouped_wgrad(x, dy, m)
    assert torch.equal(dw[1], torch.zeros(2, 5, dtype=torch.float64))  # zero tokens, zero gradient
    main = torch.randn(3, 2, 5, dtype=torch.float64)
    acc = ref.grouped_wgrad(x, dy, m, main, torch.tensor([True, True, False]))
    torch.testing.assert_close(acc[0], main[0] + dy[:3].T @ x[:3])
    assert torch.equal(acc[1], main[1])  # accumulating, no token: untouched
    torch.testing.assert_close(acc[2], dy[3:].T @ x[3:])  # not accumulating: overwritten


# --- Triton kernels (interpreter on the CPU) ------------------------------------------------------

ACTS = [("swiglu", glu.swiglu, ref.swiglu, {}), ("clamped_swiglu", glu.clamped_swiglu, ref.clamped_swiglu, {}),
        ("srelu", glu.srelu, ref.srelu, {})]


@pytest.mark.parametrize("name,fn,rf,_", ACTS)
@pytest.mark.parametrize("f,interleave", [(67, 0), (96, 32), (5, 0)])
@pytest.mark.parametrize("scaled", [True, False])
def test_activation_kernels_match_float64(name, fn, rf, _, f, interleave, scaled):
    if name == "srelu" and interleave:
        pytest.skip("sReLU has no halves to interleave")
    width = f if name == "srelu" else 2 * f
    x = _leaf(37, width, scale=10.0)  # past the clamp limit on both sides
    s = torch.rand(37).requires_grad_() if scaled else None
    kw = {} if name == "srelu" else {"interleave": interleave}
    with poisoning():
        y = fn(x, s, **kw)
        g = torch.randn_like(y)
        grads = torch.autograd.grad(y, [x] + ([s] if scaled else []), g)
    xd = x.detach().double().requires_grad_()
    sd = s.detach().double().requires_grad_() if scaled else None
    yr = rf(xd, sd, **kw)
    rgrads = torch.autograd.grad(yr, [xd] + ([sd] if scaled else []), g.double())
    for a, b in zip((y, *grads), (yr, *rgrads)):
        assert torch.isfinite(a).all()  # poisoned before the launch: every element written
        assert _rel(a, b) < 2e-6


def test_activation_kernels_round_bf16_once():
    """The kernel works in fp32 and rounds to bf16 once, at the store.

    Its fp32 result is a few fp32 ulps from the exact value, so where the exact value sits
    within that of a bf16 rounding midpoint either neighbour is right; everywhere else the
    output is the correctly rounded bf16 of the exact value. A kernel that rounded an
    intermediate to bf16 (silu(a) before the product) misses by whole bf16 ulps.
    """
    x = torch.randn(29, 2 * 67).to(torch.bfloat16)
    y = glu.swiglu(x).double()
    exact = ref.swiglu(x.double())
    nearest = exact.to(torch.bfloat16).double()
    slack = 1e-6 * exact.abs()  # ~8 fp32 ulps: the kernel's own fp32 error
    assert ((y - exact).abs() <= (nearest - exact).abs() + slack).all()
    assert (y != nearest).float().mean() < 0.01  # ties are rare; a second rounding is not


@pytest.mark.parametrize("splits", [[5, 0, 17, 1, 14], [37, 0, 0, 0, 0], [0, 0, 0, 0, 37], [1, 15, 17, 3, 1]])
@pytest.mark.parametrize("bias", [False, True])
def test_grouped_gemm_forward_dgrad_wgrad(splits, bias):
    m = torch.tensor(splits)
    x, w = _leaf(37, 40), _leaf(5, 24, 40, scale=0.2)
    b = _leaf(5, 24) if bias else None
    with poisoning():
        y = tgg.grouped_gemm(x, w, m, b)
        g = torch.randn_like(y)
        grads = torch.autograd.grad(y, [x, w] + ([b] if bias else []), g)
    dd = [t.detach().double().requires_grad_() for t in (x, w, *([b] if bias else []))]
    yr = ref.grouped_gemm(dd[0], dd[1], m, dd[2] if bias else None)
    rgrads = torch.autograd.grad(yr, dd, g.double())
    for a, r in zip((y, *grads), (yr, *rgrads)):
        assert torch.isfinite(a).all()
        assert _rel(a, r) < 2e-6
    for e, c in enumerate(splits):  # zero-token experts: zero wgrad (and zero bias gradient)
        if c == 0:
            assert torch.equal(grads[1][e], torch.zeros_like(grads[1][e]))


def test_grouped_wgrad_leaves_idle_accumulating_buffers_bitwise_untouched():
    m = torch.tensor([4, 0, 0, 9])
    x, dy = torch.randn(13, 16), torch.randn(13, 8)
    main = torch.randn(4, 8, 16)
    main[1, 0, 0] = -0.0  # adding a zero would turn this into +0.0
    flags = torch.tensor([True, True, False, False])
    out = tgg.grouped_wgrad(x, dy, m, main.clone(), flags)
    assert torch.equal(out[1], main[1]) and torch.signbit(out[1, 0, 0])
    assert torch.equal(out[2], torch.zeros(8, 16))
    expect = ref.grouped_wgrad(x.double(), dy.double(), m, main.double(), flags)
    assert _rel(out, expect) < 2e-6


@pytest.mark.parametrize("activation", ["swiglu", "clamped_swiglu", "srelu"])
def test_grouped_mlp_matches_float64(activation):
    t, h, f, e = 29, 24, 32, 3
    m = torch.tensor([11, 0, 18])
    width = f if activation == "srelu" else 2 * f
    ins = [_leaf(t, h), _leaf(e, width, h, scale=h ** -0.5), _leaf(e, h, f, scale=f ** -0.5),
           _leaf(e, width), _leaf(e, h), torch.rand(t).requires_grad_()]
    kw = dict(activation=activation, interleave=0 if activation == "srelu" else 32)
    with poisoning():
        y = tmlp.grouped_mlp(ins[0], ins[1], ins[2], m, *ins[3:], **kw)
        g = torch.randn_like(y)
        grads = torch.autograd.grad(y, ins, g)
    dd = [t_.detach().double().requires_grad_() for t_ in ins]
    yr = ref.grouped_mlp(dd[0], dd[1], dd[2], m, *dd[3:], **kw)
    rgrads = torch.autograd.grad(yr, dd, g.double())
    for a, r in zip((y, *grads), (yr, *rgrads)):
        assert torch.isfinite(a).all()
        assert _rel(a, r) < 5e-6


def test_kernels_refuse_what_they_do_not_take():
    with pytest.raises(ValueError, match="even width"):
        glu.swiglu(torch.randn(4, 7))
    with pytest.raises(ValueError, match="multiple"):
        glu.swiglu(torch.randn(4, 2 * 40), interleave=32)
    with pytest.raises(ValueError, match="scale must be fp32"):
        glu.swiglu(torch.randn(4, 8), torch.rand(3))
    with pytest.raises(ValueError, match="m_splits must be an integer tensor"):
        tgg.grouped_gemm(torch.randn(4, 8), torch.randn(2, 3, 8), torch.tensor([2.0, 2.0]))
    with pytest.raises(ValueError, match="x must be"):
        tgg.grouped_gemm(torch.randn(4, 8), torch.randn(2, 3, 9), torch.tensor([2, 2]))


def test_native_grouped_gemm_reads_the_counts_on_the_host():
    """The baseline loops over experts with the counts on the host; the fused kernel takes the
    same device tensor without reading it (checked for real on the GPU: tests/kernels/test_gpu.py)."""
    m = torch.tensor([2, 2])
    x, w = torch.randn(4, 8), torch.randn(2, 3, 8)
    torch.testing.assert_close(native.grouped_gemm(x, w, m), tgg.grouped_gemm(x, w, m))


# --- layouts ------------------------------------------------------------------------------------

def test_fc1_interleave_round_trip_and_kernel_agreement():
    w = torch.randn(3, 2 * 64, 16)
    b = torch.randn(3, 2 * 64)
    wi, bi = layouts.interleave_fc1(w, 32), layouts.interleave_fc1_bias(b, 32)
    assert torch.equal(layouts.deinterleave_fc1(wi, 32), w)
    assert torch.equal(layouts.deinterleave_fc1_bias(bi, 32), b)
    # an interleaved FC1 with the interleaved activation computes what the plain pair computes
    x, m = torch.randn(10, 16, dtype=torch.float64), torch.tensor([4, 0, 6])
    plain = ref.swiglu(ref.grouped_gemm(x, w.double(), m, b.double()))
    inter = ref.swiglu(ref.grouped_gemm(x, wi.double(), m, bi.double()), interleave=32)
    torch.testing.assert_close(plain, inter)


def _sd(groups=4, bias=True):
    sd = {"decoder.fc1.weight": torch.randn(groups, 6, 5), "other": torch.ones(2)}
    if bias:
        sd["decoder.fc1.bias"] = torch.randn(groups, 6)
    return sd


@pytest.mark.parametrize("bias", [True, False])
def test_grouped_indexed_round_trip(bias):
    sd = _sd(bias=bias)
    split = layouts.to_indexed(sd, "decoder.fc1.", 4)
    assert split.changed and "decoder.fc1.weight" not in split.state_dict
    assert torch.equal(split.state_dict["decoder.fc1.weight2"], sd["decoder.fc1.weight"][2])
    assert ("decoder.fc1.bias3" in split.state_dict) == bias
    merged = layouts.to_grouped(split.state_dict, "decoder.fc1.", 4)
    assert merged.changed and list(merged.state_dict) == list(sd)
    assert all(torch.equal(merged.state_dict[k], sd[k]) for k in sd)


def test_conversions_that_cannot_be_clean_leave_the_state_dict_unchanged():
    sd = _sd()
    split = layouts.to_indexed(sd, "decoder.fc1.", 4).state_dict
    incomplete = {k: v for k, v in split.items() if k != "decoder.fc1.weight1"}
    r = layouts.to_grouped(incomplete, "decoder.fc1.", 4)
    assert not r.changed and r.state_dict is incomplete and "weight1 is missing" in r.status
    both = dict(split, **{"decoder.fc1.weight": sd["decoder.fc1.weight"]})
    for conv in (layouts.to_grouped, layouts.to_indexed):
        r = conv(both, "decoder.fc1.", 4)
        assert not r.changed and r.state_dict is both and "already present" in r.status
    r = layouts.to_indexed(sd, "decoder.fc1.", 3)  # the group count does not match
    assert not r.changed and "not [3, ...]" in r.status
    r = layouts.to_grouped(split, "decoder.fc1.", 3)  # weight3 exists: more than 3 groups
    assert not r.changed and "more than 3 groups" in r.status
    r = layouts.to_grouped({"other": torch.ones(1)}, "decoder.fc1.", 4)
    assert not r.changed and "no decoder.fc1.weight0" in r.status
    assert list(sd) == ["decoder.fc1.weight", "other", "decoder.fc1.bias"]  # the input was not touched


# --- CLI ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args,needle", [
    (["--kernel", "swiglu", "--shape", "37x96x1"], "TxHxFxE"),
    (["--kernel", "swiglu", "--shape", "37x1x67x1", "--scenario", "tests/data/interleave-odd.toml"], "needs ffn to be a multiple of 32"),
    (["--kernel", "swiglu,sinkhorn", "--shape", "37x1x96x1"], "one form per kind"),
    (["--kernel", "grouped_mlp", "--impl", "cutile"], "mhctool has no cuTile implementation of grouped_mlp"),
])
def test_moe_bad_input_exit_2(tmp_path, args, needle):
    res = runner.invoke(app, ["parity", "--device", "cpu", *args, "-o", str(tmp_path / "r.parquet")])
    assert res.exit_code == 2, res.output
    assert needle in res.output
