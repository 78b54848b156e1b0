"""The post-path's dropout: the contract's counter-based mask (references/dropout.py) and mhctool's
Triton kernels that draw it inside the kernel, forward and backward, on the CPU through the
interpreter (the GPU's own checks are in test_gpu.py)."""
import math

import pytest
import torch

from mhctool.core.poison import poisoning
from mhctool.kernels.torch import mhc as native
from mhctool.kernels.triton import h_post_bda as thp
from mhctool.references import dropout as D
from mhctool.references import mhc as ref

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests; the GPU runs test_gpu.py")


def philox_words(seed: int, counter: int) -> tuple[int, ...]:
    """Philox-4x32-10 at counter (counter, 0, 0, 0) in Python integers (Random123's rounds)."""
    m = 0xFFFFFFFF
    c0, c1, c2, c3 = counter & m, counter >> 32, 0, 0
    k0, k1 = seed & m, (seed >> 32) & m
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & m, (p0 >> 32) ^ c3 ^ k1, p0 & m
        k0, k1 = (k0 + 0x9E3779B9) & m, (k1 + 0xBB67AE85) & m
    return c0, c1, c2, c3


def test_the_generator_is_philox_4x32_10_in_integer_arithmetic():
    seed = (1 << 62) + 12345  # a key past 32 bits
    counters = [0, 1, 2**32 - 1, 2**32, 2**33 + 7, 2**61 + 3]
    words = D.philox(seed, torch.tensor(counters))
    for j, ctr in enumerate(counters):
        assert tuple(int(w[j]) for w in words) == philox_words(seed, ctr)
    # Random123's known-answer vector for Philox-4x32-10 with a zero key and counter
    zero = D.philox(0, torch.tensor([0]))
    assert [int(w[0]) for w in zero] == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]


