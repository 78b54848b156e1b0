"""``mhctool train --engine``: the trajectories come from another trainer's own model, optimizer and
schedule (Megatron-core's, staged unchanged: :mod:`mhctool.libraries.megatron_core`), with the
implementation under test swapped in at its mHC module's entry points.

An engine is a function ``train(tree, recipe, progress, ops)``: ``recipe`` a
:class:`~mhctool.libraries.megatron_core.Recipe`, ``progress(record)`` called after every step with
Megatron's golden-value metrics and each parameter's exact-zero count (``zeros``), ``ops`` the
module's entry points to replace (family -> callable, called as Megatron calls them: ``proj_rms(x2d,
weight, eps) -> (proj, r)``, ``sinkhorn(logits, iters, eps)``, ``h_aggregate(x, h_pre)``,
``h_post_bda(h_res, residual, h_post, x, bias)``). ``megatron:DIR`` is Megatron-core's;
``FILE.py:function`` or ``module:function`` is anyone's with that interface (the tests' stand-in).

Each trajectory runs in a process of its own, one a rank at tensor parallelism (Megatron keeps
global state, and a crash, an exit or a hang in it ends that run with its steps kept, never
mhctool); several run side by side:

- ``impl``: the implementation under test. ``megatron`` is Megatron's own switch
  (``use_fused_mhc``: its fused kernels); any other ``--impl`` is swapped in at the entry points,
  with its declared conventions, its inputs at the contract's dtypes (the mapping path fp32: the
  Sinkhorn logits, the projection's weight, h_pre, h_post and h_res) and its outputs at the
  dtypes Megatron's own ops return;
- ``native``: Megatron's own unfused path;
- ``reference``: mhctool's float64 references at the entry points, at the conventions of
  Megatron's own path (:data:`~mhctool.libraries.megatron_core.NATIVE_CONVENTIONS`);
- ``native:FAMILY.KNOB=VALUE``: the tracing's reruns, Megatron's own path with mhctool's native
  piece computing the knob at one entry point.
"""
from __future__ import annotations

import os
import signal

if __name__ == "__main__" and os.environ.get("MHCTOOL_PARENT_STOPS"):  # ranks.PARENT_STOPS, before any import
    for _s in (signal.SIGINT, signal.SIGTERM):  # a terminal's Ctrl-C or timeout's signal to the group: the
        signal.signal(_s, signal.SIG_IGN)       # parent decides (the run in hand ends, or it is killed)

import argparse
import importlib.util
import json
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Callable

import torch

from mhctool.analyses.knob_shift import typed_value
from mhctool.analyses.train import first_step as first_step_mod
from mhctool.analyses.train import module_path
from mhctool.analyses.train.pieces import assign as model_assign
from mhctool.analyses.train.pieces import family_call, native_piece, pick_impl, reference_piece
from mhctool.analyses.train.ranks import STALL_S, gpu_slots, run_ranks
from mhctool.analyses.train.session import parse_knobs
from mhctool.analyses.train.setup import GOLDEN_METRICS, config
from mhctool.analyses.train.trace import fitted
from mhctool.analyses.train.trajectory import Step, Trajectory
from mhctool.core.environment import ensure_triton_mode
from mhctool.core.errors import UsageError, kept_at_once
from mhctool.families import get_family
from mhctool.runner.call import short_error
from mhctool.libraries import megatron_core as mc
from mhctool.libraries.megatron_core import NATIVE_CONVENTIONS, Recipe, recipe_from
from mhctool.registry import loading
from mhctool.registry.specs import resolve_impls

# the entry points of Megatron's HyperConnectionModule, by the mhctool family each computes
ENGINE_FAMILIES = ("proj_rms", "sinkhorn", "h_aggregate", "h_post_bda")
MEGATRON = "mhctool.libraries.megatron_core:train"
# the recipe's options for bench --engine alone (the baseline without hyper-connections, the
# per-step checks off, the entry points timed)
BENCH_ONLY = ("hyper_connections", "watch", "time_entry_from")


@dataclass(frozen=True)
class EngineSpec:
    target: str  # module:function or FILE.py:function of the engine's train
    tree: str | None  # what it is given first (Megatron-core's staged tree)
    name: str  # as the user wrote it
    generation: str = "pr3828"  # whose native conventions the float64 run takes


