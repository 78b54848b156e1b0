"""The float64 references against hand-computed values and torch.autograd.gradcheck."""
import math

import pytest
import torch

from mhctool.references import mhc as ref

D = torch.float64


def test_sinkhorn_one_iteration_by_hand():
    logits = torch.tensor([[0.0, math.log(3.0)], [math.log(2.0), 0.0]], dtype=D)
    # rowmax: rows [1/3, 1], [1, 1/2]; the max cancels in the row step: rows [1/4, 3/4], [2/3, 1/3]
    # columns then: col sums 11/12 and 13/12
    out = ref.sinkhorn(logits, iters=1, eps=0.0)
    expect = torch.tensor([[0.25 / (11 / 12), 0.75 / (13 / 12)], [(2 / 3) / (11 / 12), (1 / 3) / (13 / 12)]], dtype=D)
    torch.testing.assert_close(out, expect, rtol=1e-12, atol=1e-12)


def test_sinkhorn_col_first_by_hand():
    logits = torch.tensor([[0.0, math.log(3.0)], [math.log(2.0), 0.0]], dtype=D)
    out = ref.sinkhorn(logits, iters=1, eps=0.0, order="col_first", stabilize="none")
    m = torch.tensor([[1.0, 3.0], [2.0, 1.0]], dtype=D)
    m = m / m.sum(0, keepdim=True)
    m = m / m.sum(1, keepdim=True)
    torch.testing.assert_close(out, m, rtol=1e-12, atol=1e-12)


def test_sinkhorn_eps_modes_differ_only_on_small_sums():
    m = torch.tensor([[[0.0, -40.0], [-40.0, -40.0]]], dtype=D)
    add = ref.sinkhorn(m, iters=1, eps=1e-6, eps_mode="add", stabilize="none")
    clamp = ref.sinkhorn(m, iters=1, eps=1e-6, eps_mode="clamp", stabilize="none")
    # the second row sums to 2e^-40 << eps: add divides by eps, clamp by eps too; the first row
    # sums to ~1: add gives 1/(1+eps), clamp gives exactly 1
    assert add[0, 0, 0] != clamp[0, 0, 0]
    big = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=D)
    torch.testing.assert_close(ref.sinkhorn(big, 3, 1e-9, eps_mode="add"),
                               ref.sinkhorn(big, 3, 1e-9, eps_mode="clamp"), rtol=1e-8, atol=1e-8)


def test_sinkhorn_converges_to_doubly_stochastic():
    g = torch.Generator().manual_seed(0)
    p = ref.sinkhorn(torch.randn(16, 4, 4, generator=g, dtype=D), iters=200, eps=0.0)
    torch.testing.assert_close(p.sum(-1), torch.ones(16, 4, dtype=D))
    torch.testing.assert_close(p.sum(-2), torch.ones(16, 4, dtype=D))


def test_sinkhorn_stabilize_variants():
    g = torch.Generator().manual_seed(1)
    L = torch.randn(8, 4, 4, generator=g, dtype=D)
    # rowmax and none agree where nothing overflows (eps=0 makes the row scale cancel exactly)
    torch.testing.assert_close(ref.sinkhorn(L, 5, 0.0, stabilize="rowmax"), ref.sinkhorn(L, 5, 0.0, stabilize="none"))
    # none overflows past about 709 in float64, rowmax does not
    assert not torch.isfinite(ref.sinkhorn(L + 800, 5, 1e-6, stabilize="none")).all()
    assert torch.isfinite(ref.sinkhorn(L + 800, 5, 1e-6, stabilize="rowmax")).all()
    # softmax: softmax + eps, then the column step first (DeepSeek's order)
    sm = torch.softmax(L, -1) + 1e-6
    sm = sm / (sm.sum(-2, keepdim=True) + 1e-6)
    torch.testing.assert_close(ref.sinkhorn(L, 1, 1e-6, stabilize="softmax"), sm)


@pytest.mark.parametrize("stabilize", ref.STABILIZE)
@pytest.mark.parametrize("order", ref.ORDERS)
@pytest.mark.parametrize("eps_mode", ref.EPS_MODES)
def test_sinkhorn_takes_several_iteration_counts_at_once(stabilize, order, eps_mode):
    """identify's and stability's grids: the matrices after 1, 3 and 6 iterations from one run,
    bit for bit those of three runs, with an eps grid along a leading axis as well."""
    L = torch.randn(5, 3, 4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) * 4
    eps = torch.tensor([1e-8, 1e-6, 1e-3], dtype=torch.float64).reshape(-1, 1, 1, 1, 1)
    many = ref.sinkhorn(L, (1, 3, 6), eps, stabilize=stabilize, order=order, eps_mode=eps_mode)
    assert many.shape == (3, 3, 5, 3, 4, 4)
    for k, it in enumerate((1, 3, 6)):
        assert torch.equal(many[k], ref.sinkhorn(L, it, eps, stabilize=stabilize, order=order, eps_mode=eps_mode))
    with pytest.raises(ValueError, match="increasing"):
        ref.sinkhorn(L, (3, 1), 1e-6)


