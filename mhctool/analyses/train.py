"""``mhctool train``: from a kernel's error to a training run's drift.

The small mHC language model of :mod:`mhctool.references.model` is trained three times from one
seed, on the same synthetic tokens: with the implementation under test plugged into every mHC
family it has (the others run natively, and the run says which ran what), with the native
PyTorch implementation, and with the mHC pieces in float64 (the reference trajectory). Every
step records Megatron's golden-value metrics (``lm loss``, ``num-zeros`` counted over the
gradients as ``--log-num-zeros-in-grad`` counts them, ``grad-norm``, ``iteration-time``, memory
on a GPU) and mHC health per layer (H_res's row- and column-sum deviation from 1 and its
smallest entry, the largest Sinkhorn logit, non-finite counts of every mHC output), and where
the zeros are (per parameter).

The drift is judged like a kernel's error: per metric, the implementation's median distance from
the reference trajectory over the steps may be at most ``kappa`` times the native trajectory's,
plus a floor of the dtype's rounding; where it is more, the first step past native's envelope is
where the run parts.
A drift is traced to a knob by rerunning the native implementation with each convention in
which the kernel differs from the contract (declared, or fitted by ``mhctool identify``): the
one whose run the implementation's stays with is the cause; if none, the drift is the kernel's
own. A run that goes non-finite names the first layer and mHC output that did.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch

from mhctool.registry import families as registry
from mhctool.registry.specs import is_function_spec, load_external, resolve_impls
from mhctool.core.dtypes import FORMATS, dtype_named
from mhctool.core.errors import UsageError
from mhctool.references import model as model_mod
from mhctool.references.model import ModelConfig
from mhctool.core.verdict import VerdictRule

# the mHC families the model calls, in the order a layer calls them
FAMILIES = ("mapping", "sinkhorn", "h_aggregate", "h_post_bda")
# what a trajectory's verdict is judged on (iteration time and memory are recorded, not judged)
JUDGED = ("lm loss", "grad-norm", "num-zeros")
GOLDEN_METRICS = ("lm loss", "num-zeros", "grad-norm", "iteration-time", "mem-allocated-bytes",
                  "mem-max-allocated-bytes")
# whose backward computes the gradient each mHC output receives (a non-finite gradient there is
# that backward's)
CONSUMER = {("mapping", "h_pre"): "h_aggregate", ("mapping", "h_post"): "h_post_bda",
            ("mapping", "h_res_logits"): "sinkhorn", ("sinkhorn", "h_res"): "h_post_bda",
            ("h_aggregate", "out"): "the sublayer (attention, MLP)", ("h_post_bda", "out"): "the layer above"}


@dataclass(frozen=True)
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    steps: int = 30
    batch: int = 2
    lr: float = 1e-2
    weight_decay: float = 0.01
    clip: float = 1.0  # gradient clipping at this total norm, as Megatron's --clip-grad
    dtype: str = "fp32"  # the activations' dtype (the mapping path is fp32 whatever it is)
    device: str = "cpu"
    seed: int = 0
    branch: int = 3  # the synthetic source: successors a token may have


# the default model: small enough for Triton's CPU interpreter (about a second a step), and a
# larger one on a GPU
CPU_DEFAULTS = dict(layers=4, streams=4, hidden=32, heads=2, ffn=128, seq=16, vocab=64, batch=2, steps=30)
GPU_DEFAULTS = dict(layers=4, streams=4, hidden=256, heads=4, ffn=1024, seq=256, vocab=512, batch=8, steps=100)


def config(device: str, **given) -> TrainConfig:
    """The run's configuration: the device's defaults, then what was given (None: the default);
    a shape the model cannot take is a UsageError."""
    d = {**(GPU_DEFAULTS if device == "cuda" else CPU_DEFAULTS),
         **{k: v for k, v in given.items() if v is not None}}
    model_keys = {f for f in ModelConfig.__dataclass_fields__}
    m = ModelConfig(**{k: v for k, v in d.items() if k in model_keys})
    cfg = TrainConfig(model=m, device=device, **{k: v for k, v in d.items() if k not in model_keys})
    check(cfg)
    return cfg


def check(cfg: TrainConfig) -> None:
    m = cfg.model
    for name, v, least in (("steps", cfg.steps, 1), ("layers", m.layers, 1), ("streams", m.streams, 2),
                           ("hidden", m.hidden, 2), ("heads", m.heads, 1), ("seq", m.seq, 2),
                           ("batch", cfg.batch, 1), ("vocab", m.vocab, 2), ("ffn", m.ffn, 1)):
        if not (isinstance(v, int) and v >= least):
            raise UsageError(f"--{name} {v!r} must be at least {least}")
    if m.hidden % m.heads:
        raise UsageError(f"--hidden {m.hidden} must be a multiple of the attention heads ({m.heads})")
    if not (cfg.lr > 0 and math.isfinite(cfg.lr)):
        raise UsageError(f"--lr {cfg.lr!r} must be a positive number")
    if cfg.branch < 1 or cfg.branch > m.vocab:
        raise UsageError(f"the source's branching {cfg.branch} must be between 1 and the vocabulary ({m.vocab})")
    if cfg.dtype not in ("fp32", "bf16", "fp16"):
        raise UsageError(f"unknown dtype {cfg.dtype!r}; accepted: fp32, bf16, fp16")


# --- the data: a seeded Markov source a small model learns -------------------------------------

class MarkovSource:
    """Token sequences from a fixed random Markov chain: every token has ``branch`` successors with
    random probabilities, so the next token is predictable from the current one; a model that
    learns the chain approaches :meth:`entropy` nats a token (from ``log(vocab)`` untrained)."""

    def __init__(self, vocab: int, branch: int, seed: int):
        g = torch.Generator().manual_seed(seed * 7919 + 17)
        succ = torch.stack([torch.randperm(vocab, generator=g)[:branch] for _ in range(vocab)])
        w = -torch.log(torch.rand(vocab, branch, generator=g, dtype=torch.float64))  # Dirichlet(1)
        self.probs = torch.zeros(vocab, vocab, dtype=torch.float64).scatter_(1, succ, w / w.sum(1, keepdim=True))
        self.seed, self.vocab = seed, vocab

    def entropy(self) -> float:
        """The chain's entropy rate under a uniform start (nats a token): the loss floor."""
        p = self.probs
        return float(-(p * torch.log(p.clamp_min(1e-300))).sum(1).mean())

    def batch(self, step: int, batch: int, seq: int) -> torch.Tensor:
        """``tokens[seq + 1, batch]`` of step ``step``: the same in every run with this seed."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        tok = [torch.randint(0, self.vocab, (batch,), generator=g)]
        for _ in range(seq):
            tok.append(torch.multinomial(self.probs[tok[-1]].float(), 1, generator=g).squeeze(1))
        return torch.stack(tok)


# --- the mHC pieces of one trajectory ----------------------------------------------------------

@dataclass
class Piece:
    """What one family runs in a trajectory: ``call(args dict) -> outputs`` and how it was named."""

    family: str
    name: str  # e.g. "triton", "torch", "float64", "megatron[m3828]:fused_sinkhorn"
    call: Callable[[dict], tuple]
    note: str = ""  # why it runs what it runs (a family the implementation lacks: natively)
    # not the implementation's own function for the family (run natively, or its projection with
    # the native compute_h): identify has nothing of its to fit
    fallback: bool = False
    # the matmul precision it computes at by design (an adapter's declaration): the native
    # trajectory computes the family at it too, as parity's baseline does
    precision: str = "ieee"


def _family_call(family: str, fn, knobs: dict, accepts=lambda k: True, bind=lambda k: k) -> Callable[[dict], tuple]:
    fam = registry.get_family(family)
    return lambda args: fam.call(fn, args, knobs, accepts, bind)


def _expected(family: str, args: dict) -> list[tuple]:
    """(shape, dtype) of each output the model takes from ``family``, as the native one gives them:
    the mapping path in fp32, the streams at theirs."""
    if family == "mapping":
        t, n = args["x2d"].shape[0], int(round((args["weight"].shape[0] + 1) ** 0.5 - 1))
        return [((t, n), torch.float32), ((t, n), torch.float32), ((t, n, n), torch.float32)]
    if family == "sinkhorn":
        return [(tuple(args["logits"].shape), torch.float32)]
    x = args["x"]
    return [((*x.shape[:-2], x.shape[-1]) if family == "h_aggregate" else tuple(x.shape), x.dtype)]


def _conformed(family: str, call: Callable[[dict], tuple]) -> Callable[[dict], tuple]:
    """Outputs taken by value, as parity takes them: size-1 dimensions and another dtype (Megatron's
    h_post_bda writes in h_res's dtype) conformed to what the model expects, so the rest of the
    model computes as in the other trajectories; an output that cannot be is an error."""
    def run(args: dict) -> tuple:
        outs = call(args)
        want = _expected(family, args)
        if len(outs) < len(want):
            raise RuntimeError(f"{family} returned {len(outs)} outputs, expected {len(want)}")
        fixed = []
        for o, (shape, dtype) in zip(outs, want):
            if tuple(o.shape) != shape:
                if o.numel() != math.prod(shape):
                    raise RuntimeError(f"{family} returned an output of shape {tuple(o.shape)}, expected {shape}")
                o = o.reshape(shape)
            fixed.append(o if o.dtype == dtype else o.to(dtype))
        return tuple(fixed)
    return run


def native_piece(family: str, knobs: dict, precision: str = "ieee") -> Piece:
    from mhctool.runner.call import native_at
    impl = native_at(family, precision)
    return Piece(family, impl.name, _family_call(family, impl.fn, knobs))


def reference_piece(family: str, knobs: dict) -> Piece:
    """The family's float64 reference on the inputs upcast; each output back at the dtype the
    native implementation gives it (the mapping path fp32, the streams at theirs)."""
    fam = registry.get_family(family)
    call = _family_call(family, fam.reference, knobs)

    def run(args: dict) -> tuple:
        wide = {k: (v.double() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in args.items()}
        return tuple(o.to(dtype) for o, (_, dtype) in zip(call(wide), _expected(family, args)))
    return Piece(family, "float64", run)


def assign(specs: list[str], kernel: str | None = None) -> dict[str, str]:
    """Which ``--impl`` spec each family of the model runs: a function spec (``FILE.py:fn``,
    ``module:fn``) implements one family (``kernel``, else the family whose inputs its first
    parameters are named after); a built-in name or a library stands for every family it has.
    A function spec wins over a library for its family; a family no spec has runs natively."""
    import inspect
    out: dict[str, str] = {}
    functions = [s for s in specs if is_function_spec(s)]
    if kernel is not None and kernel not in FAMILIES:
        raise UsageError(f"--kernel {kernel}: the model's mHC families are {', '.join(FAMILIES)}")
    if kernel is not None and len(functions) > 1:
        raise UsageError("--kernel names the family of one function; with several, name each after its "
                         "family's inputs (logits; x, h_pre; h_res, x, h_post, y; x2d, weight, alpha, h_bias)")
    for spec in functions:
        family = kernel
        if family is None:
            fn = load_external(spec, "sinkhorn", check=False).fn
            try:
                params = list(inspect.signature(fn).parameters)
            except (TypeError, ValueError):
                params = []
            family = next((f for f in FAMILIES if params[:len(registry.get_family(f).inputs)]
                           == list(registry.get_family(f).inputs)), None)
            if family is None:
                raise UsageError(f"--impl {spec}: which mHC family is it? Its parameters ({', '.join(params)}) "
                                 f"are named after none of {', '.join(FAMILIES)}'s inputs; say it with --kernel")
        if family in out:
            raise UsageError(f"--impl: two functions for {family} ({out[family]}, {spec})")
        out[family] = spec
    for spec in (s for s in specs if not is_function_spec(s)):
        for family in FAMILIES:
            out.setdefault(family, spec)
    return out


def _as_used(call: Callable[[dict], tuple], dtypes: dict, activation: str) -> Callable[[dict], tuple]:
    """The inputs a library takes in other dtypes than the contract's (its adapter's
    ``Binding.dtypes``: Megatron's h_pre, h_res, h_post in the activations' dtype) converted first."""
    want = {k: dtype_named(v, activation) for k, v in dtypes.items()}
    return lambda args: call({k: (v.to(want[k]) if k in want and torch.is_tensor(v) else v) for k, v in args.items()})


def impl_pieces(spec: str | dict[str, str], knobs: dict[str, dict], conventions: dict[str, dict], device: str,
                dtype: str, as_used: bool = False) -> tuple[dict[str, Piece], dict[str, dict]]:
    """The pieces the ``--impl`` specs give the model (``spec``: one for every family, or per
    family as :func:`assign` gives them), and each family's knobs with what it declares: a family
    no spec has (or cannot run here) runs natively, and says so; a mapping a library lacks beside
    a projection it has runs its projection with the native compute_h."""
    from mhctool.core.environment import ensure_triton_mode
    ensure_triton_mode()
    specs = spec if isinstance(spec, dict) else {f: spec for f in FAMILIES}
    pieces, eff = {}, {}
    for family in FAMILIES:
        if family not in specs:
            eff[family] = {**knobs.get(family, {}), **conventions.get(family, {})}
            pieces[family] = replace(native_piece(family, eff[family]), note="natively: no --impl for it",
                                     fallback=True)
            continue
        spec_ = specs[family]
        impl, why = _pick(family, spec_, device, dtype)
        eff[family] = {**knobs.get(family, {}), **(impl.conventions if impl and impl.backend == "external" else {}),
                       **conventions.get(family, {})}
        if impl is not None:
            call = _family_call(family, impl.fn, eff[family], impl.accepts, impl.bind)
            if as_used and impl.input_dtypes:
                call = _as_used(call, impl.input_dtypes, dtype)
            pieces[family] = Piece(family, impl.name, _conformed(family, call), precision=impl.precision_on(device),
                                   note="its inputs at the dtypes its library is used with" if as_used and
                                   impl.input_dtypes else "")
            continue
        proj = _pick("proj_rms", spec_, device, dtype)[0] if family == "mapping" and \
            not is_function_spec(spec_) else None
        if proj is not None:
            pieces[family] = replace(_projection_mapping(proj, eff[family]), precision=proj.precision_on(device),
                                     fallback=True)
            continue
        pieces[family] = replace(native_piece(family, eff[family]), note=f"natively: {why}", fallback=True)
    return pieces, eff


def _pick(family: str, spec: str, device: str, dtype: str):
    """The first implementation ``spec`` gives ``family`` that can run here, or (None, why not)."""
    impls = resolve_impls(family, [spec])
    why = None
    for impl in impls:
        why = impl.unsupported(device, dtype)
        if why is None and impl.exists:
            return impl, None
    return None, why or f"{spec} has no {family}"


def _projection_mapping(proj, knobs: dict) -> Piece:
    """The mapping as a library without one computes it: its proj_rms, then the native compute_h."""
    from mhctool.kernels.torch.mhc import compute_h
    fam = registry.get_family("proj_rms")
    pk = {k: v for k, v in knobs.items() if k in fam.knobs}

    def run(args: dict) -> tuple:
        w = args["weight"]
        n = int(round((w.shape[0] + 1) ** 0.5 - 1))
        p, r = fam.call(proj.fn, {"x2d": args["x2d"], "weight": w}, pk, proj.accepts, proj.bind)[:2]
        return compute_h(p.float(), r.float().reshape(p.shape[0]), args["alpha"].float(), args["h_bias"].float(),
                         n, knobs.get("compute_h_eps", 0.0))
    return Piece("mapping", f"{proj.name}+torch:compute_h", run, note="its proj_rms with the native compute_h")


# --- recording what the mHC pieces return ------------------------------------------------------

class Recorder:
    """The model's ``ops``: calls the pieces, and records per layer what the contract cares about
    (health) and the first non-finite output, in call order."""

    def __init__(self, pieces: dict[str, Piece]):
        self.pieces = pieces
        self.health: list[dict] = []
        self.first_nonfinite: tuple[int, str, str] | None = None  # (layer, family, output)
        # the first mHC output, in backward order, whose incoming gradient is not finite
        self.first_nonfinite_grad: tuple[int, str, str, int] | None = None  # (+ how many elements)

    def reset(self, layers: int) -> None:
        self.health = [{} for _ in range(layers)]
        self.first_nonfinite = self.first_nonfinite_grad = None

    def layer(self, index: int) -> "_LayerOps":
        return _LayerOps(self, index)

    def _seen(self, index: int, family: str, names: tuple[str, ...], outs: tuple) -> None:
        h = self.health[index]
        for name, out in zip(names, outs):
            if out.requires_grad:
                out.register_hook(lambda g, where=(index, family, name): self._grad(where, g))
            t = out.detach()
            bad = int((~torch.isfinite(t)).sum())
            h[f"nonfinite:{family}.{name}"] = bad
            if bad and self.first_nonfinite is None:
                self.first_nonfinite = (index, family, name)
        if family == "mapping":
            h["largest logit"] = float(outs[2].detach().float().nan_to_num(0.0).abs().max())
        if family == "sinkhorn":
            m = outs[0].detach().double()
            h["row-sum deviation"] = float((m.sum(-1) - 1).abs().nan_to_num(math.inf).max())
            h["col-sum deviation"] = float((m.sum(-2) - 1).abs().nan_to_num(math.inf).max())
            h["smallest entry"] = float(m.nan_to_num(math.inf).min())


    def _grad(self, where: tuple, g: torch.Tensor) -> None:
        if self.first_nonfinite_grad is None:
            bad = int((~torch.isfinite(g)).sum())
            if bad:
                self.first_nonfinite_grad = (*where, bad)


class _LayerOps:
    def __init__(self, rec: Recorder, index: int):
        self.rec, self.index = rec, index

    def _call(self, family: str, names: tuple[str, ...], **args) -> tuple:
        outs = self.rec.pieces[family].call(args)
        self.rec._seen(self.index, family, names, outs)
        return outs

    def mapping(self, x2d, weight, alpha, h_bias):
        return self._call("mapping", ("h_pre", "h_post", "h_res_logits"), x2d=x2d, weight=weight, alpha=alpha,
                          h_bias=h_bias)

    def sinkhorn(self, logits):
        return self._call("sinkhorn", ("h_res",), logits=logits)[0]

    def h_aggregate(self, x, h_pre):
        return self._call("h_aggregate", ("out",), x=x, h_pre=h_pre)[0]

    def h_post_bda(self, h_res, x, h_post, y, bias):
        return self._call("h_post_bda", ("out",), h_res=h_res, x=x, h_post=h_post, y=y, bias=bias)[0]


# --- one trajectory --------------------------------------------------------------------------

@dataclass
class Step:
    step: int  # 1-based, as Megatron's golden values count
    metrics: dict[str, float]  # lm loss, grad-norm, num-zeros, iteration-time (+ memory on a GPU)
    zeros: dict[str, int]  # per parameter: its gradient's exact zeros
    health: list[dict]  # per layer
    first_nonfinite: list | None = None  # [layer, family, output] of the first non-finite mHC output
    # [layer, family, output, elements]: the first mHC output (backward order) whose gradient is not finite
    first_nonfinite_grad: list | None = None


def nonfinite(s: Step) -> bool:
    return bool(s.first_nonfinite or s.first_nonfinite_grad or not math.isfinite(s.metrics["lm loss"])
                or not math.isfinite(s.metrics["grad-norm"]))


@dataclass
class Trajectory:
    role: str  # impl, native, reference, or native with a knob (native:sinkhorn.eps=1e-08)
    pieces: dict[str, str]  # family -> what ran it
    notes: dict[str, str] = field(default_factory=dict)  # family -> why (ran natively)
    steps: list[Step] = field(default_factory=list)
    error: str | None = None  # what ended it early (a raise, a crash, an interrupt)

    def series(self, metric: str) -> dict[int, float]:
        return {s.step: s.metrics.get(metric, math.nan) for s in self.steps}

    @property
    def nonfinite_step(self) -> Step | None:
        """The first step with a non-finite mHC output, loss or gradient."""
        return next((s for s in self.steps if nonfinite(s)), None)

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict) -> "Trajectory":
        t = Trajectory(d["role"], d["pieces"], d.get("notes", {}), error=d.get("error"))
        t.steps = [Step(**s) for s in d.get("steps", [])]
        return t


def build_model(cfg: TrainConfig) -> model_mod.MHCLanguageModel:
    """The model at its seeded initial state (drawn on the CPU: the same on every device)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        m = model_mod.MHCLanguageModel(cfg.model)
    return m.to(cfg.device)


