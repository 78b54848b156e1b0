"""``mhctool bench`` as a run: kernels timed against the memory roofline measured in the same run
(the timing itself is :mod:`mhctool.analyses.timing`'s)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from mhctool.analyses import parity, timing
from mhctool.analyses.runs import Watch
from mhctool.core import environment, report
from mhctool.core.dtypes import parse_dtype
from mhctool.core.errors import UsageError, kept_at_once, system_exit_message
from mhctool.core.library_log import beside, holding
from mhctool.core.shapes import MOE_PAPER_SHAPE, PAPER_SHAPE, MoeShape, parse_shape_for
from mhctool.core.text import split
from mhctool.families import get_family
from mhctool.registry.builtin import impls_for
from mhctool.registry.specs import is_function_spec, resolve_impls
from mhctool.runner.call import short_error
from mhctool.runner.case import check_runnable
from mhctool.spread import setup

INPUT_DTYPES = ("library", "contract")
CPU_SHAPES = {"mhc": "64x2x4x512", "moe": "64x64x96x4"}


@dataclass
class Request:
    kernel: str = "all"
    impls: list[str] = field(default_factory=list)  # empty: every available built-in
    shape: str | None = None  # None: the paper's shape on a GPU, a small one on the CPU
    dtype: str = "bf16"
    directions: list[str] = field(default_factory=lambda: ["fwd", "bwd"])
    repeats: int = 50
    graph: bool = False
    experts: str | None = None  # a grouped-MLP sweep over expert counts, "8,32,128"
    tokens: int = 4096
    hidden: int = 2048
    ffn: int = 1024
    device: str | None = None
    out: Path = Path("mhctool-bench.parquet")
    plot: Path | None = None
    isolate: bool | None = None
    case_timeout: float | None = None
    input_dtypes: str = "library"
    insist: bool = False  # an implementation that keeps ending its process or hanging is timed on every case
    knobs: list[tuple[str, str]] = field(default_factory=list)  # --knob KEY=VALUE: the kernels' knobs timed at


@dataclass
class Measurement:
    """One (kernel, implementation, shape, graph) to time, and why it cannot run here (or None)."""

    kernel: str
    impl: object  # registry.impl.Impl
    shape: object
    graph: bool
    why_not: str | None
    knobs: dict = field(default_factory=dict)  # the family's knobs it is timed at (--knob)


@dataclass
class Outcome:
    rows: list[dict]
    device: str
    dtype: str
    shape_text: str
    copy_bw: float
    matmul_bf16: float
    matmul_tf32: float
    interrupted: bool
    report: Path
    table: object  # pyarrow.Table: the report as written (the figure is drawn from it)
    glue: list[tuple[str, str, str]] = field(default_factory=list)  # (kernel, impl, what its adapter adds)
    library_log: str | None = None  # where the libraries' own output went, where they wrote any

    @property
    def totals(self) -> list:
        return timing.totals(self.rows)

    @property
    def errors(self) -> list[dict]:
        """Rows of a kernel that failed, crashed or hung where it was timed."""
        return [r for r in self.rows if r["metric"] == "error"]

    @property
    def exit_code(self) -> int:
        """130 interrupted, 1 where a kernel failed to run (a refusal or a dtype it does not
        take is a skip, not a failure), else 0."""
        return 130 if self.interrupted else 1 if self.errors else 0


def _shapes(req: Request, kernels: list[str], dev: str) -> tuple[list, object, list[bool]]:
    """(grouped-MLP shapes, the mHC shape, whether to replay graphs) the request asks for."""
    kinds = {get_family(k).shape_kind for k in kernels}
    if req.experts is not None:
        if kinds != {"moe"}:
            raise UsageError("--experts sweeps the grouped-MLP kernels; pick them with --kernel (e.g. grouped_mlp)")
        try:
            counts = [int(v) for v in split([req.experts])]
        except ValueError:
            raise UsageError(f"--experts {req.experts!r} is not a comma-separated list of expert counts") from None
        if not counts or min(counts) < 1:
            raise UsageError(f"--experts {req.experts!r}: every expert count must be at least 1")
        moe = [MoeShape(req.tokens, req.hidden, req.ffn, e) for e in counts]
        graphs = [False, True] if dev == "cuda" else [False]
    else:
        if req.shape and len(kinds) > 1:
            raise UsageError("--shape takes one form per kind of kernel (SxBxNxC for mHC, TxHxFxE for the grouped "
                             "MLP); pick the kernels with --kernel (mhc or moe: every kernel of one kind)")
        moe = ([parse_shape_for("moe", req.shape or (MOE_PAPER_SHAPE if dev == "cuda" else CPU_SHAPES["moe"]))]
               if "moe" in kinds else [])
        graphs = [req.graph]
    mhc = (parse_shape_for("mhc", req.shape or (PAPER_SHAPE if dev == "cuda" else CPU_SHAPES["mhc"]))
           if "mhc" in kinds else None)
    return moe, mhc, graphs


def plan(req: Request, dev: str, dtype: str) -> tuple[list[Measurement], dict, list[bool]]:
    """What to time, checked (a UsageError otherwise), the implementations per kernel, and whether
    CUDA graphs are replayed (both, in an expert sweep on a GPU)."""
    if req.input_dtypes not in INPUT_DTYPES:
        raise UsageError(f"unknown --input-dtypes {req.input_dtypes!r}; accepted: {', '.join(INPUT_DTYPES)}")
    kernels = parity.kernels_of(split([req.kernel]))
    moe, mhc, graphs = _shapes(req, kernels, dev)
    if not req.directions or any(d not in ("fwd", "bwd") for d in req.directions):
        raise UsageError(f"unknown --direction {','.join(req.directions)!r}; accepted: fwd, bwd, fwd,bwd")
    if any(is_function_spec(s) for s in req.impls) and len(kernels) != 1:
        raise UsageError("an external --impl module:function needs one --kernel, not all")
    resolved = {k: resolve_impls(k, req.impls) if req.impls else impls_for(k) for k in kernels}
    targets = [SimpleNamespace(kernel=k, device=dev, dtype=timing.bench_dtype(k, dtype)) for k in kernels]
    if req.impls:  # as in parity: skipped where it cannot run, an error only where it runs nothing
        check_runnable(resolved, targets)
    knobs = kernel_knobs(kernels, req.knobs)
    todo = [Measurement(t.kernel, i, shp, g, i.unsupported(t.device, t.dtype), knobs[t.kernel])
            for t in targets for i in resolved[t.kernel]
            for shp in (moe if get_family(t.kernel).shape_kind == "moe" else [mhc]) for g in graphs]
    return todo, resolved, graphs


def kernel_knobs(kernels: list[str], items: list[tuple[str, str]]) -> dict[str, dict]:
    """``--knob KEY=VALUE`` items -> per kernel, the checked values of the knobs its family has; a
    knob no kernel timed has is a UsageError (as is a value its knob refuses)."""
    from mhctool.analyses.knob_shift import typed_value
    out: dict[str, dict] = {k: {} for k in kernels}
    for name, raw in items:
        takers = [k for k in kernels if name in get_family(k).knobs]
        if not takers:
            raise UsageError(f"--knob {name}: no kernel timed here has it ({', '.join(kernels)})")
        for k in takers:
            knob = get_family(k).knobs[name]
            out[k][name] = knob.check(k, name, typed_value(knob.kind, name, raw))
    return out


def _check_fits(todo: list[Measurement], dev: str, dtype: str) -> int:
    """Refuse up front what cannot fit, with the estimate; the L2 cache's bytes to flush (0: CPU)."""
    worst, worst_shape = max((timing.footprint(m.kernel, m.shape, dtype), m.shape) for m in todo)
    if dev == "cuda":
        free, _ = environment.cuda_mem_info()
        if worst > 0.9 * free:
            raise UsageError(f"--shape {worst_shape} needs about {worst / 2**30:.1f} GiB on the GPU for one kernel; "
                             f"{free / 2**30:.1f} GiB are free")
        return environment.l2_bytes()
    if worst > 2 * 2**30:
        raise UsageError(f"--shape {worst_shape} needs about {worst / 2**30:.1f} GiB; CPU benchmarks take shapes "
                         "under 2 GiB (GPU figures need a GPU)")
    return 0


