"""Issue 77's ablation: Megatron-core's mHC recipe in miniature with one factor changed at a time,
each row over an ensemble of seeds, the runs side by side on the machine's GPUs (GPU machine, after
`source dev/mcore_gpu.sh`):

    python3 dev/mcore_ablation.py OUT [--steps 8] [--seeds 8] [--jobs 16] [--rows 0,1,...]

Rows 0-7 and 13-16 run on one GPU each; rows 8-12 at tensor parallel 2 (sequence parallelism on and
off), a pair of GPUs each. Runs are dealt over the visible GPUs (groups of the row's ranks), each started
through the engine's own worker and rank launcher.

Per run: num-zeros per step, whether it alternates between two levels, and which parameters'
gradients hold the zeros (the hyper-connection projections split into H_pre, H_post and H_res
rows). Per row, over its seeds: on how many seeds and steps a whole H_res block of the projection is
exactly zero (the jump), from which step, where, and the two levels. Each run's steps are in
OUT/ROW.sSEED.jsonl and its golden values, in Megatron's format, in OUT/ROW.sSEED.golden.json (all
of them in OUT/goldens.tar.gz); the row summary in OUT/summary.txt.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tarfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mhctool.analyses.goldens import Series, check, dump
from mhctool.analyses.train.engine import ENGINE_FAMILIES, MEGATRON
from mhctool.analyses.train.ranks import gpu_slots, run_ranks
from mhctool.analyses.train.setup import GOLDEN_METRICS

ROWS = [  # (name, tree variable, the options changed)
    ("m3828 recipe", "MCORE", {}),
    ("m3828 fused", "MCORE", {"fused": True}),
    ("m3828 no recompute", "MCORE", {"recompute": False}),
    ("m3828 recompute 1", "MCORE", {"recompute_layers": 1}),
    ("m3828 eps 1e-8", "MCORE", {"sinkhorn_eps": 1e-8}),
    ("m3828 fused eps 1e-8", "MCORE", {"fused": True, "sinkhorn_eps": 1e-8}),
    ("dev recipe", "MCORE_DEV", {}),
    ("dev fused", "MCORE_DEV", {"fused": True}),
    # two GPUs, as the recipe runs (tensor parallel 2; its sequence parallelism on and off)
    ("m3828 tp2", "MCORE", {"tp": 2}),
    ("m3828 tp2 SP", "MCORE", {"tp": 2, "sequence_parallel": True}),
    ("m3828 tp2 SP fused", "MCORE", {"tp": 2, "sequence_parallel": True, "fused": True}),
    ("dev tp2 SP", "MCORE_DEV", {"tp": 2, "sequence_parallel": True}),
    ("dev tp2 SP fused", "MCORE_DEV", {"tp": 2, "sequence_parallel": True, "fused": True}),
    # dev with one factor changed, as rows 2-5 change PR 3828's
    ("dev no recompute", "MCORE_DEV", {"recompute": False}),
    ("dev recompute 1", "MCORE_DEV", {"recompute_layers": 1}),
    ("dev eps 1e-8", "MCORE_DEV", {"sinkhorn_eps": 1e-8}),
    ("dev fused eps 1e-8", "MCORE_DEV", {"fused": True, "sinkhorn_eps": 1e-8}),
]


def slug(name: str) -> str:
    return name.replace(" ", "_")


def launch(out: Path, name: str, tree: str, changed: dict, seed: int, extra: dict, slots: dict) -> Path:
    log = out / f"{slug(name)}.s{seed}.jsonl"
    log.unlink(missing_ok=True)
    # the engine's own worker: Megatron's fused switch is the impl role with --impl megatron
    fused = changed.get("fused", False)
    recipe = {**extra, **{k: v for k, v in changed.items() if k != "fused"}, "seed": seed}
    specs = json.dumps({f: "megatron" for f in ENGINE_FAMILIES} if fused else {})
    cmd = [sys.executable, "-m", "mhctool.analyses.train.engine", "--engine", MEGATRON, "--tree", os.environ[tree],
           "--recipe", json.dumps(recipe), "--role", "impl" if fused else "native", "--specs", specs, "--log", str(log)]
    tp = recipe.get("tp", 1)
    gpus = slots[tp].get()
    try:
        error = run_ranks(cmd, tp, 600, log, {"CUDA_VISIBLE_DEVICES": gpus})
    finally:
        slots[tp].put(gpus)
    (out / f"{slug(name)}.s{seed}.out").write_text(f"GPUs {gpus}: {error or 'ok'}\n")
    return log


def read(log: Path) -> list[dict]:
    if not log.is_file():
        return []
    return [d for d in map(json.loads, log.read_text().splitlines()) if "step" in d]


def golden(steps: list[dict], path: Path) -> None:
    if steps:
        first, last = steps[0]["step"], steps[-1]["step"]
        dump({m: Series(first, last, 1, {s["step"]: s[m] for s in steps}) for m in GOLDEN_METRICS}, path)


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


def jump_steps(steps: list[dict], streams: int, hidden: int) -> list[tuple[int, str]]:
    """The steps where a whole H_res block of a projection (n^2 rows of n x hidden) is exactly
    zero, with the blocks (layer and hyper-connection)."""
    block = streams * streams * streams * hidden
    out = []
    for s in steps:
        full = [k.replace("decoder.layers.", "L").replace("_hyper_connection.mapping_proj.weight:h_res", "")
                for k, v in s["zeros"].items() if k.endswith(":h_res") and v == block]
        if full:
            out.append((s["step"], " ".join(full)))
    return out


def row_summary(name: str, runs: list[list[dict]], streams: int, hidden: int) -> str:
    ran = [r for r in runs if r]
    if not ran:
        return f"{name:22s} no run made a step"
    jumps = [jump_steps(r, streams, hidden) for r in ran]
    seeds_with = sum(1 for j in jumps if j)
    n_steps = sum(len(r) for r in ran)
    where_ = sorted({w for j in jumps for _, w in j})
    firsts = [j[0][0] for j in jumps if j]
    lows = [min(s["num-zeros"] for s in r) for r in ran]
    highs = [max(s["num-zeros"] for s in r) for r in ran]
    two = sum(1 for r in ran if len(r) >= 4 and any(
        a.metric == "num-zeros" for a in check({"num-zeros": Series(1, len(r), 1, {s["step"]: s["num-zeros"] for s in r})})))
    first = f", first at step {min(firsts)}-{max(firsts)}" if firsts else ""
    return (f"{name:22s} jump on {seeds_with}/{len(ran)} seeds, {sum(len(j) for j in jumps)}/{n_steps} steps{first}"
            f" [{', '.join(where_) or '-'}]; num-zeros low {statistics.median(lows):.0f} (median over seeds), "
            f"high {statistics.median(highs):.0f}; goldens check: two levels on {two}/{len(ran)}; "
            f"loss at the end {statistics.median(r[-1]['lm loss'] for r in ran):.4f}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--jobs", type=int, default=16, help="runs at once")
    ap.add_argument("--rows", default="", help="comma-separated row numbers (default all)")
    ap.add_argument("--recipe", default="{}", help="JSON of options for every row (sizes)")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = [ROWS[int(i)] for i in a.rows.split(",")] if a.rows else ROWS
    extra = {"steps": a.steps, **json.loads(a.recipe)}
    jobs = [(name, tree, changed, seed) for name, tree, changed in rows for seed in range(1, a.seeds + 1)]
    # each run's GPUs, dealt round robin
    slots = {tp: gpu_slots(tp, a.jobs) for tp in {c.get("tp", 1) for _, _, c in rows}}
    with ThreadPoolExecutor(a.jobs) as pool:
        logs = list(pool.map(lambda j: launch(out, *j, extra, slots), jobs))
    print(f"{'row':24s} seed  num-zeros per step                      where (>= 1000 zeros)")
    by_row: dict[str, list] = {}
    for (name, tree, changed, seed), log in zip(jobs, logs):
        steps = read(log)
        by_row.setdefault(name, []).append(steps)
        golden(steps, log.with_suffix(".golden.json"))
        nz = " ".join(f"{int(s['num-zeros'])}" for s in steps)
        fused = {s["fused"] for s in steps}
        levels = "; ".join(a.message for a in check({"num-zeros": Series(1, len(steps), 1, {
            s["step"]: s["num-zeros"] for s in steps})}) if a.metric == "num-zeros") if len(steps) >= 4 else ""
        print(f"{name:24s} {seed:4d}  {nz:40s} {where(steps)}  fused ran: {fused} loss {steps[-1]['lm loss']:.4f}"
              f"  {levels or 'no two levels, no jump'}"
              if steps else f"{name:24s} {seed:4d}  no step: {log.with_suffix('.out').read_text()[-300:]!r}")
    recipe = {"streams": 4, "hidden": 512, **extra}
    summary = "\n".join(row_summary(name, runs, recipe["streams"], recipe["hidden"]) for name, runs in by_row.items())
    (out / "summary.txt").write_text(summary + "\n")
    print("\n" + summary)
    # the golden values in one file: a device run brings back a limited count of files
    with tarfile.open(out / "goldens.tar.gz", "w:gz") as tar:
        for g in sorted(out.glob("*.golden.json")):
            tar.add(g, arcname=g.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
