"""Timing against the memory roofline: bytes/flops models, measured ceilings, timers.

Each kernel declares the bytes it must move and the flops it must do for a shape (``model``);
``bench`` reports achieved GB/s (model bytes / median time), its share of the device-to-device
copy bandwidth measured in the same run, and which limit applies (memory or matrix math, from
the measured copy bandwidth and bf16/tf32 matmul rate).

The byte models count each tensor a kernel must read or write once, at its dtype (e = bytes per
activation element, f = 4 for the fp32 mapping path), with T = s*b tokens, K = n*C, N = n^2 + 2n:

| kernel      | fwd bytes                                   | bwd bytes                                              | flops fwd / bwd  |
|-------------|---------------------------------------------|--------------------------------------------------------|------------------|
| sinkhorn    | read logits, write out: 2 T n^2 f           | read logits, grad_out; write grad: 3 T n^2 f           | ~0 (latency)     |
| h_aggregate | read x, h_pre; write out: T n C e + T C e + T n f | read x, grad_out, h_pre; write grad_x, grad_h: 2 T n C e + T C e + 2 T n f | 2TnC / 4TnC |
| h_post_bda  | read x, y, h; write out: 2 T n C e + T C e + T (n^2+n) f + C e | read grad_out, x, y; write grad_x, grad_y (small grads reduced on chip): 3 T n C e + 2 T C e + ... | 2Tn(n+1)C / 4Tn(n+1)C |
| proj_rms    | read x, W; write proj, r: T K e + N K e + T (N+1) f | read x, W, grad_proj, grad_r; write dx, dW: 2 T K e + ... | 2TNK / 4TNK |
| mapping     | read x, W; write H_pre, H_post, logits: T K e + N K e + T N f | read x, W, the 3 grads; write dx, dW: 2 T K e + ... | 2TNK / 4TNK |
| mapping_sinkhorn | as mapping (Sinkhorn runs on the n^2 logits on chip: no extra traffic) | as mapping | as mapping |
| mix_aggregate | mapping + Sinkhorn + aggregation: x read twice, out written: 2 T K e + N K e + T C e + T (n+n^2) f | x twice, grad_out once (a two-pass backward reads it twice), dx: 3 T K e + T C e + ... | 2TNK + 2TK / twice |

Grouped MLP kernels (shape TxHxFxE: T tokens, hidden H, ffn F, G = E experts; W = 2F for GLU):

| kernel      | fwd bytes                                   | bwd bytes                                              | flops fwd / bwd  |
|-------------|---------------------------------------------|--------------------------------------------------------|------------------|
| activations | read x, scale; write out: T W e + T f + T F e | read x, grad_out, scale; write dx, dscale: 2 T W e + T F e + 2 T f | ~0 |
| grouped_gemm| read x, W; write y: T H e + G F H e + T F e | read x, W, dy; write dx, dW: 2 T H e + 2 G F H e + T F e | 2THF / 4THF |
| grouped_wgrad| read x, dy, main_grad; write it: T H e + T F e + 2 G F H f | -                                             | 2THF / -     |
| grouped_mlp | x, FC1, FC2, the FC1 output and activation (written and read), out | about twice the forward | 2TH(W+F) / 4TH(W+F) |
"""
from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from mhctool.core import inputs as inputs_mod
from mhctool.core.dtypes import dtype_named, fmt_of
from mhctool.core.errors import short_error
from mhctool.core.shapes import Shape
from mhctool.families import KERNELS, Family, generate, get_family
from mhctool.registry.builtin import impls_for
from mhctool.registry.costs import model
from mhctool.registry.impl import Impl
from mhctool.registry.specs import resolve_one
from mhctool.runner.call import (
    cast_case_inputs,
    leaf_inputs,
    load_digest,
    refusal,
    settled,
)
from mhctool.runner.case import Case


def bench_dtype(kernel: str, dtype: str) -> str:
    """Sinkhorn runs on the fp32 mapping path whatever the activation dtype."""
    return "fp32" if kernel == "sinkhorn" else dtype


