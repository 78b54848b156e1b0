"""How often `mhctool train`'s ensemble verdict calls a correct kernel DRIFT, and how often it
catches each planted defect: E ensembles of K seeds each, from base seeds far apart (ensemble e
starts at seed 1000 * e), every one judged as `mhctool train --seeds K` judges it.

    python dev/train_ensembles.py cpu [--ensembles 10] [--seeds 4] [--workers 2] [--only LABEL,...]
    python3 dev/train_ensembles.py gpu --out $OUT [--megatron .anchors/megatron/m3828] ...
    python dev/train_ensembles.py gpu --rejudge A.jsonl B.jsonl --group 2   # 4-seed records as 8

Prints a line per ensemble as it ends and a Markdown table at the end; with --out, JSON lines
(one per ensemble: the verdict, and per metric the ratio and the per-seed distances) in
FOLDER/train-ensembles.jsonl. The rates are what the guide's training page quotes. With --gpus, a
process per entry (an index may repeat), each running whole ensembles: every label of an ensemble
in one process, so that its native and float64 runs are run once a seed and shared by the labels
whose knobs and precision are the same.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IMPLS = ROOT / "tests" / "impls"


def cases(where: str, megatron: str | None) -> list[dict]:
    """(label, --impl specs, config overrides, knobs) of what is run; the defects are the test
    suite's stand-ins."""
    if where == "cpu":
        out = []
        for lr in (0.01, 0.05):
            out.append({"label": f"triton lr {lr}", "impl": "triton", "lr": lr})
            out.append({"label": f"H^T h_post_bda lr {lr}", "impl": f"{IMPLS}/defects.py:h_post_bda_transposed", "lr": lr})
            out.append({"label": f"Sinkhorn without a gradient lr {lr}", "impl": f"{IMPLS}/train_faults.py:sinkhorn_detached",
                        "lr": lr})
            out.append({"label": f"Sinkhorn ignoring eps (runs 1e-8) lr {lr}", "impl": f"{IMPLS}/defects.py:sinkhorn_eps_1e8",
                        "lr": lr})
        out.append({"label": "raw-exp Sinkhorn lr 0.2", "impl": f"{IMPLS}/strangers.py:sinkhorn_raw_exp", "lr": 0.2})
        return out
    out = []
    for lr in (0.05, 0.01):  # the chaotic rate first: what the verdict's stability is about
        for impl in ("triton", "cutile"):
            out.append({"label": f"{impl} bf16 lr {lr}", "impl": impl, "lr": lr, "dtype": "bf16"})
        if megatron and lr == 0.05:
            for eps in (1e-6, 1e-8):
                out.append({"label": f"megatron PR 3828 eps {eps:g} bf16 lr {lr}", "impl": f"megatron:{megatron}",
                            "lr": lr, "dtype": "bf16", "knobs": {"sinkhorn": {"eps": eps}}, "as_used": True})
    return out


