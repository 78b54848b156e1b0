"""Case -> run the implementations and the float64 reference, forward and backward -> rows."""
from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import time
from dataclasses import dataclass, field, replace

import torch

from . import inputs as inputs_mod
from .dtypes import FORMATS, dtype_named, fmt_of
from .errors import UsageError
from .isolation import system_exit_message
from .metrics import Reference, measure
from .metrics import reference as reference_facts  # make_baseline's `reference` is the float64 function
from . import cuda_context
from . import profile
from .poison import poisoning
from .registry import MATMUL_KERNELS, Family, Impl, get_family, native_impl
from .shapes import Shape
from .verdict import VerdictRule


@dataclass(frozen=True)
class Case:
    kernel: str
    family: str  # input family
    dtype: str
    shape: Shape
    knobs: tuple  # sorted (name, value) pairs
    seed: int
    device: str = "cpu"
    scenario: str = "cli"

    @property
    def knob_dict(self) -> dict:
        return dict(self.knobs)

    @property
    def knobs_json(self) -> str:
        return json.dumps(self.knob_dict, sort_keys=True)

    @property
    def case_id(self) -> str:
        key = f"{self.kernel}|{self.family}|{self.dtype}|{self.shape}|{self.knobs_json}|{self.seed}"
        return hashlib.sha1(key.encode()).hexdigest()[:12]


@dataclass
class ImplResult:
    outputs: list[torch.Tensor] | None = None
    grads: dict[str, torch.Tensor] | None = None
    fwd_error: str | None = None
    fwd_refused: str | None = None  # an outside implementation refused the case (a limit it states)
    bwd_error: str | None = None
    bwd_unsupported: str | None = None
    returned: dict[str, str] = field(default_factory=dict)  # output -> dtype it came back in, where converted
    failure: str | None = None  # what the code under test did to its process (isolation: crash, timeout, ...)

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass
class CaseResult:
    case: Case
    shape: Shape  # after the input family's reshape
    rows: list[dict] = field(default_factory=list)
    abandoned: bool = False  # an isolated implementation was stopped because the run was interrupted
    timings: dict = field(default_factory=dict)  # phase -> seconds (mhctool.profile)


# exception classes (by name or by the module they come from) that mean "this implementation does
# not take this case": an assert on a shape or a dtype, a kernel compiler refusing the shape
_LIMIT_TYPES = (AssertionError, NotImplementedError)
_COMPILER_MODULES = ("tilelang", "tvm", "tvm_ffi", "triton.compiler", "cuda.tile")


def refusal(e: BaseException) -> bool:
    """True for an exception by which an outside implementation refuses a case it does not take
    (its own ``assert``, ``NotImplementedError``, or its kernel compiler's error at that shape), as
    opposed to a failure: the case is skipped with the implementation's own words and judged at
    the other shapes (an implementation refusing every case is still judged on nothing, a failure)."""
    if isinstance(e, _LIMIT_TYPES):
        return True
    for cls in type(e).__mro__:  # raised by a kernel compiler (not, say, torch.compile's failures)
        module = cls.__module__ or ""
        if any(module == m or module.startswith(m + ".") for m in _COMPILER_MODULES):
            return True
    return False


def short_error(e: BaseException) -> str:
    """The error in one line; compiler errors put the cause after the first line, so keep it."""
    lines = [ln.strip() for ln in f"{type(e).__name__}: {e}".splitlines() if ln.strip()]
    return " | ".join(lines)[:1500]


def _cast_inputs(fam: Family, raw: dict, case: Case) -> dict:
    return cast_inputs(fam, raw, case.dtype, case.device)


def cast_inputs(fam: Family, raw: dict, dtype: str, device: str) -> dict:
    """The family's inputs in call order: activations at ``dtype``, mapping tensors in fp32,
    integer tensors (token counts, masks) as generated; absent ones None."""
    act = FORMATS[dtype].torch_dtype
    out = {}
    for name in fam.inputs:
        t = raw.get(name)
        if t is None:
            out[name] = None
            continue
        if not t.is_floating_point():  # token counts, masks: as generated
            out[name] = t.to(device=device).contiguous()
            continue
        out[name] = t.to(dtype=torch.float32 if name in fam.mapping else act, device=device).contiguous()
    return out


