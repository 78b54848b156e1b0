"""``mhctool identify``: which convention an implementation computes, or that none fits."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from . import names
from .clikit import lazy
from .clikit import device as parse_device
from .clikit import Interrupts, fmt, isolation_for, knob_items, out
from .errors import UsageError

environment, registry, report = (lazy(m) for m in ("environment", "registry", "report"))


def parse_dtype(name: str):
    from .dtypes import parse_dtype as parse
    return parse(name)


def _table(ident, top: int) -> Table:
    from .identify import fmt_knobs
    t = Table(title=f"identify {ident.kernel}: {ident.impl.name} (asked: {fmt_knobs(ident.asked_all) or 'the contract'})")
    for c in ("candidate", "max_rel", "x native noise", "native max_rel", "verdict", "what it is"):
        t.add_column(c)
    for c in ident.shown(top):
        verdict = "-" if c.passed is None else ("pass" if c.passed else "FAIL")
        t.add_row(fmt_knobs(c.knobs) or "(the contract)", fmt(c.max_rel), fmt(c.score), fmt(c.native_score), verdict,
                  (c.worst if c.passed is False else c.level) or "not judged")
    return t


def identify(
    kernel: str = typer.Option(..., "--kernel", "-k", help="One kernel: " + ", ".join(names.IDENTIFIABLE) + "."),
    impl: str = typer.Option(..., "--impl", "-i", help="The implementation: a built-in name, module.path:function, file.py:function, or a library (te:DIR, megatron:DIR)."),
    dtype: str = typer.Option("fp32", "--dtype", help="Probe dtype (fp32 separates the candidates best)."),
    device: Optional[str] = typer.Option(None, "--device", help="cpu or cuda (default: cuda when present)."),
    shape: Optional[str] = typer.Option(None, "--shape", help="Probe shape (default: small, per kernel; TransformerEngine's kernels need n = 4)."),
    knob: Optional[list[str]] = typer.Option(None, "--knob", help="KNOB=VALUE (repeat): what the implementation is asked for (default: the contract's values, e.g. iters=20 eps=1e-6)."),
    seed: int = typer.Option(0, "--seed", min=0, help="Probe input seed."),
    out_path: Path = typer.Option(Path("mhctool-identify.parquet"), "--out", "-o", help="Parquet report: one row per candidate tried."),
    top: int = typer.Option(8, "--top", min=1, help="Rows of the candidates table."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print only the result lines."),
    isolate: Optional[bool] = typer.Option(None, "--isolate/--no-isolate", help="Run the implementation in a child process (default: on for an external one on a GPU)."),
    matmul_precision: Optional[str] = typer.Option(None, "--matmul-precision", help="ieee, tf32, tf32_trunc or bf16: what the implementation multiplies at by design (default: fitted with the conventions; an adapter's declared precision is where the fit starts)."),
):
    """Tell which convention a kernel computes: fit the family's convention knobs against the float64
    reference; exit 0 when a convention fits (the verdict rule passes under it), 1 when none does."""
    from .clikit import precheck
    precheck(kernel, [dtype], shape, device)
    if kernel not in names.IDENTIFIABLE:
        raise UsageError(f"mhctool identify knows no conventions of {kernel}; it identifies "
                         + ", ".join(names.IDENTIFIABLE))
    from . import identify as ident_mod
    report.check_writable(out_path)
    ident_mod.check_kernel(kernel)
    dt = parse_dtype(dtype).name
    dev = parse_device(device)
    asked = ident_mod.checked_knobs(kernel, dict(knob_items(knob, "--knob", "iters=20")), from_text=True)
    impls = registry.resolve_impls(kernel, [impl])
    for i in impls:
        if why := i.unsupported(dev, dt):
            raise UsageError(f"--impl {i.name} cannot run {kernel} at {dt} on {dev}: {why}")
    interrupts = Interrupts()
    iso = isolation_for(isolate, [impl], dev, None, "shm", interrupts)
    rows, failed = [], False
    try:
        with interrupts:
            for i in impls:
                ident = ident_mod.identify(kernel, i, dtype=dt, device=dev, shape=shape, asked=asked, seed=seed,
                                           isolation=iso, matmul_precision=matmul_precision)
                if ident.error and registry.call_problem(ident.error.rsplit(" (probe ", 1)[0]):
                    raise UsageError(f"--impl {i.name} cannot be judged as {kernel}: {ident.error}; expected "
                                     f"{registry.signature(registry.get_family(kernel))}")
                rows.extend(ident_mod.rows(ident, dt, dev))
                if not quiet and ident.candidates:
                    out.print(_table(ident, top))
                out.print(ident.line(), markup=False)
                if ident.best is not None and ident.best.note and ident.best.level != "as asked" and not ident.overflow:
                    out.print(ident.best.note, markup=False)
                elif ident.best is not None and ident.passed and i.conventions and not asked:
                    declared = " ".join(f"{k}={ident_mod.fmt_value(v)}" for k, v in i.conventions.items())
                    out.print(f"as its adapter declares: {declared}", markup=False)
                if ident.best is not None and (note := ident.precision_note()):
                    out.print(note, markup=False)
                if ident.ties:
                    out.print("fits as well (within native noise): "
                              + "; ".join(ident_mod.fmt_knobs(c.knobs) for c in ident.ties), markup=False)
                flags = ident.flags() if ident.best is not None else ""
                if ident.passed and flags:  # a defect too: judged as it computes, the rest may still fail
                    out.print(f"judge it with: mhctool parity --kernel {kernel} --impl {impl} {flags}", markup=False)
                failed |= not ident.passed
    finally:
        if iso is not None:
            iso.close()
    table = report.to_table(rows, report.new_run_id(), "identify", environment.metadata(),
                            {"kernel": kernel, "impl": impl, "dtype": dt, "device": dev, "asked": asked},
                            schema=report.IDENTIFY_SCHEMA)
    path = report.write_atomic(table, out_path)
    if not quiet:
        out.print(f"report {path}")
    raise typer.Exit(1 if failed else 0)


def parity_hint(kernel: str, impl: registry.Impl, short: str, device: str, isolated: bool, transport: str,
                case_timeout: float | None = None, asked: dict | None = None, verify=None) -> str | None:
    """What ``parity`` says under a failed external implementation: a quick identification (fp32,
    the default probes) tells a convention it passes under from a defect. ``asked``: the
    conventions declared with ``--convention`` (an adapter's own are the implementation's).
    ``verify(conventions, precision) -> (passed, first failure)``: the run again with the flags
    found; a flag is offered as passing only where that run passes."""
    from . import identify as ident_mod
    from .runner import Isolation
    spec = impl.spec or impl.name
    if kernel not in ident_mod.IDENTIFIABLE:
        return None
    iso = Isolation(transport=transport, case_timeout=case_timeout) if isolated else None
    try:
        ident = ident_mod.identify(kernel, impl, dtype="fp32", device=device, isolation=iso, asked=asked)
    except Exception as e:  # noqa: BLE001 - a hint never fails the run
        return f"hint: {short} failed on {kernel}; identification could not run ({type(e).__name__}: {e})"
    finally:
        if iso is not None:
            iso.close()
    how = f"(mhctool identify --kernel {kernel} --impl {spec})"
    if not ident.passed:
        line = ident.line()
        if line.startswith("no convention fits: "):
            rest = line[len('no convention fits: '):]
            return f"hint: no convention fits {short} on {kernel}: {rest}{'' if 'a defect' in rest else '; a defect'} {how}"
        return f"hint: {short} on {kernel}: {line} {how}"
    best, flags = ident.best, ident.flags()
    notes = "; ".join(n for n in (best.note if best.level != "as asked" else None, ident.precision_note()) if n)
    if best.level == "as asked" and not flags:
        return (f"hint: {short} computes {kernel}'s asked convention at fp32 {how}; the failure is not a "
                "convention: see the rows above")
    if not flags:
        return f"hint: {short} on {kernel}: {notes} {how}"
    precision = ident.judged_precision() if ident.judged_precision() != ident.declared_precision else None
    ok, failure = verify(ident.conventions(), precision) if verify is not None else (True, None)
    if not ok:
        return (f"hint: {short} on {kernel}: identify fits {flags} ({notes}), but with them this run still fails: "
                f"{failure} {how}")
    if best.level == "likely a defect":
        return f"hint: {short} on {kernel}: {notes}; judged as it computes, it passes with {flags} {how}"
    return f"hint: {short} fails on {kernel} but passes with {flags} ({notes})"
