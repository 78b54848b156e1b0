"""One trajectory: the model trained from a seed with given pieces, every step's golden-value
metrics, where the zeros are, and mHC health per layer; where a step first went non-finite."""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch

from mhctool.analyses.goldens import Series
from mhctool.analyses.train.pieces import Piece, impl_pieces
from mhctool.analyses.train.setup import (
    GOLDEN_METRICS,
    MarkovSource,
    TrainConfig,
    from_dict,
)
from mhctool.core.dtypes import FORMATS
from mhctool.core.errors import kept_at_once, system_exit_message
from mhctool.core.metrics import h_res_health
from mhctool.references import model as model_mod
from mhctool.references.dropout import counters_used
from mhctool.runner.call import load_digest, settled, short_error

# whose backward computes the gradient each mHC output receives (a non-finite gradient there is
# that backward's)
CONSUMER = {("mapping", "h_pre"): "h_aggregate", ("mapping", "h_post"): "h_post_bda",
            ("mapping", "h_res_logits"): "sinkhorn", ("sinkhorn", "h_res"): "h_post_bda",
            ("h_aggregate", "out"): "the sublayer (attention, MLP)", ("h_post_bda", "out"): "the layer above",
            ("mix_aggregate", "out"): "the sublayer (attention, MLP)", ("mix_aggregate", "h_post"): "h_post_bda",
            ("mix_aggregate", "h_res"): "h_post_bda"}


class Recorder:
    """The model's ``ops``: calls the pieces, and records per layer what the contract cares about
    (health) and the first non-finite output, in call order."""

    def __init__(self, pieces: dict[str, Piece]):
        self.pieces = pieces
        self.health: list[dict] = []
        self.first_nonfinite: tuple[int, str, str] | None = None  # (layer, family, output)
        # the first mHC output, in backward order, whose incoming gradient is not finite
        self.first_nonfinite_grad: tuple[int, str, str, int] | None = None  # (+ how many elements)
        # on a GPU's first step: each piece's outputs and input gradients checked for work left
        # on another stream (runner.call.settled; a device synchronization each)
        self.check_streams = False

    def reset(self, layers: int) -> None:
        self.health = [{} for _ in range(layers)]
        self.first_nonfinite = self.first_nonfinite_grad = None

    def layer(self, index: int) -> "LayerCalls":
        return LayerCalls(self, index)

    def _seen(self, index: int, family: str, names: tuple[str, ...], outs: tuple, args: dict | None = None) -> None:
        """What a layer's call of ``family`` gave (``args``: what it was given, for a recorder that keeps it)."""
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
        if family in ("sinkhorn", "mix_aggregate"):  # H_res: Sinkhorn's output, the pre-path's third
            h.update({k: float(v) for k, v in h_res_health(outs[-1]).items()})


    def _grad(self, where: tuple, g: torch.Tensor) -> None:
        if self.first_nonfinite_grad is None:
            bad = int((~torch.isfinite(g)).sum())
            if bad:
                self.first_nonfinite_grad = (*where, bad)


# the key of the model's dropout masks (the counters go on from call to call)
DROPOUT_SEED = 0x6D4843


class LayerCalls:
    """One layer's ``ops`` (the model's calls of the mHC families): each call runs ``rec``'s piece
    and tells ``rec._seen`` what it was given and gave (the trajectory's recorder, the first step's)."""

    def __init__(self, rec: Recorder, index: int):
        self.rec, self.index = rec, index
        self.whole = "mix_aggregate" in rec.pieces  # a whole-module variant: the pre-path in one call

    def _call(self, family: str, names: tuple[str, ...], **args) -> tuple:
        outs = self.rec.pieces[family].call(args)
        if self.rec.check_streams:
            self._check_streams(family, outs, args)
        self.rec._seen(self.index, family, names, outs, args)
        return outs

    def _check_streams(self, family: str, outs: tuple, args: dict) -> None:
        if why := settled(outs, "outputs"):
            raise RuntimeError(f"layer {self.index} {family}'s forward: {why}")
        for name, t in args.items():
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(lambda g, name=name: self._settled_grad(family, name, g))

    def _settled_grad(self, family: str, name: str, g: torch.Tensor) -> None:
        if why := settled([g], "gradients"):
            raise RuntimeError(f"layer {self.index} {family}'s backward (the gradient of {name}): {why}")

    def mapping(self, x2d, weight, alpha, h_bias):
        return self._call("mapping", ("h_pre", "h_post", "h_res_logits"), x2d=x2d, weight=weight, alpha=alpha,
                          h_bias=h_bias)

    def sinkhorn(self, logits):
        return self._call("sinkhorn", ("h_res",), logits=logits)[0]

    def pre_path(self, x, weight, alpha, h_bias):
        return self._call("mix_aggregate", ("out", "h_post", "h_res"), x=x, weight=weight, alpha=alpha, h_bias=h_bias)

    def h_aggregate(self, x, h_pre):
        return self._call("h_aggregate", ("out",), x=x, h_pre=h_pre)[0]

    def h_post_bda(self, h_res, x, h_post, y, bias):
        # the dropout's key (where --knob h_post_bda.dropout sets one): counters drawn in call order,
        # so each call's mask is its own and the trajectories, which call alike, draw the same masks
        s, b, n, c = x.shape
        offset = getattr(self.rec, "dropout_drawn", 0)
        self.rec.dropout_drawn = offset + counters_used(s * b, n, c)
        return self._call("h_post_bda", ("out",), h_res=h_res, x=x, h_post=h_post, y=y, bias=bias,
                          dropout_seed=DROPOUT_SEED, dropout_offset=offset)[0]


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
    seed: int = 0  # the seed it was trained from
    hung: bool = False  # ended by its step limit (a hang): its implementation is not called again

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
        t = Trajectory(d["role"], d["pieces"], d.get("notes", {}), error=d.get("error"), seed=d.get("seed", 0),
                       hung=d.get("hung", False))
        t.steps = [Step(**s) for s in d.get("steps", [])]
        return t


