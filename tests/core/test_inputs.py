"""Seeded inputs: large tensors drawn in blocks on threads give the same values at any thread count."""
import torch

from mhctool.core import inputs
from mhctool.families import generate
from mhctool.core.shapes import parse_shape


def test_blockwise_draws_depend_on_the_seed_and_shape_only(monkeypatch):
    monkeypatch.setattr(inputs, "BIG", 1000)
    monkeypatch.setattr(inputs, "BLOCK", 256)  # 13x3x4x67 has 10,452 values a stream tensor: 41 blocks
    shape = parse_shape("13x3x4x67")
    threads = torch.get_num_threads()
    try:
        runs = []
        for n in (1, 3):
            torch.set_num_threads(n)
            runs.append(generate("h_post_bda", "random", shape, 7, {})[1])
        monkeypatch.setenv("MHCTOOL_DRAW_THREADS", "5")  # a pool worker's share of the cores
        assert inputs.draw_threads() == 5
        runs.append(generate("h_post_bda", "random", shape, 7, {})[1])
    finally:
        torch.set_num_threads(threads)
    for name, t in runs[0].items():
        assert torch.equal(t, runs[2][name]), name
    for name, t in runs[0].items():
        assert torch.equal(t, runs[1][name]), name
    x = runs[0]["x"]
    assert x.shape == (13, 3, 4, 67) and abs(float(x.mean())) < 0.05 and abs(float(x.std()) - 1) < 0.05
    # each block draws values of its own (no block repeats another's)
    flat = x.reshape(-1)
    assert not torch.equal(flat[:256], flat[256:512])
    other = generate("h_post_bda", "random", shape, 8, {})[1]["x"]
    assert not torch.equal(x, other)


def test_small_tensors_are_drawn_as_before_from_the_case_generator():
    g = torch.Generator().manual_seed(3)
    want = torch.randn(5, 7, generator=g)
    assert torch.equal(inputs.randn(torch.Generator().manual_seed(3), 5, 7), want)
    ups = inputs.upstream_grads([torch.empty(())], 1)
    assert ups[0].shape == () and torch.isfinite(ups[0])


def test_every_family_draws_its_large_tensors_where_asked_with_the_small_ones_unchanged(monkeypatch, family_cases):
    """The families scale and shift a large tensor by small ones drawn on the CPU (moved to it):
    with every tensor past BIG, drawing 'on' the CPU gives the default's values for every family
    (tests/kernels/test_gpu.py draws them on a GPU)."""
    monkeypatch.setattr(inputs, "BIG", 64)
    monkeypatch.setattr(inputs, "BLOCK", 4096)
    cases = family_cases
    assert len({k for k, _, _ in cases}) >= 10
    for kernel, name, shape in cases:
        want = generate(kernel, name, shape, 3, {})[1]
        got = generate(kernel, name, shape, 3, {}, draw_on="cpu")[1]
        assert want.keys() == got.keys()
        for k, t in want.items():
            assert (t is None and got[k] is None) or torch.equal(t, got[k]), (kernel, name, k)


def test_every_family_combines_large_tensors_on_another_device_with_its_small_ones(monkeypatch, family_cases):
    """A GPU case draws its large tensors on the GPU and the small ones on the CPU: every family must
    move the small ones over before combining. Large tensors 'drawn' on the meta device (shapes
    only) stand in for the GPU: an operation mixing devices raises."""
    import math

    def on_meta(g, shape, normal):
        int(torch.randint(0, 1 << 62, (1,), generator=g))
        return torch.empty(math.prod(shape), device="meta").view(*shape)
    monkeypatch.setattr(inputs, "BIG", 64)
    monkeypatch.setattr(inputs, "_blocks", on_meta)
    for kernel, name, shape in family_cases:
        raw = generate(kernel, name, shape, 3, {}, draw_on="meta")[1]
        assert any(t is not None and t.is_meta for t in raw.values()), (kernel, name)