def parse_engine(text: str) -> EngineSpec:
    """``megatron:DIR`` (a staged megatron-core: DIR/megatron/core), or an engine function; bad
    input is a UsageError (exit 2) in one sentence."""
    kind, sep, rest = text.partition(":")
    if kind == "megatron":
        if not sep or not rest:
            raise UsageError("--engine megatron:DIR needs the folder of a staged megatron-core "
                             "(../shared/anchors/stage.sh megatron-core GIT_DIR writes .anchors/megatron-core/m3828)")
        if not (Path(rest) / "megatron" / "core").is_dir():
            raise UsageError(f"--engine {text}: {rest} holds no megatron/core "
                             "(stage one with ../shared/anchors/stage.sh megatron-core GIT_DIR)")
        return EngineSpec(MEGATRON, str(Path(rest).resolve()), text, mc.generation(rest))
    target, _, tree = text.partition("@")
    if ":" not in target:
        raise UsageError(f"unknown --engine {text!r}; accepted: megatron:DIR, or FILE.py:function[@DIR] "
                         "(a function train(tree, recipe, progress, ops))")
    try:
        load_engine(target)
    except UsageError as e:
        raise UsageError(f"--engine {text}: {e}") from None
    return EngineSpec(target, tree or None, text)


def load_engine(target: str) -> Callable:
    """``module:function`` or ``FILE.py:function`` -> the engine's train; a UsageError if absent."""
    where, _, name = target.rpartition(":")
    module = loading.load_path_or_module(where, where, Path(where).name)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise UsageError(f"{where} has no function {name}")
    return fn


def recipe_options(items: list[tuple[str, str]]):
    """``--recipe KEY=VALUE`` items as the recipe's typed options (parsed as knob values are); an
    unknown key or a value of the wrong kind is a UsageError."""

    kinds = {f.name: str(f.type) for f in fields(Recipe)}
    out = {}
    for key, raw in items:
        if key not in kinds:
            raise UsageError(f"--recipe {key}: no such option; accepted: {', '.join(kinds)}")
        kind = kinds[key].split(" ")[0]  # bool, int or float (| None: none is accepted)
        if raw.lower() in ("none", "null") and "None" in kinds[key]:
            out[key] = None
            continue
        try:
            v = typed_value({"bool": bool, "int": int, "float": float}[kind], key, raw)
        except UsageError:
            v = None
        if v is None or (kind == "int" and not isinstance(v, int)):
            raise UsageError(f"--recipe {key}={raw}: expected {kind}")
        out[key] = v
    return out


def assign(specs: list[str]) -> dict[str, str]:
    """Which spec each entry point runs: ``megatron`` (Megatron's own fused kernels, by its switch)
    stands alone, as does a whole-module spec (``triton[module]``: mhctool's kernels for the
    module's pre- and post-path, :mod:`~mhctool.analyses.train.module_path`); a function spec is
    the family its parameters are named after; a built-in or a library stands for every entry
    point it has."""
    alone = [s for s in specs if s == "megatron" or module_path.backend_of(s)]
    if alone and len(specs) > 1:
        raise UsageError(f"--impl {alone[0]} is " + ("Megatron's own fused kernels (its use_fused_mhc switch)"
                                                     if alone[0] == "megatron" else "the whole module")
                         + ": it does not combine with another --impl")
    if "megatron" in specs:
        return {f: "megatron" for f in ENGINE_FAMILIES}
    if alone:
        return {module_path.KEY: module_path.backend_of(alone[0])}
    out = {}
    for spec, fams in ((s, model_assign([s])) for s in specs):
        for family, s in fams.items():
            out.setdefault("proj_rms" if family == "mapping" else family, s)
    return out