def footprint(kernel: str, shape, dtype: str) -> float:
    """Bytes a bench case holds at its peak, about: inputs, outputs, gradients, upstream gradients
    (input copies for L2 rotation are only made for shapes far smaller than the GPU)."""
    m = model(kernel, shape, bench_dtype(kernel, dtype))
    return 4 * max(m.bytes_fwd, m.bytes_bwd)


# --- timers -------------------------------------------------------------------------------------

class Timer:
    """CUDA events on the GPU; perf_counter with a synchronize-free body on the CPU."""

    def __init__(self, device: str):
        self.device = device

    def time(self, fn: Callable[[], object], repeats: int, warmup: int = 3,
             before: Callable[[int], None] | None = None, queued: bool = False) -> list[float]:
        """``queued`` (CUDA graph replays): the GPU is held busy while the host enqueues every
        repeat, so the events bracket the device's work alone. Without it a kernel shorter than its
        launch's host time is timed as that host time: the start event runs on an idle GPU at once,
        and the replay reaches the GPU only when the host has submitted it (Sinkhorn's 6 us forward
        read 18 us on an H200)."""
        t0 = time.perf_counter()
        for i in range(warmup):
            if before:
                before(i)
            fn()
        host_s = (time.perf_counter() - t0) / max(warmup, 1)
        if self.device == "cuda":
            torch.cuda.synchronize()
            starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
            ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
            if queued:
                hold_gpu(2 * repeats * host_s + 1e-3)
            for i in range(repeats):
                if before:
                    before(i)
                starts[i].record()
                fn()
                ends[i].record()
            torch.cuda.synchronize()
            return [s.elapsed_time(e) for s, e in zip(starts, ends)]
        out = []
        for i in range(repeats):
            if before:
                before(i)
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
        return out


def hold_gpu(seconds: float) -> None:
    """Keep the current stream busy for about ``seconds`` (at most 0.5; at a 2 GHz clock or
    slower, at least that long), so that what the host enqueues next runs back to back."""
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is not None:  # a private torch function (a spin on the clock); without it, no hold
        sleep(int(min(seconds, 0.5) * 2e9))


def host_time_us(fn: Callable[[], object], calls: int = 20) -> float:
    """CPU time per call of launch and Python dispatch, without synchronising."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    dt = (time.perf_counter() - t0) / calls * 1e6
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return dt


def copy_bandwidth(device: str, nbytes: int = 1 << 30, repeats: int = 20) -> float:
    """Device-to-device copy bandwidth, bytes read + written per second."""
    n = nbytes // 4
    a = torch.empty(n, dtype=torch.float32, device=device).fill_(1.0)
    b = torch.empty_like(a)
    times = Timer(device).time(lambda: b.copy_(a), repeats)
    return 2 * nbytes / (statistics.median(times) / 1e3)


def host_op_us(device: str, ops: int = 200, rounds: int = 5) -> float:
    """The host's microseconds to issue one small PyTorch op on ``device`` (an in-place add to one
    element): :func:`host_time_us` over ``ops`` ops, median of ``rounds`` rounds after one to warm.
    On a GPU that is a launch's host cost, which sets how far a host-bound step (many small
    kernels: mHC's module path) keeps ahead of the device; on a CPU, the op itself."""
    t = torch.zeros(1, device=device)
    host_time_us(lambda: t.add_(1.0), ops)  # warm: the first launches load what they need
    return statistics.median(host_time_us(lambda: t.add_(1.0), ops) for _ in range(rounds))


def matmul_rate(device: str, dtype: torch.dtype, size: int = 8192, repeats: int = 10) -> float:
    """Dense matmul flop/s at ``dtype`` (bf16; fp32 runs at TF32). On a CPU a 256-square product:
    without native bf16 arithmetic PyTorch's CPU build took 1.2 s for one bf16 1024-square product
    on the 2-core development machine (30 s of every CPU bench for a ceiling that is informational
    there)."""
    if device != "cuda":
        size = 256
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        times = Timer(device).time(lambda: a @ b, repeats)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    return 2 * size ** 3 / (statistics.median(times) / 1e3)


