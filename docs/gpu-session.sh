#!/usr/bin/env bash
# The GPU machine's steps, in two calls of the device tool (each call has 10 minutes):
#   run(command="source .device/setup.sh && bash docs/gpu-session.sh checks", carry=[".device", ".anchors"])
#   run(command="source .device/setup.sh && bash docs/gpu-session.sh anchors", carry=[".device", ".anchors"])
# Staged first on the development machine: ../shared/device/stage.sh, and ../shared/anchors/stage.sh
# megatron|te GIT_DIR for the anchors (never commit .anchors/). Logs go to $OUT (or ./out).
set -uo pipefail
out="${OUT:-out}"; mkdir -p "$out"
phase="${1:-checks}"
m() { python3 -m mhctool.cli "$@"; }
step() { echo; echo "=== $* ($(date +%T))"; }

case "$phase" in
checks)
  {
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    step "pytest -m gpu"
    /usr/bin/time -f "pytest -m gpu wall %e s" python3 -m pytest -m gpu -q -p no:cacheprovider --durations=12
    step "parity --scenario paper --impl triton,cutile (bf16; cuTile rows skipped only where no kernel exists)"
    /usr/bin/time -f "paper parity wall %e s" m parity --scenario paper --impl triton,cutile -o "$out/paper.parquet" --top 8
    step "parity --scenario moe --impl triton,cutile --kernel grouped_mlp (cuTile has none: skipped with the reason)"
    m parity --scenario moe --kernel grouped_mlp,swiglu --impl triton,cutile -o /tmp/moe.parquet --top 3 --quiet
    python3 -c "import pyarrow.parquet as pq; rows = pq.read_table('/tmp/moe.parquet').to_pylist(); print(sorted({(r['impl'], r['message']) for r in rows if r['metric'] == 'unsupported'}))"
  } 2>&1 | tee "$out/checks.log"
  ;;
anchors)
  {
    for gen in m3828 dev; do
      for dt in fp32 bf16; do
        step "megatron $gen $dt"
        m parity --kernel all --impl "megatron:.anchors/megatron/$gen" --dtype "$dt" -o "$out/megatron-$gen-$dt.parquet" --top 12
      done
    done
    for dt in fp32 bf16; do
      step "te $dt"
      m parity --kernel all --impl te:.anchors/te --dtype "$dt" -o "/tmp/te-$dt.parquet" --top 12
    done
    step "isolation cost at the paper shape (h_post_bda bf16 inputs and output through a worker)"
    python3 - <<'PY'
import time, torch
from mhctool.isolation import Worker
s, b, n, c = 8192, 4, 4, 7168
args = (torch.randn(s, b, n, n, device="cuda"), torch.randn(s, b, n, c, device="cuda", dtype=torch.bfloat16),
        torch.randn(s, b, n, device="cuda"), torch.randn(s, b, c, device="cuda", dtype=torch.bfloat16))
gb = sum(t.numel() * t.element_size() for t in args) / 1e9
for transport in ("shm", "file"):
    with Worker(transport) as w:
        t0 = time.perf_counter(); w.call("torch:cat", ([args[1].flatten()[:1]],)); start = time.perf_counter() - t0
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            value, failure = w.call("mhctool.kernels.torch.mhc:h_post_bda", args)
            torch.cuda.synchronize(); times.append(time.perf_counter() - t0)
            assert failure is None, failure
    t0 = time.perf_counter(); from mhctool.kernels.torch.mhc import h_post_bda; h_post_bda(*args); torch.cuda.synchronize()
    direct = time.perf_counter() - t0
    print(f"{transport}: worker start {start:.1f} s; per call {min(times):.2f} s (in-process {direct:.3f} s) "
          f"for {gb:.2f} GB of inputs and {args[1].numel() * 2 / 1e9:.2f} GB of output")
PY
    step "bench: ours and the anchors in one run"
    m bench --shape 8192x4x4x7168 --kernel sinkhorn,h_aggregate,h_post_bda,proj_rms,mapping \
      --impl triton,cutile,te:.anchors/te,megatron:.anchors/megatron/m3828 --graph --repeats 20 -o "$out/bench.parquet"
  } 2>&1 | tee "$out/anchors.log"
  ;;
esac
