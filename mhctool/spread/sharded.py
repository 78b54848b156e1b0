"""Parity under data / sequence parallelism: ``mhctool parity --ranks R --grad-reduce fp32|bf16``.

In training each rank holds a slice of the tokens. The gradients of the parameters (the mapping
weight, alpha and the bias of the mapping path; h_post_bda's bias) are sums over every token: each
rank computes its partial sum, and the partials are all-reduced, in fp32 or, where training reduces
gradients in bf16 (Megatron-LM's ``--grad-reduce-in-bf16``), in bf16. A one-process check never
sees that sum.

:func:`run` runs one implementation on one case that way: R processes (started once for the run
and serving every case), joined by ``torch.distributed`` (Gloo on the CPU, NCCL on GPUs, one GPU a
rank); rank r takes the r-th of R slices of the tokens (``torch.tensor_split`` along the first axis
of the token inputs: uneven where R does not divide it), runs the implementation forward and
backward with its slice of the upstream gradients, and all-reduces each parameter gradient (a sum)
in the asked dtype. The
outputs and the token inputs' gradients are each rank's slice, put back in rank order; the
parameter gradients are the reduced ones. The runner judges that against the float64 reference of
the whole batch, with the native implementation run the same sharded way as the baseline, so the
verdict rule asks whether the kernel's partials plus the reduction stay within kappa of PyTorch's
partials plus the same reduction.

On GPUs nothing goes through host memory: this process puts each rank's slice (and a copy of
each parameter) on that rank's GPU and hands it over as a CUDA IPC handle; the ranks hand their
outputs and gradients back the same way, and this process copies them onto its own GPU. (On the
CPU, the tensors travel through host shared memory and each rank cuts its own slice.) A case's
native run is handed to the ranks before this process computes the float64 reference, so the two
overlap where both fit in the device's memory (:func:`submit`, :func:`collect`, :func:`overlaps`).

A rank's process that dies or hangs is a failed row (the case's time limit), as in isolation; the
others are stopped, and the next case starts R new ones.
"""
from __future__ import annotations

import queue
import shutil
import tempfile
import time

import torch
import torch.distributed as dist

from mhctool.core import environment
from mhctool.core.dtypes import FORMATS
from mhctool.core.errors import UsageError
from mhctool.families import get_family
from mhctool.registry.specs import resolve_one
from mhctool.runner.call import leaf_inputs, native_at, run_impl, short_error
from mhctool.runner.case import ImplResult, device_memory, footprint
from mhctool.spread.isolation import adopt_environment, child_context, shared_copy

# kernel -> the inputs that hold tokens along their first axis (the others are parameters, their
# gradients all-reduced); every output of these families holds tokens along its first axis
TOKEN_INPUTS = {
    "proj_rms": ("x2d",),
    "mapping": ("x2d",),
    "mapping_sinkhorn": ("x",),
    "mix_aggregate": ("x",),
    "h_post_bda": ("h_res", "x", "h_post", "y"),
    "h_aggregate": ("x", "h_pre"),
    "sinkhorn": ("logits",),
}
# the dtypes the parameter gradients may be all-reduced in (dtypes.FORMATS names)
REDUCE_FORMATS = ("fp32", "bf16")
# a case's float64 reference beside rank 0's native run on the same device, in reference
# footprints: what a case alone needs (pool.MEMORY_FACTOR, 2) and rank 0's slice on top
OVERLAP_FACTOR = 2.5


