"""The one-case runner: a case's inputs, the native baseline and the float64 reference, every
implementation's forward and backward, and the judged rows (:func:`run_case`).

It never imports what spreads cases or times them: ``isolation``
(:class:`mhctool.spread.case_isolation.Isolation`) and ``sharding``
(:class:`mhctool.spread.sharded.Sharding`) are objects the caller hands it, whose methods it calls.
"""
from __future__ import annotations

import json
import math
import os
import time

import torch

from mhctool.core import profile
from mhctool.core.verdict import VerdictRule
from mhctool.families import Family, generate, get_family
from mhctool.registry.builtin import native_impl
from mhctool.registry.impl import Impl
from mhctool.runner.baseline import (
    Baseline,
    sharded_timeout,
    judged_rows,
    make_baseline,
)
from mhctool.runner.call import (
    cast_case_inputs,
    contract_grads,
    declared_inputs,
    output_specs,
    run_impl,
)
from mhctool.runner.case import Case, CaseResult, row_fields
from mhctool.runner.checks import CaseChecks


def run_case(case: Case, impls: list[Impl], rule: VerdictRule | None = None,
             matmul_precision: str = "ieee", isolation=None,
             conventions: dict | None = None, checks: tuple[str, ...] = (), repeats: int = 3,
             sharding=None, input_dtypes: dict | None = None) -> CaseResult:
    """:func:`_run_case`, its phases timed (``CaseResult.timings``, :mod:`mhctool.core.profile`)."""
    t0 = time.perf_counter()
    with profile.case() as timings:
        result = _run_case(case, impls, rule, matmul_precision, isolation, conventions, checks, repeats, sharding,
                           input_dtypes)
    rest = time.perf_counter() - t0 - sum(timings.values())
    result.timings = profile.add(timings, {profile.REST: max(0.0, rest)})
    return result


