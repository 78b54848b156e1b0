"""Launches for Nsight Compute's stall reasons (issue 42): the Triton projection backward, and
cuTile's h_post_bda forward and backward beside Triton's, at the paper shape, bf16, each
launched twice (the twenty-third session's profiles, dev/perf-notes.md, also launched the
C-block candidate that has shipped since):

    ncu --clock-control none -k regex:"_proj_rms_bwd_packed|_h_post_bda" --launch-skip 0 \\
        --section SpeedOfLight --section Occupancy --section LaunchStats \\
        --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio \\
        python3 dev/ncu_stalls.py [proj|agg|agg-orders|agg-warps|agg-forms|hpb|all]

("agg": the projection backward with mix_aggregate's aggregation term, Triton's and cuTile's
(``-k regex:_proj_rms_bwd``), as mix_aggregate's backward launches them; "agg-orders": cuTile's
alone, its programs in the plain order and then with the streams side by side, ``GROUP_STREAMS``;
"agg-warps": cuTile's alone with tileiras's worker warps and then with eight, ``AGG_WORKER_WARPS``;
"agg-forms": cuTile's alone, a program per K block and then a program per channel block of the n
streams, ``AGG_STREAMS``, each with tileiras's worker warps: ``-k regex:_proj_rms_bwd``.)

(a stall ratio is the warps stalled for that reason per issued instruction: their sum is the
cycles between a warp's instructions, the figure to lower)."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bwd_sweep import hpb_inputs  # noqa: E402 - the sweeps' inputs

S, B, N, C = 8192, 4, 4, 7168
what = sys.argv[1] if len(sys.argv) > 1 else "all"


def proj_inputs():
    """The projection backward's inputs at the paper shape, bf16: ``(x, w, r, rms, g_proj, g_r)``."""
    from kernels.triton import proj_rms as pr
    T, K = S * B, N * C
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(T, K, generator=g, device="cuda").to(torch.bfloat16)
    w = (torch.randn(24, K, generator=g, device="cuda") / K ** 0.5).to(torch.bfloat16)
    _, r, rms = pr.proj_rms_forward(x, w)
    return x, w, r, rms, torch.randn(T, 24, device="cuda"), torch.randn(T, device="cuda")


if what in ("all", "proj"):
    from kernels.triton import proj_rms as pr
    x, w, r, rms, gp, gr = proj_inputs()
    for _ in range(2):
        pr.proj_rms_backward(x, w, r, rms, gp, gr)
    del x
if what in ("all", "agg", "agg-orders", "agg-warps", "agg-forms"):
    from kernels.cutile import proj_rms as cpr
    from kernels.triton import proj_rms as pr
    x, w, r, rms, gp, gr = proj_inputs()
    T = x.shape[0]
    agg = (torch.rand(T, N, device="cuda"), torch.randn(T, C, device="cuda").to(torch.bfloat16))
    dx, dw = torch.empty_like(x), torch.empty_like(w)
    # cuTile's packed gradient, as its mapping backward writes it for mix_aggregate
    gc = torch.empty(T, cpr._ng(24), device="cuda")
    cpr.launch(cpr._pack_grad, (cpr.cdiv(T, cpr.BM_PACK),), (x, gp, gr, r, rms, gc, 24, cpr._ng(24), cpr.BM_PACK))
    if what == "agg-orders":  # cuTile's kernel in the plain order, then the streams side by side
        for group in (False, True):
            cpr.GROUP_STREAMS = group
            cpr.backward_packed(x, w, gc, dx, dw, agg=agg)
    elif what == "agg-forms":  # cuTile's kernel a program per K block, then per channel block of the streams
        cpr.AGG_WORKER_WARPS = None
        for streams in (False, True):
            cpr.AGG_STREAMS = streams
            cpr.backward_packed(x, w, gc, dx, dw, agg=agg)
    elif what == "agg-warps":  # cuTile's kernel with tileiras's worker warps, then with eight
        for warps in (None, 8):
            cpr.AGG_WORKER_WARPS = warps
            cpr.backward_packed(x, w, gc, dx, dw, agg=agg)
    else:
        for _ in range(2):
            pr.proj_rms_backward(x, w, r, rms, gp, gr, agg=agg)
            cpr.backward_packed(x, w, gc, dx, dw, agg=agg)
    del x
if what in ("all", "hpb"):
    from kernels.cutile import h_post_bda as chp
    from kernels.triton import h_post_bda as thp
    h, x, hp, y, bias, go = hpb_inputs(S, B, C)
    req = [t.detach().requires_grad_() for t in (h, x, hp, y, bias)]
    for _ in range(2):
        out = chp.h_post_bda(*req)
        torch.autograd.grad(out, req, go)
        thp.h_post_bda_forward(h, x, hp, y, bias)
        thp.h_post_bda_backward(h, x, hp, y, bias, go)
torch.cuda.synchronize()
