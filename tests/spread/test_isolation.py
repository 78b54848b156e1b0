"""Code under test never decides the verdict: exits, crashes and hangs become failed rows with the
reason, the report is written and the exit code is 1; Ctrl-C keeps what was measured (exit 130)."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from mhctool.core import report
from mhctool.cli.app import app
from mhctool.spread.isolation import Worker

PROCESS = Path(__file__).resolve().parents[1] / "impls" / "process.py"
cli = CliRunner()


def _scenario(tmp_path, shapes=("8x2x4x1",)):
    """One family, fp32: each case costs a worker start at most."""
    sc = tmp_path / "sc.toml"
    listed = ", ".join(f'"{s}"' for s in shapes)
    sc.write_text(f'name = "iso"\n[[cases]]\nkernel = "sinkhorn"\nshapes = [{listed}]\nfamilies = ["random"]\n')
    return sc


def _parity(tmp_path, fn, *extra, shapes=("8x2x4x1",)):
    out = tmp_path / "r.parquet"
    res = cli.invoke(app, ["parity", "--kernel", "sinkhorn", "--device", "cpu", "--scenario", str(_scenario(tmp_path, shapes)),
                           "--impl", f"{PROCESS}:{fn}", "-o", str(out), *extra])
    rows = pq.read_table(out).to_pylist() if out.exists() else []
    return res, [r for r in rows if r["impl"].endswith(fn)]


def _failed_with(rows, needle, rule):
    fwd = [r for r in rows if r["direction"] == "fwd"]
    assert fwd and all(r["passed"] is False for r in fwd)
    assert all(needle in r["message"] and r["rule"] == rule for r in fwd), fwd


def test_sys_exit_is_a_failed_row_even_without_isolation(tmp_path):
    res, rows = _parity(tmp_path, "sinkhorn_sys_exit", "--no-isolate")
    assert res.exit_code == 1, res.output
    _failed_with(rows, "the implementation called sys.exit(0)", "raised")


@pytest.mark.parametrize("fn,needle,rule", [
    ("sinkhorn_sys_exit", "called sys.exit(0)", "raised"),
    ("sinkhorn_os_exit", "ended its process with exit code 0", "exit"),
    ("sinkhorn_segfault", "crashed: signal 11 (SIGSEGV)", "signal"),
])
def test_process_faults_are_failed_rows_under_isolation(tmp_path, fn, needle, rule):
    res, rows = _parity(tmp_path, fn, "--isolate")
    assert res.exit_code == 1, res.output
    _failed_with(rows, needle, rule)
    assert "FAILED" in res.output


@pytest.mark.parametrize("fn,needle,rule,extra", [
    ("sinkhorn_backward_exits", "ended its process with exit code 5", "exit", []),
    ("sinkhorn_backward_segfaults", "crashed: signal 11 (SIGSEGV)", "signal", []),
    ("sinkhorn_backward_hangs", "timed out after 3 s", "timeout", ["--case-timeout", "3"]),
])
def test_a_backward_that_ends_the_process_keeps_the_forward_judged(tmp_path, fn, needle, rule, extra):
    """The forward's outputs reach mhctool before the backward runs: they are judged (and pass),
    and the failure is the backward's row."""
    res, rows = _parity(tmp_path, fn, "--isolate", *extra)
    assert res.exit_code == 1, res.output
    fwd = [r for r in rows if r["direction"] == "fwd" and r["passed"] is not None]
    assert fwd and all(r["passed"] for r in fwd), fwd
    (bwd,) = [r for r in rows if r["direction"] == "bwd"]
    assert bwd["passed"] is False and needle in bwd["message"] and bwd["rule"] == rule, bwd


def test_a_hang_is_stopped_by_the_case_timeout(tmp_path):
    t0 = time.monotonic()
    res, rows = _parity(tmp_path, "sinkhorn_hangs", "--case-timeout", "1")  # a time limit turns isolation on
    assert res.exit_code == 1, res.output
    _failed_with(rows, "timed out after 1 s", "timeout")
    assert time.monotonic() - t0 < 60


