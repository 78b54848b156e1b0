"""Liger-Kernel through its built-in adapter (a stand-in written from its public API; the real
package too where it is installed), and adapters written outside mhctool: a file named on the
command line, and an installed package's entry point."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from mhctool.registry import adapters
from mhctool.registry.specs import is_library_spec, resolve_impls
from mhctool.cli.app import app

ROOT = Path(__file__).resolve().parents[2]
IMPLS = ROOT / "tests" / "impls"
SCENARIO = ROOT / "tests" / "data" / "libraries.toml"
LIGER_STANDIN = IMPLS / "liger_standin"
cli = CliRunner()


def parity(tmp_path, *args, kernel="mhc", scenario=SCENARIO, env=None):
    out = tmp_path / "r.parquet"
    res = cli.invoke(app, ["parity", "--kernel", kernel, "--device", "cpu", "--scenario", str(scenario),
                           "-o", str(out), *map(str, args)], env=env)
    return res, (pq.read_table(out).to_pylist() if out.exists() else [])


def test_liger_standin_every_function_judged_as_shipped(tmp_path):
    res, rows = parity(tmp_path, "--impl", f"liger:{LIGER_STANDIN}")
    assert res.exit_code == 0, res.output
    assert not [r for r in rows if r["metric"] == "error"]
    judged = {(r["kernel"], r["impl"]) for r in rows if r["impl"].startswith("liger[") and r["passed"] is not None}
    assert judged == {("h_aggregate", "liger[local]:liger_mhc_pre"),
                      ("h_post_bda", "liger[local]:liger_mhc_post_res"),
                      ("mapping_sinkhorn", "liger[local]:liger_mhc_coeffs"),
                      ("mix_aggregate", "liger[local]:liger_mhc_coeffs+liger_mhc_pre")}
    # the conventions it declares are what the reference computed, and recorded in the rows
    coeffs = next(r for r in rows if r["kernel"] == "mapping_sinkhorn" and r["impl"].startswith("liger["))
    assert '"rms_eps": "inside"' in coeffs["knobs"] and '"stabilize": "softmax"' in coeffs["knobs"]
    # the default case has a bias (folded into the branch outside Liger's code) and is judged
    assert any(r["kernel"] == "h_post_bda" and r["impl"].startswith("liger[") and r["passed"] for r in rows)
    skipped = {r["kernel"]: r["message"] for r in rows if r["impl"].startswith("liger") and r["metric"] == "unsupported"}
    assert skipped["sinkhorn"] == "liger (local) has no sinkhorn kernel"


def test_liger_declares_tf32_truncation_on_the_gpu_and_ieee_on_the_interpreter():
    (impl,) = resolve_impls("mapping_sinkhorn", [f"liger:{LIGER_STANDIN}"])
    assert impl.precision_on("cuda") == "tf32_trunc" and impl.precision_on("cpu") == "ieee"
    assert impl.conventions == {"rms_eps": "inside", "stabilize": "softmax", "order": "row_first"}


def test_liger_takes_n_a_power_of_two(tmp_path):
    scenario = tmp_path / "n3.toml"
    scenario.write_text('name = "n3"\n[[cases]]\nkernel = "mapping_sinkhorn"\nshapes = ["5x2x3x40"]\n'
                        'dtypes = ["fp32"]\nfamilies = ["random"]\n')
    res, rows = parity(tmp_path, "--impl", f"liger:{LIGER_STANDIN}", kernel="mapping_sinkhorn", scenario=scenario)
    (skip,) = [r for r in rows if r["impl"].startswith("liger[")]
    assert skip["metric"] == "unsupported" and "n a power of two, not 3" in skip["message"]
    # skipped on every case: the library was judged on nothing, which is no pass
    assert res.exit_code == 1, res.output
    assert "was judged on no case: every row of it was skipped (Liger-Kernel's mHC kernels take n a power of two" \
        in " ".join(res.output.split())


@pytest.mark.skipif(not __import__("importlib").util.find_spec("liger_kernel") or
                    __import__("importlib").util.find_spec("liger_kernel").origin.startswith(str(IMPLS)),
                    reason="Liger-Kernel is not installed (pip install liger-kernel)")
def test_real_liger_kernel_at_fp32_through_the_interpreter(tmp_path):
    """The package as shipped, its Triton kernels through the interpreter (skipped where it is not
    installed: CI judges the stand-in)."""
    scenario = tmp_path / "liger.toml"
    scenario.write_text('name = "liger"\n' + "".join(
        f'[[cases]]\nkernel = "{k}"\nshapes = ["5x3x4x40"]\ndtypes = ["fp32", "bf16"]\nfamilies = ["random", "tiny_norm"]\n'
        for k in ("mapping_sinkhorn", "mix_aggregate")))
    res, rows = parity(tmp_path, "--impl", "liger:liger_kernel", kernel="mapping_sinkhorn,mix_aggregate",
                       scenario=scenario)
    assert res.exit_code == 0, res.output
    assert {r["dtype"] for r in rows if r["impl"].startswith("liger[") and r["passed"]} == {"fp32", "bf16"}


# --- adapters from outside mhctool --------------------------------------------------------------

LIBRARY = '''
"""A small library of one's own: an aggregation with its own argument order and streams last."""
import torch


