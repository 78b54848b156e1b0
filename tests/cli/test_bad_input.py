"""Bad input ends in one sentence and exit 2 before anything runs, and nothing is left
half-written; implementations resolve per kernel; reports honour the umask."""
import os
import stat
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from mhctool.core import environment, report
from mhctool.families import get_family
from mhctool.registry.builtin import impls_for
from mhctool.registry.impl import Impl
from mhctool.registry.specs import resolve_impls
from mhctool.runner import run as runner
from mhctool.runner.case import Case, check_runnable
from mhctool.cli.app import app
from mhctool.core.errors import UsageError
from mhctool.core.shapes import parse_shape_for

cli = CliRunner()


def run(*args):
    return cli.invoke(app, [str(a) for a in args])


def _one_sentence(res, needle):
    assert res.exit_code == 2, res.output
    assert needle in res.output, res.output
    assert "Traceback" not in res.output


def test_a_shape_too_large_for_the_device_is_refused_with_the_sizes(tmp_path):
    out = tmp_path / "r.parquet"
    res = run("parity", "--kernel", "h_aggregate", "--device", "cpu", "--shape", "99999999999x4x4x7168", "-o", out)
    _one_sentence(res, "needs at least")
    assert "GiB for the float64 reference" in res.output and "the machine has" in res.output
    assert not out.exists()


def test_out_naming_a_directory_is_refused_before_the_run(tmp_path, monkeypatch):
    ran = []
    monkeypatch.setattr(runner, "run_case", lambda *a, **k: ran.append(a))
    res = run("parity", "--kernel", "sinkhorn", "--device", "cpu", "-o", tmp_path)
    _one_sentence(res, "is a directory")
    assert not ran


@pytest.mark.parametrize("cmd", [
    ["bench", "--kernel", "sinkhorn", "--device", "cpu"],
    ["stability", "gain", "--depth", "2"],
    ["goldens", "extract", "x.log"],
])
def test_every_report_writer_refuses_a_directory(tmp_path, cmd):
    res = run(*cmd, "-o", tmp_path)
    _one_sentence(res, "is a directory")


def test_gate_refuses_unwritable_outputs_before_running(tmp_path):
    suite = Path(__file__).resolve().parents[2] / "scenarios" / "ci-gate.toml"
    res = run("gate", "--suite", suite, "--junit", tmp_path)
    _one_sentence(res, "--junit")


def test_reports_get_the_mode_a_plain_open_would_give(tmp_path):
    old = os.umask(0o022)
    try:
        path = report.write_atomic(report.to_table([], "r", "parity", {}), tmp_path / "r.parquet")
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize("setup,cmd,needle", [
    ("truncated", ["report", "show", "{f}"], "not a readable Parquet file"),
    ("truncated", ["report", "compare", "{f}", "{f}"], "not a readable Parquet file"),
    ("foreign", ["report", "show", "{f}"], "not an mhctool report"),
    ("binary", ["goldens", "extract", "{f}", "-o", "{d}/x.json"], "no Megatron training-iteration lines"),
    ("nan_eps", ["parity", "--scenario", "{f}", "--device", "cpu"], "must be finite"),
    ("negative_iters", ["parity", "--scenario", "{f}", "--device", "cpu"], "must be a positive integer"),
    ("broken_suite", ["gate", "--suite", "{f}", "--device", "cpu"], "not valid TOML"),
    (None, ["parity", "--kernel", "sinkhorn", "--device", "cpu", "--kappa", "nan"], "--kappa"),
    (None, ["parity", "--kernel", "h_post_bda", "--device", "cpu", "--shape", "4x0x4x8"], "zero dimension"),
])
def test_bad_files_and_values_are_one_sentence(tmp_path, setup, cmd, needle):
    f = tmp_path / "input"
    if setup == "truncated":
        good = report.write_atomic(report.to_table([], "r", "parity", {}), tmp_path / "good.parquet")
        f.write_bytes(good.read_bytes()[:100])
    elif setup == "foreign":
        import pyarrow as pa
        pq.write_table(pa.table({"a": [1]}), f)
    elif setup == "binary":
        f.write_bytes(bytes(range(256)) * 20)
    elif setup in ("nan_eps", "negative_iters"):
        knob = "eps = nan" if setup == "nan_eps" else "iters = -3"
        f.write_text(f'name = "x"\n[[cases]]\nkernel = "sinkhorn"\n[cases.knobs]\n{knob}\n')
    elif setup == "broken_suite":
        f.write_text('name = "x"\n[[parity]\n')
    args = [a.format(f=f, d=tmp_path) for a in cmd]
    if cmd[0] == "parity":
        args += ["-o", str(tmp_path / "r.parquet")]
    res = run(*args)
    _one_sentence(res, needle)
    assert not (tmp_path / "r.parquet").exists()


