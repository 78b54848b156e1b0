"""Reproducibility checks: determinism (the same inputs give the same bits, call after call) and
batch invariance (a token's result does not depend on how many tokens share the launch).

Both compare bits, not errors: any difference is a failure when the check was asked for. The
runner runs the implementation; this module builds the batch variants of a case and turns the
comparisons into report rows (``rule`` = ``determinism`` or ``batch-invariance``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mhctool.core import inputs as inputs_mod
from mhctool.core.dtypes import fmt_of
from mhctool.core.errors import UsageError
from mhctool.core.metrics import ulp_size
from mhctool.core.shapes import Shape
from mhctool.families import Family, generate
from mhctool.registry.builtin import native_impl
from mhctool.registry.impl import Impl
from mhctool.runner.baseline import Baseline
from mhctool.runner.call import (
    cast_case_inputs,
    named_tensors,
    output_specs,
    run_impl,
    run_reference,
    short_error,
)
from mhctool.runner.case import Case, ImplResult, device_memory, footprint, row_fields

CHECKS = ("determinism", "batch-invariance")

# Per family: the leading token dimensions of each per-token input and output (2: (S, B, ...),
# 1: (T, ...)). Inputs not named are shared by every token (weights, bias, alpha); their
# gradients sum over tokens by definition and are left out of batch invariance. ``m_splits``
# (tokens per expert, tokens sorted by expert) is recomputed for each batch.
TOKEN_DIMS: dict[str, dict[str, int]] = {
    "sinkhorn": {"logits": 2, "out": 2},
    "h_aggregate": {"x": 2, "h_pre": 2, "out": 2},
    "h_post_bda": {"h_res": 2, "x": 2, "h_post": 2, "y": 2, "out": 2},
    "proj_rms": {"x2d": 1, "proj": 1, "r": 1},
    "mapping": {"x2d": 1, "h_pre": 1, "h_post": 1, "h_res_logits": 1, "rms": 1},
    "mapping_sinkhorn": {"x": 2, "h_pre": 2, "h_post": 2, "h_res": 2},
    "mix_aggregate": {"x": 2, "out": 2, "h_post": 2, "h_res": 2},
    "swiglu": {"x": 1, "scale": 1, "out": 1},
    "clamped_swiglu": {"x": 1, "scale": 1, "out": 1},
    "srelu": {"x": 1, "scale": 1, "out": 1},
    "grouped_gemm": {"x": 1, "out": 1},
    "grouped_wgrad": {"x": 1, "grad_out": 1},  # its one output sums over tokens
    "grouped_mlp": {"x": 1, "scale": 1, "out": 1},
}
COUNTS = "m_splits"
CPU_NOTE = "on the CPU the Triton interpreter runs programs one after another: atomics cannot race there"


def parse_checks(names: list[str]) -> tuple[str, ...]:
    out = []
    for n in names:
        if n not in CHECKS:
            raise UsageError(f"unknown check {n!r}; accepted: {', '.join(CHECKS)}")
        if n not in out:
            out.append(n)
    return tuple(out)


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in units in the last place of the format of ``a``, at the larger magnitude."""
    a64, b64 = a.double(), b.double()
    d = (a64 - b64).abs() / ulp_size(torch.maximum(a64.abs(), b64.abs()), fmt_of(a.dtype))
    both_nan = torch.isnan(a64) & torch.isnan(b64)
    return torch.where(both_nan, torch.zeros_like(d), d)


