"""One call of an implementation (mhctool.runner.call): a compiler's refusal of a case is a skip
carrying the compiler's words, through Triton's CPU interpreter as on the GPU."""
from pathlib import Path

import pyarrow.parquet as pq
from typer.testing import CliRunner

from mhctool.cli.app import app

IMPLS = Path(__file__).resolve().parents[1] / "impls"
runner = CliRunner()


def test_a_triton_refusal_through_the_interpreter_is_a_skip_not_a_failure(tmp_path):
    """``tl.arange`` over 3 entries: the front end refuses it (on a GPU a CompilationError, here an
    InterpreterError around the same ValueError): the n = 3 case is skipped with those words, the
    n = 4 case is judged and passes."""
    spec = f"{IMPLS / 'triton_refusals.py'}:sinkhorn_pow2_only"
    rows = {}
    for n in (3, 4):
        out = tmp_path / f"n{n}.parquet"
        runner.invoke(app, ["parity", "--kernel", "sinkhorn", "--impl", spec, "--device", "cpu", "--dtype", "fp32",
                            "--shape", f"5x2x{n}x1", "-q", "-o", str(out)])
        rows[n] = [r for r in pq.read_table(out).to_pylist() if r["impl"].endswith("sinkhorn_pow2_only")]
    assert rows[3] and all(r["passed"] is None and r["metric"] == "unsupported" for r in rows[3])
    assert all("arange's range must be a power of 2" in r["message"] for r in rows[3])
    assert rows[4] and all(r["passed"] is not False for r in rows[4]) and any(r["passed"] for r in rows[4])
