"""Rows <-> Parquet: the versioned long-format schema, environment metadata, atomic writes.

Schema version 2 (one row per case x implementation x direction x tensor x metric; version 1
had every column but the last two):

| column     | type    | meaning                                                             |
|------------|---------|---------------------------------------------------------------------|
| run_id     | string  | one id per mhctool invocation                                       |
| scenario   | string  | scenario name (``cli`` when built from flags)                       |
| case_id    | string  | hash of kernel, family, dtype, shape, knobs, seed                   |
| kernel     | string  | kernel family (sinkhorn, h_aggregate, h_post_bda, proj_rms)         |
| impl       | string  | implementation name (torch, compile, triton, cutile, module:fn;     |
|            |         | ``float64``: the reference's own --check rows)                      |
| backend    | string  | torch, compile, triton, cutile, external, reference                 |
| precision  | string  | matmul precision judged at (ieee, tf32, tf32_trunc, bf16)           |
| family     | string  | input family (random, large_logits, ...)                            |
| dtype      | string  | case dtype of the activations (fp32, bf16, fp16)                    |
| dtype_out  | string  | dtype of the tensor measured (null for error/unsupported rows)      |
| shape      | string  | SxBxNxC actually run (after the family's reshape)                   |
| knobs      | string  | JSON object of the knobs                                            |
| seed       | int64   | input seed                                                          |
| device     | string  | cpu or cuda                                                         |
| direction  | string  | fwd or bwd                                                          |
| tensor     | string  | output name, ``grad_<input>`` in bwd, ``*`` for whole-case rows     |
| metric     | string  | max_abs, rel_l2, max_rel, ulp, nonfinite, unwritten, extra_zeros,   |
|            |         | row_residual, col_residual, error, unsupported, not_judged (the     |
|            |         | forward's outputs lost with a CUDA context its backward took);      |
|            |         | with --check:                                                       |
|            |         | nondeterministic (share of elements that differ between runs),      |
|            |         | batch_variant (share of tokens that differ at another batch size)   |
| value      | float64 | the measurement                                                     |
| threshold  | float64 | the bound it was judged against (null: informational)               |
| passed     | bool    | verdict of this row (null: informational or unsupported)            |
| rule       | string  | which rule decided (``kappa=2 x native``, ``dtype floor``, ``reduction floor``, |
|            |         | ``determinism``, ``batch-invariance``, ...)                         |
| message    | string  | error or skip reason                                                |
| ranks      | int64   | ``--ranks``: processes the tokens were split over (null: one)       |
| grad_reduce| string  | ``--grad-reduce``: the parameter gradients' all-reduce dtype        |

File metadata: ``mhctool.schema_version``, ``mhctool.kind`` (parity, ...), ``mhctool.environment``
(JSON: GPU, driver, torch, triton, cuda.tile, mhctool version, git commit) and ``mhctool.run``
(JSON: the command's settings). Readers accept any version up to their own; columns added by a
later version are ignored by name, never by position.
"""
from __future__ import annotations

import json
import os
import tempfile
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from mhctool.core.errors import UsageError
from mhctool.core.findings import tally, verdicts, worst_first

# 2: bench reports gained ``inputs`` (the input dtypes each row was timed at); parity reports gained
# ``ranks`` and ``grad_reduce`` (``--ranks``; null in a one-process run)
# 3: train reports gained ``seed`` (the trajectory's seed; in a verdict row, null where the verdict
# is the seed ensemble's)
# 4: bench reports gained ``knobs`` (JSON of the knobs a row was timed at, ``--knob``; null at the
# family's defaults); bench-step reports gained the module's ops and the attribution rows
SCHEMA_VERSION = 4


