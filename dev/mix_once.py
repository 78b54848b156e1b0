"""cuTile mix_aggregate's read-x-once backward (kernels/cutile/mix_backward.py) on a GPU, against the
two passes it replaces and float64:

    python3 dev/mix_once.py check        # small odd shapes and the paper shape: gradients, waits given up
    python3 dev/mix_once.py time [LAGS]  # graph replay, paired: two passes (also with the projection
                                         # backward at 8 worker warps) vs one (LAGS e.g. 2,4,8)
    python3 dev/mix_once.py proj         # proj_rms's backward alone, graph replay: worker warps as
                                         # tileiras picks vs 8
    python3 dev/mix_once.py profile      # each backward's launches under torch.profiler

Inputs as the bench makes them (bf16 x and W, fp32 alpha and bias), upstream gradients random.
"""
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bwd_sweep import paired_rounds  # noqa: E402
from kernels.cutile import mix_aggregate as cmx, mix_backward as once  # noqa: E402
from mhctool import cuda_context  # noqa: E402


def inputs(s, b, n, c, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    nr = n * n + 2 * n
    x = torch.randn(s, b, n, c, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (torch.randn(nr, n * c, device="cuda", generator=g) / (n * c) ** .5).bfloat16().requires_grad_()
    a = torch.tensor([0.8, 1.1, 0.9], device="cuda", requires_grad=True)
    hb = (0.1 * torch.randn(nr, device="cuda", generator=g)).requires_grad_()
    return x, w, a, hb, g


def grads(leaves, outs, ups, one_pass):
    old, cmx.ONE_PASS = cmx.ONE_PASS, one_pass
    try:
        return torch.autograd.grad(outs, leaves, ups, retain_graph=True)
    finally:
        cmx.ONE_PASS = old


def check(shapes):
    from mhctool.references import mhc as ref
    for shape in shapes:
        s, b, n, c = shape
        x, w, a, hb, g = inputs(*shape)
        leaves = [x, w, a, hb]
        outs = cuda_context.bound(list(cmx.mix_aggregate(x, w, a, hb)))  # the context on autograd's thread
        ups = [torch.randn(o.shape, device="cuda", generator=g).to(o.dtype) for o in outs]
        plan = once.plan(s * b, n, c, x.dtype, w.dtype, torch.cuda.get_device_properties(0).multi_processor_count)
        t0 = time.time()
        one = grads(leaves, outs, ups, True)
        err = int(once.LAST_ERR.item()) if plan else None
        again = grads(leaves, outs, ups, True)
        two = grads(leaves, outs, ups, False)
        dd = [t.detach().double().requires_grad_() for t in leaves]
        want = torch.autograd.grad(ref.mix_aggregate(*dd), dd, [u.double() for u in ups])
        print(f"{shape} plan {plan} waits given up {err} ({time.time() - t0:.1f} s)", flush=True)
        for name, o, o2, tw, wt in zip(("dx", "dW", "dalpha", "dbias"), one, again, two, want):
            e1 = float((o.double() - wt).abs().max() / wt.abs().max())
            e2 = float((tw.double() - wt).abs().max() / wt.abs().max())
            print(f"  {name}: one pass {e1:.2e}, two passes {e2:.2e} (relative to float64's max), "
                  f"|one - two| {float((o.double() - tw.double()).abs().max()):.3g}, finite {bool(torch.isfinite(o).all())}, "
                  f"same bits twice {torch.equal(o, o2)}", flush=True)


def paper():
    x, w, a, hb, g = inputs(8192, 4, 4, 7168)
    fs = torch.cuda.Stream()
    fs.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(fs):  # autograd runs a backward op on its forward's stream
        outs = cuda_context.bound(list(cmx.mix_aggregate(x, w, a, hb)))
    torch.cuda.current_stream().wait_stream(fs)
    ups = [torch.randn(o.shape, device="cuda", generator=g).to(o.dtype) for o in outs]
    return [x, w, a, hb], outs, ups


def timing(lags):
    from mhctool.bench import _graphed
    leaves, outs, ups = paper()

    from kernels.cutile import proj_rms as cpr

    def variant(one_pass, lag=None, warps=None):
        def run():
            old = once.LAG, cpr.BWD_WORKER_WARPS
            once.LAG = old[0] if lag is None else lag
            cpr.BWD_WORKER_WARPS = warps
            try:
                grads(leaves, outs, ups, one_pass)
            finally:
                once.LAG, cpr.BWD_WORKER_WARPS = old
        return run

    fns = {"two passes": variant(False), "two passes, projection backward at 8 worker warps": variant(False, warps=8),
           **{f"one pass, LAG {lag}": variant(True, lag) for lag in lags}}
    ok = {}
    for name, fn in fns.items():
        try:
            t0 = time.time()
            fn()
            torch.cuda.synchronize()
            print(name, f"first run {time.time() - t0:.1f} s, waits given up {int(once.LAST_ERR.item()) if 'one' in name else '-'}",
                  flush=True)
            ok[name] = _graphed(fn)
        except Exception as ex:  # noqa: BLE001
            print(name, "failed:", type(ex).__name__, str(ex).splitlines()[0][:200], flush=True)
    for name, ts in paired_rounds(ok, 7).items():
        print(f"{name}: median {sorted(ts)[len(ts) // 2]:.3f} ms (graph replay)", flush=True)


def proj():
    """proj_rms's cuTile backward alone at the paper shape, worker warps as declared vs 8."""
    from kernels.cutile import proj_rms as cpr
    from mhctool.bench import _graphed
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(32768, 28672, device="cuda", generator=g).bfloat16()
    w = (torch.randn(24, 28672, device="cuda", generator=g) / 28672 ** .5).bfloat16()
    gp, gr = torch.randn(32768, 24, device="cuda", generator=g), torch.randn(32768, device="cuda", generator=g)
    _, r, rms = cpr.forward(x, w, 1e-6)
    dx, dw = torch.empty_like(x), torch.empty_like(w)
    outs = {}

    def variant(warps):
        def run():
            old, cpr.BWD_WORKER_WARPS = cpr.BWD_WORKER_WARPS, warps
            try:
                cpr.backward_into(x, w, gp, gr, r, rms, dx, dw)
            finally:
                cpr.BWD_WORKER_WARPS = old
        return run

    fns = {}
    for warps in (None, 8):
        variant(warps)()
        outs[warps] = (dx.clone(), dw.clone())
        fns[f"worker warps {warps}"] = _graphed(variant(warps))
    print("same bits:", all(torch.equal(a, b) for a, b in zip(outs[None], outs[8])), flush=True)
    for name, ts in paired_rounds(fns, 9).items():
        print(f"proj_rms backward, {name}: median {sorted(ts)[len(ts) // 2]:.3f} ms (graph replay)", flush=True)


def profile():
    from torch.profiler import ProfilerActivity, profile as prof_
    leaves, outs, ups = paper()
    for one_pass in (False, True):
        grads(leaves, outs, ups, one_pass)
        torch.cuda.synchronize()
        with prof_(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                grads(leaves, outs, ups, one_pass)
            torch.cuda.synchronize()
        print(f"--- one pass {one_pass}: device us per backward, by kernel", flush=True)
        rows = [(e.device_time_total / 5, e.count // 5, e.key) for e in prof.key_averages() if e.device_time_total > 0]
        for us, cnt, key in sorted(rows, reverse=True)[:10]:
            print(f"  {us:9.1f} us  x{cnt}  {key[:90]}", flush=True)


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "check"
    if what == "check":
        check([(37, 5, 4, 256), (9, 2, 2, 512), (1000, 1, 4, 768), (3, 1, 4, 7168), (8192, 4, 4, 7168)])
    elif what == "proj":
        proj()
    elif what == "time":
        timing([int(v) for v in (sys.argv[2] if len(sys.argv) > 2 else "4").split(",")])
    else:
        profile()
