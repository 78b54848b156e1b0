"""The time a model spends inside its mHC entry points, forward and backward, measured in place
(``mhctool bench --engine``): each entry point's call is wrapped, not replaced, so the model's
autograd graph and numbers are its own; the step runs under PyTorch's profiler and the time is
read from what it recorded.

- **Forward**: the call runs inside a profiler range of its own; its time is the device time of
  the kernels launched inside it (on a CPU, the range's CPU time). A call made while autograd
  runs a backward is a **recompute** (Megatron's mHC recompute runs the forward again there).
- **Backward**: the autograd nodes the call created (from its outputs back to its inputs, nothing
  before it) are known by their sequence numbers; the profiler records each node's evaluation
  with that number, and the backward's time is the device time of the kernels launched inside
  those evaluations. Autograd may run other nodes between them (it orders ready nodes by creation),
  which a span from first to last would count; the sum of the call's own nodes does not.

Kernel time is the GPU's busy time: time the GPU waits between an entry point's launches (a
launch-bound path) is not in it; it is in the step's time, and so in what the overhead over the
baseline leaves outside the entry points. Where the device waits is recorded apart
(``gap_before``): each gap in the profiled step's device timeline counts for the call whose
launch ended it (the host was late with that kernel). The profiler's own cost on the host widens
every gap, so these say where the device waits, not how long it would without the profiler.

What is wrapped may nest (a module's whole pre-path around the entry points it calls): a kernel
counts for the innermost wrapped call it was launched in, so an outer call's time is what its
inner ones leave (the module's glue). A wrapped call also records the bytes of the tensors it is
given and returns (``{KIND}_bytes``: what it moves at the least, read and written once).
"""
from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager
from typing import Callable

import torch

KINDS = ("fwd", "bwd", "recompute")
PREFIX = "mhctool.entry:"
WHOLE = "*"  # step_end's key for the whole step's busy time
_MAX_NODES = 4096  # a call's graph walked no further (an entry point is a few hundred nodes at most)


def in_backward() -> bool:
    """Whether autograd is running a backward in this thread now (a forward called then is a
    recompute)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


def _tensors(args, kwargs) -> list:
    out = []
    for v in (*args, *kwargs.values()):
        if torch.is_tensor(v):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out += [t for t in v if torch.is_tensor(t)]
    return out


def innermost(containers: list, launches: list) -> dict[tuple[str, str], float]:
    """Each launch's kernel time counted for the innermost container that holds its start (ranges
    on one thread nest): ``containers`` [(start, end, family, kind, call)], ``launches`` [(start,
    ns)]; (family, kind) -> ns. A launch outside every container counts for none."""
    out: dict[tuple[str, str], float] = defaultdict(float)
    cs = sorted(containers, key=lambda c: (c[0], -c[1]))
    stack: list = []
    i = 0
    for at, k in sorted(launches):
        while i < len(cs) and cs[i][0] <= at:
            while stack and stack[-1][1] < cs[i][0]:
                stack.pop()
            stack.append(cs[i])
            i += 1
        while stack and stack[-1][1] < at:
            stack.pop()
        if stack:
            out[(stack[-1][2], stack[-1][3])] += k
    return out


def device_gaps(kernels: list, launch_of: dict) -> tuple[float, dict[int, list]]:
    """The device's gaps: ``kernels`` [(start, end, correlation id)] on every stream (overlaps are
    busy once); a gap, from the end of all that ran before a kernel to its start, counts for the
    launch of that kernel (``launch_of``: correlation id -> (thread, launch start)). Returns the
    gaps' total ns and, per thread, [(launch start, gap ns)] as :func:`innermost` takes launches;
    a gap whose launch is unknown is in the total only."""
    total, out, end = 0.0, defaultdict(list), None
    for start, stop, corr in sorted(kernels):
        if end is not None and start > end:
            total += start - end
            if corr in launch_of:
                thread, at = launch_of[corr]
                out[thread].append((at, start - end))
        end = stop if end is None else max(end, stop)
    return total, dict(out)


def own_times(containers: list) -> dict[tuple[str, str], float]:
    """Each container's own time: its span less that of the containers directly inside it."""
    out: dict[tuple[str, str], float] = defaultdict(float)
    cs = sorted(containers, key=lambda c: (c[0], -c[1]))
    stack: list = []  # [container, time of its children]
    for c in cs:
        while stack and stack[-1][0][1] < c[0]:
            done, inner = stack.pop()
            out[(done[2], done[3])] += done[1] - done[0] - inner
        if stack:
            stack[-1][1] += c[1] - c[0]
        stack.append([c, 0.0])
    for done, inner in stack:
        out[(done[2], done[3])] += done[1] - done[0] - inner
    return out