def weighted_streams(weights, streams_last):
    return (streams_last.float() @ weights.float().unsqueeze(-1)).squeeze(-1).to(streams_last.dtype)
'''

ADAPTER = '''
"""An mhctool adapter for mylib, kept beside it: mhctool is not modified."""
from mhctool.libraries import Binding, load_path_or_module

NAME = "mylib"


def load(target):
    return load_path_or_module(target, "mylib", "mylib.py")


def _streams_last(x):
    return x.transpose(-1, -2).contiguous()


def _aggregate(m, x, h_pre):
    return m.weighted_streams(h_pre, x)


def recognise(m):
    found = []
    if hasattr(m, "weighted_streams"):
        found.append(Binding("h_aggregate", "weighted_streams", _aggregate, layouts={"x": _streams_last}))
    return "0.1", found
'''


def _write_library(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "mylib.py").write_text(textwrap.dedent(LIBRARY))
    (folder / "mylib_adapter.py").write_text(textwrap.dedent(ADAPTER))
    return folder


def test_an_adapter_file_on_the_command_line(tmp_path):
    lib = _write_library(tmp_path / "own")
    res, rows = parity(tmp_path, "--impl", f"{lib / 'mylib_adapter.py'}:{lib / 'mylib.py'}", kernel="h_aggregate")
    assert res.exit_code == 0, res.output
    mine = [r for r in rows if r["impl"] == "mylib[0.1]:weighted_streams"]
    assert mine and all(r["passed"] for r in mine if r["passed"] is not None)
    assert {r["dtype"] for r in mine if r["passed"]} == {"fp32", "bf16"}


def test_an_adapter_from_an_installed_packages_entry_point(tmp_path):
    """A package that declares ``[project.entry-points."mhctool.adapters"] mylib = "mylib_adapter"``,
    as installed: its dist-info on the path. mhctool finds ``mylib:`` with nothing else said."""
    site = _write_library(tmp_path / "site")
    info = site / "mylib_adapter-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mylib-adapter\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[mhctool.adapters]\nmylib = mylib_adapter\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    env.pop("TRITON_INTERPRET", None)
    sc = tmp_path / "sc.toml"  # what is tested is finding the adapter: one small case
    sc.write_text('name = "ep"\n[[cases]]\nkernel = "h_aggregate"\nshapes = ["5x3x4x40"]\ndtypes = ["fp32"]\n'
                  'families = ["random"]\n')
    out = subprocess.run([sys.executable, "-m", "mhctool.cli", "parity", "--kernel", "h_aggregate", "--impl",
                          f"mylib:{site}", "--device", "cpu", "--scenario", str(sc), "--quiet",
                          "-o", str(tmp_path / "r.parquet")], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = pq.read_table(tmp_path / "r.parquet").to_pylist()
    assert any(r["impl"] == "mylib[0.1]:weighted_streams" and r["passed"] for r in rows)
    listed = subprocess.run([sys.executable, "-c", "from mhctool.registry import adapters; print(adapters.names())"],
                            capture_output=True, text=True, env=env, timeout=120)
    assert "'mylib'" in listed.stdout, listed.stderr


def test_a_plain_file_is_no_adapter_and_an_unknown_name_says_what_is_accepted(tmp_path):
    plain = tmp_path / "plain.py"
    plain.write_text("def h_aggregate(x, h_pre):\n    return (x * h_pre.unsqueeze(-1)).sum(-2)\n")
    assert adapters.find(str(plain)) is None
    assert not is_library_spec(f"{plain}:h_aggregate")
    res, _ = parity(tmp_path, "--impl", "nolib:somewhere", kernel="h_aggregate")
    assert res.exit_code == 2