def test_the_run_goes_on_after_a_crash(tmp_path):
    """16 tokens pass, 101 crash the worker, the next case runs in a fresh worker and passes."""
    res, rows = _parity(tmp_path, "sinkhorn_crashes_on_large_inputs", "--isolate",
                        shapes=("8x2x4x1", "101x1x4x1", "9x1x4x1"))
    assert res.exit_code == 1, res.output
    by_shape = {}
    for r in rows:
        if r["direction"] == "fwd" and r["passed"] is not None:
            by_shape.setdefault(r["shape"], set()).add(r["passed"])
    assert by_shape == {"8x2x4x1": {True}, "101x1x4x1": {False}, "9x1x4x1": {True}}


def test_case_timeout_without_isolation_is_bad_input(tmp_path):
    res, _ = _parity(tmp_path, "sinkhorn_slow", "--no-isolate", "--case-timeout", "5")
    assert res.exit_code == 2 and "--case-timeout needs --isolate" in res.output


def test_a_transport_without_isolation_is_bad_input(tmp_path):
    res, _ = _parity(tmp_path, "sinkhorn_slow", "--no-isolate", "--isolate-transport", "host")
    assert res.exit_code == 2 and "--isolate-transport host needs isolation, which --no-isolate turns off" in \
        " ".join(res.output.split())
    # off by default for mhctool's own kernels
    out = tmp_path / "own.parquet"
    res = cli.invoke(app, ["parity", "--kernel", "sinkhorn", "--device", "cpu", "--scenario", str(_scenario(tmp_path)),
                           "--impl", "torch", "--isolate-transport", "file", "-o", str(out)])
    assert res.exit_code == 2 and "is off here: add --isolate" in " ".join(res.output.split())


@pytest.mark.parametrize("transport", ["shm", "file"])
def test_worker_round_trips_tensors_bitwise(transport):
    import torch
    x = torch.randn(37, 5, dtype=torch.bfloat16)
    with Worker(transport) as w:
        value, failure = w.call("torch:clone", (x,), timeout=120)
    assert failure is None and value.dtype == torch.bfloat16 and torch.equal(value, x)
    assert not list(Path("/dev/shm" if os.path.isdir("/dev/shm") else "/tmp").glob("mhctool-iso-*"))


def test_gate_fails_the_crashing_entry_and_still_writes_everything(tmp_path):
    sc = _scenario(tmp_path)
    suite = tmp_path / "suite.toml"
    suite.write_text(f'name = "g"\n[[parity]]\nname = "crashes"\nkernel = "sinkhorn"\nscenario = "{sc.name}"\n'
                     f'impls = ["{PROCESS}:sinkhorn_segfault"]\ndevice = "cpu"\n'
                     f'[[parity]]\nname = "fine"\nkernel = "sinkhorn"\nscenario = "{sc.name}"\nimpls = ["torch"]\n'
                     'device = "cpu"\n')
    paths = {k: tmp_path / f"gate.{k}" for k in ("xml", "md", "parquet")}
    res = cli.invoke(app, ["gate", "--suite", str(suite), "--junit", str(paths["xml"]), "--summary", str(paths["md"]),
                           "-o", str(paths["parquet"])])
    assert res.exit_code == 1, res.output
    assert all(p.exists() for p in paths.values())
    rows = pq.read_table(paths["parquet"]).to_pylist()
    assert {r["entry"] for r in rows if r["passed"] is False} == {"crashes"}
    assert any(r["entry"] == "fine" and r["passed"] for r in rows)
    assert "crashed: signal 11" in paths["xml"].read_text()


