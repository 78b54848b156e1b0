"""``mhctool doctor``: what is installed and usable here."""
from __future__ import annotations

from rich.table import Table

from mhctool.cli.console import guard, out


@guard
def doctor():
    """Which backends work here, and why not."""
    t = Table(title="backends")
    for c in ("backend", "usable", "mode", "version", "why not"):
        t.add_column(c)
    from mhctool.core import environment
    for b in environment.backends():
        t.add_row(b.name, "[green]yes[/]" if b.usable else "[red]no[/]", b.mode, b.version or "-", b.reason or "")
    out.print(t)
    gpu = environment.gpu_info()
    out.print(f"GPU: {gpu.get('gpu') or 'none visible'}" + (f" (sm_{gpu['sm']}, driver {gpu.get('driver')}, CUDA {gpu.get('cuda')})" if gpu.get("gpu") else ""))
    out.print(f"tileiras: {environment.tileiras_path() or 'not on PATH'}")
    if environment.triton_interpreted():
        from mhctool.core import interpreter
        errors = interpreter.prepare()
        out.print("Triton interpreter: mhctool's kernels, library adapters and plain FILE:function or "
                  "module:function implementations run through it (TRITON_INTERPRET=1 is set for them)")
        for dt, err in errors.items():
            state = ("right" if err <= interpreter.TOLERANCE else f"wrong (relative error {err:.2g}): {dt} cases skipped")
            mend = " after mhctool's mend (bf16 operands widened to fp32)" if dt == "bf16" and interpreter.mended() else ""
            out.print(f"  tl.dot on {dt}: {state}{mend}")
        before, after, mended_casts = interpreter.casts()
        state = "right" if not after else f"wrong ({after} of {interpreter.CAST_PROBES} probe casts): bf16 cases skipped"
        mend = (f" after mhctool's mend (it truncated or misrounded {before} of {interpreter.CAST_PROBES}; now rounded "
                "to nearest even)") if mended_casts else ""
        out.print(f"  fp32 <-> bf16 casts: {state}{mend}")
    from mhctool.families import KERNELS
    from mhctool.registry.builtin import impls_for
    for k in KERNELS:
        names = ", ".join(f"{i.name}{'' if not i.unavailable() else ' (unavailable)'}" for i in impls_for(k))
        out.print(f"{k}: {names}")
