"""The first step judged per tensor: parity inside the model.

At the first step every trajectory has the same weights and the same batch. The float64 run's
first step is recorded at each entry point of each layer (mapping, Sinkhorn, H-aggregate,
H_post * bias-dropout-add): its inputs, as the model computed them, and the gradient its outputs
received in the backward. Each entry point is then run again by the implementation, natively and
by the float64 reference on those very inputs, backward with that very upstream gradient, and
judged by parity's rule (:class:`~mhctool.core.verdict.VerdictRule`: the implementation's error
within kappa x native's on the same tensor plus the dtype's floor, no non-finite element where
the float64 result is finite, no extra exact zeros). That is parity at the model's own
activations, upstream gradients and shapes, deterministic, with no propagation between the
pieces to blur it: a wrong gradient that training noise hides in the trajectories (a Sinkhorn
whose backward skips the normalisations) fails here, named by its layer, entry point and tensor.
The projection's parameters (the mapping's weight, alpha and bias) are judged a block of rows
at a time: the rows feeding H_pre, H_post and H_res, and alpha's three gates, each apart.

The whole model's parameter gradients at the first step (the implementation's run against the
float64 run) are judged too, on what propagation cannot blur: no non-finite element and no extra
exact zeros where the float64 run's gradient is finite and not zero. Their distances are
reported beside native's, not gated: every piece's rounding reaches them through the fp32
network, so one native sample is no yardstick for them (measured: a correct kernel's H_pre rows
5x native's on a one-layer model).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace

import torch

from mhctool.analyses.train.pieces import Piece, came_in
from mhctool.analyses.train.setup import MarkovSource, TrainConfig
from mhctool.analyses.train.trajectory import LayerCalls, build_model
from mhctool.core.dtypes import FORMATS, fmt_of
from mhctool.core.errors import system_exit_message
from mhctool.core.metrics import measure, reference
from mhctool.core.verdict import VerdictRule
from mhctool.families import get_family
from mhctool.families.mapping import blocks
from mhctool.runner.call import leaf_inputs, short_error

GATED = ("max_abs", "rel_l2", "nonfinite", "extra_zeros")
GATED_WHOLE = ("nonfinite", "extra_zeros")  # the model's parameter gradients, end to end
# the inputs that are the projection's parameters, by entry point (mhctool's model: the mapping;
# Megatron's: the projection + RMS, whose weight's rows feed H_pre, H_post and H_res)
BLOCKS = {"mapping": {"weight", "h_bias", "alpha"}, "proj_rms": {"weight"}}
PROJECTION = re.compile(r"layers\.(\d+)\.(phi|h_bias|alpha)$")  # the model's names of them
# what a gradient the sentence names feeds, where the name alone does not say it
FEEDS = {"sinkhorn.grad_logits": "the H_res logits' gradient: what the projection's H_res rows receive",
         "h_aggregate.grad_h_pre": "what the projection's H_pre rows receive",
         "h_post_bda.grad_h_post": "what the projection's H_post rows receive",
         "h_post_bda.grad_h_res": "what the Sinkhorn's backward receives"}


def parts(name: str, value: torch.Tensor, n: int) -> dict[str, torch.Tensor]:
    """A model parameter's gradient as it is reported: a projection's by its blocks, any other whole."""
    return blocks(name, value, n) if PROJECTION.search(name) else {name: value}


@dataclass
class Call:
    """One entry point's call in the float64 run's first step: what it was given and what its
    outputs received in the backward (None: no gradient reached that output)."""

    layer: int
    family: str
    inputs: dict
    upstream: list
    names: tuple = ()  # the outputs' names, as the recorder's model names them
    rank: int | None = None  # the tensor-parallel rank whose shard it is (None: one rank)


@dataclass
class Judged:
    """One tensor's metric at the first step, as parity judges it (``passed`` None: reported only)."""

    tensor: str  # "layer 0 sinkhorn.grad_logits", "layer 1 mapping.grad_weight:h_res", "grad layers.0.qkv"
    metric: str
    value: float
    threshold: float | None
    passed: bool | None
    rule: str
    native: float  # native's value of the metric on the same tensor
    grid: str | None = None  # a 16-bit format whose grid holds every element (native's does not): computed there

    def sentence(self) -> str:
        if self.metric == "mask_repeat":
            return (f"{self.tensor}: {int(self.value)} elements differ when it is called again with the same "
                    "dropout key (a recompute, which restores the key, would draw another mask)")
        counted = self.metric in ("nonfinite", "extra_zeros")
        what = (f"{int(self.value)} {'non-finite elements' if self.metric == 'nonfinite' else 'extra exact zeros'}"
                if counted else f"{self.metric} {self.value:.3g}")
        native = f"{int(self.native)}" if counted else f"{self.native:.3g}"
        allowed = "" if self.threshold is None else f", {self.threshold:.3g} allowed ({self.rule}; native {native})"
        feeds = next((f" ({v})" for k, v in FEEDS.items() if self.tensor.endswith(k)), "")
        grid = f" (every element on {self.grid}'s grid: written or computed at 16 bits)" if self.grid else ""
        return f"{self.tensor}{feeds}: {what}{allowed}{grid}"


