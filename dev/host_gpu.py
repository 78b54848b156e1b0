"""Where the host's time goes issuing the fused module path on a GPU (issue 99's step shape).

    python3 dev/host_gpu.py [triton|cutile]

1. Any call that synchronizes with the device (``torch.cuda.set_sync_debug_mode``: a warning names
   it), one module call forward and backward.
2. The host's microseconds to issue each piece (the pre-path, the post-path, the backward), median
   of 20 calls, the device idle between them (synchronized before each piece, so the host time is
   the issuing alone).
3. The launcher's share: every kernel launch (Triton's ``JITFunction.run``, cuTile's
   ``launch``) timed on the host over 10 calls, against the calls' whole host time.
4. cProfile of 10 calls after 3: the functions that take the host's time.
"""
import cProfile
import pstats
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
from step_profile import _inputs  # noqa: E402
from mhctool.analyses.train import module_path  # noqa: E402

backend = sys.argv[1] if len(sys.argv) > 1 else "triton"
ops = module_path.ops(module_path.pieces("impl", backend, {}, "cuda")[0])
x, w, a, hb, bias = _inputs(4096, 1, 4, 2048)


def one(k):
    agg, h_res, h_post = ops["pre_path"](x, w, a, hb)
    out = ops["post_path"](h_res, x, h_post, agg * 1.0, bias, 0.1, 1234, 4294967000 + k * (1 << 20))
    torch.autograd.backward(out, torch.ones_like(out))


for k in range(3):
    one(k)
torch.cuda.synchronize()
torch.cuda.set_sync_debug_mode("warn")
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    one(3)
torch.cuda.set_sync_debug_mode(0)
print(f"{backend}[module]: {len(caught)} synchronizing call(s) in one module call")
for c in caught[:10]:
    print(f"  {c.filename}:{c.lineno}: {str(c.message)[:160]}")

t = {"pre": [], "post": [], "backward": []}
for k in range(20):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    agg, h_res, h_post = ops["pre_path"](x, w, a, hb)
    t1 = time.perf_counter()
    y = agg * 1.0
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    out = ops["post_path"](h_res, x, h_post, y, bias, 0.1, 1234, 4294967000 + k * (1 << 20))
    t3 = time.perf_counter()
    g = torch.ones_like(out)
    torch.cuda.synchronize()
    t4 = time.perf_counter()
    torch.autograd.backward(out, g)
    t5 = time.perf_counter()
    t["pre"].append(t1 - t0)
    t["post"].append(t3 - t2)
    t["backward"].append(t5 - t4)
print("host us to issue, median of 20 (device idle before each): "
      + ", ".join(f"{k} {statistics.median(v) * 1e6:.0f}" for k, v in t.items()))


def timed_launches():
    """Wrap the backend's launch function with a host timer; returns the counters."""
    acc = {"n": 0, "s": 0.0}

    def wrap(fn):
        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                acc["n"] += 1
                acc["s"] += time.perf_counter() - t0
        return timed
    if backend == "triton":  # the kernels' remembered dispatch, and Triton's for any other kernel
        import triton.runtime.jit as jit
        from mhctool.kernels.triton import _common
        jit.JITFunction.run = wrap(jit.JITFunction.run)
        _common._Dispatch.__call__ = wrap(_common._Dispatch.__call__)
    else:
        import kernels.cutile._common as cc
        cc.launch = wrap(cc.launch)
        for mod in list(sys.modules.values()):  # modules that imported launch by name
            if getattr(mod, "__name__", "").startswith("kernels.cutile") and getattr(mod, "launch", None) is not None:
                mod.launch = cc.launch
    return acc


if backend == "triton":  # the kernels' remembered dispatch against Triton's own, host per call:
    from mhctool.kernels.triton import _common  # rounds of 10 calls, off and on interleaved
    rounds = {False: [], True: []}
    for _ in range(6):
        for on in (False, True):
            _common.FAST_LAUNCH = on
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for k in range(10):
                one(k)
            rounds[on].append((time.perf_counter() - t0) / 10)
            torch.cuda.synchronize()
    _common.FAST_LAUNCH = True
    for on, v in rounds.items():
        print(f"remembered dispatch {'on ' if on else 'off'}: host per module call, median of 6 rounds of 10: "
              f"{statistics.median(v) * 1e6:.0f} us (rounds {', '.join(f'{t * 1e6:.0f}' for t in v)})")

acc = timed_launches()
torch.cuda.synchronize()
t0 = time.perf_counter()
for k in range(10):
    one(k)
whole = (time.perf_counter() - t0) / 10
torch.cuda.synchronize()
print(f"host per module call (forward and backward, device running behind): {whole * 1e6:.0f} us; "
      f"{acc['n'] / 10:.0f} launches a call taking {acc['s'] / 10 * 1e6:.0f} us "
      f"({acc['s'] / 10 / max(acc['n'] / 10, 1) * 1e6:.1f} us each)")

torch.cuda.synchronize()
p = cProfile.Profile()
p.runcall(lambda: [one(k) for k in range(10)])
st = pstats.Stats(p)
st.sort_stats("tottime").print_stats(25)
st.sort_stats("cumulative").print_stats(35)