def _run_case(case: Case, impls: list[Impl], rule: VerdictRule | None = None,
              matmul_precision: str = "ieee", isolation=None,
              conventions: dict | None = None, checks: tuple[str, ...] = (), repeats: int = 3,
              sharding=None, input_dtypes: dict | None = None) -> CaseResult:
    """Run every implementation of ``impls`` on one case; the native one always runs (baseline).

    With ``isolation``, every implementation but the native one runs in a worker process. An
    external implementation computes its declared convention (an adapter's, overridden by
    ``conventions`` from ``--convention``): the float64 reference and the native baseline it is
    judged against compute the same convention. ``checks`` (:data:`mhctool.runner.checks.CHECKS`): also compare
    bits across ``repeats`` runs (determinism) and across batch sizes (batch invariance), for
    every implementation and the float64 reference. ``sharding`` (:class:`sharded.Sharding`):
    every implementation, the native baseline too, runs on the case's tokens split over ranks, its
    parameter gradients all-reduced (:mod:`mhctool.spread.sharded`). ``input_dtypes`` (``--input-dtypes``):
    input name -> ``activation`` or a format name, the dtypes an external implementation takes its
    inputs in (:func:`declared_inputs`)."""
    rule = rule or VerdictRule()
    fam = get_family(case.kernel)
    knobs = case.knob_dict
    def inputs():
        with profile.phase("inputs"):
            shape, raw = generate(case.kernel, case.family, case.shape, case.seed, knobs,
                                             draw_on=case.device)
            cast = cast_case_inputs(fam, raw, case)
            if case.device.startswith("cuda"):  # the draws are asynchronous: the phase waits for them
                torch.cuda.synchronize()
            return shape, cast

    if sharding is not None:  # the ranks start (the first case, or after one died) while the inputs are drawn
        with profile.phase(profile.RANKS):
            sharding.start()
    shape, base = inputs()
    result = CaseResult(case, shape)
    baselines: dict[tuple, Baseline] = {}
    references: dict[str, tuple] = {}  # the float64 reference depends on the knobs, not the precision

    def baseline(precision: str, eff: dict, rounded: dict | None = None, cast: dict | None = None) -> "Baseline":
        knobs_key = json.dumps([eff, cast or {}], sort_keys=True, default=str)
        if (precision, knobs_key) not in baselines:
            baselines[precision, knobs_key] = make_baseline(fam, case, rounded or base, eff, precision, references,
                                                            knobs_key, sharding=sharding)
        return baselines[precision, knobs_key]

    if sharding is not None:
        with profile.phase(profile.RANKS):  # what is left of their start once the inputs are drawn
            sharding.group()
        few = sharding.too_few_tokens(case.kernel, base)
        if few:
            result.rows.append({**row_fields(case, shape, native_impl(case.kernel), "ieee", knobs, sharding),
                                "direction": "fwd", "tensor": "*", "metric": "unsupported", "value": math.nan,
                                "threshold": None, "passed": None, "rule": "unsupported", "message": few})
            return result
    nat_base = baseline("ieee", knobs)
    nat = nat_base.native
    repro = CaseChecks(fam, case, shape, base, nat_base, checks, repeats) if checks else None
    if repro is not None:
        result.rows.extend(repro.reference_rows(knobs))
    ordered = [native_impl(case.kernel)] + [i for i in impls if not i.native]
    for impl in ordered:
        external = impl.backend == "external"
        declared = impl.precision_on(case.device)
        prec = matmul_precision if external and declared == "ieee" else declared
        eff = {**knobs, **impl.conventions, **(conventions or {})} if external else knobs
        row_base = row_fields(case, shape, impl, prec, eff, sharding)
        why = (impl.unsupported(case.device, case.dtype) or (impl.limit and impl.limit(shape)) or impl.refuses(eff)
               or _knob_gap(fam, impl, eff, set(impl.conventions) | set(conventions or {}) if external else set()))
        if why:
            result.rows.append({**row_base, "direction": "fwd", "tensor": "*", "metric": "unsupported",
                                "value": math.nan, "threshold": None, "passed": None,
                                "rule": "unsupported", "message": why})
            continue
        cast = (input_dtypes or {}) if external else {}
        given, rounded = declared_inputs(base, cast, case.dtype) if cast else (base, None)
        judged = baseline(prec, eff, rounded, cast)
        if impl.native:
            res = nat
        else:
            with profile.phase(profile.call_name(impl.name, (impl.name, case.kernel, case.dtype, case.device))):
                if sharding is not None:
                    res = sharding.run(case.kernel, impl, given, eff, judged.upstream,
                                      sharded_timeout(case, external), expect=output_specs(nat.outputs))
                elif isolation is not None and isolation.isolates(impl):
                    res = isolation.run(case, impl, given, eff, judged.upstream, output_specs(nat.outputs))
                else:
                    res = run_impl(fam, impl, given, eff, lambda outs: judged.upstream,
                                   expect=output_specs(nat.outputs))
        if cast:
            res = contract_grads(res, base)
        if res.failure == "lost" and isolation is not None and isolation.interrupted():
            result.abandoned = True
            return result
        if res.failure not in (None, "stopped"):  # a worker that died may have written through the memory it shared
            _, base = inputs()
            if repro is not None:
                repro.base = base
        if res.fwd_refused:
            result.rows.append({**row_base, "direction": "fwd", "tensor": "*", "metric": "unsupported",
                                "value": math.nan, "threshold": None, "passed": None, "rule": "unsupported",
                                "message": f"it refuses this case (a limit it states; judged at the others): "
                                           f"{res.fwd_refused}"})
            continue
        if res.fwd_lost:  # a fault of the backward, placed there (its forward's outputs went with it)
            result.rows.append({**row_base, "direction": "fwd", "tensor": "*", "metric": "not_judged",
                                "value": math.nan, "threshold": None, "passed": None, "rule": "cuda",
                                "message": res.fwd_lost})
            result.rows.append({**row_base, "direction": "bwd", "tensor": "*", "metric": "error",
                                "value": math.nan, "threshold": None, "passed": False, "rule": "cuda",
                                "message": res.bwd_error})
            continue
        if res.fwd_error:
            for direction in ("fwd", "bwd"):
                msg = res.fwd_error if direction == "fwd" or res.failure == "stopped" else "not run: the forward failed"
                result.rows.append({**row_base, "direction": direction, "tensor": "*",
                                    "metric": "error", "value": math.nan, "threshold": None,
                                    "passed": False, "rule": res.failure or "raised", "message": msg})
            continue
        with profile.phase("judging"):
            result.rows.extend(judged_rows(judged, res, row_base, rule, case.dtype, impl.native))
        if repro is not None and not res.bwd_error:
            def again(b, ups, expect, impl=impl, eff=eff):
                if impl.native:
                    return run_impl(fam, native_impl(case.kernel), b, eff, lambda outs: ups)
                if isolation is not None and isolation.isolates(impl):
                    return isolation.run(case, impl, b, eff, ups, expect)
                return run_impl(fam, impl, b, eff, lambda outs: ups, expect=expect)
            with profile.phase("checks (determinism, batch invariance)"):
                result.rows.extend(repro.rows(row_base, res, judged.upstream, again,
                                              gated=any(impl is i for i in impls)))
        if res.bwd_unsupported or res.bwd_error:
            result.rows.append({**row_base, "direction": "bwd", "tensor": "*",
                                "metric": "unsupported" if res.bwd_unsupported else "error",
                                "value": math.nan, "threshold": None,
                                "passed": None if res.bwd_unsupported else False,
                                "rule": "unsupported" if res.bwd_unsupported else res.failure or "raised",
                                "message": res.bwd_unsupported or res.bwd_error})
    if case.device == "cuda" and gives_memory_back(isolation, sharding):
        torch.cuda.empty_cache()
    return result


def gives_memory_back(isolation, sharding) -> bool:
    """Whether a GPU case hands its cached memory back to the driver at its end: only where
    another process may want it (isolation workers started beside this process, ranks, pool
    workers sharing a GPU: ``MHCTOOL_SHARED_GPU=1``, which the pool sets for them). A process
    alone on its GPU keeps it for the next case, as PyTorch does (its allocator hands the cache
    back itself before it would run out of memory). Given back and taken again case after case, the paper
    scenario (Triton, ``--no-isolate``) took 6.7-7.2 s on one H200 of a four-H200 host, kept
    5.3-5.4 s, the same rows; over four processes on the four GPUs, 2.5-3.0 s summed went to it."""
    return (bool(isolation is not None and isolation.workers) or sharding is not None
            or os.environ.get("MHCTOOL_SHARED_GPU") == "1")



def _knob_gap(fam: Family, impl: Impl, knobs: dict, declared: set = frozenset()) -> str | None:
    """A knob the implementation cannot take (it ignores it), set to a value other than its
    default: judging it at that value would judge what it never computed. Knobs its declared
    convention fixes are what it computes by construction."""
    for name, value in knobs.items():
        if name in declared:
            continue
        knob = fam.knobs[name]
        if knob.passed and not impl.accepts(name) and value != knob.default:
            how = (f"; declare the value it runs with --convention {name}=VALUE to judge it (mhctool identify "
                   "finds it)") if name in fam.conventions else ""
            return f"{impl.name} takes no {name} parameter, so it ignores {name}={value!r}: not judged at it{how}"
    return None
