"""Issue 63, item 5: hunt a race in h_post_bda's n = 4 backward kernels, where programs talk to each
other (the tensor-core kernel: partials in a workspace, a counter electing the last program of a
token group, the partials dropped from L2 once summed). Each shape's backward runs ``--repeats``
times on the same inputs with poisoned outputs and workspace; every run's gradients are compared
bit for bit with the first run's, and any non-finite value is counted. ``--load`` runs matmuls on a
second stream meanwhile, so that the programs are scheduled otherwise from one run to the next.

    python3 dev/hpb_race.py [--repeats 2000] [--load] [--dtypes fp16,bf16]

Prints, per dtype and shape, the runs whose bits differ from the first and the runs with a
non-finite gradient (both 0 where there is no race)."""
import argparse
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernels.triton.h_post_bda import h_post_bda_backward  # noqa: E402
from mhctool.poison import poisoning  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--repeats", type=int, default=2000)
ap.add_argument("--load", action="store_true")
ap.add_argument("--dtypes", default="fp16,bf16")
a = ap.parse_args()
DT = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
# several C blocks (512 channels a block) and token groups (16 tokens), partial tiles of both
SHAPES = [(1, 1, 4, 67), (17, 1, 4, 513), (300, 2, 4, 1100), (4101, 1, 4, 67), (13, 3, 4, 4099),
          (2048, 1, 4, 7168), (257, 3, 4, 1537)]

stop = threading.Event()


def load():
    s = torch.cuda.Stream()
    m = torch.randn(4096, 4096, device="cuda")
    with torch.cuda.stream(s):
        while not stop.is_set():
            m = (m @ m).clamp_(-1, 1)
            s.synchronize()


def bits(t):
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


if a.load:
    threading.Thread(target=load, daemon=True).start()
total_diff = total_nan = 0
for name in a.dtypes.split(","):
    dt = DT[name]
    for shape in SHAPES:
        s, b, n, C = shape
        g = torch.Generator(device="cuda").manual_seed(hash((name, shape)) % (2**31))
        x = torch.randn(shape, device="cuda", generator=g).to(dt)
        y = torch.randn((s, b, C), device="cuda", generator=g).to(dt)
        bias = torch.randn((C,), device="cuda", generator=g).to(dt)
        go = torch.randn(shape, device="cuda", generator=g).to(dt)
        h_res = torch.randn((s, b, n, n), device="cuda", generator=g)
        h_post = torch.randn((s, b, n), device="cuda", generator=g)
        for transpose in (False, True):
            t0 = time.perf_counter()
            with poisoning(True):
                first = [bits(v).clone() for v in h_post_bda_backward(h_res, x, h_post, y, bias, go, transpose)]
                nan = sum(1 for v in h_post_bda_backward(h_res, x, h_post, y, bias, go, transpose)
                          if not torch.isfinite(v).all())
                diff = 0
                for _ in range(a.repeats):
                    out = h_post_bda_backward(h_res, x, h_post, y, bias, go, transpose)
                    same = all(torch.equal(bits(v), f) for v, f in zip(out, first))
                    finite = all(torch.isfinite(v).all() for v in out)
                    diff += not same
                    nan += not finite
            total_diff, total_nan = total_diff + diff, total_nan + nan
            print(f"{name} {'x'.join(map(str, shape))} transpose={transpose}: {a.repeats} runs, "
                  f"{diff} with other bits, {nan} with a non-finite gradient ({time.perf_counter() - t0:.1f} s)",
                  flush=True)
stop.set()
print(f"all: {total_diff} runs with other bits, {total_nan} with a non-finite gradient", flush=True)
