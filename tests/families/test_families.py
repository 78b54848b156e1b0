"""Kernel families (mhctool.families): each family's module gives a whole contract, its input
families draw what the contract takes, and its bytes model and kernels are where the registry
and bench read them."""
import importlib
import math

import pytest
import torch

from mhctool.core import inputs
from mhctool.core.errors import UsageError
from mhctool.core.shapes import parse_shape_for
from mhctool.families import FAMILIES, MATMUL_KERNELS, generate, input_family
from mhctool.registry import costs
from mhctool.registry.builtin import CUTILE_KERNELS, TRITON_KERNELS, impls_for

SMALL = {"mhc": "3x2x4x40", "moe": "40x24x16x4"}


@pytest.mark.parametrize("kernel", list(FAMILIES))
def test_every_input_family_draws_the_tensors_the_contract_takes(kernel):
    fam = FAMILIES[kernel]
    assert fam.input_families, kernel
    for name in (*fam.input_families, *fam.stress, *fam.probes):
        _, raw = generate(kernel, name, parse_shape_for(fam.shape_kind, SMALL[fam.shape_kind]), 0, {})
        assert set(raw) == set(fam.inputs), (kernel, name)
        drawn = [t for t in raw.values() if t is not None and t.is_floating_point()]
        assert drawn and all(bool(torch.isfinite(t).all()) for t in drawn), (kernel, name)


@pytest.mark.parametrize("kernel", list(FAMILIES))
def test_every_family_has_a_bytes_model_and_its_kernels_registered(kernel):
    fam = FAMILIES[kernel]
    cost = costs.model(kernel, parse_shape_for(fam.shape_kind, SMALL[fam.shape_kind]), "bf16")
    assert cost.bytes_fwd > 0 and (cost.bytes_bwd > 0) != fam.forward_only
    assert (cost.flops_fwd > 0) == (kernel in MATMUL_KERNELS or fam.shape_kind == "moe" and "grouped" in kernel)
    assert TRITON_KERNELS.get(kernel) == fam.kernels.get("triton") and CUTILE_KERNELS.get(kernel) == fam.kernels.get("cutile")
    for backend, target in fam.kernels.items():
        module, fn = target.split(":")
        assert module.startswith("mhctool.kernels.") and fn, target
        assert backend in {i.name for i in impls_for(kernel)}
        if backend != "cutile":  # cuda.tile may be absent on a CPU machine (tests/kernels/test_cutile.py)
            assert callable(getattr(importlib.import_module(module), fn)), target


def test_an_unknown_input_family_names_the_ones_there_are():
    with pytest.raises(UsageError, match="unknown input family 'bogus' for kernel sinkhorn; accepted: random, "):
        input_family("sinkhorn", "bogus")
    assert input_family("sinkhorn", "underflow_cols").name == "underflow_cols"  # a stress family
    assert input_family("sinkhorn", "eps_sweep").name == "eps_sweep"  # identify's probe


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
    def on_meta(g, shape, normal):
        int(torch.randint(0, 1 << 62, (1,), generator=g))
        return torch.empty(math.prod(shape), device="meta").view(*shape)
    monkeypatch.setattr(inputs, "BIG", 64)
    monkeypatch.setattr(inputs, "_blocks", on_meta)
    for kernel, name, shape in family_cases:
        raw = generate(kernel, name, shape, 3, {}, draw_on="meta")[1]
        assert any(t is not None and t.is_meta for t in raw.values()), (kernel, name)


def test_a_knob_that_means_something_under_another_only_says_so():
    """Sinkhorn's clamp bound means something under stabilize=clamp alone (Knob.only_with): identify
    neither asks for it nor claims it apart from the clamp."""
    from mhctool.families import get_family
    bound = get_family("sinkhorn").knobs["clamp_at"]
    assert bound.applies({"stabilize": "clamp"}) and not bound.applies({"stabilize": "rowmax"})
    assert get_family("sinkhorn").knobs["eps"].applies({})


@pytest.mark.parametrize("kernel", ["mapping_sinkhorn", "mix_aggregate"])
def test_the_composites_probes_reach_sinkhorns_regimes_through_the_mapping(kernel):
    """identify's composite probes (issue 90): the mapping's shared bias cannot make one token's
    logits differ from another's, so the probes set each token's H_res logits through x. Computed
    by the float64 reference mapping, they are where Sinkhorn's own probes are: a column 5 to 80
    below the rest (res_depths), levels of 3 to 75 (res_levels), of about 90 to 300 (res_large)."""
    from mhctool.references import mhc as ref
    shape = parse_shape_for("mhc", "8x4x4x67")

    def logits(name):
        raw = generate(kernel, name, shape, 1, {})[1]
        x = raw["x"].double()
        s, b, n, c = x.shape
        h = ref.mapping(x.reshape(s * b, n * c), raw["weight"].double(), raw["alpha"].double(), raw["h_bias"].double())
        return h[2].reshape(-1, n, n)

    dead = logits("res_depths")
    depth = dead.amax((-1, -2)) - dead[:, :, 0].amax(-1)
    assert depth.min() > 4 and depth.max() > 60, depth
    rows = dead.amax((-1, -2)) - dead[:, 0, 1:].amax(-1)  # the first row, on every other token
    assert (rows[1::2] > 4).all() and (rows[0::2] < 6).all(), rows
    level = logits("res_levels").mean((-1, -2))
    assert level.min() > 2 and level.max() > 40 and logits("res_levels").max() < 88, level
    large = logits("res_large")
    assert large.min() > 80 and large.max() > 200


def test_a_family_caller_plans_its_arguments_once_and_again_when_the_knobs_change():
    """``Family.caller`` (a model's layer calling one function call after call): the keyed knobs
    (h_post_bda's dropout key) come from each call's arguments, the others from the knobs dict,
    planned again whenever that dict changes; an input the function has no parameter for must be
    None. The arguments are those ``Family.arguments`` gives."""
    from mhctool.families import get_family
    fam = get_family("h_post_bda")
    seen = []

    def fn(h_res, x, h_post, y, bias=None, transpose_res=False, dropout=0.0, dropout_seed=0, dropout_offset=0):
        seen.append((h_res, x, h_post, y, bias, transpose_res, dropout, dropout_seed, dropout_offset))
        return "out"

    knobs = {"transpose_res": False, "dropout": 0.1}
    call = fam.caller(fn, knobs, lambda k: True)
    args = {"h_res": 1, "x": 2, "h_post": 3, "y": 4, "bias": None}
    assert call({**args, "dropout_seed": 7, "dropout_offset": 9}) == ("out",)
    call(args)
    knobs["transpose_res"] = True  # the caller's dict changed: planned again
    call({**args, "dropout": 0.2})
    assert seen == [(1, 2, 3, 4, None, False, 0.1, 7, 9), (1, 2, 3, 4, None, False, 0.1, 0, 0),
                    (1, 2, 3, 4, None, True, 0.2, 0, 0)]
    pos, kw = fam.arguments({**args, "dropout_seed": 7}, knobs, lambda k: True)
    assert pos == [1, 2, 3, 4, None] and kw["dropout_seed"] == 7 and kw["transpose_res"] is True
    no_bias = fam.caller(lambda h_res, x, h_post, y: "out", {}, lambda k: False, takes=lambda name: name != "bias")
    assert no_bias(args) == ("out",)
    with pytest.raises(ValueError, match="takes no bias input"):
        no_bias({**args, "bias": 5})
