"""Triton's interpreter never blames a kernel for its own faults; plain files get it unasked."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mhctool.core import interpreter
from mhctool.testing import check_parity

IMPLS = Path(__file__).resolve().parents[1] / "impls"
BF16_DOT = f"{IMPLS / 'triton_bf16_dot.py'}:proj_rms"

pytestmark = pytest.mark.skipif(not interpreter.active(), reason="the interpreter runs on machines without a GPU")


def test_the_bf16_product_is_right_after_prepare():
    errors = interpreter.prepare()
    assert errors["bf16"] <= interpreter.TOLERANCE and errors["fp16"] <= interpreter.TOLERANCE
    assert interpreter.dot_error("bf16") <= interpreter.TOLERANCE
    assert interpreter.fault("bf16") is None and interpreter.fault("fp32") is None


def test_the_unmended_interpreter_is_what_the_mend_is_for():
    """The fault is real (so the mend is no decoration): Triton's own create_dot, called directly
    on bf16 handles, multiplies their bit patterns."""
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle
    original = getattr(InterpreterBuilder.create_dot, "__wrapped__", InterpreterBuilder.create_dot)
    a = torch.randn(16, 32, dtype=torch.bfloat16)
    b = torch.randn(32, 16, dtype=torch.bfloat16)
    ha = TensorHandle(a.view(torch.int16).numpy().view(np.uint16), tl.bfloat16)
    hb = TensorHandle(b.view(torch.int16).numpy().view(np.uint16), tl.bfloat16)
    d = TensorHandle(np.zeros((16, 16), np.float32), tl.float32)
    exact = (a.double() @ b.double()).numpy()
    wrong = original(InterpreterBuilder(), ha, hb, d, "ieee", 0).data
    assert abs(wrong - exact).max() > 1e3
    mended = InterpreterBuilder.create_dot(InterpreterBuilder(), ha, hb, d, "ieee", 0).data
    assert abs(mended - exact).max() < 1e-4


def test_a_correct_bf16_dot_kernel_passes_on_the_cpu():
    res = check_parity(BF16_DOT, "proj_rms", dtypes=["bf16", "fp32"], device="cpu", shapes=["13x3x4x67"],
                       families=["random", "tiny_norm"])
    assert res.passed and res.judged == 8, res.message()


def test_an_interpreter_that_stays_wrong_skips_the_case_and_says_why(monkeypatch):
    monkeypatch.setitem(interpreter._state, "errors", None)
    monkeypatch.setattr(interpreter, "dot_error", lambda dtype: 4.4e10 if dtype == "bf16" else 0.0)
    monkeypatch.setattr(interpreter, "_mend_bf16_dot", lambda: None)
    res = check_parity(BF16_DOT, "proj_rms", dtypes=["bf16", "fp32"], device="cpu", shapes=["13x3x4x67"],
                       families=["random"])
    assert res.passed and res.judged == 2  # fp32 judged; bf16 a skip, never a failure of the kernel
    (skip,) = [v for v in res.verdicts if v["passed"] is None]
    assert skip["dtype"] == "bf16"
    assert "interpreter computes bf16 tl.dot wrong here (relative error 4.4e+10" in skip["message"]
    assert "judge bf16 on a GPU" in skip["message"]


def test_a_plain_file_runs_through_the_interpreter_with_no_variable_set(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-m", "mhctool.cli", "parity", "--kernel", "proj_rms", "--impl", BF16_DOT,
                          "--device", "cpu", "--dtype", "bf16", "--shape", "13x3x4x67",
                          "--out", str(tmp_path / "r.parquet"), "--quiet"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 failed" in out.stdout and "0 skipped" in out.stdout
