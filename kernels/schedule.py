"""The Sinkhorn step schedule and autograd wrapper, shared by the fused backends (Triton, cuTile).

A sequence of ``2 * iters`` normalisations alternates rows and columns from its first axis. The
kernels run it as an optional lone first step (``ODD``, along ``B``) followed by ``PAIRS`` pairs
(``A`` then ``B``), so that every axis is a compile-time constant. Tile axes: a row normalisation
sums over j (axis 2), a column one over i (axis 1).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Callable

import torch

ROW, COL = 2, 1
STABILIZE = {"rowmax": 0, "none": 1, "softmax": 2}


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for a launch's grid, in plain Python: ``triton.cdiv`` is a constexpr function
    in Triton 3.9, whose host call unwraps its arguments (microseconds a launch, on the host's path)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): tile extents are powers of two."""
    return 1 << (max(int(n), 1) - 1).bit_length()


def sinkhorn_steps(n: int, stabilize: str, order: str, iters: int) -> dict:
    first = ROW if order == "row_first" else COL
    steps = 2 * iters
    if stabilize == "softmax" and order == "row_first":
        first, steps = COL, steps - 1  # the softmax was the first row step
    other = ROW + COL - first
    odd = steps % 2 == 1
    # an odd sequence is FIRST, then (OTHER, FIRST) pairs; an even one (FIRST, OTHER) pairs
    a, b = (other, first) if odd else (first, other)
    return dict(NP=next_pow2(n), PAIRS=steps // 2, ODD=odd, A=a, B=b)


def recompute_segment(pairs: int) -> int:
    """Pairs per recomputation segment of the backward: about sqrt(pairs) (4 for 20 iterations).
    Each segment's starting state is recomputed from the logits once and each step's input from
    that state: sum over segments of (start + steps within) instead of pairs^2 / 2."""
    return max(1, int(pairs ** 0.5))


def check_knobs(stabilize: str, eps_mode: str, order: str, iters) -> None:
    if stabilize not in STABILIZE or eps_mode not in ("add", "clamp") or order not in ("row_first", "col_first"):
        raise ValueError(f"unknown knob value: stabilize={stabilize!r}, eps_mode={eps_mode!r}, order={order!r}")
    if int(iters) < 1:
        raise ValueError(f"iters must be at least 1, got {iters}")


def sinkhorn_autograd(forward: Callable, backward: Callable) -> Callable:
    """Megatron's ``sinkhorn(logits[..., n, n], iters, eps, *, stabilize, eps_mode, order)`` over a
    backend's ``forward(logits, *knobs)`` and ``backward(logits, grad_out, *knobs)`` launchers: the
    backward recomputes from the saved logits."""

    class SinkhornFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx, logits, iters, eps, stabilize, eps_mode, order):
            ctx.save_for_backward(logits)
            ctx.knobs = (iters, eps, stabilize, eps_mode, order)
            return forward(logits, iters, eps, stabilize, eps_mode, order)

        @staticmethod
        def backward(ctx, grad_out):
            (logits,) = ctx.saved_tensors
            return (backward(logits, grad_out, *ctx.knobs),) + (None,) * 5

    def sinkhorn(logits, iters: int = 20, eps: float = 1e-6, stabilize: str = "rowmax",
                 eps_mode: str = "add", order: str = "row_first"):
        """Megatron's signature: ``sinkhorn(logits[..., n, n], iters, eps)``, other knobs by keyword."""
        return SinkhornFunction.apply(logits, iters, eps, stabilize, eps_mode, order)

    return sinkhorn


_SIDE_STREAMS: dict = {}
SIDE_STREAM = True  # False: ``beside`` runs the two in order on the current stream (sweeps)


def beside(side: Callable, main: Callable, device: torch.device):
    """``(side(), main())``, with side's launches on a side stream of ``device`` while main's go on
    the current stream: for a small latency-bound kernel (Sinkhorn's backward on 32768 4 x 4
    matrices, 20-35 us with most of the GPU idle) beside a memory-bound one that does not need its
    result. The side stream first waits for the current one, and the current one then waits for
    the side's work, so everything after sees both results; inside a CUDA graph capture the two
    waits are the capture's fork and join. Tensors side returns are marked as used on the current
    stream (the allocator must not hand their memory to the side stream's next allocation while
    the current stream still reads them). Off CUDA (the Triton interpreter), or with ``SIDE_STREAM``
    off, the two run in order on the current stream."""
    if device.type != "cuda" or not SIDE_STREAM:
        return side(), main()
    index = device.index if device.index is not None else torch.cuda.current_device()
    current = torch.cuda.current_stream(index)
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(index)
    stream = _SIDE_STREAMS[index]
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        a = side()
    b = main()
    current.wait_stream(stream)
    if isinstance(a, torch.Tensor):
        a.record_stream(current)
    return a, b