def test_bench_reports_a_crash_and_times_the_others(tmp_path):
    out = tmp_path / "b.parquet"
    res = cli.invoke(app, ["bench", "--kernel", "sinkhorn", "--device", "cpu", "--shape", "8x2x4x1", "--repeats", "3",
                           "--impl", "torch", "--impl", f"{PROCESS}:sinkhorn_segfault", "--isolate", "-o", str(out)])
    assert res.exit_code == 1, res.output  # a kernel that crashed where it was timed is a failure
    rows = pq.read_table(out).to_pylist()
    crashed = [r for r in rows if r["impl"].endswith("sinkhorn_segfault")]
    assert crashed and all(r["metric"] == "error" for r in crashed)
    # the forward crashed, then the backward: two in a row, so nothing more of it would be run
    assert {r["direction"]: r["message"][:20] for r in crashed} == {"fwd": "crashed: signal 11 (", "bwd": "crashed: signal 11 ("}
    assert any(r["impl"] == "torch" and r["metric"] == "time_ms" and r["value"] > 0 for r in rows)
    text = " ".join(res.output.split())
    assert "FAILED sinkhorn fwd process.py:sinkhorn_segfault: crashed: signal 11 (SIGSEGV)" in text


# --- Ctrl-C -------------------------------------------------------------------------------------

def _start(tmp_path, marker, fn="sinkhorn_slow", *extra):
    env = {**os.environ, "MHCTOOL_TEST_MARKER": str(marker)}
    cmd = [sys.executable, "-c", "from mhctool.cli.app import main; main()", "parity", "--kernel", "sinkhorn",
           "--device", "cpu", "--dtype", "fp32", "--impl", f"{PROCESS}:{fn}", "-o", str(tmp_path / "r.parquet"),
           *(extra or ("--no-isolate", "--workers", "1"))]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for(marker, proc, limit=120):
    t0 = time.monotonic()
    while not marker.exists():
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() - t0 < limit
        time.sleep(0.05)


def test_ctrl_c_writes_what_was_measured_and_exits_130(tmp_path):
    marker = tmp_path / "started"
    proc = _start(tmp_path, marker)
    _wait_for(marker, proc)
    proc.send_signal(signal.SIGINT)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, output
    assert "INTERRUPTED" in output
    table, meta = report.read(tmp_path / "r.parquet")
    assert meta["run"]["interrupted"] is True
    assert 1 <= meta["run"]["cases_run"] < meta["run"]["cases_planned"]
    assert table.num_rows > 0
    shown = cli.invoke(app, ["report", "show", str(tmp_path / "r.parquet")])
    assert "interrupted" in shown.output


@pytest.mark.parametrize("spread", [("--workers", "1"), pytest.param(("--workers", "2"), marks=pytest.mark.slow)],
                         ids=["isolated", "pool"])
def test_one_ctrl_c_on_a_hung_implementation_leaves_a_report(tmp_path, spread):
    """In mhctool's process an outside implementation is isolated by default, so its call in hand
    is abandoned at once; spread over worker processes, the cases in hand get the pool's grace."""
    marker = tmp_path / "started"
    proc = _start(tmp_path, marker, "sinkhorn_hangs_marked", *spread)
    _wait_for(marker, proc)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, output
    assert time.monotonic() - t0 < 60, output
    _, meta = report.read(tmp_path / "r.parquet")
    assert meta["run"]["interrupted"] is True


def test_a_second_ctrl_c_stops_at_once_and_still_writes_the_report_without_a_partial_file(tmp_path):
    """A second Ctrl-C more than a second after the first (within a second it is the same request:
    timeout's copy to the process group) stops at once, while the case in hand hangs, and what was
    measured is still written, marked interrupted: one report and no temp file beside it."""
    marker = tmp_path / "started"
    proc = _start(tmp_path, marker, "sinkhorn_hangs_marked")
    _wait_for(marker, proc)
    proc.send_signal(signal.SIGINT)
    time.sleep(1.2)  # within a second the same signal is the same request (timeout's copy to the process group)
    proc.send_signal(signal.SIGINT)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, output
    assert "no report written" not in output and "Traceback" not in output, output
    written = sorted(p.name for p in tmp_path.iterdir() if p.name != "started")
    assert [n for n in written if n.endswith(".parquet")] == ["r.parquet"], written  # no temp file beside it
    assert report.read(tmp_path / "r.parquet")[1]["run"]["interrupted"] is True


