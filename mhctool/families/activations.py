"""The MoE activations on a token's FC1 output, each optionally scaled by the router's
probability: SwiGLU, SwiGLU clamped at a limit (GPT-OSS's), and squared ReLU."""
from __future__ import annotations

from mhctool.core.errors import UsageError
from mhctool.core.inputs import InputFamily, log_uniform, rand, randn
from mhctool.families.contract import Cost, Family, Knob
from mhctool.references import moe as moe_ref

# the gate and up halves side by side (0) or interleaved in blocks of 32 columns
INTERLEAVE = Knob(0, (0, 32), int)
# the router's probability multiplied in (False: no scale input)
SCALED = Knob(True, (False, True), bool, passed=False)


def _act_width(kernel: str, shape) -> int:
    return shape.ffn if kernel == "srelu" else 2 * shape.ffn


def check_interleave(shape, knobs):
    k = knobs.get("interleave", 0)
    if k and shape.ffn % k:
        raise UsageError(f"interleave {k} needs ffn to be a multiple of {k}; shape {shape} has ffn={shape.ffn}")


def _act(kernel: str, x_scale: float = 3.0, scale_range=None):
    def gen(shape, g, knobs):
        check_interleave(shape, knobs)
        x = randn(g, shape.tokens, _act_width(kernel, shape)) * x_scale
        if not knobs.get("scaled", True):
            return {"x": x, "scale": None}
        if scale_range is None:
            scale = rand(g, shape.tokens)  # router probabilities
        else:
            scale = log_uniform(g, *scale_range, shape.tokens)
        return {"x": x, "scale": scale}
    return gen


def _act_families(kernel: str) -> dict[str, InputFamily]:
    fams = [
        InputFamily("random", "normal x (std 3), scale in (0, 1)", _act(kernel)),
        InputFamily("scale_extremes", "per-token scales from 1e-4 to 1e4: scale before or after the activation shows",
                    _act(kernel, 2.0, (-4, 4))),
    ]
    if kernel != "srelu":
        fams.insert(1, InputFamily("past_clamp", "x with std 12: both halves far past the clamp limit on both sides",
                                   _act(kernel, 12.0)))
    return {f.name: f for f in fams}


def _cost(kernel: str):
    def cost(shape, e: int, f: int) -> Cost:
        T, F = shape.tokens, shape.ffn
        W = F if kernel == "srelu" else 2 * F
        return Cost(T * W * e + T * f + T * F * e, 2 * T * W * e + T * F * e + 2 * T * f, 0.0, 0.0)
    return cost


def _activation(name, knobs, reference):
    return Family(name, ("x", "scale"), ("x", "scale"), ("scale",), ("out",), knobs, (), reference,
                  shape_kind="moe", input_families=_act_families(name),
                  kernels={"triton": f"mhctool.kernels.triton.glu:{name}"}, cost=_cost(name))


SWIGLU = _activation("swiglu", {"interleave": INTERLEAVE, "scaled": SCALED}, moe_ref.swiglu)
CLAMPED_SWIGLU = _activation(
    "clamped_swiglu",
    {"interleave": INTERLEAVE, "scaled": SCALED, "limit": Knob(7.0, kind=float),
     "alpha": Knob(1.702, kind=float), "offset": Knob(1.0, kind=float, signed=True)},
    moe_ref.clamped_swiglu)
SRELU = _activation("srelu", {"scaled": SCALED}, moe_ref.srelu)
