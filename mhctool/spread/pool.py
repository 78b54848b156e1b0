"""Cases spread over worker processes, on this machine or on a Ray cluster.

A parity run is a list of independent cases. :func:`run_cases` hands them to ``workers``
processes (or to Ray tasks) and puts the rows back together in the plan's order, so a run with
four workers writes the same report as a run with one.

Each worker is an :class:`mhctool.isolation.Worker` that runs :func:`case_job`: it resolves the
implementations from the same ``--impl`` specs as the parent, runs :func:`runner.run_case` and
sends back plain rows. Where the run isolates the implementations under test, the worker isolates
the external ones (a file's, a library's) in workers of its own, as a single process would;
mhctool's own kernels run in the worker itself, a process apart already (a worker of its own
for each of them cost each worker a fork server and a process per kernel: the GPU gate took
longer on two GPUs than on one).

What the code under test does to a case's worker (a crash, an exit, a hang past the case's time
limit, a CUDA fault) costs that case only: the case is run again once, in a fresh worker that
isolates every implementation, so the implementation that crashed gets its failed rows and the
others their verdicts. Should that run die too (mhctool's own code, the native run or the
reference, is what crashed), every implementation of the case gets one error row saying so.

On a GPU machine each worker sees one GPU (``CUDA_VISIBLE_DEVICES``), round-robin over the
visible ones; ``auto`` is one worker per visible GPU, or one per core on a CPU.
"""
from __future__ import annotations

import collections
import math
import os
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable

from mhctool.core import profile
from mhctool.core.errors import UsageError
from mhctool.spread.forkserver import start_forkserver

BACKENDS = ("local", "ray")


@dataclass(frozen=True)
class IsolationSettings:
    """What a worker needs to isolate the implementations under test as the parent would.
    ``own`` False (a case's first run in a worker): mhctool's own implementations (its Triton,
    cuTile and PyTorch kernels) run in the worker itself, which is a process apart already; what
    they do to it (a crash, a hang, a CUDA fault) runs the case again with ``own`` True, every
    implementation isolated. External ones (a file, a library) are always isolated: code that
    changes its process's state (a global flag) must not reach the cases after it."""

    transport: str = "shm"
    case_timeout: float | None = None
    own: bool = False


@dataclass(frozen=True)
class Job:
    """One case, as a worker runs it: everything plain enough to pickle."""

    case: object  # runner.Case
    specs: tuple  # the --impl specs the parent resolved (empty: every default built-in)
    rule: object  # verdict.VerdictRule
    matmul_precision: str
    conventions: dict | None
    checks: tuple
    repeats: int
    isolation: IsolationSettings | None
    input_dtypes: dict | None = None  # the external implementations' declared input dtypes


# --- how many workers, and where ---------------------------------------------------------------

def parse_workers(value: str | int | None) -> str | int:
    """``--workers``: a positive integer or ``auto``; anything else is a UsageError."""
    if value is None:
        return 1
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    else:
        text = str(value).strip().lower()
        if text == "auto":
            return "auto"
        try:
            n = int(text)
        except ValueError:
            raise UsageError(f"malformed --workers {value!r}; expected a positive integer or auto") from None
    if n < 1:
        raise UsageError(f"--workers {value!r} must be at least 1 (or auto)")
    return n