def measure_one(iso, m: Measurement, direction: str, dtype: str, dev: str, repeats: int, l2: int,
                contract: bool) -> tuple:
    """One timed (kernel, implementation, direction): in-process, or in an isolation worker; a
    kernel that fails, crashes or hangs is an error row and the others are still timed; one that
    keeps ending its process or hanging is stopped (the isolation's streaks, as in parity)."""
    k, i, shp, g = m.kernel, m.impl, m.shape, m.graph
    if iso is None or i.native:
        try:
            return ("ok", k, i, direction, timing.measure(k, i, shp, dtype, dev, repeats, direction, g, l2, 0,
                                                          contract, m.knobs), shp, g)
        except SystemExit as e:
            return ("error", k, i, direction, system_exit_message(e), shp, g)
        except Exception as e:  # a kernel that fails to run is reported, the rest still run
            return ("error", k, i, direction, short_error(e), shp, g)
    value, failure = iso.call(i, "mhctool.analyses.timing:isolated_measure",
                              (k, i.spec or i.name, i.name, shp, dtype, dev, repeats, direction, g, l2, 0, contract,
                               m.knobs),
                              timing.footprint(k, shp, dtype), dev)
    if failure is not None:
        return ("error", k, i, direction, failure.message, shp, g)
    return ("ok", k, i, direction, value, shp, g)