# --- implementations resolve per kernel ---------------------------------------------------------

def test_a_backend_missing_for_one_kernel_is_a_skip_reason_not_an_error():
    (impl,) = resolve_impls("swiglu", ["cutile"])
    assert impl.unsupported("cuda", "bf16") == "mhctool has no cuTile implementation of swiglu"
    with pytest.raises(UsageError, match="unknown implementation 'cutlass'"):
        resolve_impls("swiglu", ["cutlass"])


def _case(kernel, shape):
    kind = get_family(kernel).shape_kind
    return Case(kernel, "random", "bf16", parse_shape_for(kind, shape), (), 0, "cuda")


def test_named_impl_is_an_error_only_when_it_runs_no_case():
    usable = Impl("cutile", "sinkhorn", "cutile", lambda x: x, requires=lambda: None)
    impls = {"sinkhorn": [usable], "swiglu": resolve_impls("swiglu", ["cutile"])}
    cases = [_case("sinkhorn", "8x2x4x1"), _case("swiglu", "8x1x32x1")]
    check_runnable(impls, cases)  # runs sinkhorn: swiglu's rows are skipped with the reason
    with pytest.raises(UsageError, match="cannot run swiglu here: mhctool has no cuTile implementation"):
        check_runnable({"swiglu": impls["swiglu"]}, cases[1:])


def test_a_default_run_says_which_backend_was_skipped_everywhere(tmp_path, monkeypatch):
    why = "Triton 3.6.0's CPU interpreter does not run with numpy 2.4.0"
    for impl in impls_for("h_aggregate"):
        if impl.name == "triton":
            monkeypatch.setattr(impl, "requires", lambda: why)
    res = run("parity", "--kernel", "h_aggregate", "--device", "cpu", "--dtype", "fp32", "-o", tmp_path / "r.parquet")
    assert res.exit_code == 0, res.output
    assert f"note: triton skipped for every case: {why}" in res.output.replace("\n", " ")


@pytest.mark.parametrize("triton,numpy,broken", [
    ("3.6.0", "2.4.6", True), ("3.6.0", "2.3.5", False), ("3.7.0", "2.4.0", False), ("3.9.0", "2.4.6", False),
    ("3.10.0", "2.5.0", False), ("3.5.1", "2.4.0rc1", True),
])
def test_interpreter_gate_names_the_broken_combination(triton, numpy, broken):
    why = environment.interpreter_incompatibility(triton, numpy)
    assert (why is not None) == broken
    if broken:
        assert "triton>=3.7" in why and "numpy<2.4" in why


# every command that writes, with what it needs to reach its writes (the inputs are read after
# the outputs are checked, or are real)
_GOLDEN = Path(__file__).resolve().parents[1] / "data" / "goldens"
_WRITERS = {
    "parity": (["parity", "--kernel", "sinkhorn", "--device", "cpu"], "-o"),
    "bench": (["bench", "--kernel", "sinkhorn", "--device", "cpu"], "-o"),
    "identify": (["identify", "--kernel", "sinkhorn", "--impl", "torch", "--device", "cpu"], "-o"),
    "stability gain": (["stability", "gain", "--depth", "2"], "-o"),
    "train": (["train", "--impl", "torch", "--device", "cpu", "--steps", "1"], "-o"),
    "gate": (["gate", "--suite", Path(__file__).resolve().parents[2] / "scenarios" / "ci-gate.toml"], "-o"),
    "report merge": (["report", "merge", "a.parquet"], "-o"),
}