def run(cfg: TrainConfig, pieces: dict[str, Piece], role: str, interrupted: Callable[[], bool] = lambda: False,
        progress: Callable[[Step], None] | None = None, stop_on_nonfinite: bool = True) -> Trajectory:
    """Train from the seed with ``pieces``; a raise ends the trajectory with the steps so far
    (never mhctool's exit code), as does ``interrupted()`` turning true, and, with
    ``stop_on_nonfinite``, a step whose loss is not finite (every later step would be NaN too)."""
    traj = Trajectory(role, {f: p.name for f, p in pieces.items()}, {f: p.note for f, p in pieces.items() if p.note})
    source = MarkovSource(cfg.model.vocab, cfg.branch, cfg.seed)
    model = build_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    warmup = max(1, cfg.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / warmup))
    names = {id(p): n for n, p in model.named_parameters()}
    rec = Recorder(pieces)
    act = FORMATS[cfg.dtype].torch_dtype
    cuda = cfg.device == "cuda"
    for i in range(1, cfg.steps + 1):
        if interrupted():
            traj.error = "interrupted"
            break
        tokens = source.batch(i, cfg.batch, cfg.model.seq).to(cfg.device)
        rec.reset(cfg.model.layers)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        try:
            opt.zero_grad(set_to_none=True)
            loss = model.loss(tokens, rec, act)
            loss.backward()
            zeros = {names[id(p)]: int(p.grad.numel() - torch.count_nonzero(p.grad))
                     for p in model.parameters() if p.grad is not None}
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
            opt.step()
            sched.step()
            if cuda:
                torch.cuda.synchronize()
        except SystemExit as e:  # code under test never decides mhctool's exit code
            from mhctool.core.errors import system_exit_message
            traj.error = f"step {i}: {system_exit_message(e)}"
            break
        except Exception as e:  # noqa: BLE001 - an implementation that raises ends the run, kept
            from mhctool.runner.call import short_error
            traj.error = f"step {i}: {short_error(e)}"
            break
        metrics = {"lm loss": float(loss.detach()), "grad-norm": float(gnorm), "num-zeros": float(sum(zeros.values())),
                   "iteration-time": time.perf_counter() - t0}
        if cuda:
            metrics["mem-allocated-bytes"] = float(torch.cuda.memory_allocated())
            metrics["mem-max-allocated-bytes"] = float(torch.cuda.max_memory_allocated())
        step = Step(i, metrics, zeros, rec.health, list(rec.first_nonfinite) if rec.first_nonfinite else None,
                    list(rec.first_nonfinite_grad) if rec.first_nonfinite_grad else None)
        traj.steps.append(step)
        if progress:
            progress(step)
        if stop_on_nonfinite and nonfinite(step):  # the update would carry it into every later step
            traj.error = f"step {i}: not finite ({where_nonfinite(step)})"
            break
    return traj


