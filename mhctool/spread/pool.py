"""Cases spread over worker processes, on this machine or on a Ray cluster.

A parity run is a list of independent cases. :func:`run_cases` hands them to ``workers``
processes (or to Ray tasks) and puts the rows back together in the plan's order, so a run with
four workers writes the same report as a run with one.

Each worker is an :class:`mhctool.spread.isolation.Worker` that runs :func:`case_job`: it resolves the
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
visible ones; ``auto`` is one worker per visible GPU, or one per core on a CPU; unset, a run is
spread where it pays (:mod:`mhctool.spread.machine`).
"""
from __future__ import annotations

import collections
import os
import sys
import threading
import time
from dataclasses import replace
from typing import Callable

from mhctool.core import profile
from mhctool.core.errors import Interrupted, UsageError, abandonable
from mhctool.core.host import cores
from mhctool.spread.forkserver import start_forkserver
from mhctool.spread.jobs import IsolationSettings, Job, Spread, job_timeout, lost_rows
from mhctool.spread.streaks import Streaks
from mhctool.spread.machine import default_workers
from mhctool.spread.prewarm import gpu_machine
from mhctool.spread.ray_cluster import ray_module, run_on_ray

BACKENDS = ("local", "ray")


# ``--workers`` unset: spread where it pays (machine.default_workers); "auto" and a number are asked
DEFAULT = "default"


WORKERS_ENV = "MHCTOOL_WORKERS"
PER_CORE = 4  # the most worker processes a core: past that, a count is a typo, not a plan


def _said(value) -> str:
    """How the user gave the worker count: the variable where it came from there, else the flag."""
    from_env = os.environ.get(WORKERS_ENV) == str(value) and not any(a.startswith("--workers") for a in sys.argv)
    return f"{WORKERS_ENV}={value}" if from_env else f"--workers {value!r}"


def parse_workers(value: str | int | None) -> str | int:
    """``--workers`` (or ``MHCTOOL_WORKERS``): a positive integer or ``auto``; None (unset) is
    :data:`DEFAULT`; anything else, or a count far past the machine (more than
    :data:`PER_CORE` a core), is one sentence naming where it was given."""
    if value is None:
        return DEFAULT
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    else:
        text = str(value).strip().lower()
        if text == "auto":
            return "auto"
        try:
            n = int(text)
        except ValueError:
            raise UsageError(f"malformed {_said(value)}; expected a positive integer or auto") from None
    if n < 1:
        raise UsageError(f"{_said(value)} must be at least 1 (or auto)")
    if n > PER_CORE * cores():
        raise UsageError(f"{_said(value)} is far past this machine's {cores()} cores (at most {PER_CORE * cores()} "
                         "worker processes; auto: one per GPU, or per core)")
    return n


