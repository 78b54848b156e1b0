"""The Triton projection backward (``proj_rms._proj_rms_bwd_packed``) with its loads through TMA
tensor descriptors or by pointers, with and without mix_aggregate's aggregation term, at the paper
shape (bf16): dx and dW of each variant against the first's bit for bit, then paired rounds of
CUDA-event timings of ``proj_rms_backward`` (the kernel and dW's sum) from given pieces.

    python3 dev/agg_tma.py ["[(agg, {FLAG: value, ...}), ...]"]

(agg: True for the term; FLAG: a proj_rms module flag such as AGG_TMA, PLAIN_TMA, TMA_STORE,
GROUP_STREAMS, AGG_TMA_STAGES, LOWP_TILE; every variant sets the flags it relies on, since they
persist. The default: the term's kernel by pointers and by TMA loads, the streams' programs side by
side and in the plain order; the kernel without it by pointers and by TMA loads and store.)
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1])); sys.path.insert(0, str(Path(__file__).resolve().parent))
from bwd_sweep import paired_rounds  # noqa: E402
from kernels.triton import proj_rms as pr  # noqa: E402


def main() -> None:
    S, B, n, C = 8192, 4, 4, 7168
    M, K, N = S * B, n * C, 24
    NG = pr.piece_cols(N)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
    w = (torch.randn(N, K, device="cuda", generator=g) / K ** 0.5).bfloat16()
    grad = torch.randn(M, NG, device="cuda", generator=g) * 1e-2
    grad[:, N:] = 0
    hi = grad.bfloat16()
    pieces = (hi, (grad - hi.float()).bfloat16(), torch.randn(M, device="cuda", generator=g) * 1e-3)
    agg = (torch.rand(M, n, device="cuda", generator=g), torch.randn(M, C, device="cuda", generator=g).bfloat16())
    r = rms = torch.ones(M, device="cuda")
    default = [(True, {"AGG_TMA": False, "TMA_STORE": False, "GROUP_STREAMS": True}),
               (True, {"AGG_TMA": True, "TMA_STORE": False, "GROUP_STREAMS": True}),
               (True, {"AGG_TMA": False, "TMA_STORE": False, "GROUP_STREAMS": False}),
               (True, {"AGG_TMA": True, "TMA_STORE": False, "GROUP_STREAMS": False}),
               (False, {"PLAIN_TMA": False, "TMA_STORE": False}), (False, {"PLAIN_TMA": True, "TMA_STORE": True})]
    cands = ast.literal_eval(sys.argv[1]) if len(sys.argv) > 1 else default

    def variant(with_agg, flags):
        def run():
            for key, val in flags.items():
                setattr(pr, key, val)
            return pr.proj_rms_backward(x, w, r, rms, None, None, pieces=pieces, agg=agg if with_agg else None)
        return run

    refs, fns = {}, {}
    for with_agg, flags in cands:
        name = f"{'agg' if with_agg else 'plain'} {flags}"
        try:
            fn = variant(with_agg, flags)
            got = fn()
            torch.cuda.synchronize()
            first = refs.setdefault(with_agg, got)
            print(f"{name}: dx, dW the same bits as the first {'agg' if with_agg else 'plain'} variant's:",
                  [torch.equal(a, b) for a, b in zip(got, first)], flush=True)
            fns[name] = fn
        except Exception as ex:  # noqa: BLE001
            print(f"{name} failed: {type(ex).__name__}: {str(ex).splitlines()[0][:200]}", flush=True)
    for name, ts in paired_rounds(fns, 9).items():
        print(f"{name}: median {sorted(ts)[len(ts) // 2]:.4f} ms", flush=True)


if __name__ == "__main__":
    main()