def _leaf(fam: Family, base: dict, dtype=None) -> dict:
    out = {}
    for name, t in base.items():
        if t is None:
            out[name] = None
            continue
        if not t.is_floating_point():
            out[name] = t.detach().clone()
            continue
        t = t.detach().clone() if dtype is None else t.detach().to(dtype)
        out[name] = t.requires_grad_(name in fam.differentiable)
    return out


def _grad_inputs(fam: Family, args: dict) -> list[str]:
    return [k for k in fam.differentiable if args.get(k) is not None]


def run_reference(fam: Family, base: dict, knobs: dict, upstream: list[torch.Tensor], fn=None):
    """The float64 reference (``fn``: another function of the family's signature) and its gradients."""
    args = _leaf(fam, base, torch.float64)
    outs = fam.call(fn or fam.reference, args, knobs, lambda k: True)
    names = _grad_inputs(fam, args)
    if fam.forward_only or not names:
        return [o.detach() for o in outs], {}
    # autograd's device thread gets the context first (under --ranks this is the process's first
    # backward on the GPU, and cuBLAS warned that it had none)
    grads = torch.autograd.grad(cuda_context.bound(list(outs)), [args[k] for k in names],
                                [u.double() for u in upstream])
    return [o.detach() for o in outs], dict(zip(names, grads))


def run_impl(fam: Family, impl: Impl, base: dict, knobs: dict, upstream_fn, expect=None) -> ImplResult:
    """Forward, then backward with the upstream gradients ``upstream_fn(outputs)``. ``expect``:
    the contract's (shape, dtype, device) per output; outputs are conformed to it by value."""
    res = ImplResult()
    args = _leaf(fam, base)
    try:
        with poisoning(True):
            outs = list(fam.call(impl.fn, args, knobs, impl.accepts, impl.bind))
    except SystemExit as e:  # code under test never decides mhctool's exit code
        res.fwd_error = system_exit_message(e)
        return res
    except Exception as e:  # an implementation that raises is a failed case, not a crash
        res.fwd_error = short_error(e)
        if impl.backend == "external" and refusal(e):
            res.fwd_refused = res.fwd_error  # parity skips it; elsewhere it is an error as before
        return res
    if expect is not None:
        outs, problem = conform_outputs(fam, outs, expect, res.returned)
        if problem:
            res.fwd_error = problem
            return res
    res.outputs = [o.detach() for o in outs]
    if fam.forward_only:
        return res
    outs = cuda_context.bound(outs)  # autograd's device thread gets the context before the impl's backward
    names = _grad_inputs(fam, args)
    if not any(o.requires_grad for o in outs):
        res.bwd_unsupported = "no backward: its outputs carry no autograd graph"
        return res
    try:
        with poisoning(True):
            grads = torch.autograd.grad(
                [o for o in outs if o.requires_grad],
                [args[k] for k in names],
                [u for o, u in zip(outs, upstream_fn(outs)) if o.requires_grad],
                allow_unused=True,
            )
    except SystemExit as e:
        res.bwd_error = system_exit_message(e)
        return res
    except Exception as e:
        if impl.backend == "external" and refusal(e):
            res.bwd_unsupported = f"its backward refuses this case: {short_error(e)}"
        else:
            res.bwd_error = short_error(e)
        return res
    missing = [k for k, g in zip(names, grads) if g is None]
    if missing:
        res.bwd_error = f"no gradient for {', '.join(missing)}"
        return res
    res.grads = {k: g.detach() for k, g in zip(names, grads)}
    return res


def named_tensors(fam: Family, outputs: list | None, grads: dict | None) -> dict[str, torch.Tensor]:
    """Outputs by the family's names and gradients as ``grad_<input>``: the report's tensor names."""
    return dict(zip(fam.outputs, outputs or [])) | {f"grad_{k}": g for k, g in (grads or {}).items()}


def output_specs(outs: list[torch.Tensor]) -> list[tuple]:
    """What the contract expects of each output: (shape, dtype, device), from the native outputs."""
    return [(tuple(o.shape), o.dtype, str(o.device)) for o in outs]