def test_the_mask_lays_four_channels_on_a_counter_and_starts_each_row_afresh():
    t, n, c, seed, offset = 3, 2, 7, 99, 2**32 - 3  # counters cross 32 bits
    mask = D.keep((t, n, c), 0.3, seed, offset)
    thr = D.threshold(0.3)
    g = D.counters_per_row(c)
    for tt in range(t):
        for i in range(n):
            for ch in range(c):
                word = philox_words(seed, offset + (tt * n + i) * g + ch // 4)[ch % 4]
                assert bool(mask[tt, i, ch]) == (word >= thr)
    assert D.counters_used(t, n, c) == t * n * g


def test_the_mask_keeps_one_minus_p_and_no_mask_at_zero():
    m = D.keep((512, 4, 257), 0.1, 7, 0)
    frac = float(m.double().mean())
    assert abs(frac - 0.9) < 5 * math.sqrt(0.09 / m.numel())
    assert bool(D.keep((3, 2, 5), 0.0, 7, 0).all())
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        D.threshold(1.0)


def test_the_kernels_key_is_checked_once_for_both_backends():
    k = D.key(30, 0.25, 2**40 + 5, 2**33)
    assert k == D.Key(2**40 + 5, 2**33, 8, D.threshold(0.25), D.scale(0.25))
    assert D.key(30, 0.0, -1, -1).threshold == 0  # no dropout: the key is not used
    for seed, offset in [(-1, 0), (2**63, 0), (0, 2**62)]:
        with pytest.raises(ValueError, match=r"dropout_seed must be in \[0, 2\*\*63\)"):
            D.key(30, 0.25, seed, offset)


def test_apply_drops_rows_of_c_as_the_mask_lays_them():
    post = torch.randn(3, 2, 4, 9, dtype=torch.float64)
    got = D.apply(post, 0.4, 11, 5)
    want = post * D.keep((6, 4, 9), 0.4, 11, 5).view(post.shape).double() / 0.6
    assert torch.equal(got, want)
    assert D.apply(post, 0.0, 11, 5) is post


def _inputs(s, b, n, c, dtype, bias=True):
    h = torch.softmax(torch.randn(s, b, n, n), -1)
    x, y = torch.randn(s, b, n, c).to(dtype), torch.randn(s, b, c).to(dtype)
    hp = 2 * torch.rand(s, b, n)
    return h, x, hp, y, (torch.randn(c).to(dtype) if bias else None)


def _want(h, x, hp, y, bias, go, transpose_res, key):
    dd = [t.double().requires_grad_() if t is not None else None for t in (h, x, hp, y, bias)]
    out = ref.h_post_bda(*dd, transpose_res=transpose_res, dropout=key[0], dropout_seed=key[1], dropout_offset=key[2])
    leaves = [t for t in dd if t is not None]
    return out.detach(), torch.autograd.grad(out, leaves, go.double())


def _close(got, want, dtype, name):
    assert torch.isfinite(got).all(), name
    tol = 1e-5 if got.dtype == torch.float32 else 2**-7
    err = float((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30))
    assert err < tol, f"{name}: {err:.3g}"


KEYS = [(0.1, 4294967311, 4294967000), (0.7, 5, 0)]  # a key and counters past 32 bits; a threshold past 2^31


@pytest.mark.parametrize("key, shape, fwd_tile, bwd_tile", [
    *((k, (13, 3, 4, 67), None, None) for k in KEYS),  # the interpreter's generic kernels: C not a multiple of 4
    *((k, (5, 2, 3, 9), None, None) for k in KEYS),  # another n
    # the n = 4 kernels (the GPU's) at odd C blocks and token groups (their per-token loops are slow here)
    (KEYS[1], (11, 1, 4, 203), (64, 8, 1, 1), (4, 64, 8, 4, 1)),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_dropout_matches_float64_forward_and_backward(key, shape, fwd_tile, bwd_tile, dtype):
    """The mask drawn in the kernel is the contract's (forward) and drawn again from the same key in
    the backward, every output written (NaN-poisoned before), at every kernel mhctool's Triton
    h_post_bda chooses among."""
    h, x, hp, y, bias = _inputs(*shape, dtype)
    go = torch.randn(x.shape).to(dtype)
    for transpose_res in (False, True):
        with poisoning():
            out = thp.h_post_bda_forward(h, x, hp, y, bias, transpose_res, fwd_tile, *key)
            grads = thp.h_post_bda_backward(h, x, hp, y, bias, go, transpose_res, bwd_tile, *key)
        want_out, want_grads = _want(h, x, hp, y, bias, go, transpose_res, key)
        _close(out, want_out, dtype, "out")
        for name, g, w in zip(("h_res", "x", "h_post", "y", "bias"), grads, want_grads):
            _close(g, w, dtype, f"grad_{name}")


def test_triton_dropout_through_autograd_and_its_mask_is_exact():
    """The autograd Function keeps the key for its backward; the dropped elements are exactly the
    mixed streams (the branch zeroed, not rounded small)."""
    h, x, hp, y, bias = _inputs(9, 2, 4, 40, torch.float32)
    key = (0.25, 123, 456)
    leaves = [t.requires_grad_() for t in (h, x, hp, y, bias)]
    out = thp.h_post_bda(*leaves, dropout=key[0], dropout_seed=key[1], dropout_offset=key[2])
    go = torch.randn(out.shape)
    got = torch.autograd.grad(out, leaves, go)
    want_out, want = _want(h, x, hp, y, bias, go, False, key)
    _close(out.detach(), want_out, torch.float32, "out")
    for g, w in zip(got, want):
        _close(g, w, torch.float32, "grad")
    dropped = ~D.keep((18, 4, 40), *key).view(out.shape)
    mixed = thp.h_post_bda_forward(h.detach(), x.detach(), torch.zeros_like(hp), y.detach(), None)
    assert torch.equal(out.detach()[dropped], mixed[dropped])


@pytest.mark.parametrize("key", KEYS)
@pytest.mark.parametrize("dtype, with_bias", [(torch.bfloat16, True), (torch.float16, False)])
def test_the_tensor_core_backward_takes_the_mask_into_its_product(key, dtype, with_bias):
    """The n = 4 tensor-core backward (the GPU's default for 16-bit operands) with dropout: the
    kept gradient rows join the product beside the gradient's own, so dH stays unmasked and
    dh_post, dy and the bias take the mask; at C off its blocks (and not a multiple of 4), tokens
    off its groups, NaN-poisoned, both layouts of h_res, against float64."""
    h, x, hp, y, bias = _inputs(11, 1, 4, 203, dtype, bias=with_bias)
    go = torch.randn(x.shape).to(dtype)
    for transpose_res in (False, True):
        with poisoning():
            grads = thp.h_post_bda_backward(h, x, hp, y, bias, go, transpose_res, (64, 8, 1, 1), *key)
        _, want = _want(h, x, hp, y, bias, go, transpose_res, key)
        for name, g, w in zip(("h_res", "x", "h_post", "y", "bias"), [g for g in grads if g is not None], want):
            _close(g, w, dtype, f"grad_{name}")
    fma = thp.h_post_bda_backward(h, x, hp, y, bias, go, False, (4, 64, 8, 4, 1), *key)
    tc = thp.h_post_bda_backward(h, x, hp, y, bias, go, False, (64, 8, 1, 1), *key)
    assert torch.equal(tc[1], fma[1])  # dx: the residual mix, never dropped, the same products


def test_native_draws_the_contracts_mask():
    h, x, hp, y, bias = _inputs(7, 2, 4, 30, torch.float32)
    key = dict(dropout=0.5, dropout_seed=3, dropout_offset=2**40)
    got = native.h_post_bda(h, x, hp, y, bias, **key)
    want = ref.h_post_bda(*(t.double() for t in (h, x, hp, y, bias)), **key)
    assert float((got.double() - want).abs().max()) < 1e-5


@pytest.mark.parametrize("tile", ["dropout", "tensor-core"])
def test_the_backward_with_the_mask_at_the_gpus_tiles(tile, monkeypatch):
    """The tile a GPU takes with dropout and 16-bit operands (the FMA kernel over 256 channels and
    32-token groups) and the tensor-core kernel's own (two warps over 512 channels: one warp
    spilled with the mask's counters), over a C block and a part and a token group and a part
    (35 tokens, 300 channels; 37 and 700 for the tensor-core tile), against float64, NaN-poisoned."""
    monkeypatch.setattr(thp, "interpreted", lambda: False)  # the tile a GPU picks
    gpu = thp.backward_tile4(torch.bfloat16, tc=True, dropout=True)
    monkeypatch.undo()
    assert gpu == thp.BWD4_TILE_DROPOUT and len(gpu) == 5
    assert len(thp.BWD4_TILE_TC_DROPOUT) == 4
    t = gpu if tile == "dropout" else thp.BWD4_TILE_TC_DROPOUT
    h, x, hp, y, bias = _inputs(*((35, 1, 4, 300) if tile == "dropout" else (37, 1, 4, 700)), torch.bfloat16)
    go = torch.randn(x.shape).to(torch.bfloat16)
    with poisoning():
        grads = thp.h_post_bda_backward(h, x, hp, y, bias, go, True, t, *KEYS[0])
    _, want = _want(h, x, hp, y, bias, go, True, KEYS[0])
    for name, g, w in zip(("h_res", "x", "h_post", "y", "bias"), grads, want):
        _close(g, w, torch.bfloat16, f"grad_{name}")