class Sharding:
    """``--ranks`` and ``--grad-reduce``, and the rank processes that serve them (started on first
    use, kept for the run's cases, started again after a rank died or hung; :meth:`close`)."""

    def __init__(self, ranks: int, reduce: str = "fp32", device: str = "cpu"):
        self.ranks, self.reduce, self.device = ranks, reduce, device
        self._group: _Group | None = None

    def row(self) -> dict:
        """What each report row records of it."""
        return {"ranks": self.ranks, "grad_reduce": self.reduce}

    def start(self) -> None:
        """Start the rank processes (again, after one died) without waiting for them: they start
        while this process draws the case's inputs; :meth:`group` waits."""
        if self._group is None or not self._group.alive():
            self.close()
            self._group = _Group(self.ranks, self.device)

    def group(self) -> "_Group":
        """The ranks, once every one has joined the process group (or the group broken, and the
        next job says why)."""
        self.start()
        self._group.wait_ready()
        return self._group

    # what the one-case runner calls (it never imports this module): the functions below, bound
    def run(self, kernel: str, impl, base: dict, knobs: dict, upstream: list, timeout: float, **kw):
        return run(kernel, impl, base, knobs, upstream, self, timeout, **kw)

    def submit(self, kernel: str, impl, base: dict, knobs: dict, upstream: list, **kw) -> "Pending":
        return submit(kernel, impl, base, knobs, upstream, self, **kw)

    @staticmethod
    def collect(pending: "Pending", timeout: float):
        return collect(pending, timeout)

    def overlaps(self, case) -> bool:
        return overlaps(case, self)

    def too_few_tokens(self, kernel: str, base: dict) -> str | None:
        return too_few_tokens(kernel, base, self)

    @staticmethod
    def whole_batch_outputs(fam, kernel: str, native, base: dict, knobs: dict) -> list[torch.Tensor]:
        return whole_batch_outputs(fam, kernel, native, base, knobs)

    def close(self) -> None:
        if self._group is not None:
            self._group.stop()
            self._group = None


def parse(ranks: int, reduce: str, kernels: list[str], device: str) -> Sharding | None:
    """``--ranks`` and ``--grad-reduce``: None for one rank; bad values are a UsageError."""
    if reduce not in REDUCE_FORMATS:
        raise UsageError(f"unknown --grad-reduce {reduce!r}; accepted: {', '.join(REDUCE_FORMATS)}")
    if ranks < 1:
        raise UsageError(f"--ranks {ranks}: at least 1")
    if ranks == 1:
        return None
    other = [k for k in kernels if k not in TOKEN_INPUTS]
    if other:
        raise UsageError(f"--ranks splits the tokens of the mHC kernels (--kernel mhc: {', '.join(TOKEN_INPUTS)}); "
                         f"not {', '.join(other)}")
    if device == "cuda" and ranks > torch.cuda.device_count():
        raise UsageError(f"--ranks {ranks} on cuda needs {ranks} GPUs (NCCL takes one GPU a rank); "
                         f"{torch.cuda.device_count()} are visible")
    return Sharding(ranks, reduce, device)


def overlaps(case, sharding: Sharding) -> bool:
    """Whether the ranks' native run and this process's float64 reference may run at once: where
    both fit in the device's memory (at the paper shape, fp32 h_post_bda's reference is 43 GB: on
    an 80 GB GPU they run one after the other)."""
    return OVERLAP_FACTOR * footprint(case) <= 0.9 * device_memory(sharding.device)


def too_few_tokens(kernel: str, base: dict, sharding: Sharding) -> str | None:
    """Why a case cannot be split over the ranks (fewer token rows than ranks), or None."""
    rows = base[TOKEN_INPUTS[kernel][0]].shape[0]
    return None if rows >= sharding.ranks else \
        f"{sharding.ranks} ranks need at least {sharding.ranks} token rows; this case has {rows}"


def whole_batch_outputs(fam, kernel: str, native, base: dict, knobs: dict) -> list[torch.Tensor]:
    """Uninitialised tensors of the whole batch's output shapes and dtypes, from ``native``'s forward
    on the first token row alone: every output holds tokens along its first axis, which the batch's
    token inputs give. A sharded case draws its upstream gradients from them (the same draws as
    from the whole batch's outputs) without running the whole batch in this process."""
    token = TOKEN_INPUTS[kernel]
    rows, device = base[token[0]].shape[0], base[token[0]].device
    # on the CPU: shapes and dtypes do not depend on the device, and a GPU would load its kernels
    first = {k: (None if v is None else (v[:1] if k in token else v).cpu()) for k, v in base.items()}
    with torch.no_grad():
        try:
            outs = list(fam.call(native.fn, leaf_inputs(fam, first), knobs, native.accepts, native.bind))
        except Exception as e:  # noqa: BLE001 - mhctool's own code failed: the case's error
            raise RuntimeError(f"the native {kernel} failed on the first token row: {e}") from e
    return [torch.empty((rows, *o.shape[1:]), dtype=o.dtype, device=device) for o in outs]


