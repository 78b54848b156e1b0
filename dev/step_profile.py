"""Where the fused mHC path's time goes at issue 99's step shape, kernel by kernel (GPU only).

    python3 dev/step_profile.py [profile] [--shape S,B,N,C] [--backend triton|cutile]
    python3 dev/step_profile.py mapfwd [--shape S,B,N,C]
    python3 dev/step_profile.py fold [--shape S,B,N,C]
    python3 dev/step_profile.py postfwd [--shape S,B,N,C]
    python3 dev/step_profile.py postbwd [--shape S,B,N,C]

``profile``: the module path as ``bench --engine`` swaps it in (mhctool.analyses.train.module_path:
the pre-path, then the post-path with dropout 0.1 on a stand-in layer output), forward and backward,
five calls under torch.profiler: each kernel's device time a call, and the bytes each direction
must move at the least against the copy rate measured here. Default shape: one call of issue 99's
step (4,096 tokens, n = 4, C = 2048, bf16).

``mapfwd``: the pre-path's first kernel, Triton's mapping forward (the projection, RMS and the
mapping's activations), at its shipped tile (kernels/triton/mapping.py FWD_TILE: 64 rows a
program, 64 programs at the step's 4,096 tokens for 132 SMs) and at smaller ones, each a CUDA
graph replayed: median microseconds, % of the copy rate for reading x once, and whether its
outputs have the shipped tile's bits (a row's sums over K should not depend on the rows beside it).

``fold``: the pre-path's backward with the residual's other gradient added in its dx pass
(kernels.schedule.ResidualLink) at its tile and others, against the backward without it followed
by autograd's add of the two, each a CUDA graph replayed.

``postfwd``: the post-path's forward with dropout 0.1 at its tile and others.

``postbwd``: the post-path's backward with dropout 0.1 (the n = 4 FMA kernel) at its tile and
others, and the tensor-core kernel with the mask at its tiles.
"""
from __future__ import annotations

import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mhctool.analyses.timing import copy_bandwidth  # noqa: E402
from mhctool.analyses.train import module_path  # noqa: E402


def _arg(name: str, default: str) -> str:
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


def _inputs(s, b, n, c):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(s, b, n, c, device="cuda", generator=g).bfloat16().requires_grad_()
    nh = n * n + 2 * n
    w = (torch.randn(nh, n * c, device="cuda", generator=g) / (n * c) ** 0.5).bfloat16().requires_grad_()
    a = torch.tensor([0.8, 1.1, 0.9], device="cuda", requires_grad=True)
    hb = (0.1 * torch.randn(nh, device="cuda", generator=g)).requires_grad_()
    bias = (0.1 * torch.randn(c, device="cuda", generator=g)).bfloat16().requires_grad_()
    return x, w, a, hb, bias


