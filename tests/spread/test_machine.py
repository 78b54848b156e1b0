"""How a run uses the machine: worker processes by default where a run pays for them, one PyTorch
thread a process on the CPU (the rows the same on any machine), both in the report."""
import pytest
import torch
from typer.testing import CliRunner

from mhctool.cli.app import app
from mhctool.core import report
from mhctool.core.errors import UsageError
from mhctool.spread import machine, pool
from mhctool.spread.isolation import Worker

cli = CliRunner()


def test_the_cpu_computes_with_one_thread_a_gpu_process_with_its_share_of_the_cores(monkeypatch):
    monkeypatch.delenv(machine.THREADS_ENV, raising=False)
    monkeypatch.setattr(machine, "cores", lambda: 16)
    assert machine.threads_for("cpu", 1) == machine.threads_for("cpu", 4) == 1
    assert machine.threads_for("cuda", 4) == 4
    assert machine.threads_for("cuda", 32) == 1
    monkeypatch.setenv(machine.THREADS_ENV, "3")
    assert machine.threads_for("cpu", 2) == 3
    monkeypatch.setenv(machine.THREADS_ENV, "many")
    with pytest.raises(UsageError, match="MHCTOOL_THREADS"):
        machine.threads_for("cpu", 2)


def test_unset_workers_spread_a_cpu_run_only_where_each_worker_gets_four_cases(monkeypatch):
    for where in (machine, pool):
        monkeypatch.setattr(where, "cores", lambda: 8)
    assert pool.parse_workers(None) == pool.DEFAULT
    assert pool.worker_count(pool.DEFAULT, "cpu", 7) == 1
    assert pool.worker_count(pool.DEFAULT, "cpu", 12) == 3
    assert pool.worker_count(pool.DEFAULT, "cpu", 1000) == 8
    assert pool.worker_count("auto", "cpu", 3) == 3  # asked: one per core, at most one a case


def test_pinned_threads_reach_every_child_and_are_given_back(monkeypatch):
    monkeypatch.delenv(machine.THREADS_ENV, raising=False)
    before = torch.get_num_threads()
    with machine.pinned_threads(3):
        assert torch.get_num_threads() == 3
        with Worker() as w:
            assert w.call("torch:get_num_threads") == (3, None)
    assert torch.get_num_threads() == before
    assert machine.THREADS_ENV not in __import__("os").environ


def _scenario(tmp_path):
    sc = tmp_path / "sc.toml"
    sc.write_text('name = "machine"\n[[cases]]\nkernel = "sinkhorn"\nshapes = ["8x2x4x1", "9x1x4x3"]\n'
                  'families = ["random", "near_perm", "dead_rows_cols", "large_logits"]\ndtypes = ["fp32"]\n')
    return sc


def test_a_default_cpu_run_of_eight_cases_spreads_and_its_report_says_how(tmp_path, monkeypatch):
    """Unset --workers: 8 cases on a machine of 2 cores or more are spread over 2 workers, each
    computing with one thread whatever this process had (which it has again afterwards). That a
    spread run's rows are one process's: tests/spread/test_pool.py."""
    monkeypatch.delenv("MHCTOOL_WORKERS", raising=False)
    for where in (machine, pool):
        monkeypatch.setattr(where, "cores", lambda: 2)
    out = tmp_path / "spread.parquet"
    torch.set_num_threads(2)
    try:
        res = cli.invoke(app, ["parity", "--kernel", "sinkhorn", "--impl", "torch", "--device", "cpu",
                               "--scenario", str(_scenario(tmp_path)), "--no-hint", "-o", str(out)])
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(1)
    assert res.exit_code == 0, res.output
    _, meta = report.read(out)
    assert meta["run"]["workers"] == 2
    assert meta["environment"]["threads"] == 1 and meta["environment"]["cores"] >= 1