def check_backend(backend: str) -> str:
    """``--backend``: local, or ray where Ray is installed; anything else is a UsageError."""
    if backend not in BACKENDS:
        raise UsageError(f"unknown --backend {backend!r}; accepted: {', '.join(BACKENDS)}")
    if backend == "ray":
        _ray()  # installed, or one sentence saying how
    return backend


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as ``CUDA_VISIBLE_DEVICES`` entries for a child."""
    import torch
    if not torch.cuda.is_available():
        return []
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    count = torch.cuda.device_count()
    if listed is not None and listed.strip():
        return [s.strip() for s in listed.split(",") if s.strip()][:count]
    return [str(i) for i in range(count)]


def worker_count(workers: str | int, device: str, cases: int) -> int:
    """How many workers a run gets: ``auto`` is one per visible GPU (cuda) or per core (cpu);
    never more than there are cases."""
    if workers == "auto":
        n = len(visible_gpus()) if device == "cuda" else cores()
    else:
        n = int(workers)
    return max(1, min(n, cases))


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def worker_env(index: int, device: str, workers: int = 1) -> dict[str, str]:
    """The environment of worker ``index`` of ``workers``: on a GPU machine, its GPU (round-robin),
    which a child of the fork server takes (no interpreter of its own to start), and whether
    another worker shares it (``MHCTOOL_SHARED_GPU``); its share of the
    cores for drawing a large case's inputs. On a CPU, idle OpenMP threads sleep instead of
    spinning (``OMP_WAIT_POLICY=PASSIVE``): two workers whose threads spun for the cores made two
    workers on 2 cores slower than one. The thread counts stay as in one process: PyTorch's CPU
    sums split their work by the thread count, so fewer threads a worker changed the last bits of
    119 of 13,296 rows of the default run."""
    gpus = visible_gpus() if device == "cuda" else []
    env = {"CUDA_VISIBLE_DEVICES": gpus[index % len(gpus)]} if gpus else {}
    if gpus and workers > len(gpus):  # a case hands its GPU memory back for the others (runner.gives_memory_back)
        env["MHCTOOL_SHARED_GPU"] = "1"
    if workers > 1:  # a large case's inputs are drawn on threads: each worker its share of the cores
        env["MHCTOOL_DRAW_THREADS"] = str(max(1, min(32, cores() // workers)))
    if workers > 1 and device == "cpu":
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    return env


def warm(workers: str | int | None, backend: str = "local", isolate: bool = False) -> None:
    """At the start of a command that spreads its cases or isolates the implementations under test
    (before its own imports): the fork server starts in the background, importing torch while this
    process plans the run, so that the workers are forked from it at once; where the cases are
    spread, idle OpenMP threads sleep (``OMP_WAIT_POLICY=PASSIVE``, unless set already). Anything
    else (one worker without isolation, Ray, a malformed value) does nothing here."""
    try:
        spread = parse_workers(workers) != 1
    except UsageError:
        return  # said once the command checks its options
    if backend != "local" or not (spread or isolate):
        return
    if spread:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    start_forkserver()


# --- the job a worker runs -----------------------------------------------------------------------

_isolations: dict = {}


def case_job(job: Job) -> dict:
    """Run one case in this (worker) process; the rows and whether an interrupt cut it short."""
    from mhctool.registry.specs import resolve_impls
    from mhctool.runner import run as runner
    from mhctool.spread.case_isolation import Isolation
    t0 = time.perf_counter()
    impls = resolve_impls(job.case.kernel, list(job.specs))
    resolving = time.perf_counter() - t0
    iso = None
    if job.isolation is not None:
        iso = _isolations.get(job.isolation)
        if iso is None:
            iso = _isolations[job.isolation] = Isolation(transport=job.isolation.transport,
                                                                case_timeout=job.isolation.case_timeout,
                                                                own=job.isolation.own)
        # the fork server of this worker's isolation workers, started while the case's inputs,
        # reference and native run come first (none where nothing of the case is isolated)
        if any(iso.isolates(i) for i in impls if not i.native):
            start_forkserver()
    res = runner.run_case(job.case, impls, job.rule, job.matmul_precision, iso, job.conventions,
                          job.checks, job.repeats, input_dtypes=job.input_dtypes)
    return {"rows": res.rows, "abandoned": res.abandoned,
            "timings": profile.add(res.timings, {profile.RESOLVING: resolving})}


def job_timeout(job: Job, impls: int) -> float:
    """How long one case may take in a worker: the isolation limit of each implementation, the
    native run and the reference included (each one compiles and runs inside it)."""
    from mhctool.runner.case import default_timeout, footprint
    if job.isolation is not None and job.isolation.case_timeout is not None:
        per = job.isolation.case_timeout
    else:
        per = default_timeout(footprint(job.case), job.case.device,
                              external=any(":" in s for s in job.specs))
    checks = 1 + (job.repeats if job.checks else 0)
    return per * (impls + 2) * checks


def lost_rows(job: Job, impl_names: list[tuple[str, str]], why: str) -> list[dict]:
    """One error row per implementation and direction: the case's worker died twice, the second
    time with every implementation isolated, so mhctool's own part of the case is what failed."""
    from mhctool.runner.case import row_fields
    from mhctool.registry.impl import Impl
    rows = []
    for name, backend in impl_names:
        base = row_fields(job.case, job.case.shape, Impl(name, job.case.kernel, backend, name), "ieee",
                         job.case.knob_dict)
        for direction in ("fwd", "bwd"):
            rows.append({**base, "direction": direction, "tensor": "*", "metric": "error", "value": math.nan,
                         "threshold": None, "passed": False, "rule": "lost",
                         "message": f"the worker running this case died: {why}" if direction == "fwd"
                         else "not run: the case's worker died"})
    return rows