def profile(shape, backend: str) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof_
    s, b, n, c = shape
    calls, names = module_path.pieces("impl", backend, {}, "cuda")
    ops = module_path.ops(calls)
    x, w, a, hb, bias = _inputs(s, b, n, c)

    def one(k: int):
        agg, h_res, h_post = ops["pre_path"](x, w, a, hb)
        y = agg * 1.0  # the layer's output, a tensor of its own
        out = ops["post_path"](h_res, x, h_post, y, bias, 0.1, 1234, 4294967000 + k * (1 << 20))
        return out

    for k in range(3):  # compiles, warms
        torch.autograd.backward(one(k), torch.ones(s, b, n, c, device="cuda", dtype=torch.bfloat16))
    torch.cuda.synchronize()
    reps = 5
    with prof_(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for k in range(reps):
            with torch.profiler.record_function("forward"):
                out = one(k)
            torch.cuda.synchronize()
            with torch.profiler.record_function("backward"):
                torch.autograd.backward(out, torch.ones_like(out))
            torch.cuda.synchronize()
    per = defaultdict(float)
    counts = defaultdict(int)
    for e in prof.key_averages():
        if e.device_time_total > 0 and not e.key.startswith(("forward", "backward")):
            per[e.key] += e.device_time_total / reps
            counts[e.key] += e.count // reps
    bw = copy_bandwidth("cuda")
    r, cb = s * b * n * c * 2, s * b * c * 2
    # bench's floor without the recompute: the pre-path reads the streams and writes C, the
    # post-path reads the streams and y and writes the streams; the backward about twice that
    floor = {"forward": 3 * r + 2 * cb, "backward": 2 * (3 * r + 2 * cb)}
    print(f"{backend}[module] at {s}x{b}x{n}x{c} bf16, dropout 0.1; copy {bw / 1e9:.0f} GB/s; {names}")
    total = sum(per.values())
    for key, us in sorted(per.items(), key=lambda kv: -kv[1]):
        print(f"  {us:9.1f} us  x{counts[key]:<3d} {key[:100]}")
    least = sum(floor.values()) / bw * 1e6
    print(f"  total {total:.1f} us a call (forward and backward); the bytes' floor {least:.1f} us "
          f"({100 * least / total:.0f}% of it)")
    # host-bound or not: the host's time to issue each direction (no synchronize inside) against
    # the device's span of it, outside the profiler
    import time
    host, dev = defaultdict(list), defaultdict(list)
    for k in range(10):
        torch.cuda.synchronize()
        for name in ("forward", "backward"):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            e0.record()
            if name == "forward":
                out = one(k)
            else:
                torch.autograd.backward(out, torch.ones_like(out))
            e1.record()
            host[name].append((time.perf_counter() - t0) * 1e6)
            torch.cuda.synchronize()
            dev[name].append(e0.elapsed_time(e1) * 1e3)
    for name in ("forward", "backward"):
        print(f"  {name}: the host issues it in {statistics.median(host[name]):.1f} us, the device spans "
              f"{statistics.median(dev[name]):.1f} us")


def _graph_us(fn, reps: int = 10) -> float:
    """Median microseconds of ``fn`` a call, ``reps`` calls captured in a CUDA graph, replayed 20 times."""
    g = torch.cuda.CUDAGraph()
    st = torch.cuda.Stream()
    st.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(st):
        fn()
        with torch.cuda.graph(g, stream=st):
            for _ in range(reps):
                fn()
    torch.cuda.current_stream().wait_stream(st)
    times = []
    for _ in range(20):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1) * 1000 / reps)
    return statistics.median(times)


def _sweep(tiles, shipped, call, nbytes: int, bw: float, bits) -> None:
    """Each tile once (``call(tile)``: its outputs), then timed (``_graph_us``): microseconds, % of the
    copy rate for ``nbytes``, and ``bits(out, first)``: how its outputs compare with the first
    tile's. A tile the compiler refuses is a line of its own."""
    ref = None
    for tile in dict.fromkeys(tiles):
        try:
            out = call(tile)
            us = _graph_us(lambda: call(tile))
        except Exception as e:  # noqa: BLE001 - a tile the compiler refuses is a line, not the end
            print(f"  {tile}: {type(e).__name__}: {str(e)[:120]}")
            continue
        same = "-" if ref is None else bits(out, ref)
        ref = out if ref is None else ref
        print(f"  {tile}{' (shipped)' if tile == shipped else ''}: {us:.1f} us, {100 * nbytes / bw / (us * 1e-6):.0f}% "
              f"of copy; the shipped tile's bits: {same}")


def _post_inputs(shape, seed: int):
    """The post-path's inputs at ``shape`` (bf16 streams, y and bias; fp32 h_res and h_post) and the
    generator that drew them, for more."""
    s, b, n, c = shape
    x, _, _, _, bias = _inputs(s, b, n, c)
    g = torch.Generator(device="cuda").manual_seed(seed)
    h_res = torch.rand(s, b, n, n, device="cuda", generator=g)
    h_post = 2 * torch.rand(s, b, n, device="cuda", generator=g)
    y = torch.randn(s, b, c, device="cuda", generator=g).bfloat16()
    return (h_res, x.detach(), h_post, y, bias.detach()), g


