"""Issue 77's ablation on one GPU: Megatron-core's mHC recipe in miniature with one factor changed at
a time, each over seeds, run concurrently on the GPU (GPU machine, after `source dev/mcore_gpu.sh`):

    python3 dev/mcore_ablation.py OUT [--steps 8] [--seeds 2] [--jobs 7]

Per row: num-zeros per step (each seed), whether it alternates between two levels, and which
parameters' gradients hold the zeros (the hyper-connection projections split into H_pre, H_post and
H_res rows). Each run's steps are in OUT/ROW.sSEED.jsonl and its golden values, in Megatron's
format, in OUT/ROW.sSEED.golden.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mhctool.analyses.goldens import Series, check, dump
from mhctool.analyses.train.engine import ENGINE_FAMILIES, MEGATRON

ROWS = [  # (name, tree variable, the options changed)
    ("m3828 recipe", "MCORE", {}),
    ("m3828 fused", "MCORE", {"fused": True}),
    ("m3828 no recompute", "MCORE", {"recompute": False}),
    ("m3828 recompute 1", "MCORE", {"recompute_layers": 1}),
    ("m3828 eps 1e-8", "MCORE", {"sinkhorn_eps": 1e-8}),
    ("m3828 fused eps 1e-8", "MCORE", {"fused": True, "sinkhorn_eps": 1e-8}),
    ("dev recipe", "MCORE_DEV", {}),
    ("dev fused", "MCORE_DEV", {"fused": True}),
]
METRICS = ("lm loss", "num-zeros", "grad-norm", "iteration-time", "mem-allocated-bytes", "mem-max-allocated-bytes")


def slug(name: str) -> str:
    return name.replace(" ", "_")


def launch(out: Path, name: str, tree: str, changed: dict, seed: int, port: int, extra: dict) -> Path:
    log = out / f"{slug(name)}.s{seed}.jsonl"
    log.unlink(missing_ok=True)
    env = {**os.environ, "MASTER_PORT": str(port)}
    # the engine's own worker: Megatron's fused switch is the impl role with --impl megatron
    fused = changed.get("fused", False)
    recipe = json.dumps({**extra, **{k: v for k, v in changed.items() if k != "fused"}, "seed": seed})
    specs = json.dumps({f: "megatron" for f in ENGINE_FAMILIES} if fused else {})
    with open(out / f"{slug(name)}.s{seed}.out", "w") as f:
        subprocess.run([sys.executable, "-m", "mhctool.analyses.train.engine", "--engine", MEGATRON,
                        "--tree", os.environ[tree], "--recipe", recipe, "--role", "impl" if fused else "native",
                        "--specs", specs, "--log", str(log)], env=env, stdout=f, stderr=subprocess.STDOUT, timeout=560)
    return log


def read(log: Path) -> list[dict]:
    if not log.is_file():
        return []
    return [d for d in map(json.loads, log.read_text().splitlines()) if "step" in d]


def golden(steps: list[dict], path: Path) -> None:
    if steps:
        first, last = steps[0]["step"], steps[-1]["step"]
        dump({m: Series(first, last, 1, {s["step"]: s[m] for s in steps}) for m in METRICS}, path)


def where(steps: list[dict]) -> str:
    """The parameters (parts) whose zeros change between steps, or hold the most."""
    parts = {}
    for s in steps:
        for k, v in s["zeros"].items():
            if ":" in k or "mapping_proj" not in k:
                parts.setdefault(k, []).append(v)
    big = sorted(((k, max(v)) for k, v in parts.items() if max(v) >= 1000 and "word_embeddings" not in k),
                 key=lambda kv: -kv[1])
    return "; ".join(f"{k.replace('decoder.layers.', 'L').replace('_hyper_connection.mapping_proj.weight', '')} "
                     f"{v} on {sum(1 for s in steps if s['zeros'].get(k, 0) >= 1000)}/{len(steps)} steps" for k, v in big[:4])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--jobs", type=int, default=8)
    ap.add_argument("--rows", default="", help="comma-separated row numbers (default all)")
    ap.add_argument("--recipe", default="{}", help="JSON of options for every row (sizes)")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = [ROWS[int(i)] for i in a.rows.split(",")] if a.rows else ROWS
    extra = {"steps": a.steps, **json.loads(a.recipe)}
    jobs = [(name, tree, changed, seed) for name, tree, changed in rows for seed in range(1, a.seeds + 1)]
    with ThreadPoolExecutor(a.jobs) as pool:
        logs = list(pool.map(lambda ij: launch(out, *ij[1], 29600 + ij[0], extra), enumerate(jobs)))
    print(f"{'row':24s} seed  num-zeros per step                      where (>= 1000 zeros)")
    for (name, tree, changed, seed), log in zip(jobs, logs):
        steps = read(log)
        golden(steps, log.with_suffix(".golden.json"))
        nz = " ".join(f"{int(s['num-zeros'])}" for s in steps)
        fused = {s["fused"] for s in steps}
        levels = "; ".join(a.message for a in check({"num-zeros": Series(1, len(steps), 1, {
            s["step"]: s["num-zeros"] for s in steps})}) if a.metric == "num-zeros") if len(steps) >= 4 else ""
        print(f"{name:24s} {seed:4d}  {nz:40s} {where(steps)}  fused ran: {fused} loss {steps[-1]['lm loss']:.4f}"
              f"  {levels or 'no two levels, no jump'}"
              if steps else f"{name:24s} {seed:4d}  no step: {log.with_suffix('.out').read_text()[-300:]!r}")
    # the golden values in one file: a device run brings back a limited count of files
    with tarfile.open(out / "goldens.tar.gz", "w:gz") as tar:
        for g in sorted(out.glob("*.golden.json")):
            tar.add(g, arcname=g.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
