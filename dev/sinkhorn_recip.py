"""Issue 42, item 2 (cuTile's Sinkhorn backward within 10% of Triton's): the per-token path's
reciprocals correctly rounded (``RoundingMode.RN``, shipped) or as Triton's fp32 ``1.0 / d``
compiles them (``FULL``: ``div.full.f32``, 2 ulp). One mode a process (cuTile compiles a kernel
once per process); run it for each mode, alternating:

    for r in 1 2 3; do for m in rn full; do python3 dev/sinkhorn_recip.py $m; done; done

(a second argument, tile or gather, picks how the per-token path loads and stores, forward and
backward alike: EL_TILE_IO)

Prints the fwd / bwd times (a CUDA graph of 20 launches replayed, per launch: eager timings of one
launch are mostly cuTile's launch overhead; 32768 tokens, n = 4, 20 iterations, fp32) and
the largest relative errors of the output and the gradient against float64, and Triton's times."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bwd_sweep import timed  # noqa: E402
import cuda.tile as ct  # noqa: E402
from kernels.cutile import sinkhorn as cs  # noqa: E402
from kernels.triton import sinkhorn as ts  # noqa: E402
from mhctool.references import mhc as ref  # noqa: E402

mode = sys.argv[1] if len(sys.argv) > 1 else "rn"
io = sys.argv[2] if len(sys.argv) > 2 else "tile"  # the per-token path's loads and stores (EL_TILE_IO)
cs.EL_TILE_IO = (io == "tile",) * 2  # forward and backward alike
cs.RECIP = {"rn": ct.RoundingMode.RN, "full": ct.RoundingMode.FULL, "approx": ct.RoundingMode.APPROX}[mode]
g = torch.Generator(device="cuda").manual_seed(0)
x = torch.randn(8192, 4, 4, 4, generator=g, device="cuda")
go = torch.randn(8192, 4, 4, 4, generator=g, device="cuda")
xd = x.double().requires_grad_()
want = ref.sinkhorn(xd, 20, 1e-6)
(want_g,) = torch.autograd.grad(want, xd, go.double())


def graphed(fn, launches=20):
    """Median time of one launch, from a CUDA graph of ``launches`` replayed."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            fn()
    return timed(graph.replay, 30) / launches


def rel(a, b):
    return float((a.double() - b).abs().max() / b.abs().max())


out = cs.sinkhorn_forward(x, 20, 1e-6)
gr = cs.sinkhorn_backward(x, go, 20, 1e-6)
line = f"cutile {mode} {io}: fwd {graphed(lambda: cs.sinkhorn_forward(x, 20, 1e-6)) * 1e3:.1f} us, " \
       f"bwd {graphed(lambda: cs.sinkhorn_backward(x, go, 20, 1e-6)) * 1e3:.1f} us; " \
       f"err out {rel(out, want):.2e} grad {rel(gr, want_g):.2e}"
tout, tgr = ts.sinkhorn_forward(x, 20, 1e-6), ts.sinkhorn_backward(x, go, 20, 1e-6)
line += f" | triton fwd {graphed(lambda: ts.sinkhorn_forward(x, 20, 1e-6)) * 1e3:.1f} us, " \
        f"bwd {graphed(lambda: ts.sinkhorn_backward(x, go, 20, 1e-6)) * 1e3:.1f} us; " \
        f"err out {rel(tout, want):.2e} grad {rel(tgr, want_g):.2e}"
print(line, flush=True)
