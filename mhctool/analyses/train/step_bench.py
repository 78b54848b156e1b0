"""``mhctool bench --engine``: what mHC costs in an engine's training step (Megatron-core's, or a
``FILE.py:function`` engine's), and what kernels swapped in at its entry points buy there.

Each variant trains the engine's model by the recipe in a process of its own, one after another
(never side by side: they would share the GPU):

- ``plain``: the same GPT without hyper-connections, the baseline;
- ``native``: the engine's own mHC path (Megatron's unfused one, as its recipe runs);
- ``fused``: the engine's fused switch (Megatron's ``use_fused_mhc``: its cuTile kernels);
- each ``--impl``: swapped in at the module's entry points, as ``train --engine`` swaps it.

A run is ``warmup`` steps (compilation, the allocator's first growth), then ``steps`` timed steps
(each the engine's own wall time of one optimizer step, synchronised), then ``entry_steps`` more
under PyTorch's profiler with the entry points timed in place
(:class:`mhctool.core.entry_timing.EntryTimer`: the device time of their forward, backward and
recompute kernels). The timed steps carry no instrumentation, so the step times are the model's;
the kernel times are exact whatever the profiler costs the host, and their shares are of the clean
step (the profiled steps' own time is reported beside).
"""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field, replace

from mhctool.analyses.train import engine as E
from mhctool.analyses.train import module_path
from mhctool.core.errors import UsageError, kept_at_once
from mhctool.libraries.megatron_core import Recipe
from mhctool.registry.specs import resolve_impls

BASELINE, NATIVE, FUSED = "plain", "native", "fused"
# the parts a step's mHC overhead is attributed to, as the engines name what they time
# (mhctool.libraries.megatron_core.MODULE_OPS): the module's entry points, its other ops, and around
# them its two paths, whose own time is what the ops inside leave (the module's glue; all of a
# whole-module variant's kernels)
OPS = {
    "proj_rms": "projection + RMS (entry point)", "mapping": "projection + mapping (dev's fused entry point)",
    "sinkhorn": "Sinkhorn (entry point)", "h_aggregate": "H_pre aggregation (entry point)",
    "h_post_bda": "H_res mix + H_post bias-add (entry point)", "compute_h": "the mapping's arithmetic (compute_h)",
    "h_res_product": "H_res x the streams (bmm)", "h_post_y": "H_post x y", "h_post_bias": "H_post x the bias",
    "dropout_add": "bias-dropout-add over n x C", "expand": "expand (the block's entry)",
    "contract": "contract (the block's exit)",
    "pre_path": "the pre-path beyond the ops above (glue; a [module] variant's: all of it)",
    "post_path": "the post-path beyond the ops above (glue; a [module] variant's: all of it)"}
# recipe options that change the model without hyper-connections too (the baseline is run again
# at each sweep point where one of these differs)
PLAIN_KEYS = ("layers", "hidden", "heads", "seq", "vocab", "micro_batch", "global_batch", "tp",
              "sequence_parallel", "hidden_dropout", "deterministic", "lr")
ENTRY_KINDS = ("fwd", "bwd", "recompute")


@dataclass(frozen=True)
class Variant:
    name: str  # plain, native, fused, or the --impl spec
    role: str  # the engine worker's role: plain, native or impl
    specs: dict = field(default_factory=dict)  # entry point -> spec, for role impl


def default_impls(device: str) -> list[str]:
    """What is swapped in where ``--impl`` is not given: mhctool's Triton and cuTile kernels on a
    GPU at the entry points and for the whole module, its torch pieces on a CPU."""
    backends = ["triton", "cutile"] if device == "cuda" else ["torch"]
    return backends + [f"{b}{module_path.SUFFIX}" for b in backends]


def variants(specs: list[str], assign) -> list[Variant]:
    """The baseline, the engine's own path, its fused switch, then each ``--impl`` (``assign``:
    entry point -> spec, as ``train --engine`` assigns one spec)."""
    out = [Variant(BASELINE, "plain"), Variant(NATIVE, "native"), Variant(FUSED, "impl", {"*": "megatron"})]
    for s in dict.fromkeys(specs):
        if s == "megatron":
            continue  # Megatron's fused kernels: the fused variant
        out.append(Variant(s, "impl", assign([s])))
    return out


def sweep_points(items: list[tuple[str, str]], parse) -> list[dict]:
    """``--sweep KEY=V1,V2`` items as the recipe points to run (every combination, in order);
    ``parse``: ``[(key, raw)] -> {key: typed}`` (the recipe's own option parsing)."""
    points: list[dict] = [{}]
    seen = set()
    for key, raw in items:
        if key in seen:
            raise UsageError(f"--sweep {key} is given twice; put its values in one list: --sweep {key}=A,B")
        seen.add(key)
        values = [v for v in raw.split(",") if v.strip()]
        if not values:
            raise UsageError(f"--sweep {key}= needs values, e.g. --sweep {key}=2,4,8")
        typed = [parse([(key, v.strip())])[key] for v in values]
        points = [{**p, key: v} for p in points for v in typed]
    return points