def run(req: Request, watch: Watch = Watch()) -> Outcome:
    """Time the request's kernels and write the report (what was timed before an interrupt too)."""
    report.check_writable(req.out)
    if req.plot is not None:
        report.check_writable(req.plot, "--plot", suffixes=(".png",))
    dev = environment.resolve_device(req.device)
    dtype = parse_dtype(req.dtype).name
    with holding(watch.consoles):  # the implementations' imports: their lines to the library log
        todo, resolved, graphs = plan(req, dev, dtype)
    l2 = _check_fits(todo, dev, dtype)
    if dev != "cuda":
        watch.say("note: no GPU here: CPU timer on a small shape; GPU figures need a GPU")
    copy_bw = timing.copy_bandwidth(dev, (1 << 30) if dev == "cuda" else (1 << 26))
    mm_bf16 = timing.matmul_rate(dev, parse_dtype("bf16").torch_dtype)
    mm_tf32 = timing.matmul_rate(dev, parse_dtype("fp32").torch_dtype)
    s = setup.prepare(dev, specs=req.impls, isolate=req.isolate, case_timeout=req.case_timeout, insist=req.insist,
                      pin_threads=False,
                      library_log=beside(req.out), consoles=watch.consoles,
                      say=watch.say)
    watch.planned(len(todo) * len(req.directions))
    results = []
    with s.running(), kept_at_once():  # a second signal abandons the timing in hand; the others are kept
        for m in todo:
            for d in req.directions:
                if s.interrupts.requested:
                    break
                what = f"{m.kernel} {m.shape} {m.impl.name} {d}{' graph' if m.graph else ''}"
                watch.started(what, what)
                results.append(("skip", m.kernel, m.impl, d, m.why_not, m.shape, m.graph) if m.why_not else
                               measure_one(s.isolation, m, d, dtype, dev, req.repeats, l2,
                                           req.input_dtypes == "contract"))
                watch.finished()
    rows = timing.rows(results, dev, copy_bw, mm_bf16, mm_tf32)
    shape_text = ", ".join(dict.fromkeys(str(m.shape) for m in todo))
    settings = {"command": "bench", "shape": shape_text, "dtype": dtype, "device": dev, "repeats": req.repeats,
                "graph": graphs, "copy_bandwidth_Bps": copy_bw,
                "matmul_bf16_flops": mm_bf16, "matmul_tf32_flops": mm_tf32, "isolate": s.isolation is not None,
                "input_dtypes": req.input_dtypes, "knobs": dict(req.knobs), "interrupted": s.interrupts.requested}
    table = report.to_table(rows, report.new_run_id(), "bench", environment.metadata(), settings,
                            schema=report.BENCH_SCHEMA)
    path = report.write_atomic(table, req.out)
    glue = [(k, i.name, i.glue) for k, impls in resolved.items() for i in impls  # timed with the library's call
            if i.glue and any(r["impl"] == i.name for r in rows)]
    return Outcome(rows, dev, dtype, shape_text, copy_bw, mm_bf16, mm_tf32, s.interrupts.requested, path, table, glue,
                   s.library_log)
