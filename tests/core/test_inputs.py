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
