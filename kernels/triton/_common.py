"""Helpers shared by the Triton kernels: launch configuration and layout checks."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os

import torch
import triton
import triton.language as tl

from .. import _disk
from ..schedule import cdiv, next_pow2  # noqa: F401  (the kernels import them from here)


# fixed at import, as Triton fixes it when it decorates a kernel (a JIT or an interpreted function):
# read on the host's path of every launch, where an environment lookup a call adds up
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


def interpreted() -> bool:
    """True when Triton runs through its CPU interpreter (TRITON_INTERPRET=1 when the kernels
    were imported)."""
    return _INTERPRETED


# the kernels branch on it at compile time
INTERPRETED = tl.constexpr(_INTERPRETED)


@triton.jit
def cast(x, DTYPE: tl.constexpr):
    """``x.to(DTYPE)`` with round-to-nearest-even everywhere. Triton's CPU interpreter (3.6)
    converts fp32 to bf16 by truncating the low 16 bits, which doubles the rounding error of every
    bf16 store; there the rounding is done on the bits first. Compiled code converts directly."""
    if INTERPRETED:
        if DTYPE == tl.bfloat16:
            x = round_low_bits(x.to(tl.float32), 16)
    return x.to(DTYPE)


@triton.jit
def round_low_bits(v, DROP: tl.constexpr):
    """fp32 ``v`` rounded to nearest (ties to even) at ``DROP`` bits above the bottom of its
    mantissa, kept in fp32 with those bits zero: 16 is bf16, 13 is TF32. On the bits, so a
    finite value that rounds past the largest one becomes inf; callers that must keep inf and NaN
    as they are select them back."""
    bits = v.to(tl.uint32, bitcast=True)
    bits = (bits + ((1 << (DROP - 1)) - 1) + ((bits >> DROP) & 1)) & (0xFFFFFFFF ^ ((1 << DROP) - 1))
    return bits.to(tl.float32, bitcast=True)


# The host's path of a launch. Triton's own dispatch (JITFunction.run) binds every argument,
# specializes it and hashes the lot on every launch: about 44 us a launch of these kernels on an
# H100's host (dev/host_gpu.py, 2026-12-07), where the fused module path launches about fourteen
# kernels a call with its recompute, and the recompute of a block of layers runs host-bound.
# ``fast`` remembers, per kernel, the compiled kernel Triton's dispatch chose for a key at least as
# fine as Triton's own specialization (each tensor's dtype and 16-byte alignment, each integer's
# 1-ness, divisibility by 16 and width, every constexpr's value, the launch options), and launches
# it directly the next time that key comes; a key it has not seen goes through Triton's dispatch.
FAST_LAUNCH = True  # False: every launch through Triton's own dispatch (tests, dev/host_gpu.py)
_NO_DEFAULT = object()
_STREAM = []  # Triton's driver's current-stream function, looked up once


def _hooked() -> bool:
    """Whether something watches launches through Triton's hooks (a profiler): its dispatch then.
    A hook is None or, from Triton 3.5 or so, a chain of calls that may be empty."""
    rt = getattr(getattr(triton, "knobs", None), "runtime", None)
    if rt is None:
        return True
    return any(h is not None and getattr(h, "calls", None) != [] for h in (rt.launch_enter_hook, rt.launch_exit_hook))


_I32 = (-2**31, 2**31)
_TENSORS = (torch.Tensor, torch.nn.Parameter)


class _Dispatch:
    """A Triton kernel's ``run`` with its dispatch remembered (:func:`fast`)."""

    def __init__(self, kernel):
        self.slow = kernel.run
        self.params = [(p.name, p.default if p.has_default else _NO_DEFAULT, p.is_constexpr) for p in kernel.params]
        self.constexpr_at = tuple(i for i, (_, _, c) in enumerate(self.params) if c)
        self.seen: dict = {}
        self.hits = 0
        self.off = False  # a launcher this code does not know: Triton's dispatch from then on

    def key(self, args: tuple, kw: dict) -> tuple:
        """At least as fine as Triton's specialization: a tensor's dtype and 16-byte alignment, an
        integer's 1-ness, divisibility by 16 and width (32 or 64 bits, signed or not), a float's
        type, anything else (a constexpr, None, a bool) by type and value."""
        k = [torch.cuda.current_device(), tuple(kw.items())]
        add = k.append
        lo, hi = _I32
        for a in args:
            t = type(a)
            if t in _TENSORS:
                add(a.dtype)
                add(a.data_ptr() & 15)
            elif t is int:
                add((a == 1, (a & 15) == 0, lo <= a < hi, a < 2**63))
            elif t is float:
                add(t)
            elif isinstance(a, torch.Tensor):
                add((a.dtype, a.data_ptr() & 15))
            else:
                add((t, a))
        for i in self.constexpr_at:  # a constexpr given by position: its value
            if i < len(args):
                add((type(args[i]), args[i]))
        return tuple(k)

    def __call__(self, *args, grid, warmup, **kw):
        if warmup or self.off or not FAST_LAUNCH or type(grid) is not tuple or _hooked():
            return self.slow(*args, grid=grid, warmup=warmup, **kw)
        try:
            key = self.key(args, kw)
            ck = self.seen.get(key)
        except TypeError:  # an argument of no hashable value: Triton's dispatch
            return self.slow(*args, grid=grid, warmup=False, **kw)
        if ck is None:
            ck = self.slow(*args, grid=grid, warmup=False, **kw)
            if len(self.seen) < 256:  # a value that keeps changing is no key to keep
                self.seen[key] = ck
            return ck
        full = args + tuple(kw[name] if name in kw else default for name, default, _ in self.params[len(args):])
        g = grid + (1, 1)
        if not _STREAM:
            from triton.runtime import driver
            _STREAM.append(driver.active.get_current_stream)
        try:
            ck.run(g[0], g[1], g[2], _STREAM[0](key[0]), ck.function, ck.packed_metadata, None, None, None, *full)
        except (TypeError, AttributeError):  # raised before the launch, by a launcher of another form
            self.off = True
            return self.slow(*args, grid=grid, warmup=False, **kw)
        self.hits += 1
        return ck