# --- spreading the cases -----------------------------------------------------------------------

@dataclass
class Spread:
    """What :func:`run_cases` returns: rows per case index (None: not finished)."""

    rows: list
    interrupted: bool
    timings: dict = field(default_factory=dict)  # phase -> seconds, inside the cases and outside them


def run_cases(jobs: list[Job], impl_names: list[list[tuple[str, str]]], workers: int, backend: str = "local",
              interrupted: Callable[[], bool] = lambda: False,
              started: Callable[[int], None] | None = None, finished: Callable[[int], None] | None = None,
              ray_address: str | None = None, into: "Pool | None" = None) -> Spread:
    """Run ``jobs`` on ``workers`` processes (``backend`` local) or as Ray tasks; ``impl_names``:
    per job, the (name, backend) pairs that get error rows if its case is lost. ``into``: a
    :class:`Pool` whose workers (already started, their kernels compiled) run them; otherwise a
    pool of ``workers`` for this run alone."""
    if check_backend(backend) == "ray":
        return _run_ray(jobs, impl_names, interrupted, started, finished, ray_address)
    if into is not None:
        return into.run(jobs, impl_names, interrupted, started, finished, workers)
    with Pool(workers, jobs[0].case.device if jobs else "cpu") as p:
        return p.run(jobs, impl_names, interrupted, started, finished)


class Pool:
    """``size`` worker processes kept from one run of cases to the next: a gate's parity entries
    share them, so each worker starts, initialises CUDA and loads (or compiles) a kernel once for
    the whole suite rather than once an entry. Workers start at their first case; one that died
    or was stopped starts again at its next. :meth:`close` (or leaving the ``with``) stops them."""

    def __init__(self, size: int, device: str):
        from mhctool.runner.case import device_memory
        self.size, self.device = max(1, size), device
        self.memory = _Memory(0.9 * device_memory(device))
        self.workers: list = [None] * self.size
        # every worker's variables, worked out here before any starts: a spawned worker's start sets
        # its variables in this process's environment for a moment, and reading the GPU list from
        # there as each worker started once put three of four workers on the first GPU of a
        # four-H200 node (which then ran out of memory)
        self.envs = [worker_env(k, device, self.size) for k in range(self.size)]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        for w in self.workers:
            if w is not None:
                w.stop()
        self.workers = [None] * self.size

    def _worker(self, index: int):
        if self.workers[index] is None:
            from mhctool.spread.isolation import Worker
            self.workers[index] = Worker(daemon=False, env=self.envs[index])
        return self.workers[index]

    def run(self, jobs: list[Job], impl_names: list[list[tuple[str, str]]],
            interrupted: Callable[[], bool] = lambda: False,
            started: Callable[[int], None] | None = None, finished: Callable[[int], None] | None = None,
            workers: int | None = None) -> Spread:
        """Run ``jobs`` on the first ``workers`` (all by default) of the pool's processes; rows
        per job in the jobs' order."""
        n = max(1, min(workers or self.size, self.size, len(jobs) or 1))
        results: list = [None] * len(jobs)
        from mhctool.runner.case import footprint
        todo = _Segments(len(jobs), n, [footprint(j.case) for j in jobs])
        abort = threading.Event()  # set when the run must stop at once: in-flight cases are abandoned
        timings: dict = {}
        lock = threading.Lock()

        def serve(index: int) -> None:
            pool_worker = self._worker(index)
            # the workers that share a device share its memory
            place = pool_worker.env.get("CUDA_VISIBLE_DEVICES", self.device)
            t0 = time.perf_counter()
            if pool_worker.start() is None:  # a worker that did not start fails at its first case
                with lock:
                    profile.add(timings, {profile.START: time.perf_counter() - t0})
            while not (interrupted() or abort.is_set()):  # an interrupt: no new case, the ones in hand finish
                i = todo.take(index)
                if i is None:
                    return
                if started:
                    started(i)
                t0 = time.perf_counter()
                value = _run_job(pool_worker, jobs[i], impl_names[i], abort.is_set, self.memory, place)
                if value is None or value["abandoned"]:
                    pool_worker.stop()
                    return
                spent = time.perf_counter() - t0
                inside = value.get("timings") or {}
                with lock:  # the case's phases, and what its worker spent around them
                    profile.add(timings, inside)
                    profile.add(timings, {profile.OUTSIDE: max(0.0, spent - sum(inside.values()))})
                results[i] = value["rows"]
                if finished:
                    finished(i)

        threads = [threading.Thread(target=serve, args=(k,), name=f"mhctool-worker-{k}", daemon=True)
                   for k in range(n)]
        for t in threads:
            t.start()
        try:
            for t in threads:
                while t.is_alive():
                    t.join(0.1)
        except BaseException:  # a second Ctrl-C: the workers are stopped before the run ends
            abort.set()
            for t in threads:
                t.join(30)
            self.close()
            raise
        return Spread(results, interrupted(), timings)