# recipe options bench sets itself (its steps; the variants' switches), never a user's
BENCH_SETS = ("steps",) + E.BENCH_ONLY + ("fused",)


def check_variants(vs: list[Variant], only: list[str]) -> list[Variant]:
    """The variants' implementations resolved (an unknown one is a UsageError before anything
    trains); ``only``: the variants kept (the baseline always is)."""
    for v in vs:
        for f, s in v.specs.items():
            if s != "megatron" and f not in ("*", module_path.KEY):
                resolve_impls(f, [s])
    if only:
        known = [v.name for v in vs]
        unknown = [n for n in only if n not in known]
        if unknown:
            raise UsageError(f"--variant {', '.join(unknown)}: not one of this run's ({', '.join(known)})")
        vs = [v for v in vs if v.name in only or v.name == BASELINE]
    return vs


def base_recipe(items: list[tuple[str, str]], sizes: dict | None = None, device: str = "cuda"):
    """The recipe a step bench starts from: the engine's recipe with ``sizes`` (None: the
    recipe's on a GPU, :data:`~mhctool.analyses.train.engine.CPU_SIZES` on a CPU) and the
    ``--recipe KEY=VALUE`` items; an option bench sets itself, or one the recipe has not, is a
    UsageError. Checked as one point to time."""
    opts = E.recipe_options(items)
    for key in BENCH_SETS:
        if key in opts:
            raise UsageError(f"--recipe {key} is bench's to set (--steps, --warmup, --entry-steps; the variants "
                             "set hyper_connections and fused)")
    given, opts = E.sized(sizes or {}, device, opts)
    base = replace(Recipe(), **given, **opts)
    check_points(base, [{}])
    return base


def check_points(base, points: list[dict]) -> None:
    """Each sweep point a recipe bench can time (one GPU's step); bad input is a UsageError."""
    for p in points:
        for key in p:
            if key in BENCH_SETS or key == "seed":
                raise UsageError(f"--sweep {key}: not a sweep of the model (sweep sizes or options: streams, "
                                 "hidden, seq, layers, recompute, ...)")
        r = replace(base, **p)
        if r.global_batch % r.micro_batch:
            raise UsageError(f"global_batch={r.global_batch} must be a multiple of the micro-batch ({r.micro_batch})")
        if r.tp > 1:
            raise UsageError("bench --engine times one GPU's step (tp=1)")


def measure_all(spec, base, points: list[dict], vs: list[Variant], device: str, warmup: int, steps: int,
                entry_steps: int, interrupted=lambda: False, started=lambda label: None,
                finished=lambda: None) -> list["Measured"]:
    """Each variant at each point, one run after another (the baseline once for the points that
    differ only in mHC's options); a run not started before ``interrupted()`` turned true is left
    out. ``spec``: the engine (:func:`mhctool.analyses.train.engine.parse_engine`)."""
    todo, seen_plain = [], set()
    for p in points:
        for v in vs:
            if v.name == BASELINE:
                key = plain_key(p)
                if key not in seen_plain:
                    seen_plain.add(key)
                    todo.append((dict(key), v))
                continue
            todo.append((p, v))
    per_run = warmup + steps + entry_steps
    out = []
    with kept_at_once():  # a second signal kills the run in hand; the finished runs are kept
        for p, v in todo:
            if interrupted():
                break
            r = replace(base, **p, steps=per_run, watch=False, time_entry_from=warmup + steps + 1)
            started(f"{v.name}{'' if not p else ' ' + point_text(p)}: {per_run} steps")
            specs = {f: "megatron" for f in E.ENGINE_FAMILIES} if v.name == FUSED else v.specs
            records, error = E.EngineRunner(spec, r, specs, {}, {}, device=device, workers=1).records(r, v.role)
            if error is not None and interrupted():  # the signal ended it (not the variant's failure): left out
                break
            out.append(Measured(v, p, records, error, warmup, steps))
            finished()
    return out


def runs_planned(points: list[dict], vs: list[Variant]) -> int:
    """How many runs :func:`measure_all` makes."""
    plain = len({plain_key(p) for p in points}) if any(v.name == BASELINE for v in vs) else 0
    return plain + len(points) * sum(v.name != BASELINE for v in vs)