@pytest.mark.parametrize("name", sorted(_WRITERS))
@pytest.mark.parametrize("where,needle", [
    ("missing/x.parquet", "does not exist"),
    ("/proc/mhctool-nope.parquet", "cannot create a file in /proc"),
    ("x.csv", "the name's suffix sets the format; accepted: .parquet, .json"),
])
def test_every_report_writer_refuses_an_output_it_cannot_write_before_any_work(tmp_path, monkeypatch, name, where,
                                                                                needle):
    """A folder that does not exist (none is made), a place no file can be created in (even for
    root, where ``os.access`` says yes), a suffix that is no format: one sentence, exit 2, nothing
    run and nothing written."""
    ran = []
    monkeypatch.setattr(runner, "run_case", lambda *a, **k: ran.append(a))
    args, flag = _WRITERS[name]
    target = where if where.startswith("/") else tmp_path / where
    res = run(*args, flag, target)
    _one_sentence(res, needle)
    assert not ran and not (tmp_path / "missing").exists()


@pytest.mark.parametrize("args", [
    ["parity", "--kernel", "sinkhorn", "--device", "cpu", "-o", "{tmp}/r.parquet", "--plot", "{tmp}/r.parquet.d"],
    ["train", "--impl", "torch", "--device", "cpu", "--steps", "1", "-o", "{tmp}/r.parquet", "--plot", "{tmp}/f"],
])
def test_a_plot_folder_that_is_a_file_is_refused_before_any_work(tmp_path, args):
    (tmp_path / "r.parquet.d").write_text("")
    (tmp_path / "f").write_text("")
    res = run(*[a.format(tmp=tmp_path) for a in args])
    _one_sentence(res, "is a file; name a folder for the figures")
    assert not (tmp_path / "r.parquet").exists()


def test_the_other_writers_check_their_place_too(tmp_path):
    """Outputs whose format is fixed (a golden-value JSON, a page, JUnit, a summary) take any name
    but still must be writable: one sentence, exit 2."""
    g = next(_GOLDEN.rglob("*.json"))
    r = report.write_atomic(report.to_table([], "r", "parity", {}), tmp_path / "r.parquet")
    for args, needle in ((["goldens", "extract", "x.log", "-o", "/proc/nope.json"], "cannot create a file in /proc"),
                         (["report", "html", r, "-o", tmp_path / "missing" / "x.html"], "does not exist"),
                         (["gate", "--suite", Path(__file__).resolve().parents[2] / "scenarios" / "ci-gate.toml",
                           "--junit", "/proc/nope.xml"], "--junit /proc/nope.xml: cannot create a file"),
                         (["report", "compare", r, r, "--json", tmp_path / "missing" / "c.json"], "does not exist"),
                         (["goldens", "diff", g, g, "--plot", g], "is a file; name a folder")):
        _one_sentence(run(*args), needle)


def _suite(tmp_path, body: str) -> Path:
    p = tmp_path / "suite.toml"
    p.write_text('[[parity]]\nkernel = "sinkhorn"\n' + body)
    return p


@pytest.mark.parametrize("args, env, needle", [
    (["parity", "--kernel", ""], {}, "--kernel '' names no kernel"),
    (["parity", "--kernel", "sinkhorn", "--impl", ""], {}, "--impl '' names no implementation"),
    (["train", "--impl", ""], {}, "--impl '' names no implementation"),
    (["bench", "--kernel", " "], {}, "names no kernel"),
    (["parity", "--kernel", "sinkhorn", "--device", "cpu"], {"MHCTOOL_WORKERS": "abc"}, "malformed MHCTOOL_WORKERS=abc"),
    (["parity", "--kernel", "sinkhorn", "--device", "cpu"], {"MHCTOOL_WORKERS": "100000"},
     "MHCTOOL_WORKERS=100000 is far past this machine's"),
    (["parity", "--kernel", "sinkhorn", "--device", "cpu", "--workers", "100000"], {}, "--workers '100000' is far past"),
])
def test_what_names_nothing_or_is_far_past_the_machine_is_one_sentence_naming_where_it_was_given(
        tmp_path, args, env, needle):
    res = cli.invoke(app, args + ["-o", str(tmp_path / "r.parquet")] if args[0] != "train" else args, env=env)
    _one_sentence(res, needle)
    assert not (tmp_path / "r.parquet").exists()


