"""Suites -> verdicts, JUnit XML, Markdown summary: mhctool's checks as one CI gate.

A suite (TOML)::

    name = "my-gate"

    [[parity]]                      # any number: a parity run, one JUnit case per verdict
    name = "fused-sinkhorn"         # optional
    kernel = "sinkhorn"             # a kernel, a group (all, mhc, moe) or a comma-separated list
    impls = ["triton"]              # default: every built-in one available here; file.py:fn
                                    # paths are relative to the suite file
    scenario = "parity-default"     # built-in name or TOML path (relative to the suite file)
    dtypes = ["fp32"]               # optional override
    device = "cpu"                  # optional (default: cuda when present)
    kappa = 2.0                     # optional
    checks = ["determinism"]        # optional: determinism, batch-invariance (bits, see repro.py)
    conventions = { iters = 10 }    # optional: what the external implementations compute (--convention)
    input_dtypes = { h_pre = "activation" }   # optional: the dtypes they take inputs in (--input-dtypes)

    [[goldens]]                     # any number: Megatron's golden-value checks, one case per metric
    golden = "golden.json"          # paths relative to the suite file
    actual = "run.json"             # a golden-format file, or a training log (.log / .txt)
    metrics = ["lm loss", "num-zeros"]   # optional
    deterministic = false           # optional: add the exact check
    rtol = { "num-zeros" = 0.2 }    # optional per-metric overrides

    [[goldens_check]]               # any number: anomalies inside one run (fails on any)
    file = "run.json"

    [[train]]                       # any number: mhctool train, its golden values diffed against stored ones
    impls = ["triton"]              # as mhctool train's --impl (file.py:fn relative to the suite file)
    golden = "train-golden.json"    # the stored golden values (Megatron's rules, as [[goldens]])
    steps = 6                       # optional: steps, layers, streams, hidden, heads, seq, batch, vocab,
    layers = 2                      #   lr, dtype, seed (mhctool train's defaults otherwise)
    metrics = ["lm loss", "num-zeros"]   # optional; deterministic, rtol as in [[goldens]]
    compare = true                  # optional: also train natively and in float64; the drift is one more case

    [[stability]]                   # any number: a Sinkhorn stability sweep, one case per configuration
    kernel = "sinkhorn"             # the only kernel with a sweep so far
    impls = ["torch"]               # default: the native implementation
    quick = true                    # the CPU-sized sweep (default true)
    finite = ["rowmax"]             # stabilize settings that must stay finite at every amplitude
    dtypes = ["fp32", "bf16"]       # ... in these dtypes
    iters = [20]                    # optional: the iteration counts (default: the sweep's)

    [[step]]                        # any number: bench --engine's training step, one case per variant
    engine = "megatron:.anchors/megatron-core/m3828"   # or FILE.py:function (relative to the suite file)
    max_overhead = 10               # percent: each variant's step over the baseline's (no hyper-connections)
    impls = ["triton"]              # optional (default: triton and cutile on a GPU, torch on a CPU)
    variants = ["native", "triton"] # optional (default: native, fused and each impl)
    recipe = { layers = 2, hidden = 128 }   # optional: the recipe's options (bench --engine --recipe)
    steps = 5                       # optional: timed steps (default 5), after warmup (default 2)
"""
from __future__ import annotations

import contextlib
import os
import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field, replace
from pathlib import Path

from mhctool.analyses import goldens as G
from mhctool.analyses import parity
from mhctool.analyses import scenario as scenario_mod
from mhctool.analyses import stability as st
from mhctool.analyses import train as T
from mhctool.analyses.hints import hints
from mhctool.analyses.train import engine as E
from mhctool.analyses.train import step_bench as SB
from mhctool.core import profile
from mhctool.core.combine import stable
from mhctool.core.dtypes import parse_dtype
from mhctool.core.errors import UsageError, kept_at_once
from mhctool.core.findings import judged_nothing, verdicts
from mhctool.core.report import to_table
from mhctool.families import get_family
from mhctool.registry.specs import resolve_impls
from mhctool.runner.checks import parse_checks
from mhctool.spread import pool
from mhctool.spread.isolation import Worker

