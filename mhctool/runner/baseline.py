"""What an implementation is judged against: the native run at the implementation's precision and
conventions and the float64 reference, computed once a case; and the judged rows."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mhctool.core import profile
from mhctool.core.dtypes import FORMATS, fmt_of
from mhctool.core.metrics import Reference, mask_mismatch, measure
from mhctool.core.metrics import (
    reference as reference_facts,  # make_baseline's `reference`: the float64 function
)
from mhctool.core.verdict import VerdictRule
from mhctool.families import Family
from mhctool.registry.impl import Impl
from mhctool.runner.call import (
    leaf_inputs,
    named_tensors,
    native_at,
    output_specs,
    run_impl,
    run_reference,
    upstream_for,
)
from mhctool.runner.case import Case, ImplResult, default_timeout, footprint


def judged_rows(judged: "Baseline", res: ImplResult, row_base: dict, rule: VerdictRule, dtype: str,
                native: bool = False) -> list[dict]:
    """One row per (direction, tensor, metric) of ``res`` measured against the float64 reference
    of ``judged`` and judged by ``rule`` against its native run (``native``: ``res`` is that run,
    judged by the baseline tolerance)."""
    rows = []
    fwd, bwd = judged.measured(res)
    nat_fwd, nat_bwd = judged.native_metrics
    outs = named_tensors(judged.fam, res.outputs, res.grads)
    for direction, vals, nat_vals in (("fwd", fwd, nat_fwd), ("bwd", bwd, nat_bwd)):
        for tensor, metrics in vals.items():
            amax = judged.fact(tensor).amax
            fmt = fmt_of(outs[tensor].dtype)
            for metric, value in metrics.items():
                j = rule.judge(metric, value, fmt, amax, None if native else nat_vals[tensor],
                               FORMATS[dtype], outs[tensor].numel(), judged.term_scale.get(tensor))
                rows.append({**row_base, "direction": direction, "tensor": tensor,
                             "dtype_out": res.returned.get(tensor, fmt.name),
                             "metric": metric, "value": value,
                             "threshold": j.threshold, "passed": j.passed,
                             "rule": j.rule, "message": None})
    return rows


@dataclass
class Baseline:
    """What an implementation is judged against for one (matmul precision, knobs): the native
    implementation's run and metrics, the float64 reference's outputs and gradients."""

    fam: Family
    native: ImplResult
    upstream: list
    ref_outs: list
    ref_grads: dict
    term_scale: dict
    native_metrics: tuple = ()
    facts: dict = field(default_factory=dict)  # metrics.Reference by tensor name, worked out once
    branches: dict = field(default_factory=dict)  # output -> (kept branch, mask): Family.branches

    def fact(self, tensor: str) -> Reference:
        if tensor not in self.facts:
            refs = named_tensors(self.fam, self.ref_outs, self.ref_grads)
            self.facts[tensor] = reference_facts(refs[tensor])
        return self.facts[tensor]

    def measured(self, res: ImplResult):
        """Every metric of ``res``'s outputs and gradients (the native run's: measured once, when
        the baseline is made, and kept)."""
        if res is self.native and self.native_metrics:
            return self.native_metrics
        fwd = {n: measure(o, r, self.fam.name == "sinkhorn", self.fact(n))
               for n, o, r in zip(self.fam.outputs, res.outputs or [], self.ref_outs)}
        for n, (branch, kept) in self.branches.items():
            if n in fwd:
                native = self.native_metrics[0][n] if self.native_metrics else fwd[n]
                o, r = (res.outputs[self.fam.outputs.index(n)],
                        self.ref_outs[self.fam.outputs.index(n)])
                fwd[n]["mask_mismatch"] = mask_mismatch(o, r, branch, kept, native["max_abs"], self.fact(n).amax)
        bwd = {f"grad_{k}": measure(g, self.ref_grads[k], of=self.fact(f"grad_{k}"))
               for k, g in (res.grads or {}).items()}
        return fwd, bwd


def make_baseline(fam: Family, case: Case, base: dict, knobs: dict, precision: str = "ieee",
                  references: dict | None = None, knobs_key: str = "", native_impl_: Impl | None = None,
                  reference=None, sharding=None) -> Baseline:
    """The native run and the float64 reference of one case under ``knobs``; ``references`` caches
    the reference by ``knobs_key`` across precisions. ``native_impl_`` and ``reference``: other
    native and float64 functions of the family's signature (mhctool identify's variants that are
    no family knob); the defaults are the family's."""
    references = {} if references is None else references
    first = ("native", case.kernel, precision, case.dtype, case.device)
    if sharding is None:
        made: list = []  # the upstream gradients the native backward took: drawn once (a paper-shape set is GBs)

        def upstream_of(outs):
            made.append(upstream_for(fam, outs, case.seed))
            return made[-1]
        with profile.phase(profile.call_name("native (the baseline)", first, "first call in the process")):
            native = run_impl(fam, native_impl_ or native_at(case.kernel, precision), base, knobs, upstream_of)
            if native.fwd_error or native.outputs is None:
                raise RuntimeError(f"the native {case.kernel} failed on {case.family}: {native.fwd_error}")
            # seeded from shapes: the same at every precision (the native backward does not write into them)
            upstream = made[0] if made else upstream_for(fam, native.outputs, case.seed)
    else:  # the baseline is the native implementation sharded the same way
        if native_impl_ is not None:
            raise ValueError("a sharded baseline runs the family's native implementation (the ranks resolve "
                             "it by precision); native_impl_ is for identify's unsharded variants")
        with profile.phase(profile.call_name("native (the baseline)", first, "first call in the process")):
            # the upstream gradients are drawn from the whole batch's output shapes, which the native
            # forward on the first token row gives (no whole-batch run in this process: it took
            # 2.5 of a sharded run's 12.6 s on two H200s)
            shapes = sharding.whole_batch_outputs(fam, case.kernel, native_at(case.kernel, precision), base, knobs)
            upstream = upstream_for(fam, shapes, case.seed)
            pending = sharding.submit(case.kernel, native_at(case.kernel, precision), base, knobs, upstream,
                                      native_precision=precision, expect=output_specs(shapes))
        try:  # the ranks run it while this process computes the float64 reference, where both fit
            if sharding.overlaps(case):
                _reference(fam, base, knobs, upstream, references, knobs_key, reference)
        finally:  # waited for even where the reference failed: the next job's answers come after it
            with profile.phase("native (the baseline)"):
                native = sharding.collect(pending, sharded_timeout(case))
        if native.fwd_error or native.bwd_error:
            raise RuntimeError(f"the native {case.kernel} failed on {case.family} over {sharding.ranks} ranks: "
                               f"{native.fwd_error or native.bwd_error}")
    _reference(fam, base, knobs, upstream, references, knobs_key, reference)
    ref_outs, ref_grads, term_scale, branches = references[knobs_key]
    b = Baseline(fam, native, upstream, ref_outs, ref_grads, term_scale, branches=branches)
    with profile.phase("judging"):
        b.native_metrics = b.measured(native)
    return b


def _reference(fam: Family, base: dict, knobs: dict, upstream: list, references: dict, knobs_key: str,
               reference=None) -> None:
    """The float64 reference under ``knobs`` into ``references`` (once per ``knobs_key``)."""
    if knobs_key not in references:
        with profile.phase("float64 reference"):
            ref_outs, ref_grads = run_reference(fam, base, knobs, upstream, reference)
            term_scale, branches = {}, {}
            if fam.term_scale is not None:
                term_scale = fam.term_scale(leaf_inputs(fam, base, torch.float64), [u.double() for u in upstream], knobs)
            if fam.branches is not None:
                branches = fam.branches(leaf_inputs(fam, base, torch.float64), knobs)
        references[knobs_key] = (ref_outs, ref_grads, term_scale, branches)


def sharded_timeout(case: Case, external: bool = False) -> float:
    return default_timeout(footprint(case), case.device, external)
