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

A rank's process that dies or hangs is a failed row (the case's time limit), as in isolation; the
others are stopped, and the next case starts R new ones.
"""
from __future__ import annotations

import shutil
import tempfile
import time

import torch

from .dtypes import FORMATS
from .errors import UsageError
from .registry import get_family

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


class Sharding:
    """``--ranks`` and ``--grad-reduce``, and the rank processes that serve them (started on first
    use, kept for the run's cases, started again after a rank died or hung; :meth:`close`)."""

    def __init__(self, ranks: int, reduce: str = "fp32", device: str = "cpu"):
        self.ranks, self.reduce, self.device = ranks, reduce, device
        self._group: _Group | None = None

    def row(self) -> dict:
        """What each report row records of it."""
        return {"ranks": self.ranks, "grad_reduce": self.reduce}

    def group(self) -> "_Group":
        if self._group is None or not self._group.alive():
            self.close()
            self._group = _Group(self.ranks, self.device)
        return self._group

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
    from .runner import _leaf
    token = TOKEN_INPUTS[kernel]
    rows, device = base[token[0]].shape[0], base[token[0]].device
    # on the CPU: shapes and dtypes do not depend on the device, and a GPU would load its kernels
    first = {k: (None if v is None else (v[:1] if k in token else v).cpu()) for k, v in base.items()}
    with torch.no_grad():
        try:
            outs = list(fam.call(native.fn, _leaf(fam, first), knobs, native.accepts, native.bind))
        except Exception as e:  # noqa: BLE001 - mhctool's own code failed: the case's error
            raise RuntimeError(f"the native {kernel} failed on the first token row: {e}") from e
    return [torch.empty((rows, *o.shape[1:]), dtype=o.dtype, device=device) for o in outs]


def _slice(t: torch.Tensor, rank: int, ranks: int) -> torch.Tensor:
    return torch.tensor_split(t, ranks, dim=0)[rank].contiguous()


class _Group:
    """R processes joined by one process group, each serving jobs from its own queue."""

    def __init__(self, ranks: int, device: str, start_timeout: float = 300.0):
        from .isolation import child_context
        self.ranks = ranks
        self.folder = tempfile.mkdtemp(prefix="mhctool-ranks-")
        ctx, environ = child_context()  # the ranks fork from a server that imported torch once
        self.jobs = [ctx.Queue() for _ in range(ranks)]
        self.answers = ctx.Queue()
        self.procs = [ctx.Process(target=_serve, args=(r, ranks, self.folder, device, self.jobs[r], self.answers,
                                                       environ), daemon=True) for r in range(ranks)]
        for p in self.procs:
            p.start()
        self.broken = False
        # every rank says it is ready once its first collective is done: starting the ranks is paid
        # here, once, not inside the first case's runs (a rank that died or did not join in time
        # leaves the group broken, and the next job says which and why)
        self._gather(start_timeout)

    def alive(self) -> bool:
        return not self.broken and all(p.is_alive() for p in self.procs)

    def run(self, job: dict, timeout: float) -> tuple[list | None, str | None, str | None]:
        """Every rank's answer to ``job`` in rank order, or (None, why, failure kind)."""
        for q in self.jobs:
            q.put(job)
        return self._gather(timeout)

    def _gather(self, timeout: float) -> tuple[list | None, str | None, str | None]:
        """One message from every rank, in rank order, or (None, why, failure kind) with the group
        broken: a rank ended, or one had said nothing by ``timeout``."""
        import queue
        got: dict = {}
        deadline = time.monotonic() + timeout
        while len(got) < self.ranks:
            dead = [r for r, p in enumerate(self.procs) if not p.is_alive() and r not in got]
            if dead:
                self.broken = True
                return None, (f"rank {dead[0]} of {self.ranks} ended without a result "
                              f"(exit code {self.procs[dead[0]].exitcode})"), "crashed"
            if time.monotonic() > deadline:
                self.broken = True
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
    import torch.distributed as dist

    from . import environment
    from .isolation import adopt_environment
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
    all-reduced (by every rank, or by none where one failed); CPU tensors back."""
    import torch.distributed as dist

    from .registry import resolve_one
    from .runner import native_at, run_impl
    kernel, spec, name, native_precision = job["impl"]
    dev = device if device == "cpu" else f"cuda:{rank}"
    fam = get_family(kernel)
    token = TOKEN_INPUTS[kernel]
    try:
        impl = native_at(kernel, native_precision) if native_precision else resolve_one(kernel, spec, name)
    except Exception as e:  # noqa: BLE001 - resolving the implementation failed: its failed row
        from .runner import ImplResult, short_error
        res = ImplResult(fwd_error=short_error(e))
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
                part = g.to(FORMATS[job["reduce"]].torch_dtype).contiguous()
                dist.all_reduce(part)
                reduced[k] = part.cpu()
    out = res.to_dict()
    out["outputs"] = None if res.outputs is None else [o.cpu() for o in res.outputs]
    out["grads"] = None if res.grads is None else {k: g.cpu() for k, g in res.grads.items() if k in token}
    out["reduced"] = reduced
    return out


def run(kernel: str, impl, base: dict, knobs: dict, upstream: list, sharding: Sharding, timeout: float,
        native_precision: str | None = None, expect: list | None = None):
    """``impl`` (or, with ``native_precision``, the native implementation at that precision) on the
    case's tokens split over ``sharding.ranks`` processes; an :class:`runner.ImplResult` of the
    whole batch (outputs and token gradients joined, parameter gradients all-reduced). ``expect``:
    the contract's (shape, dtype, device) per output of the whole batch (each rank conforms its
    slice's outputs to it, as the runner does)."""
    from .runner import ImplResult
    job = {"impl": (kernel, impl.spec or impl.name, impl.name, native_precision),
           "base": {k: None if v is None else v.detach().cpu() for k, v in base.items()},
           "upstream": [u.detach().cpu() for u in upstream], "knobs": knobs, "reduce": sharding.reduce,
           "expect": expect}
    parts, why, kind = sharding.group().run(job, timeout)
    if parts is None:
        sharding.close()
        return ImplResult(fwd_error=why, failure=kind)
    dev = sharding.device if sharding.device == "cpu" else "cuda"
    for key in ("fwd_error", "bwd_unsupported", "bwd_error"):
        bad = next(((r, p[key]) for r, p in enumerate(parts) if p[key]), None)
        if bad:
            outputs = None if key == "fwd_error" else _joined(parts, dev)[0]
            refused = parts[bad[0]].get("fwd_refused") if key == "fwd_error" else None
            return ImplResult(outputs=outputs, fwd_refused=refused and f"rank {bad[0]}: {refused}",
                              **{key: f"rank {bad[0]}: {bad[1]}"})
    outputs, grads = _joined(parts, dev)
    grads.update({k: g.to(dev) for k, g in parts[0]["reduced"].items()})
    returned = {k: v for p in parts for k, v in p["returned"].items()}
    return ImplResult(outputs=outputs, grads={k: grads[k] for k in base if k in grads}, returned=returned)


def _joined(parts: list[dict], dev: str) -> tuple[list, dict]:
    """The ranks' outputs and token-input gradients, joined along the token axis in rank order."""
    outputs = [torch.cat([p["outputs"][i] for p in parts]).to(dev) for i in range(len(parts[0]["outputs"]))]
    grads = {}
    if all(p["grads"] for p in parts):
        grads = {k: torch.cat([p["grads"][k] for p in parts]).to(dev) for k in parts[0]["grads"]}
    return outputs, grads