def trajectory_job(cfg_dict: dict, spec: dict, knobs: dict, conventions: dict, log: str, as_used: bool = False) -> dict:
    """What an isolation worker runs: the implementation's trajectory, every step also appended to
    ``log`` (JSON lines), so the steps before a crash or a hang are kept."""
    cfg = from_dict(cfg_dict)
    pieces, _ = impl_pieces(spec, knobs, conventions, cfg.device, cfg.dtype, as_used)
    with open(log, "a") as f:
        def progress(step: Step) -> None:
            f.write(json.dumps(asdict(step)) + "\n")
            f.flush()
        return run(cfg, pieces, "impl", progress=progress).to_dict()


def to_dict(cfg: TrainConfig) -> dict:
    return asdict(cfg)


def from_dict(d: dict) -> TrainConfig:
    return TrainConfig(**{**d, "model": ModelConfig(**d["model"])})


# --- judging the drift -----------------------------------------------------------------------

@dataclass
class Drift:
    """One metric of one trajectory against the reference trajectory."""

    metric: str
    passed: bool
    median: float  # the median distance from the reference over the steps (what is judged)
    threshold: float  # kappa times the native trajectory's median distance, plus the floor
    largest: float  # the largest distance
    parted_at: int | None  # where it first left native's envelope (kappa x native's largest so far)
    parted_by: float | None  # the distance there
    allowed: float | None  # the envelope there
    message: str


