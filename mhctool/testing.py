"""mhctool's verdict rule inside your own pytest suite.

``assert_parity(my_sinkhorn, "sinkhorn")`` runs the cases of ``mhctool parity --kernel sinkhorn
--impl my_module:my_sinkhorn`` in this process, through the same engine (:mod:`mhctool.analyses.parity`):
the same input families, float64 reference, native baseline and rule (error at most kappa times
the native implementation's error at the same dtype). It passes silently and, on failure, raises
an ``AssertionError`` whose message is the worst rows as a table, as ``mhctool parity`` prints it.

With the pytest plugin (installed with mhctool, idle unless asked), ``pytest --mhctool-report
parity.parquet`` collects every call of a session into one Parquet report.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import pyarrow as pa

from mhctool.analyses import parity as engine
from mhctool.analyses.hints import hints
from mhctool.core import environment, findings
from mhctool.families import get_family
from mhctool.registry.builtin import native_impl
from mhctool.registry.impl import Impl

__all__ = ["ParityResult", "assert_parity", "check_parity"]

# Callbacks that receive each result's table (the pytest plugin's --mhctool-report collector).
_sinks: list[Callable[["ParityResult"], None]] = []

_COLUMNS = ("kernel", "family", "dtype", "shape", "direction", "tensor", "metric", "value", "threshold", "rule")


@dataclass
class ParityResult:
    """The outcome of one :func:`check_parity` call.

    ``table``: the rows, in the schema of ``mhctool parity``'s Parquet report (one row per case,
    implementation, direction, tensor and metric; the native baseline's rows included).
    ``verdicts``: one per (case, implementation under test, direction), as ``mhctool parity``
    counts them: ``passed`` is True, False or None (skipped, with the reason in ``message``).
    """

    table: pa.Table
    verdicts: list[dict]
    impls: list[str]  # the implementations under test, by name
    settings: dict = field(default_factory=dict)
    plan: object = field(default=None, repr=False)  # the engine's plan (what a hint reruns)

    def hints(self) -> list[str]:
        """What ``mhctool parity`` says under a failed outside implementation: the convention it
        passes under (identified, then checked by a rerun) or the defect; what its raising cases
        have in common. Empty when it passed, or for mhctool's own backends."""
        if self.passed or self.plan is None or not self.failures:
            return []
        return [h for _, _, h in hints(self.plan, self.verdicts, self.plan.cases[0].device)]

    @property
    def failures(self) -> list[dict]:
        """Failed verdicts, worst first (an error before any measurement, then by margin)."""
        return findings.worst_first([v for v in self.verdicts if v["passed"] is False])

    @property
    def judged(self) -> int:
        return sum(v["passed"] is not None for v in self.verdicts)

    @property
    def passed(self) -> bool:
        """True when nothing failed and at least one case was judged."""
        return not self.failures and self.judged > 0

    def summary(self) -> str:
        p = sum(v["passed"] is True for v in self.verdicts)
        f = len(self.failures)
        s = len(self.verdicts) - p - f
        return f"{', '.join(self.impls)}: {p} passed, {f} failed, {s} skipped"

    def message(self, top: int = 10) -> str:
        """The worst rows as a compact text table (what :func:`assert_parity` raises with)."""
        if not self.failures:
            if self.judged:
                return self.summary()
            why = next((v["message"] for v in self.verdicts if v["message"]), "no case ran")
            return f"{self.summary()}: judged on no case ({why})"
        lines = [self.summary() + f" (worst {min(top, len(self.failures))} shown; kappa {self.settings.get('kappa')})"]
        rows, notes = [], []
        for v in self.failures[:top]:
            w = v["worst"] or {}
            rows.append([str(v[c]) for c in _COLUMNS[:5]] + [
                str(w.get("tensor", "*")), str(w.get("metric", "error")), _num(w.get("value")),
                _num(w.get("threshold")), str(w.get("rule", "raised"))])
            if v["message"]:
                notes.append(f"  {v['kernel']} {v['family']} {v['dtype']} {v['direction']}: {v['message']}")
        widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(_COLUMNS)]
        lines.append("  ".join(c.ljust(w) for c, w in zip(_COLUMNS, widths)).rstrip())
        lines += ["  ".join(x.ljust(w) for x, w in zip(r, widths)).rstrip() for r in rows]
        if len(self.failures) > top:
            lines.append(f"... and {len(self.failures) - top} more failed")
        return "\n".join(lines + notes)

    def __repr__(self) -> str:
        return f"<ParityResult {self.summary()}>"