class _Segments:
    """The cases in plan order (grouped by kernel), cut into one contiguous stretch a worker of
    about equal cost (``costs``: a case's float64 footprint, its size), each stretch largest case
    first: a worker takes from the front of its own, and once that is empty from the back (the
    smallest case) of the costliest other one. Workers meet in few kernels, so few kernels are
    compiled (or, under Triton's interpreter, traced) by more than one worker, and the run ends
    on small cases. On 2 cores, the default scenario's Triton kernels: first calls 8.2 s in all
    with one shared queue, where one process spends 3.7. Stretches of equal counts in plan order
    left the paper scenario's two workers on two H200s 89% busy: a stretch could end on its
    largest case."""

    def __init__(self, jobs: int, workers: int, costs: list[float] | None = None):
        costs = [1.0] * jobs if costs is None or not sum(costs) else [max(0.0, c) for c in costs]
        self.costs = costs
        total, cuts, acc = sum(costs), [0], 0.0
        for i, c in enumerate(costs):  # cut where the running cost passes each worker's share
            if len(cuts) < workers and acc + c / 2 > total * len(cuts) / workers and i > cuts[-1]:
                cuts.append(i)
            acc += c
        cuts += [jobs] * (workers + 1 - len(cuts))
        self.stretches = [collections.deque(sorted(range(cuts[k], cuts[k + 1]), key=lambda i: -costs[i]))
                          for k in range(workers)]
        self.lock = threading.Lock()

    def take(self, worker: int) -> int | None:
        with self.lock:
            own = self.stretches[worker % len(self.stretches)]
            if own:
                return own.popleft()
            donor = max(self.stretches, key=lambda d: sum(self.costs[i] for i in d))
            return donor.pop() if donor else None


class _Memory:
    """Cases start on a device only where their memory fits beside the cases running there: two
    paper-shape cases at once need more than an 80 GB GPU has. A case alone always starts."""

    def __init__(self, budget: float):
        self.budget = budget
        self.used: dict[str, float] = {}
        self.cond = threading.Condition()

    def take(self, place: str, need: float, aborted: Callable[[], bool]) -> float:
        """Wait until ``need`` bytes fit on ``place`` (more than the budget: until the device is
        free, and keep it alone); what was taken, for :meth:`give`."""
        with self.cond:
            while True:
                used = self.used.get(place, 0.0)
                if used == 0.0 or used + need <= self.budget or aborted():
                    break
                self.cond.wait(0.2)
            self.used[place] = used + need
        return need

    def give(self, place: str, need: float) -> None:
        with self.cond:
            left = self.used.get(place, 0.0) - need
            self.used[place] = left if left >= 1.0 else 0.0  # float sums of byte counts: under a byte is none
            self.cond.notify_all()


