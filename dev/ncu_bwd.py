"""One launch of each backward kernel at the paper shape, for Nsight Compute:

    ncu -k regex:"bwd" --section SpeedOfLight --section Occupancy --section WarpStateStats \
        --section MemoryWorkloadAnalysis python3 dev/ncu_bwd.py

(every kernel is launched twice: the first compiles and picks tiles, the profile reads both;
"h_post_bda", "proj_rms" or "cutile" (the cuTile projection backward, ``-k regex:_proj_rms_bwd``)
as the argument runs one). The profiles (eighth, eleventh and twelfth sessions) are in
dev/perf-notes.md."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernels.triton import h_post_bda as hpb  # noqa: E402
from kernels.triton import proj_rms as pr  # noqa: E402

S, B, N, C = 8192, 4, 4, 7168
T, K = S * B, N * C
what = sys.argv[1] if len(sys.argv) > 1 else "all"
g = torch.Generator(device="cuda").manual_seed(0)
if what in ("all", "h_post_bda"):
    x = torch.randn(S, B, N, C, generator=g, device="cuda").to(torch.bfloat16)
    go = torch.randn_like(x)
    y = torch.randn(S, B, C, generator=g, device="cuda").to(torch.bfloat16)
    bias = torch.randn(C, generator=g, device="cuda").to(torch.bfloat16)
    h, hp = torch.rand(S, B, N, N, device="cuda"), torch.rand(S, B, N, device="cuda")
    for _ in range(2):
        hpb.h_post_bda_backward(h, x, hp, y, bias, go)
    del x, go
if what in ("all", "proj_rms", "cutile"):
    x = torch.randn(T, K, generator=g, device="cuda").to(torch.bfloat16)
    w = (torch.randn(24, K, generator=g, device="cuda") / K ** 0.5).to(torch.bfloat16)
    _, r, rms = pr.proj_rms_forward(x, w)
    gp, gr = torch.randn(T, 24, device="cuda"), torch.randn(T, device="cuda")
    if what == "cutile":
        from kernels.cutile import proj_rms as cpr  # needs cuda.tile: imported only when asked for
        dx, dw = torch.empty_like(x), torch.empty_like(w)
    for _ in range(2):
        if what == "cutile":
            cpr.backward_into(x, w, gp, gr, r, rms, dx, dw)
        else:
            pr.proj_rms_backward(x, w, r, rms, gp, gr)
torch.cuda.synchronize()
