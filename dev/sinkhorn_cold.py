"""Sinkhorn's backward at 32768 tokens (n = 4, fp32 logits, 20 iterations) with its inputs in L2
(the bench replays it back to back) and cold (a 512 MB write between launches, as in
mix_aggregate's backward, where the logits were written long before): device time per kernel
under torch.profiler, Triton's and cuTile's, 20 launches each.

    python3 dev/sinkhorn_cold.py [EL_TILE_IO as "(True, False)"]

(cuTile's per-token path reads each token block's entries as one tile or by a gather per entry,
``sinkhorn.EL_TILE_IO`` = (forward, backward); it is read when the kernel compiles, so a setting
needs its own process.)"""
import ast
import hashlib
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernels.cutile import sinkhorn as cs  # noqa: E402
from kernels.triton import sinkhorn as ts  # noqa: E402

if len(sys.argv) > 1:
    cs.EL_TILE_IO = tuple(ast.literal_eval(sys.argv[1]))
g = torch.Generator(device="cuda").manual_seed(0)
x = torch.randn(8192, 4, 4, 4, device="cuda", generator=g)
up = torch.randn(8192, 4, 4, 4, device="cuda", generator=g)
junk = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
for name, fn in (("triton", ts.sinkhorn_backward), ("cutile", cs.sinkhorn_backward)):
    ref = fn(x, up)
    for cold in (False, True):
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                if cold:
                    junk.fill_(1)
                fn(x, up)
            torch.cuda.synchronize()
        us = [e.device_time_total / e.count for e in prof.key_averages() if "sinkhorn" in e.key and e.count]
        print(f"{name} EL_TILE_IO={cs.EL_TILE_IO} {'cold' if cold else 'warm'}: {us[0]:.1f} us a launch", flush=True)
    # the gradient's bits, to compare the settings' processes
    print(f"{name} gradient sha1 {hashlib.sha1(ref.cpu().numpy().tobytes()).hexdigest()[:16]}", flush=True)
