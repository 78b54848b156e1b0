"""What --isolate costs per call at the paper shape: h_post_bda's bf16 inputs and output through a
worker process, by each transport (shm: CUDA IPC on a GPU; host: through host shared memory;
file: torch.save in /dev/shm), against the same call in-process. On a machine without a GPU it
measures the host path at a quarter of the shape. Run on the GPU machine: python3 dev/isolation_cost.py"""
import time

import torch

from mhctool.spread.isolation import TRANSPORTS, Worker
from mhctool.kernels.torch.mhc import h_post_bda


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main():
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    s, b, n, c = (8192 if dev == "cuda" else 2048), 4, 4, 7168
    args = (torch.randn(s, b, n, n, device=dev), torch.randn(s, b, n, c, device=dev, dtype=torch.bfloat16),
            torch.randn(s, b, n, device=dev), torch.randn(s, b, c, device=dev, dtype=torch.bfloat16))
    gb_in = sum(t.numel() * t.element_size() for t in args) / 1e9
    gb_out = args[1].numel() * 2 / 1e9
    h_post_bda(*args)
    _sync()
    direct = []
    for _ in range(3):
        t0 = time.perf_counter()
        h_post_bda(*args)
        _sync()
        direct.append(time.perf_counter() - t0)
    direct = min(direct)
    print(f"{dev}, {s}x{b}x{n}x{c}: in-process {direct * 1e3:.1f} ms; {gb_in:.2f} GB in, {gb_out:.2f} GB out")
    for transport in TRANSPORTS:
        t0 = time.perf_counter()
        with Worker(transport) as w:
            w.call("torch:zeros", (1,))
            start = time.perf_counter() - t0
            times = []
            for _ in range(4):
                t0 = time.perf_counter()
                value, failure = w.call("mhctool.kernels.torch.mhc:h_post_bda", args)
                _sync()
                times.append(time.perf_counter() - t0)
                assert failure is None, failure
                del value
        best = min(times[1:])  # the first call compiles nothing but maps and warms the worker's allocator
        print(f"{transport}: worker start {start:.1f} s; per call {best * 1e3:.1f} ms (first {times[0] * 1e3:.0f} ms), "
              f"{(best - direct) * 1e3:+.1f} ms over in-process")


if __name__ == "__main__":  # the workers are spawned: they import this file
    main()