def test_sinkhorn_rejects_unknown_knob_values():
    with pytest.raises(ValueError):
        ref.sinkhorn(torch.zeros(2, 2, dtype=D), stabilize="log")
    with pytest.raises(ValueError):
        ref.sinkhorn(torch.zeros(2, 2, dtype=D), order="diagonal")


def test_h_aggregate_and_h_post_bda_by_hand():
    x = torch.arange(1.0, 9.0, dtype=D).reshape(1, 1, 2, 4)  # streams [1..4], [5..8]
    h_pre = torch.tensor([[[0.5, 2.0]]], dtype=D)
    torch.testing.assert_close(ref.h_aggregate(x, h_pre), torch.tensor([[[10.5, 13.0, 15.5, 18.0]]], dtype=D))
    h_res = torch.tensor([[[[0.0, 1.0], [2.0, 0.0]]]], dtype=D)
    h_post = torch.tensor([[[1.0, 0.5]]], dtype=D)
    y = torch.ones(1, 1, 4, dtype=D)
    bias = torch.tensor([0.0, 1.0, 2.0, 3.0], dtype=D)
    out = ref.h_post_bda(h_res, x, h_post, y, bias)
    expect = torch.stack([x[0, 0, 1] + (y + bias)[0, 0], 2 * x[0, 0, 0] + 0.5 * (y + bias)[0, 0]])
    torch.testing.assert_close(out[0, 0], expect)
    out_t = ref.h_post_bda(h_res, x, h_post, y, None, transpose_res=True)
    expect_t = torch.stack([2 * x[0, 0, 1] + y[0, 0], x[0, 0, 0] + 0.5 * y[0, 0]])
    torch.testing.assert_close(out_t[0, 0], expect_t)


def test_proj_rms_by_hand():
    x = torch.tensor([[3.0, 4.0]], dtype=D)
    w = torch.tensor([[1.0, 0.0], [1.0, 1.0]], dtype=D)
    proj, r = ref.proj_rms(x, w, eps=0.5)
    torch.testing.assert_close(proj, torch.tensor([[3.0, 7.0]], dtype=D))
    # ||x|| / sqrt(K) = 5 / sqrt(2); eps outside the root
    torch.testing.assert_close(r, torch.tensor([1.0 / (5 / math.sqrt(2) + 0.5)], dtype=D))


def test_compute_h_layout_and_activations():
    n = 2
    proj = torch.arange(8.0, dtype=D).reshape(1, 8) / 10
    r = torch.tensor([2.0], dtype=D)
    alpha = torch.tensor([1.0, 0.5, 0.25], dtype=D)
    bias = torch.full((8,), 0.1, dtype=D)
    h_pre, h_post, logits = ref.compute_h(proj, r, alpha, bias, n)
    h = 2.0 * proj[0] * torch.tensor([1, 1, 0.5, 0.5, 0.25, 0.25, 0.25, 0.25], dtype=D) + 0.1
    torch.testing.assert_close(h_pre[0], torch.sigmoid(h[:2]))
    torch.testing.assert_close(h_post[0], 2 * torch.sigmoid(h[2:4]))
    torch.testing.assert_close(logits[0], h[4:].reshape(2, 2))


def test_expand_contract_roundtrip():
    x = torch.randn(3, 2, 5, dtype=D)
    e = ref.expand(x, 4)
    assert e.shape == (3, 2, 4, 5)
    torch.testing.assert_close(ref.contract(e), x)


