"""What judging one paper-shape tensor costs on a GPU, piece by piece (issue 63: judging was about
half of the paper scenario's work on an H200, 7.8 of 15.8 s).

    python3 dev/judge_cost.py [--shape 8192x4x7168] [--dtypes bf16,fp32] [--repeats 5]

For each output dtype: an output and a float64 reference near it, then the time of
``metrics.measure`` and of each of its parts (median of the repeats, after one warm-up call),
and the bytes a single pass over the pair moves, to set the time against the copy bandwidth.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from mhctool import metrics

DT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def timed(fn, repeats):
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="8192x4x7168")
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    shape = [int(s) for s in a.shape.split("x")]
    print(torch.cuda.get_device_name(), "shape", shape, "allocator",
          torch.cuda.memory._get_current_allocator_name() if hasattr(torch.cuda.memory, "_get_current_allocator_name") else "")
    g = torch.Generator(device="cuda").manual_seed(0)
    ref = torch.randn(shape, device="cuda", dtype=torch.float64, generator=g)
    for name in a.dtypes.split(","):
        dt = DT[name]
        out = ref.to(dt)
        facts = metrics.reference(ref)
        one_pass = out.numel() * (out.element_size() + 8)  # read the output and the reference once
        parts = {
            "measure (all)": lambda: metrics.measure(out, ref),
            "measure, reference known": lambda: metrics.measure(out, ref, of=facts),
            "reference(ref) (once a ref)": lambda: metrics.reference(ref),
            "_errors (4 error metrics)": lambda: metrics._errors(out, ref),
            "count metrics (3)": lambda: [fn(out, ref) for fn in metrics.COUNT_METRICS.values()],
            "_abs_err": lambda: metrics._abs_err(out, ref),
            "ulp_size": lambda: metrics.ulp_size(ref, metrics.fmt_of(dt)),
            "out.to(float64)": lambda: out.to(torch.float64),
            "isfinite(ref).all()": lambda: bool(torch.isfinite(ref).all()),
            "finite_amax(ref)": lambda: metrics.finite_amax(ref),
            "copy of ref (clone)": lambda: ref.clone(),
        }
        for k, fn in parts.items():
            t = timed(fn, a.repeats)
            print(f"{name:5s} {k:28s} {t * 1e3:8.2f} ms   {one_pass / t / 1e12:6.2f} TB/s-equivalent of one pass")
        out = None  # freed before the next dtype's
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
