"""What a library's proj_rms returns for 16-bit activations, from its own outputs: the dtype of
proj and r, and whether their distance from float64 is the rounding to that dtype (the distance
of float64's value rounded there) or more.

    python3 dev/proj_rms_dtype.py megatron:.anchors/megatron/m3828 [--tokens 8192 --k 1024 --n 4]
"""
from __future__ import annotations

import argparse

import torch

from mhctool.registry.specs import resolve_impls


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("spec")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--k", type=int, default=1024)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--device", default="cuda")
    a = p.parse_args()
    impl = next(i for i in resolve_impls("proj_rms", [a.spec]) if i.exists)
    g = torch.Generator(device=a.device).manual_seed(0)
    x = torch.randn(a.tokens, a.k, device=a.device, generator=g).bfloat16()
    nh = a.n * a.n + 2 * a.n
    w32 = torch.randn(nh, a.k, device=a.device, generator=g) / a.k ** 0.5
    for wname, w in (("fp32", w32), ("bf16", w32.bfloat16())):
        proj, r = impl.fn(x, w)[:2]
        exact = x.double() @ w.double().t()
        r64 = 1.0 / (x.double().pow(2).mean(-1, keepdim=True).sqrt() + 1e-6)
        for name, got, want in (("proj", proj, exact), ("r", r.reshape(-1, 1), r64)):
            rounded = want.to(got.dtype).double()
            dist = (got.double() - want).abs().max().item()
            floor = (rounded - want).abs().max().item()
            same = (got.double() == rounded).double().mean().item()
            print(f"x bf16, weight {wname}: {name} returned {got.dtype}; max |got - float64| {dist:.3g}; "
                  f"float64 rounded to {got.dtype}: {floor:.3g}; equal to that rounding in {100 * same:.2f}% "
                  f"of {got.numel()} elements", flush=True)


if __name__ == "__main__":
    main()
