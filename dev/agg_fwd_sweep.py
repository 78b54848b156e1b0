"""h_aggregate's forward at the paper shape: mhctool's Triton kernel as shipped (autotuned), at each
tile, and TileKernels' ``mhc_pre_apply_mix_fwd`` when importable; CUDA-graph
replay in paired rounds, the bits checked against the shipped kernel's.

    python3 dev/agg_fwd_sweep.py [SHAPE]      # default 8192x4x4x7168, bf16
"""
import statistics
import sys

import torch
import triton

from mhctool.kernels.triton import h_aggregate as agg
from mhctool.kernels.triton._common import next_pow2

shape = [int(v) for v in (sys.argv[1] if len(sys.argv) > 1 else "8192x4x4x7168").split("x")]
s, b, n, C = shape
T = s * b
x = torch.randn(s, b, n, C, device="cuda", dtype=torch.bfloat16)
h = torch.rand(s, b, n, device="cuda")
ref = agg.h_aggregate_forward(x, h)
variants = {}
for bc in (512, 1024, 2048, 4096):
    for w in (2, 4, 8):
        def run(out, bc=bc, w=w):
            agg._h_aggregate_fwd[(T * triton.cdiv(C, bc),)](x, h, out, C, N=n, NP=next_pow2(n), BLOCK_C=bc, num_warps=w)
        variants[f"tile {bc} w{w}"] = run
try:
    import math

    from tile_kernels.mhc import mhc_pre_apply_mix_fwd
    xv, hv = x.view(T, n, C), h.view(T, n)
    variants["tilekernels"] = lambda out: mhc_pre_apply_mix_fwd(xv, hv, out.view(T, C))
except ImportError as e:
    print("no TileKernels:", e)
graphs, outs, keep = {}, {}, []
for name, fn in variants.items():
    out = torch.empty_like(ref)
    keep.append(out)  # a captured graph writes into it on every replay: it must outlive the loop
    fn(out)
    torch.cuda.synchronize()
    same = torch.equal(out, ref)
    print(f"{name}: same bits {same}", flush=True)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(10):
            fn(out)
    g.replay()
    torch.cuda.synchronize()  # a variant that faults is named above, before the context is lost
    graphs[name], outs[name] = g, same
times = {k: [] for k in graphs}
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
for _ in range(15):
    for name, g in graphs.items():
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times[name].append(start.elapsed_time(end) / 10)
byts = x.numel() * 2 + T * C * 2 + h.numel() * 4
for name, ts in sorted(times.items(), key=lambda kv: statistics.median(kv[1])):
    ms = statistics.median(ts)
    print(f"{name:16s} {ms:.4f} ms  p10 {sorted(ts)[1]:.4f}  {byts / ms / 1e9:.0f} GB/s  same bits: {outs[name]}")