# --- one kernel x impl ----------------------------------------------------------------------------

@dataclass
class Measurement:
    kernel: str
    impl: str
    backend: str
    direction: str
    dtype: str
    shape: str
    times_ms: list[float]
    host_us: float
    peak_bytes: float
    saved_bytes: float
    model_bytes: float
    model_flops: float
    graph: bool
    message: str | None = None
    inputs: str | None = None  # the input dtypes it was timed at (input_dtypes)
    knobs: str | None = None  # the knobs it was timed at, JSON (None: the family's defaults)

    @property
    def median_ms(self) -> float:
        return statistics.median(self.times_ms) if self.times_ms else math.nan


def _inputs(kernel: str, shape: Shape, dtype: str, device: str, seed: int, copies: int):
    fam = get_family(kernel)
    case = Case(kernel, "random", dtype, shape, (), seed, device)
    out = []
    for i in range(copies):
        _, raw = generate(kernel, "random", shape, seed + i, {}, device=device)
        out.append(cast_case_inputs(fam, raw, case))
    return fam, out


def used_dtypes(impl: Impl, sets: list[dict], activation: str) -> tuple[list[dict], str | None]:
    """The input copies at the dtypes ``impl``'s library is used with (its adapter's
    ``input_dtypes``: ``activation`` is the run's activation dtype), and a note of what changed."""
    want = {k: dtype_named(v, activation) for k, v in impl.input_dtypes.items()}
    changed = [k for k in sets[0] if k in want and sets[0][k] is not None and sets[0][k].dtype != want[k]]
    if not changed:
        return sets, None
    sets = [{k: (t.to(want[k]) if k in changed else t) for k, t in s.items()} for s in sets]
    dt = sorted({fmt_of(want[k]).name for k in changed})
    return sets, f"{', '.join(changed)} at {'/'.join(dt)}, as the library is used"


def input_dtypes(args: dict) -> str:
    """``name=dtype`` for each floating input, in call order (``x=bf16,h_pre=fp32``)."""
    return ",".join(f"{k}={fmt_of(t.dtype).name}" for k, t in args.items()
                    if t is not None and t.is_floating_point())


def knob_text(knobs: dict | None) -> str | None:
    """How a measurement at other knobs than the family's defaults says so (``at dropout=0.1``)."""
    return "at " + ", ".join(f"{k}={v}" for k, v in sorted(knobs.items())) if knobs else None


def _call(fam: Family, impl: Impl, args: dict, knobs: dict | None = None):
    """``impl`` on ``args`` at ``knobs`` (the family's defaults where not given): inputs already in
    its library's layouts where its adapter converts them (:func:`measure` stages them once, so the
    conversion is never timed)."""
    fn = impl.staged[1] if impl.staged is not None else impl.fn
    return fam.call(fn, args, knobs or {}, impl.accepts, impl.bind, impl.takes)


def check_streams(fam: Family, impl: Impl, args: dict, direction: str, knobs: dict | None = None) -> None:
    """One call (and, for ``bwd``, its backward) before the timing: a RuntimeError where its
    outputs (or gradients) change after it returned: work left on another stream, which the
    caller's stream, and so the timer's events, never waits for (its time would go unmeasured)."""
    leaves = leaf_inputs(fam, args)
    load_digest(next(t.device for t in leaves.values() if isinstance(t, torch.Tensor)))
    outs = [o for o in _call(fam, impl, leaves, knobs) if isinstance(o, torch.Tensor)]
    if why := settled(outs, "outputs"):
        raise RuntimeError(f"{why}; its time would not be measured")
    if direction != "bwd":
        return
    wrt = [t for t in leaves.values() if isinstance(t, torch.Tensor) and t.requires_grad]
    outs = [o for o in outs if o.requires_grad]
    if outs and wrt:
        grads = torch.autograd.grad(outs, wrt, [torch.ones_like(o) for o in outs], allow_unused=True)
        if why := settled([g for g in grads if g is not None], "gradients"):
            raise RuntimeError(f"{why}; its time would not be measured")