def test_external_libraries_get_time_to_compile_in_the_case_limit():
    # JIT libraries compile and autotune per shape inside the call (Megatron-LM dev's cuTile
    # h_post_bda passed 120 s before its first result on an H100): code mhctool did not write
    # gets the compile allowance on top of the size-scaled limit, mhctool's own kernels do not
    from mhctool.runner.case import COMPILE_ALLOWANCE_S, default_timeout
    from mhctool.registry.specs import resolve_impls
    from mhctool.spread.case_isolation import Isolation

    gib = 2.0**30
    assert default_timeout(gib, "cuda") == 150.0
    assert default_timeout(gib, "cuda", external=True) == 150.0 + COMPILE_ALLOWANCE_S
    # on a CPU nothing compiles: a hung stranger is stopped in half a minute on small cases
    assert default_timeout(1024.0, "cpu", external=True) < 31.0
    assert default_timeout(gib, "cpu", external=True) == 150.0
    assert default_timeout(gib, "cpu") == 4 * 150.0  # mhctool's own kernels, interpreted
    seen = []

    class _Probe:
        def call(self, target, args, timeout, interrupted):
            seen.append(timeout)
            return None, None

    iso = Isolation()
    for spec in ("triton", f"{Path(__file__).resolve().parents[1] / 'impls' / 'correct.py'}:sinkhorn"):
        impl = resolve_impls("sinkhorn", [spec])[0]
        iso.workers[impl.name] = _Probe()
        iso.call(impl, "x:y", (), gib, "cuda")
    assert seen == [150.0, 150.0 + COMPILE_ALLOWANCE_S]


def test_a_worker_takes_the_environment_as_it_is_when_the_worker_starts(monkeypatch):
    """Workers fork from a server started once: each still sees mhctool's variables of the moment
    it starts (TRITON_INTERPRET set after the first worker must reach the next one)."""
    from mhctool.spread.isolation import Worker
    monkeypatch.setenv("MHCTOOL_TEST_PROBE", "first")
    with Worker("shm") as w:
        assert w.call("os:getenv", ("MHCTOOL_TEST_PROBE",), timeout=120) == ("first", None)
    monkeypatch.setenv("MHCTOOL_TEST_PROBE", "second")
    with Worker("shm") as w:
        assert w.call("os:getenv", ("MHCTOOL_TEST_PROBE",), timeout=120) == ("second", None)


def test_a_worker_has_the_modules_autograd_imports_at_its_first_grad_already():
    """The fork server imports, once for all its children, what PyTorch's autograd imports at the
    first grad with given gradients (sympy, through torch.fx's symbolic shapes: 3 s a process on the
    GPU machine, whose packages have no compiled bytecode); a worker forked from it starts with it."""
    from mhctool.spread.isolation import Worker
    probe = "'torch.fx.experimental.symbolic_shapes' in __import__('sys').modules"
    with Worker("shm") as w:
        assert w.call("builtins:eval", (probe,), timeout=120) == (True, None)


def test_a_cuda_fault_after_the_forward_returned_is_the_backwards():
    """The worker that lost its CUDA context sends back what the call had returned, its tensors
    left behind: where the forward ran and the backward faulted, the backward carries the error
    and the forward is not judged (tests/kernels/test_gpu.py runs it on a GPU)."""
    from mhctool.spread.case_isolation import Isolation
    from mhctool.spread.isolation import Failure

    class Lost(Isolation):
        def call(self, impl, target, args, footprint_bytes, device):
            return None, Failure("cuda", "AcceleratorError: CUDA error: an illegal memory access was encountered",
                                 {"fwd_error": None, "bwd_error": "AcceleratorError: CUDA error: an illegal memory access"})

    from mhctool.core.shapes import parse_shape
    from mhctool.runner.case import Case

    case = Case("h_aggregate", "random", "fp32", parse_shape("13x3x4x67"), (), 0, "cuda")
    res = Lost().run(case, type("I", (), {"spec": None, "name": "f"})(), {}, {}, [], [])
    assert res.fwd_lost.startswith("not judged: the forward ran") and res.fwd_error is None
    assert "illegal memory access" in res.bwd_error and res.failure == "cuda"


