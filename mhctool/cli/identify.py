"""``mhctool identify``: which convention an implementation computes, or that none fits."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from mhctool.cli.kit import (
    Interrupts,
    err,
    fmt,
    isolation_for,
    knob_items,
    out,
    parse_dtype,
)
from mhctool.cli.kit import device as parse_device
from mhctool.core import names
from mhctool.core.errors import UsageError


def _table(ident, top: int) -> Table:
    from mhctool.analyses.identify import fmt_knobs
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
    verbose: bool = typer.Option(False, "--verbose", help="Let the libraries' own log lines (TileLang, Triton, NCCL) show; by default they go to a log file beside the report, named in its metadata and in the last line."),
    matmul_precision: Optional[str] = typer.Option(None, "--matmul-precision", help="ieee, tf32, tf32_trunc or bf16: what the implementation multiplies at by design (default: fitted with the conventions; an adapter's declared precision is where the fit starts)."),
):
    """Tell which convention a kernel computes: fit the family's convention knobs against the float64
    reference; exit 0 when a convention fits (the verdict rule passes under it), 1 when none does or
    what fits is likely a defect."""
    from mhctool.cli.kit import precheck
    precheck(kernel, [dtype], shape, device)
    if kernel not in names.IDENTIFIABLE:
        raise UsageError(f"mhctool identify knows no conventions of {kernel}; it identifies "
                         + ", ".join(names.IDENTIFIABLE))
    from mhctool.core import environment, report
    report.check_writable(out_path)
    from mhctool.analyses import identify as ident_mod
    ident_mod.check_kernel(kernel)
    dt = parse_dtype(dtype).name
    dev = parse_device(device)
    asked = ident_mod.checked_knobs(kernel, dict(knob_items(knob, "--knob", "iters=20")), from_text=True)
    from mhctool.registry.specs import resolve_impls
    impls = resolve_impls(kernel, [impl])
    for i in impls:
        if why := i.unsupported(dev, dt):
            raise UsageError(f"--impl {i.name} cannot run {kernel} at {dt} on {dev}: {why}")
    interrupts = Interrupts()
    iso = isolation_for(isolate, [impl], dev, None, None, interrupts)
    rows, failed = [], False
    from mhctool.core.library_log import library_log
    from mhctool.families import call_problem, get_family, signature
    log_path = out_path.with_name(out_path.stem + ".libraries.log")
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from mhctool.cli.kit import LogProgress, short_impl
    from mhctool.spread.machine import pinned_threads, threads_for
    # while it works: a spinner with the stage on a terminal, a line every few seconds in a log
    beat = LogProgress("identify", len(impls), enabled=not quiet and not out.is_terminal, unit="implementations done")
    try:
        with interrupts, pinned_threads(threads_for(dev, 1)), beat, \
                library_log(log_path, {"stdout": out, "stderr": err}, enabled=not verbose) as log:
            for i in impls:
                with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=err,
                              transient=True, disable=quiet or not out.is_terminal) as bar:
                    task = bar.add_task("identify")

                    def stage(what: str, name: str = i.name, bar=bar, task=task) -> None:
                        beat.now = f"{short_impl(name)}: {what}"
                        bar.update(task, description=f"identify {kernel} {short_impl(name)}: {what}")
                    ident = ident_mod.identify(kernel, i, dtype=dt, device=dev, shape=shape, asked=asked, seed=seed,
                                               isolation=iso, matmul_precision=matmul_precision, progress=stage)
                beat.done += 1
                if ident.error and call_problem(ident.error.rsplit(" (probe ", 1)[0]):
                    raise UsageError(f"--impl {i.name} cannot be judged as {kernel}: {ident.error}; expected "
                                     f"{signature(get_family(kernel))}")
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
                defect = ident.defect()
                if ident.passed and flags and not defect:  # judged as it computes, the rest may still fail
                    out.print(f"judge it with: mhctool parity --kernel {kernel} --impl {impl} {flags}", markup=False)
                elif defect:  # a defect is no convention to declare: the kernel is what to change
                    out.print("not a convention to declare: the kernel computes it whatever it is asked", markup=False)
                failed |= not ident.passed or defect
            meta = environment.metadata()  # with the threads it computed with
    finally:
        if iso is not None:
            iso.close()
    table = report.to_table(rows, report.new_run_id(), "identify", meta,
                            {"kernel": kernel, "impl": impl, "dtype": dt, "device": dev, "asked": asked,
                             "library_log": log["path"]},
                            schema=report.IDENTIFY_SCHEMA)
    path = report.write_atomic(table, out_path)
    if not quiet:
        out.print(f"report {path}" + (f"; the libraries' own output: {log['path']}" if log["path"] else ""))
    raise typer.Exit(1 if failed else 0)
