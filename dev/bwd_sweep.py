"""Issue 20 on the GPU: the backward kernels of h_post_bda and proj_rms (IEEE-class and TF32),
the shipped tile beside candidate tiles, at the paper shape (8192x4x4x7168, bf16 activations),
in one process so that the figures compare (the bench's few-percent differences move between
machine starts).

Each line: the time (median of CUDA-event timings after a warm-up that compiles), the % of the
copy bandwidth measured in the same process for the bytes that must move, and the largest
relative difference to the generic kernel (h_post_bda: float64 gradients at this shape would need
30 GB) or to float64 (proj_rms). Best last.

    python3 dev/bwd_sweep.py [h_post_bda|proj_rms|cutile|cutile_fwd|tf32|packed|mapping_fwd|all] [--limit SECONDS]
"""
from __future__ import annotations

import argparse
import ast
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.triton import h_post_bda as hpb  # noqa: E402
from kernels.triton import proj_rms as pr  # noqa: E402

S, B, N, C = 8192, 4, 4, 7168
T = S * B
TILES: dict = {}  # --tiles: candidate lists in place of the built-in ones ("bf16", "fp32", "cutile", "cutile_fwd")


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


def paired_rounds(fns: dict, rounds: int, deadline: float = float("inf")) -> dict:
    """Each callable's times (ms) over paired rounds: every one once a round, the order reversed
    every other round, until ``rounds`` or the deadline (``time.time()``)."""
    times = {name: [] for name in fns}
    for i in range(rounds):
        if time.time() > deadline:
            break
        for name in (list(fns) if i % 2 == 0 else list(fns)[::-1]):
            times[name].append(timed(fns[name]))
    return times


def copy_bw() -> float:
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    return 2 * a.numel() / (timed(lambda: b.copy_(a), 20) * 1e-3)


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def _line(name, ms, nbytes, bw, extra=""):
    print(f"  {name}: {ms:.3f} ms ({nbytes / (ms * 1e-3) / bw * 100:.0f}% of copy){extra}", flush=True)


