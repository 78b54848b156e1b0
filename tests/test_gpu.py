"""GPU tests (``pytest -m gpu`` on a CUDA machine); they skip cleanly without one."""
import pyarrow.parquet as pq
import pytest
import torch
from typer.testing import CliRunner

from mhctool.cli import app

pytestmark = pytest.mark.gpu
runner = CliRunner()


def _parity(tmp_path, *args):
    out = tmp_path / "r.parquet"
    res = runner.invoke(app, ["parity", "--device", "cuda", "-o", str(out), *args])
    return res, (pq.read_table(out).to_pylist() if out.exists() else [])


def test_triton_parity_default_scenario_on_gpu(tmp_path):
    res, rows = _parity(tmp_path, "--kernel", "all", "--impl", "triton")
    assert res.exit_code == 0, res.output
    tri = [r for r in rows if r["impl"] == "triton"]
    assert {r["kernel"] for r in tri} == {"sinkhorn", "h_aggregate", "h_post_bda", "proj_rms", "mapping"}
    assert all(r["value"] == 0 for r in tri if r["metric"] == "unwritten")


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_triton_parity_every_dtype_on_gpu(tmp_path, dtype):
    res, _ = _parity(tmp_path, "--kernel", "all", "--impl", "triton", "--dtype", dtype)
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize("kernel", ["h_aggregate", "h_post_bda"])
def test_triton_fp16_activations_on_gpu(tmp_path, kernel):
    """fp16 where the native baseline is meaningful (Sinkhorn and proj_rms in fp16 overflow on
    the amplifying families by design: that is what `stability` is for)."""
    res, _ = _parity(tmp_path, "--kernel", kernel, "--impl", "triton", "--dtype", "fp16")
    assert res.exit_code == 0, res.output


def test_compile_variant_on_gpu(tmp_path):
    res, rows = _parity(tmp_path, "--kernel", "h_aggregate", "--impl", "compile", "--dtype", "bf16")
    assert res.exit_code == 0, res.output
    assert any(r["impl"] == "compile" and r["passed"] for r in rows)


def test_sinkhorn_triton_tail_and_n(tmp_path):
    from mhctool.kernels.triton.sinkhorn import sinkhorn
    from mhctool.references.mhc import sinkhorn as ref
    for n in (2, 4, 8):
        L = torch.randn(32768 + 7, n, n, device="cuda")
        torch.testing.assert_close(sinkhorn(L).double(), ref(L.double()), rtol=0, atol=2e-6)


def test_defect_flagged_on_gpu(tmp_path):
    res, _ = _parity(tmp_path, "--kernel", "sinkhorn", "--dtype", "fp32",
                     "--impl", "tests.impls.defects:sinkhorn_no_max")
    assert res.exit_code == 1
