"""cuTile mix_aggregate's read-x-once backward (kernels/cutile/mix_backward.py) on a GPU, against the
two passes it replaces and float64:

    python3 dev/mix_once.py check        # small odd shapes and the paper shape: gradients, waits given up
    python3 dev/mix_once.py time [LAGS]  # graph replay, paired: two passes (also with the projection
                                         # backward at 8 worker warps) vs one (LAGS e.g. 2,4,8)
    python3 dev/mix_once.py proj         # proj_rms's backward alone, graph replay: worker warps as
                                         # tileiras picks vs 8
    python3 dev/mix_once.py profile      # each backward's launches under torch.profiler
    python3 dev/mix_once.py handoff      # the smallest cross-program wait (cutile_wait_probe.handoff)
    python3 dev/mix_once.py diag 0,1,4194304 [SxBxNxC [workers|closers]]  # the kernel alone, waits
                                         # giving up after that many polls (default 37x5x4x256): does
                                         # it end, how far it got; optionally one side of it alone

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
        one = grads(leaves, outs, ups, True)  # returns once every launch is queued (compiles done)
        t1 = time.time()
        torch.cuda.synchronize()
        print(f"{shape}: one pass queued in {t1 - t0:.1f} s (compiles), ran in {time.time() - t1:.2f} s", flush=True)
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


def watch(seconds, side, tensors, say):
    """Wait up to ``seconds`` for the work queued so far on the current stream. Each second, copy
    ``tensors`` to the host on ``side`` and print ``say(*copies)``. Copies, not kernels: they run
    beside a kernel that holds every SM. If the work has not ended, say so and end the process:
    a CUDA teardown would wait for the kernel."""
    ended = torch.cuda.Event()
    ended.record()
    host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    t0 = time.time()
    while not ended.query() and time.time() - t0 < seconds:
        time.sleep(1.0)
        with torch.cuda.stream(side):
            for h, t in zip(host, tensors):
                h.copy_(t, non_blocking=True)
        side.synchronize()
        print(f"  {time.time() - t0:5.1f} s: {say(*host)}", flush=True)
    if not ended.query():
        print(f"  not ended after {seconds:.0f} s", flush=True)
        import os
        os._exit(3)


def handoff(seconds=20.0):
    """``dev/cutile_wait_probe.py``'s ``handoff`` kernel: one program raises a flag per token block,
    eight wait for each flag before loading that block's tile. With no wait, with atomic polls (the
    read-x-once kernel's form) and with tile-load polls; each against torch's column sums."""
    from cutile_wait_probe import handoff as kernel
    from kernels.cutile._common import launch
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(512 * 64, 8 * 128, device="cuda", generator=g).bfloat16()
    want = x.float().sum(0)
    side = torch.cuda.Stream()
    for wait, name in ((0, "no wait"), (3, "atomic polls"), (1, "tile-load polls")):
        flags = torch.zeros(512, dtype=torch.int32, device="cuda")
        out = torch.full((8 * 128,), float("nan"), device="cuda")
        t0 = time.time()
        launch(kernel, (9,), (x, flags, out, wait))
        print(f"handoff, {name}: queued in {time.time() - t0:.1f} s", flush=True)
        watch(seconds, side, (flags,), lambda hf: f"flags raised {int((hf > 0).sum())} of 512")
        print(f"  ended; max |out - torch| {float((out - want).abs().max()):.3g} (|torch| max "
              f"{float(want.abs().max()):.3g})", flush=True)


def diag(limits, shape=(37, 5, 4, 256), part="all", seconds=30.0):
    """The read-x-once kernel alone (``mix_backward.start``, no autograd, no launch after it) at
    ``shape``, once for each of ``limits``: every wait gives up after that many polls (0: no wait
    polls at all). While it runs, a copy on another stream reads its flags each second: how many
    token blocks have all their (A) counts, how many a closer has marked done, the waits given up.
    Says whether it ended within ``seconds`` (the first that does not ends the process); where it
    did, dx and dW against the two passes'. A hang at limit 0 is not in the waits.

    ``part``: ``all``; ``workers`` (the workers alone: the closers are not launched); ``closers``
    (no workers: a kernel built for none, whose closers' waits are met at once). With either, the
    gradients are not compared (what the other side writes is missing); limit 0 leaves no wait to
    meet."""
    from kernels.cutile import h_aggregate as cagg
    from kernels.cutile import mapping as cmap
    s, b, n, c = shape
    m = s * b
    x, w, a, hb, g = inputs(*shape)
    workers, closers = once.plan(m, n, c, x.dtype, w.dtype, torch.cuda.get_device_properties(0).multi_processor_count)
    with torch.no_grad():
        (pre, _, _), saved = cmap.forward(x.detach().reshape(m, n * c), w.detach(), a.detach(), hb.detach(), 1e-6)
        g_out = torch.randn(m, c, device="cuda", generator=g).bfloat16()
        g_post = torch.randn(m, n, device="cuda", generator=g)
        g_log = torch.randn(m, n, n, device="cuda", generator=g)
        g_pre = cagg.backward(x.detach(), pre.reshape(s, b, n), g_out.reshape(s, b, c), write_dx=False)[1]
        two = cmap.backward(saved, g_pre.reshape(m, n), g_post, g_log, agg=(pre, g_out))  # the two passes
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        for limit in limits:
            once.SPIN_LIMIT = limit
            t0 = time.time()
            wk, cl, programs = {"all": (workers, closers, None), "workers": (workers, closers, workers),
                                "closers": (0, closers, None)}[part]
            dx, dw, ws, flags, err = once.start(saved, pre, g_out, g_post, g_log, wk, cl, programs)
            print(f"{shape}, {part}: {wk} workers, {cl} closers, {flags.shape[1]} token blocks, SPIN_LIMIT "
                  f"{limit}: queued in {time.time() - t0:.1f} s", flush=True)
            t1 = time.time()
            watch(seconds, side, (flags, err), lambda hf, he: (
                f"blocks with all (A) counts {int((hf[0] == wk).sum())}, counts {int(hf[0].sum())}, "
                f"blocks closed {int(hf[1].sum())}, waits given up {int(he[0])}"))
            print(f"  ended in {time.time() - t1:.3f} s, waits given up {int(err.item())}", flush=True)
            for name, o, t in zip(("dx", "dW"), (dx, dw), two if part == "all" else ()):
                print(f"  {name}: |one - two| {float((o.double() - t.double()).abs().max()):.3g} "
                      f"(two's max {float(t.double().abs().max()):.3g})", flush=True)


if __name__ == "__main__":
    import faulthandler
    faulthandler.dump_traceback_later(90, repeat=True)  # where a stuck run waits: a compile or the device
    what = sys.argv[1] if len(sys.argv) > 1 else "check"
    if what == "check":
        check([(37, 5, 4, 256), (9, 2, 2, 512), (1000, 1, 4, 768), (3, 1, 4, 7168), (8192, 4, 4, 7168)])
    elif what == "handoff":
        handoff()
    elif what == "diag":
        diag([int(v) for v in sys.argv[2].split(",")],
             tuple(int(v) for v in sys.argv[3].split("x")) if len(sys.argv) > 3 else (37, 5, 4, 256),
             sys.argv[4] if len(sys.argv) > 4 else "all")
    elif what == "proj":
        proj()
    elif what == "time":
        timing([int(v) for v in (sys.argv[2] if len(sys.argv) > 2 else "4").split(",")])
    else:
        profile()
