"""Cases as Ray tasks (``--backend ray``): one task per case, a task whose worker dies run again
with every implementation isolated, as in the local pool. Imported by the pool, so free of torch
at import (as :mod:`mhctool.spread.jobs`); Ray itself is optional."""
from __future__ import annotations

import os
from dataclasses import replace

from mhctool.core.errors import UsageError
from mhctool.spread.jobs import IsolationSettings, Job, Spread, case_job, lost_rows
from mhctool.spread.machine import THREADS_ENV, apply_threads


def ray_module():
    try:
        import ray
    except ImportError:
        raise UsageError("--backend ray needs Ray: pip install 'mhctool[ray]' (or pip install ray)") from None
    return ray


def _ray_task(job: Job) -> dict:  # runs in a Ray worker process
    from mhctool.core.environment import ensure_triton_mode
    ensure_triton_mode()
    apply_threads()  # the run's thread count (its runtime environment carries MHCTOOL_THREADS)
    return case_job(job)


def run_on_ray(jobs, impl_names, interrupted, started, finished, address) -> Spread:
    """One Ray task per case (``ray.init(address)``; a local cluster when None). A task whose
    worker dies is run again with every implementation isolated, as in the local pool."""
    ray = ray_module()
    owns = not ray.is_initialized()
    if owns:
        env = {"env_vars": {k: v for k, v in os.environ.items() if k in ("TRITON_INTERPRET", "PYTHONPATH", THREADS_ENV)}}
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