SCHEMA = pa.schema([
    ("run_id", pa.string()), ("scenario", pa.string()), ("case_id", pa.string()),
    ("kernel", pa.string()), ("impl", pa.string()), ("backend", pa.string()),
    ("precision", pa.string()), ("family", pa.string()), ("dtype", pa.string()),
    ("dtype_out", pa.string()), ("shape", pa.string()), ("knobs", pa.string()),
    ("seed", pa.int64()), ("device", pa.string()), ("direction", pa.string()),
    ("tensor", pa.string()), ("metric", pa.string()), ("value", pa.float64()),
    ("threshold", pa.float64()), ("passed", pa.bool_()), ("rule", pa.string()),
    ("message", pa.string()), ("ranks", pa.int64()), ("grad_reduce", pa.string()),
])


# `mhctool bench` reports: one row per (kernel, impl, direction, metric). Metrics: time_ms (median),
# time_ms_p10, time_ms_p90, gbps (model bytes / median time), pct_copy_bw (of the copy bandwidth
# measured in the same run), tflops, host_us (CPU time per call, no sync), peak_bytes, saved_bytes
# (what autograd keeps for backward), speedup_vs_torch, speedup_vs_compile. ``bound`` says which
# ceiling applies (memory or compute); the ceilings are in the ``mhctool.run`` metadata. ``dtype``
# is the run's dtype for the kernel (fp32 for Sinkhorn's mapping path); ``inputs`` (schema 2) the
# dtype of each floating input as timed, ``name=dtype`` in call order (a library's adapter may
# state other dtypes than the contract's: ``h_res=bf16``); null on skipped rows. A (kernel, impl,
# direction) that could not be timed has one row instead: metric ``skipped`` (it cannot run here:
# a dtype or device it does not take, not graph-capturable) or ``error`` (it raised, crashed, hung,
# faulted, or left work on another stream; the run exits 1), the reason in ``message``.
BENCH_SCHEMA = pa.schema([
    ("run_id", pa.string()), ("kernel", pa.string()), ("impl", pa.string()), ("backend", pa.string()),
    ("direction", pa.string()), ("dtype", pa.string()), ("shape", pa.string()), ("device", pa.string()),
    ("graph", pa.bool_()), ("metric", pa.string()), ("value", pa.float64()), ("bound", pa.string()),
    ("message", pa.string()), ("inputs", pa.string()), ("knobs", pa.string()),
])


# `mhctool goldens diff/check` reports: per metric and step (diff) or per anomaly (check).
GOLDENS_SCHEMA = pa.schema([
    ("run_id", pa.string()), ("command", pa.string()), ("metric", pa.string()), ("check", pa.string()),
    ("step", pa.int64()), ("golden", pa.float64()), ("actual", pa.float64()), ("abs_diff", pa.float64()),
    ("rel_diff", pa.float64()), ("close", pa.bool_()), ("passed", pa.bool_()), ("message", pa.string()),
])


# `mhctool stability sinkhorn` reports: one row per (impl, family, dtype, amplitude, knobs, metric).
STABILITY_SCHEMA = pa.schema([
    ("run_id", pa.string()), ("impl", pa.string()), ("family", pa.string()), ("dtype", pa.string()),
    ("scale", pa.float64()), ("stabilize", pa.string()), ("eps", pa.float64()), ("eps_mode", pa.string()),
    ("order", pa.string()), ("iters", pa.int64()), ("metric", pa.string()), ("value", pa.float64()),
    ("message", pa.string()),
])


# `mhctool stability eps` reports: level ``kernel`` (per family, dtype, impl and output tensor:
# ref_shift_max_abs, shift_max_abs, shift_rel_l2, shift_ulps, token_shift_ulps_median,
# tokens_shifted_share, noise_max_abs, shift_over_noise) and level ``stack`` (per family, dtype and
# depth: shift_rel_l2, noise_rel_l2, shift_over_noise, shift_ulps_median, shift_ulps_max).
KNOB_SHIFT_SCHEMA = pa.schema([
    ("run_id", pa.string()), ("kernel", pa.string()), ("knob", pa.string()), ("setting_a", pa.string()),
    ("setting_b", pa.string()), ("level", pa.string()), ("family", pa.string()), ("dtype", pa.string()),
    ("impl", pa.string()), ("tensor", pa.string()), ("depth", pa.int64()), ("metric", pa.string()),
    ("value", pa.float64()),
])