def record(into: list, layer: int, family: str, names: tuple, args: dict, outs: tuple) -> Call:
    """A call of an entry point recorded into ``into``: what it was given, and (through hooks) the
    gradient its outputs receive in the backward."""
    c = Call(layer, family, {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in args.items()},
             [None] * len(outs), tuple(names))
    into.append(c)
    attach(c, outs)
    return c


def attach(call: Call, outs: tuple) -> None:
    """The gradients ``outs`` receive in the backward, into ``call.upstream``."""
    for i, o in enumerate(outs):
        if o.requires_grad:
            o.register_hook(lambda g, i=i: call.upstream.__setitem__(i, g.detach().clone()))


class _Recording:
    """The model's ``ops`` for the first step: the model's own layer ops over ``pieces``
    (:class:`~mhctool.analyses.train.trajectory.LayerCalls`), each call recorded where ``calls``
    is given."""

    check_streams = False  # LayerCalls' check of work left on another stream: the trajectory's

    def __init__(self, pieces: dict[str, Piece], calls: list | None = None):
        self.pieces, self.calls = pieces, calls

    def layer(self, index: int) -> LayerCalls:
        return LayerCalls(self, index)

    def _seen(self, index: int, family: str, names: tuple, outs: tuple, args: dict | None = None) -> None:
        if self.calls is not None:
            record(self.calls, index, family, names, args, outs)


def _first_batch(cfg: TrainConfig) -> torch.Tensor:
    return MarkovSource(cfg.model.vocab, cfg.branch, cfg.seed).batch(1, cfg.batch, cfg.model.seq).to(cfg.device)


def model_step(cfg: TrainConfig, pieces: dict[str, Piece], calls: list | None = None) -> dict[str, torch.Tensor]:
    """The model's first forward and backward with ``pieces`` (before any optimizer step): every
    parameter's gradient, as :func:`parts` names them; ``calls``: the entry points' calls recorded."""
    model = build_model(cfg)
    model.loss(_first_batch(cfg), _Recording(pieces, calls), FORMATS[cfg.dtype].torch_dtype).backward()
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            grads.update({f"grad {k}": v for k, v in parts(name, p.grad.detach(), cfg.model.streams).items()})
    return grads


def entry_point(piece_call, family: str, call: Call, wide: bool = False) -> dict[str, torch.Tensor]:
    """One entry point run again on a recorded call: its outputs and its inputs' gradients (the
    projection's parameters by their blocks), by tensor name; ``wide``: on float64 copies (the
    reference)."""
    leaves = leaf_inputs(get_family(family), call.inputs, torch.float64 if wide else None)
    outs = piece_call(leaves)
    got = dict(zip(call.names, outs))
    # an output of another shape with the same elements (PR 3828's r is [M, 1], the recorded one [M])
    # takes its gradient in its own shape
    pairs = [(o, g.to(o.dtype).reshape(o.shape) if g.numel() == o.numel() else g.to(o.dtype))
             for o, g in zip(outs, call.upstream) if g is not None and o.requires_grad]
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    for k, leaf in leaves.items():
        if torch.is_tensor(leaf) and leaf.requires_grad and leaf.grad is not None:
            if k in BLOCKS.get(family, ()):
                got.update({f"grad_{b}": t for b, t in blocks(k, leaf.grad, _streams(call)).items()})
            else:
                got[f"grad_{k}"] = leaf.grad
    return got


def _streams(call: Call) -> int:
    """n of a mapping call: its weight has n^2 + 2n rows."""
    return int(round((call.inputs["weight"].shape[0] + 1) ** 0.5 - 1))