def _distances(a: Trajectory, b: Trajectory, metric: str) -> dict[int, float]:
    """Per common step, ``|a - b|``: inf where one is finite and the other is not."""
    sa, sb = a.series(metric), b.series(metric)
    out = {}
    for k in sorted(set(sa) & set(sb)):
        x, y = sa[k], sb[k]
        if math.isfinite(x) and math.isfinite(y):
            out[k] = abs(x - y)
        else:
            out[k] = 0.0 if not (math.isfinite(x) or math.isfinite(y)) else math.inf
    return out


def _floor(metric: str, value: float, cfg: TrainConfig, rule: VerdictRule, params: int) -> float:
    """What two correct runs may differ by at the first step: the activations' rounding of the value
    (``rule.floor_roundoffs`` unit roundoffs), and for a zero count that share of the gradients'
    elements at their dtype (fp32: the parameters' and the gradients')."""
    if metric == "num-zeros":
        return math.ceil(rule.floor_roundoffs * FORMATS["fp32"].unit_roundoff * params)
    u = rule.floor_roundoffs * FORMATS[cfg.dtype].unit_roundoff
    return u * abs(value) if math.isfinite(value) else 0.0


def judge(traj: Trajectory, native: Trajectory, reference: Trajectory, cfg: TrainConfig,
          rule: VerdictRule | None = None, params: int = 0) -> list[Drift]:
    """The drift of ``traj`` from the reference trajectory, per metric: its median distance over
    the steps may be at most ``kappa`` times the native trajectory's, plus the floor. Training is
    chaotic (two correct runs part a little more every step, and the largest distance of one run is
    a noisy maximum), so the median is judged; where the verdict fails, the first step where the
    run left native's envelope (kappa times native's largest distance so far, plus the floor) says
    where it parted and by how much. A trajectory that ended before the reference's last step
    fails; so does a zero-count series with two levels or jumps the reference's has not."""
    import statistics
    rule = rule or VerdictRule()
    out = []
    ref_steps = len(reference.steps)
    for metric in JUDGED:
        d_own, d_nat = _distances(traj, reference, metric), _distances(native, reference, metric)
        refs = reference.series(metric)
        steps = sorted(d_own)
        scale = statistics.median([abs(v) for v in refs.values() if math.isfinite(v)] or [0.0])
        floor = _floor(metric, scale, cfg, rule, params)
        nat = [d_nat[k] for k in steps if k in d_nat and math.isfinite(d_nat[k])]  # non-finite bounds nothing
        med_own = statistics.median(d_own.values()) if d_own else 0.0
        med_nat = statistics.median(nat) if nat else 0.0
        threshold = rule.kappa * med_nat + floor
        worst_nat, parted, at, allowed_at = 0.0, None, None, None
        for k in steps:
            if math.isfinite(d_nat.get(k, 0.0)):
                worst_nat = max(worst_nat, d_nat.get(k, 0.0))
            allowed = rule.kappa * worst_nat + _floor(metric, refs.get(k, math.nan), cfg, rule, params)
            if parted is None and not d_own[k] <= allowed:
                parted, at, allowed_at = k, d_own[k], allowed
        short = len(traj.steps) < ref_steps and traj.error != "interrupted"
        anomaly = _zero_anomaly(traj, reference) if metric == "num-zeros" else None
        passed = med_own <= threshold and not short and anomaly is None
        largest = max(d_own.values(), default=0.0)
        judged = (f"median distance {med_own:.3g} over {len(steps)} steps against {threshold:.3g} allowed "
                  f"(kappa x native's {med_nat:.3g}, plus the floor)")
        if short:
            msg = f"ended at step {len(traj.steps)} of {ref_steps}: {traj.error}"
        elif anomaly:
            msg = f"{anomaly}, which the reference's has not; {judged}"
        elif passed:
            msg = f"stays with the reference: {judged}; largest {largest:.3g}, native's {worst_nat:.3g}"
        else:
            where = (f"; parts from the reference at step {parted}: off by {at:.3g} against {allowed_at:.3g} allowed "
                     f"there (native: {d_nat.get(parted, math.nan):.3g})") if parted is not None else ""
            msg = f"{judged}{where}"
        out.append(Drift(metric, passed, med_own, threshold, largest, parted if not passed else None,
                         at if not passed else None, allowed_at if not passed else None, msg))
    return out