def _slice(t: torch.Tensor, rank: int, ranks: int) -> torch.Tensor:
    return torch.tensor_split(t, ranks, dim=0)[rank].contiguous()


class _Group:
    """R processes joined by one process group, each serving jobs from its own queue."""

    def __init__(self, ranks: int, device: str, start_timeout: float = 300.0):
        self.ranks = ranks
        self.folder = tempfile.mkdtemp(prefix="mhctool-ranks-")
        ctx, environ = child_context()  # the ranks fork from a server that imported torch once
        self.jobs = [ctx.Queue() for _ in range(ranks)]
        self.answers = ctx.Queue()
        self.procs = [ctx.Process(target=_serve, args=(r, ranks, self.folder, device, self.jobs[r], self.answers,
                                                       environ), daemon=True) for r in range(ranks)]
        for p in self.procs:
            p.start()
        self.broken, self.why = False, (None, None)
        self.ready = False
        self.start_timeout = start_timeout

    def wait_ready(self) -> None:
        """Every rank says it is ready once its first collective is done: starting the ranks is
        paid here, once, not inside the first case's runs (a rank that died or did not join in
        time leaves the group broken, and the next job says which and why)."""
        if not self.ready and not self.broken:
            self.gather(self.start_timeout)
            self.ready = True

    def alive(self) -> bool:
        return not self.broken and all(p.is_alive() for p in self.procs)

    def send(self, jobs: list[dict]) -> None:
        """Job r to rank r; the answers are :meth:`gather`'s, in the order the jobs were sent."""
        for q, job in zip(self.jobs, jobs):
            q.put(job)

    def gather(self, timeout: float) -> tuple[list | None, str | None, str | None]:
        """One message from every rank, in rank order, or (None, why, failure kind) with the group
        broken: a rank ended, or one had said nothing by ``timeout`` (a broken group says so again)."""
        if self.broken:
            return None, *self.why
        got, why, kind = self._gather(timeout)
        if got is None:
            self.broken, self.why = True, (why, kind)
        return got, why, kind

    def _gather(self, timeout: float) -> tuple[list | None, str | None, str | None]:
        got: dict = {}
        deadline = time.monotonic() + timeout
        while len(got) < self.ranks:
            dead = [r for r, p in enumerate(self.procs) if not p.is_alive() and r not in got]
            if dead:
                return None, (f"rank {dead[0]} of {self.ranks} ended without a result "
                              f"(exit code {self.procs[dead[0]].exitcode})"), "crashed"
            if time.monotonic() > deadline:
                late = min(r for r in range(self.ranks) if r not in got)
                return None, f"rank {late} of {self.ranks} did not finish in {timeout:.0f} s", "timeout"
            try:
                rank, answer = self.answers.get(timeout=0.5)
            except queue.Empty:
                continue
            got[rank] = answer
        return [got[r] for r in range(self.ranks)], None, None

    def stop(self) -> None:
        if not self.broken:
            for q in self.jobs:
                q.put(None)
            for p in self.procs:
                p.join(10)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join()
        shutil.rmtree(self.folder, ignore_errors=True)