# The pre-path's mapping kept from a forward for its recompute (``recompute_memo``), per thread: a
# recompute runs inside a backward hook, on the autograd engine's device thread
_MEMO = threading.local()


@contextlib.contextmanager
def _holding(local: threading.local, value):
    """``local.at`` is ``value`` inside it, what it was before after."""
    before = getattr(local, "at", None)
    local.at = value
    try:
        yield
    finally:
        local.at = before


def recompute_memo(slot: dict, key: tuple):
    """Inside it, the fused pre-path (each backend's ``mix_aggregate``) keeps its mapping's results
    and Sinkhorn's h_res in ``slot`` under ``key`` (a forward), or takes them from there where an
    earlier call left them under the same key (the recompute of that forward): the recompute then
    reads x once, for the aggregation, and launches neither the mapping nor Sinkhorn. ``key`` is
    the caller's promise that the inputs are the same (a checkpoint's closure: the tensors it
    saved, their versions unchanged); a slot is taken once. Only what is no output is kept: an
    engine may free the outputs' memory between the two calls (Megatron's
    ``CheckpointWithoutOutput`` does), so the forward returns copies of h_post and h_res and keeps
    the tensors it computed."""
    return _holding(_MEMO, (slot, key))


def mapped(compute: Callable[[], tuple], mix: Callable) -> tuple:
    """``((pre, post, logits), saved, h_res)``: the mapping's results as each backend's mapping
    forward returns them (``compute()``) and Sinkhorn's ``mix(logits)``, or the kept ones of the
    forward that this call recomputes (:func:`recompute_memo`). ``post`` and ``h_res`` are never
    tensors that another call returned or will return."""
    at = getattr(_MEMO, "at", None)
    if at is None:
        (pre, post, logits), saved = compute()
        return (pre, post, logits), saved, mix(logits)
    slot, key = at
    if slot.get("key") == key:
        value = slot["value"]
        slot.clear()  # taken once
        return value
    (pre, post, logits), saved = compute()
    h_res = mix(logits)
    slot.clear()
    slot.update(key=key, value=((pre, post, logits), saved, h_res))
    return (pre, post.clone(), logits), saved, h_res.clone()


# The residual's gradient handed from a module call's post-path to its pre-path
# (``ResidualLink``), per thread as the memo is
_LINK = threading.local()


class ResidualLink:
    """One module call's residual gradient, from the post-path's backward to the pre-path's.

    The hyper-connection's n-stream residual feeds two calls of the module: the pre-path (its
    mapping and aggregation) and the post-path (``H_res x``). Autograd sums their two gradients of
    it in a pass of its own (a read of each and a write: 3 n C elements a token). Linked, the
    post-path hands its gradient over (:func:`hand_over`) and the pre-path's backward adds it in
    the pass that writes its own (a read: n C), where its backend takes one (``taker``; Triton's
    ``mix_aggregate``). The pre-path's backward always runs after the post-path's (its h_res and
    h_post gradients come from there); whichever order they run in, a gradient is never lost: the
    pre-path closes the link as it runs (:meth:`take`), and a post-path that finds it closed, or
    no taker, gives its gradient to autograd as before."""

    __slots__ = ("taker", "grad", "open")

    def __init__(self):
        self.taker = False
        self.grad = None
        self.open = True

    def give(self, grad) -> bool:
        """The post-path's gradient kept for the pre-path's backward; False where nothing takes it
        (no taker, or the pre-path's backward has run)."""
        if not (self.taker and self.open):
            return False
        self.grad = grad if self.grad is None else self.grad + grad
        return True

    def take(self):
        """The gradient handed over (None where none was), the link closed: a post-path after this
        gives its gradient to autograd."""
        self.open = False
        grad, self.grad = self.grad, None
        return grad


def residual_link(link: ResidualLink | None):
    """Inside it, a fused pre-path that can add the residual's other gradient in its backward
    (:func:`linked`) takes ``link``'s."""
    return _holding(_LINK, link)


def linked() -> ResidualLink | None:
    """The link a fused pre-path's forward takes (:func:`residual_link`), marked as taken."""
    link = getattr(_LINK, "at", None)
    if link is not None:
        link.taker = True
    return link


class _HandOver(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, link):
        ctx.link = link
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return (None if ctx.link.give(grad) else grad), None


def hand_over(residual: torch.Tensor, link: ResidualLink | None) -> torch.Tensor:
    """``residual`` as the post-path takes it, its gradient handed to ``link``'s pre-path where one
    takes it (:class:`ResidualLink`); ``residual`` itself without a link."""
    return residual if link is None else _HandOver.apply(residual, link)