def hpb_inputs(s: int, b: int, c: int, seed: int = 0) -> tuple:
    """h_post_bda's inputs and upstream gradient, bf16 activations and fp32 h_res / h_post:
    ``(h_res, x, h_post, y, bias, grad_out)``."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    dt = torch.bfloat16
    x = torch.randn(s, b, N, c, generator=g, device="cuda").to(dt)
    go = torch.randn(s, b, N, c, generator=g, device="cuda").to(dt)
    y = torch.randn(s, b, c, generator=g, device="cuda").to(dt)
    bias = torch.randn(c, generator=g, device="cuda").to(dt)
    h = torch.rand(s, b, N, N, generator=g, device="cuda")
    hp = torch.rand(s, b, N, generator=g, device="cuda")
    return h, x, hp, y, bias, go


def sweep_h_post_bda(bw: float, deadline: float) -> None:
    h, x, hp, y, bias, go = hpb_inputs(S, B, C)
    nbytes = 3 * T * N * C * 2 + 2 * T * C * 2
    generic = hpb.backward_tile(C, N)
    want = hpb.h_post_bda_backward(h, x, hp, y, bias, go, tile_=generic)
    print(f"h_post_bda bf16 with bias, generic kernel {generic}; n = 4 tiles, tensor-core (BLOCK_C, GROUP, warps, "
          f"stages) shipped {hpb.BWD4_TILE_TC}, FMA (BLOCK_T, BLOCK_C, GROUP, warps, stages) {hpb.BWD4_TILE}:", flush=True)
    _line("generic", timed(lambda: hpb.h_post_bda_backward(h, x, hp, y, bias, go, tile_=generic)), nbytes, bw)
    # the H100's tile (ninth session) and the one-warp ones around the H200's best (eleventh; the
    # earlier candidates and their figures are in dev/perf-notes.md)
    # 4 entries: the tensor-core kernel (BLOCK_C, GROUP, warps, stages), the default for bf16
    tiles = TILES.get("bf16") or [hpb.BWD4_TILE_TC, (512, 32, 1, 2), (512, 48, 1, 3), (512, 16, 1, 4),
                                  (256, 32, 1, 2), hpb.BWD4_TILE, (1, 512, 128, 1, 3), (1, 512, 64, 1, 4),
                                  (2, 256, 128, 1, 3)]
    results = _sweep("n=4", lambda t: hpb.h_post_bda_backward(h, x, hp, y, bias, go, tile_=t), tiles,
                     lambda got: f"max rel diff to generic {max(rel(a, b) for a, b in zip(got, want)):.1e}",
                     nbytes, bw, deadline)
    if not results:
        return
    best = results[0][1]
    for tr, bb in ((True, bias), (False, None)):
        ms = timed(lambda: hpb.h_post_bda_backward(h, x, hp, y, bb, go, tr, tile_=best))
        ms0 = timed(lambda: hpb.h_post_bda_backward(h, x, hp, y, bb, go, tr, tile_=generic))
        print(f"  transpose_res={tr} bias={bb is not None}: n=4 {ms:.3f} ms, generic {ms0:.3f} ms", flush=True)
    if time.time() < deadline:
        del x, go, want
        torch.cuda.empty_cache()
        x32, go32, y32, b32 = (torch.randn(S, B, N, C, device="cuda"), torch.randn(S, B, N, C, device="cuda"),
                               torch.randn(S, B, C, device="cuda"), torch.randn(C, device="cuda"))
        ms0 = timed(lambda: hpb.h_post_bda_backward(h, x32, hp, y32, b32, go32, tile_=generic))
        print(f"  fp32 generic: {ms0:.3f} ms ({2 * nbytes / (ms0 * 1e-3) / bw * 100:.0f}%)", flush=True)
        # fp32 takes the FMA kernel: the bf16 sweep's best only where it is an FMA tile
        for tile in TILES.get("fp32") or (hpb.BWD4_TILE_FP32, *([best] if len(best) == 5 else []), (4, 128, 256, 4, 2),
                                          (1, 512, 128, 1, 3), (1, 512, 128, 1, 2), (2, 256, 128, 1, 3), (8, 128, 256, 4, 2)):
            if time.time() > deadline:
                break
            ms = timed(lambda: hpb.h_post_bda_backward(h, x32, hp, y32, b32, go32, tile_=tile))
            print(f"  fp32 n=4 {tile}: {ms:.3f} ms ({2 * nbytes / (ms * 1e-3) / bw * 100:.0f}%)", flush=True)


def _proj_inputs():
    K = N * C
    nh = N * N + 2 * N
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(T, K, generator=g, device="cuda").to(torch.bfloat16)
    w = (torch.randn(nh, K, generator=g, device="cuda") / K ** 0.5).to(torch.bfloat16)
    _, r, rms = pr.proj_rms_forward(x, w, 1e-6)
    gp = torch.randn(T, nh, generator=g, device="cuda")
    gr = torch.randn(T, generator=g, device="cuda")
    coef = -gr.double() * r.double() ** 2 / (K * rms.double())
    dw64 = (gp.double().T @ x.double()).float()
    dx64 = (gp.double() @ w.double() + coef[:, None] * x.double()).float()
    return x, w, r, rms, gp, gr, (dx64, dw64), 2 * T * K * 2


def _sweep(label, run, cfgs, errors, nbytes, bw, deadline) -> list:
    """Each tile: run once (compiling), ``errors(result)`` as text, then timed; the best three
    printed last. Returns (ms, tile) fastest first."""
    results = []
    for cfg in cfgs:
        if time.time() > deadline:
            print("  time limit: sweep stopped", flush=True)
            break
        try:
            err = errors(run(cfg))
            ms = timed(lambda: run(cfg))
        except Exception as ex:  # noqa: BLE001 - a tile that does not compile is a line, not the end
            print(f"  {label} {cfg}: {type(ex).__name__}: {str(ex)[:160]}", flush=True)
            continue
        results.append((ms, cfg))
        _line(f"{label} {cfg}", ms, nbytes, bw, f", {err}")
    results.sort()
    for ms, cfg in results[:3][::-1]:
        _line(f"best {label} {cfg}", ms, nbytes, bw)
    return results


def _errors(want):
    return lambda got: f"rel err dx {rel(got[0], want[0]):.2e} dW {rel(got[1], want[1]):.2e}"


def sweep_proj_rms(bw: float, deadline: float) -> None:
    x, w, r, rms, gp, gr, want, nbytes = _proj_inputs()
    print(f"proj_rms bf16 (Triton), shipped tile {pr.LOWP_TILE} (BLOCK_M, BLOCK_K, SPLIT, warps, stages):", flush=True)
    cfgs = [pr.LOWP_TILE, (64, 256, 8, 8, 2), (64, 128, 2, 4, 2), (64, 128, 1, 4, 2), (64, 128, 4, 4, 3),
            (32, 256, 2, 4, 2), (128, 128, 4, 8, 2), (64, 64, 4, 4, 3)]
    _sweep("triton", lambda cfg: pr.proj_rms_backward(x, w, r, rms, gp, gr, tile_=cfg), cfgs, _errors(want), nbytes,
           bw, deadline)


def sweep_cutile(bw: float, deadline: float) -> None:
    from kernels.cutile import proj_rms as cpr
    x, w, r, rms, gp, gr, want, nbytes = _proj_inputs()

    def run(cfg):
        dx, dw = torch.empty_like(x), torch.empty_like(w)
        cpr.backward_into(x, w, gp, gr, r, rms, dx, dw, tile_=cfg)
        return dx, dw

    print(f"proj_rms bf16 (cuTile), shipped tile {cpr.BWD_TILE} (BM, BK, splits):", flush=True)
    # not swept (H200, dev/perf-notes.md): the occupancy hint (1 equals the default, 2-4 took 2.7x
    # longer), num_worker_warps 4 or 8 (30-80x), a DRAM-latency hint on the x and gradient loads
    # (4 or 8: 4-8% slower), the next block's tiles loaded by hand before this block's products
    # (2x: the compiler's own pipelining is lost); 2, 3 or 6 splits (tails of the last wave)
    cfgs = TILES.get("cutile") or [cpr.BWD_TILE, (128, 128, 4), (128, 128, 8), (64, 256, 4), (64, 256, 16),
                                    (32, 256, 8), (64, 512, 8)]
    _sweep("cutile", run, cfgs, _errors(want), nbytes, bw, deadline)


def sweep_cutile_fwd(bw: float, deadline: float) -> None:
    """The cuTile projection's forward tile (BM, BK): one program per BM tokens walks all of K, so
    BM sets how many programs there are to hide the loads' latency."""
    from kernels.cutile import proj_rms as cpr
    x, w, r, rms, *_ = _proj_inputs()
    want = (x.double() @ w.double().T).float()

    def run(cfg):
        proj, rr, _ = cpr.forward(x, w, 1e-6, tile_=cfg)
        return proj, rr

    print(f"proj_rms forward bf16 (cuTile), shipped tile {cpr._tiles(True)} (BM, BK):", flush=True)
    # (32, *) and (16, *) were 1.5-5x slower on an H200 (dev/perf-notes.md, eleventh session)
    cfgs = TILES.get("cutile_fwd") or [cpr._tiles(True), (64, 64), (128, 64), (32, 128), (128, 128), (64, 256)]
    _sweep("cutile fwd", run, cfgs, lambda got: f"rel err proj {rel(got[0], want):.2e} r {rel(got[1], r):.2e}",
           T * N * C * 2, bw, deadline)