def rejudge(files: list[str], group: int) -> int:
    """The verdict of every ``group`` recorded ensembles of a label in a row (by index) judged as one
    ensemble of their seeds together, by mhctool's own test (``ensemble.pooled``); an ensemble that
    went non-finite or ended early fails as recorded. Prints the tally and every failure."""
    from collections import defaultdict

    from mhctool.analyses.train.ensemble import pooled
    recorded: dict[str, dict[int, dict]] = defaultdict(dict)
    failures = []
    for f in files:
        for line in open(f):
            d = json.loads(line)
            recorded[d["label"]][d["ensemble"]] = d
    print("| what | ensembles PASSED | largest geometric mean |\n|---|---|---|")
    for label, runs in recorded.items():
        idx = sorted(runs)
        groups = [idx[i:i + group] for i in range(0, len(idx) - group + 1, group)]
        passed, worst = 0, 0.0
        for g in groups:
            ok = not any(runs[e]["nonfinite"] for e in g)
            if not ok:
                failures.append(f"{label} ensembles {g}: non-finite")
            for metric in runs[g[0]]["metrics"]:
                seeds = [(m, a) for e in g for m, _, a in runs[e]["metrics"][metric]["per_seed"]]
                mean, drifts = pooled(metric, seeds)
                worst = max(worst, mean)
                if drifts:
                    ok = False
                    failures.append(f"{label} ensembles {g}: {metric} {mean:.3g}")
            passed += ok
        print(f"| {label} | {passed} of {len(groups)} | {worst:.3g} |")
    for f in failures:
        print(f)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("where", choices=("cpu", "gpu"))
    ap.add_argument("--ensembles", type=int, default=10)
    ap.add_argument("--first", type=int, default=0, help="the first ensemble's index (to go on from a run cut short)")
    ap.add_argument("--seeds", type=int, default=None, help="seeds an ensemble (default: mhctool train's on the device)")
    ap.add_argument("--rejudge", nargs="+", default=None, metavar="JSONL",
                    help="run nothing: judge the seeds these files recorded, --group ensembles in a row as one")
    ap.add_argument("--group", type=int, default=1)
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--only", default=None, help="comma-separated substrings of the labels to run")
    ap.add_argument("--megatron", default=None, help="a staged Megatron-LM tree (gpu)")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--gpus", default=None, help="comma-separated GPU indices: a process each")
    ap.add_argument("--shard", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=None, help="start no ensemble after this many seconds")
    ap.add_argument("--verbose", action="store_true", help="a line per trajectory with its time")
    a = ap.parse_args()
    t_start = time.time()
    if a.rejudge:
        return rejudge(a.rejudge, a.group)
    if a.gpus:
        import os
        import subprocess
        gpus = a.gpus.split(",")
        argv = list(sys.argv[1:])
        k = argv.index("--gpus")
        del argv[k:k + 2]
        procs = [subprocess.Popen([sys.executable, __file__, *argv, "--shard", f"{i}/{len(gpus)}", "--workers", "1"],
                                  env={**os.environ, "CUDA_VISIBLE_DEVICES": g}) for i, g in enumerate(gpus)]
        return max(p.wait() for p in procs)
    from mhctool.analyses import train as T
    from mhctool.spread import pool
    from mhctool.spread.forkserver import start_forkserver
    from mhctool.spread.isolation import Worker
    device = "cuda" if a.where == "gpu" else "cpu"
    a.seeds = a.seeds or T.default_seeds(device)
    workers = a.workers or pool.worker_count("auto", device, a.seeds)
    if workers > 1:
        start_forkserver()
    log = None
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        log = open(Path(a.out) / "train-ensembles.jsonl", "a")
    todo = [c for c in cases(a.where, a.megatron) if not a.only or any(s in c["label"] for s in a.only.split(","))]
    jobs = [(c, e) for e in range(a.first, a.first + a.ensembles) for c in todo]  # ensemble-major: every label advances
    if a.shard:  # by ensemble: a process runs every label of its ensembles, native and float64 once a seed
        k, n = map(int, a.shard.split("/"))
        jobs = [(c, e) for c, e in jobs if e % n == k]
    shared: dict = {}
    tally: dict[str, list[bool]] = {}
    for c, e in jobs:
        if a.deadline and time.time() - t_start > a.deadline:
            print(f"deadline after {sum(map(len, tally.values()))} of {len(jobs)} runs", flush=True)
            break
        cfg = T.config(device, lr=c["lr"], dtype=c.get("dtype", "fp32"), seed=1000 * e, steps=a.steps)
        t0 = time.time()
        marks = [time.time()]

        def progress(role, step, c=c, e=e, marks=marks):  # a line a trajectory, to see where the time goes
            if step.step == cfg.steps:
                print(f"  {c['label']} ensemble {e}: {role} done, {time.time() - marks[-1]:.1f} s", flush=True)
                marks.append(time.time())
        o = T.session(cfg, T.assign([c["impl"]]), c.get("knobs", {}), {}, trace=False, seeds=a.seeds,
                      workers=workers, as_used=c.get("as_used", False), isolation_factory=lambda: Worker("shm"),
                      progress=progress if a.verbose else None, shared=shared if workers == 1 else None)
        verdict = "PASS" if o.passed else "DRIFT" if o.drifts and not all(d.passed for d in o.drifts) else "FAIL"
        why = o.nonfinite or next((d.message for d in o.drifts if not d.passed), "")
        tally.setdefault(c["label"], []).append(o.passed)
        ratios = "; ".join(f"{d.metric} {d.ratio:.3g}" for d in o.drifts if hasattr(d, "ratio"))
        print(f"{c['label']} ensemble {e} (seeds {1000 * e}-{1000 * e + a.seeds - 1}): {verdict} "
              f"{time.time() - t0:.0f} s; {ratios}" + (f"; {why}" if why else ""), flush=True)
        if log:
            log.write(json.dumps({"label": c["label"], "ensemble": e, "passed": o.passed, "verdict": verdict,
                                  "nonfinite": o.nonfinite, "seconds": time.time() - t0,
                                  "metrics": {d.metric: {"ratio": d.ratio, "passed": d.passed,
                                                         "per_seed": [[p.median, p.native, p.threshold]
                                                                      for p in d.per_seed]}
                                              for d in o.drifts if hasattr(d, "ratio")},
                                  "zeros": o.zeros.sentence if o.zeros else None,
                                  "zero_params": o.zeros.parameters if o.zeros else []}) + "\n")
            log.flush()
    print("\n| what | ensembles PASSED | DRIFT or FAILED |\n|---|---|---|")
    for label, vs in tally.items():
        print(f"| {label} | {sum(vs)} of {len(vs)} | {len(vs) - sum(vs)} of {len(vs)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
