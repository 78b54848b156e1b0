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

from mhctool.core import inputs as inputs_mod
from mhctool.core import profile
from mhctool.core.shapes import Shape
from mhctool.core.verdict import VerdictRule
from mhctool.registry.builtin import native_impl
from mhctool.registry.families import Family, get_family
from mhctool.registry.impl import Impl
from mhctool.runner.baseline import (
    _Baseline,
    _sharded_timeout,
    judged_rows,
    make_baseline,
)
from mhctool.runner.call import (
    _cast_inputs,
    contract_grads,
    declared_inputs,
    named_tensors,
    output_specs,
    run_impl,
    run_reference,
    short_error,
)
from mhctool.runner.case import Case, CaseResult, ImplResult, device_memory, footprint


def run_case(case: Case, impls: list[Impl], rule: VerdictRule | None = None,
             matmul_precision: str = "ieee", isolation=None,
             conventions: dict | None = None, checks: tuple[str, ...] = (), repeats: int = 3,
             sharding=None, input_dtypes: dict | None = None) -> CaseResult:
    """:func:`_run_case`, its phases timed (``CaseResult.timings``, :mod:`mhctool.profile`)."""
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
    judged against compute the same convention. ``checks`` (:data:`repro.CHECKS`): also compare
    bits across ``repeats`` runs (determinism) and across batch sizes (batch invariance), for
    every implementation and the float64 reference. ``sharding`` (:class:`sharded.Sharding`):
    every implementation, the native baseline too, runs on the case's tokens split over ranks, its
    parameter gradients all-reduced (:mod:`mhctool.sharded`). ``input_dtypes`` (``--input-dtypes``):
    input name -> ``activation`` or a format name, the dtypes an external implementation takes its
    inputs in (:func:`declared_inputs`)."""
    rule = rule or VerdictRule()
    fam = get_family(case.kernel)
    knobs = case.knob_dict
    def inputs():
        with profile.phase("inputs"):
            shape, raw = inputs_mod.generate(case.kernel, case.family, case.shape, case.seed, knobs,
                                             draw_on=case.device)
            cast = _cast_inputs(fam, raw, case)
            if case.device.startswith("cuda"):  # the draws are asynchronous: the phase waits for them
                torch.cuda.synchronize()
            return shape, cast

    if sharding is not None:  # the ranks start (the first case, or after one died) while the inputs are drawn
        with profile.phase(profile.RANKS):
            sharding.start()
    shape, base = inputs()
    result = CaseResult(case, shape)
    baselines: dict[tuple, _Baseline] = {}
    references: dict[str, tuple] = {}  # the float64 reference depends on the knobs, not the precision

    def baseline(precision: str, eff: dict, rounded: dict | None = None, cast: dict | None = None) -> "_Baseline":
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
            result.rows.append({**_row_base(case, shape, native_impl(case.kernel), "ieee", knobs, sharding),
                                "direction": "fwd", "tensor": "*", "metric": "unsupported", "value": math.nan,
                                "threshold": None, "passed": None, "rule": "unsupported", "message": few})
            return result
    nat_base = baseline("ieee", knobs)
    nat = nat_base.native
    repro = _Repro(fam, case, shape, base, nat_base, checks, repeats) if checks else None
    if repro is not None:
        result.rows.extend(repro.reference_rows(knobs))
    ordered = [native_impl(case.kernel)] + [i for i in impls if not i.native]
    for impl in ordered:
        external = impl.backend == "external"
        declared = impl.precision_on(case.device)
        prec = matmul_precision if external and declared == "ieee" else declared
        eff = {**knobs, **impl.conventions, **(conventions or {})} if external else knobs
        row_base = _row_base(case, shape, impl, prec, eff, sharding)
        why = (impl.unsupported(case.device, case.dtype) or (impl.limit and impl.limit(shape))
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
                                      _sharded_timeout(case, external), expect=output_specs(nat.outputs))
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
        if res.failure is not None:  # a worker that died may have written through the memory it shared
            _, base = inputs()
            if repro is not None:
                repro.base = base
        if res.fwd_refused:
            result.rows.append({**row_base, "direction": "fwd", "tensor": "*", "metric": "unsupported",
                                "value": math.nan, "threshold": None, "passed": None, "rule": "unsupported",
                                "message": f"it refuses this case (a limit it states; judged at the others): "
                                           f"{res.fwd_refused}"})
            continue
        if res.fwd_error:
            for direction in ("fwd", "bwd"):
                msg = res.fwd_error if direction == "fwd" else "not run: the forward failed"
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
                                "rule": "unsupported" if res.bwd_unsupported else "raised",
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


class _Repro:
    """The determinism and batch-invariance checks of one case (mhctool.repro): reruns of each
    implementation on the same inputs, and runs on the batch variants of the case."""

    def __init__(self, fam: Family, case: Case, shape: Shape, base: dict, nat_base: "_Baseline",
                 checks: tuple[str, ...], repeats: int):
        from mhctool.runner import checks as repro
        self.fam, self.case, self.shape, self.base, self.checks, self.repeats = fam, case, shape, base, checks, repeats
        self.total = repro.token_count(fam, base) if fam.name in repro.TOKEN_DIMS else None
        self.note = repro.CPU_NOTE if case.device == "cpu" else None
        self.batch = "batch-invariance" in checks and bool(self.total)
        self.upstream = nat_base.upstream
        self.out_specs = output_specs(nat_base.native.outputs)

    def variants(self):
        """The batch variants with the outputs' expected layout (from the native run of each),
        built when needed and dropped after: at the paper shape one of them is as large as the case."""
        from mhctool.runner import checks as repro
        case, fam = self.case, self.fam
        _, raw = inputs_mod.generate(case.kernel, case.family, case.shape, case.seed + 1, case.knob_dict,
                                     draw_on=case.device)
        others = _cast_inputs(fam, raw, case)
        del raw
        others_up = inputs_mod.upstream_grads([torch.empty(sh, dtype=dt, device=dev) for sh, dt, dev in self.out_specs],
                                              case.seed + 1)
        vs = repro.variants(fam, self.base, self.upstream, others, others_up)
        del others, others_up
        native = native_impl(case.kernel)
        while vs:
            v = vs.pop(0)
            r = run_impl(fam, native, v.base, case.knob_dict, lambda outs, v=v: v.upstream)
            expect = output_specs(r.outputs) if r.outputs is not None else None
            del r
            yield v, expect

    def _named(self, res: ImplResult) -> dict[str, torch.Tensor]:
        return named_tensors(self.fam, res.outputs, res.grads)

    def rows(self, row_base: dict, first: ImplResult, upstream: list, again, gated: bool = True) -> list[dict]:
        """The check rows of one implementation; ``gated`` False: recorded, never failing (the
        baseline and the reference, when they are not the implementations under test). A check
        that cannot run (out of memory, an error of mhctool's own) is one failed row, never a crash."""
        try:
            out = self._rows(row_base, first, upstream, again)
        except Exception as e:  # noqa: BLE001 - the run goes on
            if self.case.device == "cuda":
                torch.cuda.empty_cache()
            out = [{**row_base, "direction": "fwd", "tensor": "*", "metric": "error", "value": math.nan,
                    "threshold": None, "passed": False, "rule": "/".join(self.checks),
                    "message": f"the reproducibility check could not run: {short_error(e)}"}]
        if self.case.device == "cuda":
            torch.cuda.empty_cache()
        if not gated:
            for r in out:
                if r["passed"] is False:
                    r["message"] = f"(baseline, not gated) {r['message']}"
                r["passed"] = None
        return out

    def _rows(self, row_base: dict, first: ImplResult, upstream: list, again) -> list[dict]:
        from mhctool.runner import checks as repro
        out = []
        full = self._named(first)
        # batch invariance needs a second run of the same batch too: a tensor that differs run to
        # run cannot be judged across batch sizes. Each run is compared, then dropped.
        reruns = self.repeats - 1 if "determinism" in self.checks else (1 if self.batch else 0)
        tallies = {n: repro.Tally(t) for n, t in full.items()}
        error = None
        for _ in range(reruns):
            r = again(self.base, upstream, output_specs(first.outputs))
            if r.fwd_error or r.bwd_error:
                error = r.fwd_error or r.bwd_error
                break
            for n, t in self._named(r).items():
                tallies[n].add(t)
            del r
        unsteady = {n for n, t in tallies.items() if t.fraction}
        if "determinism" in self.checks:
            if error:
                out.append({**row_base, "direction": "fwd", "tensor": "*", "metric": "nondeterministic",
                            "value": math.nan, "threshold": 0.0, "passed": False, "rule": "determinism",
                            "message": f"a repeated run failed: {error}"})
            else:
                out.extend(repro.determinism_rows(row_base, tallies, self.repeats, self.note))
        del tallies
        if self.batch:
            results = []
            for v, expect in self.variants():
                if expect is None:
                    results.append((v, None, "the native implementation failed on it"))
                    continue
                r = again(v.base, v.upstream, expect)
                err = r.fwd_error or r.bwd_error
                results.append((v, None if err else repro.compare_batch(self.fam, full, v, self._named(r)), err))
                v.base = v.upstream = None  # keep the label and positions only
                del r
            out.extend(repro.batch_rows(row_base, self.fam, full, self.total, results, unsteady))
        return out

    def reference_rows(self, knobs: dict) -> list[dict]:
        """The float64 reference under the same checks: is PyTorch itself reproducible here?"""
        ref = Impl("float64", self.case.kernel, "reference", self.fam.reference)
        row_base = _row_base(self.case, self.shape, ref, "ieee", knobs)
        if 3 * footprint(self.case) > device_memory(self.case.device):
            return [{**row_base, "direction": "fwd", "tensor": "*", "metric": "unsupported", "value": math.nan,
                     "threshold": None, "passed": None, "rule": "unsupported",
                     "message": "the float64 reference is not rerun at this shape: three copies do not fit"}]

        def again(b, ups, expect):
            outs, grads = run_reference(self.fam, b, knobs, ups)
            return ImplResult(outputs=outs, grads=grads)
        return self.rows(row_base, again(self.base, self.upstream, None), self.upstream, again, gated=False)


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


def _row_base(case: Case, shape: Shape, impl: Impl, precision: str, knobs: dict, sharding=None) -> dict:
    return {
        "scenario": case.scenario, "case_id": case.case_id, "kernel": case.kernel,
        "impl": impl.name, "backend": impl.backend, "precision": precision,
        "family": case.family, "dtype": case.dtype, "dtype_out": None, "shape": str(shape),
        "knobs": json.dumps(knobs, sort_keys=True), "seed": case.seed, "device": case.device,
        **(sharding.row() if sharding is not None else {}),
    }