def test_mhc_layer_identity_branch_preserves_mean_stream():
    """With a doubly-stochastic H_res and F = 0, contract(x') = contract(H_res x) keeps the mean."""
    g = torch.Generator().manual_seed(3)
    s, b, n, c = 2, 3, 4, 8
    x = torch.randn(s, b, n, c, generator=g, dtype=D)
    w = torch.randn(n * n + 2 * n, n * c, generator=g, dtype=D) * 0.1
    out = ref.mhc_layer(x, w, torch.tensor([1.0, 1.0, 1.0], dtype=D), torch.zeros(n * n + 2 * n, dtype=D),
                        lambda a: torch.zeros_like(a), sinkhorn_iters=200, sinkhorn_eps=0.0)
    torch.testing.assert_close(ref.contract(out), ref.contract(x), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("stabilize", ["rowmax", "none", "softmax"])
@pytest.mark.parametrize("eps_mode", ["add", "clamp"])
@pytest.mark.parametrize("order", ["row_first", "col_first"])
def test_sinkhorn_gradcheck(stabilize, eps_mode, order):
    g = torch.Generator().manual_seed(4)
    L = torch.randn(3, 4, 4, generator=g, dtype=D, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda t: ref.sinkhorn(t, 4, 1e-3, stabilize=stabilize, eps_mode=eps_mode, order=order), (L,))


def test_primitives_gradcheck():
    g = torch.Generator().manual_seed(5)
    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=D, requires_grad=True)
    assert torch.autograd.gradcheck(ref.h_aggregate, (r(2, 1, 3, 5), r(2, 1, 3)))
    assert torch.autograd.gradcheck(lambda *a: ref.h_post_bda(*a), (r(2, 1, 3, 3), r(2, 1, 3, 5), r(2, 1, 3), r(2, 1, 5), r(5)))
    assert torch.autograd.gradcheck(lambda *a: ref.h_post_bda(*a, transpose_res=True), (r(2, 1, 3, 3), r(2, 1, 3, 5), r(2, 1, 3), r(2, 1, 5), r(5)))
    assert torch.autograd.gradcheck(lambda x, w: ref.proj_rms(x, w, 1e-3), (r(4, 6), r(5, 6)))
    assert torch.autograd.gradcheck(lambda p, rr, a, bb: ref.compute_h(p, rr, a, bb, 2), (r(3, 8), r(3), r(3), r(8)))


def test_mix_aggregate_is_mapping_then_sinkhorn_then_aggregation_by_hand():
    # n = 1, C = 2: N = 3 columns (pre, post, res); one token x = [3, 4], so ||x|| / sqrt(2) = 5/sqrt(2)
    x = torch.tensor([3.0, 4.0], dtype=D).reshape(1, 1, 1, 2)
    weight = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], dtype=D)
    alpha = torch.tensor([1.0, 2.0, 0.5], dtype=D)
    h_bias = torch.tensor([0.0, 0.1, 0.0], dtype=D)
    out, h_post, h_res = ref.mix_aggregate(x, weight, alpha, h_bias, eps=0.0, sinkhorn_eps=0.0)
    r = math.sqrt(2) / 5
    h_pre = 1 / (1 + math.exp(-(3.0 * r)))
    torch.testing.assert_close(out, torch.tensor([[[3.0 * h_pre, 4.0 * h_pre]]], dtype=D), rtol=1e-12, atol=0)
    torch.testing.assert_close(h_post, torch.tensor([[[2 / (1 + math.exp(-(4.0 * r * 2.0 + 0.1)))]]], dtype=D),
                               rtol=1e-12, atol=0)
    torch.testing.assert_close(h_res, torch.ones(1, 1, 1, 1, dtype=D))  # a 1 x 1 doubly stochastic matrix
    # n = 4 with random inputs: each output is its piece of the chain, and the conventions reach them
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2, 4, 5, generator=g, dtype=D)
    weight, alpha, h_bias = torch.randn(24, 20, generator=g, dtype=D), torch.rand(3, generator=g, dtype=D), \
        torch.randn(24, generator=g, dtype=D)
    kw = dict(rms_eps="inside", compute_h_eps=1e-3)
    out, h_post, h_res = ref.mix_aggregate(x, weight, alpha, h_bias, 1e-4, 7, 1e-5, stabilize="softmax", **kw)
    pre, post, logits = ref.mapping(x.reshape(6, 20), weight, alpha, h_bias, 1e-4, **kw)
    torch.testing.assert_close(out, ref.h_aggregate(x, pre.reshape(3, 2, 4)))
    torch.testing.assert_close(h_post, post.reshape(3, 2, 4))
    torch.testing.assert_close(h_res, ref.sinkhorn(logits.reshape(3, 2, 4, 4), 7, 1e-5, stabilize="softmax"))


@pytest.mark.parametrize("mode", ["threshold", "threshold_zero"])
def test_eps_as_a_threshold_keeps_or_zeroes_what_sums_below_it_and_the_native_one_agrees(mode):
    """A column 30 below the rest sums to about 1e-13 after the max subtraction: at eps 1e-6 it is
    left as it is (threshold) or zeroed (threshold_zero); the other columns are normalised."""
    from mhctool.kernels.torch import mhc as native
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 4, 4, generator=g, dtype=torch.float64)
    logits[..., 2] -= 30.0
    out = ref.sinkhorn(logits, 1, 1e-6, eps_mode=mode, order="col_first")
    if mode == "threshold":  # the column kept (tiny, positive), the rows then normalised around it
        assert bool((out[..., 2] > 0).all()) and float(out[..., 2].max()) < 1e-6
    else:
        assert bool((out[..., 2] == 0).all())
    assert torch.allclose(out.sum(-1), torch.ones(6, 4, dtype=torch.float64))  # the rows, normalised last
    assert torch.allclose(native.sinkhorn(logits, 1, 1e-6, eps_mode=mode, order="col_first"), out)


