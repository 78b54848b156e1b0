"""Cases spread over workers, slices of a run merged, Ray: the same report as one process."""
import math
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from typer.testing import CliRunner

from mhctool.analyses import parity
from mhctool.spread import forkserver, pool
from mhctool.spread import jobs as jobs_mod
from mhctool.core import report
from mhctool.cli.app import app
from mhctool.core.errors import UsageError
from mhctool.spread.isolation import Worker

PROCESS = Path(__file__).resolve().parents[1] / "impls" / "process.py"
cli = CliRunner()


def _scenario(tmp_path, shapes=("8x2x4x1", "101x1x4x1", "9x1x4x3", "5x3x4x1", "7x1x4x2"),
              families=("random", "large_logits")):
    """Cheap cases (Sinkhorn, fp32, PyTorch and a plain file): a worker start costs more than all."""
    sc = tmp_path / "sc.toml"
    listed = ", ".join(f'"{s}"' for s in shapes)
    fams = ", ".join(f'"{f}"' for f in families)
    sc.write_text(f'name = "pool"\n[[cases]]\nkernel = "sinkhorn"\nshapes = [{listed}]\n'
                  f'families = [{fams}]\ndtypes = ["fp32"]\n')
    return sc


def _rows(path):
    """A report's rows without the run id, NaN made comparable."""
    out = []
    for r in pq.read_table(path).drop(["run_id"]).to_pylist():
        out.append({k: ("nan" if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()})
    return out


def _parity(tmp_path, name, *extra, impl=f"{PROCESS}:sinkhorn_crashes_on_large_inputs", shapes=None, families=None):
    out = tmp_path / f"{name}.parquet"
    sc = _scenario(tmp_path, *([shapes] if shapes else []), **({"families": families} if families else {}))
    res = cli.invoke(app, ["parity", "--kernel", "sinkhorn", "--device", "cpu", "--scenario",
                           str(sc), "--impl", impl, "-o", str(out), *extra])
    return res, out


def test_two_workers_write_the_rows_of_one_process_and_a_crash_fails_its_case_only(tmp_path):
    """Without isolation the crash takes the case's worker down: the case is run again with the
    implementation isolated, so its rows are those of an isolated single-process run."""
    shapes, fams = ("8x2x4x1", "101x1x4x1", "9x1x4x3"), ("random",)
    one, one_out = _parity(tmp_path, "one", "--isolate", "--no-hint", shapes=shapes, families=fams)
    two, two_out = _parity(tmp_path, "two", "--workers", "2", "--no-isolate", "--no-hint", shapes=shapes, families=fams)
    assert one.exit_code == two.exit_code == 1, (one.output, two.output)
    assert _rows(one_out) == _rows(two_out)
    crashed = {r["shape"] for r in _rows(two_out) if r["passed"] is False}
    assert crashed == {"101x1x4x1"}
    assert any("crashed: signal 11" in (r["message"] or "") for r in _rows(two_out))
    assert report.read(two_out)[1]["run"]["workers"] == 2


def test_shards_merge_into_the_report_of_one_run(tmp_path):
    _, whole = _parity(tmp_path, "whole", impl="torch")
    slices = []
    for i in (3, 1, 2):
        res, out = _parity(tmp_path, f"s{i}", "--shard", f"{i}/3", impl="torch")
        assert res.exit_code == 0, res.output
        slices.append(out)
    sizes = [len({r["case_id"] for r in _rows(s)}) for s in slices]
    assert sorted(sizes) == [3, 3, 4]  # 10 cases, every third one
    merged = tmp_path / "merged.parquet"
    res = cli.invoke(app, ["report", "merge", *map(str, slices), "-o", str(merged)])
    assert res.exit_code == 0, res.output
    assert _rows(merged) == _rows(whole)
    run = report.read(merged)[1]["run"]
    assert run["cases_run"] == run["cases_planned"] == 10 and len(run["merged_from"]) == 3


def test_merge_refuses_what_is_not_every_slice_of_one_run(tmp_path):
    _, a = _parity(tmp_path, "a", "--shard", "1/2", impl="torch")
    _, whole = _parity(tmp_path, "w", impl="torch")
    other = tmp_path / "other"
    other.mkdir()
    _, b_other = _parity(other, "b", "--shard", "2/2", "--kappa", "3", impl="torch")
    for paths, needle in (([a], "slice(s) 2/2 missing"), ([a, whole], "written without --shard"),
                          ([a, a], "are both slice 1/2"), ([a, b_other], "settings differ: kappa")):
        res = cli.invoke(app, ["report", "merge", *map(str, paths), "-o", str(tmp_path / "m.parquet")])
        assert res.exit_code == 2 and needle in res.output, res.output
        assert not (tmp_path / "m.parquet").exists()


def test_gate_slices_merge_into_one_gate(tmp_path):
    sc = _scenario(tmp_path, shapes=("8x2x4x1", "9x1x4x3", "5x3x4x1"))
    gfile = next((Path(__file__).resolve().parents[1] / "data" / "goldens").rglob("*.json"))
    suite = tmp_path / "suite.toml"
    suite.write_text(f'name = "g"\n[[parity]]\nname = "p"\nkernel = "sinkhorn"\nimpls = ["torch"]\n'
                     f'scenario = "{sc.name}"\ndevice = "cpu"\n[[goldens_check]]\nfile = "{gfile}"\n')

    def gate(tag, *extra):
        paths = [tmp_path / f"{tag}.{ext}" for ext in ("parquet", "xml", "md")]
        res = cli.invoke(app, ["gate", "--suite", str(suite), "--no-isolate", "-o", str(paths[0]),
                               "--junit", str(paths[1]), "--summary", str(paths[2]), *extra])
        return res, paths

    res, whole = gate("whole")
    assert res.exit_code in (0, 1), res.output
    parts = [gate(f"s{i}", "--shard", f"{i}/2")[1][0] for i in (1, 2)]
    merged = [tmp_path / f"m.{ext}" for ext in ("parquet", "xml", "md")]
    res2 = cli.invoke(app, ["report", "merge", *map(str, parts), "-o", str(merged[0]),
                            "--junit", str(merged[1]), "--summary", str(merged[2])])
    assert res2.exit_code == res.exit_code, res2.output
    assert _rows(merged[0]) == _rows(whole[0])
    assert merged[1].read_bytes() == whole[1].read_bytes() and merged[2].read_text() == whole[2].read_text()


def test_a_gates_parity_entries_share_one_pool_of_workers(tmp_path, monkeypatch):
    """Each worker starts (imports, initialises CUDA, compiles) once for the suite, not once an
    entry: two entries of three cases on two workers start two processes."""
    sc = _scenario(tmp_path, shapes=("8x2x4x1", "9x1x4x3", "5x3x4x1"))
    entry = f'kernel = "sinkhorn"\nimpls = ["torch"]\nscenario = "{sc.name}"\ndevice = "cpu"\n'
    suite = tmp_path / "suite.toml"
    suite.write_text(f'name = "g"\n[[parity]]\nname = "a"\n{entry}[[parity]]\nname = "b"\n{entry}')
    starts = []
    real = Worker._start
    monkeypatch.setattr(Worker, "_start", lambda self: (starts.append(self), real(self)))
    res = cli.invoke(app, ["gate", "--suite", str(suite), "--no-isolate", "--workers", "2", "-o",
                           str(tmp_path / "g.parquet"), "--junit", str(tmp_path / "g.xml"), "--summary",
                           str(tmp_path / "g.md")])
    assert res.exit_code == 0, res.output
    assert "24 passed" in " ".join(res.output.split()), res.output
    assert len(starts) == 2 and len(set(map(id, starts))) == 2


@pytest.mark.parametrize("args,needle", [
    (["--workers", "0"], "--workers '0' must be at least 1"),
    (["--workers", "two"], "malformed --workers 'two'"),
    (["--shard", "3/2"], "malformed --shard '3/2'"),
    (["--shard", "1"], "malformed --shard '1'"),
    (["--backend", "mpi"], "unknown --backend 'mpi'"),
])
def test_bad_spread_options_are_one_sentence_and_exit_2(tmp_path, args, needle):
    res, out = _parity(tmp_path, "bad", *args, impl="torch")
    assert res.exit_code == 2 and needle in res.output, res.output
    assert not out.exists()


def test_ray_backend_without_ray_says_how_to_get_it(tmp_path, monkeypatch):
    import builtins
    real = builtins.__import__

    def no_ray(name, *a, **k):
        if name == "ray":
            raise ImportError("no ray")
        return real(name, *a, **k)
    monkeypatch.setattr(builtins, "__import__", no_ray)
    res, _ = _parity(tmp_path, "ray", "--backend", "ray", impl="torch")
    assert res.exit_code == 2 and "pip install ray" in res.output, res.output


def test_auto_is_one_worker_per_core_on_a_cpu_and_never_more_than_the_cases():
    assert pool.worker_count("auto", "cpu", 1000) >= 1
    assert pool.worker_count(8, "cpu", 3) == 3
    with pytest.raises(UsageError):
        pool.parse_workers("-1")


def test_a_python_callable_cannot_be_spread(tmp_path):
    from mhctool.kernels.torch import mhc
    from mhctool.registry.impl import Impl
    pl = parity.plan(["sinkhorn"], [Impl("mine", "sinkhorn", "external", mhc.sinkhorn)], device="cpu",
                     scenario=str(_scenario(tmp_path)))
    with pytest.raises(UsageError, match="exists in this process only"):
        parity.execute(pl, workers=2)


def test_ray_backend_writes_the_rows_of_one_process(tmp_path):
    pytest.importorskip("ray")
    one, one_out = _parity(tmp_path, "one", impl="triton")
    ray_, ray_out = _parity(tmp_path, "ray", "--backend", "ray", impl="triton")
    assert one.exit_code == ray_.exit_code == 0, (one.output, ray_.output)
    assert _rows(one_out) == _rows(ray_out)


def test_a_worker_with_a_gpu_of_its_own_forks_from_the_fork_server():
    """A variable read after the fork (the GPU a worker sees) needs no interpreter of its own: the
    worker is the fork server's child and has it; one read when torch is imported (OpenMP's wait
    policy), unless the fork server started with it, gets a fresh interpreter (our child)."""
    import os
    with Worker(daemon=False, env={"CUDA_VISIBLE_DEVICES": "", "MHCTOOL_DRAW_THREADS": "3"}) as w:
        (ppid, failure), (threads, _) = w.call("os:getppid"), w.call("os:getenv", ("MHCTOOL_DRAW_THREADS",))
        assert failure is None and ppid != os.getpid() and threads == "3"
    if not forkserver.forkserver_has("OMP_NUM_THREADS", "7"):
        with Worker(daemon=False, env={"OMP_NUM_THREADS": "7"}) as w:
            (ppid, _), (value, _) = w.call("os:getppid"), w.call("os:getenv", ("OMP_NUM_THREADS",))
            assert ppid == os.getpid() and value == "7"


def test_each_pool_worker_gets_its_own_gpu_whatever_the_environment_while_workers_start(monkeypatch):
    """A spawned worker's variables are in this process's environment while it starts: the other
    workers' GPUs must not be read from it then (three of four once got the first one's GPU)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr("mhctool.runner.case.device_memory", lambda device: 80e9)
    p = pool.Pool(4, "cuda")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # worker 0 starting, as a spawned child
    try:
        assert [p._worker(k).env["CUDA_VISIBLE_DEVICES"] for k in range(4)] == ["0", "1", "2", "3"]
    finally:
        p.close()


@pytest.mark.gpu
def test_a_pool_worker_sees_the_gpu_it_was_given_only():
    """A pool worker's CUDA_VISIBLE_DEVICES takes effect: an empty one shows it no GPU (four
    workers forked from the fork server once all ran on the first GPU of four)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pool.warm(2)
    for gpus, count in (("", 0), (pool.visible_gpus()[-1], 1)):
        with Worker(daemon=False, env={"CUDA_VISIBLE_DEVICES": gpus}) as w:
            value, failure = w.call("torch.cuda:device_count", timeout=300)
        assert failure is None and value == count, (gpus, value, failure)


