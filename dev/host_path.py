"""The host's own Python on the fused mHC path, kernels not launched (CPU; no GPU needed).

    python3 dev/host_path.py [--prof]

The module path as ``bench --engine`` swaps it in (``triton[module]``: the pre-path, then the
post-path with dropout 0.1), forward and backward at a small shape, with every Triton launch made a
no-op after the kernels are picked: what is left is mhctool's and autograd's Python between the
launches (argument binding, checks, allocations, grids), which on the GPU adds to Triton's own
launch cost. At issue 99's step the module path runs about 200 times a step in each direction and
its kernels take tens of microseconds, so this time decides whether the GPU waits on the host.
Prints the minimum and first quartile over 600 calls; ``--prof`` the functions that take it.
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton.runtime.interpreter as interp  # noqa: E402
import triton.runtime.jit as jit  # noqa: E402

from mhctool.analyses.train import module_path  # noqa: E402


def main() -> None:
    calls, _ = module_path.pieces("impl", "triton", {}, "cpu")  # picks (and probes) with launches on
    ops = module_path.ops(calls)
    no_launch = lambda self, grid: (lambda *a, **k: None)  # noqa: E731
    jit.KernelInterface.__getitem__ = no_launch
    interp.InterpretedFunction.__getitem__ = no_launch
    s, b, n, c = 64, 1, 4, 64
    x = torch.randn(s, b, n, c).bfloat16().requires_grad_()
    nh = n * n + 2 * n
    w = (torch.randn(nh, n * c) / (n * c) ** 0.5).bfloat16().requires_grad_()
    a = torch.tensor([0.8, 1.1, 0.9], requires_grad=True)
    hb = (0.1 * torch.randn(nh)).requires_grad_()
    bias = (0.1 * torch.randn(c)).bfloat16().requires_grad_()

    def forward():
        agg, h_res, h_post = ops["pre_path"](x, w, a, hb)
        return ops["post_path"](h_res, x, h_post, agg, bias, 0.1, 1234, 5)

    def loop(k):
        fwd, bwd = [], []
        for _ in range(k):
            t0 = time.perf_counter()
            out = forward()
            t1 = time.perf_counter()
            out.backward(torch.ones_like(out))
            fwd.append(t1 - t0)
            bwd.append(time.perf_counter() - t1)
        return fwd, bwd

    loop(5)
    if "--prof" in sys.argv:
        import cProfile
        import pstats
        prof = cProfile.Profile()
        prof.runcall(loop, 200)
        pstats.Stats(prof).sort_stats("tottime").print_stats(20)
        return
    fwd, bwd = loop(600)
    q = lambda v: f"{min(v) * 1e6:.0f} / {statistics.quantiles(v, n=4)[0] * 1e6:.0f}"  # noqa: E731
    print(f"triton[module], launches off, min / p25 a call: forward {q(fwd)} us, backward {q(bwd)} us")


if __name__ == "__main__":
    main()
