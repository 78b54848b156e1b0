"""``mhctool bench --engine`` as a run: an engine's training step timed for each variant
(:mod:`mhctool.analyses.train.step_bench`), at each ``--sweep`` point, the report written once
(what was timed before a signal too)."""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from mhctool.analyses.runs import Watch
from mhctool.analyses.train import engine as E
from mhctool.analyses.train import step_bench as SB
from mhctool.core import environment, report
from mhctool.core.errors import UsageError
from mhctool.core.library_log import beside, holding
from mhctool.registry.specs import resolve_impls
from mhctool.spread import setup


@dataclass
class Request:
    engine: str
    impls: list[str] = field(default_factory=list)  # empty: triton and cutile on a GPU, torch on a CPU
    sizes: dict = field(default_factory=dict)  # layers, hidden, heads, seq, micro_batch, vocab, streams
    recipe: list[tuple[str, str]] = field(default_factory=list)
    sweep: list[tuple[str, str]] = field(default_factory=list)
    warmup: int = 3
    steps: int = 10
    entry_steps: int = 3
    device: str | None = None
    kernels: bool = True  # each swapped-in kernel's own bench figure at the step's shape, beside
    out: Path = Path("mhctool-bench-step.parquet")
    plot: Path | None = None
    variants: list[str] = field(default_factory=list)  # empty: all (plain, native, fused and each --impl)


@dataclass
class Outcome:
    rows: list[dict]
    measured: list
    recipe: object
    points: list[dict]
    device: str
    engine: str
    interrupted: bool
    report: Path
    table: object
    library_log: str | None = None
    host_op_us: float | None = None  # timing.host_op_us: the host's microseconds to issue a small op
    cpu: str | None = None  # the host's CPU model

    @property
    def errors(self) -> list[dict]:
        return [r for r in self.rows if r["metric"] == "error"]

    @property
    def exit_code(self) -> int:
        """130 interrupted, 1 where a variant failed to train, else 0."""
        return 130 if self.interrupted else 1 if self.errors else 0


def plan(req: Request, dev: str):
    """(engine spec, base recipe, sweep points, variants), checked: bad input is a UsageError."""
    spec = E.parse_engine(req.engine)
    if spec.target == E.MEGATRON and dev != "cuda":
        raise UsageError("--engine megatron runs Megatron-core's model on a GPU; no GPU here (--device cuda)")
    if min(req.warmup, req.entry_steps) < 0 or req.steps < 3:
        raise UsageError("--steps takes at least 3 timed steps (a median and its spread); --warmup and "
                         "--entry-steps at least 0")
    base = SB.base_recipe(req.recipe, req.sizes, dev)
    points = SB.sweep_points(req.sweep, E.recipe_options)
    SB.check_points(base, points)
    vs = SB.check_variants(SB.variants(list(req.impls) or SB.default_impls(dev), E.assign), req.variants)
    return spec, base, points, vs


def kernel_figures(measured: list, recipe, dev: str, spec=None, repeats: int = 20) -> dict:
    """Each swapped-in implementation's kernels timed alone (``mhctool bench``'s measurement) at the
    step's shape: (variant, point, family, direction) -> median ms; what cannot be timed is left out.
    A whole-module variant's are its two families, ``mix_aggregate`` at the native path's
    conventions and ``h_post_bda`` at the recipe's dropout. On a GPU as CUDA graph replays: the
    kernels' device time, as the step's figure is (without a graph a call at a recipe's size is
    timed mostly as the host's launches: 0.39 ms for Triton's projection backward at Megatron's
    recipe, whose kernels run 0.036 ms a call in the step); where a capture fails, without."""
    from mhctool.analyses import timing
    from mhctool.analyses.train import module_path
    from mhctool.core.shapes import parse_shape_for
    out = {}
    l2 = environment.l2_bytes() if dev == "cuda" else 0
    for m in measured:
        if m.variant.role != "impl" or m.variant.name == SB.FUSED or not m.step_ms:
            continue
        r = replace(recipe, **m.point)
        shape = parse_shape_for("mhc", f"{r.seq}x{r.micro_batch}x{r.streams}x{r.hidden}")
        todo = {f: (s, {}) for f, s in m.variant.specs.items()}
        if module_path.KEY in todo:
            backend = todo.pop(module_path.KEY)[0]
            eff = E.effective_knobs(spec, r, {}, {}, {}, "native", dev) if spec is not None else {}
            pre = {k: v for k, v in module_path.pre_knobs(eff).items() if k != "rms_eps"}
            todo = {"mix_aggregate": (backend, pre), "h_post_bda": (backend, {"dropout": r.hidden_dropout,
                                                                               "dropout_seed": 1, "dropout_offset": 0})}
        for family, (s, knobs) in todo.items():
            impls = resolve_impls(family, [s])
            if not impls or impls[0].unsupported(dev, "bf16"):
                continue
            for d in ("fwd", "bwd"):
                for graph in ((True, False) if dev == "cuda" else (False,)):
                    try:
                        t = timing.measure(family, impls[0], shape, "bf16", dev, repeats, d, graph, l2,
                                           knobs=knobs or None)
                    except Exception:  # noqa: BLE001 - a kernel that cannot be timed alone: no figure, the step stands
                        continue
                    if t.times_ms:
                        out[(m.variant.name, SB.point_text(m.point), family, d)] = statistics.median(t.times_ms)
                        break
    return out


def run(req: Request, watch: Watch = Watch()) -> Outcome:
    report.check_writable(req.out)
    if req.plot is not None:
        report.check_writable(req.plot, "--plot", suffixes=(".png",))
    dev = environment.resolve_device(req.device)
    with holding(watch.consoles):
        spec, base, points, vs = plan(req, dev)
    s = setup.prepare(dev, isolate=False, pin_threads=False, library_log=beside(req.out), consoles=watch.consoles,
                      say=watch.say)
    per_run = req.warmup + req.steps + req.entry_steps
    watch.planned(SB.runs_planned(points, vs))
    with s.running():
        measured = SB.measure_all(spec, base, points, vs, dev, req.warmup, req.steps, req.entry_steps,
                                  lambda: s.interrupts.requested, lambda label: watch.started(label, label),
                                  watch.finished)
        figures = kernel_figures(measured, base, dev, spec) if req.kernels and not s.interrupts.requested else {}
        from mhctool.analyses import timing
        copy_bw = timing.copy_bandwidth(dev, (1 << 30) if dev == "cuda" else (1 << 24))
        host_us = timing.host_op_us(dev)  # the host's speed issuing launches: the module path's steps depend on it
        meta = environment.metadata()
    rows = SB.rows(measured, base, figures, dev, copy_bw)
    settings = {"command": "bench", "engine": spec.name, "device": dev, "recipe": asdict(replace(base, steps=per_run)),
                "sweep": [dict(p) for p in points], "warmup": req.warmup, "steps": req.steps,
                "entry_steps": req.entry_steps, "variants": [v.name for v in vs], "copy_bandwidth_Bps": copy_bw,
                "host_op_us": host_us,
                "interrupted": s.interrupts.requested}
    table = report.to_table(rows, report.new_run_id(), "bench-step", meta, settings, schema=report.STEP_SCHEMA)
    path = report.write_atomic(table, req.out)
    return Outcome(rows, measured, base, points, dev, spec.name, s.interrupts.requested, path, table, s.library_log,
                   host_us, meta.get("cpu"))
