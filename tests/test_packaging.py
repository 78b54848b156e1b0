"""A built wheel carries the engine, the kernels, the references and the scenarios."""
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_builds_and_imports(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "dist"), str(ROOT)], check=True, cwd=tmp_path)
    wheel = next((tmp_path / "dist").glob("mhctool-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    for must in ("mhctool/cli/app.py", "mhctool/kernels/torch/mhc.py", "mhctool/references/mhc.py",
                 "mhctool/scenarios/parity-default.toml", "mhctool/kernels/triton/__init__.py"):
        assert must in names, must
    assert not any(n.startswith(("kernels/", "references/", "scenarios/")) for n in names)
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = ("import mhctool, mhctool.kernels.torch.mhc, mhctool.references.mhc; "
            "from mhctool.analyses import scenario; print(mhctool.__file__); print(len(scenario.builtin('paper').specs))")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env={"PYTHONPATH": str(site), "PATH": ""},
                         capture_output=True, text=True, check=True).stdout.split()
    assert out[0].startswith(str(site)) and out[1] == "7"  # the paper scenario's case entries
