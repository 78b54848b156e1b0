"""mhctool from Python: mhctool.testing, the pytest plugin, the public names."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import mhctool
from mhctool.core import report
from mhctool.core.findings import verdicts
from mhctool.cli.app import app
from mhctool.testing import ParityResult, assert_parity, check_parity

IMPLS = Path(__file__).resolve().parent / "impls"  # loaded by file path, never as a package

PAGE = Path(__file__).resolve().parents[1] / "docs" / "api.md"


def _page_blocks() -> tuple[str, list[str]]:
    """What a kernel author's own test file looks like (the API page's, which knows nothing of
    mhctool's tests), and the output the page shows for it."""
    text = PAGE.read_text()
    code = text.split("```python\n# test_my_sinkhorn.py\n", 1)[1].split("```", 1)[0]
    shown = text.split("<!-- sample of the command above -->\n```\n", 1)[1].split("```", 1)[0].splitlines()
    return code, [ln for ln in shown if not ln.startswith("$ ")]


USER_TESTS, SHOWN = _page_blocks()


_HAS_ENTRY_POINT = ("import importlib.metadata as m; "
                    "print(any(e.value == 'mhctool.pytest_plugin' for e in m.entry_points(group='pytest11')))")


def _sampling():
    """tests/docs/sampling.py (its matching of a page's sample with what a command printed)."""
    import importlib.util
    if "sampling" in sys.modules:
        return sys.modules["sampling"]
    spec = importlib.util.spec_from_file_location("sampling", Path(__file__).resolve().parent / "docs" / "sampling.py")
    module = sys.modules["sampling"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _pytest(args, cwd):
    """pytest in a child process, in ``cwd``, as a user runs it: the plugin comes from the
    installed entry point (asked for with -p where mhctool runs from a tree without one)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    found = subprocess.run([sys.executable, "-c", _HAS_ENTRY_POINT], cwd=cwd, capture_output=True, text=True, env=env)
    extra = [] if found.stdout.strip() == "True" else ["-p", "mhctool.pytest_plugin"]
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *extra, *args],
                          cwd=cwd, capture_output=True, text=True, env=env, timeout=600)


def test_a_users_test_file_passes_the_correct_kernel_and_fails_eps_1e8_with_one_report(tmp_path):
    (tmp_path / "test_my_sinkhorn.py").write_text(USER_TESTS)
    out = tmp_path / "reports" / "parity.parquet"
    res = _pytest(["test_my_sinkhorn.py", f"--mhctool-report={out}"], tmp_path)
    text = res.stdout + res.stderr
    assert res.returncode == 1, text
    missing = _sampling().mismatches(SHOWN, text)  # the API page's sample is what pytest prints
    assert not missing, (missing, text)
    assert "1 failed, 1 passed" in text
    assert "test_sinkhorn_with_eps_1e8" in text and "AssertionError: mhctool parity failed" in text
    failure = text[text.index("AssertionError: mhctool parity failed"):]
    assert "grad_logits" in failure and "max_abs" in failure  # the tensor and the metric
    assert "random" in failure or "dead_rows_cols" in failure  # the input family
    assert "kappa=2 x native" in failure  # the rule
    table, meta = report.read(out)  # one report, both calls
    calls = meta["run"]["calls"]
    assert [c["test"].split("::")[1] for c in calls] == ["test_correct_sinkhorn", "test_sinkhorn_with_eps_1e8"]
    assert [c["passed"] for c in calls] == [True, False]
    impls = set(table.column("impl").to_pylist())
    assert {"test_my_sinkhorn:sinkhorn", "test_my_sinkhorn:sinkhorn_eps_1e8", "torch"} <= impls
    assert len(set(table.column("run_id").to_pylist())) == 2


def test_the_plugin_is_idle_unless_asked():
    code = "import sys, mhctool.pytest_plugin; assert 'torch' not in sys.modules, 'plugin imported torch'"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0
    code = "import sys, mhctool; assert 'torch' not in sys.modules; mhctool.read_report; print('ok')"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "ok"


def test_unwritable_report_path_is_a_usage_error(tmp_path):
    (tmp_path / "test_nothing.py").write_text("def test_nothing():\n    pass\n")
    res = _pytest(["test_nothing.py", f"--mhctool-report={tmp_path}"], tmp_path)
    assert res.returncode == 4 and "is a directory" in res.stderr + res.stdout


def test_cli_and_api_give_the_same_verdicts_row_by_row(tmp_path):
    spec = f"{IMPLS / 'defects.py'}:sinkhorn_eps_1e8"
    path = tmp_path / "cli.parquet"
    res = CliRunner().invoke(app, ["parity", "--kernel", "sinkhorn", "--impl", spec, "--device", "cpu",
                                   "--no-isolate", "-o", str(path)])
    assert res.exit_code == 1, res.output
    cli_rows = report.read(path)[0].drop(["run_id"]).to_pylist()
    api = check_parity(spec, "sinkhorn", device="cpu")
    api_rows = api.table.drop(["run_id"]).to_pylist()
    assert len(cli_rows) == len(api_rows) > 0
    key = ("case_id", "impl", "direction", "tensor", "metric", "value", "threshold", "passed", "rule")
    norm = [lambda r: tuple("nan" if v != v else v for v in (r[k] for k in key))] * 2
    assert sorted(map(norm[0], cli_rows), key=repr) == sorted(map(norm[1], api_rows), key=repr)
    cli_verdicts = {(v["case_id"], v["direction"]): v["passed"] for v in verdicts(report.read(path)[0])
                    if v["impl"] == spec}
    assert cli_verdicts == {(v["case_id"], v["direction"]): v["passed"] for v in api.verdicts}
    assert not api.passed and any(v is False for v in cli_verdicts.values())


def test_result_object_and_narrowing():
    r = check_parity("torch", "h_post_bda", dtypes=["fp32"], families=["random"], device="cpu", seed=3)
    assert isinstance(r, ParityResult) and r.passed and r.impls == ["torch"]
    assert {v["family"] for v in r.verdicts} == {"random"}
    assert set(r.table.column("seed").to_pylist()) == {3}
    assert set(r.table.column("dtype").to_pylist()) == {"fp32"}
    assert r.settings["kappa"] == 2.0 and "passed" in r.summary()


def test_a_declared_convention_reaches_the_reference():
    def softmax_first(logits, iters=20, eps=1e-6):
        p = logits.softmax(-1) + eps
        p = p / (p.sum(-2, keepdim=True) + eps)
        for _ in range(iters - 1):
            p = p / (p.sum(-1, keepdim=True) + eps)
            p = p / (p.sum(-2, keepdim=True) + eps)
        return p
    kw = dict(dtypes=["fp32"], families=["random"], device="cpu")
    # undeclared: it fails, and the message carries parity's hint (identified, then rerun with it)
    with pytest.raises(AssertionError, match="hint: .*softmax_first fails on sinkhorn but passes with "
                                             "--convention stabilize=softmax"):
        assert_parity(softmax_first, "sinkhorn", **kw)
    assert_parity(softmax_first, "sinkhorn", convention={"stabilize": "softmax"}, **kw)


@pytest.mark.parametrize("call, needle", [
    (lambda: check_parity("torch", "nope"), "unknown kernel"),
    (lambda: check_parity("torch", "sinkhorn", dtypes=["fp7"]), "fp7"),
    (lambda: check_parity("torch", "sinkhorn", families=["nope"]), "unknown input family"),
    (lambda: check_parity(lambda x: x, "sinkhorn", convention={"bogus": 1}), "no convention of sinkhorn"),
    (lambda: check_parity("torch", "sinkhorn", matmul_precision="fp8"), "matmul-precision"),
    (lambda: check_parity("torch", "sinkhorn", kappa=0.5), "at least 1"),
    (lambda: check_parity("nosuchimpl", "sinkhorn"), "unknown implementation"),
])
def test_bad_arguments_raise_usage_error(call, needle):
    with pytest.raises(mhctool.UsageError, match=needle):
        call()
    assert issubclass(mhctool.UsageError, ValueError)


def test_not_a_callable_is_a_type_error():
    with pytest.raises(TypeError, match="callable"):
        check_parity(42, "sinkhorn", device="cpu")


def test_public_names_are_listed_documented_and_annotated():
    import inspect
    for name in mhctool.__all__:
        obj = getattr(mhctool, name)
        if callable(obj) and name != "UsageError":
            assert obj.__doc__ and ("Example" in obj.__doc__ or name in ("read_report", "ParityResult")), name
    sig = inspect.signature(assert_parity)
    assert all(p.annotation is not inspect.Parameter.empty for p in sig.parameters.values())
    assert "assert_parity" in dir(mhctool)


def test_sinkhorn_example_in_the_docstring_runs():
    assert check_parity("torch", "sinkhorn", dtypes=["fp32"], device="cpu").passed
    with pytest.raises(AssertionError, match="kernel +family +dtype"):
        assert_parity(f"{IMPLS / 'defects.py'}:sinkhorn_eps_1e8", "sinkhorn", dtypes=["fp32"], device="cpu")


def test_the_native_run_is_measured_once_a_baseline(monkeypatch):
    """The native run's metrics are taken when its baseline is made and kept for its own rows
    (measuring them again cost a third of judging): one measurement a tensor of the report."""
    calls = []
    from mhctool.runner import baseline
    real = baseline.measure

    def counting(*args, **kw):
        calls.append(1)
        return real(*args, **kw)
    monkeypatch.setattr(baseline, "measure", counting)
    r = check_parity("torch", "h_post_bda", dtypes=["fp32"], families=["random"], device="cpu", seed=3)
    rows = r.table.to_pylist()
    tensors = {(x["case_id"] if "case_id" in x else x["shape"], x["impl"], x["direction"], x["tensor"])
               for x in rows if x["metric"] == "max_abs"}
    assert r.passed and tensors and len(calls) == len(tensors)