def own_nodes(outputs: list, inputs: list) -> list:
    """The autograd nodes a call created: from its outputs' nodes back to its inputs' nodes (or
    leaves' accumulators), which are not its own."""
    # the nodes' Python objects held while their ids are compared: a node's object made for one
    # look and freed at once may give its id to the next (the walk then stopped at its first node)
    held = [t.grad_fn for t in inputs if t.grad_fn is not None]
    stop = {id(n) for n in held}
    todo = [n for n in (t.grad_fn for t in outputs) if n is not None and id(n) not in stop]
    seen, nodes = set(), []
    while todo and len(nodes) < _MAX_NODES:
        node = todo.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        nodes.append(node)
        todo += [n for n, _ in node.next_functions
                 if n is not None and id(n) not in stop and type(n).__name__ != "AccumulateGrad"]
    del held
    return nodes


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class EntryTimer:
    """Times the entry points it wraps over the steps run inside :meth:`profiling`; :meth:`step_end`
    gives each one's milliseconds, calls and bytes in that step, by direction (:data:`KINDS`)."""

    def __init__(self, cuda: bool | None = None):
        self.cuda = torch.cuda.is_available() if cuda is None else cuda
        self._prof = None
        # per call: family, kind, its nodes' sequence numbers, the bytes of its tensors in and out
        self._calls: list[tuple[str, str, list[int], int]] = []
        self._last: dict = {}

    def wrap(self, family: str | Callable[..., str], op: Callable) -> Callable:
        """``op`` with its calls timed under ``family`` while a step is profiled (untouched
        otherwise); ``family`` may be a function of the call's arguments that names it (H_post
        applied to y or to the bias)."""

        def timed(*args, **kwargs):
            if self._prof is None:
                return op(*args, **kwargs)
            name = family(*args, **kwargs) if callable(family) else family
            kind = "recompute" if in_backward() else "fwd"
            call = len(self._calls)
            with torch.profiler.record_function(f"{PREFIX}{name}|{kind}|{call}"):
                out = op(*args, **kwargs)
            outs = [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if torch.is_tensor(t)]
            ins = _tensors(args, kwargs)
            seqs = []
            if torch.is_grad_enabled():
                seqs = [n._sequence_nr() for n in own_nodes(outs, ins)]
            self._calls.append((name, kind, seqs, _nbytes(ins) + _nbytes(outs)))
            return out
        timed.__wrapped__ = op
        return timed

    @contextmanager
    def profiling(self):
        """One step's entry points timed: the step runs inside this; :meth:`step_end` reads it."""
        from torch.profiler import ProfilerActivity, profile
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self._calls = []
        with profile(activities=acts) as prof:
            self._prof = prof
            try:
                yield
            finally:
                if self.cuda:
                    torch.cuda.synchronize()
                self._prof = None
        self._last = self._read(prof)

    def _read(self, prof) -> dict[str, dict[str, float]]:
        """The profile's raw events (building the profiler's event tree takes minutes for a large
        model's step): each call's forward range and its own nodes' evaluations are containers; a
        kernel counts for the container its launching op started in (on that op's thread)."""
        events = prof.profiler.kineto_results.events()
        cpu, gpu = torch.autograd.DeviceType.CPU, None if not self.cuda else torch.autograd.DeviceType.CUDA
        ops = [e for e in events if e.device_type() == cpu and e.linked_correlation_id() == 0 and not e.is_async()]
        kernel_ns: dict[int, float] = defaultdict(float)
        busy_ns = 0.0
        for e in events:
            if gpu is not None and e.device_type() == gpu and e.linked_correlation_id() > 0:
                kernel_ns[e.linked_correlation_id()] += e.duration_ns()
                busy_ns += e.duration_ns()
        # (thread, sequence number) -> call; a node an outer call and an inner one both reach (the
        # outer's walk goes through the inner's) is the inner's: calls with fewer nodes first
        owner: dict[tuple[int, int], int] = {}
        threads: dict[int, int] = {}  # call -> the thread its range ran on
        containers: dict[int, list] = defaultdict(list)  # thread -> [(start, end, family, kind, call)]
        for e in ops:
            if e.name().startswith(PREFIX):
                family, kind, call = e.name()[len(PREFIX):].split("|")
                containers[e.start_thread_id()].append((e.start_ns(), e.end_ns(), family, kind, int(call)))
                threads[int(call)] = e.start_thread_id()
        for call in sorted(threads, key=lambda c: len(self._calls[c][2]) if c < len(self._calls) else 0):
            if call < len(self._calls):
                for s in self._calls[call][2]:
                    owner.setdefault((threads[call], s), call)
        for e in ops:
            if e.sequence_nr() >= 0 and e.name().startswith("autograd::engine::evaluate_function"):
                call = owner.get((e.fwd_thread_id(), e.sequence_nr()))
                if call is not None:
                    containers[e.start_thread_id()].append((e.start_ns(), e.end_ns(), self._calls[call][0], "bwd", call))
        ns: dict[tuple[str, str], float] = defaultdict(float)
        calls: dict[tuple[str, str], set] = defaultdict(set)
        for cs in containers.values():
            for start, end, family, kind, call in cs:
                calls[(family, kind)].add(call)
        gap_ns, gap_at = 0.0, defaultdict(float)
        if gpu is not None:
            launches: dict[int, list] = defaultdict(list)  # thread -> [(start, kernel ns)]
            launch_of = {}
            for e in ops:
                k = kernel_ns.get(e.correlation_id())
                if k:
                    launches[e.start_thread_id()].append((e.start_ns(), k))
                    launch_of[e.correlation_id()] = (e.start_thread_id(), e.start_ns())
            for t, cs in containers.items():
                for (family, kind), k in innermost(cs, launches.get(t, [])).items():
                    ns[(family, kind)] += k
            gap_ns, gaps = device_gaps([(e.start_ns(), e.start_ns() + e.duration_ns(), e.linked_correlation_id())
                                        for e in events if e.device_type() == gpu and e.linked_correlation_id() > 0],
                                       launch_of)
            for t, cs in containers.items():
                for (family, kind), g in innermost(cs, gaps.get(t, [])).items():
                    gap_at[f"{family}|{kind}"] += g / 1e6
        if gpu is None:  # on a CPU, each container's own time (what its inner ones leave)
            for cs in containers.values():
                for (family, kind), v in own_times(cs).items():
                    ns[(family, kind)] += v
            # the CPU's busy time: every thread's ops, overlaps counted once
            for t in {e.start_thread_id() for e in ops}:
                end = None
                for a, z in sorted((e.start_ns(), e.end_ns()) for e in ops if e.start_thread_id() == t):
                    if end is None or a > end:
                        busy_ns += z - a
                        end = z
                    elif z > end:
                        busy_ns += z - end
                        end = z
        out: dict[str, dict[str, float]] = defaultdict(dict)
        for (family, kind), c in calls.items():
            out[family][f"{kind}_calls"] = len(c)
            out[family][f"{kind}_ms"] = ns.get((family, kind), 0.0) / 1e6
            if kind != "bwd":  # a call's tensors in and out (the backward's are not seen)
                out[family][f"{kind}_bytes"] = float(sum(self._calls[i][3] for i in c if i < len(self._calls)))
        # the step's whole: the device time of every kernel and copy (the GPU's busy time), or on a
        # CPU every thread's time in ops, the profiler's own cost in it as in the entry points'
        out[WHOLE] = {"busy_ms": busy_ns / 1e6}
        if gpu is not None:  # the device's gaps, and those before a kernel a call launched ("family|kind")
            out[WHOLE].update(gap_ms=gap_ns / 1e6, gap_before=dict(gap_at))
        self._calls = []
        return dict(out)

    def step_end(self) -> dict[str, dict[str, float]]:
        """Per family, the last profiled step's ``{KIND}_ms`` and ``{KIND}_calls``; under
        :data:`WHOLE`, ``busy_ms``: the whole step's kernel time (CPU time on a CPU), and on a GPU
        ``gap_ms`` (the device's gaps in it) and ``gap_before`` (``"family|kind"`` -> the gaps'
        milliseconds before kernels that such calls launched)."""
        last, self._last = self._last, {}
        return last
