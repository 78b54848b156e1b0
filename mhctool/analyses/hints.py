"""The hints under a failed implementation from outside mhctool (parity, the gate, assert_parity):
what a raising function's cases have in common, and a quick identification that tells a
convention it passes under from a defect, its flags offered only after a rerun with them passed."""
from __future__ import annotations

from dataclasses import replace

from mhctool.analyses import identify as ident_mod
from mhctool.analyses import parity
from mhctool.core.text import fmt, short_impl
from mhctool.core import report
from mhctool.core.findings import verdicts
from mhctool.families import get_family
from mhctool.registry.impl import Impl
from mhctool.spread.case_isolation import Isolation


def failed_externals(vs: list[dict]) -> dict[tuple[str, str], set[str]]:
    """(kernel, external implementation) -> how it failed: ``measured`` (an error, a non-finite or
    zero count: what a convention may explain, so identify is asked) and/or ``raised`` (the
    implementation raised: its cases say why, and the hint comes from the cases that ran). A crash
    or a reproducibility check failure gets no hint."""
    out: dict[tuple[str, str], set[str]] = {}
    for v in vs:
        if v["passed"] is not False or ":" not in v["impl"] or v["worst"] is None:
            continue
        metric = v["worst"]["metric"]
        kind = ("measured" if metric in ("max_abs", "rel_l2", "nonfinite", "extra_zeros")
                else "raised" if metric == "error" and v["worst"].get("rule") == "raised" and v["direction"] == "fwd"
                else None)
        if kind:
            out.setdefault((v["kernel"], v["impl"]), set()).add(kind)
    return out


def verifier(pl, kernel: str, impl, iso):
    """What a hint's flags do: the run's cases of ``kernel`` for ``impl`` again with the conventions
    and precision found -> (every case passes, the first failure)."""
    def verify(conventions: dict, precision: str | None) -> tuple[bool, str | None]:
        sub = replace(pl, cases=[c for c in pl.cases if c.kernel == kernel], impls={kernel: [impl]}, checks=(),
                      conventions={**pl.conventions, kernel: {**pl.conventions.get(kernel, {}), **conventions}},
                      matmul_precision=precision or pl.matmul_precision, shard=None, planned=None)
        o = parity.execute(sub, iso)
        bad = [v for v in verdicts(report.to_table(o.rows, "hint", "parity", {}))
               if v["impl"] == impl.name and v["passed"] is False]
        if not bad:
            return True, None
        v, w = bad[0], bad[0]["worst"] or {}
        what = f"{w.get('tensor')}.{w.get('metric')} {fmt(w.get('value'))} > {fmt(w.get('threshold'))}" if w \
            else (v["message"] or "failed")
        return False, f"{len(bad)} verdicts fail, first {v['family']} {v['dtype']} {v['shape']} {v['direction']}: {what}"
    return verify


def raised_hint(vs: list[dict], kernel: str, impl) -> str:
    """What a plain function's raising cases have in common, and the flag that may let them run."""
    mine = [v for v in vs if v["impl"] == impl.name and v["kernel"] == kernel and v["direction"] == "fwd"]
    raised = [v for v in mine if v["passed"] is False and v["worst"] is not None and v["worst"]["metric"] == "error"]
    dtypes = sorted({v["dtype"] for v in raised})
    by_dtype = all(v in raised for v in mine if v["dtype"] in dtypes) and len(raised) < len(mine)
    where = f"every {'/'.join(dtypes)} case" if by_dtype else f"{len(raised)} of {len(mine)} cases"
    msg = raised[0]["message"] or ""
    # a call that returned what the contract cannot judge (None, another count of outputs) did not raise
    did = "failed" if msg.startswith(("output ", "returned ")) else "raised"
    hint = f"hint: {short_impl(impl.name)} {did} on {where} of {kernel}: {msg[:300]}"
    fam = get_family(kernel)
    dtype_error = any(w in msg for w in ("scalar type", "dtype", "BFloat16", "Half", "same type"))
    if dtype_error and fam.mapping and impl.backend == "external" and dtypes != ["fp32"]:
        names = ",".join(f"{n}=activation" for n in fam.mapping)
        hint += (f"; if it takes its {', '.join(fam.mapping)} in the activations' dtype, say so: --input-dtypes {names} "
                 "(the reference then sees the same rounded values)")
    return hint


def parity_hint(kernel: str, impl: Impl, short: str, device: str, isolated: bool, transport: str,
                case_timeout: float | None = None, asked: dict | None = None, verify=None) -> str | None:
    """What ``parity`` says under a failed external implementation: a quick identification (fp32,
    the default probes) tells a convention it passes under from a defect. ``asked``: the
    conventions declared with ``--convention`` (an adapter's own are the implementation's).
    ``verify(conventions, precision) -> (passed, first failure)``: the run again with the flags
    found; a flag is offered as passing only where that run passes."""
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
    from mhctool.analyses.identify import claims  # the sentences as identify prints them, each checked
    if not ident.passed:
        line = claims.identification(ident).text
        if line.startswith("no convention fits: "):
            rest = line[len('no convention fits: '):]
            return f"hint: no convention fits {short} on {kernel}: {rest}{'' if 'a defect' in rest else '; a defect'} {how}"
        return f"hint: {short} on {kernel}: {line} {how}"
    best, flags = ident.best, ident.flags()
    prec = claims.precision(ident)
    notes = "; ".join(n for n in (best.note if best.level != "as asked" else None,
                                  prec.text if prec is not None and prec.held else None) if n)
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
    if ident.defect():
        return (f"hint: {short} on {kernel}: {notes}; with that granted the rest of it passes: a defect to fix in "
                f"the kernel, not a convention to declare {how}")
    return f"hint: {short} fails on {kernel} but passes with {flags} ({notes})"


def hints(pl, vs: list[dict], device: str, iso=None, transport: str = "shm", case_timeout=None,
          stop=lambda: False, started=None) -> list[tuple[str, str, str]]:
    """(kernel, implementation, hint) for every outside implementation that failed in a parity run
    of plan ``pl`` with verdicts ``vs``; ``iso``: the run's isolation (the reruns use it);
    ``stop()``: an interrupt; ``started(kernel, name)``: called before each identification (it
    takes seconds to a minute: what the user waits for)."""
    out = []
    for (k, name), kind in failed_externals(vs).items():
        impl = next((i for i in pl.impls.get(k, []) if i.name == name), None)
        if impl is None or stop():
            continue
        if "raised" in kind:
            out.append((k, name, raised_hint(vs, k, impl)))
        if "measured" in kind:
            if started:
                started(k, name)
            out.append((k, name, parity_hint(k, impl, short_impl(name), device, iso is not None, transport,
                                             case_timeout, asked=pl.conventions.get(k),
                                             verify=verifier(pl, k, impl, iso))))
    return [h for h in out if h[2]]
