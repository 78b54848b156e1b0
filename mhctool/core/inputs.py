"""Seeded input families per kernel.

Plain random inputs at unit scale hide most numerics defects, so each kernel family has input
families chosen to amplify one knob of its contract (DESIGN.md, "Inputs that expose defects").
A generator draws float32 values from a seeded CPU ``torch.Generator``, then the runner casts them:
activations to the case dtype, mapping tensors (``h_pre``, ``h_post``, ``h_res``) to fp32, the
mapping path's precision. A tensor of :data:`BIG` values or more is drawn on the case's device
(:func:`generate`'s ``draw_on``): on the CPU blockwise on threads, on a GPU by a counter-based
generator in one launch (:mod:`mhctool.philox`), so a GPU case's large tensors have other values
than a CPU case's at the same seed.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import math
import os
from dataclasses import dataclass, field
from typing import Callable

import torch

from mhctool.core.errors import UsageError
from mhctool.core.shapes import Shape

Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True)
class InputFamily:
    name: str
    doc: str
    make: Callable[[Shape, torch.Generator, dict], Tensors]
    reshape: Callable[[Shape], Shape] = field(default=lambda s: s)


# A CPU generator draws one value after another on one core: the 940 million values of a
# paper-shape activation took 5 s, and a paper-shape case's inputs and upstream gradients more
# than half of its run on an H200. A tensor of BIG values or more is drawn in blocks of BLOCK
# values instead, each from a generator of its own seeded from one draw of the case's, the blocks
# on threads: the values depend on the seed and the shape only, not on the thread count.
BIG = 1 << 24
BLOCK = 1 << 22
# On a GPU, four workers drawing gigabytes on the host and copying them over contended for the
# host's cores and memory (the inputs phase doubled from one worker to four on an H200 node), so
# parity draws a large tensor on the case's device, one launch a tensor (mhctool.philox: a value
# depends on the seed and its index alone, not on the GPU's size).

# where large tensors are drawn (generate's draw_on); None: on the CPU
_DRAW_ON: contextvars.ContextVar = contextvars.ContextVar("mhctool_draw_on", default=None)


@contextlib.contextmanager
def drawing_on(device):
    """Large tensors drawn on ``device`` (a ``torch.device`` or name) within the block."""
    token = _DRAW_ON.set(None if device is None else torch.device(device))
    try:
        yield
    finally:
        _DRAW_ON.reset(token)


def _randn(g, *shape):
    if _blockwise(g, shape):
        return _blocks(g, shape, normal=True)
    return torch.randn(shape, generator=g, dtype=torch.float32, device=g.device)


def _rand(g, *shape):
    if _blockwise(g, shape):
        return _blocks(g, shape, normal=False)
    return torch.rand(shape, generator=g, dtype=torch.float32, device=g.device)


def _blockwise(g, shape) -> bool:
    return g.device.type == "cpu" and math.prod(shape) >= BIG


def _on(big: torch.Tensor, *small):
    """``small`` on ``big``'s device: a large tensor may be drawn on the GPU while the small ones
    that scale or shift it stay where the case generator drew them (the same values as before)."""
    moved = tuple(t.to(big.device) if isinstance(t, torch.Tensor) else t for t in small)
    return moved[0] if len(moved) == 1 else moved


def draw_threads() -> int:
    """Threads that draw a large tensor's blocks: ``MHCTOOL_DRAW_THREADS`` where set (a pool's
    workers share the host's cores: each gets its share), else PyTorch's thread count, at most 32."""
    value = os.environ.get("MHCTOOL_DRAW_THREADS", "")
    return int(value) if value.isdigit() and int(value) > 0 else min(torch.get_num_threads(), 32)


def _blocks(g, shape, normal: bool) -> torch.Tensor:
    """A float32 tensor of ``shape`` of standard normal (``normal``) or uniform [0, 1) values
    from one seed drawn from ``g``: on the CPU a block of BLOCK values at a time on threads, each
    block from a generator seeded ``seed + k``; on a GPU in one launch (:mod:`mhctool.philox`)."""
    seed = int(torch.randint(0, 1 << 62, (1,), generator=g))
    device = _DRAW_ON.get() or torch.device("cpu")
    out = torch.empty(math.prod(shape), dtype=torch.float32, device=device)
    if device.type != "cpu":
        from mhctool.core import philox
        return philox.fill(out, seed, normal).view(*shape)

    def one(k: int) -> None:
        block, gb = out[k * BLOCK:(k + 1) * BLOCK], torch.Generator().manual_seed(seed + k)
        block.normal_(generator=gb) if normal else block.uniform_(generator=gb)

    blocks = -(-out.numel() // BLOCK)
    with concurrent.futures.ThreadPoolExecutor(max(1, min(blocks, draw_threads()))) as ex:
        list(ex.map(one, range(blocks)))  # the fills release the GIL
    return out.view(*shape)


def _log_uniform(g, lo, hi, *shape):
    return 10.0 ** (lo + (hi - lo) * _rand(g, *shape))


# --- sinkhorn -------------------------------------------------------------------------------

def _sk_random(shape, g, knobs):
    # per-matrix scale from 0.1 to 10: the easy regime and the moderately peaked one
    scale = _log_uniform(g, -1, 1, shape.s, shape.b, 1, 1)
    logits = _randn(g, shape.s, shape.b, shape.n, shape.n)
    return {"logits": logits * _on(logits, scale)}


def _sk_unit(shape, g, knobs):
    # unit normal logits: the benign regime (an mHC layer near initialisation); every row and
    # column sum stays far above eps, so eps changes the result by about eps relative
    return {"logits": _randn(g, shape.s, shape.b, shape.n, shape.n)}


def _sk_large(shape, g, knobs):
    # logits of 90 to 300 with a spread of a few units: exp overflows every float format without
    # max subtraction, while the projected matrix is as well conditioned as for small logits
    s, b, n = shape.s, shape.b, shape.n
    level = 90 + 210 * _rand(g, s, b, 1, 1)
    spread = 0.5 + 2.5 * _rand(g, s, b, 1, 1)
    noise = _randn(g, s, b, n, n)
    level, spread = _on(noise, level, spread)
    return {"logits": level + spread * noise}


def _sk_dead(shape, g, knobs):
    # one column per matrix (and one row on every other matrix) sits 20 to 80 below the rest:
    # after exponentiation its sums are far below eps, so eps and its mode decide the result
    s, b, n = shape.s, shape.b, shape.n
    logits = _randn(g, s, b, n, n)
    offset = 20 + 60 * _rand(g, s, b)
    col = torch.randint(0, n, (s, b), generator=g, device=g.device)
    row = torch.randint(0, n, (s, b), generator=g, device=g.device)
    cols = torch.nn.functional.one_hot(col, n).float()[..., None, :]
    rows = torch.nn.functional.one_hot(row, n).float()[..., :, None]
    every_other = (torch.arange(s * b, device=g.device).reshape(s, b) % 2).float()[..., None, None]
    offset, where = _on(logits, offset, (cols + every_other * rows).clamp(max=1))
    return {"logits": logits - offset[..., None, None] * where}


def _column_below(shape, g, least: float, width: float):
    """Unit normal logits with one column per matrix ``least`` to ``least + width`` below the rest
    (uniform over the matrices)."""
    s, b, n = shape.s, shape.b, shape.n
    logits = _randn(g, s, b, n, n)
    offset = least + width * _rand(g, s, b)
    col = torch.randint(0, n, (s, b), generator=g, device=g.device)
    cols = torch.nn.functional.one_hot(col, n).float()[..., None, :]
    offset, cols = _on(logits, offset, cols)
    return {"logits": logits - offset[..., None, None] * cols}


def _sk_underflow(shape, g, knobs):
    # one column per matrix 600 to 700 below the rest: exp underflows to zero there in fp32 (from
    # about 104 below), the regime training at a large rate reaches, and a backward that divides by
    # sum + eps a step multiplies the gradient by 1/eps into inf. This far below, float64 keeps the
    # column near zero too (its 20 iterations scale it by at most 1/eps each, 1e120 at eps 1e-6):
    # both functions agree to below fp32's smallest number, where nearer offsets would let float64
    # bring the column back and no fp32 kernel could follow
    return _column_below(shape, g, 600, 100)


def _sk_eps_sweep(shape, g, knobs):
    # one column per matrix 5 to 28 below the rest: the column sums sweep about 1e-2 down to
    # 1e-12, so every eps in that range changes some matrices' result (mhctool identify pins eps
    # with it)
    return _column_below(shape, g, 5, 23)


def _sk_near_perm(shape, g, knobs):
    # a permutation plus noise: Sinkhorn converges slowly, so iteration count and order matter
    s, b, n = shape.s, shape.b, shape.n
    perm = torch.argsort(_rand(g, s, b, n), dim=-1)
    p = torch.nn.functional.one_hot(perm, n).float()
    noise = _randn(g, s, b, n, n)
    return {"logits": 8.0 * _on(noise, p) + 0.5 * noise}


# --- h_aggregate / h_post_bda -------------------------------------------------------------------

def _long_c(shape: Shape) -> Shape:
    return shape.replace(c=max(shape.c, 4099))


def _long_tokens(shape: Shape) -> Shape:
    return shape.replace(s=max(shape.s, -(-4099 // shape.b)))


def _mixing(g, s, b, n):
    return torch.softmax(2.0 * _randn(g, s, b, n, n), dim=-1)


def _agg(shape, g, knobs, x_scale=None):
    s, b, n, c = shape.s, shape.b, shape.n, shape.c
    x = _randn(g, s, b, n, c)
    if x_scale is not None:
        x = x * _on(x, x_scale)
    return {"x": x, "h_pre": _rand(g, s, b, n)}


def _agg_wide(shape, g, knobs):
    # per token and stream magnitudes from 1e-3 to 1e3
    return _agg(shape, g, knobs, _log_uniform(g, -3, 3, shape.s, shape.b, shape.n, 1))


def _bda(shape, g, knobs, x_scale=None):
    s, b, n, c = shape.s, shape.b, shape.n, shape.c
    x = _randn(g, s, b, n, c)
    y = _randn(g, s, b, c)
    if x_scale is not None:
        x = x * _on(x, x_scale)
        y = y * _on(y, x_scale[..., 0, :])
    out = {"h_res": _mixing(g, s, b, n), "x": x, "h_post": 2 * _rand(g, s, b, n), "y": y}
    out["bias"] = _randn(g, c) if knobs.get("bias", True) else None
    return out


def _bda_wide(shape, g, knobs):
    return _bda(shape, g, knobs, _log_uniform(g, -3, 3, shape.s, shape.b, shape.n, 1))


# --- proj_rms ---------------------------------------------------------------------------------

def _proj(shape, g, knobs, row_scale=None):
    m, k, nh = shape.tokens, shape.k, shape.n_h
    x = _randn(g, m, k)
    if row_scale is not None:
        x = x * _on(x, row_scale)
    return {"x2d": x, "weight": _randn(g, nh, k) / k ** 0.5}


def _proj_tiny(shape, g, knobs):
    # rms from 1e-8 to 1e-4: eps (1e-6) dominates r, and where it sits in the formula shows
    return _proj(shape, g, knobs, _log_uniform(g, -8, -4, shape.tokens, 1))


def _proj_huge(shape, g, knobs):
    # rms from 1e2 to 1e4: the sum of squares overflows fp16 and is large for bf16 accumulation
    return _proj(shape, g, knobs, _log_uniform(g, 2, 4, shape.tokens, 1))


def _long_k(shape: Shape) -> Shape:
    return shape.replace(c=max(shape.c, -(-8192 // shape.n) + 1))


def _with_h(make):
    """A proj_rms family plus the compute_h parameters: alpha in [0.5, 1.5], h_bias ~ N(0, 1)."""
    def gen(shape, g, knobs):
        out = make(shape, g, knobs)
        out["alpha"] = 0.5 + _rand(g, 3)
        out["h_bias"] = _randn(g, shape.n_h)
        return out
    return gen


# --- grouped MLP -------------------------------------------------------------------------------

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
    weights = 0.1 + _rand(g, experts).cpu()
    if kind == "zero_experts":  # every other expert (and a random one more) gets no token
        weights[::2] = 0.0
        weights[int(torch.randint(0, experts, (1,), generator=g, device=g.device))] = 0.0
        if weights.sum() == 0:
            weights[-1] = 1.0
    counts = torch.floor(weights / weights.sum() * tokens).to(torch.int64)
    counts[int(weights.argmax())] += tokens - counts.sum()
    return counts


def _act_width(kernel: str, shape) -> int:
    return shape.ffn if kernel == "srelu" else 2 * shape.ffn


def _check_interleave(shape, knobs):
    k = knobs.get("interleave", 0)
    if k and shape.ffn % k:
        raise UsageError(f"interleave {k} needs ffn to be a multiple of {k}; shape {shape} has ffn={shape.ffn}")


def _act(kernel: str, x_scale: float = 3.0, scale_range=None):
    def gen(shape, g, knobs):
        _check_interleave(shape, knobs)
        x = _randn(g, shape.tokens, _act_width(kernel, shape)) * x_scale
        if not knobs.get("scaled", True):
            return {"x": x, "scale": None}
        if scale_range is None:
            scale = _rand(g, shape.tokens)  # router probabilities
        else:
            scale = _log_uniform(g, *scale_range, shape.tokens)
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


def _grouped(kernel: str, kind: str):
    def gen(shape, g, knobs):
        t, h, f, e = shape.tokens, shape.hidden, shape.ffn, shape.experts
        splits = _splits(g, t, e, kind)
        x = _randn(g, t, h)
        if kernel == "grouped_gemm":
            out = {"x": x, "weight": _randn(g, e, f, h) / h ** 0.5, "m_splits": splits}
            out["bias"] = _randn(g, e, f) if knobs.get("bias", False) else None
            return out
        if kernel == "grouped_wgrad":
            out = {"x": x, "grad_out": _randn(g, t, f), "m_splits": splits, "main_grad": None, "accumulate": None}
            if knobs.get("accumulate", "mask") == "mask":
                out["main_grad"] = _randn(g, e, f, h)
                out["accumulate"] = _rand(g, e).cpu() < 0.5
            return out
        _check_interleave(shape, knobs)
        width = f if knobs.get("activation", "swiglu") == "srelu" else 2 * f
        out = {"x": x, "fc1_weight": _randn(g, e, width, h) / h ** 0.5,
               "fc2_weight": _randn(g, e, h, f) / f ** 0.5, "m_splits": splits}
        with_bias = knobs.get("bias", True)
        out["fc1_bias"] = _randn(g, e, width) if with_bias else None
        out["fc2_bias"] = _randn(g, e, h) if with_bias else None
        out["scale"] = _rand(g, t) if knobs.get("scaled", True) else None
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


FAMILIES: dict[str, dict[str, InputFamily]] = {
    "sinkhorn": {
        f.name: f for f in [
            InputFamily("random", "normal logits, per-matrix scale log-uniform in [0.1, 10]", _sk_random),
            InputFamily("unit_random", "unit normal logits: the benign regime, eps only nudges the sums", _sk_unit),
            InputFamily("large_logits", "logits 90 to 300, spread of a few units: exp overflows without max subtraction", _sk_large),
            InputFamily("dead_rows_cols", "a column (and a row on every other matrix) 20-80 below the rest: sums far below eps", _sk_dead),
            InputFamily("near_perm", "permutation * 8 + noise: slow convergence, order and iterations matter", _sk_near_perm),
        ]
    },
    "h_aggregate": {
        f.name: f for f in [
            InputFamily("random", "unit normal x, h_pre in (0, 1)", _agg),
            InputFamily("wide_range", "stream magnitudes 1e-3 to 1e3", _agg_wide),
            InputFamily("long_c", "C of at least 4099: long reductions, odd tiles", _agg, _long_c),
        ]
    },
    "h_post_bda": {
        f.name: f for f in [
            InputFamily("random", "unit normal x, y, bias; row-stochastic h_res; h_post in (0, 2)", _bda),
            InputFamily("wide_range", "stream magnitudes 1e-3 to 1e3", _bda_wide),
            InputFamily("long_c", "C of at least 4099: odd tiles over C", _bda, _long_c),
            InputFamily("long_tokens", "at least 4099 tokens: the bias gradient reduces over them", _bda, _long_tokens),
        ]
    },
    "proj_rms": {
        f.name: f for f in [
            InputFamily("random", "unit normal x, weight scaled by 1/sqrt(K)", _proj),
            InputFamily("tiny_norm", "row rms 1e-8 to 1e-4: eps dominates r", _proj_tiny),
            InputFamily("huge_norm", "row rms 1e2 to 1e4: the sum of squares is huge", _proj_huge),
            InputFamily("long_k", "K of at least 8192: long reductions", _proj, _long_k),
        ]
    },
}
for _k in ("swiglu", "clamped_swiglu", "srelu"):
    FAMILIES[_k] = _act_families(_k)
for _k in ("grouped_gemm", "grouped_wgrad", "grouped_mlp"):
    FAMILIES[_k] = _grouped_families(_k)
# the fused mapping path (proj_rms + compute_h) takes the proj_rms families
FAMILIES["mapping"] = {
    name: InputFamily(name, f.doc, _with_h(f.make), f.reshape) for name, f in FAMILIES["proj_rms"].items()
}


# families a scenario runs only where it names them (`families = [...]`): a regime in which the
# native PyTorch implementation itself fails, so that "all of a kernel's" families (the default
# scenario, the CI gate) keep judging against a native baseline that holds
STRESS: dict[str, dict[str, InputFamily]] = {
    "sinkhorn": {"underflow_cols": InputFamily(
        "underflow_cols", "a column 600-700 below the rest: exp underflows to 0 in fp32; autograd through the "
        "native Sinkhorn returns NaN there, a backward must not", _sk_underflow)},
}

# probe families of `mhctool identify`: named like the others, never part of "all of a kernel's"
PROBES: dict[str, dict[str, InputFamily]] = {
    "sinkhorn": {"eps_sweep": InputFamily(
        "eps_sweep", "a column per matrix 5-28 below the rest: its sums sweep 1e-2 to 1e-12", _sk_eps_sweep)},
}


def _as_streams(make):
    """A mapping family with its ``x2d[T, n*C]`` as the streams ``x[s, b, n, C]`` (mix_aggregate)."""
    def gen(shape, g, knobs):
        out = make(shape, g, knobs)
        out["x"] = out.pop("x2d").reshape(shape.s, shape.b, shape.n, shape.c)
        return {k: out[k] for k in ("x", "weight", "alpha", "h_bias")}
    return gen


# the composites (mapping then Sinkhorn; that then the aggregation) take the mapping families but long_k
for _k in ("mapping_sinkhorn", "mix_aggregate"):
    FAMILIES[_k] = {
        name: InputFamily(name, f.doc, _as_streams(f.make), f.reshape)
        for name, f in FAMILIES["mapping"].items() if name != "long_k"
    }


def families_for(kernel: str) -> dict[str, InputFamily]:
    return FAMILIES[kernel]


def get_family(kernel: str, name: str) -> InputFamily:
    fams = {**FAMILIES[kernel], **STRESS.get(kernel, {}), **PROBES.get(kernel, {})}
    if name not in fams:
        raise UsageError(
            f"unknown input family {name!r} for kernel {kernel}; accepted: {', '.join(fams)}"
        )
    return fams[name]


def generate(kernel: str, family: str, shape: Shape, seed: int, knobs: dict,
             device: str = "cpu", draw_on: str | None = None) -> tuple[Shape, Tensors]:
    """The (possibly reshaped) shape and the fp32 tensors of one case. Parity draws from a CPU
    generator, tensors of BIG values or more on ``draw_on`` (the case's device; the
    others stay on the CPU, the same values on every device); bench draws everything from a
    generator on ``device`` (paper-shape inputs are gigabytes)."""
    fam = get_family(kernel, family)
    g = torch.Generator(device=device).manual_seed(seed)
    shape = fam.reshape(shape)
    with drawing_on(draw_on):
        return shape, fam.make(shape, g, knobs)


def upstream_grads(outputs: list[torch.Tensor], seed: int) -> list[torch.Tensor]:
    """Seeded upstream gradients, one per output, at the output's dtype and device, laid out in
    memory like the output (as the next layer's backward would hand them over): an output that is a
    view in another memory order (a library's layout, seen through the adapter's transpose) gets its
    gradient in that order, so the library's backward is not charged for a copy into its layout."""
    g = torch.Generator().manual_seed(seed + 0x5EED)
    out = []
    for o in outputs:  # a large one drawn on the output's device
        with drawing_on(o.device):
            out.append(torch.empty_like(o).copy_(_randn(g, *o.shape)))
    return out