SIX = ("4x2x4x1", "5x2x4x1", "6x2x4x1", "7x2x4x1", "8x2x4x1", "9x2x4x1")


@pytest.mark.parametrize("workers", ["1", pytest.param("2", marks=pytest.mark.slow)], ids=["in-process", "pool"])
def test_an_implementation_that_keeps_ending_its_process_is_stopped_and_the_rows_say_why(tmp_path, workers):
    """After it ended its process in 2 cases in a row (here or in a pool worker), its later cases
    are rows 'not run' saying why, so a broken stranger costs seconds; exit 1, never 0."""
    shapes = SIX[:2 + int(workers)]  # at most 2 + (workers - 1) end their process before the rest are stopped
    res, rows = _parity(tmp_path, "sinkhorn_os_exit", "--workers", workers, shapes=shapes)
    assert res.exit_code == 1, res.output
    fwd = [r for r in rows if r["direction"] == "fwd"]
    assert len(fwd) == len(shapes) and all(r["passed"] is False for r in fwd)  # one family, fp32: a case a shape
    ended = [r for r in fwd if r["rule"] == "exit"]
    stopped = [r for r in fwd if r["rule"] == "stopped"]
    assert 2 <= len(ended) <= 1 + int(workers) and stopped and len(ended) + len(stopped) == len(fwd)
    assert all(r["message"].startswith("not run: it ended its process in the last 2 cases (the implementation "
                                       "ended its process with exit code 0") for r in stopped), stopped[0]
    assert "--insist" in stopped[0]["message"]


def test_insist_runs_a_dying_implementation_on_every_case(tmp_path):
    res, rows = _parity(tmp_path, "sinkhorn_os_exit", "--workers", "1", "--insist", shapes=SIX[:3])
    assert res.exit_code == 1, res.output
    assert {r["rule"] for r in rows if r["direction"] == "fwd"} == {"exit"}


def test_identify_says_the_failure_that_ended_its_worker_and_takes_insist(tmp_path):
    """A backward that crashes in every call: identify's conclusion is that crash, in the
    backward, at the first probe; the stop after two such probes is said after it, and --insist
    is a flag of identify's own."""
    out = tmp_path / "id.parquet"
    res = cli.invoke(app, ["identify", "--kernel", "sinkhorn", "--impl", f"{PROCESS}:sinkhorn_backward_exits",
                           "--device", "cpu", "-q", "-o", str(out)])
    text = " ".join(res.output.split())
    assert res.exit_code == 1, text
    assert text.startswith("no convention fits: its backward failed: the implementation ended its process with "
                           "exit code 5"), text
    assert "on the later probes not run: it ended its process in the last 2 cases" in text
    res = cli.invoke(app, ["identify", "--kernel", "sinkhorn", "--impl", f"{PROCESS}:sinkhorn_backward_exits",
                           "--device", "cpu", "-q", "--insist", "-o", str(out)])
    assert res.exit_code == 1 and "not run" not in res.output, res.output


