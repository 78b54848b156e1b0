"""What a process's first PyTorch calls on a GPU cost, one step at a time (issue 63: the "native
first call" of every worker). Each step is timed after a synchronize, in a fresh process:

    python3 dev/native_first.py [cpu]      # the steps below, then each again (warm)

The steps: CUDA's context; drawing random numbers; an fp32 and a bf16 matmul (cuBLAS, cuBLASLt);
a float64 matmul; an autograd backward (autograd's device thread); elementwise and reduction
kernels; then mhctool's native mHC kernels forward and backward on a small case."""
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
DEV = sys.argv[1] if len(sys.argv) > 1 else "cuda"


def sync():
    if DEV == "cuda" and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def timed(name, fn):
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    print(f"  {time.perf_counter() - t0:7.3f} s  {name}", flush=True)


def steps():
    from kernels.torch import mhc as native
    yield "context", lambda: torch.zeros(1, device=DEV)
    yield "randn", lambda: torch.randn(1024, device=DEV)
    a = torch.randn(256, 256, device=DEV)
    yield "fp32 matmul", lambda: a @ a
    yield "bf16 matmul", lambda: a.bfloat16() @ a.bfloat16()
    yield "float64 matmul", lambda: a.double() @ a.double()

    def back():
        x = a.clone().requires_grad_()
        (x @ x).sum().backward()
    yield "autograd backward", back
    yield "elementwise, reductions", lambda: (a.exp() / a.sum(-1, keepdim=True)).amax(0).sqrt()

    x = torch.randn(64, 1, 4, 7168, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    h = torch.rand(64, 1, 4, device=DEV, requires_grad=True)

    def agg():
        native.h_aggregate(x, h).float().sum().backward()
    yield "native h_aggregate fwd+bwd (bf16)", agg
    w = torch.randn(24, 4 * 7168, device=DEV, requires_grad=True)
    x2 = x.detach().reshape(64, -1).requires_grad_()

    def proj():
        sum(o.float().sum() for o in native.proj_rms(x2, w)).backward()
    yield "native proj_rms fwd+bwd (bf16 x, fp32 weight)", proj


if __name__ == "__main__":
    for rnd in ("first", "again"):
        print(f"{rnd}:", flush=True)
        t0 = time.perf_counter()
        for name, fn in steps():
            timed(name, fn)
        print(f"  {time.perf_counter() - t0:7.3f} s  all", flush=True)