def isolated_measure(kernel: str, spec: str, name: str, *args) -> Measurement:
    """The job an isolation worker runs for ``mhctool bench``: resolve ``spec`` there, measure ``name``."""
    return measure(kernel, resolve_one(kernel, spec, name), *args)


def measure(kernel: str, impl: Impl, shape: Shape, dtype: str, device: str, repeats: int,
            direction: str, graph: bool, l2_bytes: int, seed: int = 0, contract: bool = False,
            knobs: dict | None = None) -> Measurement:
    """``contract``: the inputs at mhctool's contract dtypes even where the implementation's adapter
    says its library is used with others. Where the call raises with an optional input it has a
    parameter for (a bias its library does not support), it is timed without that input, and
    the row says so; an outside implementation that refuses the case (its ``assert``,
    ``NotImplementedError``, its compiler's error) is a skipped row with its words. ``knobs``: the
    family's knobs it runs at (its defaults where not given; h_post_bda's dropout)."""
    args = (kernel, impl, shape, dtype, device, repeats, direction, graph, l2_bytes, seed, contract, knobs)
    try:
        return _measure(*args)
    except Exception as e:  # noqa: BLE001 - tried again without its optional inputs, else raised as it was
        first = e
    optional = tuple(k for k in get_family(kernel).optional_inputs if impl.takes(k))
    if optional and impl.backend == "external":
        try:
            return _measure(*args, without=optional, why=short_error(first))
        except Exception:  # noqa: BLE001 - the first error is the one to report
            pass
    if impl.backend == "external" and refusal(first):
        m = model(kernel, shape, bench_dtype(kernel, dtype))
        return Measurement(kernel, impl.name, impl.backend, direction, bench_dtype(kernel, dtype), str(shape), [],
                           math.nan, math.nan, math.nan, m.bytes_fwd if direction == "fwd" else m.bytes_bwd,
                           m.flops_fwd if direction == "fwd" else m.flops_bwd, graph,
                           message=f"it refuses this case: {short_error(first)}")
    raise first


