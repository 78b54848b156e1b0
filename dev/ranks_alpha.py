"""Issue 43: what the all-reduce's dtype does to the parameter gradients of the mapping path.

For R in (1, 2, 4, 8) and each reduce dtype, `mhctool parity --kernel mapping --ranks R` on one
random case (Gloo on the CPU, NCCL on GPUs); prints, for the native and the Triton implementation,
each parameter gradient's max-abs error against the float64 reference of the whole batch and the
verdict's threshold (kappa times the native error, or a floor).

    python3 dev/ranks_alpha.py [--shape 64x8x4x64] [--device cpu] [--ranks 1,2,4,8] [--dtype bf16]
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import pyarrow.parquet as pq


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="64x8x4x64")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--ranks", default="1,2,4,8")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--kernel", default="mapping")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    scen = tmp / "s.toml"
    scen.write_text(f'name = "ranks"\n[[cases]]\nkernel = "{a.kernel}"\nshapes = ["{a.shape}"]\n'
                    f'dtypes = ["{a.dtype}"]\nfamilies = ["random"]\n')
    print(f"{a.kernel} {a.shape} {a.dtype} on {a.device}: max_abs error of each parameter gradient (threshold)")
    for r in [int(v) for v in a.ranks.split(",")]:
        for reduce in (["fp32"] if r == 1 else ["fp32", "bf16"]):
            out = tmp / f"r{r}{reduce}.parquet"
            cmd = [sys.executable, "-m", "mhctool.cli", "parity", "--scenario", str(scen), "--impl", "triton",
                   "--device", a.device, "--ranks", str(r), "--grad-reduce", reduce, "-o", str(out), "--quiet"]
            done = subprocess.run(cmd, capture_output=True, text=True)
            rows = pq.read_table(out).to_pylist() if out.exists() else []
            cells = []
            for impl in ("torch", "triton"):
                for t in ("grad_alpha", "grad_h_bias", "grad_weight"):
                    m = [x for x in rows if x["impl"] == impl and x["tensor"] == t and x["metric"] == "max_abs"]
                    if m:
                        v = m[0]
                        thr = f" ({v['threshold']:.2e})" if v["threshold"] is not None else ""
                        cells.append(f"{impl} {t} {v['value']:.2e}{thr}{'' if v['passed'] is not False else ' FAIL'}")
            print(f"R={r} {reduce}: " + "; ".join(cells) + f"  [{done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr.strip()[-200:]}]",
                  flush=True)


if __name__ == "__main__":
    main()
