"""cuTile's projection forward (proj_rms's, and the mapping's, whose first launch it is) at the paper
shape, bf16, in graph replay and paired rounds, with variants of its tile and hints (issue 42: the
cuTile mapping read 89.6% of copy forward + backward on an H200, thirty-second session):

    python3 dev/cutile_fwd_hints.py ["[((bm, bk), {FLAG: value}), ...]"]
    python3 dev/cutile_fwd_hints.py bwd ["[{FLAG: value}, ...]"]

(FLAG: a ``kernels.cutile.proj_rms`` module flag, e.g. ``FWD_OCCUPANCY``; set every
flag a variant relies on, they persist. Each variant's proj and r are compared with the first's,
bit for bit.) Default: (64, 128) and (128, 128), each without a hint and at occupancy 2.
"bwd": the backward of proj_rms and of the mapping with proj_rms module flags (default
``BWD_OCCUPANCY`` None and 2), dx and dW against the first variant's."""
import ast
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bwd_sweep import paired_rounds  # noqa: E402
from kernels.cutile import mapping as cmap  # noqa: E402
from kernels.cutile import proj_rms as cpr  # noqa: E402
from mhctool.bench import _graphed  # noqa: E402

S, B, N, C = 8192, 4, 4, 7168
T, K = S * B, N * C
g = torch.Generator(device="cuda").manual_seed(0)
x = torch.randn(T, K, generator=g, device="cuda").to(torch.bfloat16)
w = (torch.randn(24, K, generator=g, device="cuda") / K ** 0.5).to(torch.bfloat16)
alpha = torch.tensor([0.8, 1.1, 0.9], device="cuda")
bias = 0.1 * torch.randn(24, device="cuda")
default = [(tile, {"FWD_OCCUPANCY": occ}) for tile in ((64, 128), (128, 128)) for occ in (None, 2)]
variants = ast.literal_eval(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1] != "bwd" else default


backward = sys.argv[1:2] == ["bwd"]
if backward:  # the backward of proj_rms and of the mapping (autograd, graph replay) for flag variants
    variants = ast.literal_eval(sys.argv[2]) if len(sys.argv) > 2 else [
        {"BWD_OCCUPANCY": None}, {"BWD_OCCUPANCY": 2}]
    fs = torch.cuda.Stream()  # the forwards on a side stream: a captured backward runs on its forward's
    fs.wait_stream(torch.cuda.current_stream())
    xr, wr = x.detach().requires_grad_(), w.detach().requires_grad_()
    ar, br = alpha.detach().requires_grad_(), bias.detach().requires_grad_()
    with torch.cuda.stream(fs):
        pouts = cpr.proj_rms(xr, wr, 1e-6)
        mouts = cmap.mapping(xr, wr, ar, br, 1e-6)
    torch.cuda.current_stream().wait_stream(fs)
    pups = [torch.randn_like(o) for o in pouts]
    mups = [torch.randn_like(o) for o in mouts]
    fns, ref = {}, None
    for flags in variants:
        for key, val in flags.items():
            setattr(cpr, key, val)
        try:
            got = torch.autograd.grad(pouts, [xr, wr], pups, retain_graph=True)
            if ref is None:
                ref = got
            print(flags, "dx, dW the same bits as the first:", [torch.equal(a, b) for a, b in zip(got, ref)], flush=True)
            pb = _graphed(lambda: torch.autograd.grad(pouts, [xr, wr], pups, retain_graph=True))
            mb = _graphed(lambda: torch.autograd.grad(mouts, [xr, wr, ar, br], mups, retain_graph=True))
        except Exception as ex:  # noqa: BLE001
            print(flags, "failed:", type(ex).__name__, str(ex).splitlines()[0][:160], flush=True)
            continue
        fns[f"proj_rms bwd {flags}"], fns[f"mapping bwd {flags}"] = pb, mb
    for name, ts in paired_rounds(fns, 7).items():
        print(name, "median ms", round(sorted(ts)[len(ts) // 2], 4), flush=True)
    sys.exit(0)

fns, ref = {}, None
for tile, flags in variants:
    name = f"{tile} {flags}"
    try:
        for key, val in flags.items():
            setattr(cpr, key, val)
        got = cpr.forward(x, w, 1e-6, tile_=tuple(tile))
        if ref is None:
            ref = got
        print(name, "proj, r the same bits as the first:", [torch.equal(a, b) for a, b in zip(got[:2], ref[:2])],
              flush=True)
        pf = _graphed(lambda tile=tuple(tile): cpr.forward(x, w, 1e-6, tile_=tile))
        cpr.FWD_TILE = tuple(tile)  # the mapping's forward takes the module's tile
        mf = _graphed(lambda: cmap.forward(x, w, alpha, bias, 1e-6))
    except Exception as ex:  # noqa: BLE001 - a variant that fails to compile is a line
        print(name, "failed:", type(ex).__name__, str(ex).splitlines()[0][:160], flush=True)
        continue
    fns[f"proj_rms {name}"], fns[f"mapping {name}"] = pf, mf
for name, ts in paired_rounds(fns, 7).items():
    print(name, "median ms", round(sorted(ts)[len(ts) // 2], 4), flush=True)
