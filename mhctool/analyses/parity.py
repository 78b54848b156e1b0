"""The parity engine: plan the cases, run them, make the report table.

One engine for ``mhctool parity``, ``mhctool gate`` and :mod:`mhctool.testing`: nothing about
cases, inputs or verdicts is written twice. The command line parses its options into
:func:`plan`'s arguments and prints; the API calls the same three functions.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable

import pyarrow as pa

from mhctool.analyses import scenario as scenario_mod
from mhctool.analyses.scenario import Scenario
from mhctool.core import environment, profile, report
from mhctool.core.dtypes import parse_dtype
from mhctool.core.errors import UsageError, kept_at_once
from mhctool.core.names import is_outside
from mhctool.families import GROUPS, KERNELS, PRECISIONS, get_family, kernels_named
from mhctool.registry.builtin import native_impl
from mhctool.registry.impl import Impl
from mhctool.registry.specs import is_function_spec, resolve_impls
from mhctool.runner import run as runner
from mhctool.runner.call import INPUT_DTYPES
from mhctool.runner.case import Case, check_fits, check_runnable
from mhctool.runner.checks import parse_checks
from mhctool.spread import jobs as jobs_mod
from mhctool.spread import pool
from mhctool.spread.case_isolation import Isolation


@dataclass
class Plan:
    """What a parity run will do: its cases and, per kernel, the implementations under test."""

    scenario: Scenario
    cases: list[Case]
    impls: dict[str, list[Impl]]
    specs: list[str]  # the implementations as asked for (empty: every default built-in)
    conventions: dict[str, dict]  # kernel -> {knob: value} the external implementations compute
    matmul_precision: str = "ieee"
    checks: tuple[str, ...] = ()  # reproducibility checks (mhctool.runner.checks.CHECKS)
    repeats: int = 3  # runs in all for the determinism check
    shard: tuple[int, int] | None = None  # (I, N): this run is the I-th of N slices of the cases
    planned: list[str] | None = None  # with a shard: every case id of the whole run, in order
    sharding: object | None = None  # sharded.Sharding: the tokens split over ranks (--ranks)
    # kernel -> {input: activation | fp32 | bf16 | fp16}: the dtypes external implementations take
    # their inputs in (--input-dtypes); the reference and the baseline see the same rounded values
    input_dtypes: dict = field(default_factory=dict)


@dataclass
class Executed:
    rows: list[dict]
    cases_run: int
    interrupted: bool
    timings: dict = field(default_factory=dict)  # phase -> seconds over the run (mhctool.core.profile)
    wall: float = 0.0  # seconds the cases took, start to end


def check_precision(precision: str, option: str = "matmul precision") -> str:
    """``precision`` when it is one of :data:`PRECISIONS`; anything else is a UsageError."""
    if precision not in PRECISIONS:
        raise UsageError(f"unknown {option} {precision!r}; accepted: {', '.join(PRECISIONS)}")
    return precision


def kernels_of(kernel: str | list[str]) -> list[str]:
    """A name, a group (``all``, ``mhc``, ``moe``), a comma-separated list or a list of those ->
    kernel names (checked)."""
    names = kernel if isinstance(kernel, list) else [k.strip() for k in kernel.split(",") if k.strip()]
    if not names:
        raise UsageError("no kernel named; accepted: " + ", ".join(KERNELS) + ", or a group: "
                         + ", ".join(GROUPS))
    return kernels_named(names)


def check_conventions(kernel: str, conventions: dict | None) -> dict:
    """``{knob: value}`` declared for ``kernel``'s external implementation, each value checked."""
    fam = get_family(kernel)
    out = {}
    for name, value in (conventions or {}).items():
        if name not in fam.conventions:
            raise UsageError(f"convention {name} is no convention of {kernel}; accepted: "
                             + (", ".join(fam.conventions) or "none"))
        out[name] = fam.knobs[name].check(kernel, name, value)
    return out


def check_input_dtypes(kernel: str, declared: dict | None) -> dict:
    """``{input: dtype}`` declared for ``kernel``'s external implementation, each checked: an
    input of the family, and ``activation`` (the case's dtype) or a format name."""
    fam = get_family(kernel)
    out = {}
    for name, value in (declared or {}).items():
        if name not in fam.inputs:
            raise UsageError(f"--input-dtypes {name}={value}: {name} is no input of {kernel}; accepted: "
                             + ", ".join(fam.inputs))
        if value not in INPUT_DTYPES:
            raise UsageError(f"--input-dtypes {name}={value}: unknown dtype {value!r}; accepted: "
                             + ", ".join(INPUT_DTYPES))
        out[name] = value
    return out


