"""Issue 20 on the GPU: the backward kernels of h_post_bda and proj_rms, the shipped version beside
the candidates, at the paper shape (8192x4x4x7168, bf16 activations).

For each candidate tile: the time (median of CUDA-event timings, after a warm-up that compiles),
the % of the measured copy bandwidth for the bytes that must move, and the largest difference to
a float64 computation of the same gradients (proj_rms) or to the shipped kernel (h_post_bda, whose
float64 gradients at this shape would need 30 GB). Prints one line per candidate, best last.

    python3 docs/bwd_sweep.py [h_post_bda|proj_rms|all] [--limit SECONDS]
"""
from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.triton import h_post_bda as hpb  # noqa: E402
from kernels.triton import proj_rms as pr  # noqa: E402

S, B, N, C = 8192, 4, 4, 7168
T = S * B


def copy_bw() -> float:
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    return 2 * a.numel() / (timed(lambda: b.copy_(a), 20) * 1e-3)


def timed(fn, reps: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn()
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1))
    return sorted(times)[len(times) // 2]


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def sweep_h_post_bda(bw: float, deadline: float, dtype=torch.bfloat16) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(S, B, N, C, generator=g, device="cuda").to(dtype)
    go = torch.randn(S, B, N, C, generator=g, device="cuda").to(dtype)
    y = torch.randn(S, B, C, generator=g, device="cuda").to(dtype)
    bias = torch.randn(C, generator=g, device="cuda").to(dtype)
    h = torch.rand(S, B, N, N, generator=g, device="cuda")
    hp = torch.rand(S, B, N, generator=g, device="cuda")
    e = x.element_size()
    nbytes = 3 * T * N * C * e + 2 * T * C * e
    want = hpb.h_post_bda_backward(h, x, hp, y, bias, go)
    ms = timed(lambda: hpb.h_post_bda_backward(h, x, hp, y, bias, go))
    print(f"h_post_bda {dtype} shipped tile {hpb.backward_tile(C, N)}: {ms:.3f} ms "
          f"({nbytes / (ms * 1e-3) / bw * 100:.0f}% of copy)", flush=True)
    results = []
    tiles = [(2, 64, 1, 3, 1024), (2, 64, 1, 4, 1024), (2, 64, 1, 3, 2048), (1, 128, 1, 4, 1024),
             (2, 64, 1, 2, 1024), (1, 64, 1, 4, 1024), (2, 128, 1, 3, 1024)]
    for tile in tiles:
        if time.time() > deadline:
            print("time limit: sweep stopped", flush=True)
            break
        try:
            got = hpb.h_post_bda_backward_rows(h, x, hp, y, bias, go, False, tile)
            err = max(rel(gg, w) for gg, w in zip(got, want))
            ms = timed(lambda: hpb.h_post_bda_backward_rows(h, x, hp, y, bias, go, False, tile))
        except Exception as ex:  # noqa: BLE001 - a tile that does not compile is a line, not the end
            print(f"  rows {tile}: {type(ex).__name__}: {str(ex)[:120]}", flush=True)
            continue
        pct = nbytes / (ms * 1e-3) / bw * 100
        results.append((ms, tile, err))
        print(f"  rows {tile}: {ms:.3f} ms ({pct:.0f}%), max rel diff to shipped {err:.1e}", flush=True)
    for ms, tile, err in sorted(results)[:5][::-1]:
        print(f"best h_post_bda rows {tile}: {ms:.3f} ms ({nbytes / (ms * 1e-3) / bw * 100:.0f}%) diff {err:.1e}")
    if not results:
        return
    tile = sorted(results)[0][1]
    from kernels.triton.reduce import sum_rows
    ws = torch.zeros(tile[4], C, device="cuda")
    print(f"  of which the bias sum over {tile[4]} partial rows: {timed(lambda: sum_rows(ws, dtype, (C,))):.4f} ms")
    for tr, bb in ((True, bias), (False, None)):
        ms = timed(lambda: hpb.h_post_bda_backward_rows(h, x, hp, y, bb, go, tr, tile))
        ms0 = timed(lambda: hpb.h_post_bda_backward(h, x, hp, y, bb, go, tr))
        print(f"  transpose_res={tr} bias={bb is not None}: rows {ms:.3f} ms, shipped {ms0:.3f} ms")
    if dtype == torch.bfloat16 and time.time() < deadline:
        del x, go, want
        torch.cuda.empty_cache()
        x32, go32, y32, b32 = (torch.randn(S, B, N, C, device="cuda"), torch.randn(S, B, N, C, device="cuda"),
                               torch.randn(S, B, C, device="cuda"), torch.randn(C, device="cuda"))
        ms = timed(lambda: hpb.h_post_bda_backward_rows(h, x32, hp, y32, b32, go32, False, tile))
        ms0 = timed(lambda: hpb.h_post_bda_backward(h, x32, hp, y32, b32, go32, False))
        print(f"  fp32: rows {ms:.3f} ms ({2 * nbytes / (ms * 1e-3) / bw * 100:.0f}%), shipped {ms0:.3f} ms")


def sweep_proj_rms(bw: float, deadline: float) -> None:
    K = N * C
    nh = N * N + 2 * N
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(T, K, generator=g, device="cuda").to(torch.bfloat16)
    w = (torch.randn(nh, K, generator=g, device="cuda") / K ** 0.5).to(torch.bfloat16)
    _, r, rms = pr.proj_rms_forward(x, w, 1e-6)
    gp = torch.randn(T, nh, generator=g, device="cuda")
    gr = torch.randn(T, generator=g, device="cuda")
    nbytes = 2 * T * K * 2
    # float64 gradients: dx = gp W + coef x, dW = gp^T x
    coef = -gr.double() * r.double() ** 2 / (K * rms.double())
    dw64 = gp.double().T @ x.double()
    dx64 = gp.double() @ w.double()
    dx64 += coef[:, None] * x.double()
    want = (dx64, dw64)
    got = pr.proj_rms_backward(x, w, r, rms, gp, gr)
    ms = timed(lambda: pr.proj_rms_backward(x, w, r, rms, gp, gr))
    print(f"proj_rms bf16 shipped: {ms:.3f} ms ({nbytes / (ms * 1e-3) / bw * 100:.0f}%), "
          f"rel err dx {rel(got[0], want[0]):.2e} dW {rel(got[1], want[1]):.2e}", flush=True)
    results = []
    cfgs = [(bm, bk, sp, wp, st, 2, dwp) for (bm, bk, wp) in ((64, 256, 8), (64, 128, 4), (32, 128, 4), (64, 64, 4))
            for sp in (8, 16) for st in (2, 3) for dwp in (2, 3)]
    for cfg in cfgs:
        if time.time() > deadline:
            print("time limit: sweep stopped", flush=True)
            break
        try:
            got = pr.proj_rms_backward_t(x, w, r, rms, gp, gr, cfg)
            e_dx, e_dw = rel(got[0], want[0]), rel(got[1], want[1])
            ms = timed(lambda: pr.proj_rms_backward_t(x, w, r, rms, gp, gr, cfg))
        except Exception as ex:  # noqa: BLE001
            print(f"  t {cfg}: {type(ex).__name__}: {str(ex)[:120]}", flush=True)
            continue
        pct = nbytes / (ms * 1e-3) / bw * 100
        results.append((ms, cfg, e_dx, e_dw))
        print(f"  t {cfg}: {ms:.3f} ms ({pct:.0f}%), rel err dx {e_dx:.2e} dW {e_dw:.2e}", flush=True)
    for ms, cfg, e_dx, e_dw in sorted(results)[:5][::-1]:
        print(f"best proj_rms t {cfg}: {ms:.3f} ms ({nbytes / (ms * 1e-3) / bw * 100:.0f}%) dx {e_dx:.2e} dW {e_dw:.2e}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", nargs="?", default="all")
    ap.add_argument("--limit", type=float, default=500)
    a = ap.parse_args()
    t0 = time.time()
    bw = copy_bw()
    print(torch.cuda.get_device_name(), f"copy {bw / 1e9:.0f} GB/s", flush=True)
    if a.what in ("all", "proj_rms"):
        sweep_proj_rms(bw, t0 + (a.limit / 2 if a.what == "all" else a.limit))
        torch.cuda.empty_cache()
    if a.what in ("all", "h_post_bda"):
        sweep_h_post_bda(bw, t0 + a.limit)


if __name__ == "__main__":
    main()
