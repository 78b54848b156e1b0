"""Which implementations of a case run in isolation workers, and under what time limit: the
object the pool and the commands hand the one-case runner (``isolation=``)."""
from __future__ import annotations

from dataclasses import dataclass, field

from mhctool.registry.impl import Impl
from mhctool.runner.case import Case, ImplResult, default_timeout, footprint
from mhctool.spread.isolation import Failure, Worker
from mhctool.spread.streaks import Streaks


@dataclass
class Isolation:
    """Implementations under test run in worker processes (one per implementation, replaced after
    a crash, a fatal CUDA error or a time-out), so what they do to a process becomes a failed row.
    ``case_timeout`` None: :func:`mhctool.runner.case.default_timeout` of each case's footprint.
    One that keeps ending its process or hanging is stopped (:class:`~mhctool.spread.streaks.Streaks`)
    unless ``insist``."""

    transport: str = "shm"
    case_timeout: float | None = None
    interrupted: object = staticmethod(lambda: False)
    workers: dict = field(default_factory=dict)
    own: bool = True  # False: mhctool's own implementations run in this process (a pool worker's first run of a case)
    insist: bool = False
    streaks: Streaks | None = None  # how each implementation's last cases ended (made from ``insist``)

    def __post_init__(self):
        if self.streaks is None:
            self.streaks = Streaks(self.insist)

    def isolates(self, impl: Impl) -> bool:
        """Whether ``impl`` runs in a worker of its own: every one, or with ``own`` False the external ones."""
        return self.own or impl.backend == "external"

    def call(self, impl: Impl, target: str, args: tuple, footprint_bytes: float, device: str):
        """Run ``target(*args)`` in ``impl``'s worker (started on first use) under the case time
        limit; a ``stopped`` failure, without running it, where its streak says so."""
        why = self.streaks.why(impl.name)
        if why is not None:
            return None, Failure("stopped", why)
        worker = self.workers.get(impl.name)
        if worker is None:
            worker = self.workers[impl.name] = Worker(self.transport)
        timeout = self.case_timeout or default_timeout(footprint_bytes, device, impl.backend == "external")
        value, failure = worker.call(target, args, timeout=timeout, interrupted=self.interrupted)
        self.streaks.saw(impl.name, failure and failure.kind, failure and failure.message or "")
        return value, failure

    def run(self, case: Case, impl: Impl, base: dict, knobs: dict, upstream: list, expect: list) -> ImplResult:
        value, failure = self.call(impl, "mhctool.runner.call:isolated_impl",
                                   (case.kernel, impl.spec or impl.name, impl.name, base, knobs, upstream, expect),
                                   footprint(case), case.device)
        if failure is not None and failure.kind == "stopped":
            return ImplResult(fwd_error=failure.message, failure="stopped")
        if failure is None:
            value = dict(value)
            if value.pop("outputs_handed", False):  # the forward's outputs came before the backward ran
                value["outputs"] = self.workers[impl.name].progress["outputs"]
            return ImplResult(**value)
        done, forward = failure.partial or {}, failure.progress
        if forward is not None:  # the forward returned and was handed over: the failure is the backward's
            return ImplResult(outputs=forward["outputs"], returned=forward["returned"],
                              bwd_error=done.get("bwd_error") or failure.message, failure=failure.kind)
        if failure.kind == "cuda" and done.get("bwd_error") and not done.get("fwd_error"):
            # the forward returned and the backward faulted: its outputs went with the context
            return ImplResult(fwd_lost="not judged: the forward ran, and its outputs were lost with the CUDA "
                                       "context, which its backward's fault took", bwd_error=done["bwd_error"],
                              failure="cuda")
        return ImplResult(fwd_error=failure.message, failure=failure.kind)

    def close(self) -> None:
        for w in self.workers.values():
            w.stop()
        self.workers.clear()