def _num(v) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.3g}"


def _impl_of(impl: str | Callable, kernel: str, name: str | None) -> str | Impl:
    if isinstance(impl, str):
        return impl
    if not callable(impl):
        raise TypeError(f"impl must be a callable or an --impl spec string, not {type(impl).__name__}")
    label = name or f"{getattr(impl, '__module__', None) or 'python'}:{getattr(impl, '__qualname__', repr(impl))}"
    return Impl(label, kernel, "external", impl)


def check_parity(impl: str | Callable, kernel: str, *, dtypes: Sequence[str] | None = None,
                 shapes: Sequence[str] | None = None, families: Sequence[str] | None = None,
                 device: str | None = None, convention: dict | None = None, kappa: float | None = None,
                 seed: int = 0, matmul_precision: str | None = None, scenario: str | None = None,
                 name: str | None = None, checks: Sequence[str] | None = None) -> ParityResult:
    """Judge ``impl`` on ``kernel``'s parity cases and return the result (never raises on a failure).

    ``impl``: a callable with the family's signature (``sinkhorn(logits, iters=20, eps=1e-6)``, see
    ``mhctool parity --help`` and docs/concepts/contract.md) or an ``--impl`` spec string
    (``"triton"``, ``"path/to/file.py:fn"``, ``"te:.anchors/te"``). The other arguments narrow the
    scenario's cases (default scenario: parity-default, small odd shapes, every input family) the
    way ``mhctool parity``'s options do; ``convention``: ``{knob: value}`` the implementation
    computes by design (``{"stabilize": "softmax"}``), as ``--convention``; ``checks``:
    ``["determinism", "batch-invariance"]``, as ``--check``. Bad arguments raise
    :class:`mhctool.UsageError` (a ``ValueError``).

    Example::

        >>> from mhctool.testing import check_parity
        >>> r = check_parity("torch", "sinkhorn", dtypes=["fp32"], device="cpu")
        >>> r.passed
        True
    """
    dev = environment.resolve_device(device)
    p = engine.plan([get_family(kernel).name], [_impl_of(impl, kernel, name)], device=dev,
                    scenario=scenario, dtypes=list(dtypes) if dtypes else None,
                    shapes=list(shapes) if shapes else None, seeds=[seed],
                    families=list(families) if families else None,
                    conventions={kernel: engine.check_conventions(kernel, convention)} if convention else None,
                    kappa=kappa, matmul_precision=matmul_precision or "ieee", checks=list(checks or []))
    outcome = engine.execute(p)
    table = engine.table(p, outcome, command="mhctool.testing", kernel=kernel, device=dev)
    asked = [i.name for i in p.impls[p.cases[0].kernel]]
    if not asked:  # "torch" asked for: the native implementation judges itself against float64
        asked = [native_impl(kernel).name]
    verdicts = [v for v in findings.verdicts(table) if v["impl"] in asked]
    result = ParityResult(table, verdicts, asked, engine.settings(p, outcome), p)
    for sink in list(_sinks):
        sink(result)
    return result


def assert_parity(impl: str | Callable, kernel: str, *, dtypes: Sequence[str] | None = None,
                  shapes: Sequence[str] | None = None, families: Sequence[str] | None = None,
                  device: str | None = None, convention: dict | None = None, kappa: float | None = None,
                  seed: int = 0, matmul_precision: str | None = None, scenario: str | None = None,
                  name: str | None = None, checks: Sequence[str] | None = None) -> ParityResult:
    """:func:`check_parity`, raising ``AssertionError`` when a case fails or none could be judged.

    The message is the worst rows as a table (kernel, family, dtype, shape, direction, tensor,
    metric, value, threshold, rule), then parity's hints for a function of yours (the convention
    it passes under, checked by a rerun, or the defect identify shows). Returns the
    :class:`ParityResult` when it passes.

    Example (a test in your suite)::

        from mhctool.testing import assert_parity

        def test_my_sinkhorn():
            assert_parity(my_sinkhorn, "sinkhorn", dtypes=["fp32", "bf16"])
    """
    result = check_parity(impl, kernel, dtypes=dtypes, shapes=shapes, families=families, device=device,
                          convention=convention, kappa=kappa, seed=seed, matmul_precision=matmul_precision,
                          scenario=scenario, name=name, checks=checks)
    if not result.passed:
        raise AssertionError("\n".join(["mhctool parity failed: " + result.message(), *result.hints()]))
    return result
