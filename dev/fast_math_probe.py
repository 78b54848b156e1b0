"""What does nvcc's --use_fast_math do to a Sinkhorn's error, measured? (GPU machine, with nvcc:
`python3 dev/fast_math_probe.py [OUT_DIR]`.)

Builds one small CUDA file twice, with and without --use_fast_math, loaded through ctypes (no
PyTorch headers, so no CUDA-version check): an elementwise ``expf`` and division, and a one-thread-
per-matrix Sinkhorn written the way a hand-written extension is (``expf(x - rowmax)`` or
``expf(fminf(x, 20))``, then ``p / (sum + eps)``). Prints

- the elementwise error in fp32 ulps of each build's ``expf`` and ``/`` against float64, beside
  the emulations mhctool's native baseline could use for ``math=fast``;
- each Sinkhorn's rel_l2 against the float64 reference on mhctool's input families, as a ratio to
  the IEEE build's and to PyTorch's, beside the emulated baseline's.
"""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import tempfile

import torch
from mhctool.kernels.torch import mhc as native
from mhctool.references import mhc as ref

from mhctool.core.shapes import parse_shape
from mhctool.families.sinkhorn import FAMILY

SRC = r"""
extern "C" {
__global__ void k_exp(const float* x, float* y, long n) {
  long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
  if (i < n) y[i] = expf(x[i]);
}
__global__ void k_div(const float* a, const float* b, float* y, long n) {
  long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
  if (i < n) y[i] = a[i] / b[i];
}
__global__ void k_sinkhorn(const float* L, float* P, long count, int n, int iters, float eps, int clamp, float at) {
  long m = blockIdx.x * (long)blockDim.x + threadIdx.x;
  if (m >= count) return;
  float p[8][8];
  const float* l = L + m * n * n;
  for (int i = 0; i < n; ++i) {
    float mx = l[i * n];
    for (int j = 1; j < n; ++j) mx = fmaxf(mx, l[i * n + j]);
    for (int j = 0; j < n; ++j) p[i][j] = clamp ? expf(fminf(l[i * n + j], at)) : expf(l[i * n + j] - mx);
  }
  for (int it = 0; it < iters; ++it) {
    for (int i = 0; i < n; ++i) {
      float s = 0.f;
      for (int j = 0; j < n; ++j) s += p[i][j];
      for (int j = 0; j < n; ++j) p[i][j] = p[i][j] / (s + eps);
    }
    for (int j = 0; j < n; ++j) {
      float s = 0.f;
      for (int i = 0; i < n; ++i) s += p[i][j];
      for (int i = 0; i < n; ++i) p[i][j] = p[i][j] / (s + eps);
    }
  }
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < n; ++j) P[m * n * n + i * n + j] = p[i][j];
}
void exp_(const float* x, float* y, long n) { k_exp<<<(n + 255) / 256, 256>>>(x, y, n); }
void div_(const float* a, const float* b, float* y, long n) { k_div<<<(n + 255) / 256, 256>>>(a, b, y, n); }
void sinkhorn_(const float* L, float* P, long count, int n, int iters, float eps, int clamp, float at) {
  k_sinkhorn<<<(count + 127) / 128, 128>>>(L, P, count, n, iters, eps, clamp, at);
}
}
"""


def build(folder: str, fast: bool):
    src = os.path.join(folder, "fm.cu")
    with open(src, "w") as f:
        f.write(SRC)
    lib = os.path.join(folder, f"fm_{'fast' if fast else 'ieee'}.so")
    cmd = ["nvcc", "-O3", "-shared", "-Xcompiler", "-fPIC", "-arch=sm_90", src, "-o", lib]
    if fast:
        cmd.insert(1, "--use_fast_math")
    subprocess.run(cmd, check=True)
    so = ctypes.CDLL(lib)
    so.exp_.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long]
    so.div_.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long]
    so.sinkhorn_.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_int,
                             ctypes.c_float, ctypes.c_int, ctypes.c_float]
    return so