# `mhctool stability overflow` reports: per scale and intermediate, ``amax`` (dtype fp64) and
# ``headroom_log2`` per dtype (impl ``reference``); per scale and dtype, the implementation's
# ``output_nonfinite_share`` and ``output_rel_error`` (largest error of its finite outputs over the
# reference's largest magnitude; intermediate ``output``).
OVERFLOW_SCHEMA = pa.schema([
    ("run_id", pa.string()), ("kernel", pa.string()), ("impl", pa.string()), ("family", pa.string()),
    ("scale", pa.float64()), ("dtype", pa.string()), ("intermediate", pa.string()), ("metric", pa.string()),
    ("value", pa.float64()),
])


# `mhctool stability gain` reports: per H_res configuration, implementation and depth: fwd_gain,
# bwd_gain (means over tokens), fwd_gain_max, bwd_gain_max.
GAIN_SCHEMA = pa.schema([
    ("run_id", pa.string()), ("config", pa.string()), ("kind", pa.string()), ("impl", pa.string()),
    ("dtype", pa.string()), ("iters", pa.int64()), ("depth", pa.int64()), ("metric", pa.string()),
    ("value", pa.float64()),
])


# `mhctool identify` reports: one row per candidate convention tried. ``stage``: grid (the coarse
# search), refine / snap (the continuous knobs), judged (the verdict rule ran: ``passed``,
# ``native_max_rel``, ``classification`` = as asked / known convention / variant / likely a
# defect), or error (the implementation failed). ``candidate`` and ``asked`` are JSON knob dicts.
# ``max_rel``: the implementation's worst relative error against the candidate's float64 reference;
# ``noise_ratio``: its worst normalised max-abs error over the native implementation's at the asked
# knobs (what candidates are ranked by).
IDENTIFY_SCHEMA = pa.schema([
    ("run_id", pa.string()), ("kernel", pa.string()), ("impl", pa.string()), ("dtype", pa.string()),
    ("device", pa.string()), ("asked", pa.string()), ("stage", pa.string()), ("candidate", pa.string()),
    ("max_rel", pa.float64()), ("noise_ratio", pa.float64()), ("native_max_rel", pa.float64()),
    ("passed", pa.bool_()), ("best", pa.bool_()),
    ("classification", pa.string()), ("message", pa.string()),
])


# `mhctool train` reports: per trajectory (``run``: impl, native, reference, or native with a knob
# such as ``native:h_post_bda.transpose_res=True``), step and metric: Megatron's golden-value
# metrics (lm loss, grad-norm, num-zeros, iteration-time, memory on a GPU), ``zeros:PARAM`` (the
# exact zeros of one parameter's gradient), and per ``layer`` the mHC health (``row-sum deviation``,
# ``col-sum deviation``, ``smallest entry`` of H_res, ``largest logit`` of Sinkhorn's input,
# ``nonfinite:FAMILY.OUTPUT`` counts; ``first non-finite`` names it in ``message``). The verdict
# rows: ``drift:METRIC`` per judged trajectory (``value`` its largest distance from the reference,
# ``threshold`` kappa times the native trajectory's plus the floor, ``step`` where it parted,
# ``passed``), ``nonfinite`` and ``traced:FAMILY.KNOB`` (the attribution, in ``message``).
TRAIN_SCHEMA = pa.schema([
    ("run_id", pa.string()), ("run", pa.string()), ("step", pa.int64()), ("layer", pa.int64()),
    ("metric", pa.string()), ("value", pa.float64()), ("threshold", pa.float64()), ("passed", pa.bool_()),
    ("message", pa.string()), ("seed", pa.int64()),
])