@pytest.mark.parametrize("body, needle", [
    ('kappa = "two"\n', "parity[0].kappa: 'two' is a str, not what the key takes: e.g. kappa = 2"),
    ('impls = "f.py:g"\n', "parity[0].impls: 'f.py:g' is a str, not what the key takes"),
    ("dtypes = \"fp32\"\n", "parity[0].dtypes"),
])
def test_a_suite_value_of_the_wrong_type_is_one_sentence_naming_the_key(tmp_path, body, needle):
    res = run("gate", "--suite", _suite(tmp_path, body), "--device", "cpu", "-o", tmp_path / "g.parquet",
              "--junit", tmp_path / "g.xml", "--summary", tmp_path / "g.md")
    _one_sentence(res, needle)


def test_an_output_that_is_one_of_the_inputs_is_refused_and_the_input_kept(tmp_path):
    a = tmp_path / "a.parquet"
    assert run("parity", "--kernel", "sinkhorn", "--impl", "torch", "--dtype", "fp32", "--device", "cpu", "-q",
               "--scenario", _small_scenario(tmp_path), "-o", a).exit_code == 0
    before = a.read_bytes()
    _one_sentence(run("report", "html", a, "-o", a), "is the report read")
    _one_sentence(run("report", "compare", a, a, "--junit", a), "is one of the reports compared")
    _one_sentence(run("report", "merge", a, "-o", a), "is one of the slices merged")
    assert a.read_bytes() == before


def _small_scenario(tmp_path) -> Path:
    p = tmp_path / "sc.toml"
    p.write_text('name = "small"\n[[cases]]\nkernel = "sinkhorn"\nshapes = ["3x1x4x1"]\nfamilies = ["random"]\n'
                 'dtypes = ["fp32"]\n')
    return p


@pytest.mark.parametrize("args, said", [
    (["train", "--seeds", "0"], "error: --seeds: input should be greater than or equal to 1"),
    (["parity", "--kappa", "0"], "error: --kappa: input should be greater than or equal to 1"),
    (["parity", "--top", "-1"], "error: --top: input should be greater than or equal to 1"),
    (["bench", "--repeats", "1"], "error: --repeats: input should be greater than or equal to 3"),
])
def test_a_number_out_of_its_range_is_one_sentence_and_exit_2(args, said):
    """An option's refused value (issue 101): one sentence naming the option, as every bad input,
    never the option parser's boxed usage text."""
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2, res.output
    assert " ".join(res.output.split()) == said, res.output


def test_identify_refuses_several_implementations_in_one_sentence():
    res = CliRunner().invoke(app, ["identify", "--kernel", "sinkhorn", "--impl", "torch", "--impl", "triton",
                                   "--device", "cpu"])
    assert res.exit_code == 2 and "identify fits one implementation a run; got 2 (torch, triton)" in res.output


def test_a_device_is_taken_in_any_case_as_a_dtype_is(tmp_path):
    """``--device CPU`` as ``--dtype FP32`` (issue 101: the one was refused, the other taken)."""
    res = run("parity", "--kernel", "sinkhorn", "--impl", "torch", "--device", "CPU", "--dtype", "FP32",
              "--shape", "3x1x2x1", "-q", "-o", tmp_path / "r.parquet")
    assert res.exit_code == 0, res.output
    assert {r["device"] for r in pq.read_table(tmp_path / "r.parquet").to_pylist()} == {"cpu"}
