"""The grouped MoE GEMMs with the token counts per expert on the device: the grouped GEMM, its
weight gradient (accumulated into main_grad where an expert's mask says so) and the whole grouped
MLP (FC1, activation, FC2)."""
from __future__ import annotations

import torch

from mhctool.core.inputs import InputFamily, rand, randn
from mhctool.families.activations import INTERLEAVE, SCALED, check_interleave
from mhctool.families.contract import Cost, Family, Knob
from mhctool.references import moe as moe_ref

ODD_COUNTS = (1, 15, 17, 31, 33, 63, 65, 127, 129)  # around every power-of-two block size


def _splits(g, tokens: int, experts: int, kind: str) -> torch.Tensor:
    """Token counts per expert summing to ``tokens`` (int64)."""
    if kind == "one_expert":
        counts = torch.zeros(experts, dtype=torch.int64)
        counts[int(torch.randint(0, experts, (1,), generator=g, device=g.device))] = tokens
        return counts
    if kind == "odd_splits":
        counts = torch.tensor([ODD_COUNTS[i % len(ODD_COUNTS)] for i in range(experts)], dtype=torch.int64)
        while counts.sum() > tokens:  # few tokens: drop counts from the end
            counts[int((counts > 0).nonzero().max())] = 0
        counts[-1] += tokens - counts.sum()
        return counts
    weights = 0.1 + rand(g, experts).cpu()
    if kind == "zero_experts":  # every other expert (and a random one more) gets no token
        weights[::2] = 0.0
        weights[int(torch.randint(0, experts, (1,), generator=g, device=g.device))] = 0.0
        if weights.sum() == 0:
            weights[-1] = 1.0
    counts = torch.floor(weights / weights.sum() * tokens).to(torch.int64)
    counts[int(weights.argmax())] += tokens - counts.sum()
    return counts


def _grouped(kernel: str, kind: str):
    def gen(shape, g, knobs):
        t, h, f, e = shape.tokens, shape.hidden, shape.ffn, shape.experts
        splits = _splits(g, t, e, kind)
        x = randn(g, t, h)
        if kernel == "grouped_gemm":
            out = {"x": x, "weight": randn(g, e, f, h) / h ** 0.5, "m_splits": splits}
            out["bias"] = randn(g, e, f) if knobs.get("bias", False) else None
            return out
        if kernel == "grouped_wgrad":
            out = {"x": x, "grad_out": randn(g, t, f), "m_splits": splits, "main_grad": None, "accumulate": None}
            if knobs.get("accumulate", "mask") == "mask":
                out["main_grad"] = randn(g, e, f, h)
                out["accumulate"] = rand(g, e).cpu() < 0.5
            return out
        check_interleave(shape, knobs)
        width = f if knobs.get("activation", "swiglu") == "srelu" else 2 * f
        out = {"x": x, "fc1_weight": randn(g, e, width, h) / h ** 0.5,
               "fc2_weight": randn(g, e, h, f) / f ** 0.5, "m_splits": splits}
        with_bias = knobs.get("bias", True)
        out["fc1_bias"] = randn(g, e, width) if with_bias else None
        out["fc2_bias"] = randn(g, e, h) if with_bias else None
        out["scale"] = rand(g, t) if knobs.get("scaled", True) else None
        return out
    return gen


def _grouped_families(kernel: str) -> dict[str, InputFamily]:
    fams = [
        InputFamily("random", "tokens spread over every expert, uneven counts", _grouped(kernel, "random")),
        InputFamily("zero_experts", "about half of the experts get no token: zero wgrad, untouched buffers",
                    _grouped(kernel, "zero_experts")),
        InputFamily("one_expert", "one expert takes every token", _grouped(kernel, "one_expert")),
        InputFamily("odd_splits", "counts 1, 15, 17, 31, 33, 63, 65, ...: no count a multiple of a block size",
                    _grouped(kernel, "odd_splits")),
    ]
    # no past-the-clamp family for the whole MLP: there the clamp acts on the FC1 output, which a
    # bf16 implementation rounds (flipping elements across the limit, where the gradient jumps)
    # and the float64 reference does not; the clamp is checked at the activation kernels, whose
    # reference sees the same rounded input (family past_clamp of clamped_swiglu and swiglu)
    return {f.name: f for f in fams}


def _gemm_cost(shape, e: int, f: int) -> Cost:
    T, H, F, G = shape.tokens, shape.hidden, shape.ffn, shape.experts
    return Cost(T * H * e + G * F * H * e + T * F * e, 2 * T * H * e + 2 * G * F * H * e + T * F * e,
                2.0 * T * H * F, 4.0 * T * H * F)


def _wgrad_cost(shape, e: int, f: int) -> Cost:
    T, H, F, G = shape.tokens, shape.hidden, shape.ffn, shape.experts
    return Cost(T * H * e + T * F * e + 2 * G * F * H * f, 0.0, 2.0 * T * H * F, 0.0)


def _mlp_cost(shape, e: int, f: int) -> Cost:
    T, H, F, G = shape.tokens, shape.hidden, shape.ffn, shape.experts
    W = 2 * F  # with its default SwiGLU
    fwd = T * H * e + G * W * H * e + G * H * F * e + 2 * T * W * e + 2 * T * F * e + T * H * e + T * f
    return Cost(fwd, 2 * fwd, 2.0 * T * H * (W + F), 4.0 * T * H * (W + F))


def _grouped_family(name, inputs, differentiable, mapping, outputs, knobs, reference, cost, triton,
                    forward_only=False, optional_inputs=()):
    return Family(name, inputs, differentiable, mapping, outputs, knobs, (), reference, shape_kind="moe",
                  forward_only=forward_only, input_families=_grouped_families(name), optional_inputs=optional_inputs,
                  kernels={"triton": triton}, cost=cost)


GROUPED_GEMM = _grouped_family("grouped_gemm", ("x", "weight", "m_splits", "bias"), ("x", "weight", "bias"), (),
                               ("out",), {"bias": Knob(False, (False, True), bool, passed=False)}, moe_ref.grouped_gemm,
                               _gemm_cost, "mhctool.kernels.triton.grouped_gemm:grouped_gemm", optional_inputs=("bias",))
GROUPED_WGRAD = _grouped_family("grouped_wgrad", ("x", "grad_out", "m_splits", "main_grad", "accumulate"), (),
                                ("main_grad",), ("wgrad",), {"accumulate": Knob("mask", ("mask", "none"), passed=False)},
                                moe_ref.grouped_wgrad, _wgrad_cost, "mhctool.kernels.triton.grouped_gemm:grouped_wgrad",
                                forward_only=True)
GROUPED_MLP = _grouped_family(
    "grouped_mlp", ("x", "fc1_weight", "fc2_weight", "m_splits", "fc1_bias", "fc2_bias", "scale"),
    ("x", "fc1_weight", "fc2_weight", "fc1_bias", "fc2_bias", "scale"), ("scale",), ("out",),
    {"activation": Knob("swiglu", moe_ref.ACTIVATIONS), "interleave": INTERLEAVE,
     "bias": Knob(True, (False, True), bool, passed=False), "scaled": SCALED},
    moe_ref.grouped_mlp, _mlp_cost, "mhctool.kernels.triton.grouped_mlp:grouped_mlp")