def _serve(rank: int, ranks: int, folder: str, device: str, jobs, answers, environ: dict | None = None) -> None:
    """One rank's process: joins the group once, then runs each job it is handed until None."""

    adopt_environment(environ)
    environment.ensure_triton_mode()
    if device != "cpu":
        torch.cuda.set_device(rank)
    dist.init_process_group("gloo" if device == "cpu" else "nccl", init_method=f"file://{folder}/init",
                            rank=rank, world_size=ranks)
    try:
        # a first collective (NCCL makes its communicator here) before the rank says it is ready
        dist.all_reduce(torch.zeros(1, device="cpu" if device == "cpu" else f"cuda:{rank}"))
        answers.put((rank, "ready"))
        while True:
            job = jobs.get()
            if job is None:
                break
            answers.put((rank, _rank_job(rank, ranks, device, job)))
    finally:
        dist.destroy_process_group()


def _rank_job(rank: int, ranks: int, device: str, job: dict) -> dict:
    """One rank's part of a job: its slice forward and backward, the parameter gradients
    all-reduced (by every rank, or by none where one failed). The answer's tensors stay where they
    are: on a GPU they go back as CUDA IPC handles (copies where they are the sender's own
    tensors, which a process cannot hand on), on the CPU through shared memory."""

    kernel, spec, name, native_precision = job["impl"]
    dev = device if device == "cpu" else f"cuda:{rank}"
    fam = get_family(kernel)
    token = TOKEN_INPUTS[kernel]
    received = set()
    try:
        impl = native_at(kernel, native_precision) if native_precision else resolve_one(kernel, spec, name)
    except Exception as e:  # noqa: BLE001 - resolving the implementation failed: its failed row
        res = ImplResult(fwd_error=short_error(e))
    else:
        if job["placed"]:  # this rank's slices and parameters, already on its GPU
            base, ups = job["base"], job["upstream"]
            received = {t.untyped_storage().data_ptr() for t in [*base.values(), *ups] if t is not None}
        else:
            base = {k: (None if v is None else (_slice(v, rank, ranks) if k in token else v).to(dev))
                    for k, v in job["base"].items()}
            ups = [_slice(u, rank, ranks).to(dev) for u in job["upstream"]]
        expect = None
        if job["expect"] is not None:  # the contract's output shapes, each cut to this rank's tokens
            expect = [((len(torch.tensor_split(torch.arange(shape[0]), ranks)[rank]), *shape[1:]), dtype, dev)
                      for shape, dtype, _ in job["expect"]]
        res = run_impl(fam, impl, base, job["knobs"], lambda outs: ups, expect=expect)
    fine = not (res.fwd_error or res.bwd_error or res.bwd_unsupported) and res.grads is not None
    ok = torch.tensor([1 if fine else 0], device=dev)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # every rank reduces, or none does
    reduced = {}
    if ok.item():
        for k, g in res.grads.items():
            if k not in token:
                part = g.to(FORMATS[job["reduce"]].torch_dtype, copy=True).contiguous()
                dist.all_reduce(part)
                reduced[k] = part

    def back(t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        return t.clone() if t.untyped_storage().data_ptr() in received else t

    out = res.to_dict()
    out["outputs"] = None if res.outputs is None else [back(o) for o in res.outputs]
    out["grads"] = None if res.grads is None else {k: back(g) for k, g in res.grads.items() if k in token}
    out["reduced"] = reduced
    if device != "cpu":
        torch.cuda.synchronize()  # the answer is written before this process says it is
    return out


def _placed(kernel: str, base: dict, upstream: list, rank: int, ranks: int) -> dict:
    """Rank ``rank``'s inputs on its own GPU: its slice of the token inputs and of the upstream
    gradients, and a copy of each parameter (new tensors on this process's GPU too: a rank never
    holds this process's own tensors)."""
    dev = torch.device("cuda", rank)
    token = TOKEN_INPUTS[kernel]

    def put(t: torch.Tensor, cut: bool) -> torch.Tensor:
        t = t.detach()
        return (_slice(t, rank, ranks) if cut else t).to(dev, copy=True).contiguous()
    return {"base": {k: None if v is None else put(v, k in token) for k, v in base.items()},
            "upstream": [put(u, True) for u in upstream]}


class Pending:
    """A job handed to the ranks whose answers :func:`collect` waits for."""

    def __init__(self, sharding: "Sharding", group: "_Group", names: list):
        self.sharding, self.group, self.names = sharding, group, names


def submit(kernel: str, impl, base: dict, knobs: dict, upstream: list, sharding: Sharding,
           native_precision: str | None = None, expect: list | None = None) -> Pending:
    """Hand ``impl`` (or, with ``native_precision``, the native implementation at that precision)
    on the case's tokens to the ranks, without waiting for them. ``expect``: the contract's
    (shape, dtype, device) per output of the whole batch (each rank conforms its slice's outputs
    to it, as the runner does)."""
    head = {"impl": (kernel, impl.spec or impl.name, impl.name, native_precision), "knobs": knobs,
            "reduce": sharding.reduce, "expect": expect}
    if sharding.device == "cpu":
        # copies in shared memory: the queue pickles the job in a thread of its own while this process
        # goes on with the case, and pickling a tensor not yet shared moves its storage there
        job = {**head, "placed": False, "base": {k: None if v is None else shared_copy(v.detach().cpu())
                                                 for k, v in base.items()},
               "upstream": [shared_copy(u.detach().cpu()) for u in upstream]}
        jobs = [job] * sharding.ranks
    else:
        jobs = [{**head, "placed": True, **_placed(kernel, base, upstream, r, sharding.ranks)}
                for r in range(sharding.ranks)]
        for r in range(sharding.ranks):  # the copies are written before a rank reads them
            torch.cuda.synchronize(r)
    group = sharding.group()
    group.send(jobs)
    return Pending(sharding, group, list(base))


def collect(pending: Pending, timeout: float):
    """The :class:`runner.ImplResult` of the whole batch (outputs and token gradients joined,
    parameter gradients all-reduced) of a :func:`submit`-ted job, or its failed result."""
    sharding = pending.sharding
    parts, why, kind = pending.group.gather(timeout)
    if parts is None:
        sharding.close()
        return ImplResult(fwd_error=why, failure=kind)
    dev = torch.device(sharding.device)
    for key in ("fwd_error", "bwd_unsupported", "bwd_error"):
        bad = next(((r, p[key]) for r, p in enumerate(parts) if p[key]), None)
        if bad:
            outputs = None if key == "fwd_error" else _joined(parts, dev)[0]
            refused = parts[bad[0]].get("fwd_refused") if key == "fwd_error" else None
            return ImplResult(outputs=outputs, fwd_refused=refused and f"rank {bad[0]}: {refused}",
                              **{key: f"rank {bad[0]}: {bad[1]}"})
    outputs, grads = _joined(parts, dev)
    # copies: a rank's tensor (mapped from its GPU or from shared memory) is freed whatever this process keeps
    grads.update({k: g.to(dev, copy=True) for k, g in parts[0]["reduced"].items()})
    returned = {k: v for p in parts for k, v in p["returned"].items()}
    return ImplResult(outputs=outputs, grads={k: grads[k] for k in pending.names if k in grads}, returned=returned)


def run(kernel: str, impl, base: dict, knobs: dict, upstream: list, sharding: Sharding, timeout: float,
        native_precision: str | None = None, expect: list | None = None):
    """:func:`submit`, then :func:`collect`: ``impl`` on the case's tokens split over
    ``sharding.ranks`` processes, as an :class:`runner.ImplResult` of the whole batch."""
    return collect(submit(kernel, impl, base, knobs, upstream, sharding, native_precision, expect), timeout)


def _joined(parts: list[dict], dev: torch.device) -> tuple[list, dict]:
    """The ranks' outputs and token-input gradients, joined along the token axis in rank order on
    ``dev`` (new tensors: nothing of a rank's is kept)."""
    outputs = [torch.cat([p["outputs"][i].to(dev) for p in parts]) for i in range(len(parts[0]["outputs"]))]
    grads = {}
    if all(p["grads"] for p in parts):
        grads = {k: torch.cat([p["grads"][k].to(dev) for p in parts]) for k in parts[0]["grads"]}
    return outputs, grads