def mapfwd(shape) -> None:
    from kernels.triton import mapping as tm
    s, b, n, c = shape
    x, w, a, hb, _ = _inputs(s, b, n, c)
    x2d = x.detach().reshape(s * b, n * c)
    w, a, hb = w.detach(), a.detach(), hb.detach()
    bw = copy_bandwidth("cuda")
    print(f"mapping forward at {s * b} rows, K = {n * c}, bf16; copy {bw / 1e9:.0f} GB/s")
    # more of x in flight a program (stages, BLOCK_K): at 64 programs a call the bytes in flight, not
    # the programs, may be what holds the copy rate (smaller row blocks were no faster, session 60)
    _sweep((tm.FWD_TILE, (64, 128, 4), (64, 128, 4, 5), (64, 128, 8, 6), (64, 256, 4, 3), (64, 256, 8, 4),
            (32, 256, 4, 4), (32, 128, 4, 6), (32, 128, 4)), tm.FWD_TILE,
           lambda tile: tm.mapping_forward(x2d, w, a, hb, tile_=tile), x2d.numel() * 2, bw,
           lambda out, ref: all(torch.equal(p, q) for p, q in zip((*out[0], *out[1]), (*ref[0], *ref[1]))))


def fold(shape) -> None:
    """The pre-path's backward (Triton's mapping backward with the aggregation's term) with the
    residual's other gradient added in its dx pass (``extra``, kernels.schedule.ResidualLink) at
    EXTRA_TILE and others, against it without and autograd's add of the two after it."""
    from kernels.triton import mapping as tm
    from kernels.triton import proj_rms as tpr
    s, b, n, c = shape
    x, w, a, hb, _ = _inputs(s, b, n, c)
    M = s * b
    x2d = x.detach().reshape(M, n * c)
    w, a, hb = w.detach(), a.detach(), hb.detach()
    _, saved = tm.mapping_forward(x2d, w, a, hb)
    g = torch.Generator(device="cuda").manual_seed(1)
    grads = (torch.randn(M, n, device="cuda", generator=g), torch.randn(M, n, device="cuda", generator=g),
             torch.randn(M, n, n, device="cuda", generator=g))
    agg = (torch.rand(M, n, device="cuda", generator=g), torch.randn(M, c, device="cuda", generator=g).bfloat16())
    extra = torch.randn(M, n * c, device="cuda", generator=g).bfloat16()
    bw = copy_bandwidth("cuda")
    print(f"pre-path backward at {M} rows, n = {n}, C = {c}, bf16; copy {bw / 1e9:.0f} GB/s")
    plain = _graph_us(lambda: tm.mapping_backward(x2d, w, a, hb, saved, grads, agg=agg)[0])
    added = _graph_us(lambda: tm.mapping_backward(x2d, w, a, hb, saved, grads, agg=agg)[0] + extra)
    want = tm.mapping_backward(x2d, w, a, hb, saved, grads, agg=agg)[0].float() + extra.float()
    print(f"  without the residual's gradient: {plain:.1f} us; with autograd's add after it: {added:.1f} us")
    shipped = tpr.EXTRA_TILE
    for tile in dict.fromkeys((shipped, (64, 128, 8, 8, 3), (64, 128, 8, 4, 3), (64, 128, 8, 8, 2),
                               (64, 128, 8, 4, 2), (64, 64, 8, 4, 3), (128, 128, 4, 8, 2))):
        tpr.EXTRA_TILE = tile
        try:
            got = tm.mapping_backward(x2d, w, a, hb, saved, grads, agg=agg, extra=extra)[0]
            us = _graph_us(lambda: tm.mapping_backward(x2d, w, a, hb, saved, grads, agg=agg, extra=extra))
        except Exception as e:  # noqa: BLE001 - a tile the compiler refuses is a line, not the end
            print(f"  {tile}: {type(e).__name__}: {str(e)[:120]}")
            continue
        finally:
            tpr.EXTRA_TILE = shipped
        # against the largest magnitude: where the two gradients nearly cancel, one bf16 rounding of a
        # large dx is a large share of a small sum (session 62 divided element by element: 0.775)
        err = float((got.float() - want).abs().max() / want.abs().max())
        print(f"  folded {tile}{' (shipped)' if tile == shipped else ''}: {us:.1f} us ({added - us:+.1f} us "
              f"against the add after); largest difference from the add in fp32, against its largest "
              f"magnitude: {err:.2e}")