def _zero_anomaly(traj: Trajectory, reference: Trajectory) -> str | None:
    """A num-zeros series with two levels or jumps (``goldens check``) where the reference's has none
    of that kind: the kernel's own zero-count anomaly, whatever its median."""
    from mhctool.analyses.goldens import check
    if len(traj.steps) < 4:
        return None
    ref_kinds = {a.kind for a in check(to_golden(reference)) if a.metric == "num-zeros"}
    own = [a for a in check(to_golden(traj)) if a.metric == "num-zeros" and a.kind in ("bimodal", "jump")
           and a.kind not in ref_kinds]
    return own[0].message if own else None


def nonfinite_sentence(traj: Trajectory, reference: Trajectory) -> str | None:
    """Where a trajectory went non-finite while the reference did not: the step, the first layer
    and mHC output, and how many of its elements."""
    s = traj.nonfinite_step
    if s is None:
        return None
    ref_step = next((r for r in reference.steps if r.step == s.step), None)
    if ref_step is not None and nonfinite(ref_step):
        return None  # the reference went non-finite there too: not the implementation's
    return f"goes non-finite at step {s.step}: " + where_nonfinite(s)


def where_nonfinite(s: Step) -> str:
    """The first non-finite mHC output of a step (forward), else the first gradient (backward)."""
    if s.first_nonfinite:
        layer, fam, name = s.first_nonfinite
        bad = s.health[layer].get(f"nonfinite:{fam}.{name}", 0)
        largest = s.health[layer].get("largest logit")
        logit = f"; the largest Sinkhorn logit there was {largest:.4g}" if largest is not None else ""
        return f"first layer {layer}, {fam} output {name} ({bad} elements non-finite){logit}"
    if s.first_nonfinite_grad:
        layer, fam, name, bad = s.first_nonfinite_grad
        largest = s.health[layer].get("largest logit")
        logit = f"; the largest Sinkhorn logit there was {largest:.4g}" if largest is not None else ""
        return (f"the forward is finite; first in the backward, the gradient of layer {layer}'s {fam} output {name} "
                f"({bad} elements), computed by {CONSUMER[(fam, name)]}'s backward{logit}")
    if not math.isfinite(s.metrics["lm loss"]):
        return "the loss (no mHC output was non-finite)"
    return "the gradients (no mHC output's gradient was non-finite: the sublayer or the head)"


