"""The first step's check over seeds, cheaply, for the guide's false-alarm rates: one float64
recording a seed, every implementation judged on it (what ``mhctool train --steps 1 --seeds 1
--seed K`` does for one implementation, without the trajectories it also runs).

    python3 dev/first_step_seeds.py model --seeds 0-9 --impl triton --impl cutile
    python3 dev/first_step_seeds.py engine:megatron:$MCORE --seeds 0-9 --impl triton [--size layers=4 ...]

An ``--impl`` joins specs with ``+`` (``megatron:DIR+mhctool.kernels.torch.mhc:mapping``) and
takes conventions after ``@`` (``FILE.py:fn@sinkhorn.eps=0,sinkhorn.domain=log``). One line a seed
and implementation: its first-step sentence.
"""
from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from mhctool.analyses.train import engine as E
from mhctool.analyses.train import first_step
from mhctool.analyses.train.pieces import assign, family_call, impl_pieces, native_piece, reference_piece
from mhctool.analyses.train.session import parse_knobs
from mhctool.analyses.train.setup import FAMILIES, config
from mhctool.core.verdict import VerdictRule
from mhctool.families import get_family


SHOWN = 3  # failures a line shows (--shown)


def seeds_of(text: str) -> list[int]:
    a, _, b = text.partition("-")
    return list(range(int(a), int(b or a) + 1))


def split(impl: str) -> tuple[list[str], list[tuple[str, str]]]:
    specs, _, conv = impl.partition("@")
    return specs.split("+"), [tuple(kv.split("=", 1)) for kv in conv.split(",") if kv]


def model(seeds: list[int], impls: list[str], dtype: str, device: str, sizes: dict) -> None:
    rule = VerdictRule()
    for seed in seeds:
        cfg = config(device, dtype=dtype, steps=1, seed=seed, **sizes)
        for impl in impls:
            specs, conv = split(impl)
            t0 = time.time()
            pieces, eff = impl_pieces(assign(specs), {}, parse_knobs(conv, "--convention", True), device, dtype)
            native = {f: native_piece(f, eff[f], pieces[f].precision) for f in FAMILIES}
            ref = {f: reference_piece(f, eff[f]) for f in FAMILIES}
            wide = {f: family_call(f, get_family(f).reference, eff[f]) for f in FAMILIES}
            c = first_step.check(cfg, pieces, native, ref, wide, rule, eff)
            print(f"{impl} seed {seed} ({time.time() - t0:.0f} s): {'ok' if c.passed else 'FAIL'} {c.sentence(SHOWN)}",
                  flush=True)


def engine(target: str, seeds: list[int], impls: list[str], sizes: dict, recipe: list[tuple[str, str]],
           device: str) -> None:
    rule = VerdictRule()
    runners = {}
    for impl in impls:
        specs, conv = split(impl)
        runners[impl] = E.configure(target, recipe, specs, device, sizes, seeds[0], [], conv, None, 1, 1)[1]
    with tempfile.TemporaryDirectory() as d:
        for seed in seeds:
            t0 = time.time()
            path = Path(d) / f"first-{seed}.pt"
            one = next(iter(runners.values()))
            _, error = one._run(replace(one.recipe, seed=seed, steps=1), "reference", d, ["--record", str(path)])
            print(f"seed {seed}: recorded in {time.time() - t0:.0f} s{'' if path.is_file() else f': {error}'}",
                  flush=True)
            for impl, runner in runners.items():
                copy = Path(d) / f"{abs(hash(impl))}-{seed}.pt"
                shutil.copy(path, copy)
                runner._recorded[seed] = str(copy)
                t0 = time.time()
                c = runner.first_step(seed, rule)
                said = "nothing swapped in" if c is None else f"{'ok' if c.passed else 'FAIL'} {c.sentence(SHOWN)}"
                print(f"{impl} seed {seed} ({time.time() - t0:.0f} s): {said}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("where", help="model, or engine:ENGINE (engine:megatron:DIR)")
    p.add_argument("--seeds", default="0-9")
    p.add_argument("--impl", action="append", required=True)
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--size", action="append", default=[], help="KEY=VALUE: layers, hidden, heads, seq, batch, lr")
    p.add_argument("--recipe", action="append", default=[], help="KEY=VALUE (engines)")
    p.add_argument("--shown", type=int, default=3, help="failures a line shows")
    a = p.parse_args()
    global SHOWN
    SHOWN = a.shown
    sizes = {k: (float(v) if k == "lr" else int(v)) for k, v in (s.split("=", 1) for s in a.size)}
    if a.where == "model":
        model(seeds_of(a.seeds), a.impl, a.dtype, a.device, sizes)
    else:
        size_keys = {"layers": "layers", "hidden": "hidden", "heads": "heads", "seq": "seq", "batch": "micro_batch",
                     "lr": "lr"}
        engine(a.where.removeprefix("engine:"), seeds_of(a.seeds), a.impl, {size_keys[k]: v for k, v in sizes.items()},
               [tuple(r.split("=", 1)) for r in a.recipe], a.device)


if __name__ == "__main__":
    main()