# what a case needs on its device, in float64-reference footprints: the reference, the native and
# fused runs, autograd's saved tensors and the metrics (an H100 peaked at 1.7 for h_aggregate at the
# paper shape)
MEMORY_FACTOR = 2.0


def _out_of_memory(rows: list[dict]) -> bool:
    return any(r["metric"] == "error" and "out of memory" in (r["message"] or "").lower() for r in rows)


def _call(pool_worker, job, timeout, aborted, memory, place, need):
    taken = memory.take(place, need, aborted)
    try:
        return pool_worker.call("mhctool.spread.pool:case_job", (job,), timeout=timeout, interrupted=aborted)
    finally:
        memory.give(place, taken)


def _run_job(pool_worker, job: Job, impl_names: list, aborted: Callable[[], bool], memory: _Memory,
             place: str) -> dict | None:
    """One case in ``pool_worker``, once its memory fits on its device; a worker that dies (or a
    case that fails in mhctool's own part, out of memory say) runs it again once, alone on the
    device, with every implementation isolated; None: abandoned (the run is being stopped)."""
    from mhctool.runner.case import footprint
    timeout = job_timeout(job, len(impl_names))
    value, failure = _call(pool_worker, job, timeout, aborted, memory, place, MEMORY_FACTOR * footprint(job.case))
    if failure is None and not value["abandoned"] and _out_of_memory(value["rows"]):
        # the cases beside it may have taken the memory: what it gets alone is its verdict
        value, failure = _call(pool_worker, job, timeout, aborted, memory, place, memory.budget + 1.0)
    if failure is None:
        return value
    if aborted():
        return None
    again = replace(job, isolation=replace(job.isolation or IsolationSettings(), own=True))
    value, second = _call(pool_worker, again, timeout, aborted, memory, place, memory.budget + 1.0)
    if second is None:
        return value
    if aborted():
        return None
    return {"rows": lost_rows(job, impl_names, f"{failure.message}; again with every implementation "
                              f"isolated: {second.message}"), "abandoned": False}


# --- Ray -----------------------------------------------------------------------------------------

def _ray():
    try:
        import ray
    except ImportError:
        raise UsageError("--backend ray needs Ray: pip install 'mhctool[ray]' (or pip install ray)") from None
    return ray


def _ray_task(job: Job) -> dict:  # runs in a Ray worker process
    from mhctool.core.environment import ensure_triton_mode
    ensure_triton_mode()
    return case_job(job)


def _run_ray(jobs, impl_names, interrupted, started, finished, address) -> Spread:
    """One Ray task per case (``ray.init(address)``; a local cluster when None). A task whose
    worker dies is run again with every implementation isolated, as in the local pool."""
    ray = _ray()
    owns = not ray.is_initialized()
    if owns:
        env = {"env_vars": {k: v for k, v in os.environ.items() if k in ("TRITON_INTERPRET", "PYTHONPATH")}}
        ray.init(address=address, runtime_env=env, log_to_driver=False, include_dashboard=False)
    try:
        gpu = jobs and jobs[0].case.device == "cuda"
        task = ray.remote(num_cpus=1, num_gpus=1 if gpu else 0, max_retries=0)(_ray_task)
        results: list = [None] * len(jobs)
        pending = {}
        for i, job in enumerate(jobs):
            pending[task.remote(job)] = (i, False)
            if started:
                started(i)
        while pending:
            if interrupted():
                for ref in pending:
                    ray.cancel(ref, force=True)
                break
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=0.2)
            for ref in ready:
                i, retried = pending.pop(ref)
                try:
                    value = ray.get(ref)
                except Exception as e:  # noqa: BLE001 - the task's worker died or the task raised
                    why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                    if not retried:
                        again = replace(jobs[i], isolation=replace(jobs[i].isolation or IsolationSettings(), own=True))
                        pending[task.remote(again)] = (i, why)
                        continue
                    value = {"rows": lost_rows(jobs[i], impl_names[i], f"{retried}; again with every "
                                               f"implementation isolated: {why}"), "abandoned": False}
                results[i] = value["rows"]
                if finished:
                    finished(i)
        return Spread(results, interrupted())
    finally:
        if owns:
            ray.shutdown()
