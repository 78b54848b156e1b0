"""``mhctool stability sinkhorn|eps|overflow|gain`` as runs: where and why a computation breaks
(the sweeps are :mod:`mhctool.analyses.stability`'s, :mod:`~mhctool.analyses.knob_shift`'s,
:mod:`~mhctool.analyses.overflow`'s and :mod:`~mhctool.analyses.gain`'s). Each run writes its
report once and returns its rows with what the command's table needs."""
from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from mhctool.analyses import gain as gn
from mhctool.analyses import knob_shift as ks
from mhctool.analyses import overflow as ov
from mhctool.analyses import stability as st
from mhctool.analyses.runs import Stopped, Watch, stop_point
from mhctool.core import environment, report
from mhctool.core.dtypes import parse_dtype
from mhctool.core.errors import Interrupted, UsageError, abandonable
from mhctool.families import get_family, input_family
from mhctool.registry.builtin import impls_for, native_impl
from mhctool.registry.impl import Impl
from mhctool.registry.specs import resolve_impls
from mhctool.spread.setup import Interrupts


@dataclass
class Outcome:
    """A sweep's rows and the report written; ``extra``: what the sweep's table and figures need
    beside the rows (its spec, summary or change); ``interrupted``: a signal stopped it, and the
    report holds the stages measured before."""

    rows: list[dict]
    report: Path
    table: object  # pyarrow.Table: the report as written (figures are drawn from it)
    extra: dict = field(default_factory=dict)
    interrupted: bool = False

    @property
    def exit_code(self) -> int:
        return 130 if self.interrupted else 0


@contextmanager
def stoppable(watch: Watch):
    """SIGINT and SIGTERM during a sweep: the stage in hand finishes, the next one is not started,
    and what was measured is written (marked interrupted); a second signal abandons the stage in
    hand and the stages done are written all the same. Yields
    ``(stage, interrupts)``: ``stage(what)`` starts a stage, or raises where a signal came."""
    ints = Interrupts(watch.say)

    def stage(what: str) -> None:
        stop_point(ints)
        _stage(watch, what)
    with ints:
        try:
            with abandonable():
                yield stage, ints
        except (Stopped, Interrupted):  # a second signal abandons the stage in hand; the stages done are kept
            pass


def impls_of(kernel: str, specs: list[str], default: str) -> list[Impl]:
    """``specs`` resolved and usable here; without specs, the native one (``default="native"``) or
    every available built-in one (``default="all"``)."""
    if specs:
        impls = resolve_impls(kernel, specs)
        for i in impls:
            if why := i.unavailable():
                raise UsageError(f"--impl {i.name} cannot run here: {why}")
        return impls
    if default == "native":
        return [native_impl(kernel)]
    return [i for i in impls_for(kernel) if i.default and not i.unavailable()]


def runnable(impls: list[Impl], dtypes, device: str) -> None:
    """Every implementation runs every dtype here, or the sweep is bad input (before it starts)."""
    for i in impls:
        for dt in dtypes:
            if why := i.unsupported(device, dt):
                raise UsageError(f"--impl {i.name} cannot run {dt} on {device}: {why}")


def _stage(watch: Watch, what: str) -> None:
    """A sweep's stage starts (the progress counts stages: a sweep does not know how many ahead)."""
    watch.started(what, what)
    watch.finished()


def dtypes_of(values: list[str], default: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(parse_dtype(v).name for v in values) if values else default


def _outputs(out: Path, plot: Path | None) -> None:
    report.check_writable(out)
    if plot:
        report.check_folder(plot)


def _write(rows: list[dict], kind: str, run: dict, schema, out: Path, interrupted: bool = False):
    table = report.to_table(rows, report.new_run_id(), kind, environment.metadata(), {**run, "interrupted": interrupted},
                            schema=schema)
    return table, report.write_atomic(table, out)


@dataclass
class SinkhornRequest:
    impls: list[str] = field(default_factory=list)
    quick: bool = False
    scales: str | None = None
    iters: list[str] = field(default_factory=list)
    families: list[str] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)
    device: str | None = None
    out: Path = Path("mhctool-stability.parquet")
    plot: Path | None = None


