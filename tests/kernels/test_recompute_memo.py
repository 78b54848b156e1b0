"""The fused pre-path's recompute from its forward's kept mapping and h_res
(``schedule.recompute_memo``): the recompute of Megatron's mHC checkpoint runs the pre-path again on
the same saved inputs, and with the memo it runs the mapping (a pass over x) and Sinkhorn once, in
the forward. Triton through the interpreter
on the CPU; both backends on the GPU."""
import importlib

import pytest
import torch

from mhctool.core.poison import poisoning
from mhctool.core.shapes import parse_shape_for
from mhctool.families import generate
from mhctool.kernels.schedule import recompute_memo

CASES = [pytest.param("triton", "cpu", id="triton-cpu"),
         pytest.param("triton", "cuda", id="triton-gpu", marks=pytest.mark.gpu),
         pytest.param("cutile", "cuda", id="cutile-gpu", marks=pytest.mark.gpu)]


def _inputs(device, shape="5x3x4x37"):  # 15 tokens, K = 148: no tile's multiple
    """The family's own random case (x and the weight in bf16, as the model gives them), and
    upstream gradients of the three outputs."""
    _, t = generate("mix_aggregate", "random", parse_shape_for("mhc", shape), 7, {}, device=device)
    x, w = t["x"].bfloat16(), t["weight"].bfloat16()
    g = torch.Generator(device=device).manual_seed(8)
    s, b, n, c = x.shape
    ups = [torch.randn(s, b, c, generator=g, device=device).bfloat16(), torch.randn(s, b, n, generator=g, device=device),
           torch.randn(s, b, n, n, generator=g, device=device)]
    return (x, w, t["alpha"], t["h_bias"]), ups


def _counted(monkeypatch, mod, backend):
    """Counts the mapping's forward launches of ``mod`` (its one pass over x before the aggregation)
    and Sinkhorn's forward launches."""
    calls, mixes = [], []
    if backend == "triton":
        real = mod.mapping_forward
        monkeypatch.setattr(mod, "mapping_forward", lambda *a, **k: calls.append(1) or real(*a, **k))
    else:
        real = mod.map_.forward
        monkeypatch.setattr(mod.map_, "forward", lambda *a, **k: calls.append(1) or real(*a, **k))
    real_mix = mod.sinkhorn_forward
    monkeypatch.setattr(mod, "sinkhorn_forward", lambda *a, **k: mixes.append(1) or real_mix(*a, **k))
    return calls, mixes


@pytest.mark.parametrize("backend,device", CASES)
def test_the_recompute_takes_the_forwards_mapping_and_gives_the_same_bits(monkeypatch, backend, device):
    """A forward without grad under a memo, its outputs' memory then freed (as Megatron's checkpoint
    frees it), and the recompute under the same key with grad: the mapping and Sinkhorn ran once,
    the slot is empty after, and the recompute's outputs and all four gradients have the bits of a plain call
    with grad. Under another key (inputs the caller does not vouch for) the mapping runs again."""
    mod = importlib.import_module(f"mhctool.kernels.{backend}.mix_aggregate")
    inputs, ups = _inputs(device)

    def with_grad():
        leaves = [t.clone().requires_grad_() for t in inputs]
        outs = mod.mix_aggregate(*leaves)
        return outs, torch.autograd.grad(outs, leaves, ups)

    with poisoning():
        want_outs, want_grads = with_grad()
        calls, mixes = _counted(monkeypatch, mod, backend)
        slot = {}
        with recompute_memo(slot, ("call", 1)), torch.no_grad():
            first = mod.mix_aggregate(*inputs)
        for t in first:  # what CheckpointWithoutOutput does to the forward's outputs
            t.untyped_storage().resize_(0)
        assert len(calls) == len(mixes) == 1 and slot
        with recompute_memo(slot, ("call", 1)):
            got_outs, got_grads = with_grad()
        assert len(calls) == len(mixes) == 1 and not slot  # the recompute took the kept mapping and h_res, once
        for name, w, g in zip(("out", "h_post", "h_res", "dx", "dweight", "dalpha", "dh_bias"),
                              (*want_outs, *want_grads), (*got_outs, *got_grads)):
            assert torch.isfinite(w).all(), name
            assert torch.equal(w, g), name
        with recompute_memo(slot, ("call", 2)), torch.no_grad():
            mod.mix_aggregate(*inputs)
        with recompute_memo(slot, ("call", 3)):
            other_outs, _ = with_grad()
        assert len(calls) == len(mixes) == 3  # a key that differs is no recompute of that forward
        assert all(torch.equal(w, g) for w, g in zip(want_outs, other_outs))