def conform_outputs(fam: Family, outs, expect: list[tuple], returned: dict) -> tuple[list, str | None]:
    """Outputs judged by value: a shape that differs from the contract's only by size-1 dimensions
    is reshaped, another floating dtype is converted to the contract's (its error is then judged
    by the contract's threshold: a lower precision is not excused) and named in ``returned``.
    What cannot be judged (count, non-tensor, element count, device, a non-float) is the problem."""
    required = len(expect) - len(fam.optional_outputs)
    if not required <= len(outs) <= len(expect):
        counted = f"{required} to {len(expect)}" if required < len(expect) else str(len(expect))
        return outs, f"returned {len(outs)} outputs, expected {counted} ({', '.join(fam.outputs)})"
    conformed = []
    for name, o, (shape, dtype, device) in zip(fam.outputs, outs, expect):
        if not isinstance(o, torch.Tensor):
            return outs, f"output {name} is {type(o).__name__}, not a tensor"
        if str(o.device) != device:
            return outs, f"output {name} is on {o.device}, expected {device}"
        if tuple(o.shape) != shape:
            if [d for d in o.shape if d != 1] != [d for d in shape if d != 1]:
                return outs, f"output {name} has shape {tuple(o.shape)}, expected {shape}"
            o = o.reshape(shape)
        if o.dtype != dtype:
            if not (o.is_floating_point() and dtype.is_floating_point):
                return outs, f"output {name} has dtype {o.dtype}, expected {dtype}"
            returned[name] = fmt_of(o.dtype).name
            o = o.to(dtype)
        conformed.append(o)
    return conformed, None


def isolated_impl(kernel: str, spec: str, name: str, base: dict, knobs: dict, upstream: list, expect: list) -> dict:
    """The job an isolation worker runs: resolve ``spec`` for ``kernel`` there, and run ``name``."""
    from .registry import resolve_one
    impl = resolve_one(kernel, spec, name)
    return run_impl(get_family(kernel), impl, base, knobs, lambda outs: upstream, expect).to_dict()


def native_at(kernel: str, precision: str) -> Impl:
    nat = native_impl(kernel)
    if precision == "ieee" or kernel not in MATMUL_KERNELS:
        return nat
    fn = functools.partial(nat.fn, matmul_precision=precision)
    return replace(nat, name=f"torch-{precision}", target=fn, _fn=fn, precision=precision)


