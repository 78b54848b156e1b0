import pytest
from typer.testing import CliRunner

from mhctool.cli.app import app


@pytest.fixture
def train():
    """``train(tmp_path, *args, name="t") -> (result, output on one line)``: ``mhctool train`` in
    this process, writing ``tmp_path/NAME.parquet``; its seeds in it too unless the test asks for
    workers (the suite's own workers are the cores already)."""
    runner = CliRunner()

    def invoke(tmp_path, *args, name="t"):
        spread = [] if "--workers" in map(str, args) else ["--workers", "1"]
        res = runner.invoke(app, ["train", *map(str, args), *spread, "-o", str(tmp_path / f"{name}.parquet"), "-q"])
        return res, " ".join(res.output.split())
    return invoke