# --- tracing a drift to a knob --------------------------------------------------------------

@dataclass
class Attribution:
    family: str
    knob: str
    value: object
    reproduces: bool
    message: str


def candidate_knobs(specs: dict[str, str], eff: dict[str, dict], pieces: dict[str, Piece], device: str) -> list[tuple]:
    """(family, knob, value, why) for every convention in which the implementation differs from
    the contract where the run does not already compute it: fitted by ``mhctool identify`` on each
    family the implementation has (fp32, its default probes), and its matmul precision."""
    from mhctool.analyses.identify import IDENTIFIABLE, Identifier, fmt_value
    out = []
    for family, piece in pieces.items():
        if piece.fallback or family not in IDENTIFIABLE:
            continue
        impl, _ = _pick(family, specs[family], device, "fp32")
        if impl is None:
            continue
        try:
            ident = Identifier(family, impl, dtype="fp32", device=device, asked=dict(eff[family])).run()
        except Exception:  # noqa: BLE001 - no candidate from a family identify cannot run
            continue
        if ident.best is None or not (ident.best.passed or ident.best.fwd_passed):
            continue
        for k, v in ident.conventions().items():
            out.append((family, k, v, f"identify fits {k}={fmt_value(v)}"))
        if ident.judged_precision() != ident.declared_precision:
            out.append((family, "matmul_precision", ident.judged_precision(),
                        f"identify fits matmul_precision={ident.judged_precision()}"))
    return out


def attribute(traj: Trajectory, native: Trajectory, reference: Trajectory, cfg: TrainConfig,
              eff: dict[str, dict], candidates: list[tuple], rule: VerdictRule, params: int,
              interrupted: Callable[[], bool] = lambda: False,
              precision: dict[str, str] | None = None) -> tuple[list[Attribution], list[Trajectory]]:
    """Rerun the native implementation with each candidate knob; it reproduces the drift where
    the implementation's trajectory stays with that run as it would with the reference (every
    judged metric within kappa times the native noise)."""
    found, runs = [], []
    prec = precision or {}
    for family, knob, value, why in candidates:
        if interrupted():
            break
        pieces = {f: (native_piece(f, eff[f], value) if knob == "matmul_precision" and f == family
                      else native_piece(f, {**eff[f], knob: value}, prec.get(f, "ieee")) if f == family
                      else native_piece(f, eff[f], prec.get(f, "ieee")))
                  for f in FAMILIES}
        role = f"native:{family}.{knob}={value}"
        alt = run(cfg, pieces, role, interrupted)
        runs.append(alt)
        same = all(d.passed for d in judge(traj, native, replace(alt, role="as-reference"), cfg, rule, params))
        # the knob must also be what moves native: a knob that changes nothing explains nothing
        moves = not all(d.passed for d in judge(alt, native, reference, cfg, rule, params))
        ok = same and moves
        found.append(Attribution(family, knob, value, ok,
                                 f"the native run with {family}.{knob}={value} ({why}) "
                                 + ("drifts the same way" if ok else "does not drift the same way"
                                    if moves else "does not drift from the reference")))
    return found, runs