# `mhctool bench --engine` reports (kind ``bench-step``): per variant (``plain``: the GPT without
# hyper-connections; ``native``: the engine's own mHC path; ``fused``: its fused switch; else the
# --impl swapped in) and sweep point (``point``: JSON of the swept recipe options; the recipe's
# sizes beside), the step (``entry`` ``*``): step_ms (median over the timed steps), step_ms_p10,
# step_ms_p90, steps, tokens_per_s, overhead (step_ms / the baseline's - 1), overhead_ms,
# peak_bytes (GPU), entry_step_ms (median step under the profiler, which times the entry points),
# busy_ms (that step's whole kernel time: the GPU's busy time; CPU time of every op on a CPU),
# mhc_ms (the device time of the kernels inside the entry points a step; CPU time on a CPU),
# mhc_share (of step_ms; of busy_ms on a CPU), elsewhere_ms (overhead_ms - mhc_ms), gap_ms (GPU: the
# device's gaps in the profiled step, widened by the profiler's host cost); per entry point (``entry``: the
# family; ``mapping``: a fused projection with the mapping's activations) and ``direction`` (fwd,
# bwd, recompute): entry_ms, entry_share (of step_ms), calls (a step), kernel_ms (the kernel
# alone, bench's measurement at the step's shape), gap_before_ms (GPU: of gap_ms, the gaps ended by
# a kernel such a call launched: where the host was late). A variant that could not run: metric ``error`` or ``skipped``, why in ``message``.
STEP_SCHEMA = pa.schema([
    ("run_id", pa.string()), ("variant", pa.string()), ("point", pa.string()), ("streams", pa.int64()),
    ("layers", pa.int64()), ("hidden", pa.int64()), ("seq", pa.int64()), ("micro_batch", pa.int64()),
    ("global_batch", pa.int64()), ("recompute", pa.bool_()), ("entry", pa.string()), ("direction", pa.string()),
    ("metric", pa.string()), ("value", pa.float64()), ("message", pa.string()),
])


# `mhctool gate` reports: one row per JUnit case.
GATE_SCHEMA = pa.schema([
    ("run_id", pa.string()), ("suite", pa.string()), ("entry", pa.string()), ("kind", pa.string()),
    ("name", pa.string()), ("passed", pa.bool_()), ("message", pa.string()),
])


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


def to_table(rows: list[dict], run_id: str, kind: str, environment: dict, run: dict | None = None,
             schema: pa.Schema = SCHEMA) -> pa.Table:
    cols = {f.name: [] for f in schema}
    for r in rows:
        for name in cols:
            cols[name].append(run_id if name == "run_id" else r.get(name))
    return with_metadata(pa.table(cols, schema=schema), kind, environment, run)


def with_metadata(table: pa.Table, kind: str, environment: dict, run: dict | None = None) -> pa.Table:
    """``table`` with a report's file metadata (schema version, kind, environment, run settings)."""
    meta = {
        b"mhctool.schema_version": str(SCHEMA_VERSION).encode(),
        b"mhctool.kind": kind.encode(),
        b"mhctool.environment": json.dumps(environment, default=str).encode(),
        b"mhctool.run": json.dumps(run or {}, default=str).encode(),
    }
    return table.replace_schema_metadata(meta)


def with_run(table: pa.Table, **fields) -> pa.Table:
    """``table`` with ``fields`` added to its run settings (the hints a command found after the
    rows were written)."""
    raw = dict(table.schema.metadata or {})
    raw[b"mhctool.run"] = json.dumps({**json.loads(raw.get(b"mhctool.run", b"{}")), **fields}, default=str).encode()
    return table.replace_schema_metadata(raw)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# the suffixes a report may have: the suffix decides the format (write_atomic)
REPORT_SUFFIXES = (".parquet", ".json")


