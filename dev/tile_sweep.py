"""Time every tile of the Triton Sinkhorn (forward, backward) and h_post_bda backward at the paper
shape, and check each tile for batch invariance (a token alone and in a prime-sized slice against
the same token in the full batch, bitwise). The fixed tiles in kernels/triton/sinkhorn.py
(``tile``) and h_post_bda.py (``backward_tile``) were chosen from this table.

    python3 dev/tile_sweep.py [--shape 8192x4x4x7168] [--only sinkhorn|h_post_bda]

Needs a GPU. CUDA-graph replay (triton.testing.do_bench_cudagraph), median of its repeats.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's kernels/, run from anywhere
from kernels.triton import h_post_bda as hpb  # noqa: E402
from kernels.triton import sinkhorn as sk  # noqa: E402


def _time(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=100)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({4: torch.int32, 2: torch.int16}[t.element_size()])


def _same(full: torch.Tensor, part: torch.Tensor) -> bool:
    """The leading slice of ``full`` equals ``part`` bit for bit."""
    return torch.equal(_bits(full[: part.shape[0]]), _bits(part))


def sweep_sinkhorn(T: int, n: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn((T, n, n), device="cuda", generator=g) * 3
    go = torch.randn((T, n, n), device="cuda", generator=g)
    print(f"\nsinkhorn n={n}, {T} tokens, fp32 (us; invariant = 1 token and 9973 tokens bitwise equal to the full batch)")
    print("| BT | warps | fwd us | bwd us | fwd invariant | bwd invariant |")
    print("|---|---|---|---|---|---|")
    for t in sk.tiles(n):
        try:
            fwd = lambda: sk._launch(sk._sinkhorn_fwd, x, [], 20, 1e-6, "rowmax", "add", "row_first", t)
            bwd = lambda: sk._launch(sk._sinkhorn_bwd, x, [go], 20, 1e-6, "rowmax", "add", "row_first", t)
            tf, tb = _time(fwd) * 1e3, _time(bwd) * 1e3
            inv = []
            for kern, extra in ((sk._sinkhorn_fwd, []), (sk._sinkhorn_bwd, [go])):
                full = sk._launch(kern, x, extra, 20, 1e-6, "rowmax", "add", "row_first", t)
                ok = all(_same(full, sk._launch(kern, x[:k], [e[:k] for e in extra], 20, 1e-6, "rowmax", "add",
                                                "row_first", t)) for k in (1, 9973))
                inv.append("yes" if ok else "**no**")
            print(f"| {t[0]} | {t[1]} | {tf:.1f} | {tb:.1f} | {inv[0]} | {inv[1]} |", flush=True)
        except Exception as e:  # a tile that does not compile
            print(f"| {t[0]} | {t[1]} | - | - | {type(e).__name__}: {str(e)[:60]} | |", flush=True)


def sweep_h_post_bda(s: int, b: int, n: int, C: int, dtype) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    mk = lambda *sh, dt=dtype: torch.randn(sh, device="cuda", generator=g).to(dt)
    h, hp = mk(s, b, n, n, dt=torch.float32), mk(s, b, n, dt=torch.float32)
    x, y, bias, go = mk(s, b, n, C), mk(s, b, C), mk(C), mk(s, b, n, C)
    print(f"\nh_post_bda backward {s}x{b}x{n}x{C} {dtype} with bias "
          f"(ms; invariant: 1 and 977 tokens bitwise equal to the same tokens in the full batch)")
    print("| BLOCK_T | BLOCK_C | warps | bwd ms | grad_h_res, grad_h_post invariant |")
    print("|---|---|---|---|---|")
    for t in hpb._candidates(C, n):
        try:
            run = lambda: hpb.h_post_bda_backward(h, x, hp, y, bias, go, False, t)
            ms = _time(run)
            full = run()
            ok = True
            for k in (1, 977):
                part = hpb.h_post_bda_backward(h[:k], x[:k], hp[:k], y[:k], bias, go[:k], False, t)
                ok &= _same(full[0], part[0]) and _same(full[2], part[2]) and _same(full[1], part[1])
            print(f"| {t[0]} | {t[1]} | {t[2]} | {ms:.3f} | {'yes' if ok else '**no**'} |", flush=True)
            del full
        except Exception as e:
            print(f"| {t[0]} | {t[1]} | {t[2]} | - | {type(e).__name__}: {str(e)[:60]} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="8192x4x4x7168")
    ap.add_argument("--only", default="")
    a = ap.parse_args()
    s, b, n, C = (int(v) for v in a.shape.split("x"))
    print(torch.cuda.get_device_name())
    if a.only in ("", "sinkhorn"):
        sweep_sinkhorn(s * b, n)
    if a.only in ("", "h_post_bda"):
        sweep_h_post_bda(s, b, n, C, torch.bfloat16)


if __name__ == "__main__":
    main()
