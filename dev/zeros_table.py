"""The num-zeros of a `mhctool train` report per trajectory and step, and where they are: the
parameters whose gradients' zero counts change from step to step (what a two-level series is
made of). Usage: python3 dev/zeros_table.py REPORT.parquet"""
import sys

import pyarrow.parquet as pq

rows = pq.read_table(sys.argv[1]).to_pylist()
runs = list(dict.fromkeys(r["run"] for r in rows if r["metric"] == "num-zeros"))
series = {run: {r["step"]: r["value"] for r in rows if r["run"] == run and r["metric"] == "num-zeros"} for run in runs}
steps = sorted(set().union(*series.values()))
print("num-zeros per step:")
for run in runs:
    vals = [series[run].get(k) for k in steps]
    print(f"  {run:10s}", " ".join("-" if v is None else f"{v:.0f}" for v in vals))
for run in runs:
    per = {}
    for r in rows:
        if r["run"] == run and r["metric"].startswith("zeros:"):
            per.setdefault(r["metric"][6:], {})[r["step"]] = r["value"]
    moving = {p: v for p, v in per.items() if len(set(v.values())) > 1 or len(v) != len(steps)}
    print(f"{run}: zeros by parameter (min / max over steps; those that change):",
          ", ".join(f"{p} {min(v.values()):.0f}/{max(v.values()):.0f}" for p, v in sorted(moving.items())) or "none")
for r in rows:
    if r["metric"].startswith("drift:") or r["metric"] in ("nonfinite", "error"):
        print(f"{r['run']} {r['metric']}: passed={r['passed']} {r['message']}")
largest = {}
for r in rows:
    if r["metric"] == "largest logit" and r["run"] in ("impl", "reference"):
        largest[r["run"]] = max(largest.get(r["run"], 0.0), r["value"])
print("largest Sinkhorn logit:", largest)
