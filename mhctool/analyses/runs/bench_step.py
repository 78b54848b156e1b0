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
from mhctool.libraries.megatron_core import Recipe
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

    @property
    def errors(self) -> list[dict]:
        return [r for r in self.rows if r["metric"] == "error"]

    @property
    def exit_code(self) -> int:
        """130 interrupted, 1 where a variant failed to train, else 0."""
        return 130 if self.interrupted else 1 if self.errors else 0


def default_impls(device: str) -> list[str]:
    return ["triton", "cutile"] if device == "cuda" else ["torch"]


def plan(req: Request, dev: str):
    """(engine spec, base recipe, sweep points, variants), checked: bad input is a UsageError."""
    spec = E.parse_engine(req.engine)
    if spec.target == E.MEGATRON and dev != "cuda":
        raise UsageError("--engine megatron runs Megatron-core's model on a GPU; no GPU here (--device cuda)")
    if min(req.warmup, req.entry_steps) < 0 or req.steps < 3:
        raise UsageError("--steps takes at least 3 timed steps (a median and its spread); --warmup and "
                         "--entry-steps at least 0")
    opts = E.recipe_options(req.recipe)
    for key in ("steps", "watch", "time_entry_from", "hyper_connections", "fused"):
        if key in opts:
            raise UsageError(f"--recipe {key} is bench's to set (--steps, --warmup, --entry-steps; the variants "
                             "set hyper_connections and fused)")
    base = replace(Recipe(), **{k: v for k, v in req.sizes.items() if v is not None}, **opts)
    points = SB.sweep_points(req.sweep, E.recipe_options)
    for p in points:
        for key in p:
            if key in ("steps", "watch", "time_entry_from", "hyper_connections", "fused", "seed"):
                raise UsageError(f"--sweep {key}: not a sweep of the model (sweep sizes or options: streams, "
                                 "hidden, seq, layers, recompute, ...)")
        r = replace(base, **p)
        if r.global_batch % r.micro_batch:
            raise UsageError(f"global_batch={r.global_batch} must be a multiple of the micro-batch ({r.micro_batch})")
        if r.tp > 1:
            raise UsageError("bench --engine times one GPU's step (tp=1)")
    specs = list(req.impls) or default_impls(dev)
    vs = SB.variants(specs, E.assign)
    for v in vs:
        for f, s in v.specs.items():
            if s != "megatron" and f != "*":
                resolve_impls(f, [s])  # an unknown implementation: before anything trains
    if req.variants:
        known = [v.name for v in vs]
        unknown = [n for n in req.variants if n not in known]
        if unknown:
            raise UsageError(f"--variant {', '.join(unknown)}: not one of this run's ({', '.join(known)})")
        vs = [v for v in vs if v.name in req.variants or v.name == SB.BASELINE]
    return spec, base, points, vs


def _runner(spec, recipe, v: SB.Variant, dev: str) -> E.EngineRunner:
    specs = {f: "megatron" for f in E.ENGINE_FAMILIES} if v.name == SB.FUSED else v.specs
    return E.EngineRunner(spec, recipe, specs, {}, {}, device=dev, workers=1)


def kernel_figures(measured: list, recipe, dev: str, repeats: int = 20) -> dict:
    """Each swapped-in implementation's kernels timed alone (``mhctool bench``'s measurement) at the
    step's shape: (variant, point, family, direction) -> median ms; what cannot be timed is left out."""
    from mhctool.analyses import timing
    from mhctool.core.shapes import parse_shape_for
    out = {}
    l2 = environment.l2_bytes() if dev == "cuda" else 0
    for m in measured:
        if m.variant.role != "impl" or m.variant.name == SB.FUSED or not m.step_ms:
            continue
        r = replace(recipe, **m.point)
        shape = parse_shape_for("mhc", f"{r.seq}x{r.micro_batch}x{r.streams}x{r.hidden}")
        for family, s in m.variant.specs.items():
            impls = resolve_impls(family, [s])
            if not impls or impls[0].unsupported(dev, "bf16"):
                continue
            for d in ("fwd", "bwd"):
                try:
                    t = timing.measure(family, impls[0], shape, "bf16", dev, repeats, d, False, l2)
                except Exception:  # noqa: BLE001 - a kernel that cannot be timed alone: no figure, the step stands
                    continue
                if t.times_ms:
                    out[(m.variant.name, SB.point_text(m.point), family, d)] = statistics.median(t.times_ms)
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
    todo = []
    seen_plain = set()
    for p in points:
        for v in vs:
            if v.name == SB.BASELINE:  # one baseline for the points that differ only in mHC's options
                key = SB.plain_key(p)
                if key not in seen_plain:
                    seen_plain.add(key)
                    todo.append((dict(key), v))
                continue
            todo.append((p, v))
    watch.planned(len(todo))
    measured = []
    with s.running():
        for p, v in todo:
            if s.interrupts.requested:
                break
            r = replace(base, **p, steps=per_run, watch=False, time_entry_from=req.warmup + req.steps + 1)
            label = f"{v.name}{'' if not p else ' ' + SB.point_text(p)}: {per_run} steps"
            watch.started(label, label)
            records, error = _runner(spec, r, v, dev).records(r, v.role)
            measured.append(SB.Measured(v, p, records, error, req.warmup, req.steps))
            watch.finished()
        figures = kernel_figures(measured, base, dev) if req.kernels and not s.interrupts.requested else {}
        meta = environment.metadata()
    rows = SB.rows(measured, base, figures, dev)
    settings = {"command": "bench", "engine": spec.name, "device": dev, "recipe": asdict(replace(base, steps=per_run)),
                "sweep": [dict(p) for p in points], "warmup": req.warmup, "steps": req.steps,
                "entry_steps": req.entry_steps, "variants": [v.name for v in vs], "interrupted": s.interrupts.requested}
    table = report.to_table(rows, report.new_run_id(), "bench-step", meta, settings, schema=report.STEP_SCHEMA)
    path = report.write_atomic(table, req.out)
    return Outcome(rows, measured, base, points, dev, spec.name, s.interrupts.requested, path, table, s.library_log)
