"""A signal never gives a traceback, and a run that measures writes what it has: every command at
an early moment (while Python imports the command line) and the sweeps, identify and bench at a
late one (an implementation under test has started: tests/impls/process.py touches the marker;
bench --engine's engine stand-in as its first mHC run starts).
parity's and train's late moments are tested beside their runs (tests/spread/test_isolation.py,
tests/analyses/test_first_step.py)."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mhctool.core import report

SLOW = f"{Path(__file__).resolve().parents[1] / 'impls' / 'process.py'}:sinkhorn_slow"
# the engine stand-in, the marker touched as its first run with hyper-connections starts (the
# baseline's is over by then)
ENGINE = f"{Path(__file__).resolve().parents[1] / 'impls' / 'engine_standin.py'}:train_marked"
MAIN = [sys.executable, "-c", "from mhctool.cli import main; main()"]


def _main_with(tmp_path, code: str):
    """mhctool's ``main`` with ``run`` (defined by ``code``) as the command, in a process of its own."""
    script = tmp_path / "run.py"
    script.write_text("import os, signal, sys\nimport mhctool.cli.app as app\n" + code
                      + "app.main = run\nfrom mhctool.cli import main\nmain()\n")
    return subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=120)


def _started(proc, marker, limit=120):
    """Wait until the implementation under test has started (it touched ``marker``)."""
    t0 = time.monotonic()
    while not marker.exists():
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() - t0 < limit
        time.sleep(0.05)