def test_the_shm_transport_hands_a_worker_copies_of_the_inputs():
    """Code under test that writes into its inputs never changes mhctool's own tensors."""
    x = torch.arange(6, dtype=torch.float32)
    with Worker("shm") as w:
        value, failure = w.call("operator:iadd", (x, 1.0), timeout=120)
    assert failure is None and torch.equal(value, torch.arange(6, dtype=torch.float32) + 1)
    assert torch.equal(x, torch.arange(6, dtype=torch.float32))


@pytest.mark.gpu
def test_cuda_tensors_cross_to_a_worker_on_the_device():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    x = torch.randn(1000, 37, device="cuda", dtype=torch.bfloat16)
    with Worker("shm") as w:
        value, failure = w.call("operator:imul", (x, 2.0), timeout=300)
        again, _ = w.call("torch:clone", (value,), timeout=300)
    assert failure is None and value.is_cuda and torch.equal(value, x * 2) and torch.equal(again, value)


@pytest.mark.slow
def test_every_kernel_on_two_workers_writes_the_report_of_one_process(tmp_path):
    """The default run (every kernel, every built-in), as the isolation issue asks: the same rows."""
    outs = []
    for w in ("1", "2"):
        out = tmp_path / f"w{w}.parquet"
        res = cli.invoke(app, ["parity", "--kernel", "all", "--device", "cpu", "--workers", w, "-q", "-o", str(out)])
        assert res.exit_code == 0, res.output
        outs.append(out)
    assert _rows(outs[0]) == _rows(outs[1])


