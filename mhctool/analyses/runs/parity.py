"""``mhctool parity`` as a run: implementations and the float64 reference side by side on a
scenario's cases, the verdicts, and a hint under each outside implementation that fails (what
``mhctool identify`` finds it computes). The cases themselves are :mod:`mhctool.analyses.parity`'s."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa

from mhctool.analyses import parity
from mhctool.analyses import scenario as scenario_mod
from mhctool.analyses.hints import hints as find_hints
from mhctool.analyses.knob_shift import typed_value
from mhctool.analyses.runs import Watch
from mhctool.core import environment, report
from mhctool.core.errors import UsageError, kept_at_once
from mhctool.core.findings import (
    baseline_findings,
    counts,
    judged_nothing,
    outside_impls,
    skipped_everywhere,
    tally,
    verdicts,
    worst_first,
)
from mhctool.core.library_log import beside, holding
from mhctool.core.text import short_impl
from mhctool.families import call_problem, get_family, signature
from mhctool.runner.checks import CPU_NOTE
from mhctool.spread import setup, sharded


@dataclass
class Request:
    """What a parity run is asked, as the command line takes it (each value checked by :func:`run`)."""

    kernel: str | None = None  # names or groups, comma-separated; None: the scenario's kernels, else all
    impls: list[str] = field(default_factory=list)  # --impl specs; empty: every default built-in
    dtypes: list[str] | None = None
    shape: str | None = None
    device: str | None = None  # None: cuda where a GPU is visible
    scenario: str | None = None
    seed: int | None = None
    out: Path = Path("mhctool-parity.parquet")
    plot: Path | None = None
    matmul_precision: str = "ieee"
    kappa: float | None = None
    hint: bool = True
    checks: list[str] = field(default_factory=list)
    repeats: int = 3
    conventions: list[tuple[str, str]] = field(default_factory=list)  # (knob, value as typed)
    input_dtypes: list[tuple[str, str]] = field(default_factory=list)  # (input, dtype name)
    isolate: bool | None = None
    case_timeout: float | None = None
    transport: str | None = None
    workers: str | None = None
    backend: str = "local"
    ray_address: str | None = None
    shard: str | None = None
    ranks: int = 1
    grad_reduce: str = "fp32"
    verbose: bool = False  # the libraries' own lines on the terminal, no library log
    insist: bool = False  # an implementation that keeps ending its process or hanging runs on every case


@dataclass
class Outcome:
    """What a parity run measured and concluded; the report is written already."""

    plan: parity.Plan
    ran: parity.Executed
    device: str
    workers: int
    verdicts: list[dict]  # worst first
    outside: list[str]  # the implementations under test from outside mhctool
    unjudged: dict[str, str]  # an outside implementation judged on no case -> why
    notes: list[str]  # what the run noticed that is no verdict (baselines' findings, skipped backends)
    hints: list[str]
    report: Path
    table: pa.Table  # the report as written (figures are drawn from it)
    library_log: str | None = None

    @property
    def counts(self) -> tuple[int, int, int]:
        return tally(v["passed"] for v in self.verdicts)

    def counts_of(self, impl: str) -> tuple[int, int, int]:
        return counts(self.verdicts, impl)

    @property
    def interrupted(self) -> bool:
        return self.ran.interrupted

    @property
    def failed(self) -> bool:
        return bool(self.counts[1] or self.unjudged)

    @property
    def exit_code(self) -> int:
        return 130 if self.interrupted else 1 if self.failed else 0


def conventions_of(items: list[tuple[str, str]], kernels: list[str]) -> dict[str, dict]:
    """``--convention KNOB=VALUE`` pairs -> {kernel: {knob: value}} for the kernels that have the
    knob as a convention (values checked like scenario knobs); a knob none of them has is an error."""
    out: dict[str, dict] = {}
    for name, raw in items:
        takers = [k for k in kernels if name in get_family(k).conventions]
        if not takers:
            known = sorted({c for k in kernels for c in get_family(k).conventions})
            raise UsageError(f"--convention {name} is no convention of {', '.join(kernels)}; accepted: "
                             + (", ".join(known) or "none"))
        for k in takers:
            knob = get_family(k).knobs[name]
            out.setdefault(k, {})[name] = knob.check(k, name, typed_value(knob.kind, name, raw))
    return out


def input_dtypes_of(items: list[tuple[str, str]], kernels: list[str]) -> dict[str, dict]:
    """``--input-dtypes NAME=DTYPE`` pairs -> {kernel: {input: dtype}} for the kernels that have the
    input (each checked by :func:`parity.check_input_dtypes`); an input none of them has is an error."""
    out: dict[str, dict] = {}
    for name, raw in items:
        takers = [k for k in kernels if name in get_family(k).inputs]
        if not takers:
            known = sorted({i for k in kernels for i in get_family(k).inputs})
            raise UsageError(f"--input-dtypes {name} is no input of {', '.join(kernels)}; accepted: {', '.join(known)}")
        for k in takers:
            out.setdefault(k, {}).update(parity.check_input_dtypes(k, {name: raw}))
    return out


def call_shape_problem(vs: list[dict], outside: list[str]) -> str | None:
    """An outside implementation whose every case failed because it cannot be called with the
    family's signature, or returns what the contract cannot take, is bad input: the sentence that
    says so, naming the signature (the report keeps its rows)."""
    for name in outside:
        mine = [v for v in vs if v["impl"] == name and v["direction"] == "fwd" and v["passed"] is not None]
        if mine and all(v["passed"] is False and call_problem(v["message"]) for v in mine):
            k = mine[0]["kernel"]
            return (f"--impl {short_impl(name)} cannot be judged as {k}: {mine[0]['message']}; "
                    f"expected {signature(get_family(k))}")
    return None


def plan_of(req: Request, device: str) -> tuple[parity.Plan, str]:
    """The request's cases and implementations, every value checked (a UsageError otherwise), and
    the kernels as the report names them."""
    kernel = req.kernel
    if kernel is None and req.scenario is not None:  # the scenario's kernels
        kernel = ",".join(dict.fromkeys(spec.kernel for spec in scenario_mod.resolve(req.scenario).specs)) or "all"
    kernel = kernel or "all"
    kernels = parity.kernels_of(kernel)
    pl = parity.plan(kernels, list(req.impls), device=device, scenario=req.scenario, dtypes=req.dtypes,
                     shapes=[req.shape] if req.shape else None, seeds=[req.seed] if req.seed is not None else None,
                     conventions=conventions_of(req.conventions, kernels), kappa=req.kappa,
                     matmul_precision=req.matmul_precision, checks=list(req.checks), repeats=req.repeats,
                     input_dtypes=input_dtypes_of(req.input_dtypes, kernels))
    pl = parity.sharded(pl, parity.parse_shard(req.shard))
    pl.sharding = sharded.parse(req.ranks, req.grad_reduce, sorted({c.kernel for c in pl.cases}), device)
    return pl, kernel


def _notes(pl: parity.Plan, table: pa.Table, device: str) -> list[str]:
    notes = [f"note: {name} (not gated: baseline) fails {rule} on {k} in {n} row(s); see the report's messages"
             for (name, k, rule), n in sorted((baseline_findings(table) if pl.checks else {}).items())]
    if "determinism" in pl.checks and device == "cpu":
        notes.append(f"note: determinism on cpu: {CPU_NOTE}; run the check on a GPU where it matters")
    if not pl.specs:  # a default run that judged no kernel of a built-in backend says so
        notes += [f"note: {name} skipped for every case: {why}" for name, why in skipped_everywhere(table).items()]
    return notes


def run(req: Request, watch: Watch = Watch()) -> Outcome:
    """Run the request's cases (the native implementation always, as the baseline) and judge them;
    the report is written once, atomically, with the hints and the library log's path, also where
    a second interrupt stops the hints. A UsageError before anything runs for a bad request, and
    after the report for an outside implementation that cannot be called as its family."""
    report.check_writable(req.out)
    if req.plot is not None:
        report.check_folder(req.plot)
    dev = environment.resolve_device(req.device)
    with contextlib.nullcontext() if req.verbose else holding(watch.consoles):  # imports' lines to the log
        pl, kernel = plan_of(req, dev)
    n_workers, backend = setup.spread_for(req.workers, req.backend, dev, len(pl.cases),
                                          lambda: parity.check_poolable(pl), alone=pl.sharding is not None)
    if pl.sharding is not None and (n_workers > 1 or backend != "local" or pl.checks):
        raise UsageError("--ranks runs each case over its own processes: it takes neither --workers, "
                         "--backend ray nor --check")
    s = setup.prepare(dev, specs=pl.specs, isolate=req.isolate, case_timeout=req.case_timeout, insist=req.insist,
                      transport=req.transport, workers=n_workers, backend=backend,
                      library_log=None if req.verbose else beside(req.out),
                      consoles=watch.consoles, say=watch.say)
    watch.planned(len(pl.cases))
    with s.running():
        try:
            ran = parity.execute(pl, s.isolation, s.interrupts,
                                 lambda c: watch.started(f"{c.kernel} {c.family} {c.dtype}",
                                                         f"{c.kernel} {c.family} {c.dtype} {c.shape}"),
                                 n_workers, backend, lambda c: watch.finished(), req.ray_address, insist=req.insist)
        finally:
            if pl.sharding is not None:
                pl.sharding.close()
        table = parity.table(pl, ran, kernel=kernel, device=dev, isolate=s.isolation is not None,
                             case_timeout=req.case_timeout, workers=n_workers, backend=backend)
        vs = worst_first(verdicts(table))
        outside = outside_impls(table)
        problem = call_shape_problem(vs, outside)
        hints = []
        with kept_at_once():  # a second signal while identifying: the cases' rows are kept, no hint
            hints = [] if problem or ran.interrupted or not req.hint else [
                h for _, _, h in find_hints(pl, vs, dev, s.isolation, s.transport, req.case_timeout,
                                            lambda: s.interrupts.requested,
                                            lambda k, name: watch.status(f"parity: identifying {short_impl(name)} on "
                                                                      f"{k} for a hint (mhctool identify)"))]
    cut = s.interrupts.requested and not ran.interrupted  # a signal while finding hints: the run ends there
    ran.interrupted = ran.interrupted or cut
    extra = {**({"hints": hints} if hints else {}), **({"library_log": s.library_log} if s.library_log else {}),
             **({"interrupted": True, "interrupted_in": "hints"} if cut else {})}
    table = report.with_run(table, **extra) if extra else table
    path = report.write_atomic(table, req.out)
    if problem:
        raise UsageError(problem)
    return Outcome(pl, ran, dev, n_workers, vs, outside, judged_nothing(table, parity.asked_outside(pl)),
                   _notes(pl, table, dev), hints, path, table, s.library_log)