def plan(kernels: list[str], impls: list[str | Impl] | None, *, device: str,
         scenario: str | Scenario | None = None, dtypes: list[str] | None = None,
         shapes: list[str] | None = None, seeds: list[int] | None = None,
         families: list[str] | None = None, conventions: dict[str, dict] | None = None,
         kappa: float | None = None, matmul_precision: str = "ieee", checks: list[str] | None = None,
         repeats: int = 3, strict: bool = True, input_dtypes: dict[str, dict] | None = None) -> Plan:
    """The cases of ``scenario`` (default: parity-default) for ``kernels``, narrowed by the
    dtypes, shapes, seeds and input families given, and the implementations to judge.

    ``impls``: ``--impl``-style spec strings (``triton``, ``file.py:fn``, ``te:DIR``) or
    :class:`~mhctool.registry.impl.Impl` objects (a Python callable, from :mod:`mhctool.testing`).
    ``checks``: ``determinism`` and/or ``batch-invariance`` (``repeats`` runs in all for the first).
    Every problem with the request is a :class:`~mhctool.core.errors.UsageError` before anything runs;
    ``strict``: also an implementation named that can run none of the cases (the gate, where a
    suite outlives the machine it was written on, reports those as skipped instead)."""
    checks = parse_checks(list(checks or []))
    if not (isinstance(repeats, int) and repeats >= 2):
        raise UsageError(f"repeats {repeats!r} for the determinism check must be an integer of at least 2")
    check_precision(matmul_precision, "--matmul-precision")
    given = list(impls or [])
    specs = [i for i in given if isinstance(i, str)]
    objects = [i for i in given if isinstance(i, Impl)]
    if len(specs) + len(objects) != len(given):
        raise UsageError("implementations are spec strings (triton, file.py:fn, te:DIR) or callables")
    if (any(is_function_spec(s) for s in specs) or objects) and len(kernels) != 1:
        raise UsageError("an external implementation (--impl module:function, or a callable) needs one --kernel, "
                         "not several (a whole library takes NAME:PATH, e.g. megatron:fused_mhc_kernels.py)")
    conventions = {k: v for k, v in (conventions or {}).items() if v}
    if conventions and not (objects or any(is_outside(s) for s in specs)):
        raise UsageError("--convention declares what an external implementation computes; name one with --impl")
    input_dtypes = {k: check_input_dtypes(k, v) for k, v in (input_dtypes or {}).items() if v}
    if input_dtypes and not (objects or any(is_outside(s) for s in specs)):
        raise UsageError("--input-dtypes declares how an external implementation takes its inputs; "
                         "name one with --impl")
    sc = scenario if isinstance(scenario, Scenario) else scenario_mod.resolve(scenario)
    if kappa is not None:
        if not kappa >= 1.0:
            raise UsageError(f"kappa {kappa!r} must be at least 1")
        sc = replace(sc, rule=replace(sc.rule, kappa=float(kappa)))
    if shapes and len({get_family(k).shape_kind for k in kernels}) > 1:
        raise UsageError("a shape takes one form per kind of kernel (SxBxNxC for mHC, TxHxFxE for the grouped "
                         "MLP); pick the kernels (mhc or moe: every kernel of one kind)")
    dtypes = [parse_dtype(d).name for d in dtypes] if dtypes else None
    cases = sc.cases(device, kernels, dtypes, shapes, seeds, families)
    if not cases:
        raise UsageError(f"scenario {sc.name} has no case for kernel {', '.join(kernels)}")
    check_fits(cases)
    resolved = {k: resolve_impls(k, specs) if specs or not objects else [] for k in kernels}
    for obj in objects:
        resolved[obj.kernel].append(obj)
    if given and strict:  # asked for by name: unusable for every case is an input error, not skipped rows
        check_runnable(resolved, cases)
    return Plan(sc, cases, resolved, specs, conventions, matmul_precision, checks, repeats, input_dtypes=input_dtypes)


def parse_shard(text: str | None) -> tuple[int, int] | None:
    """``--shard I/N`` -> (I, N), 1 <= I <= N; anything else is a UsageError."""
    if text is None:
        return None
    i, sep, n = str(text).partition("/")
    try:
        shard = (int(i), int(n))
    except ValueError:
        shard = None
    if not sep or shard is None or not 1 <= shard[0] <= shard[1]:
        raise UsageError(f"malformed --shard {text!r}; expected I/N with 1 <= I <= N, e.g. 2/4")
    return shard


def sharded(p: Plan, shard: tuple[int, int] | None) -> Plan:
    """The I-th of N deterministic slices of the plan's cases (every N-th case from the I-th, so
    each slice gets a share of every kernel); the whole run's case ids stay in ``planned``, which
    ``mhctool report merge`` orders the slices' rows by."""
    if shard is None or shard == (1, 1):
        return p
    i, n = shard
    return replace(p, cases=p.cases[i - 1::n], shard=shard, planned=[c.case_id for c in p.cases])


def check_poolable(p: Plan) -> None:
    """A worker resolves the implementations from the ``--impl`` specs; callables handed to the
    API (mhctool.testing) exist in this process only: spreading those is a UsageError."""
    if not all(i.spec is not None or i.name in {x.name for x in resolve_impls(i.kernel, p.specs)}
               for lst in p.impls.values() for i in lst):
        raise UsageError("--workers and --backend ray run implementations named by --impl specs; "
                         "a Python callable exists in this process only")


