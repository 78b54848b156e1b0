"""``mhctool identify`` as a run: which convention and matmul precision an implementation
computes, or that none fits, with the evidence (the fitting is :mod:`mhctool.analyses.identify`'s)."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path

from mhctool.analyses import identify as ident_mod
from mhctool.analyses.runs import Stopped, Watch, stop_point
from mhctool.core import environment, names, report
from mhctool.core.dtypes import parse_dtype
from mhctool.core.errors import UsageError, kept_at_once
from mhctool.core.library_log import beside, holding
from mhctool.core.text import short_impl
from mhctool.families import call_problem, get_family, signature
from mhctool.registry.specs import resolve_impls
from mhctool.spread import setup


@dataclass
class Request:
    kernel: str
    impl: str
    dtype: str = "fp32"
    device: str | None = None
    shape: str | None = None
    knobs: list[tuple[str, str]] = field(default_factory=list)  # what the implementation is asked for
    seed: int = 0
    out: Path = Path("mhctool-identify.parquet")
    isolate: bool | None = None
    verbose: bool = False
    matmul_precision: str | None = None
    case_timeout: float | None = None  # seconds an isolated probe call may take
    insist: bool = False  # called on every probe even after it ended its process or hung


@dataclass
class Found:
    """One implementation's identification and the sentences it supports: ``claims``, each with
    the check that earned it; ``lines``, those whose check held (what is printed)."""

    ident: object  # identify.conclusion.Identification
    lines: list[str]
    failed: bool
    claims: list = field(default_factory=list)  # identify.claims.Claim


@dataclass
class Outcome:
    request: Request
    found: list[Found]
    report: Path
    library_log: str | None = None
    interrupted: bool = False  # a signal stopped it: the report holds the implementations identified before

    @property
    def exit_code(self) -> int:
        return 130 if self.interrupted else 1 if any(f.failed for f in self.found) else 0


def conclusions(ident, impl, req: Request, asked: dict) -> Found:
    """The lines under an identification's table: what fits, what it is, how to judge it; each a
    claim with the check that earned it (:mod:`mhctool.analyses.identify.claims`), printed where
    its check held."""
    from mhctool.analyses.identify import claims as C
    out = [C.identification(ident)]
    fitted = ident.best is not None and (ident.passed or ident.best.fwd_passed)
    if ident.best is not None and ident.best.note and ident.best.level != "as asked" and not ident.overflow:
        out.append(C.Claim("note", ident.best.note, "the best candidate's fitted knobs against the asked ones"
                           + ("" if fitted else " (no convention fits: said of its evidence only)"), True))
    elif ident.best is not None and ident.passed and impl.conventions and not asked:
        declared = " ".join(f"{k}={ident_mod.fmt_value(v)}" for k, v in impl.conventions.items())
        out.append(C.Claim("note", f"as its adapter declares: {declared}", "it passes at its declared conventions", True))
    out += [c for c in (C.precision(ident), C.nearest_precision(ident)) if c is not None]
    if ident.ties:
        out.append(C.Claim("ties", "fits as well (within native noise): " + "; ".join(
            ident_mod.fmt_knobs(c.knobs) for c in ident.ties), "each within native noise of the best", True))
    if (rng := C.told(ident)) is not None:
        out.append(rng)
    out += C.dropped_asks(ident, asked)
    for name, raised in ident.without.items():
        out.append(C.Claim("input", f"given {name}, it raised {raised}: identified without one", "it raised", True))
    if ident.returned:  # judged at the contract's dtype all the same: a lower precision is not excused
        came = ", ".join(f"{name} in {fmt}" for name, fmt in sorted(ident.returned.items()))
        out.append(C.Claim("dtype", f"it returned {came} for {req.dtype} inputs: judged converted to the contract's "
                                    "dtype", "the dtypes it returned", True))
    flags = ident.flags() if ident.best is not None else ""
    defect = ident.defect()
    if ident.passed and flags and not defect:  # judged as it computes, the rest may still fail
        out.append(C.Claim("judge", f"judge it with: mhctool parity --kernel {req.kernel} --impl {req.impl} {flags}",
                           "it passes the verdict rule at these conventions", True))
    elif defect:  # a defect is no convention to declare: the kernel is what to change
        out.append(C.Claim("defect", "not a convention to declare: the kernel computes it whatever it is asked",
                           "the fitted value is likely a defect of a knob it takes", True))
    return Found(ident, C.printed(out), bool(not ident.passed or defect), out)


def run(req: Request, watch: Watch = Watch()) -> Outcome:
    """Identify each implementation the request's ``--impl`` stands for (a library: each of its
    functions for the kernel); the report holds one row per candidate tried."""
    if req.kernel not in names.IDENTIFIABLE:
        raise UsageError(f"mhctool identify knows no conventions of {req.kernel}; it identifies "
                         + ", ".join(names.IDENTIFIABLE))
    report.check_writable(req.out)
    ident_mod.check_kernel(req.kernel)
    dt = parse_dtype(req.dtype).name
    dev = environment.resolve_device(req.device)
    asked = ident_mod.checked_knobs(req.kernel, dict(req.knobs), from_text=True)
    with contextlib.nullcontext() if req.verbose else holding(watch.consoles):  # its import's lines to the log
        impls = resolve_impls(req.kernel, [req.impl])
    for i in impls:
        if why := i.unsupported(dev, dt):
            raise UsageError(f"--impl {i.name} cannot run {req.kernel} at {dt} on {dev}: {why}")
    s = setup.prepare(dev, specs=[req.impl], isolate=req.isolate, case_timeout=req.case_timeout, insist=req.insist,
                      workers=1,
                      library_log=None if req.verbose else beside(req.out),
                      consoles=watch.consoles, say=watch.say)
    watch.planned(len(impls))
    rows, found = [], []
    with s.running():
        for i in impls:
            def stage(what: str, name: str = i.name) -> None:
                stop_point(s.interrupts)  # a signal: the identification in hand stops at its next probe
                watch.started(f"identify {req.kernel} {short_impl(name)}: {what}", f"{short_impl(name)}: {what}")
            ident = None
            with kept_at_once():  # a second signal: the identification in hand is abandoned
                try:
                    ident = ident_mod.identify(req.kernel, i, dtype=dt, device=dev, shape=req.shape, asked=asked,
                                               seed=req.seed, isolation=s.isolation,
                                               matmul_precision=req.matmul_precision, progress=stage)
                except Stopped:
                    pass
            if ident is None:
                break
            watch.finished()
            said = (ident.error or "").removeprefix("its forward failed: ")
            if ident.error and call_problem(said.rsplit(" (probe ", 1)[0]):
                raise UsageError(f"--impl {i.name} cannot be judged as {req.kernel}: {said}; expected "
                                 f"{signature(get_family(req.kernel))}")
            rows.extend(ident_mod.rows(ident, dt, dev))
            found.append(conclusions(ident, i, req, asked))
        meta = environment.metadata()  # with the threads it computed with
    claims = [c.row(f.ident.impl.name) for f in found for c in f.claims]
    table = report.to_table(rows, report.new_run_id(), "identify", meta,
                            {"kernel": req.kernel, "impl": req.impl, "dtype": dt, "device": dev, "asked": asked,
                             "library_log": s.library_log, "interrupted": s.interrupts.requested,
                             "claims": claims},
                            schema=report.IDENTIFY_SCHEMA)
    return Outcome(req, found, report.write_atomic(table, req.out), s.library_log, s.interrupts.requested)
