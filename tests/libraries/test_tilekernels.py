"""DeepSeek's TileKernels through its adapter (stand-ins of both layouts, written from the public
API: tests/impls/tilekernels_standin), shape limits as skips with the library's reason, and a file
of family-named functions judged and benched over every family it defines."""
from pathlib import Path

import pyarrow.parquet as pq
from typer.testing import CliRunner

from mhctool.cli.app import app

HERE = Path(__file__).resolve().parents[1]
STANDIN = HERE / "impls" / "tilekernels_standin"
runner = CliRunner()


def _run(*args):
    res = runner.invoke(app, [str(a) for a in args])
    return res, " ".join(res.output.split())


def _parity(tmp_path, spec, kernel, *extra):
    res, text = _run("parity", "--kernel", kernel, "--impl", spec, "--device", "cpu", "-q",
                     "-o", tmp_path / "p.parquet", *extra)
    return res, text, pq.read_table(tmp_path / "p.parquet").to_pylist()


def test_the_pip_layout_every_function_judged(tmp_path):
    """pip 2.1.0: kernel functions on caller-allocated buffers, autograd glue in the adapter; every
    family it has judged and passing, its limits skipped with its reasons, no error row."""
    res, text, rows = _parity(tmp_path, f"tilekernels:{STANDIN / 'pip'}", "mhc", "--shape", "7x3x4x128",
                              "--dtype", "bf16")
    assert res.exit_code == 0, text
    for fn in ("sinkhorn", "mhc_pre_apply_mix", "mhc_post", "mhc_pre_norm_fn+mhc_pre_split_mixes[gemm:torch]",
               "mhc_pre[gemm:torch]"):
        line = text.split(f"tilekernels[pip-standin]:{fn}: ", 1)[1]
        assert not line.startswith("0 passed") and line.split(" failed")[0].endswith(" 0"), (fn, text)
    assert "mhc_pre_big_fuse[gemm:torch][inference]: 3 passed" in text  # forward only: no backward
    assert not [r for r in rows if r["metric"] == "error"]
    skipped = {r["message"] for r in rows if r["metric"] == "unsupported" and "pip-standin" in r["impl"]}
    assert "TileKernels' mhc_post takes a hidden size that is a multiple of 128, not C = 4099" in skipped
    conv = {r["knobs"] for r in rows if r["impl"].endswith(":mhc_post")}
    assert all('"transpose_res": true' in k for k in conv)


def test_the_github_layout_and_its_tf32_projection(tmp_path):
    """The GitHub layout's autograd ops; its projection rounds the weight to TF32, judged at tf32."""
    res, text, rows = _parity(tmp_path, f"tilekernels:{STANDIN / 'github'}", "mapping,mix_aggregate",
                              "--shape", "7x3x4x128", "--dtype", "bf16")
    assert res.exit_code == 0, text
    assert "tilekernels[github-standin]:mhc_pre_norm_fn+mhc_pre_split_mixes: 8 passed, 0 failed" in text
    assert {r["precision"] for r in rows if "github-standin" in r["impl"]} == {"tf32"}


def test_limits_are_skips_with_the_library_s_words(tmp_path):
    """n = 2: mhc_post's forward judged, its backward (n = 4 only) skipped saying so; n = 3:
    Sinkhorn skipped for every case, so the library was judged on nothing: a failed run."""
    res, text, rows = _parity(tmp_path, f"tilekernels:{STANDIN / 'pip'}", "h_post_bda", "--shape", "7x3x2x128",
                              "--dtype", "bf16")
    assert res.exit_code == 0, text
    bwd = {r["message"] for r in rows if r["direction"] == "bwd" and r["metric"] == "unsupported"}
    assert bwd == {"its backward refuses this case: NotImplementedError: TileKernels' mhc_post backward takes "
                   "n = 4 only, not 2"}
    assert any(r["direction"] == "fwd" and r["passed"] for r in rows if "mhc_post" in r["impl"])
    res, text, _ = _parity(tmp_path, f"tilekernels:{STANDIN / 'pip'}", "sinkhorn", "--shape", "7x3x3x1",
                           "--dtype", "fp32")
    assert res.exit_code == 1 and "was judged on no case" in text and "power of two" in text