def execute(p: Plan, isolation: Isolation | None = None, interrupted: Callable[[], bool] = lambda: False,
            progress: Callable[[Case], None] | None = None, workers: int = 1, backend: str = "local",
            finished: Callable[[Case], None] | None = None, ray_address: str | None = None,
            pool=None, insist: bool = False) -> Executed:
    """Run every case of the plan (the native implementation always, as the baseline); stops
    before the next case once ``interrupted()`` is true. ``progress(case)``: called as each
    starts, ``finished(case)`` as each ends. ``workers`` > 1 or ``backend`` ray: the cases are
    spread over processes (:mod:`mhctool.spread.pool`); the rows come back in the plan's order.
    ``pool``: a :class:`mhctool.spread.pool.Pool` kept by the caller, whose workers run the cases.
    An implementation that keeps ending its process (or hanging) is not run on the cases after
    (:class:`~mhctool.spread.streaks.Streaks`) unless ``insist``."""
    t0 = time.perf_counter()
    if workers > 1 or backend != "local":
        o = _spread(p, isolation, interrupted, progress, finished, workers, backend, ray_address, pool, insist)
        o.wall = time.perf_counter() - t0
        return o
    rows: list[dict] = []
    timings: dict = {}
    done = 0
    with kept_at_once():  # a second signal abandons the case in hand; the finished ones are kept
        for c in p.cases:
            if interrupted():
                break
            if progress:
                progress(c)
            res = runner.run_case(c, p.impls[c.kernel], p.scenario.rule, p.matmul_precision, isolation,
                                  p.conventions.get(c.kernel), p.checks, p.repeats, p.sharding,
                                  p.input_dtypes.get(c.kernel))
            if res.abandoned:  # cut short by the interrupt: not a finished case
                break
            rows.extend(res.rows)
            profile.add(timings, res.timings)
            done += 1
            if finished:
                finished(c)
    return Executed(rows, done, interrupted(), timings, time.perf_counter() - t0)


def _spread(p: Plan, isolation, interrupted, progress, finished, workers, backend, ray_address, into,
            insist: bool = False) -> Executed:
    check_poolable(p)
    iso = None if isolation is None else jobs_mod.IsolationSettings(isolation.transport, isolation.case_timeout,
                                                                            insist=isolation.insist)
    jobs = [jobs_mod.Job(c, tuple(p.specs), p.scenario.rule, p.matmul_precision, p.conventions.get(c.kernel),
                     tuple(p.checks), p.repeats, iso, p.input_dtypes.get(c.kernel)) for c in p.cases]
    names = [[(i.name, i.backend) for i in [native_impl(c.kernel)] + [i for i in p.impls[c.kernel]
                                                                                 if not i.native]]
             for c in p.cases]
    spread = pool.run_cases(jobs, names, workers, backend, interrupted,
                            progress and (lambda i: progress(p.cases[i])),
                            finished and (lambda i: finished(p.cases[i])), ray_address, into, insist)
    rows = [r for case_rows in spread.rows if case_rows is not None for r in case_rows]
    return Executed(rows, sum(r is not None for r in spread.rows), spread.interrupted, spread.timings)


def asked_outside(p: Plan) -> dict[str, list[str]]:
    """Each implementation asked for from outside mhctool (an ``--impl`` spec of a function or a
    library, or a callable) -> the names of what it stands for that exist (a library's functions;
    a kernel it lacks is no part of it)."""
    out: dict[str, list[str]] = {}
    for impls in p.impls.values():
        for i in impls:
            if i.backend == "external":
                names = out.setdefault(i.spec or i.name, [])
                if i.exists and i.name not in names:
                    names.append(i.name)
    return out


def settings(p: Plan, o: Executed, **extra) -> dict:
    """The run's settings as the report's ``mhctool.run`` metadata records them."""
    return {"command": "parity", "impl": p.specs or [i.name for lst in p.impls.values() for i in lst],
            "scenario": p.scenario.name, "scenario_source": p.scenario.source, "kappa": p.scenario.rule.kappa,
            "floor_roundoffs": p.scenario.rule.floor_roundoffs, "matmul_precision": p.matmul_precision,
            "conventions": p.conventions, "input_dtypes": p.input_dtypes, "checks": list(p.checks),
            "repeats_determinism": p.repeats,
            "profile": {k: round(v, 4) for k, v in o.timings.items()}, "wall_s": round(o.wall, 3),
            "adapters": sorted({i.adapter for lst in p.impls.values() for i in lst if i.adapter}),
            "interrupted": o.interrupted, "cases_run": o.cases_run, "cases_planned": len(p.cases),
            **({"shard": f"{p.shard[0]}/{p.shard[1]}", "planned": p.planned} if p.shard else {}),
            **(p.sharding.row() if p.sharding is not None else {}), **extra}


def table(p: Plan, o: Executed, **extra) -> pa.Table:
    """The Parquet report of a run (schema: mhctool.core.report.SCHEMA), not yet written."""
    return report.to_table(o.rows, report.new_run_id(), "parity", environment.metadata(), settings(p, o, **extra))
