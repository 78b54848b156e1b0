"""A run's set-up, one function for every command (mhctool.spread.setup): what is isolated, what a
signal does, and that leaving the run closes what it started and names the library log."""
import os
import signal
from pathlib import Path

import pytest

from mhctool.core.errors import Interrupted, UsageError, abandonable, kept_at_once
from mhctool.core.names import is_outside
from mhctool.spread import setup


@pytest.mark.parametrize("spec, outside", [
    ("triton", False), ("torch", False), ("compile", False), ("cutile", False), ("triton-tf32", False),
    ("mine.py:sk", True), ("pkg.mod:sk", True), ("te:/x/te", True), ("megatron:fused_mhc_kernels.py", True),
    ("liger:liger_kernel", True), ("wrapper.py", True), ("dir/wrapper.py", True), ("adapter.py:/x/lib", True)])
def test_every_spelling_of_code_mhctool_did_not_ship_is_outside(spec, outside):
    """One function decides (isolated by default on a GPU): a function, a file of functions, a library."""
    assert is_outside(spec) is outside


def test_a_file_of_functions_on_a_gpu_is_isolated_by_default():
    quiet = setup.Interrupts(lambda line: None)
    assert setup.isolation_for(None, ["wrapper.py"], "cuda", None, None, quiet) is not None


def test_isolation_by_default_for_an_outside_implementation_or_a_time_limit_only():
    quiet = setup.Interrupts(lambda line: None)
    assert setup.isolation_for(None, ["mine.py:sk"], "cpu", None, None, quiet) is not None
    assert setup.isolation_for(None, ["triton"], "cuda", None, None, quiet) is None
    assert setup.isolation_for(None, ["triton"], "cpu", None, None, quiet) is None
    on_gpu = setup.isolation_for(None, ["mine.py:sk"], "cuda", None, None, quiet)
    timed = setup.isolation_for(None, ["triton"], "cpu", 5.0, "host", quiet)
    assert on_gpu.transport == "shm" and (timed.transport, timed.case_timeout) == ("host", 5.0)
    with pytest.raises(UsageError, match="--case-timeout needs --isolate"):
        setup.isolation_for(False, ["mine.py:sk"], "cuda", 5.0, None, quiet)
    with pytest.raises(UsageError, match="unknown --isolate-transport 'pigeon'"):
        setup.isolation_for(True, [], "cpu", None, "pigeon", quiet)


def test_the_first_signal_asks_the_run_to_stop_and_the_second_stops_it_at_once():
    said = []
    # what was there before (Python's default, or SIG_IGN where the test process was started so)
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with setup.Interrupts(said.append) as interrupts:
        os.kill(os.getpid(), signal.SIGTERM)
        assert interrupts() and said == ["SIGTERM: finishing the case in hand, then writing what was measured "
                                         "(again to stop at once)"]
        with pytest.raises(Interrupted), abandonable():
            os.kill(os.getpid(), signal.SIGINT)
        assert interrupts.aborted and said[-1].startswith("SIGINT again: stopping at once")
        os.kill(os.getpid(), signal.SIGINT)  # a third: the report is being written, nothing else happens
        assert len(said) == 2
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before  # restored on leaving


def test_a_second_signal_abandons_only_a_stretch_of_measuring_and_what_it_measured_is_kept():
    """Outside a stretch of measuring (the report being built) a second signal does not raise: the
    run stops at its next check; inside one (kept_at_once) it ends the stretch with its rows kept."""
    with setup.Interrupts(lambda line: None) as interrupts:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)  # no stretch of measuring: no raise
        assert interrupts() and interrupts.aborted
    rows = []
    with setup.Interrupts(lambda line: None) as interrupts:
        with kept_at_once():
            for k in range(5):
                rows.append(k)
                if k == 0:
                    os.kill(os.getpid(), signal.SIGTERM)
                if k == 2:
                    os.kill(os.getpid(), signal.SIGINT)
        assert rows == [0, 1, 2] and interrupts.aborted and interrupts()


def test_the_same_signal_twice_within_a_second_is_one_request():
    """coreutils' timeout (without --foreground) sends SIGTERM to the command and then to its process
    group: the main process gets it twice at once. That is one request (what was measured is still
    written); the same signal later, or another signal, stops at once."""
    now = [100.0]
    said = []
    with setup.Interrupts(said.append, clock=lambda: now[0]) as interrupts:
        os.kill(os.getpid(), signal.SIGTERM)
        now[0] += 0.2
        os.kill(os.getpid(), signal.SIGTERM)  # the group's copy: no raise
        assert interrupts() and len(said) == 1
        now[0] += 1.0
        with pytest.raises(Interrupted), abandonable():
            os.kill(os.getpid(), signal.SIGTERM)


def test_leaving_a_run_stops_its_isolation_workers_and_names_a_library_log_only_where_written(tmp_path):
    log = tmp_path / "run.libraries.log"
    s = setup.prepare("cpu", isolate=True, library_log=log, say=lambda line: None)
    stopped = []
    s.isolation.close = lambda: stopped.append(True)
    with s.running():
        assert s.threads == 1  # a CPU run computes with one thread a process
    assert stopped == [True] and s.library_log is None and not log.exists()  # nothing written: no file
    s = setup.prepare("cpu", library_log=log, say=lambda line: None)
    with pytest.raises(RuntimeError), s.running():
        with open(os.environ["MHCTOOL_LIBRARY_LOG"], "a") as f:  # where a worker started meanwhile writes
            f.write("a library's line\n")
        raise RuntimeError("the run fails")
    assert s.library_log == str(log) and Path(s.library_log).read_text() == "a library's line\n"