def apply_flags(module, flags: dict, shipped: dict) -> None:
    """A variant's module flags: its own, and the shipped value of any flag another variant sets
    (so that no variant inherits the one timed before it)."""
    for key, val in {**shipped, **flags}.items():
        setattr(module, key, val)


def sweep_mapping_fwd(bw: float, deadline: float, rounds: int = 7) -> None:
    """cuTile's mapping forward (proj_rms's forward kernel, then compute_h's) beside cuTile's
    proj_rms forward and Triton's mapping forward, in paired rounds, with the mapping module's flags
    of ``--tiles "{'mapping_flags': [{'BM_H': 64}]}"``; each mapping variant's outputs against
    Triton's. (compute_h as the projection kernel's epilogue took 0.569 ms here against 0.535 as
    two launches, and 57-61 ms with any occupancy hint: dev/perf-notes.md, twenty-fifth session.)"""
    from kernels.cutile import mapping as cmap, proj_rms as cpr
    from kernels.triton import mapping as tmap
    x, w, *_ = _proj_inputs()
    g = torch.Generator(device="cuda").manual_seed(1)
    a = torch.tensor([0.8, 1.1, 0.9], device="cuda")
    hb = 0.1 * torch.randn(w.shape[0], device="cuda", generator=g)
    shipped = {key: getattr(cmap, key) for flags in TILES.get("mapping_flags", []) for key in flags}

    def flagged(flags):
        def run():
            apply_flags(cmap, flags, shipped)
            return cmap.forward(x, w, a, hb, 1e-6)[0]
        return run

    variants = {"triton mapping fwd": lambda: tmap.mapping_forward(x, w, a, hb)[0],
                "cutile proj_rms fwd": lambda: cpr.forward(x, w, 1e-6),
                **{f"cutile mapping fwd {flags or 'shipped'}": flagged(flags)
                   for flags in [{}, *TILES.get("mapping_flags", [])]}}
    want = variants["triton mapping fwd"]()
    ok = {}
    for name, fn in variants.items():
        try:
            got = fn()
            if "mapping" in name:
                print(f"  {name}: max |d| against Triton {[float((u - v).abs().max()) for u, v in zip(got, want)]}",
                      flush=True)
            ok[name] = fn
        except Exception as ex:  # noqa: BLE001 - a variant that does not compile is a line
            print(f"  {name}: {type(ex).__name__}: {str(ex)[:160]}", flush=True)
    for name, ts in paired_rounds(ok, rounds, deadline).items():
        if ts:
            _line(name, sorted(ts)[len(ts) // 2], T * N * C * 2, bw)


def sweep_tf32(bw: float, deadline: float) -> None:
    x, w, r, rms, gp, gr, want, nbytes = _proj_inputs()
    print("proj_rms bf16, the TF32 variant's backward: the two-piece kernel (default) and the generic one "
          "(BLOCK_M, BLOCK_K, SPLIT, warps, stages):", flush=True)
    _sweep("tf32 two-piece", lambda cfg: pr.proj_rms_backward(x, w, r, rms, gp, gr, tile_=cfg, tf32=True),
           [pr.LOWP_TILE], _errors(want), nbytes, bw, deadline)
    _sweep("tf32 generic", lambda cfg: pr.proj_rms_backward(x, w, r, rms, gp, gr, lowp=False, tile_=cfg, tf32=True),
           [(64, 128, 8, 4, 2), (64, 128, 16, 4, 2)], _errors(want), nbytes, bw, deadline)


def sweep_packed(bw: float, deadline: float, rounds: int = 7) -> None:
    """The Triton bf16 backward (over the packed gradient, issue 42) at candidate tiles, beside
    cuTile's where it runs: each variant checked once against float64, then timed in paired rounds
    (every variant once a round, the order reversed every other round); the median of each
    variant's ratio to the shipped tile and its median time. (The unpacked kernel it replaced took
    2.17-2.26 ms on an H100 in the same rounds: dev/perf-notes.md, twentieth session.)"""
    x, w, r, rms, gp, gr, want, nbytes = _proj_inputs()
    variants = {}
    # an entry: a tile, or (tile, {keyword: value}) for proj_rms_backward; upper-case keys are
    # proj_rms module flags, set before each call (e.g. {"PACK_M": 64})
    def call(cfg, opts):
        for key, val in opts.items():
            if key.isupper():
                setattr(pr, key, val)
        return pr.proj_rms_backward(x, w, r, rms, gp, gr, tile_=cfg, **{k: v for k, v in opts.items() if not k.isupper()})

    # ("cutile", {FLAG: value}): cuTile's backward with its proj_rms module flags set
    cutile_flags = [{}]
    for entry in TILES.get("packed") or [pr.LOWP_TILE, (64, 128, 8, 4, 3), (64, 128, 16, 4, 4)]:
        if entry[0] == "cutile":
            cutile_flags.append(entry[1])
            continue
        cfg, opts = (entry, {}) if len(entry) == 5 else entry
        variants[f"triton {cfg}{f' {opts}' if opts else ''}"] = lambda cfg=cfg, opts=opts: call(cfg, opts)
    try:
        from kernels.cutile import proj_rms as cpr
        dx, dw = torch.empty_like(x), torch.empty_like(w)
        shipped = {key: getattr(cpr, key) for flags in cutile_flags for key in flags}

        def cutile(flags):
            apply_flags(cpr, flags, shipped)
            cpr.backward_into(x, w, gp, gr, r, rms, dx, dw)
            return dx, dw

        for flags in cutile_flags:
            variants[f"cutile {cpr.BWD_TILE}{f' {flags}' if flags else ''}"] = lambda flags=flags: cutile(flags)
    except Exception as ex:  # noqa: BLE001 - no cuTile here: the Triton variants alone
        print(f"  (cuTile not timed: {type(ex).__name__}: {str(ex)[:100]})", flush=True)
    ok = {}
    for name, fn in variants.items():
        if time.time() > deadline:
            break
        try:
            err = _errors(want)(fn())
            ok[name] = fn
            print(f"  {name}: {err}", flush=True)
        except Exception as ex:  # noqa: BLE001 - a tile that does not compile is a line
            print(f"  {name}: {type(ex).__name__}: {str(ex)[:160]}", flush=True)
    try:
        compiled_resources(pr._proj_rms_bwd_packed)
    except Exception as ex:  # noqa: BLE001 - Triton's cache layout moves between versions: a line, not a stop
        print(f"  (resources not read: {type(ex).__name__}: {ex})", flush=True)
    times = paired_rounds(ok, rounds, deadline)
    base = times[next(iter(ok))]
    res = []
    for name, ts in times.items():
        if ts:
            ratios = sorted(t / b for t, b in zip(ts, base))
            res.append((sorted(ts)[len(ts) // 2], name, ratios[len(ratios) // 2]))
    for ms, name, ratio in sorted(res, reverse=True):
        _line(f"{name} x{ratio:.3f} of the first", ms, nbytes, bw)


def compiled_resources(jit_fn) -> None:
    """Registers, spills and shared memory of each compiled specialisation of ``jit_fn`` (what the
    device compiled, beside what ``dev/sass_offline.py`` reads offline)."""
    for dev_cache in getattr(jit_fn, "device_caches", {}).values():
        cache = dev_cache[0] if isinstance(dev_cache, tuple) else dev_cache
        for k in cache.values():
            meta = k.metadata
            print(f"  compiled: warps {meta.num_warps} stages {meta.num_stages} {getattr(k, 'n_regs', '?')} registers, "
                  f"{getattr(k, 'n_spills', '?')} spills, {meta.shared} B shared; constants "
                  f"{ {kk: v for kk, v in getattr(k.src, 'constants', {}).items() if isinstance(v, (int, bool))} }",
                  flush=True)


SWEEPS = {"h_post_bda": sweep_h_post_bda, "proj_rms": sweep_proj_rms, "cutile": sweep_cutile,
          "cutile_fwd": sweep_cutile_fwd, "tf32": sweep_tf32, "packed": sweep_packed,
          "mapping_fwd": sweep_mapping_fwd}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", nargs="?", default="all", choices=[*SWEEPS, "all"])
    ap.add_argument("--limit", type=float, default=480.0, help="seconds; the sweep stops after")
    ap.add_argument("--tiles", default="{}",
                    help='candidate lists, e.g. "{\'bf16\': [(1, 512, 64, 1, 3)], \'cutile\': [(128, 128, 4)]}"')
    a = ap.parse_args()
    TILES.update(ast.literal_eval(a.tiles))
    deadline = time.time() + a.limit
    bw = copy_bw()
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e9:.0f} GB/s", flush=True)
    for name, sweep in SWEEPS.items():
        if a.what in (name, "all"):
            sweep(bw, deadline)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
