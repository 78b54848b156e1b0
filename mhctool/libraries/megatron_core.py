"""Megatron-core's own training step, driven from a staged tree (``mhctool train --engine megatron:DIR``): its
``TransformerConfig`` with the mHC recipe's options, ``GPTModel`` on the local layer spec with
hyper-connections, ``Float16Module``, its ``DistributedDataParallel``, ``get_megatron_optimizer``
(whose step returns the grad norm and the count of zeros ``--log-num-zeros-in-grad`` logs),
``OptimizerParamScheduler`` and ``get_forward_backward_func``, put together in the order
Megatron's ``megatron/training/training.py`` does (``get_model``, ``setup_model_and_optimizer``,
``train_step``). Nothing of Megatron's is copied or changed: the tree is put first on
``sys.path`` (``../shared/anchors/stage.sh megatron-core GIT_DIR`` writes one), so Megatron's own
modules are imported inside the functions that use them, once :func:`train` has put the tree there.

:func:`train` is the engine of ``mhctool train --engine megatron:DIR``
(:mod:`mhctool.analyses.train.engine` runs it in a process of its own, one per rank: a GPU;
Megatron-core's model takes its buffers on CUDA; the ranks' ``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE`` and ``MASTER_PORT`` in the environment, tensor parallelism over all of them).
Each step's record (rank 0) holds Megatron's golden-value metrics (``num-zeros`` as its optimizer
counts them, over every rank), the exact zeros of rank 0's part of every parameter's gradient, the
hyper-connection projections' zeros split into their H_pre, H_post and H_res rows (those
projections are whole on every rank), and what :class:`Watch` saw at the module's entry points.
"""
from __future__ import annotations

import contextlib
import functools
import math
import os
import sys
import time
import weakref
from dataclasses import dataclass, fields, replace
from typing import Callable

import torch
import torch.distributed as dist

from mhctool.core.entry_timing import EntryTimer
from mhctool.core.metrics import h_res_health
from mhctool.families.mapping import blocks
from mhctool.kernels.schedule import ResidualLink, hand_over, recompute_memo, residual_link


@dataclass(frozen=True)
class Recipe:
    """``gpt3_mcore_te_tp2_pp2_mhc``'s options (Megatron-LM's functional test at the PR 3828 merge),
    as Megatron's argument defaults complete them; the sizes can be scaled down. The recipe runs
    Megatron's unfused mHC path: ``use_fused_mhc`` is False by default and the recipe does not set
    it."""
    layers: int = 12
    hidden: int = 512
    heads: int = 8
    seq: int = 1024
    vocab: int = 50304  # GPT-2's BPE padded to a multiple of 128 x TP, as Megatron pads it
    micro_batch: int = 4
    global_batch: int = 32
    steps: int = 50
    lr: float = 1.5e-4
    min_lr: float = 1e-5
    lr_decay_iters: int = 320000
    warmup_fraction: float = 0.01
    weight_decay: float = 1e-2
    clip_grad: float = 1.0
    adam_beta2: float = 0.999
    streams: int = 4
    sinkhorn_iters: int = 20
    gating: float = 0.01
    # Megatron's default --hidden-dropout, which the recipe keeps. While it is above zero, the module
    # never calls its h_post_bda entry point in training (fused or native): it applies H_res, H_post
    # and bias-dropout-add one after the other
    hidden_dropout: float = 0.1
    recompute: bool = True  # --recompute-granularity selective --recompute-modules [mhc]
    recompute_layers: int | None = 2  # --mhc-recompute-layer-num
    fused: bool = False  # use_fused_mhc: PR 3828's cuTile kernels
    sinkhorn_eps: float | None = None  # None: the module's own (its norm_eps, 1e-6)
    tp: int = 1
    sequence_parallel: bool = False
    seed: int = 1234
    deterministic: bool = True
    # for mhctool bench --engine: False trains the same GPT without hyper-connections (the baseline);
    # watch=False leaves out the per-step health checks at the entry points (they synchronise);
    # from step time_entry_from on (0: never), the entry points' time is measured and recorded
    hyper_connections: bool = True
    watch: bool = True
    time_entry_from: int = 0

    def changed(self) -> dict:
        """The options that differ from the recipe's."""
        base = Recipe()
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != getattr(base, f.name)}