def _measure(kernel: str, impl: Impl, shape: Shape, dtype: str, device: str, repeats: int,
             direction: str, graph: bool, l2_bytes: int, seed: int = 0, contract: bool = False,
             knobs: dict | None = None, without: tuple = (), why: str = "") -> Measurement:
    """:func:`measure`, with the optional inputs ``without`` left out (``why``: what the call with
    them raised)."""
    activation, dtype = dtype, bench_dtype(kernel, dtype)
    m = model(kernel, shape, dtype)
    nbytes = m.bytes_fwd if direction == "fwd" else m.bytes_bwd
    # rotate among enough input copies that their bytes exceed 4x the L2 cache
    copies = max(1, min(8, math.ceil(4 * l2_bytes / max(nbytes, 1)))) if device == "cuda" else 1
    fam, sets = _inputs(kernel, shape, dtype, device, seed, copies)
    sets, used = (sets, None) if contract else used_dtypes(impl, sets, activation)
    missing = impl.missing_inputs()
    if missing:  # a function without the optional input (a bias-less h_post_bda): timed without it
        sets = [{k: None if k in missing else t for k, t in s.items()} for s in sets]
        used = "; ".join(x for x in (used, f"no {', '.join(missing)} (it takes none)") if x)
    if without:  # it has the parameter, and raised when given it
        sets = [{k: None if k in without else t for k, t in s.items()} for s in sets]
        used = "; ".join(x for x in (used, f"no {', '.join(without)} (given one, it raised {why})") if x)
    base = dict(kernel=kernel, impl=impl.name, backend=impl.backend, direction=direction, dtype=dtype,
                shape=str(shape), model_bytes=nbytes,
                model_flops=m.flops_fwd if direction == "fwd" else m.flops_bwd, graph=graph,
                inputs=input_dtypes(sets[0]), knobs=json.dumps(knobs, sort_keys=True) if knobs else None)
    if impl.staged is not None:  # the adapter's layout conversion, once per input copy, untimed
        sets = [impl.staged[0](s) for s in sets]
    note = "; ".join(x for x in (used, "the adapter's layout conversion is not timed" if impl.staged is not None
                                 else None, knob_text(knobs)) if x) or None
    timer = Timer(device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    base_mem = torch.cuda.memory_allocated() if device == "cuda" else 0
    state = {"i": 0}
    pick = lambda i: state.__setitem__("i", i)  # noqa: E731
    if graph and device == "cuda" and not graph_capturable(kernel, impl):
        return Measurement(**base, times_ms=[], host_us=math.nan, peak_bytes=math.nan, saved_bytes=math.nan,
                           message="not graph-capturable: reads m_splits on the host (a synchronisation)")
    if device == "cuda" and not graph:
        check_streams(fam, impl, dict(sets[0]), direction, knobs)
    if direction == "fwd":
        if graph and device == "cuda":
            with torch.no_grad():
                replay = graphed(lambda: _call(fam, impl, dict(sets[0]), knobs))
                times = timer.time(replay, repeats, queued=True)
                host = host_time_us(replay)
        else:
            leaves = [leaf_inputs(fam, s) for s in sets]  # with autograd on: what training pays
            times = timer.time(lambda: _call(fam, impl, leaves[state["i"] % len(leaves)], knobs), repeats,
                               before=pick)
            host = host_time_us(lambda: _call(fam, impl, leaves[0], knobs))
        sync()
        peak = (torch.cuda.max_memory_allocated() - base_mem) if device == "cuda" else math.nan
        saved = _saved_bytes(fam, impl, sets[0], knobs)
        return Measurement(**base, times_ms=times, host_us=host, peak_bytes=peak, saved_bytes=saved, message=note)
    # backward: one forward per input copy builds its graph; the backward alone is timed, replayed
    graphs = []
    # for a captured backward, the forwards run on a side stream: autograd runs each backward op on
    # its forward's stream, and the legacy default stream cannot join a capture
    fwd_stream = torch.cuda.Stream() if graph and device == "cuda" else None
    for s in sets:
        leaves = leaf_inputs(fam, s)
        if fwd_stream is not None:
            fwd_stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(fwd_stream):
                outs = _call(fam, impl, leaves, knobs)
            torch.cuda.current_stream().wait_stream(fwd_stream)
        else:
            outs = _call(fam, impl, leaves, knobs)
        if not any(o.requires_grad for o in outs):
            return Measurement(**base, times_ms=[], host_us=math.nan, peak_bytes=math.nan,
                               saved_bytes=math.nan, message="no backward")
        ups = inputs_mod.upstream_grads(list(outs), seed)
        diff = [leaves[k] for k in fam.differentiable if leaves.get(k) is not None]
        graphs.append((outs, diff, ups))

    def bwd(i):
        outs, diff, ups = graphs[i % len(graphs)]
        torch.autograd.grad(outs, diff, ups, retain_graph=True)

    sync()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    before_mem = torch.cuda.memory_allocated() if device == "cuda" else 0
    if graph and device == "cuda":
        replay = graphed(lambda: bwd(0))
        times = timer.time(replay, repeats, queued=True)
        host = host_time_us(replay, calls=5)
    else:
        times = timer.time(lambda: bwd(state["i"]), repeats, before=pick)
        host = host_time_us(lambda: bwd(0), calls=5)
    peak = (torch.cuda.max_memory_allocated() - before_mem) if device == "cuda" else math.nan
    return Measurement(**base, times_ms=times, host_us=host, peak_bytes=peak, saved_bytes=math.nan, message=note)


def graph_capturable(kernel: str, impl: Impl) -> bool:
    """The native grouped-MLP kernels loop over experts with counts read on the host."""
    return not (impl.native and get_family(kernel).shape_kind == "moe")


def graphed(fn, attempts: int = 2):
    """Capture ``fn`` into a CUDA graph; returns its replay. A backward runs on autograd's own
    thread, which may query events or allocate while this thread captures: the capture is
    thread-local. Seen on an H100 (torch 2.11): the first backward captured in a process failed
    with cudaErrorStreamCaptureInvalidated, whatever the kernel, and later ones succeeded; so a
    failed capture is retried once before it is reported."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    for attempt in range(attempts):
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(g, capture_error_mode="thread_local"):
                fn()
            return g.replay
        except RuntimeError:  # torch.AcceleratorError is a RuntimeError
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def _saved_bytes(fam: Family, impl: Impl, args: dict, knobs: dict | None = None) -> float:
    """Bytes an implementation's autograd graph saves for backward (beyond its inputs' storage)."""
    seen: set[int] = set()
    total = 0

    def pack(t):
        nonlocal total
        if isinstance(t, torch.Tensor):
            key = t.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()
        return t

    leaves = leaf_inputs(fam, args)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _call(fam, impl, leaves, knobs)
    return float(total)


def rows(results, device: str, copy_bw: float, mm_bf16: float, mm_tf32: float) -> list[dict]:
    """Long-format bench rows from measurements (and skips), with speedups against the baselines
    (the same kernel, shape and direction; the baselines' times without graphs)."""
    medians = {(r[1], str(r[5]), r[3], r[2].name): r[4].median_ms for r in results
               if r[0] == "ok" and r[4].times_ms and not r[4].graph}
    out = []
    for status, kernel, impl, direction, payload, shape, graph in results:
        base = dict(kernel=kernel, impl=impl.name, backend=impl.backend, direction=direction,
                    shape=str(shape), device=device, inputs=None if status in ("skip", "error") else payload.inputs,
                    knobs=None if status in ("skip", "error") else payload.knobs)
        if status in ("skip", "error") or not payload.times_ms:
            msg = payload if status in ("skip", "error") else payload.message
            out.append({**base, "dtype": bench_dtype(kernel, "bf16"), "graph": graph,
                        "metric": "error" if status == "error" else "skipped",
                        "value": math.nan, "bound": None, "message": msg})
            continue
        m: Measurement = payload
        t = statistics.median(m.times_ms)
        q = statistics.quantiles(m.times_ms, n=10) if len(m.times_ms) >= 2 else [t] * 9
        secs = t / 1e3
        rate = mm_bf16 if m.dtype in ("bf16", "fp16") else mm_tf32
        t_mem, t_math = m.model_bytes / copy_bw, m.model_flops / rate
        # on a CPU (Triton through its interpreter, Python per program) neither ceiling bounds a kernel
        bound = None if device != "cuda" else "compute" if t_math > t_mem else "memory"
        host_bound = m.host_us > 1e3 * t and device == "cuda"
        msg = "; ".join(x for x in ("host-bound: CPU time per call exceeds GPU time" if host_bound else None,
                                    m.message) if x) or None
        vals = {"time_ms": t, "time_ms_p10": q[0], "time_ms_p90": q[-1], "gbps": m.model_bytes / secs / 1e9,
                "pct_copy_bw": 100 * m.model_bytes / secs / copy_bw,
                "tflops": m.model_flops / secs / 1e12, "host_us": m.host_us, "peak_bytes": m.peak_bytes,
                "saved_bytes": m.saved_bytes}
        for ref_impl in ("torch", "compile"):
            ref_t = medians.get((kernel, str(shape), direction, ref_impl))
            if ref_t:
                vals[f"speedup_vs_{ref_impl}"] = ref_t / t
        for metric, v in vals.items():
            out.append({**base, "dtype": m.dtype, "graph": m.graph, "metric": metric,
                        "value": float(v) if v is not None else math.nan, "bound": bound, "message": msg})
    return out


# --- fwd + bwd, and the whole mHC path ------------------------------------------------------------

# the kernels of one mHC layer's path, in order; the projection is proj_rms, or the mapping (the same
# pass over x, with compute_h) where an implementation has no proj_rms
PATH = ("sinkhorn", "h_aggregate", "h_post_bda", "projection")
OURS = ("triton", "cutile")  # mhctool's kernels; torch and compile are the baselines


@dataclass(frozen=True)
class Total:
    kernel: str
    shape: str
    impl: str
    backend: str
    graph: bool
    fwd_ms: float
    bwd_ms: float
    pct_copy_bw: float  # the bytes of both directions over their summed time

    @property
    def ms(self) -> float:
        return self.fwd_ms + self.bwd_ms


def totals(rows: list[dict]) -> list[Total]:
    """fwd + bwd per (kernel, shape, implementation, graph), where both directions were timed."""
    got: dict = {}
    for r in rows:
        if r["metric"] in ("time_ms", "pct_copy_bw") and r["value"] == r["value"]:
            key = (r["kernel"], r["shape"], r["impl"], r["backend"], bool(r["graph"]))
            got.setdefault(key, {})[r["direction"], r["metric"]] = r["value"]
    out = []
    for (kernel, shape, impl, backend, graph), v in got.items():
        if ("fwd", "time_ms") in v and ("bwd", "time_ms") in v:
            tf, tb = v["fwd", "time_ms"], v["bwd", "time_ms"]
            # % of copy bandwidth is bytes / time / copy: the bytes of a direction are pct * time
            pct = (v.get(("fwd", "pct_copy_bw"), math.nan) * tf + v.get(("bwd", "pct_copy_bw"), math.nan) * tb) / (tf + tb)
            out.append(Total(kernel, shape, impl, backend, graph, tf, tb, pct))
    return out


def library_of(total: Total) -> str:
    """The group a total counts in: mhctool's implementations by name, a library by its prefix
    (``te[main]:mhc_fused_aggregate[tf32]`` -> ``te``), a module:function by its module."""
    if total.backend != "external":
        return total.impl
    head = total.impl.split(":")[0]
    return head.split("[")[0]


@dataclass(frozen=True)
class PathSum:
    name: str
    shape: str
    graph: bool
    parts: dict  # path slot -> Total (the fastest of the group's implementations of that kernel)

    @property
    def ms(self) -> float:
        return sum(t.ms for t in self.parts.values())

    @property
    def pct_copy_bw(self) -> float:
        return sum(t.pct_copy_bw * t.ms for t in self.parts.values()) / self.ms


def _tf32_variants() -> set[str]:
    """mhctool's implementations that multiply at TF32 by design (``triton-tf32``)."""
    return {i.name for k in KERNELS for i in impls_for(k) if i.precision == "tf32"}


TF32_BEST = "best of mhctool, TF32 allowed"


def whole_path(tots: list[Total]) -> list[PathSum]:
    """The path summed (fwd + bwd) per group: each implementation of mhctool's by name, each library
    taking its fastest variant per kernel, then the best of mhctool's kernels and the best of the
    libraries. A group is summed only where it has every kernel of the path. mhctool's TF32
    variants stay out of "best of mhctool" (IEEE accuracy); where the report has one, the best of
    mhctool with it allowed is its own line, so the table shows what the accuracy costs."""
    tf32 = _tf32_variants()
    cands: dict = {}
    for t in tots:
        slot = "projection" if t.kernel in ("proj_rms", "mapping") else t.kernel
        if slot not in PATH:
            continue
        names = [library_of(t)]
        if t.backend in OURS:
            names += [TF32_BEST] if t.impl in tf32 else ["best of mhctool", TF32_BEST]
        elif t.backend == "external":
            names.append("best of the libraries")
        for n in names:
            cands.setdefault((n, t.shape, t.graph), {}).setdefault(slot, []).append(t)
    out = []
    for (n, shape, graph), slots in cands.items():
        if set(slots) != set(PATH):
            continue
        if n == TF32_BEST and not any(t.impl in tf32 for ts in slots.values() for t in ts):
            continue  # no TF32 variant timed: the same as the best of mhctool
        # the fastest per slot; for the projection, proj_rms wherever the group has one
        parts = {slot: min(ts, key=lambda t: (t.kernel != "proj_rms", t.ms)) for slot, ts in slots.items()}
        out.append(PathSum(n, shape, graph, parts))
    return out