def postfwd(shape) -> None:
    """The post-path's forward (Triton's n = 4 h_post_bda with dropout 0.1) at its shipped tile and
    others (BLOCK_C, tokens a program, warps, stages), each a CUDA graph replayed: microseconds, %
    of the copy rate for its bytes (read the streams and y, write the streams), whether it has the
    shipped tile's bits (the tile may change the fp32 sums' contraction)."""
    from kernels.triton import h_post_bda as hpb
    s, b, n, c = shape
    inputs, _ = _post_inputs(shape, 2)
    bw = copy_bandwidth("cuda")
    print(f"post-path forward at {s * b} tokens, n = {n}, C = {c}, bf16, dropout 0.1; copy {bw / 1e9:.0f} GB/s")
    _sweep((hpb.FWD4_TILE, (1024, 1, 1, 1), (512, 1, 1, 1), (2048, 1, 2, 1), (2048, 1, 1, 1), (1024, 2, 1, 2),
            (1024, 4, 2, 2), (512, 4, 1, 3), (256, 8, 1, 3)), hpb.FWD4_TILE,
           lambda tile: hpb.h_post_bda_forward(*inputs, tile_=tile, dropout=0.1, dropout_seed=1234,
                                               dropout_offset=4294967000),
           (2 * n + 1) * s * b * c * 2, bw, torch.equal)


def postbwd(shape) -> None:
    """The post-path's backward (Triton's n = 4 h_post_bda with dropout 0.1) at its shipped tile and
    others: the tensor-core kernel's (BLOCK_C, tokens a program, warps, stages) and the FMA kernel's
    (5 entries), each a CUDA graph replayed: microseconds, % of the copy rate for its bytes (read the
    gradient, the streams and y, write dx and dy), and whether dx and dy have the shipped tile's bits
    (a token's are per element and should not depend on the tile) and dH, dh_post and the bias's
    gradient too (their sums over C follow the C block)."""
    from kernels.triton import h_post_bda as hpb
    s, b, n, c = shape
    inputs, g = _post_inputs(shape, 3)
    grad = torch.randn(s, b, n, c, device="cuda", generator=g).bfloat16()
    bw = copy_bandwidth("cuda")
    print(f"post-path backward at {s * b} tokens, n = {n}, C = {c}, bf16, dropout 0.1; copy {bw / 1e9:.0f} GB/s")

    def bits(out, ref):  # (dH, dx, dh_post, dy, d_bias)
        return (f"dx, dy {torch.equal(out[1], ref[1]) and torch.equal(out[3], ref[3])}; dH, dh_post, d_bias "
                f"{all(torch.equal(out[i], ref[i]) for i in (0, 2, 4))}")
    # the FMA kernel finishes its sums itself since session 64 (as the tensor-core one does): its tiles
    # again, around the shipped one; the tensor-core kernel's best two of session 63
    _sweep((hpb.BWD4_TILE_DROPOUT, hpb.BWD4_TILE_TC_DROPOUT, (256, 32, 1, 3), hpb.BWD4_TILE, (1, 256, 16, 1, 3),
            (1, 256, 64, 1, 3), (1, 128, 32, 1, 3), (1, 512, 32, 1, 3), (1, 512, 32, 2, 3), (1, 256, 32, 1, 2),
            (1, 256, 32, 1, 4), (2, 256, 32, 2, 3)), hpb.BWD4_TILE_DROPOUT,
           lambda tile: hpb.h_post_bda_backward(*inputs, grad, tile_=tile, dropout=0.1, dropout_seed=1234,
                                                dropout_offset=4294967000),
           (3 * n + 2) * s * b * c * 2, bw, bits)


def main() -> None:
    shape = tuple(int(v) for v in _arg("--shape", "4096,1,4,2048").split(","))
    if sys.argv[1:2] == ["mapfwd"]:
        return mapfwd(shape)
    if sys.argv[1:2] == ["fold"]:
        return fold(shape)
    if sys.argv[1:2] == ["postfwd"]:
        return postfwd(shape)
    if sys.argv[1:2] == ["postbwd"]:
        return postbwd(shape)
    return profile(shape, _arg("--backend", "triton"))


if __name__ == "__main__":
    main()
