"""mhctool's conclusion is the terminal's last line: what a library writes as the process shuts
down (PyTorch's CUDA IPC warning after an isolation worker died, here an atexit line of the module
under test) goes to the run's library log, or nowhere where the command kept none."""
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
    assert "a third-party line at shutdown" in (tmp_path / "r.libraries.log").read_text()


def test_a_command_without_a_library_log_drops_it(tmp_path):
    p = subprocess.run([*MAIN, "bench", "--kernel", "sinkhorn", "--impl", f"{NOISY}:sinkhorn", "--device", "cpu",
                        "--shape", "5x1x4x1", "--dtype", "fp32", "--repeats", "3", "-q", "-o", str(tmp_path / "b.parquet")],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "third-party line" not in p.stdout + p.stderr