def test_a_plain_function_s_own_assert_is_a_limit_not_a_failure(tmp_path):
    """A function that asserts on a shape it does not take is judged at the others: the refused
    cases are skipped with its message; refusing every case is still no pass."""
    f = tmp_path / "k.py"
    f.write_text("import torch\n\ndef agg(x, h_pre):\n"
                 "    assert x.shape[-1] <= 1024, f'C at most 1024, got {x.shape[-1]}'\n"
                 "    return torch.einsum('sbj,sbjc->sbc', h_pre.to(x.dtype), x)\n")
    res, text, rows = _parity(tmp_path, f"{f}:agg", "h_aggregate", "--dtype", "fp32")
    assert res.exit_code == 0, text
    refused = [r for r in rows if r["impl"].endswith(":agg") and r["metric"] == "unsupported"]
    judged = [r for r in rows if r["impl"].endswith(":agg") and r["passed"] is not None]
    assert refused and judged
    assert all(r["message"].startswith("it refuses this case (a limit it states; judged at the others): "
                                       "AssertionError: C at most 1024") for r in refused)
    res, text, _ = _parity(tmp_path, f"{f}:agg", "h_aggregate", "--dtype", "fp32", "--shape", "5x3x4x2048")
    assert res.exit_code == 1 and "judged on no case" in text


def test_a_file_of_family_named_functions_is_judged_and_benched_like_a_library(tmp_path):
    f = tmp_path / "kernels.py"
    f.write_text("import torch\n\n"
                 "def sinkhorn(logits, iters=20, eps=1e-6):\n"
                 "    p = torch.exp(logits - logits.amax(-1, keepdim=True))\n"
                 "    for _ in range(iters):\n"
                 "        p = p / (p.sum(-1, keepdim=True) + eps)\n"
                 "        p = p / (p.sum(-2, keepdim=True) + eps)\n"
                 "    return p\n\n"
                 "def h_aggregate(x, h_pre):\n"
                 "    return torch.einsum('sbj,sbjc->sbc', h_pre.to(x.dtype), x)\n\n"
                 "def helper(t):\n    return t\n")
    res, text, rows = _parity(tmp_path, f, "sinkhorn,h_aggregate,h_post_bda", "--dtype", "fp32")
    assert res.exit_code == 0, text
    assert "of them kernels.py:sinkhorn: 40 passed" in text and "of them kernels.py:h_aggregate: 6 passed" in text
    assert "kernels.py defines no function h_post_bda (it has sinkhorn, h_aggregate)" in \
        {r["message"] for r in rows if r["metric"] == "unsupported"}
    res, text = _run("bench", "--kernel", "sinkhorn,h_aggregate", "--impl", f"torch,{f}", "--device", "cpu",
                     "--shape", "4x2x4x64", "--repeats", "3", "-o", tmp_path / "b.parquet")
    assert res.exit_code == 0, text
    assert "kernels.py:sinkhorn" in text and "kernels.py:h_aggregate" in text
    empty = tmp_path / "none.py"
    empty.write_text("def helper():\n    pass\n")
    res, text = _run("parity", "--kernel", "sinkhorn", "--impl", empty, "--device", "cpu")
    assert res.exit_code == 2 and "defines no function named after a family" in text


def test_what_counts_as_a_refusal():
    """An assert, NotImplementedError or a kernel compiler's error is a limit the code states; any
    other exception (a RuntimeError, torch.compile's failures) is a failure."""
    from mhctool.runner.call import refusal

    class TileLangError(Exception):
        pass
    TileLangError.__module__ = "tvm_ffi.core"

    class BackendCompilerFailed(Exception):
        pass
    BackendCompilerFailed.__module__ = "torch._dynamo.exc"
    assert refusal(AssertionError("C % 128")) and refusal(NotImplementedError()) and refusal(TileLangError())
    assert not refusal(RuntimeError("illegal memory access")) and not refusal(BackendCompilerFailed())