@dataclass
class Check:
    """The first step's verdict: every tensor judged, the failures named (``error``: the
    implementation's first step did not finish)."""

    judged: list[Judged] = field(default_factory=list)
    error: str | None = None
    seed: int = 0
    # family -> {output: how it came back} where the implementation returned an output in another
    # dtype than the model takes (the likeliest reason for its distance, so a failure says it)
    returned: dict = field(default_factory=dict)

    @property
    def failures(self) -> list[Judged]:
        return [j for j in self.judged if j.passed is False]

    @property
    def passed(self) -> bool:
        return self.error is None and not self.failures

    @property
    def tensors(self) -> int:
        return len({j.tensor for j in self.judged if j.passed is not None})

    def sentence(self, shown: int = 3) -> str:
        if self.error is not None:
            return f"the implementation's first step failed: {self.error}"
        if self.passed:
            whole = any(j.tensor.startswith("grad ") for j in self.judged)  # mhctool's model: end to end too
            return ("every entry point's outputs and gradients in every layer"
                    + (", and the parameters' gradients," if whole else "")
                    + f" at the first step ({self.tensors} tensors, seed {self.seed}) are within parity's rule "
                    "against the float64 run")
        worst = self.worst()
        return (f"{len(worst)} of {self.tensors} tensors fail parity's rule at the first step (seed {self.seed}): "
                + "; ".join(j.sentence() for j in worst[:shown]) + self._came_in(worst[:shown]))

    def _came_in(self, shown: list[Judged]) -> str:
        """What the shown failures' entry points returned in another dtype than the model takes."""
        families = dict.fromkeys(m.group(1) for j in shown
                                 if (m := re.match(r"(?:rank \d+ )?layer \d+ (\w+)\.", j.tensor)))
        said = [f"{f}: {name} came back in {how}" for f in families for name, how in self.returned.get(f, {}).items()]
        return f" ({'; '.join(said)})" if said else ""

    def worst(self) -> list[Judged]:
        """Each failed tensor's most telling failure (non-finite first, then max_abs, extra zeros,
        rel_l2), the tensors by how far past the threshold that is, the farthest first."""
        order = ("mask_repeat", "nonfinite", "max_abs", "extra_zeros", "rel_l2")
        by: dict[str, Judged] = {}
        for j in sorted(self.failures, key=lambda j: order.index(j.metric)):
            by.setdefault(j.tensor, j)

        def past(j: Judged) -> float:
            if j.metric in ("nonfinite", "mask_repeat") or not math.isfinite(j.value) or not j.threshold:
                return math.inf
            return j.value / j.threshold
        return sorted(by.values(), key=lambda j: (order.index(j.metric) > 0, -past(j)))

    def rows(self) -> list[dict]:
        """The report's rows: run ``first-step``, step 0, metric ``first-step:METRIC:TENSOR`` (one
        key a tensor and metric, as ``report compare`` matches rows), the rule and native's value
        in the message."""
        return [{"run": "first-step", "seed": self.seed, "step": 0, "metric": f"first-step:{j.metric}:{j.tensor}",
                 "layer": _layer_of(j.tensor), "value": j.value, "threshold": j.threshold, "passed": j.passed,
                 "message": f"{j.rule}; native {j.native:.6g}"} for j in self.judged] + \
            ([{"run": "first-step", "seed": self.seed, "step": 0, "metric": "first-step:error", "passed": False,
               "message": self.error}] if self.error else [])


def _layer_of(tensor: str) -> int | None:
    m = re.search(r"layers?[ .](\d+)", tensor)
    return int(m.group(1)) if m else None


def _judge(mine: dict, nat: dict, refs: dict, rule: VerdictRule, prefix: str, metrics: tuple,
           scale: dict | None = None) -> list[Judged]:
    out = []
    for name, r in refs.items():
        if name not in mine or name not in nat:
            continue
        r64 = r.detach().to("cpu", torch.float64)
        facts = reference(r64)
        m = measure(_as(mine[name], r64), r64, of=facts)
        n = measure(_as(nat[name], r64), r64, of=facts)
        fmt = fmt_of(mine[name].dtype)
        terms = (scale or {}).get(name.split(":")[0])
        judged = []
        for metric in GATED:
            j = rule.judge(metric, m[metric], fmt, facts.amax, n, numel=r64.numel(), term_scale=terms)
            gated = metric in metrics
            judged.append(Judged(f"{prefix}{name}", metric, m[metric], j.threshold if gated else None,
                                 bool(j.passed) if gated else None, j.rule if gated else "reported", n[metric]))
        if any(j.passed is False for j in judged):
            grid = sixteen_bit_grid(mine[name], nat[name])
            judged = [replace(j, grid=grid) for j in judged]
        out += judged
    return out


