"""Does Triton's tl.dot at input_precision="tf32" round fp32 operands to TF32 or truncate them? (GPU machine:
`python3 dev/tf32_rounding.py`; against cuBLAS with allow_tf32 and both emulations, on one 64x256x64 product.)"""
import torch
import triton
import triton.language as tl

from mhctool.kernels.torch.mhc import round_to_tf32 as rnd  # the baseline's TF32: round to nearest even


@triton.jit
def _mm(a_ptr, b_ptr, c_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
    m = tl.arange(0, M)[:, None]
    n = tl.arange(0, N)[None, :]
    k = tl.arange(0, K)
    a = tl.load(a_ptr + m * K + k[None, :])
    b = tl.load(b_ptr + k[:, None] * N + n)
    tl.store(c_ptr + m * N + n, tl.dot(a, b, input_precision="tf32"))


def trunc(t):
    return (t.contiguous().view(torch.int32) & ~0x1FFF).view(torch.float32)


def main():
    torch.manual_seed(0)
    M = N = 64
    K = 256
    a, b = torch.randn(M, K, device="cuda"), torch.randn(K, N, device="cuda")
    c = torch.empty(M, N, device="cuda")
    _mm[(1,)](a, b, c, M, N, K)
    exact = a.double() @ b.double()
    torch.backends.cuda.matmul.allow_tf32 = True
    cublas = (a @ b).double()
    torch.backends.cuda.matmul.allow_tf32 = False
    for name, v in [("triton tl.dot tf32", c.double()), ("cuBLAS allow_tf32", cublas),
                    ("emulated round-nearest", (rnd(a) @ rnd(b)).double()), ("emulated truncate", (trunc(a) @ trunc(b)).double())]:
        print(f"{name:24s} max_abs {(v - exact).abs().max().item():.3e} rms {((v - exact) ** 2).mean().sqrt().item():.3e}"
              f"  == truncate: {(v - (trunc(a) @ trunc(b)).double()).abs().max().item():.2e}  == round: {(v - (rnd(a) @ rnd(b)).double()).abs().max().item():.2e}")


if __name__ == "__main__":
    main()