SUITE_KEYS = {"name", "description", "parity", "goldens", "goldens_check", "stability", "train", "step"}
STABILITY_KEYS = {"name", "kernel", "impls", "quick", "device", "finite", "dtypes", "iters"}
PARITY_KEYS = {"name", "kernel", "impls", "scenario", "dtypes", "device", "kappa", "checks", "conventions",
               "input_dtypes"}
GOLDEN_KEYS = {"name", "golden", "actual", "metrics", "deterministic", "rtol"}
CHECK_KEYS = {"name", "file", "factor"}
TRAIN_CONFIG_KEYS = {"steps", "layers", "streams", "hidden", "heads", "seq", "batch", "vocab", "lr", "dtype", "seed"}
TRAIN_KEYS = {"name", "impls", "kernel", "golden", "metrics", "deterministic", "rtol", "compare", "device", "knobs",
              "conventions", "seeds"} | TRAIN_CONFIG_KEYS
STEP_KEYS = {"name", "engine", "impls", "variants", "recipe", "max_overhead", "device", "steps", "warmup"}


@dataclass
class Case:
    suite_item: str  # the suite entry's name
    kind: str  # parity, goldens, goldens_check
    name: str
    passed: bool | None  # None: skipped
    message: str = ""
    unit: int = 0  # the suite's unit it came from (a parity case, or a whole other entry): merge order
    hint: str = ""  # a failed outside implementation's hint (parity's), on each of its failed cases


@dataclass
class Suite:
    name: str
    path: Path
    parity: list[dict] = field(default_factory=list)
    goldens: list[dict] = field(default_factory=list)
    checks: list[dict] = field(default_factory=list)
    stability: list[dict] = field(default_factory=list)
    train: list[dict] = field(default_factory=list)
    step: list[dict] = field(default_factory=list)


def _err(src, key, msg):
    return UsageError(f"{src}: {key}: {msg}")