def check_backend(backend: str) -> str:
    """``--backend``: local, or ray where Ray is installed; anything else is a UsageError."""
    if backend not in BACKENDS:
        raise UsageError(f"unknown --backend {backend!r}; accepted: {', '.join(BACKENDS)}")
    if backend == "ray":
        ray_module()  # installed, or one sentence saying how
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
    :data:`DEFAULT` spreads where it pays (:func:`machine.default_workers`); never more than
    there are cases."""
    if workers == DEFAULT:
        return default_workers(device, cases, len(visible_gpus()) if device == "cuda" else 0)
    if workers == "auto":
        n = len(visible_gpus()) if device == "cuda" else cores()
    else:
        n = int(workers)
    return max(1, min(n, cases))


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


def warm(workers: str | int | None, backend: str = "local", isolate: bool = False, device: str | None = None) -> None:
    """At the start of a command that spreads its cases or isolates the implementations under test
    (before its own imports): the fork server starts in the background, importing torch while this
    process plans the run, so that the workers are forked from it at once; where the cases are
    spread, idle OpenMP threads sleep (``OMP_WAIT_POLICY=PASSIVE``, unless set already). Anything
    else (one worker without isolation, Ray, a malformed value) does nothing here. ``workers``
    unset: started where the run will be on the CPU (``device``, else no NVIDIA driver here) of a
    machine of several cores, where the default spreads any run of 8 cases or more."""
    try:
        asked = parse_workers(workers)
    except UsageError:
        return  # said once the command checks its options
    spread = asked != 1
    if asked == DEFAULT:
        on_cpu = device == "cpu" or (device is None and not gpu_machine())
        spread = on_cpu and cores() > 1
    if backend != "local" or not (spread or isolate):
        return
    if spread:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    start_forkserver()


def run_cases(jobs: list[Job], impl_names: list[list[tuple[str, str]]], workers: int, backend: str = "local",
              interrupted: Callable[[], bool] = lambda: False,
              started: Callable[[int], None] | None = None, finished: Callable[[int], None] | None = None,
              ray_address: str | None = None, into: "Pool | None" = None, insist: bool = False) -> Spread:
    """Run ``jobs`` on ``workers`` processes (``backend`` local) or as Ray tasks; ``impl_names``:
    per job, the (name, backend) pairs that get error rows if its case is lost. ``into``: a
    :class:`Pool` whose workers (already started, their kernels compiled) run them; otherwise a
    pool of ``workers`` for this run alone. An implementation that keeps ending its process is not
    run on the cases after (:class:`Streaks`) unless ``insist``."""
    if check_backend(backend) == "ray":
        return run_on_ray(jobs, impl_names, interrupted, started, finished, ray_address)
    if into is not None:
        return into.run(jobs, impl_names, interrupted, started, finished, workers, insist)
    with Pool(workers, jobs[0].case.device if jobs else "cpu") as p:
        return p.run(jobs, impl_names, interrupted, started, finished, insist=insist)


# after an interrupt, how long the cases in hand may take to finish before they are abandoned (their
# workers stopped): a case that hangs never keeps one Ctrl-C from ending with a report
FINISH_GRACE_S = 20.0


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
            workers: int | None = None, insist: bool = False) -> Spread:
        """Run ``jobs`` on the first ``workers`` (all by default) of the pool's processes; rows
        per job in the jobs' order. A job is handed out with the implementations that ended their
        process in the cases before it (:class:`Streaks`) marked not to run, unless ``insist``."""
        n = max(1, min(workers or self.size, self.size, len(jobs) or 1))
        results: list = [None] * len(jobs)
        from mhctool.runner.case import footprint
        todo = _Segments(len(jobs), n, [footprint(j.case) for j in jobs])
        abort = threading.Event()  # set when the run must stop at once: in-flight cases are abandoned
        timings: dict = {}
        lock = threading.Lock()
        streaks = Streaks(insist)

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
                names = [name for name, _ in impl_names[i]]
                with lock:
                    stopped = streaks.stopped(names)
                job = replace(jobs[i], stopped=stopped) if stopped else jobs[i]
                value = _run_job(pool_worker, job, impl_names[i], abort.is_set, self.memory, place)
                if value is None or value["abandoned"]:
                    pool_worker.stop()
                    return
                spent = time.perf_counter() - t0
                inside = value.get("timings") or {}
                with lock:  # the case's phases, and what its worker spent around them
                    streaks.saw_rows(value["rows"], [n for n in names if n not in dict(stopped)])
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
            with abandonable():
                self._wait(threads, interrupted, abort)
        except BaseException as e:  # a second Ctrl-C: the workers are stopped, the finished cases kept
            abort.set()
            for t in threads:
                t.join(30)
            self.close()
            if not isinstance(e, Interrupted):
                raise
            return Spread(results, True, timings)
        return Spread(results, interrupted(), timings)

    @staticmethod
    def _wait(threads, interrupted, abort) -> None:
        asked = None  # when the run was asked to stop: the cases in hand get FINISH_GRACE_S to finish
        for t in threads:
            while t.is_alive():
                t.join(0.1)
                if interrupted() and not abort.is_set():
                    asked = asked or time.monotonic()
                    if time.monotonic() - asked > FINISH_GRACE_S:  # a hung case: abandoned, the rest written
                        abort.set()


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
        return pool_worker.call("mhctool.spread.jobs:case_job", (job,), timeout=timeout, interrupted=aborted)
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