def configure(engine: str, recipe_items: list[tuple[str, str]], specs: list[str], device: str, sizes: dict,
              seed: int, knob_items: list[tuple[str, str]], convention_items: list[tuple[str, str]],
              ranks: int | None, workers, seeds: int):
    """The run's configuration and its runner for ``--engine``: the recipe with the sizes given
    (None: the recipe's) and its ``--recipe`` options, ``--ranks`` as its tensor parallelism (with
    the recipe's sequence parallelism unless ``--recipe sequence_parallel=false``), the
    implementations assigned, the knobs and conventions checked, how many trajectories run side by
    side (``workers``: a number, else :func:`side_by_side_default`); bad input is a UsageError."""

    spec = parse_engine(engine)
    if spec.target == MEGATRON and device != "cuda":
        raise UsageError("--engine megatron runs Megatron-core's model on a GPU (it takes its buffers on CUDA); "
                         "no GPU here (--device cuda)")
    if spec.target == MEGATRON and importlib.util.find_spec("einops") is None:
        raise UsageError("--engine megatron: Megatron-core imports einops, which is not installed (pip install einops)")
    opts = recipe_options(recipe_items)
    bench_only = [k for k in opts if k in BENCH_ONLY]
    if bench_only:
        raise UsageError(f"--recipe {bench_only[0]} is bench --engine's (how it times a step), not train's")
    if ranks is not None:
        if opts.get("tp", ranks) != ranks:
            raise UsageError(f"--ranks {ranks} and --recipe tp={opts['tp']} disagree")
        opts["tp"] = ranks
    if opts.get("tp", 1) > 1:  # the recipe's parallelism: sequence parallel wherever tensor parallel
        opts.setdefault("sequence_parallel", True)
    given, opts = sized(sizes, device, opts)
    r = replace(Recipe(), **given, **opts, seed=seed)
    if spec.target == MEGATRON and r.tp > 1:
        if torch.cuda.device_count() < r.tp:
            raise UsageError(f"--recipe tp={r.tp} runs a rank a GPU; this machine has {torch.cuda.device_count()}")
        if r.heads % r.tp or r.vocab % r.tp:
            raise UsageError(f"--recipe tp={r.tp} must divide the heads ({r.heads}) and the vocabulary ({r.vocab})")
    if r.sequence_parallel and r.tp < 2:
        raise UsageError("--recipe sequence_parallel=true needs tensor parallelism (tp=2 or more)")
    if r.global_batch % r.micro_batch:
        raise UsageError(f"--recipe global_batch={r.global_batch} must be a multiple of the micro-batch ({r.micro_batch})")
    assigned = assign(specs)
    for f, s in assigned.items():  # an unknown implementation, a function of the wrong form: before training
        if s != "megatron" and f != module_path.KEY:
            resolve_impls(f, [s])
    knobs = parse_knobs(knob_items, "--knob")
    conventions = parse_knobs(convention_items, "--convention", conventions_only=True)
    cfg = config(device, steps=r.steps, layers=r.layers, streams=r.streams, hidden=r.hidden, heads=r.heads,
                 seq=r.seq, batch=r.micro_batch, vocab=r.vocab, lr=r.lr, dtype="bf16", seed=seed)
    together = workers if isinstance(workers, int) else side_by_side_default(device, r.tp)
    return cfg, EngineRunner(spec, r, assigned, knobs, conventions, device=device,
                             workers=max(1, min(together, 3 * seeds)))


# the recipe's sizes on a CPU where none is given (an engine that runs there, as the tests' stand-in
# does: Megatron-core's needs a GPU): two layers, hidden 64, sequences of 64, micro-batches of 2
# of 4, a vocabulary of 512, so that bench --engine's five variants take about a minute on 2 cores
CPU_SIZES = {"layers": 2, "hidden": 64, "heads": 4, "seq": 64, "micro_batch": 2, "vocab": 512}
CPU_RECIPE = {"global_batch": 4}


def sized(sizes: dict, device: str, opts: dict | None = None) -> tuple[dict, dict]:
    """The sizes and recipe options a run takes: those given, and on a CPU :data:`CPU_SIZES` and
    :data:`CPU_RECIPE` where not given (the recipe's own on a GPU)."""
    given = {k: v for k, v in sizes.items() if v is not None}
    opts = dict(opts or {})
    if device != "cuda":
        given = {**CPU_SIZES, **given}
        opts = {**CPU_RECIPE, **opts}
    return given, opts


# trajectories side by side on one GPU by default: Megatron's recipe at 12 layers ran 16 processes
# side by side on one H200 (dev/mcore_ablation.py, 2026-11-28); its steps are many small kernels, so
# the GPU takes several at once
PER_GPU = 4