def check_writable(path: str | os.PathLike, what: str = "--out",
                   suffixes: tuple[str, ...] | None = REPORT_SUFFIXES, make_folder: bool = False) -> Path:
    """Refuse, before a run starts, an output that cannot be written, in one sentence: a directory,
    a folder that does not exist (none is made), a place this process cannot create a file in
    (tried: a temporary file is made there and removed, which ``os.access`` cannot tell for
    root), an existing file it cannot replace, and, where ``suffixes`` decide the format, a name
    with another suffix. The run's results would otherwise be lost at its end. ``make_folder``:
    the folder is made where missing (the pytest plugin's report path), then tried."""
    path = Path(path)
    if path.is_dir():
        raise UsageError(f"{what} {path} is a directory; name a file in it, e.g. {path / 'report.parquet'}")
    if suffixes is not None and path.suffix.lower() not in suffixes:
        raise UsageError(f"{what} {path}: the name's suffix sets the format; accepted: {', '.join(suffixes)}")
    parent = path.parent
    existing = next((p for p in (parent, *parent.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise UsageError(f"{what} {path}: {existing} is a file, not a folder")
    if existing != parent and make_folder and existing is not None:
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UsageError(f"{what} {path}: cannot make the folder {parent} ({e.strerror or e})") from None
    elif existing != parent:
        raise UsageError(f"{what} {path}: the folder {parent} does not exist")
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".probe", dir=parent)
    except OSError as e:
        raise UsageError(f"{what} {path}: cannot create a file in {parent} ({e.strerror or e})") from None
    os.close(fd)
    os.unlink(probe)
    if path.exists() and not os.access(path, os.W_OK):
        raise UsageError(f"{what} {path} exists and is not writable")
    return path


def check_folder(path: str | os.PathLike, what: str = "--plot") -> Path:
    """A folder a command will write files into (``--plot``): made now if missing, and a file tried
    in it; anything else (a file of that name, a place that cannot be written) is one sentence
    before the run starts."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UsageError(f"{what} {path} is a file; name a folder for the figures")
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".mhctool.", suffix=".probe", dir=path)
    except OSError as e:
        raise UsageError(f"{what} {path}: cannot write figures there ({e.strerror or e})") from None
    os.close(fd)
    os.unlink(probe)
    return path


def atomic(path: str | os.PathLike, write) -> Path:
    """``write(tmp_path)`` into a temp file in the same folder, then rename: an interrupted write
    never leaves a half-written file (nor replaces a good one). The file gets the mode a plain
    ``open()`` would give it (0666 less the umask), not the temp file's private 0600."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_atomic(table: pa.Table, path: str | os.PathLike) -> Path:
    """A report, written atomically: Parquet, or the JSON document of :func:`document` when the
    path ends in ``.json`` (``-o run.json`` on any command)."""
    if Path(path).suffix.lower() == ".json":
        return atomic(path, lambda tmp: Path(tmp).write_text(json.dumps(document(table), indent=1)))
    return atomic(path, lambda tmp: pq.write_table(table, tmp))


def _finite(value):
    """A value JSON can carry: non-finite floats as the strings ``nan``, ``inf``, ``-inf``
    (strict JSON has no NaN; jq and most parsers refuse it)."""
    if isinstance(value, float) and value != value:
        return "nan"
    if isinstance(value, float) and value in (float("inf"), float("-inf")):
        return "inf" if value > 0 else "-inf"
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    return value


def summary(table: pa.Table, kind: str) -> dict:
    """Passed, failed and skipped verdicts of a report (a parity report's per case, implementation
    and direction; another kind's per row with a verdict), and ``ok``: no failure."""
    if kind == "parity":
        flags = [v["passed"] for v in verdicts(table)]
    elif "passed" in table.column_names:
        flags = table.column("passed").to_pylist()
    else:
        flags = []
    p, f, s = tally(flags)
    return {"passed": p, "failed": f, "skipped": s, "ok": f == 0}


def document(table: pa.Table) -> dict:
    """A report as one JSON document, for jq and CI scripts: ``mhctool`` (schema version, kind,
    environment, run settings, the column types), ``summary`` (:func:`summary`), ``verdicts`` (a
    parity report's, worst first, each with the row that decided it; other kinds: the rows that
    failed) and ``rows`` (every row, as in the Parquet file). Non-finite numbers are strings."""
    raw = table.schema.metadata or {}
    kind = raw.get(b"mhctool.kind", b"").decode()
    header = {"schema_version": int(raw.get(b"mhctool.schema_version", SCHEMA_VERSION)), "kind": kind,
              "environment": json.loads(raw.get(b"mhctool.environment", b"{}")),
              "run": json.loads(raw.get(b"mhctool.run", b"{}")),
              "columns": {f.name: str(f.type) for f in table.schema}}
    rows = table.to_pylist()
    if kind == "parity":
        vs = worst_first(verdicts(table))
        judged = [{k: v[k] for k in v if k not in ("worst", "worst_margin")}
                  | {"worst": None if v["worst"] is None else {k: v["worst"][k] for k in
                                                              ("tensor", "metric", "value", "threshold", "rule")}}
                  for v in vs]
    else:
        judged = [r for r in rows if r.get("passed") is False]
    return {"mhctool": header, "summary": summary(table, kind),
            "verdicts": [_finite(v) for v in judged], "rows": [_finite(r) for r in rows]}


_ARROW_TYPES = {"string": pa.string(), "double": pa.float64(), "int64": pa.int64(), "bool": pa.bool_()}


def _from_document(path: Path) -> pa.Table:
    """The table a JSON report (:func:`document`) holds, its metadata as a Parquet report's."""
    try:
        doc = json.loads(path.read_text())
        head = doc["mhctool"]
        schema = pa.schema([(name, _ARROW_TYPES[t]) for name, t in head["columns"].items()])
        cols = {f.name: [] for f in schema}
        for r in doc["rows"]:
            for f in schema:
                v = r.get(f.name)
                if f.type == pa.float64() and isinstance(v, str):
                    v = float(v)
                cols[f.name].append(v)
        table = pa.table(cols, schema=schema)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise UsageError(f"{path} is not a readable mhctool JSON report ({type(e).__name__}: {e})") from e
    meta = {b"mhctool.schema_version": str(head.get("schema_version", SCHEMA_VERSION)).encode(),
            b"mhctool.kind": str(head.get("kind", "")).encode(),
            b"mhctool.environment": json.dumps(head.get("environment", {})).encode(),
            b"mhctool.run": json.dumps(head.get("run", {})).encode()}
    return table.replace_schema_metadata(meta)


def read(path: str | os.PathLike) -> tuple[pa.Table, dict]:
    """The table and its decoded metadata; a file that is not a readable mhctool report is a UsageError."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"no report file {path}")
    if path.suffix.lower() == ".json":
        table = _from_document(path)
    else:
        try:
            table = pq.read_table(path)
        except Exception as e:
            raise UsageError(f"{path} is not a readable Parquet file ({type(e).__name__})") from e
    raw = table.schema.metadata or {}
    if b"mhctool.schema_version" not in raw:
        raise UsageError(f"{path} is Parquet but not an mhctool report (no mhctool.schema_version)")
    version = int(raw[b"mhctool.schema_version"])
    if version > SCHEMA_VERSION:
        raise UsageError(
            f"{path} has report schema version {version}; this mhctool reads up to {SCHEMA_VERSION}")
    meta = {
        "schema_version": version,
        "kind": raw.get(b"mhctool.kind", b"").decode(),
        "environment": json.loads(raw.get(b"mhctool.environment", b"{}")),
        "run": json.loads(raw.get(b"mhctool.run", b"{}")),
    }
    return table, meta


def write_summary(path: str | os.PathLike, md: str) -> Path:
    """A Markdown summary, written atomically and appended to ``$GITHUB_STEP_SUMMARY`` when set."""
    written = atomic(path, lambda tmp: Path(tmp).write_text(md))
    if os.environ.get("GITHUB_STEP_SUMMARY"):
        with open(os.environ["GITHUB_STEP_SUMMARY"], "a") as f:
            f.write(md)
    return written