def test_profile_says_where_the_time_went(tmp_path):
    """--profile: the phases inside the cases (the reference, the native run, each implementation
    with its first call apart, judging) and, with workers, what was spent outside them; the report
    keeps the sums whether or not they were printed."""
    res, out = _parity(tmp_path, "prof", "--profile", "--workers", "2", impl="torch")
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert "profile: " in text and "inside the cases over 2 process(es)" in text
    assert "outside the cases (transfers, waiting)" in text and "worker start (a process and its imports)" in text
    import json
    run = json.loads(pq.read_table(out).schema.metadata[b"mhctool.run"])
    assert {"float64 reference", "native (the baseline)", "judging", "inputs"} <= set(run["profile"])
    # the native run's first call in each process apart (where PyTorch loads its libraries' kernels)
    assert "native (the baseline) (first call in the process)" in run["profile"]
    assert run["wall_s"] > 0


def test_a_run_that_isolates_starts_the_fork_server_at_once_even_with_one_worker():
    """`gate` (isolating by default) and `parity --isolate` start the fork server before they plan,
    as a spread run does: its import of torch overlaps the planning and the first case's inputs,
    reference and native run (the first isolated call used to wait for all of it). One worker
    without isolation starts none."""
    import subprocess
    import sys
    code = ("import os, threading; os.environ['MHCTOOL_PROBE'] = '1'; from mhctool.spread import forkserver, pool; "
            "pool.warm(1); a = forkserver.forkserver_has('MHCTOOL_PROBE', '1'); "
            "pool.warm(1, 'local', isolate=True); b = forkserver.forkserver_has('MHCTOOL_PROBE', '1'); "
            "[t.join(120) for t in threading.enumerate() if t.name == 'mhctool-forkserver']; "
            "import multiprocessing.forkserver as f; print(a, b, getattr(f._forkserver, '_forkserver_pid', 0) is not None)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.split() == ["False", "True", "True"], out.stdout + out.stderr


def _job(isolation, specs=()):
    from mhctool.runner.case import Case
    from mhctool.core.shapes import parse_shape_for
    from mhctool.core.verdict import VerdictRule
    case = Case("sinkhorn", "random", "fp32", parse_shape_for("mhc", "9x1x4x3"), (), 0, "cpu")
    return jobs_mod.Job(case, tuple(specs), VerdictRule(), "ieee", None, (), 3, isolation)


def test_a_pool_worker_runs_mhctools_own_kernels_itself_and_isolates_the_external_ones():
    """A pool worker is a process apart already: where the run isolates, its first run of a case
    gives the external implementations workers of their own (code that changes its process's state
    must not reach the next case) but runs mhctool's own kernels itself, with the rows every
    implementation isolated gives."""
    specs = ("triton", f"{Path(__file__).resolve().parents[1] / 'impls' / 'correct.py'}:sinkhorn")
    first, every = jobs_mod.IsolationSettings(), jobs_mod.IsolationSettings(own=True)
    try:
        rows = {s: jobs_mod.case_job(_job(s, specs))["rows"] for s in (first, every)}
        workers = {s: set(jobs_mod._isolations[s].workers) for s in (first, every)}
    finally:
        for s in (first, every):
            if s in jobs_mod._isolations:
                jobs_mod._isolations.pop(s).close()
    external = next(n for n in workers[every] if n != "triton")
    assert workers[first] == {external} and workers[every] == {"triton", external}
    nan = lambda rs: [{k: ("nan" if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()} for r in rs]  # noqa: E731
    assert nan(rows[first]) == nan(rows[every]) and any(r["impl"] == "triton" and r["passed"] for r in rows[first])


def test_a_case_whose_worker_failed_runs_again_with_every_implementation_isolated():
    """What mhctool's own kernels do to the worker that ran them (a crash, a hang, a CUDA fault)
    sends the case again to a fresh worker with every implementation isolated, so the kernel that
    did it gets its failed row and the others their verdicts."""
    from mhctool.spread.isolation import Failure
    sent = []

    class Crashes:
        def call(self, target, args, timeout=None, interrupted=None):
            sent.append(args[0].isolation)
            if len(sent) == 1:
                return None, Failure("crashed", "crashed: signal 11 (SIGSEGV)")
            return {"rows": [], "abandoned": False}, None

    for isolation in (jobs_mod.IsolationSettings(), None):
        sent.clear()
        value = pool._run_job(Crashes(), _job(isolation), [], lambda: False, pool._Memory(1e15), "cpu")
        assert value == {"rows": [], "abandoned": False}
        assert sent == [isolation, jobs_mod.IsolationSettings(own=True)]


def test_stretches_are_cut_by_cost_and_run_largest_first_every_case_once():
    """Each worker's stretch is a contiguous run of the plan of about equal cost, taken largest
    case first; an idle worker takes the smallest case of the costliest stretch left. Every case
    is taken once; equal costs cut as equal counts did."""
    even = pool._Segments(9, 3)
    assert [sorted(s) for s in even.stretches] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    costs = [1, 1, 1, 1, 1, 8, 8, 2, 2, 2, 9, 1]  # two kernels of small cases, then large ones
    seg = pool._Segments(len(costs), 2, costs)
    first, second = (sorted(s) for s in seg.stretches)
    assert first == list(range(first[-1] + 1)) and second == list(range(first[-1] + 1, len(costs)))
    share = [sum(costs[i] for i in s) for s in seg.stretches]
    assert abs(share[0] - share[1]) <= max(costs)
    assert [costs[i] for i in seg.stretches[0]] == sorted((costs[i] for i in seg.stretches[0]), reverse=True)
    taken = [seg.take(0) for _ in range(len(seg.stretches[0]))]  # worker 0 empties its own stretch...
    steal = seg.take(0)  # ... then takes the smallest case of the other
    assert costs[steal] == min(costs[i] for i in second)
    rest = []
    while (i := seg.take(1)) is not None:
        rest.append(i)
    assert sorted(taken + [steal] + rest) == list(range(len(costs)))
    assert pool._Segments(3, 2, [0.0, 0.0, 0.0]).stretches[1]  # no cost known: counts


def test_workers_that_share_a_gpu_are_told_so(monkeypatch):
    """One worker a GPU keeps its cached memory from case to case; more workers than GPUs hand it
    back after each case (runner.gives_memory_back reads MHCTOOL_SHARED_GPU, set after the fork)."""
    from mhctool.runner import run as runner
    from mhctool.spread import isolation
    from mhctool.spread.case_isolation import Isolation
    monkeypatch.setattr(pool, "visible_gpus", lambda: ["0", "1"])
    assert all("MHCTOOL_SHARED_GPU" not in pool.worker_env(k, "cuda", 2) for k in range(2))
    assert [pool.worker_env(k, "cuda", 3)["CUDA_VISIBLE_DEVICES"] for k in range(3)] == ["0", "1", "0"]
    assert all(pool.worker_env(k, "cuda", 3)["MHCTOOL_SHARED_GPU"] == "1" for k in range(3))
    assert "MHCTOOL_SHARED_GPU" not in pool.worker_env(0, "cpu", 3)
    assert "MHCTOOL_SHARED_GPU" in isolation.LATE_VARIABLES
    monkeypatch.delenv("MHCTOOL_SHARED_GPU", raising=False)
    assert runner.gives_memory_back(None, None) is False
    assert runner.gives_memory_back(Isolation(), None) is False  # no isolation worker started
    assert runner.gives_memory_back(Isolation(workers={"triton": object()}), None)
    assert runner.gives_memory_back(None, object())
    monkeypatch.setenv("MHCTOOL_SHARED_GPU", "1")
    assert runner.gives_memory_back(None, None) is True