# --- golden values and report rows -----------------------------------------------------------

def to_golden(traj: Trajectory):
    """The trajectory in Megatron's golden-value form (``mhctool goldens`` reads it)."""
    from mhctool.analyses.goldens import Series
    out = {}
    steps = [s.step for s in traj.steps]
    for metric in GOLDEN_METRICS:
        vals = {s.step: float(s.metrics[metric]) for s in traj.steps if metric in s.metrics}
        if vals:
            out[metric] = Series(min(steps), max(steps), 1, vals)
    return out


def rows(trajs: list[Trajectory]) -> list[dict]:
    """Report rows (report.TRAIN_SCHEMA): per trajectory, step and metric; health per layer."""
    out = []
    for t in trajs:
        for s in t.steps:
            for metric, v in s.metrics.items():
                out.append({"run": t.role, "step": s.step, "layer": None, "metric": metric, "value": float(v),
                            "threshold": None, "passed": None, "message": None})
            for name, count in s.zeros.items():
                if count:
                    out.append({"run": t.role, "step": s.step, "layer": None, "metric": f"zeros:{name}",
                                "value": float(count), "threshold": None, "passed": None, "message": None})
            for layer, h in enumerate(s.health):
                for name, v in h.items():
                    out.append({"run": t.role, "step": s.step, "layer": layer, "metric": name, "value": float(v),
                                "threshold": None, "passed": None, "message": None})
            if s.first_nonfinite:
                layer, fam, name = s.first_nonfinite
                out.append({"run": t.role, "step": s.step, "layer": layer, "metric": "first non-finite",
                            "value": math.nan, "threshold": None, "passed": None, "message": f"{fam}.{name}"})
    return out


def verdict_rows(role: str, drifts: list[Drift]) -> list[dict]:
    return [{"run": role, "step": d.parted_at, "layer": None, "metric": f"drift:{d.metric}", "value": d.median,
             "threshold": d.threshold, "passed": d.passed, "message": d.message} for d in drifts]


def zero_sources(traj: Trajectory, top: int = 3) -> list[tuple[str, float]]:
    """The parameters whose gradients hold the most exact zeros, on average over the steps."""
    totals: dict[str, float] = {}
    for s in traj.steps:
        for name, n in s.zeros.items():
            totals[name] = totals.get(name, 0.0) + n / max(1, len(traj.steps))
    return sorted(((k, v) for k, v in totals.items() if v), key=lambda kv: -kv[1])[:top]


def param_count(cfg: TrainConfig) -> int:
    return sum(p.numel() for p in build_model(replace(cfg, device="cpu")).parameters())


def read_log(path: str | Path) -> list[Step]:
    """The steps an isolated trajectory logged before it ended (a crash keeps them)."""
    out = []
    p = Path(path)
    if p.is_file():
        for line in p.read_text().splitlines():
            try:
                out.append(Step(**json.loads(line)))
            except (json.JSONDecodeError, TypeError):
                break  # a line cut short by the crash
    return out


# --- a whole run: the implementation, native, reference, the verdict, the attribution ----------

@dataclass
class Outcome:
    cfg: TrainConfig
    spec: str
    trajectories: list[Trajectory]  # the implementation's first, then native and reference
    eff: dict[str, dict]  # per family, the knobs every trajectory computed
    drifts: list[Drift] = field(default_factory=list)
    nonfinite: str | None = None  # where the implementation went non-finite and the reference did not
    attributions: list[Attribution] = field(default_factory=list)
    interrupted: bool = False
    traced_asked: bool = True  # the drift was to be traced (--trace)

    @property
    def impl(self) -> Trajectory:
        return self.trajectories[0]

    def role(self, name: str) -> Trajectory | None:
        return next((t for t in self.trajectories if t.role == name), None)

    @property
    def compared(self) -> bool:
        return self.role("reference") is not None

    @property
    def passed(self) -> bool:
        return (self.impl.error is None and self.nonfinite is None and all(d.passed for d in self.drifts)
                and not self.interrupted)

    def traced(self) -> str | None:
        """The sentence that names the knob a drift comes from, or says it is the kernel's own."""
        if not self.traced_asked or not self.drifts or all(d.passed for d in self.drifts) or self.nonfinite \
                or self.impl.error:
            return None
        hits = [a for a in self.attributions if a.reproduces]
        if hits:
            a = hits[0]
            return f"{a.message}: the drift is {a.family}.{a.knob}"
        tried = ", ".join(f"{a.family}.{a.knob}={a.value}" for a in self.attributions)
        return ("no convention in which it differs reproduces it" + (f" (tried: {tried})" if tried else
                " (identify fits it no other convention)") + ": the drift is the kernel's own error")