def test_bench_stops_a_hung_kernel_after_one_hang_unless_insisted(tmp_path):
    out = tmp_path / "b.parquet"
    args = ["bench", "--kernel", "sinkhorn", "--device", "cpu", "--shape", "8x2x4x1", "--repeats", "3", "--impl",
            f"{PROCESS}:sinkhorn_hangs", "--case-timeout", "2", "-q", "-o", str(out)]
    res = cli.invoke(app, args)
    assert res.exit_code == 1, res.output
    said = {r["direction"]: r["message"] for r in pq.read_table(out).to_pylist() if r["metric"] == "error"}
    assert said["fwd"] == "timed out after 2 s" and said["bwd"].startswith("not run: it hung past the time limit")
    res = cli.invoke(app, [*args, "--insist"])
    said = {r["direction"]: r["message"] for r in pq.read_table(out).to_pylist() if r["metric"] == "error"}
    assert res.exit_code == 1 and said == {"fwd": "timed out after 2 s", "bwd": "timed out after 2 s"}, said


def test_the_pool_stops_an_implementation_by_its_cases_rows():
    """What the pool counts between the cases it hands out (the end-to-end run over two workers is
    slow-marked: each death restarts a worker): ended processes in a row, reset by a case it
    returned from, a hang stopping at once, and --insist."""
    from mhctool.spread.streaks import Streaks
    died = [{"impl": "f", "metric": "error", "rule": "exit", "message": "the implementation ended its process"}]
    ok = [{"impl": "f", "metric": "max_abs", "rule": "kappa", "message": ""}]
    s = Streaks()
    s.saw_rows(died, ["f"])
    assert s.stopped(["f"]) == ()
    s.saw_rows(ok, ["f"])
    s.saw_rows(died, ["f"])
    assert s.stopped(["f"]) == ()  # the case it returned from broke the streak
    s.saw_rows(died, ["f"])
    (name, why), = s.stopped(["f", "g"])
    assert name == "f" and why.startswith("not run: it ended its process in the last 2 cases")
    s.saw_rows([{**died[0], "rule": "timeout", "message": "timed out after 5 s"}], ["f"])
    assert "hung past the time limit in the last case (timed out after 5 s)" in s.why("f")
    lost = [{**died[0], "rule": "lost", "message": "the worker running this case died: ..."}]
    mhctools = Streaks()
    for _ in range(3):
        mhctools.saw_rows(lost, ["f"])  # mhctool's own part of the case failed: no implementation's fault
    assert mhctools.stopped(["f"]) == ()
    insisting = Streaks(insist=True)
    for _ in range(3):
        insisting.saw_rows(died, ["f"])
    assert insisting.stopped(["f"]) == ()


def _gone(pid: int) -> bool:
    """No such process, or only its exit status left (a zombie until its new parent reaps it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="descendants are read from /proc")
def test_a_stopped_workers_descendants_end_with_it():
    """A worker that started processes of its own (its fork server, an isolation worker hung in
    the code under test) takes them with it when it is killed: none is left running after mhctool
    exits (each kept the run's stdout open, so a caller waiting for it never got its end)."""
    from mhctool.spread import procs
    code = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            "print('started', flush=True); time.sleep(60)")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout.readline().strip() == "started"
        kin = procs.descendants(parent.pid)
        assert len(kin) == 1 and not _gone(kin[0][0])
        parent.kill()
        parent.wait(10)
        procs.end(kin)
        t0 = time.monotonic()
        while not _gone(kin[0][0]) and time.monotonic() - t0 < 10:
            time.sleep(0.05)
        assert _gone(kin[0][0])
    finally:
        parent.kill()


def test_a_stop_that_another_stop_overtakes_ends_cleanly():
    """``timeout -s INT`` against parity (issue 101): while a worker's stop waited in its join, the
    run's other stop (a signal's way out, another thread) tore the worker down, and the first went on
    to a worker that was gone ('NoneType' object has no attribute 'is_alive': a traceback, exit 1,
    no report). A stop claims the worker as it starts: the one overtaken finds what it claimed."""
    w = Worker("shm")
    assert w.call("os:getpid", (), timeout=120)[1] is None
    proc = w._proc
    real_join = proc.join

    def join(timeout=None):  # the other stop, meanwhile
        proc.join = real_join
        w.stop()
        return real_join(timeout)
    proc.join = join
    w.stop()
    proc.join(10)
    assert not proc.is_alive() and w._proc is None
