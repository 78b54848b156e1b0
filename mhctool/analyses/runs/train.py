"""``mhctool train`` as a run: a model trained with an implementation, natively and in float64,
from a seed ensemble, the drift judged and traced (the training itself is
:mod:`mhctool.analyses.train`'s; Megatron-core's model is :mod:`mhctool.analyses.train.engine`'s).

:func:`prepare` checks the request and settles the configuration (what the command states before
the first step); :func:`run` trains and writes the report once, with the golden values asked for."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from mhctool.analyses import train as T
from mhctool.analyses.goldens import check, diff, dump
from mhctool.analyses.runs import Watch
from mhctool.analyses.train import engine as E
from mhctool.core import environment, report
from mhctool.core.dtypes import parse_dtype
from mhctool.core.errors import UsageError
from mhctool.core.library_log import beside, holding
from mhctool.core.verdict import VerdictRule
from mhctool.registry.specs import resolve_impls
from mhctool.spread import pool, setup
from mhctool.spread.isolation import Worker

SIZES = ("steps", "layers", "streams", "hidden", "heads", "seq", "batch", "vocab", "lr")
INPUT_DTYPES = ("contract", "library")


@dataclass
class Request:
    impls: list[str] = field(default_factory=list)  # empty: triton (mhctool's model), megatron (an engine)
    kernel: str | None = None  # the family a function implements, where its parameters do not say
    sizes: dict = field(default_factory=dict)  # SIZES -> value; None or absent: the default here
    dtype: str = "fp32"
    device: str | None = None
    seed: int = 0
    seeds: int | None = None  # None: the default here (T.default_seeds)
    workers: str | int = "auto"
    knobs: list[tuple[str, str]] = field(default_factory=list)
    conventions: list[tuple[str, str]] = field(default_factory=list)
    input_dtypes: str = "contract"
    kappa: float = 2.0
    compare: bool = True
    trace: bool = True
    isolate: bool | None = None
    out: Path = Path("mhctool-train.parquet")
    goldens: Path | None = None
    plot: Path | None = None
    engine: str | None = None
    ranks: int | None = None
    recipe: list[tuple[str, str]] = field(default_factory=list)
    step_timeout: float | None = None  # seconds an isolated step may take (None: StepWatch's defaults)
    trace_budget: float | None = None  # seconds the tracing may take (None: trace.TRACE_BUDGET x the trajectories')


@dataclass
class Plan:
    """A checked request: the configuration, the implementation per family, how it spreads."""

    req: Request
    cfg: T.TrainConfig
    assigned: dict[str, str]  # family -> spec
    knobs: dict
    conventions: dict
    seeds: int
    setup: setup.Setup
    runner: object | None = None  # the engine's runner (--engine), None for mhctool's model

    @property
    def total(self) -> int:
        """Steps in all (the progress bar's length)."""
        return self.cfg.steps * (3 if self.req.compare else 1) * self.seeds

    def header(self) -> str:
        """What will train, in one line."""
        dev = self.setup.device
        if self.runner is not None:
            r = self.runner.recipe
            return (f"train --engine {self.runner.spec.name} ({r.layers} layers x {r.streams} streams, hidden "
                    f"{r.hidden}, {r.heads} heads, seq {r.seq}, micro-batch {r.micro_batch} of {r.global_batch}, "
                    f"vocab {r.vocab}, {r.steps} steps at lr {r.lr:g} (the recipe's schedule), bf16 on {dev} "
                    f"({seeds_phrase(self.cfg.seed, self.seeds, 1)})); changed from the recipe: "
                    + (", ".join(f"{k}={v}" for k, v in r.changed().items() if k != "seed") or "nothing"))
        m, cfg = self.cfg.model, self.cfg
        src = T.MarkovSource(m.vocab, cfg.branch, cfg.seed)
        return (f"train: {m.layers} layers x {m.streams} streams, hidden {m.hidden}, {m.heads} heads, seq {m.seq} x "
                f"batch {cfg.batch}, vocab {m.vocab}, {cfg.steps} steps at lr {cfg.lr:g}, {cfg.dtype} on {dev} "
                f"({seeds_phrase(cfg.seed, self.seeds, self.setup.workers)}); the source's floor "
                f"{src.entropy():.3f} nats a token")


@dataclass
class Outcome:
    plan: Plan
    session: T.Outcome
    report: Path
    goldens: Path | None
    table: object  # pyarrow.Table: the report as written (figures are drawn from it)
    library_log: str | None = None  # where the libraries' own output went, where they wrote any

    @property
    def exit_code(self) -> int:
        o = self.session
        if o.interrupted:
            return 130
        if not o.compared:
            return 0 if self.trained_cleanly else 1
        return 0 if o.passed else 1

    @property
    def trained_cleanly(self) -> bool:
        """A run not compared: no error and no non-finite step in any seed."""
        o = self.session
        return not o.errors and all(r.impl.nonfinite_step is None for r in o.runs)


def seeds_phrase(first: int, seeds: int, workers: int) -> str:
    if seeds == 1:
        return f"seed {first}"
    spread = f" over {workers} processes" if workers > 1 else ""
    return f"seeds {first}-{first + seeds - 1}{spread}"


def prepare(req: Request, watch: Watch = Watch()) -> Plan:
    """The request checked and configured; a UsageError for anything wrong, before any step."""
    workers_asked = pool.parse_workers(req.workers)
    if req.input_dtypes not in INPUT_DTYPES:
        raise UsageError(f"unknown --input-dtypes {req.input_dtypes!r}; accepted: {', '.join(INPUT_DTYPES)}")
    if req.goldens is not None:
        report.check_writable(req.goldens, "--goldens", suffixes=None)
    report.check_writable(req.out)
    if req.plot is not None:
        report.check_folder(req.plot)
    dev = environment.resolve_device(req.device)
    seeds = req.seeds if req.seeds is not None else T.default_seeds(dev)
    sizes = {k: req.sizes.get(k) for k in SIZES}
    if req.ranks is not None and req.engine is None:
        raise UsageError("--ranks trains over several processes only with --engine (mhctool's own model runs in one)")
    if req.engine is not None:
        engine_sizes = {("micro_batch" if k == "batch" else k): v for k, v in sizes.items()}
        cfg, runner = E.configure(req.engine, req.recipe, req.impls or ["megatron"], dev, engine_sizes, req.seed,
                                  req.knobs, req.conventions, req.ranks, workers_asked, seeds)
        s = setup.prepare(dev, workers=1, library_log=beside(req.out), consoles=watch.consoles, say=watch.say)
        return Plan(req, cfg, runner.specs, runner.knobs, runner.conventions, seeds, s, runner)
    cfg = T.config(dev, **sizes, dtype=parse_dtype(req.dtype).name, seed=req.seed)
    knobs = T.parse_knobs(req.knobs, "--knob")
    conventions = T.parse_knobs(req.conventions, "--convention", conventions_only=True)
    specs = req.impls or ["triton"]
    assigned = T.assign(specs, req.kernel)
    with holding(watch.consoles):  # their imports' lines to the library log
        for f, spec in assigned.items():  # an unknown implementation, a function of the wrong form: before training
            resolve_impls(f, [spec])
    if req.step_timeout is not None and req.isolate is False:
        raise UsageError("--step-timeout needs isolation (a hung step needs a child process to stop), "
                         "which --no-isolate turns off")
    isolate = True if req.step_timeout is not None and req.isolate is None else req.isolate
    s = setup.prepare(dev, specs=specs, isolate=isolate, workers=pool.worker_count(workers_asked, dev, seeds),
                      library_log=beside(req.out), consoles=watch.consoles, say=watch.say)
    return Plan(req, cfg, assigned, knobs, conventions, seeds, s)


def run(plan: Plan, watch: Watch = Watch(), begin=None) -> Outcome:
    """Train the plan's trajectories and judge them; the report (and the golden values asked for)
    written once the run ends, however it ends but a second interrupt. ``begin()``: called once
    the run's signals are caught, before the first step (the command states the plan there)."""
    req, s = plan.req, plan.setup
    watch.planned(plan.total)

    def progress(role, step):
        watch.started(f"{role} step {step.step} loss {step.metrics['lm loss']:.4g}", f"{role} step {step.step}")
        watch.finished()
    in_process = Worker("shm") if s.isolation is not None and s.workers == 1 else None
    try:
        with s.running():
            if begin is not None:
                begin()
            o = T.session(plan.cfg, plan.assigned, plan.knobs, plan.conventions, VerdictRule(kappa=req.kappa),
                          req.compare, req.trace, in_process, s.interrupts, progress,
                          as_used=req.input_dtypes == "library", seeds=plan.seeds, workers=s.workers,
                          isolation_factory=lambda: Worker("shm"), engine=plan.runner,
                          isolated=s.isolation is not None, step_timeout=req.step_timeout,
                          trace_budget=req.trace_budget,
                          phase=lambda line: watch.started(line, line))
            meta = environment.metadata()  # with the threads it trained with
    finally:
        if in_process is not None:
            in_process.stop()
    settings = T.settings(o, kappa=req.kappa, input_dtypes=req.input_dtypes, workers=s.workers,
                          **(plan.runner.settings() if plan.runner else {}))
    table = report.to_table(T.report_rows(o), report.new_run_id(), "train", meta, settings, schema=report.TRAIN_SCHEMA)
    path = report.write_atomic(table, req.out)
    if req.goldens is not None:
        dump(T.to_golden(o.impl), req.goldens)
    return Outcome(plan, o, path, req.goldens, table, s.library_log)


def golden_lines(o: T.Outcome) -> list[str]:
    """Megatron's golden-value rules on the implementation's run against the reference's, and the
    anomalies ``goldens check`` finds in each run that the reference's run has not."""
    lines = []
    ref = o.role("reference")
    if ref is not None and ref.steps and o.impl.steps:
        vs = diff(T.to_golden(ref), T.to_golden(o.impl), ["lm loss", "num-zeros"])
        lines.append("goldens diff against the reference (Megatron's rules): "
                     + "; ".join(f"{v.metric} {'passes' if v.passed else 'FAILS'} ({v.message})" for v in vs))
    seen = None
    for traj in o.trajectories[:3][::-1]:  # the reference first: the others' anomalies it has too are no finding
        found = [a.message for a in (check(T.to_golden(traj)) if len(traj.steps) >= 4 else [])
                 if a.metric != "iteration-time"]
        if seen is None:
            seen = set(found)
            if found and len(o.trajectories) > 1:
                lines.append("goldens check reference (the synthetic data's own): " + "; ".join(found))
            continue
        new = [m for m in found if m not in seen]
        if new or (found and len(o.trajectories) == 1):
            lines.append(f"goldens check {traj.role}: " + "; ".join(new or found))
    return lines