def recipe_from(d: dict) -> Recipe:
    known = {f.name for f in fields(Recipe)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"unknown recipe option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    return Recipe(**d)


def _import_tree(tree: str) -> None:
    root = os.path.abspath(tree)
    if not os.path.isdir(os.path.join(root, "megatron", "core")):
        raise FileNotFoundError(f"{tree} holds no megatron/core (stage one with ../shared/anchors/stage.sh megatron-core)")
    sys.path.insert(0, root)


def _tokens(r: Recipe, step: int, micro: int):
    """A micro-batch of mock tokens from the seed, the same in every run and on every rank:
    uniform over the vocabulary, as Megatron's --mock-data draws them."""
    g = torch.Generator().manual_seed(r.seed * 1_000_003 + step * 1009 + micro)
    return torch.randint(0, r.vocab, (r.micro_batch, r.seq + 1), generator=g)


# the conventions of Megatron's own (unfused) mHC path, by generation, read from its
# hyper_connection.py: PR 3828 subtracts the row max and clamps the sums at eps (``M / M.sum().clamp(min=eps)``)
# and mixes with H_res; dev starts from a row softmax plus eps, adds eps to the sums and mixes with H_res^T.
# Both compute r = 1 / (||x|| / sqrt(K) + eps).
NATIVE_CONVENTIONS = {
    "pr3828": {"sinkhorn": {"stabilize": "rowmax", "eps_mode": "clamp"}, "h_post_bda": {"transpose_res": False},
               "proj_rms": {"rms_eps": "outside"}},
    "dev": {"sinkhorn": {"stabilize": "softmax", "eps_mode": "add"}, "h_post_bda": {"transpose_res": True},
            "proj_rms": {"rms_eps": "outside"}},
}
# the module's entry points, by the family each computes (called as Megatron calls them)
ENTRY_POINTS = {"proj_rms": "_proj_rms_op", "sinkhorn": "_sinkhorn_op", "h_aggregate": "_h_aggregate_op",
                "h_post_bda": "_h_post_bda_op"}
# what bench --engine times besides, where a module has them (dev's fused path: the projection with
# the mapping's activations in one op, and the aggregate written into a recompute arena), by the
# family they count under
TIMED_ALSO = {"_proj_rms_compute_h_op": "mapping", "_h_aggregate_into_op": "h_aggregate"}


# what else of the module bench --engine times, so that a step's mHC overhead is attributed op by
# op (its names are those of mhctool.analyses.train.step_bench.OPS): the module's own methods (its
# compiled mapping arithmetic, the H_res product and H_post applied to y or the bias, which its
# unfused dropout path runs), and around them its pre-path (forward) and post-path
# (fused_h_res_h_post_bda), whose own time is what the named ops inside leave
MODULE_OPS = {"_compute_h": "compute_h", "apply_h_res": "h_res_product",
              "_apply_h_post": lambda x, *a, **k: "h_post_bias" if x.dim() == 1 else "h_post_y",
              "forward": "pre_path", "fused_h_res_h_post_bda": "post_path"}


# a module computed by two calls (swap_module_paths): the attributes that hold them, and the
# methods of the module they replace (what MODULE_OPS times otherwise)
MODULE_PATH_ATTRS = ("_mhctool_pre_path", "_mhctool_post_path")
MODULE_PATHS = {"pre_path": "forward", "post_path": "fused_h_res_h_post_bda"}


def time_entry_points(model, timer) -> None:
    """Every HyperConnectionModule's entry points (those set) wrapped by ``timer``
    (:class:`mhctool.core.entry_timing.EntryTimer`), each under the family it computes, and the
    module's other ops (:data:`MODULE_OPS`; the bias-dropout-add, and expand and contract at the
    block's ends, where the tree has them)."""
    points = {**{a: f for f, a in ENTRY_POINTS.items()}, **TIMED_ALSO, **MODULE_OPS}
    for m in model.modules():
        if hasattr(m, "_sinkhorn_op"):
            # a module computed by two calls is timed at those calls, which its recompute calls
            # again (its forward and post-path methods are the checkpoints' wrappers around them)
            skip = set(MODULE_PATHS.values()) if hasattr(m, MODULE_PATH_ATTRS[0]) else set()
            for attr, family in {**points, **dict(zip(MODULE_PATH_ATTRS, MODULE_PATHS))}.items():
                if attr not in skip and getattr(m, attr, None) is not None:
                    setattr(m, attr, timer.wrap(family, getattr(m, attr)))
    try:
        from megatron.core.fusions import fused_bias_dropout as fbd
        from megatron.core.transformer.hyper_connection import HyperConnectionModule as hc
    except ImportError:  # a tree without them: the entry points alone
        return
    get = fbd.get_bias_dropout_add
    fbd.get_bias_dropout_add = lambda *a, **k: timer.wrap("dropout_add", get(*a, **k))
    for attr, name in (("input_expand", "expand"), ("output_contract", "contract")):
        if hasattr(hc, attr):
            setattr(hc, attr, staticmethod(timer.wrap(name, getattr(hc, attr))))


def generation(tree: str) -> str:
    """``dev`` where the staged fused kernels have dev's ``fused_proj_rms_compute_h``, else ``pr3828``."""
    path = os.path.join(tree, "megatron", "core", "fusions", "fused_mhc_kernels.py")
    try:
        with open(path) as f:
            return "dev" if "def fused_proj_rms_compute_h" in f.read() else "pr3828"
    except OSError:
        return "pr3828"


def swap_entry_points(model, ops: dict[str, Callable]) -> None:
    """Every HyperConnectionModule's entry points replaced by ``ops`` (family -> a callable with
    Megatron's signature); dev's fused projection-and-mapping path turned off where the projection
    is swapped. ``pre_path`` and ``post_path`` replace the whole module
    (:func:`swap_module_paths`)."""
    paths = {k: ops[k] for k in ("pre_path", "post_path") if k in ops}
    if paths:
        swap_module_paths(model, paths)
    for m in model.modules():
        if not hasattr(m, "_sinkhorn_op"):
            continue
        for family, op in ops.items():
            if family in ENTRY_POINTS:
                setattr(m, ENTRY_POINTS[family], op)
        if "proj_rms" in ops and getattr(m, "_proj_rms_compute_h_op", None) is not None:
            m._proj_rms_compute_h_op = None


def dropout_key(counters: int) -> tuple[int, int]:
    """``(seed, offset)`` of the next dropout mask, from the CUDA generator Megatron's hidden
    dropout draws from (the default one; ``CheckpointWithoutOutput`` saves its state and restores
    it for the recompute, which so draws the same key), and that generator moved past the mask:
    torch counts its offset in 32-bit words, four a counter, and its own draws start from the
    offset (:mod:`mhctool.references.dropout`)."""
    gen = torch.cuda.default_generators[torch.cuda.current_device()]
    offset = gen.get_offset()
    gen.set_offset(offset + 4 * counters)
    return gen.initial_seed() % 2**63, offset // 4


def swap_module_paths(model, ops: dict[str, Callable]) -> None:
    """Every HyperConnectionModule computed by two calls a direction
    (:mod:`mhctool.analyses.train.module_path`): its forward by ``pre_path`` (the projection, RMS,
    mapping, Sinkhorn and aggregation), its ``fused_h_res_h_post_bda`` by ``post_path`` (the
    residual mix and the dropped-out branch, whatever the dropout: Megatron's falls back to
    separate ops where it is on). Each runs under the module's recompute as Megatron's own ops do
    (``CheckpointWithoutOutput`` with the block's manager, where one is given), the dropout's key
    drawn inside what is recomputed. The two calls are looked up on the module as they run (``MODULE_PATH_ATTRS``), so that what
    wraps them there (bench's timer) sees the recompute's calls too."""
    for m in model.modules():
        if hasattr(m, "_sinkhorn_op"):
            setattr(m, MODULE_PATH_ATTRS[0], ops["pre_path"])
            setattr(m, MODULE_PATH_ATTRS[1], ops["post_path"])
            m.forward = functools.partial(_pre_path, m)
            m.fused_h_res_h_post_bda = functools.partial(_post_path, m)


# A module call's two paths linked through its residual (kernels.schedule.ResidualLink): Megatron's
# layer gives the post-path the pre-path's own input as its residual (transformer_layer.py:
# ``residual = hidden_states``), whose gradient the pre-path's backward then adds where it writes
# its own, where its backend can (Triton's and cuTile's), instead of autograd's pass over the two. False: as
# autograd sums them (sweeps; MHCTOOL_LINK_RESIDUAL=0 in the environment, which the engine's processes inherit)
LINK_RESIDUAL = os.environ.get("MHCTOOL_LINK_RESIDUAL", "1") != "0"
_LINK_ATTR = "_mhctool_residual_link"


def _checkpointed(manager, fn, *args):
    if manager is None:
        return fn(*args)
    from megatron.core.tensor_parallel.random import CheckpointWithoutOutput
    return CheckpointWithoutOutput(ckpt_manager=manager).checkpoint(fn, *args)


def _pre_path(m, hidden_states, mhc_recompute_manager=None):
    s, b, _ = hidden_states.shape
    # under the recompute, the closure runs twice on the same saved inputs: the forward's mapping
    # is kept for the second run (kernels.schedule.recompute_memo), which then reads x once. The
    # key is the inputs' versions (the saved tensors share them), not x's address: where x is the
    # previous layer's checkpointed output, Megatron frees its memory after the forward and the
    # recompute puts the same values at another address
    memo = {} if mhc_recompute_manager is not None else None
    # the post-path of this call claims the link where its residual is this very tensor
    link = ResidualLink() if LINK_RESIDUAL else None
    setattr(m, _LINK_ATTR, None if link is None else (weakref.ref(hidden_states), link))

    def run(x, weight, alpha_pre, alpha_post, alpha_res, bias):
        alpha = torch.cat([alpha_pre.reshape(1), alpha_post.reshape(1), alpha_res.reshape(1)])
        inputs = (x, weight, alpha_pre, alpha_post, alpha_res, bias)
        kept = contextlib.nullcontext() if memo is None else \
            recompute_memo(memo, (tuple(x.shape), *(getattr(t, "_version", None) for t in inputs)))
        with kept, residual_link(link):
            return getattr(m, MODULE_PATH_ATTRS[0])(x.reshape(s, b, m.n, m.hidden_size), weight, alpha, bias)
    return _checkpointed(mhc_recompute_manager, run, hidden_states, m.mapping_proj.weight, m.alpha_pre, m.alpha_post,
                         m.alpha_res, m.bias)


def _post_path(m, h_res, original_residual, h_post, layer_output_with_bias, dropout_prob, training, fused,
               manager=None):
    from mhctool.references.dropout import counters_used
    x, bias = layer_output_with_bias
    s, b, _ = original_residual.shape
    p = float(dropout_prob) if training else 0.0
    claim = getattr(m, _LINK_ATTR, None)
    setattr(m, _LINK_ATTR, None)
    link = claim[1] if claim is not None and claim[0]() is original_residual else None

    def run(h_res, residual, h_post, x, *maybe_bias):
        seed, offset = dropout_key(counters_used(s * b, m.n, m.hidden_size)) if p else (0, 0)
        residual = hand_over(residual, link).reshape(s, b, m.n, m.hidden_size)
        out = getattr(m, MODULE_PATH_ATTRS[1])(h_res, residual, h_post, x, maybe_bias[0] if maybe_bias else None,
                                               p, seed, offset)
        return out.reshape(s, b, m.n * m.hidden_size)
    return _checkpointed(manager, run, h_res, original_residual, h_post, x, *(() if bias is None else (bias,)))


# the outputs of each entry point, by the names mhctool's families give them
OUTPUTS = {"proj_rms": ("proj", "r"), "sinkhorn": ("h_res",), "h_aggregate": ("out",), "h_post_bda": ("out",)}


class Watch:
    """Every HyperConnectionModule's entry points wrapped: their calls counted by family (what the
    model's path called, whatever was swapped in), and per step, as mhctool's own model records
    them, H_res's health per layer (its row- and column-sum deviation from 1, its smallest entry)
    and the first non-finite output (forward) and output gradient (backward). The checks stay on
    the device until :meth:`step_end` reads them, once a step."""

    def __init__(self, model):
        self.calls = {f: 0 for f in ENTRY_POINTS}
        self._pending: list[tuple] = []  # (order, layer, kind, family, output, device tensor)
        self._order = 0
        for m in model.modules():
            if hasattr(m, "_sinkhorn_op"):
                layer = int(getattr(m, "layer_number", 1)) - 1
                for family, attr in ENTRY_POINTS.items():
                    if getattr(m, attr, None) is not None:
                        setattr(m, attr, self._wrapped(getattr(m, attr), family, layer))

    def _wrapped(self, op, family: str, layer: int):


        def call(*args, **kwargs):
            self.calls[family] += 1
            out = op(*args, **kwargs)
            outs = out if isinstance(out, tuple) else (out,)
            with torch.no_grad():
                for name, t in zip(OUTPUTS[family], outs):
                    self._order += 1
                    self._pending.append((self._order, layer, "nonfinite", family, name,
                                          (~torch.isfinite(t)).sum()))
                    if t.requires_grad:
                        t.register_hook(lambda g, at=(layer, family, name): self._grad(at, g))
                if family == "sinkhorn":
                    for kind, v in h_res_health(outs[0]).items():
                        self._pending.append((0, layer, kind, family, "h_res", v))
            return out
        return call

    def _grad(self, at: tuple, g) -> None:
        self._order += 1
        self._pending.append((self._order, at[0], "nonfinite_grad", at[1], at[2], (~torch.isfinite(g)).sum()))

    def step_end(self, layers: int) -> dict:
        """The step's health per layer and its first non-finite output and gradient; reset."""
        health = [{} for _ in range(layers)]
        first = first_grad = None
        for order, layer, kind, family, name, v in sorted(self._pending, key=lambda e: e[0]):
            x = float(v)
            h = health[layer] if 0 <= layer < layers else {}
            if kind == "nonfinite":
                key = f"nonfinite:{family}.{name}"
                h[key] = max(h.get(key, 0), int(x))
                if x and first is None:
                    first = [layer, family, name]
            elif kind == "nonfinite_grad":
                if x and first_grad is None:
                    first_grad = [layer, family, name, int(x)]
            elif kind == "smallest entry":
                h[kind] = min(h.get(kind, math.inf), x)
            else:
                h[kind] = max(h.get(kind, 0.0), x)
        self._pending, self._order = [], 0
        return {"health": health, "first_nonfinite": first, "first_nonfinite_grad": first_grad}


class SequenceParallelNorm:
    """The local layer spec's norm with sequence parallelism allowed. Megatron's ``WrappedTorchNorm``
    builds the same torch ``LayerNorm`` (or ``RMSNorm``) but refuses sequence parallelism, because it
    leaves the weights unmarked: under sequence parallelism each tensor-parallel rank sees its own
    part of the sequence, so a replicated norm's gradient is partial on every rank, and Megatron's
    ``finalize_model_grads`` all-reduces only the parameters marked ``sequence_parallel`` (as its
    TransformerEngine and apex norms mark theirs). This one marks them; the module and its numbers
    are torch's, as in the local spec."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_unused):
        kind = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}.get(config.normalization)
        if kind is None:
            raise ValueError(f"normalization {config.normalization!r}: LayerNorm or RMSNorm with sequence parallelism")
        norm = kind(hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = bool(config.sequence_parallel)
        return norm


def layer_spec(layers: int, sequence_parallel: bool, hyper_connections: bool = True):
    """The local layer spec with hyper-connections (or without: the baseline), as Megatron builds
    it; under sequence parallelism, the whole block's (each layer's and the final one) with
    :class:`SequenceParallelNorm` where the spec has Megatron's torch norm."""

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    spec = get_gpt_layer_local_spec(enable_hyper_connection=hyper_connections)
    if not sequence_parallel:
        return spec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    sub = spec.submodules
    swapped = {f.name: SequenceParallelNorm for f in fields(sub) if getattr(sub, f.name) is WrappedTorchNorm}
    layer = replace(spec, submodules=replace(sub, **swapped))
    return TransformerBlockSubmodules(layer_specs=[layer] * layers, layer_norm=SequenceParallelNorm)


