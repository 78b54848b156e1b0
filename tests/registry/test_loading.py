"""Files and folders as modules (mhctool.registry.loading)."""

from typer.testing import CliRunner

from mhctool.cli.app import app

runner = CliRunner()

WRAPPER = '''"""A wrapper named like what it wraps: tabnanny.py importing the installed tabnanny."""
import tabnanny

from mhctool.kernels.torch import mhc as native
from helper import ITERS  # a sibling file: the folder is on the path

QUIET = tabnanny.filename_only  # the installed module's, read at import


def sinkhorn(logits, iters=20, eps=1e-6):
    return native.sinkhorn(logits, ITERS, eps)
'''


def test_a_file_named_like_what_it_imports_imports_that_not_itself(tmp_path):
    """The file's folder goes on sys.path after what is installed: ``import tabnanny`` inside
    ``tabnanny.py`` is the standard library's (with the folder first it was the file itself,
    half initialised: "module has no attribute"), and a sibling file still imports."""
    (tmp_path / "tabnanny.py").write_text(WRAPPER)
    (tmp_path / "helper.py").write_text("ITERS = 20\n")
    res = runner.invoke(app, ["parity", "--kernel", "sinkhorn", "--impl", f"{tmp_path / 'tabnanny.py'}:sinkhorn",
                              "--device", "cpu", "--dtype", "fp32", "--shape", "5x2x4x1", "-q",
                              "-o", str(tmp_path / "r.parquet")])
    assert res.exit_code == 0, res.output
    assert "tabnanny.py:sinkhorn: 10 passed, 0 failed" in " ".join(res.output.split())