@dataclass
class Measured:
    """One variant's run at one sweep point: its step records and the error that ended it."""

    variant: Variant
    point: dict
    records: list[dict]
    error: str | None = None
    warmup: int = 0
    steps: int = 0

    def _series(self, key: str, timed_entry: bool) -> list[float]:
        recs = [r for r in self.records if r["step"] > self.warmup]
        recs = [r for r in recs if (r["step"] > self.warmup + self.steps) == timed_entry]
        return [float(r[key]) for r in recs if r.get(key) is not None]

    @property
    def step_ms(self) -> list[float]:
        return [1e3 * v for v in self._series("iteration-time", False)]

    @property
    def entry_step_ms(self) -> list[float]:
        return [1e3 * v for v in self._series("iteration-time", True)]

    @property
    def peak_bytes(self) -> float | None:
        v = [float(r["mem-max-allocated-bytes"]) for r in self.records if r.get("mem-max-allocated-bytes") is not None]
        return max(v) if v else None

    @property
    def fused_off(self) -> bool:
        """The engine turned its fused switch off (Megatron does without cuTile)."""
        return self.variant.name == FUSED and any(r.get("fused") is False for r in self.records)

    def entry(self) -> dict[tuple[str, str], tuple[float, float, float | None]]:
        """(family or op, kind) -> (median milliseconds a step, calls a step, bytes a step: what its
        calls were given and returned, where seen) over the entry-timed steps."""
        recs = [r["entry_ms"] for r in self.records if r.get("entry_ms") is not None]
        keys = sorted({(f, k) for e in recs for f, d in e.items() if f != "*" for k in ENTRY_KINDS
                       if f"{k}_calls" in d or f"{k}_ms" in d})

        def med(f, k, what, default):
            vals = [e.get(f, {}).get(f"{k}_{what}", default) for e in recs]
            vals = [v for v in vals if v is not None]
            return statistics.median(vals) if vals else None
        return {(f, k): (med(f, k, "ms", 0.0), med(f, k, "calls", 0), med(f, k, "bytes", None)) for f, k in keys}

    def mhc_ms(self) -> float | None:
        """The median over the entry-timed steps of the step's total time inside the entry points."""
        recs = [r["entry_ms"] for r in self.records if r.get("entry_ms") is not None]
        if not recs:
            return None
        return statistics.median(sum(v for f, d in e.items() if f != "*" for k, v in d.items() if k.endswith("_ms"))
                                 for e in recs)

    def busy_ms(self) -> float | None:
        """The median over the entry-timed steps of the step's whole kernel time (CPU time on a CPU)."""
        v = [r["entry_ms"]["*"]["busy_ms"] for r in self.records if "*" in (r.get("entry_ms") or {})]
        return statistics.median(v) if v else None

    def gaps(self) -> tuple[float | None, dict[tuple[str, str], float]]:
        """Over the entry-timed steps on a GPU, medians of the device's gaps a step (ms) and of those
        before kernels each (family, kind)'s calls launched (a step without such a gap counts 0)."""
        whole = [r["entry_ms"]["*"] for r in self.records if "gap_ms" in (r.get("entry_ms") or {}).get("*", {})]
        if not whole:
            return None, {}
        keys = {tuple(k.split("|", 1)) for w in whole for k in w.get("gap_before", {})}
        return (statistics.median(w["gap_ms"] for w in whole),
                {k: statistics.median(w.get("gap_before", {}).get("|".join(k), 0.0) for w in whole) for k in sorted(keys)})


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def point_text(point: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in point.items()) or "-"


def byte_floor(r) -> float:
    """The bytes a step's mHC modules must move at the least, beyond the plain layer's own residual
    add, by recipe ``r`` (bf16 streams, two modules a layer). Per token and module call, with C
    the hidden size and n the streams: the pre-path reads the n streams and writes C; the
    post-path reads the n streams and y and writes the n streams (together (3n + 2) C elements);
    the backward about twice the forward; the recompute (where on) one more pre-path ((n + 1) C);
    the plain layer's residual add moves 3 C forward and 3 C backward, which it would anyway.
    At C = 2048, n = 4, recompute on: 164 KiB a token and call."""
    per = r.hidden * (3 * (3 * r.streams + 2) + ((r.streams + 1) if r.recompute else 0) - 6)
    return 2.0 * per * r.global_batch * r.seq * 2 * r.layers