def ulps(v: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """|v - exact| in units of the fp32 spacing at exact."""
    e = exact.abs().clamp_min(2.0 ** -126)
    spacing = torch.ldexp(torch.ones_like(e), torch.frexp(e)[1] - 24)
    return ((v.double() - exact).abs() / spacing).float()


def describe(name: str, u: torch.Tensor) -> str:
    return f"{name:34s} mean {u.mean().item():5.2f}  rms {u.pow(2).mean().sqrt().item():5.2f}  max {u.max().item():6.2f} ulp"


def emulations():
    """The native baseline's math=fast beside the first emulation tried (the power rounded to a
    22-bit significand, which measured three times too coarse)."""
    return {"torch ieee": (torch.exp, torch.div),
            "native math=fast": (native._fast_exp, lambda a, b: a * torch.reciprocal(b)),
            "first try: exp2 22b, rcp 23b": (lambda x: _exp(x, 22), lambda a, b: a * _round_sig(torch.reciprocal(b), 23))}


def _round_sig(y: torch.Tensor, bits: int) -> torch.Tensor:
    m, e = torch.frexp(y.double())
    return torch.ldexp(torch.round(torch.ldexp(m, torch.full_like(e, bits))), e - bits).to(y.dtype)


def _exp(x: torch.Tensor, bits: int) -> torch.Tensor:
    y = _round_sig(torch.exp2(x * 1.4426950408889634), bits)
    return torch.where(y.abs() < 2.0 ** -126, torch.zeros_like(y), y)


def elementwise(libs, log):
    g = torch.Generator(device="cuda").manual_seed(0)
    for lo, hi in ((-1.0, 1.0), (-5.0, 5.0), (-30.0, 0.0), (0.0, 20.0), (20.0, 80.0)):
        x = lo + (hi - lo) * torch.rand(1 << 22, generator=g, device="cuda")
        exact = x.double().exp()
        log(f"expf on [{lo:g}, {hi:g}]")
        for name, so in libs.items():
            y = torch.empty_like(x)
            so.exp_(x.data_ptr(), y.data_ptr(), x.numel())
            torch.cuda.synchronize()
            log("  " + describe(f"nvcc {name}", ulps(y, exact)))
        for name, (e, _) in emulations().items():
            log("  " + describe(name, ulps(e(x), exact)))
    a = torch.randn(1 << 22, generator=g, device="cuda")
    b = torch.rand(1 << 22, generator=g, device="cuda") * 4 + 0.25
    exact = a.double() / b.double()
    log("a / b, a unit normal, b in [0.25, 4.25]")
    for name, so in libs.items():
        y = torch.empty_like(a)
        so.div_(a.data_ptr(), b.data_ptr(), y.data_ptr(), a.numel())
        torch.cuda.synchronize()
        log("  " + describe(f"nvcc {name}", ulps(y, exact)))
    for name, (_, d) in emulations().items():
        log("  " + describe(name, ulps(d(a, b), exact)))


def emulated_sinkhorn(L, clamp: bool, exp, div, iters=20, eps=1e-6):
    p = exp(L.clamp(max=20.0)) if clamp else exp(L - L.amax(-1, keepdim=True))
    for _ in range(iters):
        p = div(p, p.sum(-1, keepdim=True) + eps)
        p = div(p, p.sum(-2, keepdim=True) + eps)
    return p


def sinkhorns(libs, shape_text: str, log):
    shape = parse_shape(shape_text)
    fams = {**FAMILY.input_families, **FAMILY.probes}
    for clamp in (False, True):
        log(f"Sinkhorn {'expf(fminf(x, 20))' if clamp else 'expf(x - rowmax)'} at {shape_text}: rel_l2, and x the IEEE build's")
        for name, fam in fams.items():
            g = torch.Generator(device="cuda").manual_seed(1)
            L = fam.make(shape, g, {})["logits"].float().contiguous()
            R = ref.sinkhorn(L.double(), 20, 1e-6, stabilize="clamp" if clamp else "rowmax")
            if not torch.isfinite(R).all():
                continue
            errs = {}
            for lname, so in libs.items():
                P = torch.empty_like(L)
                so.sinkhorn_(L.data_ptr(), P.data_ptr(), L.numel() // (shape.n * shape.n), shape.n, 20, 1e-6,
                             int(clamp), 20.0)
                torch.cuda.synchronize()
                errs[f"nvcc {lname}"] = P
            for ename, (e, d) in emulations().items():
                errs[ename] = emulated_sinkhorn(L, clamp, e, d)
            rel = {k: ((v.double() - R).norm() / R.norm()).item() for k, v in errs.items()}
            base = rel["nvcc ieee"]
            log(f"  {name:15s} ieee {base:.2e}  " + "  ".join(f"{k} {v / base:.2f}x" for k, v in rel.items() if k != "nvcc ieee"))


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "."
    lines = []

    def log(s):
        print(s, flush=True)
        lines.append(s)

    with tempfile.TemporaryDirectory() as d:
        libs = {"ieee": build(d, False), "fast": build(d, True)}
        log(f"device: {torch.cuda.get_device_name()}")
        elementwise(libs, log)
        for shape in ("8192x4x4x1", "33x2x4x1"):
            sinkhorns(libs, shape, log)
    with open(os.path.join(out, "fast_math.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