def parse_knobs(items: list[tuple[str, str]], flag: str, conventions_only: bool = False) -> dict[str, dict]:
    """``FAMILY.KNOB=VALUE`` or ``KNOB=VALUE`` (every family of the model that has it) -> per family,
    each value checked; a knob no family of the model has (or no convention, for --convention) is
    a UsageError."""
    from mhctool.analyses.knob_shift import typed_value
    out: dict[str, dict] = {}
    for name, raw in items:
        family, _, knob = name.rpartition(".")
        takers = [family] if family else [f for f in FAMILIES if knob in registry.get_family(f).knobs]
        for f in takers:
            if f not in FAMILIES:
                raise UsageError(f"{flag} {name}: the model's mHC families are {', '.join(FAMILIES)}")
            fam = registry.get_family(f)
            ok = knob in (fam.conventions if conventions_only else fam.knobs)
            if not ok:
                raise UsageError(f"{flag} {name}: {knob} is no {'convention' if conventions_only else 'knob'} of {f}; "
                                 f"accepted: {', '.join(fam.conventions if conventions_only else fam.knobs) or 'none'}")
            out.setdefault(f, {})[knob] = fam.knobs[knob].check(f, knob, typed_value(fam.knobs[knob].kind, knob, raw))
        if not takers:
            raise UsageError(f"{flag} {name}: no mHC family of the model has the knob {knob}")
    return out


def session(cfg: TrainConfig, spec: str | dict[str, str], knobs: dict[str, dict] | None = None,
            conventions: dict[str, dict] | None = None, rule: VerdictRule | None = None, compare: bool = True,
            trace: bool = True, isolation=None, interrupted: Callable[[], bool] = lambda: False,
            progress: Callable[[str, Step], None] | None = None, as_used: bool = False) -> Outcome:
    """The implementation's trajectory, then (``compare``) the native and float64 ones, the
    verdict, and (``trace``) the attribution of a drift. ``isolation``: an isolation Worker the
    implementation's trajectory runs in (a crash or a hang ends it with its steps kept)."""
    rule = rule or VerdictRule()
    knobs, conventions = knobs or {}, conventions or {}
    specs = spec if isinstance(spec, dict) else {f: spec for f in FAMILIES}
    pieces, eff = impl_pieces(specs, knobs, conventions, cfg.device, cfg.dtype, as_used)
    say = (lambda role: (lambda step: progress(role, step))) if progress else (lambda role: None)
    if isolation is not None:
        impl = _isolated(cfg, specs, knobs, conventions, pieces, isolation, interrupted, as_used)
    else:
        impl = run(cfg, pieces, "impl", interrupted, say("impl"))
    out = Outcome(cfg, " ".join(dict.fromkeys(specs.values())), [impl], eff, traced_asked=trace)
    if compare and not interrupted():
        out.trajectories.append(run(cfg, {f: native_piece(f, eff[f], pieces[f].precision) for f in FAMILIES},
                                    "native", interrupted, say("native")))
        out.trajectories.append(run(cfg, {f: reference_piece(f, eff[f]) for f in FAMILIES}, "reference",
                                    interrupted, say("reference")))
        native, reference = out.trajectories[1], out.trajectories[2]
        params = param_count(cfg)
        out.drifts = judge(impl, native, reference, cfg, rule, params)
        out.nonfinite = nonfinite_sentence(impl, reference)
        if trace and not out.nonfinite and impl.error is None and not all(d.passed for d in out.drifts) \
                and not interrupted():
            cands = candidate_knobs(specs, eff, pieces, cfg.device)
            precision = {f: p.precision for f, p in pieces.items()}
            out.attributions, alts = attribute(impl, native, reference, cfg, eff, cands, rule, params, interrupted,
                                               precision)
            out.trajectories.extend(alts)
    out.interrupted = interrupted() or any(t.error == "interrupted" for t in out.trajectories)
    return out


def _isolated(cfg: TrainConfig, spec: dict, knobs: dict, conventions: dict, pieces: dict[str, Piece], worker,
              interrupted, as_used: bool = False) -> Trajectory:
    import tempfile
    with tempfile.TemporaryDirectory(prefix="mhctool-train-") as d:
        log = str(Path(d) / "steps.jsonl")
        value, failure = worker.call("mhctool.analyses.train:trajectory_job", (to_dict(cfg), spec, knobs, conventions, log,
                                                                       as_used),
                                     timeout=None, interrupted=interrupted)
        if failure is None:
            return Trajectory.from_dict(value)
        traj = Trajectory("impl", {f: p.name for f, p in pieces.items()},
                          {f: p.note for f, p in pieces.items() if p.note})
        traj.steps = read_log(log)
        traj.error = f"step {len(traj.steps) + 1}: {failure.message}"
        return traj


def report_rows(out: Outcome) -> list[dict]:
    """Every trajectory's rows, then the verdict's (report.TRAIN_SCHEMA)."""
    rs = rows(out.trajectories)
    rs += verdict_rows("impl", out.drifts)
    if out.nonfinite:
        rs.append({"run": "impl", "step": out.impl.nonfinite_step.step, "layer": None, "metric": "nonfinite",
                   "value": math.nan, "threshold": None, "passed": False, "message": out.nonfinite})
    if out.impl.error and out.impl.error != "interrupted":
        rs.append({"run": "impl", "step": len(out.impl.steps) + 1, "layer": None, "metric": "error",
                   "value": math.nan, "threshold": None, "passed": False, "message": out.impl.error})
    for a in out.attributions:
        rs.append({"run": "impl", "step": None, "layer": None, "metric": f"traced:{a.family}.{a.knob}",
                   "value": math.nan, "threshold": None, "passed": a.reproduces, "message": a.message})
    return rs


def settings(out: Outcome, **extra) -> dict:
    return {"command": "train", "impl": out.spec, "config": to_dict(out.cfg), "knobs": out.eff,
            "pieces": out.impl.pieces, "notes": out.impl.notes, "traced": out.traced(),
            "interrupted": out.interrupted, **extra}