def build_model(cfg: TrainConfig) -> model_mod.MHCLanguageModel:
    """The model at its seeded initial state (drawn on the CPU: the same on every device)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        m = model_mod.MHCLanguageModel(cfg.model)
    return m.to(cfg.device)


def run(cfg: TrainConfig, pieces: dict[str, Piece], role: str, interrupted: Callable[[], bool] = lambda: False,
        progress: Callable[[Step], None] | None = None, stop_on_nonfinite: bool = True,
        at: Callable[[int, str], None] | None = None) -> Trajectory:
    """Train from the seed with ``pieces``; a raise ends the trajectory with the steps so far
    (never mhctool's exit code), named by step and phase (the forward, the backward, the update),
    as does ``interrupted()`` turning true, and, with ``stop_on_nonfinite``, a step whose loss is
    not finite (every later step would be NaN too). ``at(step, phase)``: told as each phase starts
    (an isolated trajectory's parent says where a crash was). On a GPU the forward is synchronized
    before the backward starts, so that an asynchronous fault is its phase's."""
    traj = Trajectory(role, {f: p.name for f, p in pieces.items()}, {f: p.note for f, p in pieces.items() if p.note},
                      seed=cfg.seed)
    source = MarkovSource(cfg.model.vocab, cfg.branch, cfg.seed)
    model = build_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    warmup = max(1, cfg.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / warmup))
    names = {id(p): n for n, p in model.named_parameters()}
    rec = Recorder(pieces)
    act = FORMATS[cfg.dtype].torch_dtype
    cuda = cfg.device == "cuda"
    if cuda:
        load_digest(cfg.device)  # before the first step's check of each piece (LayerCalls._check_streams)
    with kept_at_once():  # a second signal mid-step: the steps so far are kept
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
            rec.check_streams = cuda and i == 1
            phase = "forward"
            try:
                if at:
                    at(i, phase)
                opt.zero_grad(set_to_none=True)
                loss = model.loss(tokens, rec, act)
                if cuda:
                    torch.cuda.synchronize()
                phase = "backward"
                if at:
                    at(i, phase)
                loss.backward()
                phase = "update"
                if at:
                    at(i, phase)
                zeros = {names[id(p)]: int(p.grad.numel() - torch.count_nonzero(p.grad))
                         for p in model.parameters() if p.grad is not None}
                gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
                opt.step()
                sched.step()
                if cuda:
                    torch.cuda.synchronize()
            except SystemExit as e:  # code under test never decides mhctool's exit code
                traj.error = f"step {i}, {phase}: {system_exit_message(e)}"
                break
            except Exception as e:  # noqa: BLE001 - an implementation that raises ends the run, kept
                traj.error = f"step {i}, {phase}: {short_error(e)}"
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
    if traj.error is None and len(traj.steps) < cfg.steps:  # abandoned by a second signal
        traj.error = "interrupted"
    return traj


# the step log's last line once the implementation's trajectory has ended: what the worker runs
# after it (native's and float64's trajectories, in a seed worker) is no step of it to watch
LOG_END = {"end": "impl"}


def trajectory_job(cfg_dict: dict, spec: dict, knobs: dict, conventions: dict, log: str, as_used: bool = False) -> dict:
    """What an isolation worker runs: the implementation's trajectory, every step also appended to
    ``log`` (JSON lines), so the steps before a crash or a hang are kept."""
    return logged_run(from_dict(cfg_dict), spec, knobs, conventions, log, as_used).to_dict()


def logged_run(cfg: TrainConfig, spec: dict, knobs: dict, conventions: dict, log: str, as_used: bool) -> Trajectory:
    """The implementation's trajectory with every step appended to ``log`` and the phase beside it
    (:class:`StepWatch` watches it), then :data:`LOG_END`."""
    with open(log, "a") as f:  # first: StepWatch counts the first step from here
        pieces, _ = impl_pieces(spec, knobs, conventions, cfg.device, cfg.dtype, as_used)
        def progress(step: Step) -> None:
            f.write(json.dumps(asdict(step)) + "\n")
            f.flush()
        traj = run(cfg, pieces, "impl", progress=progress, at=lambda i, phase: write_phase(log, i, phase))
        f.write(json.dumps(LOG_END) + "\n")
        f.flush()
        return traj


def write_phase(log: str | Path, step: int, phase: str) -> None:
    """Where an isolated trajectory is (``step phase`` beside its step log), for :func:`read_phase`."""
    Path(f"{log}.at").write_text(f"{step} {phase}")


def read_phase(log: str | Path) -> str | None:
    """\"step N, PHASE\" of the last :func:`write_phase` beside ``log``, or None."""
    try:
        step, phase = Path(f"{log}.at").read_text().split()
    except (OSError, ValueError):
        return None
    return f"step {step}, {phase}"


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


def to_golden(traj: Trajectory):
    """The trajectory in Megatron's golden-value form (``mhctool goldens`` reads it)."""
    out = {}
    steps = [s.step for s in traj.steps]
    for metric in GOLDEN_METRICS:
        vals = {s.step: float(s.metrics[metric]) for s in traj.steps if metric in s.metrics}
        if vals:
            out[metric] = Series(min(steps), max(steps), 1, vals)
    return out


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


# an isolated trajectory's step limits where --step-timeout is not given: the first step compiles
# (a library's kernels, autotuning, every shape new), a later one is judged by those before it
FIRST_STEP_S = 600.0
LATER_STEP_MIN_S = 60.0
LATER_STEP_FACTOR = 10.0


class StepWatch:
    """Whether an isolated trajectory hung: polled while its worker runs, it watches the step log
    (:func:`trajectory_job` appends a line a step) and says why once no step has ended for longer
    than allowed. ``limit``: seconds a step may take; None: :data:`FIRST_STEP_S` for the first, and
    for a later one :data:`LATER_STEP_FACTOR` times the slowest before it, at least
    :data:`LATER_STEP_MIN_S`."""

    def __init__(self, log: str | Path, limit: float | None = None, clock: Callable[[], float] = time.monotonic):
        self.log, self.limit, self.clock = Path(log), limit, clock
        self.size, self.steps, self.slowest = 0, 0, 0.0
        self.since = clock()
        self.started: float | None = None  # the last poll before the log appeared
        self.ended = False  # the trajectory ended (LOG_END): nothing more to watch

    def allowed(self) -> float:
        if self.limit is not None:
            return self.limit
        if self.steps == 0:
            return FIRST_STEP_S
        return max(LATER_STEP_MIN_S, LATER_STEP_FACTOR * self.slowest)

    def __call__(self) -> str | None:
        if self.ended:
            return None
        now = self.clock()
        try:
            size = self.log.stat().st_size
        except OSError:  # not started yet: the worker imports the training code and the implementation
            if now - self.since > FIRST_STEP_S:
                return f"timed out: the trajectory had not started after {FIRST_STEP_S:g} s"
            self.started = now
            return None
        if self.steps == 0 and self.size == 0 and self.started is not None:
            self.since, self.started = self.started, None  # the first step's clock starts with the job
        if size != self.size:
            if self._ends():
                self.ended = True
                return None
            if self.steps:  # the first step's time is its compiling, not the pace
                self.slowest = max(self.slowest, now - self.since)
            self.size, self.steps, self.since = size, self.steps + 1, now
            return None
        allowed = self.allowed()
        if now - self.since > allowed and not self._ends():
            return f"timed out: no step ended in {allowed:g} s (a hang; --step-timeout sets the limit)"
        return None

    def _ends(self) -> bool:
        """Whether the log's last line is :data:`LOG_END`."""
        try:
            with open(self.log, "rb") as f:
                f.seek(max(0, self.log.stat().st_size - 64))
                tail = f.read().decode(errors="replace").rstrip("\n").rsplit("\n", 1)[-1]
        except OSError:
            return False
        return tail == json.dumps(LOG_END)
