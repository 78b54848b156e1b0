"""A built wheel carries the engine, the kernels, the references and the scenarios."""
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_builds_and_imports(tmp_path):
    # from a copy of what git tracks: a build/ folder left by an earlier build would lend the wheel
    # files the package list no longer names (as it hid two missing subpackages once)
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "mhctool", "kernels", "references", "scenarios"):
        (shutil.copytree if (ROOT / name).is_dir() else shutil.copy)(
            ROOT / name, src / name, **({"ignore": shutil.ignore_patterns("__pycache__")} if (ROOT / name).is_dir() else {}))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "dist"), str(src)], check=True, cwd=tmp_path)
    wheel = next((tmp_path / "dist").glob("mhctool-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    for must in ("mhctool/cli/app.py", "mhctool/kernels/torch/mhc.py", "mhctool/references/mhc.py",
                 "mhctool/scenarios/parity-default.toml", "mhctool/kernels/triton/__init__.py"):
        assert must in names, must
    assert not any(n.startswith(("kernels/", "references/", "scenarios/")) for n in names)
    # every module of the package ships (a subpackage left out of pyproject's list is missing from
    # the wheel while an editable install still finds it)
    ours = {p.relative_to(ROOT).as_posix() for p in (ROOT / "mhctool").rglob("*.py")}
    assert ours <= set(names), sorted(ours - set(names))
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = ("import mhctool, mhctool.kernels.torch.mhc, mhctool.references.mhc; "
            "from mhctool.analyses import scenario; print(mhctool.__file__); print(len(scenario.builtin('paper').specs))")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env={"PYTHONPATH": str(site), "PATH": ""},
                         capture_output=True, text=True, check=True).stdout.split()
    assert out[0].startswith(str(site)) and out[1] == "8"  # the paper scenario's case entries