def side_by_side_default(device: str, tp: int = 1) -> int:
    """Trajectories at once where ``--workers`` is auto: :data:`PER_GPU` for each group of ``tp``
    GPUs, one on a CPU."""
    if device != "cuda":
        return 1
    return PER_GPU * max(1, torch.cuda.device_count() // max(1, tp))


# --- in the engine's process ----------------------------------------------------------------------

def _ops(pieces: dict[str, Callable[[dict], tuple]]) -> dict[str, Callable]:
    """Megatron's signatures over mhctool's family calls: inputs by name at the contract's dtypes
    (the mapping path fp32: the Sinkhorn logits, h_pre, h_post and h_res, and the projection's
    weight unless it comes in x2d's dtype; the streams as Megatron hands them), outputs at the
    shapes and dtypes Megatron's own ops give."""
    def proj_rms(x2d, weight, eps=1e-6, call=pieces.get("proj_rms")):
        # PR 3828 hands x2d and the weight both in bf16: kept so, the kernels take their tensor-core
        # path (operands of one dtype), with the same exact products as fp32 ones would be; an fp32
        # weight beside bf16 x2d took Triton's fp32 path: 2.2-2.3 ms a call in Megatron's step on an
        # H200, 0.036 ms kept (docs/commands/bench.md). dev upcasts both itself.
        w = weight if weight.dtype == x2d.dtype else weight.float()
        proj, r = call({"x2d": x2d, "weight": w})[:2]
        return proj.to(x2d.dtype).reshape(x2d.shape[0], weight.shape[0]), r.to(x2d.dtype).reshape(x2d.shape[0], 1)

    def sinkhorn(logits, iters, eps=1e-6, call=pieces.get("sinkhorn")):
        return call({"logits": logits.float()})[0].to(logits.dtype).reshape(logits.shape)

    def h_aggregate(x, h_pre, call=pieces.get("h_aggregate")):
        return call({"x": x, "h_pre": h_pre.float()})[0].to(x.dtype).reshape(*x.shape[:-2], x.shape[-1])

    def h_post_bda(h_res, residual, h_post, x, bias=None, call=pieces.get("h_post_bda")):
        out = call({"h_res": h_res.float(), "x": residual, "h_post": h_post.float(), "y": x, "bias": bias})[0]
        return out.to(residual.dtype).reshape(residual.shape).contiguous()
    ops = {"proj_rms": proj_rms, "sinkhorn": sinkhorn, "h_aggregate": h_aggregate, "h_post_bda": h_post_bda}
    return {f: op for f, op in ops.items() if f in pieces}


def _pieces(role: str, specs: dict[str, str], eff: dict[str, dict], device: str, dtype: str):
    """Family calls for ``role`` (reference: float64; impl: the specs'), as the train pieces build them."""
    out, names = {}, {}
    for family in ENGINE_FAMILIES:
        if role == "reference":
            out[family], names[family] = reference_piece(family, eff.get(family, {})).call, "float64"
        elif specs.get(family) == "megatron":  # Megatron's own fused kernels (its switch): nothing swapped in
            names[family] = "Megatron's fused"
        elif family in specs:
            impl, why = pick_impl(family, specs[family], device, dtype)
            if impl is None:
                names[family] = f"Megatron's own ({why})"
                continue
            out[family] = family_call(family, impl.fn, eff.get(family, {}), impl.accepts, impl.bind, impl.takes)
            names[family] = impl.name
    return out, names


def effective_knobs(spec: EngineSpec, recipe, specs: dict[str, str], knobs: dict, conventions: dict,
                    role: str, device: str = "cuda") -> dict[str, dict]:
    """Per entry point, the knobs a run computes: the native path's conventions (the float64 run's),
    the recipe's Sinkhorn count and eps, then the implementation's declared conventions and what
    was asked."""
    base = NATIVE_CONVENTIONS.get(spec.generation, NATIVE_CONVENTIONS["pr3828"])
    eff = {f: dict(base.get(f, {})) for f in ENGINE_FAMILIES}
    eff["sinkhorn"].update(iters=recipe.sinkhorn_iters, eps=recipe.sinkhorn_eps if recipe.sinkhorn_eps is not None
                           else 1e-6)
    eff["proj_rms"]["eps"] = 1e-6
    if role == "impl":
        for f, s in specs.items():
            if s != "megatron" and f != module_path.KEY:
                impl = pick_impl(f, s, device, "bf16")[0]
                if impl is not None and impl.backend == "external":
                    eff[f].update(impl.conventions)
    for f in ENGINE_FAMILIES:
        eff[f].update(knobs.get(f, {}))
        eff[f].update(conventions.get(f, {}))
    return eff


def worker_main(argv: list[str] | None = None) -> int:
    """One trajectory, in its own process: the engine trained with ``--role``'s entry points."""
    ap = argparse.ArgumentParser(prog="python -m mhctool.analyses.train.engine")
    ap.add_argument("--engine", required=True, help="module:function of the engine's train")
    ap.add_argument("--tree", default=None)
    ap.add_argument("--recipe", required=True)
    ap.add_argument("--role", required=True, help="impl, native, reference, plain (no hyper-connections: bench's "
                                                  "baseline), or native:FAMILY.KNOB=VALUE (--alt)")
    ap.add_argument("--alt", default=None, help="JSON {family, knobs, precision}: mhctool's native piece at that "
                                                 "entry point (the rest Megatron's own), to trace a drift")
    ap.add_argument("--specs", default="{}")
    ap.add_argument("--eff", default="{}")
    ap.add_argument("--log", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--record", default=None, help="a file: the first step's entry-point calls, recorded there "
                                                    "(the layers' first calls of each, their inputs and the "
                                                    "gradients their outputs received)")
    a = ap.parse_args(argv)
    ensure_triton_mode()
    recipe = recipe_from(json.loads(a.recipe))
    specs, eff = json.loads(a.specs), json.loads(a.eff)
    fused = a.role == "impl" and set(specs.values()) == {"megatron"}
    module = specs.get(module_path.KEY)
    recorded: list = []  # the first step's calls, where --record asks for them
    if module and (a.role in ("impl", "native", "reference") or a.alt):  # the whole module: its two paths
        if a.alt:  # the tracing's rerun: the native module path computing one other convention
            alt = json.loads(a.alt)
            eff = {**eff, alt["family"]: alt["knobs"]}
        calls, named = module_path.pieces("native" if a.alt else a.role, module, eff, a.device)
        if a.record:
            calls = _recording(calls, recorded, recipe.layers)
        ops = module_path.ops(calls)
        names = {module_path.KEY: " and ".join(dict.fromkeys(named.values()))}
    elif a.alt:
        alt = json.loads(a.alt)
        piece = native_piece(alt["family"], alt["knobs"], alt.get("precision", "ieee"))
        ops = _ops({alt["family"]: piece.call})
        names = {f: (piece.name if f == alt["family"] else "Megatron's own") for f in ENGINE_FAMILIES}
    elif a.role == "impl" and not fused or a.role == "reference":
        calls, names = _pieces(a.role, {} if a.role == "reference" else specs, eff, a.device, "bf16")
        if a.record:
            calls = _recording(calls, recorded, recipe.layers)
        ops = _ops(calls)
    else:
        ops, names = {}, {f: "Megatron's fused" if fused else "Megatron's own" for f in ENGINE_FAMILIES}
    recipe = replace(recipe, fused=fused)
    if a.role == "plain":  # the same GPT without hyper-connections
        ops, names, recipe = {}, {f: "none (no hyper-connections)" for f in ENGINE_FAMILIES}, \
            replace(recipe, hyper_connections=False)
    train = load_engine(a.engine)
    first = os.environ.get("RANK", "0") == "0"
    with open(a.log if first else os.devnull, "a") as f:
        f.write(json.dumps({"pieces": names}) + "\n")
        f.flush()

        def progress(rec: dict) -> None:
            if a.record and rec.get("step") == 1:  # the first step's calls, their gradients in; each rank its shard's
                torch.save([asdict(c) for c in recorded], rank_record(a.record))
            f.write(json.dumps(rec) + "\n")
            f.flush()
        train(a.tree, recipe, progress, ops)
    return 0


def rank_record(path: str, rank: int | None = None) -> str:
    """Where a rank records its first step: ``path`` for rank 0, ``path.rankR`` for the others
    (``rank`` None: this process's, from ``RANK``)."""
    r = int(os.environ.get("RANK", "0")) if rank is None else rank
    return path if r == 0 else f"{path}.rank{r}"


def recorded_calls(path: str, ranks: int, device: str) -> list:
    """The first step's calls every rank recorded under ``path``, each marked with its rank where
    there are several (under tensor parallelism each rank's calls are its shard's)."""
    out = []
    for r in range(max(1, ranks)):
        p = Path(rank_record(str(path), r))
        if not p.is_file():
            raise FileNotFoundError(f"rank {r} recorded no first step")
        out += [first_step_mod.Call(**{**c, "rank": r if ranks > 1 else None})
                for c in torch.load(p, map_location=device)]
    return out


def _recording(calls: dict[str, Callable], into: list, layers: int) -> dict[str, Callable]:
    """The family calls, the first micro-batch's forward call of each entry point in each layer (its
    first ``layers`` calls) recorded into ``into`` as a :class:`first_step.Call`: its inputs and,
    through hooks, the gradient its outputs receive. A call later in the step on the very same
    inputs is a recompute of one recorded (Megatron's mHC recompute runs the forward again in the
    backward, where the gradient is built): its outputs' gradients are that record's."""
    seen: dict[str, int] = {}

    def same(c, args: dict) -> bool:
        return all(torch.is_tensor(v) == torch.is_tensor(c.inputs.get(k)) and
                   (v == c.inputs.get(k) if not torch.is_tensor(v) else
                    v.shape == c.inputs[k].shape and torch.equal(v.detach(), c.inputs[k]))
                   for k, v in args.items())

    def wrap(family: str, call: Callable) -> Callable:
        def run(args: dict) -> tuple:
            outs = call(args)
            layer = seen[family] = seen.get(family, -1) + 1
            if layer < layers:
                first_step_mod.record(into, layer, family, mc.OUTPUTS.get(family, get_family(family).outputs), args,
                                      outs)
            else:  # a recompute of a recorded call gives it the gradients it lacks
                c = next((r for r in into if r.family == family and all(g is None for g in r.upstream)
                          and same(r, args)), None)
                if c is not None:
                    first_step_mod.attach(c, outs)
            return outs
        return run
    return {f: wrap(f, c) for f, c in calls.items()}


# --- in mhctool's process -------------------------------------------------------------------------

_SLOTS_LOCK = threading.Lock()


@dataclass
class EngineRunner:
    """Runs one role's trajectory in a child process and reads its steps back."""

    spec: EngineSpec
    recipe: object  # Recipe
    specs: dict[str, str]
    knobs: dict
    conventions: dict
    device: str = "cuda"
    stall: float | None = STALL_S  # no step for this long: a hang
    params: int = 0
    dtype: str = "bf16"  # the activations' dtype the engine trains at (its steps may say; Megatron's recipe: bf16)
    workers: int = 1  # trajectories run side by side (processes of their own; on a GPU they share it)
    _slots: object = field(default=None, init=False, repr=False)  # the free GPU groups (a queue)
    # where the first seed's reference trajectory records its first step's calls (first_step reads them)
    _record_dir: object = field(default_factory=lambda: tempfile.TemporaryDirectory(prefix="mhctool-first-"),
                                init=False, repr=False)
    _recorded: dict = field(default_factory=dict, init=False, repr=False)
    _stop: threading.Event = field(default_factory=threading.Event, init=False, repr=False)  # a second signal came
    _said: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)  # progress, one at a time

    def _take_gpus(self) -> str | None:
        """A group of GPUs for one trajectory's ranks, the groups dealt round robin over the
        trajectories side by side; None on a CPU."""
        if self.device != "cuda":
            return None
        with _SLOTS_LOCK:
            if self._slots is None:
                self._slots = gpu_slots(getattr(self.recipe, "tp", 1), self.workers)
        return self._slots.get()

    def side_by_side(self, jobs: list[tuple[int, str]], say: Callable[[str], Callable | None],
                     interrupted: Callable[[], bool] = lambda: False) -> dict:
        """(seed, role) -> trajectory for each job, ``workers`` at a time; a job not started before
        ``interrupted()`` turned true is left out."""

        def one(job):
            seed, role = job
            if interrupted() or self._stop.is_set():
                return None
            traj = self.trajectory(seed, role, say(role))
            return None if self._stop.is_set() else traj  # killed by a second signal: not a trajectory
        with ThreadPoolExecutor(max(1, self.workers)) as pool:
            futures = {job: pool.submit(one, job) for job in jobs}
            with kept_at_once():  # a second signal: the trajectories in hand are killed, the finished kept
                for f in futures.values():
                    f.result()
            if not all(f.done() for f in futures.values()):
                self._stop.set()
        return {k: v for k, f in futures.items() if (v := f.result()) is not None}

    def settings(self) -> dict:
        """What the report's settings add for an engine's run."""
        return {"engine": self.spec.name, "recipe": asdict(self.recipe), "generation": self.spec.generation,
                "side_by_side": self.workers}

    @property
    def spec_text(self) -> str:
        return " ".join(dict.fromkeys(self.specs.values()))

    def effective(self, role: str) -> dict[str, dict]:
        return effective_knobs(self.spec, self.recipe, self.specs, self.knobs, self.conventions, role, self.device)

    def alternative(self, seed: int, family: str, knob: str, value, role: str):
        """Megatron's own path with mhctool's native ``family`` at its entry point, computing
        ``knob=value`` (the tracing's rerun)."""
        knobs = dict(self.effective("native")[family])
        precision = "ieee"
        if knob == "matmul_precision":
            precision = value
        else:
            knobs[knob] = value
        return self.trajectory(seed, role, alt={"family": family, "knobs": knobs, "precision": precision})

    def candidates(self) -> list[tuple]:
        """The conventions identify fits to each swapped-in implementation beside the native path's."""
        eff = self.effective("native")
        out = []
        for f, s in self.specs.items():
            if s == "megatron":
                continue
            out += module_path.candidates(s, eff, self.device, fitted) if f == module_path.KEY else \
                fitted(f, s, eff[f], self.device)
        return out

    def _run(self, recipe, role: str, d: str, extra: list[str] = (),
             record: Callable[[dict], None] | None = None) -> tuple[list[dict], str | None]:
        """One role's trajectory in a process of its own (a group of ranks): its log's records and
        the error that ended it, if one did. ``record(rec)``: each record as the log gains it."""
        eff = effective_knobs(self.spec, recipe, self.specs, self.knobs, self.conventions,
                              "native" if role.startswith("native") else role, self.device)
        log = Path(d) / "steps.jsonl"
        cmd = [sys.executable, "-m", "mhctool.analyses.train.engine", "--engine", self.spec.target,
               "--recipe", json.dumps(asdict(recipe)), "--role", role, "--specs", json.dumps(self.specs),
               "--eff", json.dumps(eff), "--log", str(log), "--device", self.device, *extra]
        if self.spec.tree:
            cmd += ["--tree", self.spec.tree]
        gpus = self._take_gpus()
        try:
            error = run_ranks(cmd, getattr(recipe, "tp", 1), self.stall, log,
                              None if gpus is None else {"CUDA_VISIBLE_DEVICES": gpus}, self._stop.is_set,
                              None if record is None else (lambda text: _parsed(text, record)))
        finally:
            if gpus is not None:
                self._slots.put(gpus)
        return ([json.loads(x) for x in log.read_text().splitlines() if x.strip()] if log.is_file() else []), error

    def records(self, recipe, role: str) -> tuple[list[dict], str | None]:
        """One run of ``role`` (plain, native or impl) by ``recipe`` (bench's runs): its step records
        and the error that ended it."""
        with tempfile.TemporaryDirectory(prefix="mhctool-engine-") as d:
            lines, error = self._run(recipe, role, d)
        steps = [x for x in lines if "step" in x]
        if error is None and len(steps) < recipe.steps:
            error = f"step {len(steps) + 1}: the engine stopped"
        elif error is not None:
            error = f"step {len(steps) + 1}: {error}"
        return steps, error

    def first_step(self, seed: int, rule) -> first_step_mod.Check | None:
        """The first step judged per entry point inside the engine's model: the float64 run's first
        step as the reference trajectory of ``seed`` recorded it (else a one-step run of its own),
        each entry point swapped in judged on its calls against mhctool's native and float64 ones
        at the implementation's conventions. None where nothing of mhctool's or of a file's is
        swapped in (Megatron's fused switch)."""
        eff = self.effective("impl")
        module = self.specs.get(module_path.KEY)
        if module:  # the whole module: its two families, judged on the module's recorded calls
            mine, _ = module_path.pieces("impl", module, eff, self.device)
        else:
            mine, _ = _pieces("impl", self.specs, eff, self.device, self.dtype)
        if not mine:
            return None
        with tempfile.TemporaryDirectory(prefix="mhctool-engine-") as d:
            path = self._recorded.pop(seed, None)
            ranks = getattr(self.recipe, "tp", 1)
            error = None
            if path is None or not Path(path).is_file():
                path = Path(d) / "first.pt"
                _, error = self._run(replace(self.recipe, seed=seed, steps=1), "reference", d, ["--record", str(path)])
            try:
                calls = recorded_calls(str(path), ranks, self.device)
            except FileNotFoundError as e:
                return first_step_mod.Check(error=f"the float64 run's first step was not recorded: {error or e}",
                                            seed=seed)
        calls = [c for c in calls if c.family in mine]
        if module:
            native = module_path.pieces("native", module, eff, self.device)[0]
            eff = {**eff, **module_path.knobs(eff)}
        else:  # native at the precision each implementation declares (TF32 for PR 3828's projection), as parity's
            native = {f: native_piece(f, eff[f], pick_impl(f, self.specs[f], self.device, self.dtype)[0]
                                      .precision_on(self.device)).call for f in mine}
        wide = {f: family_call(f, get_family(f).reference, eff[f]) for f in mine}
        returned: dict = {}
        try:
            judged = first_step_mod.judge_calls(calls, mine, native, wide, rule, eff, returned)
        except Exception as e:  # noqa: BLE001 - the implementation raised on a call: the check's failure
            return first_step_mod.Check(error=short_error(e), seed=seed)
        return first_step_mod.Check(judged, seed=seed, returned=returned)

    def trajectory(self, seed: int, role: str, progress: Callable | None = None, alt: dict | None = None):

        recipe = replace(self.recipe, seed=seed)
        extra = ["--alt", json.dumps(alt)] if alt is not None else []
        if role == "reference" and seed == self.recipe.seed and alt is None:  # the first step's calls, for first_step
            self._recorded[seed] = str(Path(self._record_dir.name) / f"first-{seed}.pt")
            extra += ["--record", self._recorded[seed]]
        def streamed(rec: dict) -> None:  # the progress by steps, as the run logs them
            if progress is not None and "step" in rec:
                with self._said:
                    progress(_step(rec))
        with tempfile.TemporaryDirectory(prefix="mhctool-engine-") as d:
            lines, error = self._run(recipe, role, d, extra, streamed)
        pieces = next((x["pieces"] for x in lines if "pieces" in x), {})
        steps = [x for x in lines if "step" in x]
        # an entry point the model never called ran nothing of what was swapped in: said, not hidden
        calls = steps[-1].get("calls", {}) if steps else {}
        notes = {f: "never called by the engine's model" for f, c in calls.items() if c == 0 and f in pieces}
        traj = Trajectory(role, pieces, notes, seed=seed)
        for rec in steps:
            traj.steps.append(_step(rec))
            self.params = rec.get("params", self.params)
            self.dtype = rec.get("dtype", self.dtype)
        if error is not None:
            traj.error = f"step {len(traj.steps) + 1}: {error}"
        elif len(traj.steps) < recipe.steps:
            traj.error = f"step {len(traj.steps) + 1}: the engine stopped"
        return traj


def _step(rec: dict) -> Step:
    """A step of the engine's log as a trajectory's step."""
    metrics = {k: float(rec[k]) for k in GOLDEN_METRICS if k in rec}
    return Step(rec["step"], metrics, rec.get("zeros", {}), rec.get("health", []), rec.get("first_nonfinite"),
                rec.get("first_nonfinite_grad"))


def _parsed(text: str, record: Callable[[dict], None]) -> None:
    try:
        rec = json.loads(text)
    except ValueError:  # a line the run left half-written: the log is read whole at its end
        return
    if isinstance(rec, dict):
        record(rec)


if __name__ == "__main__":
    sys.exit(worker_main())