def _start(args, marker=None, **env_extra):
    env = {**os.environ, **({"MHCTOOL_TEST_MARKER": str(marker)} if marker else {}), **env_extra}
    return subprocess.Popen([*MAIN, *map(str, args)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


@pytest.mark.parametrize("args", [["parity"], ["identify", "--kernel", "sinkhorn", "--impl", "torch"], ["bench", "--kernel", "sinkhorn"],
                                  ["stability", "sinkhorn"], ["train", "--device", "cpu"]],
                         ids=lambda a: a[0])
def test_a_signal_while_the_command_line_loads_is_one_sentence_and_exit_130(tmp_path, args):
    proc = _start([*args, "-o", tmp_path / "r.parquet"])
    time.sleep(0.4)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, output
    assert "Traceback" not in output and "stopped at once; no report written" in output, output
    assert not list(tmp_path.iterdir())


def test_a_signal_while_python_makes_a_class_is_still_exit_130(tmp_path):
    """Python wraps an exception raised in a ``__set_name__`` hook in RuntimeError; a signal that
    lands there (CI met it in markdown_it's dataclasses, imported by typer for a usage error) is
    still the one sentence and exit 130."""
    res = _main_with(tmp_path,
                     "class Hook:\n"
                     "    def __set_name__(self, owner, name):\n"
                     "        os.kill(os.getpid(), signal.SIGTERM)\n"
                     "        for _ in range(10000):\n"
                     "            pass\n"
                     "def run():\n"
                     "    class Made:\n"
                     "        field = Hook()\n"
                     "    print('ran on')\n")
    assert res.returncode == 130, res.stdout + res.stderr
    assert "Traceback" not in res.stderr and "stopped at once; no report written" in res.stderr, res.stderr
    assert "ran on" not in res.stdout


@pytest.mark.parametrize("args", [
    ["stability", "sinkhorn", "--quick", "--impl", SLOW, "--dtype", "fp32"],
    ["stability", "overflow", "--kernel", "sinkhorn", "--impl", SLOW, "--dtype", "fp32"],
    ["identify", "--kernel", "sinkhorn", "--impl", SLOW],
    ["bench", "--kernel", "sinkhorn", "--impl", SLOW],
    ["bench", "--engine", ENGINE, "--layers", "1", "--hidden", "16", "--heads", "2", "--seq", "8", "--batch", "2",
     "--vocab", "32", "--recipe", "global_batch=4", "--steps", "3", "--warmup", "1", "--no-kernels"],
], ids=["stability-sinkhorn", "stability-overflow", "identify", "bench", "bench-engine"])
def test_a_signal_while_measuring_writes_what_was_measured_marked_interrupted(tmp_path, args):
    marker = tmp_path / "started"
    out = tmp_path / "r.parquet"
    proc = _start([*args, "-o", out], marker)
    _started(proc, marker)
    proc.send_signal(signal.SIGINT)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, output
    assert "Traceback" not in output and "INTERRUPTED" in output, output
    table, meta = report.read(out)
    assert meta["run"]["interrupted"] is True
    if "--engine" in args:  # the run in hand ends as it would, no later one starts
        assert {r["variant"] for r in table.to_pylist() if r["metric"] == "step_ms"} == {"plain", "native"}


@pytest.mark.slow  # a run started and stopped: about 10 s on 2 cores
def test_sigterm_to_the_command_and_then_its_process_group_is_one_request(tmp_path):
    """As coreutils' timeout stops a command (a CI job's limit, Slurm's): SIGTERM to the command,
    then to its whole process group at once. The main process gets it twice; that is one request,
    so what was measured is written, marked interrupted, exit 130 (it used to be "stopped at once;
    no report written")."""
    marker, out = tmp_path / "started", tmp_path / "r.parquet"
    env = {**os.environ, "MHCTOOL_TEST_MARKER": str(marker)}
    # bench --engine: the run in hand trains on for seconds after the first signal (it ends as it would)
    args = ["bench", "--engine", ENGINE, "--layers", "1", "--hidden", "16", "--heads", "2", "--seq", "8", "--batch",
            "2", "--vocab", "32", "--recipe", "global_batch=4", "--steps", "40", "--warmup", "1", "--no-kernels"]
    proc = subprocess.Popen([*MAIN, *args, "-o", str(out)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    _started(proc, marker)
    os.kill(proc.pid, signal.SIGTERM)
    time.sleep(0.3)  # handled apart (two arrivals before Python runs its handler are one), within a second
    os.killpg(proc.pid, signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, output
    assert "no report written" not in output and "Traceback" not in output, output
    # the engine's ranks ignore the group's copy: the run in hand ended as it would, and is kept
    table, _ = report.read(out)
    assert {r["variant"] for r in table.to_pylist() if r["metric"] == "step_ms"} == {"plain", "native"}
    assert report.read(out)[1]["run"]["interrupted"] is True


LATER = f"{Path(__file__).resolve().parents[1] / 'impls' / 'process.py'}:sinkhorn_hangs_later"


@pytest.mark.slow  # five runs, each stopped twice: about 40 s on 2 cores
@pytest.mark.parametrize("args", [
    ["parity", "--kernel", "sinkhorn", "--impl", LATER, "--workers", "1"],
    ["parity", "--kernel", "sinkhorn", "--impl", LATER, "--workers", "1", "--no-isolate"],
    ["identify", "--kernel", "sinkhorn", "--impl", LATER],
    ["bench", "--kernel", "sinkhorn", "--impl", LATER],
    ["stability", "sinkhorn", "--quick", "--impl", LATER, "--dtype", "fp32"],
    ["train", "--impl", LATER, "--kernel", "sinkhorn", "--steps", "6"],
], ids=["parity", "parity-in-process", "identify", "bench", "stability", "train"])
def test_a_second_signal_still_writes_what_was_measured(tmp_path, args):
    """An implementation that hangs after its first calls: the first signal waits for the case in
    hand (which never ends), a second one, of another kind and seconds later, abandons it; the
    report is written all the same, marked interrupted, with what was finished before."""
    marker, out = tmp_path / "started", tmp_path / "r.parquet"
    proc = _start([*args, "--device", "cpu", "-o", out], marker, MHCTOOL_TEST_CALLS="2" if args[0] == "identify" else "12")
    _started(proc, marker, 150)
    proc.send_signal(signal.SIGINT)
    time.sleep(1.5)
    if proc.poll() is None:  # an isolated case or trajectory is abandoned at the first signal already
        proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, output
    assert "no report written" not in output and "Traceback" not in output, output
    table, meta = report.read(out)
    assert meta["run"]["interrupted"] is True, meta["run"]
    if args[0] == "parity":  # the cases before the hang were measured and kept
        assert table.num_rows > 0
        assert 0 < meta["run"]["cases_run"] < meta["run"]["cases_planned"]


def test_a_signal_after_the_run_measured_leaves_its_report_finished_and_its_exit_code(tmp_path):
    """A signal after a run's measuring (its report being written, its conclusion printed) is said
    and changes nothing: the report is the finished run's, the exit code the run's own; before, it
    gave exit 130 beside a report not marked interrupted."""
    res = _main_with(tmp_path,
                     "from mhctool.spread.setup import Interrupts\n"
                     "def run():\n"
                     "    with Interrupts():\n"
                     "        pass\n"
                     "    os.kill(os.getpid(), signal.SIGTERM)\n"
                     "    os.kill(os.getpid(), signal.SIGINT)\n"
                     "    print('wrote the report')\n"
                     "    sys.exit(1)\n")
    assert res.returncode == 1, res.stdout + res.stderr
    assert "wrote the report" in res.stdout
    assert res.stderr.count("came after the run had measured: its report is written as finished") == 1, res.stderr
    assert "no report written" not in res.stderr


def _still_loading(text: str, out: Path, code: int, codes: tuple) -> bool:
    """Whether a timed signal came while the command was still loading, on a loaded machine (CI met
    it at 3 to 6 s with other jobs beside it): nothing written, exit ``codes``, and either the one
    sentence the loading case says (tested on its own above) or, earlier still, nothing at all
    (the interpreter starting, before any of mhctool runs: Python's own default for the signal)."""
    if out.exists() or not (text.strip() == "" or "stopped at once; no report written" in text):
        return False
    assert code in codes and text.count("stopped at once") <= 1 and "Traceback" not in text, (code, text)
    return True


@pytest.mark.slow  # three runs stopped by timeout: about 70 s on 2 cores
@pytest.mark.parametrize("after", [6, 25, 45])
def test_timeout_at_any_moment_of_an_engines_seed_ensemble_leaves_its_report(tmp_path, after):
    """``timeout -s TERM N`` (no --foreground: the command and then its whole process group get it)
    against train --engine with 8 seeds over 8 workers on the stand-in engine: whatever it was doing
    (starting, training the seeds, judging), the report is written and agrees with the exit code."""
    import shutil
    if shutil.which("timeout") is None:
        pytest.skip("coreutils' timeout is not installed")
    out = tmp_path / "t.parquet"
    res = subprocess.run(["timeout", "-s", "TERM", str(after), *MAIN, "train", "--engine",
                          str(Path(__file__).resolve().parents[1] / "impls" / "engine_standin.py") + ":train",
                          "--device", "cpu", "--seeds", "8", "--workers", "8", "-q", "-o", str(out)],
                         capture_output=True, text=True, timeout=300)
    text = res.stdout + res.stderr
    if _still_loading(text, out, res.returncode, (124,)):  # 124: timeout's code for a command it stopped
        return
    assert "Traceback" not in text and "no report written" not in text, text
    _, meta = report.read(out)
    assert res.returncode in (0, 124, 130), text  # 124: timeout's own code once the command ended on the signal
    assert meta["run"]["interrupted"] is (res.returncode != 0), text


@pytest.mark.slow  # five commands stopped at three moments each: about 90 s on 2 cores
@pytest.mark.parametrize("after", [3, 5, 8])
@pytest.mark.parametrize("args", [
    ["parity", "--kernel", "sinkhorn"],
    ["train", "--steps", "30"],
    ["identify", "--kernel", "sinkhorn", "--impl", "torch"],
    ["bench", "--kernel", "sinkhorn"],
    ["stability", "sinkhorn", "--quick"],
], ids=lambda a: a[0] if isinstance(a, list) else str(a))
def test_timeout_as_ci_sends_it_leaves_a_report_that_agrees_with_the_exit_code(tmp_path, args, after):
    """``timeout --preserve-status -s INT N mhctool ...``, as a CI time limit stops a command, at
    moments from the first cases to the end: the report is written, marked interrupted exactly
    when the exit code is 130 (or finished, and said so), never a traceback, never "no report
    written"."""
    import shutil
    if shutil.which("timeout") is None:
        pytest.skip("coreutils' timeout is not installed")
    out = tmp_path / "r.parquet"
    res = subprocess.run(["timeout", "--preserve-status", "-s", "INT", str(after), *MAIN, *args, "--device", "cpu",
                          "-o", str(out)], capture_output=True, text=True, timeout=300)
    text = res.stdout + res.stderr
    assert "Traceback" not in text, text
    if _still_loading(text, out, res.returncode, (130,)):
        return
    assert "no report written" not in text, text
    _, meta = report.read(out)
    assert res.returncode in (0, 1, 130), text
    assert meta["run"]["interrupted"] is (res.returncode == 130), text
    if res.returncode == 130:
        assert "INTERRUPTED" in text or "interrupted" in text, text