def same(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise bit equality (NaN equal to NaN: a NaN that comes back every time is reproducible)."""
    if a.is_floating_point():
        return (a == b) | (torch.isnan(a) & torch.isnan(b))
    return a == b


def _describe(frac: float, unit: str, u: float, d: float) -> str:
    up = "inf" if math.isinf(u) else f"{u:.3g}"
    return f"{100 * frac:.3g}% of {unit}, up to {up} ulp ({d:.3g} absolute)"


class Tally:
    """Bit comparisons of one tensor against its first run, accumulated run by run (so no run
    but the first is kept: at the paper shape a run's gradients are gigabytes)."""

    def __init__(self, t0: torch.Tensor):
        self.t0 = t0
        self.diff = torch.zeros(t0.shape, dtype=torch.bool, device=t0.device)
        self.ulps, self.abs = 0.0, 0.0

    def add(self, t: torch.Tensor) -> bool:
        ne = ~same(t, self.t0)
        if not ne.any():
            return False
        self.diff |= ne
        self.ulps = max(self.ulps, float(ulps(self.t0[ne], t[ne]).max()))
        self.abs = max(self.abs, float((self.t0[ne].double() - t[ne].double()).abs().nan_to_num(math.inf).max()))
        return True

    @property
    def fraction(self) -> float:
        return float(self.diff.float().mean()) if self.diff.numel() else 0.0


def determinism_rows(row_base: dict, tallies: dict[str, Tally], runs: int, note: str | None = None) -> list[dict]:
    """One row per tensor: the share of elements that differ from the first run in any later run."""
    rows = []
    for name, tally in tallies.items():
        frac = tally.fraction
        msg = (f"nondeterministic: {name} differs in {_describe(frac, 'elements', tally.ulps, tally.abs)} "
               f"over {runs} runs") if frac else note
        rows.append({**row_base, "direction": "bwd" if name.startswith("grad_") else "fwd", "tensor": name,
                     "dtype_out": fmt_of(tally.t0.dtype).name, "metric": "nondeterministic", "value": frac,
                     "threshold": 0.0, "passed": frac == 0.0, "rule": "determinism", "message": msg})
    return rows


@dataclass
class Variant:
    """The case's tokens at another batch size. ``positions[i]``: the case's token that token i of
    this batch is (-1: a token appended from elsewhere)."""

    label: str
    base: dict
    upstream: list
    positions: torch.Tensor
    tokens: int


def _flat(t: torch.Tensor, dims: int) -> torch.Tensor:
    return t.reshape(-1, *t.shape[dims:])


def _rebatch(t: torch.Tensor, dims: int, flat: torch.Tensor, batch: int | None) -> torch.Tensor:
    """``flat`` (tokens, ...) back to the layout of ``t``: (tokens,) for one token dim; (tokens /
    batch, batch) for two, or (tokens, 1) when ``batch`` is None (a slice)."""
    if dims == 1:
        return flat.contiguous()
    lead = (flat.shape[0] // batch, batch) if batch else (flat.shape[0], 1)
    return flat.reshape(*lead, *t.shape[2:]).contiguous()


def _counts_for(counts: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Tokens per expert of a batch whose tokens are ``positions`` (sorted; -1 = appended to the last expert)."""
    ends = torch.cumsum(counts.cpu().long(), 0)
    p = positions.cpu()
    expert = torch.bucketize(p[p >= 0], ends, right=True)
    out = torch.bincount(expert, minlength=len(counts)).long()
    out[-1] += int((p < 0).sum())
    return out.to(dtype=counts.dtype, device=counts.device)


def token_count(fam: Family, base: dict) -> int | None:
    dims = TOKEN_DIMS.get(fam.name, {})
    for name in fam.inputs:
        if name in dims and base.get(name) is not None:
            return _flat(base[name], dims[name]).shape[0]
    return None


def variants(fam: Family, base: dict, upstream: list, others: dict, others_upstream: list) -> list[Variant]:
    """The case's tokens as one token, a prime-sized slice, and the whole batch with tokens of
    ``others`` (another draw of the same input family) appended."""
    dims = TOKEN_DIMS[fam.name]
    total = token_count(fam, base)
    lead2 = next((base[n] for n in fam.inputs if dims.get(n) == 2 and base.get(n) is not None), None)
    batch = lead2.shape[1] if lead2 is not None else None
    out_dims = [dims.get(o) for o in fam.outputs]
    plans = []
    if total > 1:
        one = total // 3
        plans.append(("1 token", torch.tensor([one])))
        p = _prime_below(max(2, total // 2))
        if p < total:
            start = 1 if 1 + p <= total else 0
            plans.append((f"{p} tokens (a slice)", torch.arange(start, start + p)))
    extra = batch or 1
    extra *= max(1, 7 // extra) | 1  # whole rows of (S, B), an odd number of them: about seven tokens
    plans.append((f"{total}+{extra} tokens (others appended)",
                  torch.cat([torch.arange(total), torch.full((extra,), -1)])))
    result = []
    for label, pos in plans:
        appended = bool((pos < 0).any())
        keep = pos[pos >= 0]
        vb = {}
        for name, t in base.items():
            d = dims.get(name)
            if t is None or (d is None and name != COUNTS):
                vb[name] = t
            elif name == COUNTS:
                vb[name] = _counts_for(t, pos)
            else:
                f = _flat(t, d)[keep.to(t.device)]
                if appended:
                    f = torch.cat([f, _flat(others[name], d)[:extra].to(t.device, t.dtype)])
                vb[name] = _rebatch(t, d, f, batch if appended else None)
        ups = []
        for u, ou, d in zip(upstream, others_upstream, out_dims):
            if d is None:  # an output that is not per token (none today): the upstream as is
                ups.append(u)
                continue
            f = _flat(u, d)[keep.to(u.device)]
            if appended:
                f = torch.cat([f, _flat(ou, d)[:extra].to(u.device, u.dtype)])
            ups.append(_rebatch(u, d, f, batch if appended else None))
        result.append(Variant(label, vb, ups, pos, len(pos)))
    return result


def _prime_below(n: int) -> int:
    for p in range(n, 1, -1):
        if all(p % q for q in range(2, int(p ** 0.5) + 1)):
            return p
    return 2


def per_token_tensors(fam: Family) -> tuple[list[str], list[str]]:
    """(tensors compared per token, tensors left out because they sum over tokens)."""
    dims = TOKEN_DIMS.get(fam.name, {})
    compared = [o for o in fam.outputs if o in dims] + [f"grad_{k}" for k in fam.differentiable if k in dims]
    excluded = [o for o in fam.outputs if o not in dims] + [f"grad_{k}" for k in fam.differentiable if k not in dims]
    return compared, excluded


def _dims_of(fam: Family, tensor: str) -> int:
    return TOKEN_DIMS[fam.name][tensor[5:] if tensor.startswith("grad_") else tensor]


def compare_batch(fam: Family, full: dict[str, torch.Tensor], v: Variant, got: dict[str, torch.Tensor]) -> dict:
    """tensor -> (share of the variant's case tokens that differ, max ulps, max abs) or an error string."""
    compared, _ = per_token_tensors(fam)
    out = {}
    for name in compared:
        if name not in full or name not in got:
            continue
        d = _dims_of(fam, name)
        ref, t = _flat(full[name], d), _flat(got[name], d)
        mine = v.positions >= 0
        a, b = t[mine.to(t.device)], ref[v.positions[mine].to(ref.device)]
        if a.shape != b.shape:
            out[name] = f"{name} has {tuple(a.shape)} per-token values, expected {tuple(b.shape)}"
            continue
        ne = ~same(a, b)
        tok = ne.reshape(ne.shape[0], -1).any(1)
        frac = float(tok.float().mean()) if tok.numel() else 0.0
        out[name] = (frac, float(ulps(b[ne], a[ne]).max()) if frac else 0.0,
                     float((a[ne].double() - b[ne].double()).abs().nan_to_num(math.inf).max()) if frac else 0.0)
    return out


def batch_rows(row_base: dict, fam: Family, full: dict[str, torch.Tensor], total: int,
               results: list[tuple[Variant, dict | None, str | None]],
               unsteady: set[str] = frozenset()) -> list[dict]:
    """One row per per-token tensor: the largest share of the case's tokens whose bits differ in
    another batch (``results``: per variant, :func:`compare_batch`'s dict or the error of its run);
    tensors that sum over tokens get an informational row saying they were left out.
    ``unsteady``: tensors that differ between two runs of the same batch; batch invariance cannot be
    told apart from that, so their rows are not judged (the determinism check fails them)."""
    compared, excluded = per_token_tensors(fam)
    rows = []
    for name in compared:
        if name not in full:
            continue
        base = {**row_base, "direction": "bwd" if name.startswith("grad_") else "fwd", "tensor": name,
                "dtype_out": fmt_of(full[name].dtype).name, "metric": "batch_variant", "rule": "batch-invariance"}
        if name in unsteady:
            rows.append({**base, "value": math.nan, "threshold": None, "passed": None,
                         "message": f"not judged: {name} differs between two runs of the same batch "
                                    "(see --check determinism)"})
            continue
        worst, label, problems = (0.0, 0.0, 0.0), None, []
        for v, stats, error in results:
            item = error or (stats or {}).get(name)
            if isinstance(item, str):
                problems.append(f"{v.label}: {item}")
            elif item is not None and item[0] > worst[0]:
                worst, label = item, v.label
        frac, u, dd = worst
        if problems:
            msg, passed, frac = "batch variant failed to run: " + "; ".join(problems), False, math.nan
        elif frac:
            msg = (f"not batch-invariant: {name} differs between the case's {total} tokens and {label} "
                   f"for {_describe(frac, 'tokens', u, dd)}")
            passed = False
        else:
            msg, passed = None, True
        rows.append({**base, "value": frac, "threshold": 0.0, "passed": passed, "message": msg})
    for name in excluded:
        if name in full or name in fam.outputs:
            rows.append({**row_base, "direction": "bwd" if name.startswith("grad_") else "fwd", "tensor": name,
                         "metric": "batch_variant", "value": math.nan, "threshold": None, "passed": None,
                         "rule": "batch-invariance", "message": f"{name} sums over tokens by definition: not compared"})
    return rows


class CaseChecks:
    """The determinism and batch-invariance checks of one case (mhctool.runner.checks): reruns of each
    implementation on the same inputs, and runs on the batch variants of the case."""

    def __init__(self, fam: Family, case: Case, shape: Shape, base: dict, nat_base: "Baseline",
                 checks: tuple[str, ...], repeats: int):
        self.fam, self.case, self.shape, self.base, self.checks, self.repeats = fam, case, shape, base, checks, repeats
        self.total = token_count(fam, base) if fam.name in TOKEN_DIMS else None
        self.note = CPU_NOTE if case.device == "cpu" else None
        self.batch = "batch-invariance" in checks and bool(self.total)
        self.upstream = nat_base.upstream
        self.out_specs = output_specs(nat_base.native.outputs)

    def variants(self):
        """The batch variants with the outputs' expected layout (from the native run of each),
        built when needed and dropped after: at the paper shape one of them is as large as the case."""
        case, fam = self.case, self.fam
        _, raw = generate(case.kernel, case.family, case.shape, case.seed + 1, case.knob_dict,
                                     draw_on=case.device)
        others = cast_case_inputs(fam, raw, case)
        del raw
        others_up = inputs_mod.upstream_grads([torch.empty(sh, dtype=dt, device=dev) for sh, dt, dev in self.out_specs],
                                              case.seed + 1)
        vs = variants(fam, self.base, self.upstream, others, others_up)
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
        out = []
        full = self._named(first)
        # batch invariance needs a second run of the same batch too: a tensor that differs run to
        # run cannot be judged across batch sizes. Each run is compared, then dropped.
        reruns = self.repeats - 1 if "determinism" in self.checks else (1 if self.batch else 0)
        tallies = {n: Tally(t) for n, t in full.items()}
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
                out.extend(determinism_rows(row_base, tallies, self.repeats, self.note))
        del tallies
        if self.batch:
            results = []
            for v, expect in self.variants():
                if expect is None:
                    results.append((v, None, "the native implementation failed on it"))
                    continue
                r = again(v.base, v.upstream, expect)
                err = r.fwd_error or r.bwd_error
                results.append((v, None if err else compare_batch(self.fam, full, v, self._named(r)), err))
                v.base = v.upstream = None  # keep the label and positions only
                del r
            out.extend(batch_rows(row_base, self.fam, full, self.total, results, unsteady))
        return out

    def reference_rows(self, knobs: dict) -> list[dict]:
        """The float64 reference under the same checks: is PyTorch itself reproducible here?"""
        ref = Impl("float64", self.case.kernel, "reference", self.fam.reference)
        row_base = row_fields(self.case, self.shape, ref, "ieee", knobs)
        if 3 * footprint(self.case) > device_memory(self.case.device):
            return [{**row_base, "direction": "fwd", "tensor": "*", "metric": "unsupported", "value": math.nan,
                     "threshold": None, "passed": None, "rule": "unsupported",
                     "message": "the float64 reference is not rerun at this shape: three copies do not fit"}]

        def again(b, ups, expect):
            outs, grads = run_reference(self.fam, b, knobs, ups)
            return ImplResult(outputs=outs, grads=grads)
        return self.rows(row_base, again(self.base, self.upstream, None), self.upstream, again, gated=False)
