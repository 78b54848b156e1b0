"""One tensor's errors across reports, side by side (issue 63's division experiment):

    python3 dev/grad_table.py grad_h_bias out/div-full.parquet out/div-rn.parquet ...

A line per case (kernel, family, shape, ranks): PyTorch's rel_l2, then each report's rel_l2 of the
implementation under test with the verdict's threshold, and the worst value/threshold."""
import math
import sys

import pyarrow.parquet as pq

tensor, paths = sys.argv[1], sys.argv[2:]
cols, worst = {}, {}
for p in paths:
    for r in pq.read_table(p).to_pylist():
        if r["tensor"] != tensor or r["metric"] != "rel_l2":
            continue
        key = (r["kernel"], r["family"], r["shape"], r["ranks"])
        if r["impl"] == "torch":
            cols.setdefault(key, {})["torch"] = r["value"]
        else:
            cols.setdefault(key, {})[p] = (r["value"], r["threshold"])
            if r["threshold"]:
                worst[p] = max(worst.get(p, 0.0), r["value"] / r["threshold"])
print(f"{tensor} rel_l2: torch | " + " | ".join(paths))
for key in sorted(cols, key=str):
    row = cols[key]
    cells = [f"{row[p][0]:.3g} (thr {row[p][1]:.3g})" if p in row else "-" for p in paths]
    t = row.get("torch", math.nan)
    print(" ".join(map(str, key)), f"| {t:.3g} |", " | ".join(cells))
print("worst value/threshold:", {p: round(v, 3) for p, v in worst.items()})