def sinkhorn(req: SinkhornRequest, watch: Watch = Watch()) -> Outcome:
    """Sweep logit amplitude, family, dtype, stabilize, eps, eps_mode, order and iterations."""
    _outputs(req.out, req.plot)
    dev = environment.resolve_device(req.device)
    spec = st.quick_spec() if req.quick else st.full_spec()
    if req.scales:
        spec = dataclasses.replace(spec, scales=st.parse_range(req.scales, "--scales"))
    if req.iters:
        spec = dataclasses.replace(spec, iters=st.parse_iters(req.iters))
    for f in req.families:
        input_family("sinkhorn", f)
    if req.families:
        spec = dataclasses.replace(spec, families=tuple(req.families))
    spec = dataclasses.replace(spec, dtypes=dtypes_of(req.dtypes, spec.dtypes))
    impls = impls_of("sinkhorn", req.impls, "all")
    if req.quick and not req.impls:
        impls = [i for i in impls if i.native]  # the interpreter is too slow for a one-minute sweep
    rows: list[dict] = []
    with stoppable(watch) as (stage, ints):
        st.sinkhorn_sweep(impls, spec, dev, stage, rows)
    table, path = _write(rows, "stability", {"command": "stability sinkhorn", "quick": req.quick, "device": dev,
                                             "impls": [i.name for i in impls], "converged_iters": st.CONVERGED_ITERS},
                         report.STABILITY_SCHEMA, req.out, ints.requested)
    return Outcome(rows, path, table, {"spec": spec, "first_nonfinite": st.first_nonfinite(rows)}, ints.requested)


@dataclass
class EpsRequest:
    kernel: str
    frm: str | None = None
    to: str | None = None
    knob: str | None = None
    families: list[str] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)
    impls: list[str] = field(default_factory=list)
    depth: int = 12
    seed: int = 0
    device: str | None = None
    out: Path = Path("mhctool-eps.parquet")
    plot: Path | None = None


def eps(req: EpsRequest, watch: Watch = Watch()) -> Outcome:
    """What changing one knob (eps by default) does: per input family at the kernel, and through a
    stack of ``depth`` layers."""
    _outputs(req.out, req.plot)
    get_family(req.kernel)
    change = ks.parse_change(req.kernel, req.knob, req.frm, req.to)
    if not 1 <= req.depth <= 1000:
        raise UsageError(f"--depth {req.depth} is not a possible stack depth; give 1 to 1000 layers")
    dev = environment.resolve_device(req.device)
    fams = req.families or list(ks.STACK_FAMILIES[req.kernel])
    for f in fams:
        if f not in ks.STACK_FAMILIES[req.kernel]:
            raise UsageError(f"unknown input family {f!r} for stability eps on {req.kernel}; accepted: "
                             + ", ".join(ks.STACK_FAMILIES[req.kernel]))
    dtypes = dtypes_of(req.dtypes, ("fp32", "bf16"))
    impls = impls_of(req.kernel, req.impls, "native")
    runnable(impls, dtypes, dev)
    rows: list[dict] = []
    with stoppable(watch) as (stage, ints):
        for f in fams:
            for dt in dtypes:
                for i in impls:
                    stage(f"{f} {dt} {i.name}")
                    rows += ks.kernel_shift(change, i, f, dt, dev, req.seed)
                stage(f"{f} {dt} stack of {req.depth}")
                rows += ks.stack_shift(change, f, dt, req.depth, req.seed)
    common = dict(kernel=req.kernel, knob=change.knob, setting_a=repr(change.a), setting_b=repr(change.b))
    rows = [{**common, **r} for r in rows]
    table, path = _write(rows, "stability-eps", {"command": "stability eps", "device": dev, "depth": req.depth,
                                                 "impls": [i.name for i in impls], "change": change.label},
                         report.KNOB_SHIFT_SCHEMA, req.out, ints.requested)
    return Outcome(rows, path, table, {"change": change}, ints.requested)


@dataclass
class OverflowRequest:
    kernel: str
    family: str = "random"
    scales: str | None = None
    knobs: list[str] = field(default_factory=list)  # NAME=VALUE items
    dtypes: list[str] = field(default_factory=list)
    impl: str | None = None
    quick: bool = False
    device: str | None = None
    out: Path = Path("mhctool-overflow.parquet")
    plot: Path | None = None


