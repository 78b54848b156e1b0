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


def test_parity_spreads_a_default_run_of_eight_cases_and_not_one_it_cannot_spread(tmp_path, monkeypatch):
    """What parity's command decides before it runs (the spread itself, rows as one process's:
    tests/spread/test_pool.py): unset --workers over 2 cores spreads 8 cases over 2 workers; a run
    of ranks, or of a callable, stays in one process where nothing was asked, and says why where
    it was."""
    from mhctool.analyses import parity
    from mhctool.spread import setup
    from mhctool.kernels.torch import mhc
    from mhctool.registry.impl import Impl
    for where in (machine, pool):
        monkeypatch.setattr(where, "cores", lambda: 2)
    plan = parity.plan(["sinkhorn"], ["torch"], device="cpu", scenario=str(_scenario(tmp_path)))
    assert len(plan.cases) == 8
    def spread(workers, p, alone=False):
        return setup.spread_for(workers, "local", "cpu", len(p.cases), lambda: parity.check_poolable(p), alone)
    assert spread(None, plan) == (2, "local")
    assert spread(None, plan, alone=True) == (1, "local")
    callable_plan = parity.plan(["sinkhorn"], [Impl("mine", "sinkhorn", "external", mhc.sinkhorn)], device="cpu",
                                scenario=str(_scenario(tmp_path)))
    assert spread(None, callable_plan) == (1, "local")
    with pytest.raises(UsageError, match="exists in this process only"):
        spread("2", callable_plan)


def test_a_cpu_report_says_its_cores_and_one_thread_whatever_this_process_had(tmp_path):
    """The environment metadata of a CPU run: the cores, and the one thread every process of it
    computed with, though the command's process had two (which it has again afterwards)."""
    out = tmp_path / "p.parquet"
    torch.set_num_threads(2)
    try:
        res = cli.invoke(app, ["parity", "--kernel", "sinkhorn", "--impl", "torch", "--device", "cpu", "--dtype",
                               "fp32", "--shape", "5x3x2x1", "--no-hint", "-o", str(out)])
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(1)
    assert res.exit_code == 0, res.output
    env = report.read(out)[1]["environment"]
    assert env["threads"] == 1 and env["cores"] >= 1