def sixteen_bit_grid(t: torch.Tensor, native: torch.Tensor, least: int = 64) -> str | None:
    """The 16-bit format (bf16, fp16) whose grid holds every element of a wider ``t`` of at least
    ``least`` elements where native's does not: the tensor was written (or computed) at 16 bits and
    widened after, as a gradient that autograd casts back to its input's dtype is."""
    if t.element_size() <= 2 or t.numel() < least or not t.is_floating_point():
        return None
    for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        on = lambda x: bool(torch.equal(x, x.to(dtype).to(x.dtype)))  # noqa: E731
        if on(t.detach()):  # the first grid that holds it: where native's is on it too, it tells nothing
            return None if on(native.detach()) else name
    return None


def _as(t: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """``t`` on the CPU in the reference's shape where only size-1 dimensions differ (never broadcast)."""
    t = t.detach().cpu()
    if t.shape != ref.shape:
        if t.numel() != ref.numel():
            raise RuntimeError(f"an output of shape {tuple(t.shape)} where the float64 one is {tuple(ref.shape)}")
        t = t.reshape(ref.shape)
    return t


def _scales(refs: dict) -> dict[str, float]:
    """A blocked tensor's whole scale (the largest of its blocks' references): the terms' scale of
    a block whose own gradient cancels (the last layer's H_res rows: its streams are averaged at
    the exit, so their true gradient is nothing and their rounding is that of the parameter's)."""
    scale: dict[str, float] = {}
    for name, r in refs.items():
        whole = name.split(":")[0]
        scale[whole] = max(scale.get(whole, 0.0), reference(r.detach().to("cpu", torch.float64)).amax)
    return scale


def _term_scales(family: str, call: Call, refs: dict[str, torch.Tensor], knobs: dict) -> dict[str, float]:
    """The scale of the terms each of an entry point's gradients sums, where it cancels: the
    mapping's alpha and bias sum over every token (the family's own ``term_scale``, as parity
    uses it); the Sinkhorn's logits' gradient sums products of H_res and its upstream gradient,
    which cancel to nothing at the last layer (its streams are averaged at the exit, so H_res does
    not change the loss): the largest sum of |h| |g| over a token's matrix."""
    fam = get_family(family)
    out = {}
    if fam.term_scale is not None and all(g is not None for g in call.upstream):
        wide = leaf_inputs(fam, call.inputs, torch.float64)
        with torch.no_grad():
            outs = fam.call(fam.reference, wide, knobs, lambda k: True)  # the family's outputs the model does not take get none
        up = [g.double() for g in call.upstream] + [torch.zeros_like(o) for o in outs[len(call.upstream):]]
        out = dict(fam.term_scale(wide, up, knobs))
    if family == "sinkhorn" and call.upstream[0] is not None:
        h, g = refs["h_res"].detach().double(), call.upstream[0].double()
        out["grad_logits"] = float((h.abs() * g.abs()).flatten(-2).sum(-1).max())
    return out


def _callable(p):
    return getattr(p, "call", p)  # a Piece, or a family call itself


def judge_calls(calls: list[Call], impl: dict | list, native: dict, wide: dict[str, object], rule: VerdictRule,
                knobs: dict[str, dict], returned: dict | None = None) -> list[Judged]:
    """Each recorded call's entry point, the implementation's (its pieces or family calls, or its
    results already computed in a worker, one dict a call) and native's against the float64
    reference; an output the implementation gave in another dtype than native's noted in
    ``returned`` (family -> {output: how it came back})."""
    out = []
    for i, call in enumerate(calls):
        refs = entry_point(wide[call.family], call.family, call, wide=True)
        mine = impl[i] if isinstance(impl, list) else entry_point(_callable(impl[call.family]), call.family, call)
        nat = entry_point(_callable(native[call.family]), call.family, call)
        if returned is not None:
            for name in call.names:
                if name in mine and name in nat and mine[name].dtype != nat[name].dtype:
                    returned.setdefault(call.family, {})[name] = came_in(mine[name].dtype, nat[name].dtype,
                                                                         "mhctool's native one gives")
        scale = _scales(refs)
        for name, v in _term_scales(call.family, call, refs, knobs.get(call.family, {})).items():
            scale[name] = max(scale.get(name, 0.0), v)
        where = f"layer {call.layer} {call.family}." if call.rank is None else f"rank {call.rank} layer {call.layer} {call.family}."
        out += _judge(mine, nat, refs, rule, where, GATED, scale)
        if not isinstance(impl, list) and keyed(call):
            out += _same_key_again(mine, entry_point(_callable(impl[call.family]), call.family, call), call, where)
    return out


def keyed(call: Call) -> bool:
    """Whether the call was given a dropout key its mask depends on (a keyed knob of its family)."""
    return bool(call.inputs.get("dropout")) and "dropout" in get_family(call.family).keyed


def _same_key_again(first: dict, again: dict, call: Call, where: str) -> list[Judged]:
    """A keyed call run again with the same key gives the same outputs, bit for bit: the mask is a
    function of the key (the recompute restores the key and must draw the forward's mask)."""
    out = []
    for name in call.names:
        if name in first and name in again:
            a, b = first[name].detach(), again[name].detach()
            differ = int((a != b).sum()) if a.shape == b.shape else a.numel()
            out.append(Judged(f"{where}{name}", "mask_repeat", float(differ), 0.0, differ == 0,
                              "the same dropout key draws the same mask", 0.0))
    return out


def impl_results(cfg: TrainConfig, pieces: dict[str, Piece], calls: list[Call]) -> tuple[list, dict, dict]:
    """The implementation's side of the check: each recorded call's entry point, the model's
    first step end to end (its parameters' gradients), and what its pieces returned in another
    dtype than the model takes."""
    each = [entry_point(pieces[c.family].call, c.family, c) for c in calls]
    return each, model_step(cfg, pieces), {f: dict(p.returned) for f, p in pieces.items() if p.returned}


def job(cfg_dict: dict, spec: dict, knobs: dict, conventions: dict, calls: list, as_used: bool = False) -> dict:
    """What an isolation worker runs: :func:`impl_results` for the implementation, on the CPU."""
    from mhctool.analyses.train.pieces import impl_pieces
    from mhctool.analyses.train.setup import from_dict
    cfg = from_dict(cfg_dict)
    pieces, _ = impl_pieces(spec, knobs, conventions, cfg.device, cfg.dtype, as_used)
    calls = [Call(**c) for c in calls]
    each, grads, returned = impl_results(cfg, pieces, calls)
    return {"each": [{k: v.detach().cpu() for k, v in d.items()} for d in each],
            "grads": {k: v.detach().cpu() for k, v in grads.items()}, "returned": returned}


def check(cfg: TrainConfig, impl: dict[str, Piece], native: dict[str, Piece], ref: dict[str, Piece],
          wide: dict[str, object], rule: VerdictRule, knobs: dict[str, dict], isolated=None) -> Check:
    """The first step from ``cfg``'s seed judged per tensor: the float64 run (``ref``: its pieces)
    recorded; each entry point of each layer judged on its calls (``wide``: the families' float64
    references, called on float64 copies); the model's parameter gradients end to end.
    ``isolated(calls)``: the implementation's results from an isolation worker (each call's, and
    its parameter gradients), or the error that ended it (None: computed here)."""
    calls: list[Call] = []
    ref_grads = model_step(cfg, ref, calls)
    try:
        if isolated is not None:
            got = isolated(calls)
            if isinstance(got, str):
                return Check(error=got, seed=cfg.seed)
            each, grads, returned = got
        else:
            each, grads, returned = impl_results(cfg, impl, calls)
    except SystemExit as e:  # code under test never decides mhctool's exit code
        return Check(error=system_exit_message(e), seed=cfg.seed)
    except Exception as e:  # noqa: BLE001 - an implementation that raises: the check's failure, kept
        return Check(error=short_error(e), seed=cfg.seed)
    judged = judge_calls(calls, each, native, wide, rule, knobs)
    judged += _judge(grads, model_step(cfg, native), ref_grads, rule, "", GATED_WHOLE, _scales(ref_grads))
    return Check(judged, seed=cfg.seed, returned=returned)