def overflow_knobs(kernel: str, items: list[str]) -> dict:
    """The kernel's passed knobs at their defaults, with ``items`` (NAME=VALUE) checked over them."""
    fam = get_family(kernel)
    knobs = {k: v.default for k, v in fam.knobs.items() if v.passed}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or name not in knobs:
            raise UsageError(f"--knob {item!r}: give NAME=VALUE with NAME one of {', '.join(knobs) or '(none)'}")
        knobs[name] = fam.knobs[name].check(kernel, name, ks.typed_value(fam.knobs[name].kind, name, value))
    return knobs


def overflow(req: OverflowRequest, watch: Watch = Watch()) -> Outcome:
    """Headroom to the dtype's largest finite value of every intermediate as the input scale grows."""
    _outputs(req.out, req.plot)
    ov.check_kernel(req.kernel)
    input_family(req.kernel, req.family)
    knobs = overflow_knobs(req.kernel, req.knobs)
    dev = environment.resolve_device(req.device)
    dtypes = dtypes_of(req.dtypes, ("fp32", "bf16", "fp16"))
    grid = (st.parse_range(req.scales, "--scales") if req.scales else
            ov.default_scales(req.kernel, 12 if req.quick else 45))
    (im,) = impls_of(req.kernel, [req.impl] if req.impl else [], "native")
    rows: list[dict] = []
    with stoppable(watch) as (stage, ints):
        ov.sweep(req.kernel, im, req.family, dtypes, grid, knobs, dev, progress=stage, rows=rows)
    table, path = _write(rows, "stability-overflow", {"command": "stability overflow", "device": dev, "impl": im.name,
                                                      "knobs": knobs, "family": req.family},
                         report.OVERFLOW_SCHEMA, req.out, ints.requested)
    return Outcome(rows, path, table, {"summary": ov.summary(rows), "knobs": knobs, "dtypes": dtypes, "impl": im.name},
                   ints.requested)


@dataclass
class GainRequest:
    depth: int = 64
    iters: list[str] = field(default_factory=list)
    hc_scale: float = 0.3
    family: str = "random"
    tokens: int = 256
    n: int = 4
    impls: list[str] = field(default_factory=list)
    dtype: str = "fp32"
    seed: int = 0
    device: str | None = None
    out: Path = Path("mhctool-gain.parquet")
    plot: Path | None = None


def gain(req: GainRequest, watch: Watch = Watch()) -> Outcome:
    """Amax gain of the composite H_res over depth: Sinkhorn configurations against unconstrained HC."""
    _outputs(req.out, req.plot)
    if not 1 <= req.depth <= 10_000:
        raise UsageError(f"--depth {req.depth} is not a possible depth; give 1 to 10000 layers")
    if not 1 <= req.tokens <= 1 << 20 or not 2 <= req.n <= 16:
        raise UsageError(f"--tokens {req.tokens} / --n {req.n}: give 1 to 1048576 tokens and 2 to 16 streams")
    if not req.hc_scale > 0:
        raise UsageError(f"--hc-scale {req.hc_scale:g} must be positive")
    input_family("sinkhorn", req.family)
    counts = st.parse_iters(req.iters) if req.iters else (1, 3, 5, 20)
    dt = parse_dtype(req.dtype).name
    dev = environment.resolve_device(req.device)
    impls = impls_of("sinkhorn", req.impls, "native")
    layers = gn.layer_logits(req.family, req.depth, req.tokens, req.n, req.seed)
    runnable(impls, (dt,), dev)
    rows: list[dict] = []
    with stoppable(watch) as (stage, ints):
        for i in impls:
            for it in counts:
                stage(f"{i.name} iters={it}")
                rows += [{**r, "impl": i.name, "dtype": dt}
                         for r in gn.composite_gain(gn.GainConfig("sinkhorn", it), layers, i, dt, dev)]
        stage("unconstrained HC (float64)")
        rows += [{**r, "impl": "reference", "dtype": "fp64"}
                 for r in gn.composite_gain(gn.GainConfig("hc", hc_scale=req.hc_scale), layers, None, "fp64", "cpu")]
    table, path = _write(rows, "stability-gain", {"command": "stability gain", "device": dev, "family": req.family,
                                                  "tokens": req.tokens, "n": req.n, "hc_scale": req.hc_scale},
                         report.GAIN_SCHEMA, req.out, ints.requested)
    return Outcome(rows, path, table, interrupted=ints.requested)