def rows(measured: list[Measured], recipe, kernel_ms: dict | None = None, device: str = "cuda",
         copy_bw: float | None = None) -> list[dict]:
    """The report's rows (``mhctool.core.report.STEP_SCHEMA``): per variant and sweep point, the
    step (``entry`` ``*``), then each entry point and op by direction; ``kernel_ms``: (variant,
    point text, family, direction) -> the kernel's own bench figure at the step's shape;
    ``copy_bw``: the device's copy rate (bytes/s), against which each op's bytes and the byte
    floor are set. The shares are of the clean step on a GPU (kernel time is exact under the
    profiler) and of the profiled step's whole CPU time on a CPU (where the profiler's own cost is
    in every time it records).

    The overhead is attributed: the time inside the module's ops (``mhc_ms``, split per op), the
    kernels outside them against the baseline's (``outside_ms``: the step's busy time less
    ``mhc_ms``, less the baseline's busy time), and the time the device waits against the
    baseline's (``idle_ms``: the clean step less its busy time, less the baseline's). The busy time
    is the profiled steps' kernel time, which the profiler does not change, so the three parts sum
    to ``overhead_ms``; a variant or baseline whose busy time was not measured has no such rows."""
    out: list[dict] = []
    plain, plain_busy = {}, {}
    for m in measured:
        if m.variant.name == BASELINE and m.step_ms:
            plain[plain_key(m.point)] = statistics.median(m.step_ms)
            if m.busy_ms() is not None:
                plain_busy[plain_key(m.point)] = m.busy_ms()
    for m in measured:
        r = replace(recipe, **m.point)
        base = {"variant": m.variant.name, "point": json.dumps(m.point, sort_keys=True), "streams": r.streams,
                "layers": r.layers, "hidden": r.hidden, "seq": r.seq, "micro_batch": r.micro_batch,
                "global_batch": r.global_batch, "recompute": bool(r.recompute), "entry": "*", "direction": "*"}

        def row(metric, value, **kw):
            out.append({**base, **kw, "metric": metric, "value": None if value is None else float(value)})
        if m.fused_off:
            row("skipped", None, message="the engine turned its fused switch off (Megatron does without cuTile: "
                                         "cuda.tile not importable)")
            continue
        if m.error is not None and not m.step_ms:
            row("error", None, message=m.error)
            continue
        if m.error is not None:  # steps were timed before it ended: kept, and said
            row("error", None, message=m.error)
        if not m.step_ms:
            continue
        t = statistics.median(m.step_ms)
        row("step_ms", t)
        row("step_ms_p10", _pct(m.step_ms, 0.1))
        row("step_ms_p90", _pct(m.step_ms, 0.9))
        row("steps", len(m.step_ms))
        row("tokens_per_s", r.global_batch * r.seq / (t / 1e3))
        t0 = plain.get(plain_key(m.point))
        if t0 is not None and m.variant.name != BASELINE:
            row("overhead", t / t0 - 1)
            row("overhead_ms", t - t0)
        if m.peak_bytes is not None:
            row("peak_bytes", m.peak_bytes)
        if m.entry_step_ms and m.variant.name != BASELINE:
            row("entry_step_ms", statistics.median(m.entry_step_ms))
            busy = m.busy_ms()
            if busy is not None:
                row("busy_ms", busy)
            whole = t if device == "cuda" or not busy else busy
            mhc = m.mhc_ms()
            if mhc is not None:
                row("mhc_ms", mhc)
                row("mhc_share", mhc / whole)
                if t0 is not None and device == "cuda":
                    row("elsewhere_ms", (t - t0) - mhc)
                b0 = plain_busy.get(plain_key(m.point))
                if t0 is not None and busy is not None and b0 is not None:
                    row("outside_ms", busy - mhc - b0)
                    row("idle_ms", (t - busy) - (t0 - b0))
            gap, before = m.gaps()
            if gap is not None:
                row("gap_ms", gap)
            for (family, kind), ms in before.items():
                row("gap_before_ms", ms, entry=family, direction=kind)
            for (family, kind), (ms, calls, nbytes) in m.entry().items():
                row("entry_ms", ms, entry=family, direction=kind)
                row("entry_share", ms / whole, entry=family, direction=kind)
                row("calls", calls, entry=family, direction=kind)
                if nbytes:
                    row("bytes", nbytes, entry=family, direction=kind)
                    if copy_bw and ms > 0:
                        row("pct_copy", 100 * nbytes / copy_bw / (ms / 1e3), entry=family, direction=kind)
        if m.variant.name != BASELINE and r.hyper_connections and copy_bw:
            floor = byte_floor(r)
            row("floor_bytes", floor)
            row("floor_ms", 1e3 * floor / copy_bw)
            if t0 is not None:
                row("floor_share", 1e3 * floor / copy_bw / t0)
        for (v, p, family, d), ms in (kernel_ms or {}).items():
            if v == m.variant.name and p == point_text(m.point):
                row("kernel_ms", ms, entry=family, direction=d)
    return out


def plain_key(point: dict) -> tuple:
    """What the baseline of a sweep point depends on (its run is shared by the points alike there)."""
    return tuple(sorted((k, v) for k, v in point.items() if k in PLAIN_KEYS))