def run_case(case: Case, impls: list[Impl], rule: VerdictRule | None = None,
             matmul_precision: str = "ieee", isolation: "Isolation | None" = None,
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
              matmul_precision: str = "ieee", isolation: "Isolation | None" = None,
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
        from . import sharded
        with profile.phase(profile.RANKS):  # what is left of their start once the inputs are drawn
            sharding.group()
        few = sharded.too_few_tokens(case.kernel, base, sharding)
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
                    from . import sharded
                    res = sharded.run(case.kernel, impl, given, eff, judged.upstream, sharding,
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


INPUT_DTYPES = ("activation", "fp32", "bf16", "fp16")


def declared_inputs(base: dict, cast: dict, dtype: str) -> tuple[dict, dict]:
    """(the inputs an implementation is given, the same values at the contract's dtypes): each
    input named in ``cast`` (name -> ``activation``, the case's dtype, or a format name) converted,
    so that the float64 reference and the native baseline see the values it sees (its rounding of
    an input is no error of its own)."""
    given, rounded = dict(base), dict(base)
    for name, want in cast.items():
        t = base.get(name)
        if t is None or not t.is_floating_point():
            continue
        given[name] = t.to(dtype_named(want, dtype))
        rounded[name] = given[name].to(t.dtype)
    return given, rounded


def contract_grads(res: ImplResult, base: dict) -> ImplResult:
    """Gradients of inputs given in another dtype, converted to the contract's (each judged by the
    contract's threshold: a lower precision is not excused), the dtype they came in recorded."""
    for name, g in (res.grads or {}).items():
        want = base[name].dtype
        if g.dtype != want:
            res.returned[f"grad_{name}"] = fmt_of(g.dtype).name
            res.grads[name] = g.to(want)
    return res


class _Repro:
    """The determinism and batch-invariance checks of one case (mhctool.repro): reruns of each
    implementation on the same inputs, and runs on the batch variants of the case."""

    def __init__(self, fam: Family, case: Case, shape: Shape, base: dict, nat_base: "_Baseline",
                 checks: tuple[str, ...], repeats: int):
        from . import repro
        self.fam, self.case, self.shape, self.base, self.checks, self.repeats = fam, case, shape, base, checks, repeats
        self.total = repro.token_count(fam, base) if fam.name in repro.TOKEN_DIMS else None
        self.note = repro.CPU_NOTE if case.device == "cpu" else None
        self.batch = "batch-invariance" in checks and bool(self.total)
        self.upstream = nat_base.upstream
        self.out_specs = output_specs(nat_base.native.outputs)

    def variants(self):
        """The batch variants with the outputs' expected layout (from the native run of each),
        built when needed and dropped after: at the paper shape one of them is as large as the case."""
        from . import repro
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
        from . import repro
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


def judged_rows(judged: "_Baseline", res: ImplResult, row_base: dict, rule: VerdictRule, dtype: str,
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
class _Baseline:
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
        bwd = {f"grad_{k}": measure(g, self.ref_grads[k], of=self.fact(f"grad_{k}"))
               for k, g in (res.grads or {}).items()}
        return fwd, bwd


def upstream_for(fam: Family, outputs: list, seed: int) -> list:
    """Seeded upstream gradients; zero for the family's optional outputs."""
    ups = inputs_mod.upstream_grads(outputs, seed)
    first_optional = len(fam.outputs) - len(fam.optional_outputs)
    return [u if i < first_optional else torch.zeros_like(u) for i, u in enumerate(ups)]


def make_baseline(fam: Family, case: Case, base: dict, knobs: dict, precision: str = "ieee",
                  references: dict | None = None, knobs_key: str = "", native_impl_: Impl | None = None,
                  reference=None, sharding=None) -> _Baseline:
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
        from . import sharded
        if native_impl_ is not None:
            raise ValueError("a sharded baseline runs the family's native implementation (the ranks resolve "
                             "it by precision); native_impl_ is for identify's unsharded variants")
        with profile.phase(profile.call_name("native (the baseline)", first, "first call in the process")):
            # the upstream gradients are drawn from the whole batch's output shapes, which the native
            # forward on the first token row gives (no whole-batch run in this process: it took
            # 2.5 of a sharded run's 12.6 s on two H200s)
            shapes = sharded.whole_batch_outputs(fam, case.kernel, native_at(case.kernel, precision), base, knobs)
            upstream = upstream_for(fam, shapes, case.seed)
            pending = sharded.submit(case.kernel, native_at(case.kernel, precision), base, knobs, upstream,
                                     sharding, native_precision=precision, expect=output_specs(shapes))
        try:  # the ranks run it while this process computes the float64 reference, where both fit
            if sharded.overlaps(case, sharding):
                _reference(fam, base, knobs, upstream, references, knobs_key, reference)
        finally:  # waited for even where the reference failed: the next job's answers come after it
            with profile.phase("native (the baseline)"):
                native = sharded.collect(pending, _sharded_timeout(case))
        if native.fwd_error or native.bwd_error:
            raise RuntimeError(f"the native {case.kernel} failed on {case.family} over {sharding.ranks} ranks: "
                               f"{native.fwd_error or native.bwd_error}")
    _reference(fam, base, knobs, upstream, references, knobs_key, reference)
    ref_outs, ref_grads, term_scale = references[knobs_key]
    b = _Baseline(fam, native, upstream, ref_outs, ref_grads, term_scale)
    with profile.phase("judging"):
        b.native_metrics = b.measured(native)
    return b


def _reference(fam: Family, base: dict, knobs: dict, upstream: list, references: dict, knobs_key: str,
               reference=None) -> None:
    """The float64 reference under ``knobs`` into ``references`` (once per ``knobs_key``)."""
    if knobs_key not in references:
        with profile.phase("float64 reference"):
            ref_outs, ref_grads = run_reference(fam, base, knobs, upstream, reference)
            term_scale = {}
            if fam.term_scale is not None:
                term_scale = fam.term_scale(_leaf(fam, base, torch.float64), [u.double() for u in upstream], knobs)
        references[knobs_key] = (ref_outs, ref_grads, term_scale)


def _sharded_timeout(case: Case, external: bool = False) -> float:
    from .isolation import default_timeout
    return default_timeout(footprint(case), case.device, external)


@dataclass
class Isolation:
    """Implementations under test run in worker processes (one per implementation, replaced after
    a crash, a fatal CUDA error or a time-out), so what they do to a process becomes a failed row.
    ``case_timeout`` None: :func:`isolation.default_timeout` of each case's footprint."""

    transport: str = "shm"
    case_timeout: float | None = None
    interrupted: object = staticmethod(lambda: False)
    workers: dict = field(default_factory=dict)
    own: bool = True  # False: mhctool's own implementations run in this process (a pool worker's first run of a case)

    def isolates(self, impl: Impl) -> bool:
        """Whether ``impl`` runs in a worker of its own: every one, or with ``own`` False the external ones."""
        return self.own or impl.backend == "external"

    def call(self, impl: Impl, target: str, args: tuple, footprint_bytes: float, device: str):
        """Run ``target(*args)`` in ``impl``'s worker (started on first use) under the case time limit."""
        from . import isolation as iso
        worker = self.workers.get(impl.name)
        if worker is None:
            worker = self.workers[impl.name] = iso.Worker(self.transport)
        timeout = self.case_timeout or iso.default_timeout(footprint_bytes, device, impl.backend == "external")
        return worker.call(target, args, timeout=timeout, interrupted=self.interrupted)

    def run(self, case: Case, impl: Impl, base: dict, knobs: dict, upstream: list, expect: list) -> ImplResult:
        value, failure = self.call(impl, "mhctool.runner:isolated_impl",
                                   (case.kernel, impl.spec or impl.name, impl.name, base, knobs, upstream, expect),
                                   footprint(case), case.device)
        if failure is not None:
            return ImplResult(fwd_error=failure.message, failure=failure.kind)
        return ImplResult(**value)

    def close(self) -> None:
        for w in self.workers.values():
            w.stop()
        self.workers.clear()


def check_runnable(impls: dict[str, list[Impl]], targets) -> None:
    """Implementations asked for by name: one that can run none of the ``targets`` (cases, or
    anything with ``kernel``, ``device`` and ``dtype``) is a UsageError naming the reason; one that
    runs some of them is skipped, with the reason, on the others (parity and bench alike)."""
    reasons: dict[str, str] = {}
    runnable: set[str] = set()
    for c in targets:
        for i in impls.get(c.kernel, []):
            key = i.spec or i.name  # what was asked for: a library spec stands for all it offers
            why = i.unsupported(c.device, c.dtype)
            if why is None:
                runnable.add(key)
            else:
                reasons.setdefault(key, why)
    for name, why in reasons.items():
        if name not in runnable:
            kernels = sorted({c.kernel for c in targets})
            raise UsageError(f"--impl {name} cannot run {', '.join(kernels)} here: {why}")


def footprint(case: Case) -> float:
    """Bytes a parity case needs at the least: the float64 reference's inputs, outputs, upstream
    gradients and gradients (the bench bytes model at 8 bytes an element). The native and fused
    runs, autograd's saved tensors and the metrics need more on top."""
    from .bench import model
    m = model(case.kernel, case.shape, "fp64")
    return m.bytes_fwd + m.bytes_bwd


def device_memory(device: str) -> float:
    """Bytes the device has: the GPU's total memory, or the machine's physical memory."""
    if device == "cuda":
        return float(torch.cuda.mem_get_info()[1])
    import os
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def check_fits(cases: list[Case]) -> None:
    """Refuse, before anything runs, a case that cannot fit in the device's memory."""
    if not cases:
        return
    need, case = max(((footprint(c), c) for c in cases), key=lambda t: t[0])
    have = device_memory(case.device)
    if need > have:
        raise UsageError(
            f"shape {case.shape} of {case.kernel} needs at least {need / 2**30:,.1f} GiB for the float64 reference "
            f"alone; the {'GPU' if case.device == 'cuda' else 'machine'} has {have / 2**30:,.1f} GiB")


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