def test_a_clamped_exponential_loses_the_differences_past_its_bound_and_the_native_one_agrees():
    """stabilize=clamp: exp(min(x, clamp_at)). Below the bound it is bare exp (rowmax's matrix, at
    eps 0 rows first); logits all past it give the uniform matrix; the native one computes the same."""
    from mhctool.kernels.torch import mhc as native
    g = torch.Generator().manual_seed(0)
    small = torch.randn(5, 4, 4, generator=g, dtype=torch.float64)
    assert torch.allclose(ref.sinkhorn(small, 20, 0.0, stabilize="clamp", clamp_at=20.0),
                          ref.sinkhorn(small, 20, 0.0, stabilize="rowmax"))
    large = 40.0 + torch.rand(5, 4, 4, generator=g, dtype=torch.float64)
    out = ref.sinkhorn(large, 20, 1e-6, stabilize="clamp", clamp_at=20.0)
    assert torch.allclose(out, torch.full_like(out, 0.25))
    assert not torch.allclose(ref.sinkhorn(large, 20, 1e-6), out)  # the contract keeps the differences
    mixed = 15.0 * torch.randn(5, 4, 4, generator=g, dtype=torch.float64)
    assert torch.allclose(native.sinkhorn(mixed, 20, 1e-6, stabilize="clamp", clamp_at=10.0),
                          ref.sinkhorn(mixed, 20, 1e-6, stabilize="clamp", clamp_at=10.0))


def test_fast_math_changes_the_native_baseline_by_a_few_units_of_fp32_and_not_the_reference():
    """math=fast (a kernel built with --use_fast_math): the float64 reference is the same matrix; the
    native one computes 2^(x log2 e) with the product rounded and reciprocal-multiplies: other
    roundings, as close where the exponent is small, and further past the bound's logits."""
    from mhctool.kernels.torch import mhc as native
    g = torch.Generator().manual_seed(0)
    logits = 3.0 * torch.randn(64, 4, 4, generator=g, dtype=torch.float64)
    assert torch.equal(ref.sinkhorn(logits, math="fast"), ref.sinkhorn(logits))
    exact = ref.sinkhorn(logits)
    out = {m: native.sinkhorn(logits.float(), math=m) for m in ("ieee", "fast")}
    assert not torch.equal(out["ieee"], out["fast"])
    for m, o in out.items():
        assert float((o.double() - exact).abs().max()) < 8 * 2.0 ** -24, m
    x = torch.linspace(-30.0, 0.0, 10001)  # __expf's error grows with |x|: the product's rounding
    ulp = torch.ldexp(torch.ones_like(x, dtype=torch.float64), torch.frexp(x.double().exp())[1] - 24)
    err = {m: ((native._fast_exp(x) if m == "fast" else x.exp()).double() - x.double().exp()).abs() / ulp for m in out}
    assert float(err["ieee"].max()) <= 1.0 < 8.0 < float(err["fast"].max()) < 40.0


def test_sinkhorns_early_stop_and_exp_floor_as_the_contract_says():
    """tol: a matrix stops at the first iteration after which its rows and columns are within tol
    of one (until then it is the full run's); exp_floor: the starting matrix floored. The native
    implementation (linear and log domain) computes both as the float64 reference does."""
    from mhctool.kernels.torch import mhc as native
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 3, 4, 4, generator=g, dtype=torch.float64) * 3
    stopped = ref.sinkhorn(logits, 20, 0.0, tol=1e-6)
    every = ref.sinkhorn(logits, tuple(range(1, 21)), 0.0)  # the full run after each count
    done = ref.converged(every, 1e-6)[..., 0, 0]
    # the count after which each matrix converged (0-based), the last where it never does
    first = torch.where(done.any(0), done.float().argmax(0), torch.full_like(done[0], 19, dtype=torch.long))
    assert (first < 19).any()  # some stop early
    kept = every.gather(0, first.reshape(1, 8, 3, 1, 1).expand(1, 8, 3, 4, 4))[0]
    assert torch.equal(stopped, kept)
    assert torch.equal(ref.sinkhorn(logits, 20, 0.0, tol=0.0), every[-1])
    for domain in ("linear", "log"):
        assert torch.allclose(native.sinkhorn(logits, 20, 0.0, domain=domain, tol=1e-6), stopped, atol=1e-12)
    big = logits * 20
    floored = ref.sinkhorn(big, 20, 0.0, stabilize="none", exp_floor=1e-10)
    by_hand = ref.sinkhorn(torch.log(torch.exp(big).clamp(min=1e-10)), 20, 0.0, stabilize="none")
    assert torch.allclose(floored, by_hand, atol=1e-12) and torch.isfinite(floored).all()
    assert torch.allclose(native.sinkhorn(big, 20, 0.0, stabilize="none", exp_floor=1e-10), floored, atol=1e-12)
