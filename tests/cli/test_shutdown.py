"""mhctool's lines are the terminal's: what a library writes while a command runs goes to the
run's library log (parity, identify, bench, gate, train), and so does what it writes as the
process shuts down (PyTorch's CUDA IPC warning after an isolation worker died, here an atexit line
of the module under test), never after the conclusion."""
import subprocess
import sys
from pathlib import Path

NOISY = Path(__file__).resolve().parents[1] / "impls" / "shutdown_noise.py"
MAIN = [sys.executable, "-c", "from mhctool.cli import main; main()"]


def test_a_line_written_at_shutdown_goes_to_the_library_log(tmp_path):
    out = tmp_path / "r.parquet"
    p = subprocess.run([*MAIN, "parity", "--kernel", "sinkhorn", "--impl", f"{NOISY}:sinkhorn", "--device", "cpu",
                        "--shape", "5x1x4x1", "--dtype", "fp32", "-o", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "third-party line" not in p.stdout + p.stderr
    assert "resource_tracker" not in p.stdout + p.stderr  # the leaked semaphore's warning
    assert "a third-party line at shutdown" in (tmp_path / "r.libraries.log").read_text()


def test_a_command_without_a_library_log_drops_it(tmp_path):
    p = subprocess.run([*MAIN, "bench", "--kernel", "sinkhorn", "--impl", f"{NOISY}:sinkhorn", "--device", "cpu",
                        "--shape", "5x1x4x1", "--dtype", "fp32", "--repeats", "3", "-q", "-o", str(tmp_path / "b.parquet")],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "third-party line" not in p.stdout + p.stderr


def test_bench_and_train_keep_the_libraries_lines_in_their_log(tmp_path):
    chatty = f"{NOISY}:sinkhorn_chatty"
    runs = {"b": ["bench", "--kernel", "sinkhorn", "--impl", chatty, "--device", "cpu", "--shape", "5x1x4x1",
                  "--dtype", "fp32", "--repeats", "3"],
            "t": ["train", "--kernel", "sinkhorn", "--impl", chatty, "--device", "cpu", "--steps", "2", "--layers",
                  "1", "--seq", "8", "--seeds", "1", "--workers", "1", "--no-compare"]}
    for name, args in runs.items():
        p = subprocess.run([*MAIN, *args, "-o", str(tmp_path / f"{name}.parquet")], capture_output=True, text=True,
                           timeout=300)
        assert p.returncode == 0, p.stdout + p.stderr
        assert "[chatty]" not in p.stdout + p.stderr
        assert "[chatty] compiling a kernel" in (tmp_path / f"{name}.libraries.log").read_text()
        assert f"the libraries' own output: {tmp_path / f'{name}.libraries.log'}" in " ".join(p.stdout.split())


def test_what_the_code_under_test_writes_as_it_is_imported_goes_to_the_log(tmp_path):
    spec = f"{NOISY.with_name('import_warning.py')}:sinkhorn"
    for command, extra in (("identify", []), ("parity", ["--shape", "5x1x4x1", "--dtype", "fp32"])):
        out = tmp_path / f"{command}.parquet"
        p = subprocess.run([*MAIN, command, "--kernel", "sinkhorn", "--impl", spec, "--device", "cpu", *extra,
                            "-o", str(out)], capture_output=True, text=True, timeout=300)
        text = p.stdout + p.stderr
        assert p.returncode == 0, text
        assert "import_warning:" not in text and "UserWarning" not in text, text
        log = out.with_name(f"{command}.libraries.log").read_text()
        assert "UserWarning: import_warning: this module is deprecated" in log
        assert "import_warning: built its kernels" in log