def fast(kernel):
    """``kernel`` (a ``triton.jit`` kernel, launched as ``kernel[grid](...)``) with its dispatch
    remembered: the same object, its ``run`` replaced on the instance. Under the interpreter it is
    left as it is."""
    if not _INTERPRETED and hasattr(kernel, "params") and hasattr(kernel, "run"):
        kernel.run = _Dispatch(kernel)
    return kernel


# ln 2 split in two: the high part has 16 significant bits, so k * _LN2_HI is exact for |k| < 256
_LN2_HI = tl.constexpr(0.693145751953125)
_LN2_LO = tl.constexpr(1.428606820309417e-06)
_LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def exp(x):
    """``e**x`` in fp32 with an error of a few ulp whatever ``x``. ``tl.exp`` compiles to
    ``exp2(x * log2(e))``, and the rounding of that product is an error of ``|x| * 2**-24``
    relative, 5e-6 at x = -80: on rows 20-80 below their max (Sinkhorn's dead rows) it doubled
    the backward's error against PyTorch's ``exp`` on the GPU (the interpreter's ``tl.exp`` is
    numpy's and hides it; ``exp2`` of the rounded product there gives the GPU's bits). Here
    ``x = k ln2 + r`` with k an integer (Cody-Waite): ``k * ln2_hi`` is exact and so is the
    subtraction; only ``|r| <= ln2 / 2`` goes through the product, and ``2**k`` is exact. ``x``
    is held to [-150, 150] first (e**x is 0 or inf in fp32 well before; inf - inf would be NaN);
    NaN stays NaN."""
    x = tl.where(x < -150.0, -150.0, tl.where(x > 150.0, 150.0, x))
    k = tl.floor(x * _LOG2E + 0.5)
    r = (x - k * _LN2_HI) - k * _LN2_LO
    kh = tl.minimum(k, 127.0)  # 2**128 is inf in fp32: near the top, the rest joins r's factor
    return tl.exp2(r * _LOG2E + (k - kh)) * tl.exp2(kh)


def check_device(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t is not None and t.is_cuda == _INTERPRETED:
            where = "CPU tensors (the interpreter is on)" if _INTERPRETED else "CUDA tensors"
            raise ValueError(f"the Triton kernels take {where}; got a tensor on {t.device}")


def require_contiguous(name: str, t: torch.Tensor) -> torch.Tensor:
    """The kernels index memory directly: they take contiguous tensors (the ``[s, b, n*C]`` view of
    a contiguous ``[s, b, n, C]`` tensor is one). Anything else is refused, never copied silently."""
    if not t.is_contiguous():
        raise ValueError(
            f"{name} must be contiguous for the Triton kernels (shape {tuple(t.shape)}, "
            f"strides {t.stride()}); call .contiguous() first"
        )
    return t


_BEST: dict = {}
picks = {"timed": 0, "read": 0}  # where this process's picks came from


def _time(run, cfg) -> float:
    """Milliseconds of three launches of ``cfg`` after a warm-up (inf: it does not compile)."""
    try:
        run(cfg)  # compile and warm up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(3):
            run(cfg)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)
    except Exception:  # a configuration that does not compile (resources) is skipped
        return float("inf")


def _pick_entry(key, configs: list):
    """Where the pick for ``key`` among ``configs`` is kept on this machine (None: nowhere)."""
    where = _disk.folder("tiles")
    if where is None:
        return None
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    h = hashlib.sha256()
    for part in (_disk.source_digest(), triton.__version__, device, repr(key), repr(configs)):
        h.update(part.encode() + b"\0")
    return where / f"{h.hexdigest()}.json"


def pick_config(key, configs: list, run, work: int = 1 << 30):
    """The fastest of ``configs`` for ``key``, timed with CUDA events once per machine: the pick is
    kept on disk (``$MHCTOOL_CACHE/tiles``, :mod:`mhctool.kernels._disk`) and read back by every
    later process, so a run's workers and the runs after it take one tile. A tile sets the order of
    a kernel's sums; picked afresh in each process, timing noise gave other bits from one process
    to the next (h_aggregate's autotuner did, until its tile was fixed). The first config under the
    interpreter, where nothing can be timed, and for small problems (``work`` elements under 2^24),
    where the choice does not matter and compiling every candidate would. ``run(cfg)`` launches
    the kernel(s) and may be called several times."""
    if interpreted() or len(configs) == 1 or work < (1 << 24):
        return configs[0]
    if key in _BEST:
        return _BEST[key]
    entry = _pick_entry(key, configs)
    with _disk.locked(entry.with_suffix(".lock")) if entry is not None else contextlib.nullcontext():
        index = None
        if entry is not None:
            try:
                index = json.loads(entry.read_text())["index"]
            except (OSError, ValueError, KeyError, TypeError):
                index = None
        if isinstance(index, int) and 0 <= index < len(configs):
            picks["read"] += 1
        else:
            times = [_time(run, cfg) for cfg in configs]
            index = min(range(len(configs)), key=lambda i: times[i])
            picks["timed"] += 1
            if entry is not None:
                _disk.write(entry, json.dumps({"key": repr(key), "index": index, "config": repr(configs[index]),
                                               "ms": [None if t == float("inf") else round(t, 4) for t in times]
                                               }).encode())
    _BEST[key] = configs[index]
    return configs[index]