def _strings(v) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _integer(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# what each key of an entry holds, and an example of it (a value of another type is bad input)
KEY_TYPES = {
    "name": (lambda v: isinstance(v, str), 'name = "sinkhorn-fp32"'),
    "kernel": (lambda v: isinstance(v, str), 'kernel = "sinkhorn"'),
    "scenario": (lambda v: isinstance(v, str), 'scenario = "parity-default"'),
    "device": (lambda v: isinstance(v, str), 'device = "cpu"'),
    "dtypes": (_strings, 'dtypes = ["fp32", "bf16"]'),
    "kappa": (_number, "kappa = 2"),
    "metrics": (_strings, 'metrics = ["lm loss", "num-zeros"]'),
    "deterministic": (lambda v: isinstance(v, bool), "deterministic = true"),
    "factor": (_number, "factor = 5"),
    "quick": (lambda v: isinstance(v, bool), "quick = true"),
    "finite": (_strings, 'finite = ["rowmax"]'),
    "compare": (lambda v: isinstance(v, bool), "compare = true"),
    "knobs": (lambda v: isinstance(v, dict), 'knobs = { "sinkhorn.eps" = 1e-6 }'),
    "seeds": (_integer, "seeds = 4"), "steps": (_integer, "steps = 20"), "layers": (_integer, "layers = 2"),
    "streams": (_integer, "streams = 4"), "hidden": (_integer, "hidden = 32"), "heads": (_integer, "heads = 2"),
    "seq": (_integer, "seq = 16"), "batch": (_integer, "batch = 2"), "vocab": (_integer, "vocab = 64"),
    "seed": (_integer, "seed = 0"), "lr": (_number, "lr = 0.01"), "dtype": (lambda v: isinstance(v, str), 'dtype = "fp32"'),
    "engine": (lambda v: isinstance(v, str), 'engine = "megatron:.anchors/megatron-core/m3828"'),
    "variants": (_strings, 'variants = ["native", "triton"]'), "recipe": (lambda v: isinstance(v, dict), "recipe = { layers = 2 }"),
    "max_overhead": (_number, "max_overhead = 10  # percent"), "warmup": (_integer, "warmup = 3"),
}


def _check_keys(src: str, where: str, item: dict, allowed: set, required: tuple = (), types: dict | None = None) -> None:
    """An entry's keys: one it does not know, a required one missing, or a value of another type
    than the key takes is a UsageError naming the key and what it takes."""
    bad = set(item) - allowed
    if bad:
        raise _err(src, f"{where}.{sorted(bad)[0]}", f"unknown key; accepted: {', '.join(sorted(allowed))}")
    for k in required:
        if k not in item:
            raise _err(src, f"{where}.{k}", "required")
    for k, v in item.items():
        ok, example = {**KEY_TYPES, **(types or {})}.get(k, (None, None))
        if ok is not None and not ok(v):
            raise _err(src, f"{where}.{k}", f"{v!r} is a {type(v).__name__}, not what the key takes: e.g. {example}")


def _resolve(base: Path, p: str, src: str, key: str) -> Path:
    path = (base / p) if not Path(p).is_absolute() else Path(p)
    if not path.is_file():
        raise _err(src, key, f"no file {path}")
    return path


def load_suite(path: str | os.PathLike) -> Suite:
    path = Path(path)
    data = scenario_mod.read_toml(path, "suite")
    src, base = str(path), path.parent
    unknown = set(data) - SUITE_KEYS
    if unknown:
        raise _err(src, sorted(unknown)[0], f"unknown key; accepted: {', '.join(sorted(SUITE_KEYS))}")
    suite = Suite(str(data.get("name", path.stem)), path)
    for i, item in enumerate(data.get("parity", [])):
        where = f"parity[{i}]"
        _check_keys(src, where, item, PARITY_KEYS, types={"impls": (_strings, 'impls = ["triton", "mine.py:sinkhorn"]')})
        kernel = item.get("kernel", "all")
        try:  # a name, a group (all, mhc, moe) or a comma-separated list, as --kernel takes
            parity.kernels_of(kernel)
        except UsageError as e:
            raise _err(src, f"{where}.kernel", str(e)) from None
        impls = [_impl_spec(base, spec) for spec in item.get("impls", [])]
        if impls:
            item = {**item, "impls": impls}
        sc = item.get("scenario")
        if sc and (sc.endswith(".toml") or "/" in sc):
            item = {**item, "scenario": str(_resolve(base, sc, src, f"{where}.scenario"))}
        for d in item.get("dtypes", []):
            try:
                parse_dtype(d)
            except UsageError as e:
                raise _err(src, f"{where}.dtypes", str(e)) from None
        try:
            checks = item.get("checks", [])
            if not isinstance(checks, list):
                raise UsageError(f"must be a list, e.g. checks = [\"determinism\"], got {checks!r}")
            parse_checks(checks)
        except (UsageError, TypeError) as e:
            raise _err(src, f"{where}.checks", str(e)) from None
        for key in ("conventions", "input_dtypes"):
            if not isinstance(item.get(key, {}), dict):
                raise _err(src, f"{where}.{key}", f"must be a table, e.g. {key} = {{ "
                           + ('iters = 10' if key == 'conventions' else 'h_pre = "activation"') + " }")
        try:
            kernels = parity.kernels_of(kernel)
            declared = {k: parity.check_conventions(k, {n: v for n, v in item.get("conventions", {}).items()
                                                        if n in get_family(k).conventions})
                        for k in kernels}
            dtypes_in = {k: parity.check_input_dtypes(k, {n: v for n, v in item.get("input_dtypes", {}).items()
                                                          if n in get_family(k).inputs})
                         for k in kernels}
            for key, taken in (("conventions", {n for d in declared.values() for n in d}),
                               ("input_dtypes", {n for d in dtypes_in.values() for n in d})):
                unknown_names = set(item.get(key, {})) - taken
                if unknown_names:
                    raise UsageError(f"{sorted(unknown_names)[0]} is no {'convention' if key == 'conventions' else 'input'}"
                                     f" of {kernel}")
        except UsageError as e:
            raise _err(src, f"{where}.conventions", str(e)) from None
        item = {**item, "conventions": {k: v for k, v in declared.items() if v},
                "input_dtypes": {k: v for k, v in dtypes_in.items() if v}}
        suite.parity.append({"name": item.get("name", f"parity-{kernel}"), **item})
    for i, item in enumerate(data.get("goldens", [])):
        where = f"goldens[{i}]"
        _check_keys(src, where, item, GOLDEN_KEYS, ("golden", "actual"))
        g, a = _resolve(base, item["golden"], src, f"{where}.golden"), _resolve(base, item["actual"], src, f"{where}.actual")
        suite.goldens.append({"name": item.get("name", f"{g.name} vs {a.name}"), **item, "golden": g, "actual": a})
    for i, item in enumerate(data.get("goldens_check", [])):
        where = f"goldens_check[{i}]"
        _check_keys(src, where, item, CHECK_KEYS, ("file",))
        f = _resolve(base, item["file"], src, f"{where}.file")
        suite.checks.append({"name": item.get("name", f"check {f.name}"), **item, "file": f})
    for i, item in enumerate(data.get("stability", [])):
        where = f"stability[{i}]"
        _check_keys(src, where, item, STABILITY_KEYS, types={"impls": (_strings, 'impls = ["triton"]')})
        if item.get("kernel", "sinkhorn") != "sinkhorn":
            raise _err(src, f"{where}.kernel", f"{item['kernel']!r} has no stability sweep; accepted: sinkhorn")
        for d in item.get("dtypes", []):
            try:
                parse_dtype(d)
            except UsageError as e:
                raise _err(src, f"{where}.dtypes", str(e)) from None
        iters = item.get("iters", [])
        if not isinstance(iters, list) or not all(isinstance(i, int) and 1 <= i <= st.MAX_ITERS for i in iters):
            raise _err(src, f"{where}.iters", f"{iters!r} is not a list of iteration counts from 1 to {st.MAX_ITERS}")
        for f in item.get("finite", []):
            if f not in ("rowmax", "none", "softmax"):
                raise _err(src, f"{where}.finite", f"unknown stabilize {f!r}; accepted: rowmax, none, softmax")
        suite.stability.append({"name": item.get("name", f"stability-{i}"), **item})
    for i, item in enumerate(data.get("train", [])):
        where = f"train[{i}]"
        _check_keys(src, where, item, TRAIN_KEYS, ("impls", "golden"))
        impls = item["impls"] if isinstance(item["impls"], list) else [item["impls"]]
        item = {**item, "impls": [_impl_spec(base, spec) for spec in impls],
                "golden": _resolve(base, item["golden"], src, f"{where}.golden")}
        try:
            T.config(item.get("device", "cpu"), **{k: item[k] for k in TRAIN_CONFIG_KEYS if k in item})
            T.assign(item["impls"], item.get("kernel"))
            for key in ("knobs", "conventions"):
                T.parse_knobs([(k, str(v).lower() if isinstance(v, bool) else str(v))
                               for k, v in item.get(key, {}).items()], key, key == "conventions")
        except UsageError as e:
            raise _err(src, where, str(e)) from None
        suite.train.append({"name": item.get("name", f"train-{'+'.join(item['impls'])}"), **item})
    for i, item in enumerate(data.get("step", [])):
        suite.step.append(_step_entry(src, base, f"step[{i}]", item))
    if not (suite.parity or suite.goldens or suite.checks or suite.stability or suite.train or suite.step):
        raise _err(src, "parity", "the suite has no [[parity]], [[goldens]], [[goldens_check]], [[stability]], "
                   "[[train]] or [[step]] entry")
    return suite


def _step_entry(src: str, base: Path, where: str, item: dict) -> dict:
    """A [[step]] entry checked: its engine (a path relative to the suite file), recipe options,
    implementations and variants, and the overhead budget in percent."""
    _check_keys(src, where, item, STEP_KEYS, ("engine", "max_overhead"),
                types={"impls": (_strings, 'impls = ["triton"]')})
    engine = item["engine"]
    kind, sep, rest = engine.partition(":")
    if kind == "megatron" and sep and rest and not Path(rest).is_absolute():
        engine = f"megatron:{(base / rest).resolve()}"
    elif kind != "megatron":
        engine = _impl_spec(base, engine)
    impls = [_impl_spec(base, spec) for spec in item.get("impls", [])]
    try:
        E.parse_engine(engine)
        recipe = SB.base_recipe([(k, str(v).lower() if isinstance(v, bool) else str(v))
                                 for k, v in item.get("recipe", {}).items()])
        SB.check_variants(SB.variants(impls or ["torch"], E.assign), item.get("variants", []))
    except UsageError as e:
        raise _err(src, where, str(e)) from None
    # named as the suite writes the engine (relative to its folder), never by a resolved path
    return {"name": item.get("name", f"step-{item['engine']}"), **item, "engine": engine, "impls": impls,
            "recipe": recipe}


def read_run(path: Path) -> G.Golden:
    """A golden-format JSON file, or a training log."""
    if path.suffix in (".log", ".txt"):
        return G.extract_log(path)
    return G.load(path)


def _impl_spec(base: Path, spec: str) -> str:
    """``file.py:function`` in a suite is relative to the suite file, like its other paths."""
    target, sep, fn = spec.rpartition(":")
    if sep and (target.endswith(".py") or "/" in target) and not Path(target).is_absolute():
        return f"{(base / target).resolve()}:{fn}"
    return spec


def run_suite(suite: Suite, device_default: str, progress=None, isolation=None,
              interrupted=lambda: False, shard: tuple[int, int] | None = None, workers: int | str = 1,
              backend: str = "local", ray_address: str | None = None, timings: dict | None = None) -> list[Case]:
    """Run every entry; returns one JUnit case per verdict, metric check or configuration.
    ``isolation``: the runner's Isolation for the implementations under test (a crash fails its
    entry's case and the suite goes on); ``interrupted()`` true: no new case or entry starts.

    The suite is a list of units, numbered in the order they run: every case of every parity
    entry, then each goldens, stability, train, step and goldens_check entry whole. ``shard`` (I, N) runs the
    units whose number is I-1 modulo N; each JUnit case carries its unit, so ``mhctool report
    merge`` puts the slices back in the order one run has. ``workers``/``backend``: parity cases
    spread over processes (:mod:`mhctool.spread.pool`). ``timings``: the parity entries' phases are added
    to it (:mod:`mhctool.core.profile`)."""
    cases: list[Case] = []
    unit = 0

    def mine(k: int) -> bool:
        return shard is None or k % shard[1] == shard[0] - 1

    def whole(items):  # (unit, entry) of the entries that are one unit each, this slice's ones
        nonlocal unit
        for item in items:
            unit += 1
            if interrupted():
                return
            if mine(unit - 1):
                yield unit - 1, item

    with kept_at_once():  # a second signal: the entry in hand is abandoned, the cases found so far kept
        with contextlib.ExitStack() as stack:
            pools: dict = {}  # device -> the pool of workers every parity entry on it shares (each starts once)
            for item in suite.parity:
                if interrupted():
                    break
                dtypes = [parse_dtype(d).name for d in item.get("dtypes", [])] or None
                plan = parity.plan(parity.kernels_of(item.get("kernel", "all")), item.get("impls"),
                                   device=item.get("device", device_default), scenario=item.get("scenario"),
                                   dtypes=dtypes, kappa=float(item["kappa"]) if "kappa" in item else None,
                                   checks=item.get("checks"), strict=False, conventions=item.get("conventions"),
                                   input_dtypes=item.get("input_dtypes"))
                units = {c.case_id: unit + j for j, c in enumerate(plan.cases)}
                unit += len(plan.cases)
                plan = replace(plan, cases=[c for c in plan.cases if mine(units[c.case_id])])
                if not plan.cases:
                    continue
                device = plan.cases[0].device
                n = pool.worker_count(workers, device, len(plan.cases))
                if n > 1 and backend == "local" and device not in pools:  # one pool a device for every entry
                    pools[device] = stack.enter_context(pool.Pool(pool.worker_count(workers, device, 1 << 30), device))
                outcome = parity.execute(plan, isolation, interrupted,
                                         progress and (lambda c: progress(f"{item['name']}: {c.kernel} {c.family} {c.dtype}")),
                                         n, backend, ray_address=ray_address, pool=pools.get(device),
                                         insist=isolation is not None and isolation.insist)
                item_rows = outcome.rows
                if timings is not None:
                    profile.add(timings, outcome.timings)
                table = to_table(item_rows, "gate", "parity", {})
                for v in verdicts(table):
                    if v["impl"] == "torch" and item.get("impls") and "torch" not in item["impls"]:
                        continue  # the baseline ran, but the entry did not ask for it
                    w = v["worst"] or {}
                    label = (f"{v['kernel']}/{v['impl']}/{v['family']}/{v['dtype']}/{v['shape']}"
                             f"{'/' + v['knobs'] if v['knobs'] != '{}' else ''}/{v['direction']}")
                    msg = v["message"] or (f"worst {w.get('tensor')}.{w.get('metric')} = {w.get('value'):.3g} "
                                           f"(threshold {w.get('threshold'):.3g}, {w.get('rule')})" if w else "")
                    cases.append(Case(item["name"], "parity", label, v["passed"], msg, units[v["case_id"]]))
                if not interrupted():
                    _hinted(cases, item["name"], plan, table, isolation)
                for spec, why in judged_nothing(table, parity.asked_outside(plan)).items():
                    # asked for and judged on no case: no pass (the native rows are no verdict on it)
                    cases.append(Case(item["name"], "parity", f"{item.get('kernel', 'all')}/{spec}/judged",
                                      False, f"judged on no case: every row of it was skipped ({why})",
                                      units[plan.cases[0].case_id]))
        for k, item in whole(suite.goldens):
            metrics = item.get("metrics")
            for v in G.diff(read_run(item["golden"]), read_run(item["actual"]), metrics, item.get("rtol"),
                            bool(item.get("deterministic", False))):
                cases.append(Case(item["name"], "goldens", f"{v.metric} ({v.check})", v.passed, v.message, k))
        for k, item in whole(suite.stability):
            spec = st.quick_spec() if item.get("quick", True) else st.full_spec()
            dtypes = tuple(parse_dtype(d).name for d in item.get("dtypes", [])) or spec.dtypes
            spec = replace(spec, dtypes=dtypes, iters=tuple(sorted(set(item.get("iters") or spec.iters))))
            impls = resolve_impls("sinkhorn", item.get("impls") or ["torch"])
            rows_ = st.sinkhorn_sweep(impls, spec, item.get("device", device_default), progress)
            finite = set(item.get("finite", ["rowmax"]))
            for f in st.first_nonfinite(rows_):
                if f["stabilize"] not in finite:
                    continue
                label = f"{f['impl']}/{f['family']}/{f['dtype']}/{f['stabilize']}/eps={f['eps']:g}/{f['eps_mode']}/{f['order']}/iters={f['iters']}"
                ok = f["first_nonfinite_scale"] is None
                cases.append(Case(item["name"], "stability", label, ok,
                                  "finite at every amplitude" if ok else
                                  f"non-finite from logit amplitude {f['first_nonfinite_scale']:g}", k))
        for k, item in whole(suite.train):
            cases.extend(_train_cases(item, device_default, k, isolation, interrupted))
        for k, item in whole(suite.step):
            cases.extend(_step_cases(item, device_default, k, interrupted))
        for k, item in whole(suite.checks):
            found = G.check(read_run(item["file"]), float(item.get("factor", 5.0)))
            cases.append(Case(item["name"], "goldens_check", item["file"].name, not found,
                              "; ".join(a.message for a in found) or "no anomaly", k))
    return [_relative(c, suite.path.parent) for c in cases]


def _train_cases(item: dict, device_default: str, unit: int, isolation, interrupted) -> list[Case]:
    """A [[train]] entry: the implementation's run diffed against the stored golden values with
    Megatron's rules (a case per metric), and with ``compare`` the drift from the float64 run."""
    device = item.get("device", device_default)
    cfg = T.config(device, **{k: item[k] for k in TRAIN_CONFIG_KEYS if k in item})
    knobs, conventions = ({} if not item.get(key) else T.parse_knobs(
        [(k, str(v).lower() if isinstance(v, bool) else str(v)) for k, v in item[key].items()], key,
        key == "conventions") for key in ("knobs", "conventions"))
    worker = None
    if isolation is not None:
        worker = Worker(isolation.transport)
    try:
        o = T.session(cfg, T.assign(item["impls"], item.get("kernel")), knobs, conventions,
                      compare=bool(item.get("compare", False)), trace=False, isolation=worker, interrupted=interrupted,
                      seeds=int(item.get("seeds", 1)))
    finally:
        if worker is not None:
            worker.stop()
    out = []
    for v in G.diff(read_run(item["golden"]), T.to_golden(o.impl), item.get("metrics"), item.get("rtol"),
                    bool(item.get("deterministic", False))):
        out.append(Case(item["name"], "train", f"{v.metric} ({v.check})", v.passed, v.message, unit))
    if o.impl.error and o.impl.error != "interrupted":
        out.append(Case(item["name"], "train", "run", False, f"the run ended at {o.impl.error}", unit))
    if o.compared:
        msg = o.nonfinite or "; ".join(f"{d.metric}: {d.message}" for d in o.drifts)
        out.append(Case(item["name"], "train", "drift from the float64 run", o.passed, msg, unit))
    return out


def _step_cases(item: dict, device_default: str, unit: int, interrupted) -> list[Case]:
    """A [[step]] entry: ``bench --engine``'s step for each variant, a case per variant (the
    baseline aside) that passes where its overhead over the baseline is within ``max_overhead``
    percent."""
    device = item.get("device", device_default)
    spec = E.parse_engine(item["engine"])
    if spec.target == E.MEGATRON and device != "cuda":
        return [Case(item["name"], "step", "engine", None, "skipped: Megatron-core's model runs on a GPU", unit)]
    vs = SB.check_variants(SB.variants(item["impls"] or SB.default_impls(device), E.assign), item.get("variants", []))
    measured = SB.measure_all(spec, item["recipe"], [{}], vs, device, int(item.get("warmup", 2)),
                              int(item.get("steps", 5)), 0, interrupted)
    rows = SB.rows(measured, item["recipe"], None, device)
    budget = float(item["max_overhead"])
    out = []
    step = {r["variant"]: r["value"] for r in rows if r["metric"] == "step_ms"}
    base_error = next((r["message"] for r in rows if r["variant"] == SB.BASELINE and r["metric"] == "error"), None)
    for r in rows:
        if r["metric"] == "step_ms" and r["variant"] != SB.BASELINE and SB.BASELINE not in step:
            out.append(Case(item["name"], "step", f"{r['variant']} overhead", False,
                            f"no overhead: the baseline did not run ({base_error or 'interrupted'})", unit))
        if r["metric"] == "overhead":
            ok = 100 * r["value"] <= budget
            out.append(Case(item["name"], "step", f"{r['variant']} overhead", ok,
                            f"step {step[r['variant']]:.4g} ms against the baseline's {step[SB.BASELINE]:.4g} ms: "
                            f"{100 * r['value']:+.1f}% ({'within' if ok else 'over'} the budget of {budget:g}%)", unit))
        elif r["metric"] in ("error", "skipped"):
            out.append(Case(item["name"], "step", f"{r['variant']} overhead", False if r["metric"] == "error" else None,
                            r["message"] or "", unit))
    return out


_ABSOLUTE_PATH = re.compile(r"(?<![\w.])/(?:[^/\s:]+/)*[^/\s:]+")


def _relative(c: Case, base: Path) -> Case:
    """A case whose name, message and hint name files relative to the suite's folder, never by an
    absolute path: the same JUnit and Markdown names in every checkout."""
    def rel(text: str) -> str:
        return _ABSOLUTE_PATH.sub(lambda m: os.path.relpath(m.group(0), base)
                                  if Path(m.group(0)).is_absolute() and Path(m.group(0)).exists() else m.group(0),
                                  text) if text else text
    return replace(c, name=rel(c.name), message=rel(c.message), hint=rel(c.hint))


def cases_from_rows(rows: list[dict]) -> list[Case]:
    """A gate report's rows (report.GATE_SCHEMA) back as JUnit cases."""
    return [Case(r["entry"], r["kind"], r["name"], r["passed"], r["message"] or "") for r in rows]


def _hinted(cases: list[Case], item: str, plan, table, isolation) -> None:
    """Parity's hint for each outside implementation that failed in this entry, put on its failed
    cases (the JUnit failure, the Markdown summary and the gate's output carry it)."""
    device = plan.cases[0].device if plan.cases else "cpu"
    for kernel, impl, hint in hints(plan, verdicts(table), device, isolation):
        for c in cases:
            if c.suite_item == item and c.passed is False and c.kind == "parity" and _group(c) == (impl, kernel):
                c.hint = c.hint or hint


def hints_of(cases: list[Case]) -> list[str]:
    """The distinct hints of a gate's cases, in order."""
    return list(dict.fromkeys(c.hint for c in cases if c.hint))


def junit_xml(suite: Suite | str, cases: list[Case]) -> bytes:
    root = ET.Element("testsuites", name=suite if isinstance(suite, str) else suite.name)
    by_item: dict[str, list[Case]] = {}
    for c in cases:
        by_item.setdefault(c.suite_item, []).append(c)
    for item, cs in by_item.items():
        ts = ET.SubElement(root, "testsuite", name=item, tests=str(len(cs)),
                           failures=str(sum(c.passed is False for c in cs)),
                           skipped=str(sum(c.passed is None for c in cs)))
        for c in cs:
            tc = ET.SubElement(ts, "testcase", classname=f"mhctool.{c.kind}.{item}", name=c.name)
            if c.passed is False:
                ET.SubElement(tc, "failure", message=c.message[:500]).text = c.message + (
                    f"\n{c.hint}" if c.hint else "")
            elif c.passed is None:
                ET.SubElement(tc, "skipped", message=c.message[:500])
    return ET.tostring(root, encoding="utf-8", xml_declaration=True)


def markdown(suite: Suite | str, cases: list[Case]) -> str:
    name = suite if isinstance(suite, str) else suite.name
    failed = [c for c in cases if c.passed is False]
    passed = sum(c.passed is True for c in cases)
    skipped = sum(c.passed is None for c in cases)
    head = "passed" if not failed else "FAILED"
    lines = [f"## mhctool gate `{name}`: {head}", "",
             f"{passed} passed, {len(failed)} failed, {skipped} skipped", "",
             "| entry | kind | checks | failed |", "|---|---|---|---|"]
    by_item: dict[str, list[Case]] = {}
    for c in cases:
        by_item.setdefault(c.suite_item, []).append(c)
    for item, cs in by_item.items():
        nf = sum(c.passed is False for c in cs)
        lines.append(f"| {item} | {cs[0].kind} | {len(cs)} | {'❌ ' + str(nf) if nf else '✅ 0'} |")
    if failed:
        lines += ["", "### Failures"]
        groups: dict[tuple, list[Case]] = {}
        for c in failed:
            groups.setdefault((c.suite_item, *_group(c)), []).append(c)
        for (item, impl, kernel), cs in groups.items():
            lines += ["", f"**{item}**" + (f": `{stable(impl)}` on {kernel}" if impl else "")
                      + f" ({len(cs)} failed)", ""]
            lines += [f"> {h}" for h in hints_of(cs)] + ([""] if hints_of(cs) else [])
            lines += [f"- `{stable(c.name)}`: {c.message}" for c in cs[:MARKDOWN_CAP]]
            if len(cs) > MARKDOWN_CAP:
                lines.append(f"- ... and {len(cs) - MARKDOWN_CAP} more (the JUnit XML and the report have every one)")
    return "\n".join(lines) + "\n"


MARKDOWN_CAP = 10  # failures listed per implementation and family in the summary


def _group(c: Case) -> tuple[str, str]:
    """(implementation, kernel) of a parity case's name ``kernel/impl/family/...``; else empty."""
    if c.kind != "parity":
        return "", ""
    kernel, _, rest = c.name.partition("/")
    parts = rest.split("/")  # impl (its path may hold slashes), family, dtype, shape, [knobs,] direction
    trailing = 5 if len(parts) > 5 and parts[-2].startswith("{") else 4
    return "/".join(parts[:-trailing]), kernel