def train(tree: str, r: Recipe, progress: Callable[[dict], None] | None = None,
          ops: dict[str, Callable] | None = None) -> list[dict]:
    """Train Megatron-core's GPT with hyper-connections by the recipe; every step's record.
    ``ops``: the module's entry points swapped (family -> callable, :data:`ENTRY_POINTS`)."""
    _import_tree(tree)

    os.environ.setdefault("NCCL_ALGO", "Ring")  # deterministic mode asks for one (Megatron asserts it)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    if not dist.is_initialized():
        dist.init_process_group("nccl", rank=rank, world_size=world)
    if r.deterministic:
        torch.use_deterministic_algorithms(True)

    from megatron.core import parallel_state
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
    )
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=r.tp, pipeline_model_parallel_size=1)
    torch.manual_seed(r.seed)
    model_parallel_cuda_manual_seed(r.seed)
    hc = r.hyper_connections
    recompute = dict(recompute_granularity="selective", recompute_modules=["mhc"],
                     mhc_recompute_layer_num=r.recompute_layers) if r.recompute and hc else {}
    config = TransformerConfig(
        num_layers=r.layers, hidden_size=r.hidden, num_attention_heads=r.heads,
        bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
        tensor_model_parallel_size=r.tp, sequence_parallel=r.sequence_parallel,
        enable_hyper_connections=hc, num_residual_streams=r.streams, mhc_sinkhorn_iterations=r.sinkhorn_iters,
        mhc_init_gating_factor=r.gating, use_fused_mhc=r.fused and hc, deterministic_mode=r.deterministic,
        attention_softmax_in_fp32=True, gradient_accumulation_fusion=False, hidden_dropout=r.hidden_dropout,
        **recompute)
    fused_ran = bool(config.use_fused_mhc)  # Megatron turns it off (with a warning) without cuTile
    model = GPTModel(config, layer_spec(r.layers, r.sequence_parallel, hc), vocab_size=r.vocab,
                     max_sequence_length=r.seq, position_embedding_type="learned_absolute",
                     # tied, as Megatron ties them unless --untie-embeddings-and-output-weights
                     share_embeddings_and_output_weights=True)
    from megatron.core import tensor_parallel
    for p in model.parameters():
        tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(p)
    model.cuda(torch.cuda.current_device())
    if ops:
        swap_entry_points(model, ops)
    if r.sinkhorn_eps is not None:
        for m in model.modules():
            if hasattr(m, "_sinkhorn_op"):  # the module's Sinkhorn entry point, called (logits, iters, eps)
                m._sinkhorn_op = functools.partial(lambda op, eps, x, iters, _eps: op(x, iters, eps),
                                                   m._sinkhorn_op, r.sinkhorn_eps)
    watch = Watch(model) if r.watch else None
    timer = None
    if r.time_entry_from:
        timer = EntryTimer(cuda=True)
        time_entry_points(model, timer)
    params = sum(p.numel() for p in model.parameters())
    model = Float16Module(config, model)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=False, check_for_nan_in_grad=False,
                                               bucket_size=None)
    model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=r.lr, min_lr=r.min_lr, weight_decay=r.weight_decay, adam_beta1=0.9,
                        adam_beta2=r.adam_beta2, adam_eps=1e-8, clip_grad=r.clip_grad, bf16=True,
                        params_dtype=torch.bfloat16, log_num_zeros_in_grad=True), [model])
    # as training.py's train() sets them: the loss scaled by the optimizer's scaler (none in bf16),
    # and the gradients finished after the schedule (the data-parallel reduction, and the
    # sequence-parallel parameters' all-reduce over the tensor-parallel group)
    from megatron.core.distributed import finalize_model_grads
    config.grad_scale_func = opt.scale_loss
    config.finalize_model_grads_func = finalize_model_grads
    decay = r.lr_decay_iters * r.global_batch
    sched = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=r.lr, min_lr=r.min_lr,
                                    lr_warmup_steps=int(r.warmup_fraction * decay), lr_decay_steps=decay,
                                    lr_decay_style="cosine", start_wd=r.weight_decay, end_wd=r.weight_decay,
                                    wd_incr_steps=r.steps * r.global_batch, wd_incr_style="constant")
    dp = parallel_state.get_data_parallel_world_size()
    micro_batches = r.global_batch // (r.micro_batch * dp)
    fwd_bwd = get_forward_backward_func()
    mask = torch.tril(torch.ones(r.seq, r.seq, dtype=torch.bool, device="cuda")).logical_not().view(1, 1, r.seq, r.seq)
    position = torch.arange(r.seq, device="cuda").unsqueeze(0).expand(r.micro_batch, -1)
    names = {id(p): n for n, p in model.named_parameters()}

    def loss_func(loss_mask, output):
        losses = output.view(-1).float()
        loss = torch.sum(losses * loss_mask.view(-1))
        tokens = loss_mask.sum().clone().detach().to(torch.int)
        return loss, tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), tokens.view(1)])}

    def forward_step(data, model):
        t = next(data).cuda()
        tokens, labels = t[:, :-1].contiguous(), t[:, 1:].contiguous()
        out = model(tokens, position, mask, labels=labels)
        return out, functools.partial(loss_func, torch.ones_like(labels, dtype=torch.float))

    records = []
    for step in range(1, r.steps + 1):
        data = iter([_tokens(r, step, dp_micro) for dp_micro in range(
            parallel_state.get_data_parallel_rank() * micro_batches, (parallel_state.get_data_parallel_rank() + 1) * micro_batches)])
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        timed = timer is not None and step >= r.time_entry_from
        with timer.profiling() if timed else contextlib.nullcontext():  # the entry points' time, in place
            t0 = time.perf_counter()
            model.zero_grad_buffer()
            opt.zero_grad()
            reports = fwd_bwd(forward_step_func=forward_step, data_iterator=data, model=[model],
                              num_microbatches=micro_batches, seq_length=r.seq, micro_batch_size=r.micro_batch,
                              decoder_seq_length=r.seq, forward_only=False)
            zeros: dict[str, int] = {}
            for p in model.parameters() if r.watch else ():  # each count synchronises: not in a timed step
                g = getattr(p, "main_grad", None)
                if g is None:
                    continue
                name = names[id(p)].removeprefix("module.").removeprefix("module.")
                zeros[name] = int(g.numel() - torch.count_nonzero(g))
                if name.endswith("mapping_proj.weight"):
                    zeros.update({k: int((v == 0).sum()) for k, v in blocks(name, g, r.streams).items()})
            ok, grad_norm, num_zeros = opt.step()
            sched.step(increment=r.global_batch)
            torch.cuda.synchronize()
            elapsed = time.perf_counter() - t0
        total = torch.stack([x["lm loss"] for x in reports]).sum(0)
        dist.all_reduce(total, group=parallel_state.get_data_parallel_group())
        rec = {"step": step, "lm loss": float(total[0] / total[1]),
               "grad-norm": float(grad_norm) if grad_norm is not None else math.nan,
               "num-zeros": float(num_zeros) if num_zeros is not None else math.nan,
               "iteration-time": elapsed, "mem-allocated-bytes": float(torch.cuda.memory_allocated()),
               "mem-max-allocated-bytes": float(torch.cuda.max_memory_allocated()),
               "update": bool(ok), "lr": float(opt.param_groups[0]["lr"]) if hasattr(opt, "param_groups") else None,
               "fused": fused_ran, "params": params, "zeros": {k: v for k, v in zeros.items() if v}}
        if watch is not None:
            rec.update(calls=dict(watch.calls), **watch.step_end(r.layers))
        if timed:
            rec["entry_ms"] = timer.step_end()
        records.append(rec)
        if progress and rank == 0:
            progress(rec)
    return records
