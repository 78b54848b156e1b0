"""Where a gate's first calls go (issue 63): the GPU gate scenario's cases in this one process, one
implementation, each case's profile phases printed; with ``--cprofile N`` also the N functions of
mhctool's, cuTile's and Triton's code that took the most time inside those calls (cumulative).

    python3 dev/first_calls.py cutile [--cprofile 30] [--kernels mhc]

Run it twice in a row on a fresh machine: the first fills the compile caches on disk (Triton's
and cuTile's), the second shows what a process still pays with them warm.

``--devices 0,1,0`` runs every case on GPU 0, then on GPU 1, then on GPU 0 again, in this one
process: what a second GPU's first calls cost once the process has made them on one (the question
behind threads over GPUs in one process, issue 63), against a warm pass."""
import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mhctool.analyses import parity
from mhctool.runner import run as runner  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("impl")
ap.add_argument("--cprofile", type=int, default=0)
ap.add_argument("--dump", default="", help="write the cProfile statistics to this file (pstats)")
ap.add_argument("--kernels", default="mhc")
ap.add_argument("--device", default="cuda")
ap.add_argument("--devices", default="", help="GPU indices, one pass over the cases on each in turn")
ap.add_argument("--scenario", default=str(Path(__file__).resolve().parents[1] / "scenarios" / "gpu-gate.toml"))
a = ap.parse_args()

p = parity.plan(parity.kernels_of(a.kernels.split(",")), [a.impl], device=a.device, scenario=a.scenario)
prof = cProfile.Profile() if a.cprofile else None
t_all = time.perf_counter()
passes = [int(d) for d in a.devices.split(",")] if a.devices else [None]
for gpu in passes:
    if gpu is not None:
        import torch
        torch.cuda.set_device(gpu)
        print(f"--- pass on GPU {gpu}", flush=True)
    t_pass, sums = time.perf_counter(), {}
    for case in p.cases:
        impls = p.impls[case.kernel]
        if prof:
            prof.enable()
        t0 = time.perf_counter()
        res = runner.run_case(case, impls)
        wall = time.perf_counter() - t0
        if prof:
            prof.disable()
        for k, v in res.timings.items():
            sums[k] = sums.get(k, 0.0) + v
        phases = ", ".join(f"{k.split(' (')[0] + (' 1st' if 'first call' in k else '')} {v:.2f}"
                           for k, v in sorted(res.timings.items(), key=lambda kv: -kv[1]) if v >= 0.05)
        bad = sum(1 for r in res.rows if r.get("passed") is False)
        print(f"{case.kernel:17s} {case.dtype:5s} {case.family:12s} {wall:6.2f} s  {phases}"
              + (f"  FAILED {bad}" if bad else ""), flush=True)
    print(f"pass {'' if gpu is None else f'on GPU {gpu} '}{time.perf_counter() - t_pass:.1f} s: "
          + ", ".join(f"{k} {v:.2f}" for k, v in sorted(sums.items(), key=lambda kv: -kv[1]) if v >= 0.05), flush=True)
print(f"all cases {time.perf_counter() - t_all:.1f} s", flush=True)
if "mhctool.kernels.cutile._cache" in sys.modules:  # the disk cache of mhctool's cuTile compilations
    print("cuTile compile cache:", sys.modules["mhctool.kernels.cutile._cache"].stats, flush=True)
if prof:
    st = pstats.Stats(prof)
    if a.dump:
        st.dump_stats(a.dump)
    st.sort_stats("cumulative").print_stats(a.cprofile)
    st.sort_stats("tottime").print_stats(a.cprofile)
