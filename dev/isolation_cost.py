"""What --isolate costs per case at the paper shape: h_post_bda's bf16 inputs and output through a
worker process, by each transport, against the same call in-process (GPU machine)."""
import time

import torch

from mhctool.isolation import Worker
from mhctool.kernels.torch.mhc import h_post_bda


def main():
    s, b, n, c = 8192, 4, 4, 7168
    args = (torch.randn(s, b, n, n, device="cuda"), torch.randn(s, b, n, c, device="cuda", dtype=torch.bfloat16),
            torch.randn(s, b, n, device="cuda"), torch.randn(s, b, c, device="cuda", dtype=torch.bfloat16))
    gb_in = sum(t.numel() * t.element_size() for t in args) / 1e9
    h_post_bda(*args)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    h_post_bda(*args)
    torch.cuda.synchronize()
    direct = time.perf_counter() - t0
    for transport in ("shm", "file"):
        t0 = time.perf_counter()
        with Worker(transport) as w:
            w.call("torch:zeros", (1,))
            start = time.perf_counter() - t0
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                value, failure = w.call("mhctool.kernels.torch.mhc:h_post_bda", args)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
                assert failure is None, failure
                del value
        print(f"{transport}: worker start {start:.1f} s; per call {min(times):.2f} s (in-process {direct:.3f} s) "
              f"moving {gb_in:.2f} GB of inputs and {args[1].numel() * 2 / 1e9:.2f} GB of output")


if __name__ == "__main__":  # the workers are spawned: they import this file
    main()
