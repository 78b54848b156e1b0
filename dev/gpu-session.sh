#!/usr/bin/env bash
# The GPU machine's steps, one call of the device tool per phase (each call has 10 minutes):
#   run(command="source .device/setup.sh && bash dev/gpu-session.sh checks", carry=[".device", ".anchors"])
#   run(command="source .device/setup.sh && bash dev/gpu-session.sh anchors", carry=[".device", ".anchors"])
#   run(command="source .device/setup.sh && bash dev/gpu-session.sh libraries", carry=[".device", ".anchors", ".wheels"])
#   (TE_DTYPES=bf16 TE_ONLY=1 for TE's bf16 run; "bench" is the side-by-side table)
#   run(command="source .device/setup.sh && bash dev/gpu-session.sh isolation", carry=[".device", ".anchors"])
#   run(command="source .device/setup.sh && bash dev/gpu-session.sh repro", carry=[".device"])
#   run(command="source .device/setup.sh && bash dev/gpu-session.sh train", carry=[".device", ".anchors"])
#   run(command="source .device/setup.sh && bash dev/gpu-session.sh spread", carry=[".device"], kind="nvidia-h100-x4")
#   run(command="source .device/setup.sh && bash dev/gpu-session.sh firstcalls", carry=[".device"], kind="nvidia-h100-x2")
#   run(command="bash dev/gpu-session.sh tilekernels", carry=[".tilelang", ".anchors"])  (no .device: 64 MiB)
#   (REPRO_KERNELS=swiglu,grouped_gemm and REPRO_IMPL=triton narrow the repro phase; "sweep" times every Triton tile,
#   "bwd" the backward tiles of issue 20; "verify" is the short check after a kernel change)
# Staged first on the development machine: ../shared/device/stage.sh, and ../shared/anchors/stage.sh
# megatron|te GIT_DIR for the anchors (never commit .anchors/). Logs go to $OUT (or ./out).
set -uo pipefail
out="${OUT:-out}"; mkdir -p "$out"
# the paper-shape judging holds float64 gradients of several GB: without expandable segments the
# repro phase ran out of memory on h_post_bda with 30 GB reserved but free (eighth session, H100)
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
phase="${1:-checks}"
m() { python3 -m mhctool.cli "$@"; }
step() { echo; echo "=== $* ($(date +%T))"; }
# two reports' rows, the run id aside: the same, or not (and the first rows that differ)
cmp_rows() { python3 -c "import sys, math, pyarrow.parquet as pq
rows = [[{k: ('nan' if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()} for r in pq.read_table(p).drop(['run_id']).to_pylist()] for p in sys.argv[1:]]
print('rows', [len(r) for r in rows], 'identical' if rows[0] == rows[1] else 'DIFFERENT')
diff = [(a, b) for a, b in zip(*rows) if a != b]
for a, b in diff[:8]:
    print('  ', *(a.get(k) for k in ('kernel', 'impl', 'family', 'dtype', 'shape', 'direction', 'tensor', 'metric')), a.get('value'), '->', b.get('value'), *([a.get('message'), b.get('message')] if a.get('message') != b.get('message') else []))
print('   rows that differ:', len(diff)) if diff else None" "$@"; }
# two reports' verdicts, row by row by what a row is of (for reports on other input values)
cmp_verdicts() { python3 -c "import sys, pyarrow.parquet as pq
key = ('kernel', 'impl', 'family', 'dtype', 'shape', 'direction', 'tensor', 'metric')
a, b = ({tuple(r[k] for k in key): r['passed'] for r in pq.read_table(p).to_pylist()} for p in sys.argv[1:])
moved = [k for k in a if k in b and a[k] != b[k]]
print('rows', len(a), len(b), 'in both', sum(k in b for k in a), 'failed', sum(v is False for v in a.values()), sum(v is False for v in b.values()), 'verdicts moved', len(moved))
for k in moved[:8]:
    print('  ', *k, a[k], '->', b[k])" "$@"; }

case "$phase" in
checks)
  {
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    step "pytest -m gpu"
    t0=$SECONDS; python3 -m pytest -m gpu -q -p no:cacheprovider --durations=12; echo "pytest -m gpu wall $((SECONDS - t0)) s"
    step "parity --scenario paper --impl triton,cutile (bf16; cuTile rows skipped only where no kernel exists)"
    t0=$SECONDS; timeout --foreground -s INT "${PAPER_LIMIT:-300}" python3 -m mhctool.cli parity --scenario paper --impl triton,cutile -o "$out/paper.parquet" --top 8; echo "paper parity wall $((SECONDS - t0)) s"
    step "parity --kernel sinkhorn,swiglu --impl triton,cutile (swiglu has no cuTile kernel: skipped with the reason)"
    m parity --kernel sinkhorn,swiglu --impl triton,cutile -o /tmp/mixed.parquet --quiet
    python3 -c "import pyarrow.parquet as pq; rows = pq.read_table('/tmp/mixed.parquet').to_pylist(); print(sorted({(r['kernel'], r['impl'], r['message']) for r in rows if r['metric'] == 'unsupported'}))"
  } 2>&1 | tee "$out/checks.log"
  ;;
anchors)
  {
    # one dtype per device call (TE_DTYPES=bf16 for the second): TE's kernels autotune per shape, in
    # this process (--no-isolate: fp32 took about 8 minutes on an H100 for every mHC kernel)
    for dt in ${TE_DTYPES:-fp32}; do
      step "te $dt"
      timeout --foreground -s INT "${TE_LIMIT:-540}" python3 -m mhctool.cli parity --kernel mhc --impl te:.anchors/te \
        --dtype "$dt" --no-isolate -o "$out/te-$dt.parquet" --top 8
    done
    [ -n "${TE_ONLY:-}" ] && exit 0
    step "isolation cost at the paper shape (h_post_bda bf16 inputs and output through a worker)"
    python3 dev/isolation_cost.py
    step "megatron m3828 proj_rms (TF32 by design)"
    m parity --kernel proj_rms --impl megatron:.anchors/megatron/m3828 -o "$out/megatron-m3828-proj.parquet" --top 6
    step "megatron dev bf16"
    m parity --kernel mhc --impl megatron:.anchors/megatron/dev --dtype bf16 -o "$out/megatron-dev-bf16.parquet" --top 6
  } 2>&1 | tee "$out/anchors.log"
  ;;
libraries)
  # issues 37-39: Liger-Kernel judged as shipped (its wheel carried in .wheels/: the machine has no
  # network), the libraries identified with their precision, and the isolation worker from empty
  # compile caches (no error row of mhctool's own making). LIB_STEPS picks steps (default: all).
  {
    python3 -m pip install --no-deps --no-index -q .wheels/liger_kernel-*.whl 2>&1 | grep -v "as the 'root' user"
    for s in ${LIB_STEPS:-context m3828 dev liger identify}; do case $s in
    context)
      step "pytest -m gpu -k context (a backward launching cuTile and Triton in a fresh worker)"
      timeout --foreground -s INT 200 python3 -m pytest -m gpu -q -p no:cacheprovider -k context 2>&1 | tail -3 ;;
    m3828)
      step "megatron m3828 proj_rms, default isolation, empty compile caches"
      CUDA_TILE_CACHE_DIR="$(mktemp -d)" TRITON_CACHE_DIR="$(mktemp -d)" timeout --foreground -s INT 150 \
        python3 -m mhctool.cli parity --kernel proj_rms --impl megatron:.anchors/megatron/m3828 -o "$out/m3828-proj.parquet" --top 6 ;;
    dev)
      step "megatron dev, every mHC kernel, default isolation"
      timeout --foreground -s INT "${DEV_LIMIT:-150}" python3 -m mhctool.cli parity --kernel "${DEV_KERNELS:-mhc}" \
        --impl megatron:.anchors/megatron/dev -o "$out/megatron-dev.parquet" --top 6 ;;
    liger)
      step "liger, every mHC kernel, bf16 and fp32"
      timeout --foreground -s INT 200 python3 -m mhctool.cli parity --kernel mhc --impl liger:liger_kernel \
        -o "$out/liger.parquet" --top 12 ;;
    identify)
      for spec in ${ID_SPECS:-"mapping_sinkhorn liger:liger_kernel" "mix_aggregate liger:liger_kernel" "mix_aggregate te:.anchors/te" \
                  "mapping te:.anchors/te" "mapping megatron:.anchors/megatron/dev 8x2x4x67" \
                  "proj_rms megatron:.anchors/megatron/m3828" "sinkhorn megatron:.anchors/megatron/dev" \
                  "sinkhorn megatron:.anchors/megatron/m3828" "sinkhorn te:.anchors/te" "h_post_bda te:.anchors/te"}; do
        set -- $spec
        step "identify --kernel $1 --impl $2 ${3:+--shape $3} (fp32)"
        NVTE_DISABLE_TRITON_AUTOTUNING=1 timeout --foreground -s INT 90 python3 -m mhctool.cli identify --kernel "$1" \
          --impl "$2" ${3:+--shape $3} -q -o "/tmp/identify-$1-${2%%:*}.parquet"
      done ;;
    esac; done
  } 2>&1 | tee "$out/libraries.log"
  ;;
isolation)
  # issue 39: the worker from empty compile caches (Megatron PR 3828's proj_rms, default isolation:
  # its fp32 tiny_norm backward must be a failed row, no error row), CUDA IPC's cost at the paper
  # shape, and two workers on one GPU against one (the same rows). ISO_STEPS picks steps.
  {
    for s in ${ISO_STEPS:-tests m3828 cost workers}; do case $s in
    tests)
      step "pytest -m gpu -k 'context or cross' (a backward in a fresh worker; CUDA tensors to a worker by IPC)"
      timeout --foreground -s INT 200 python3 -m pytest -m gpu -q -p no:cacheprovider -k "context or cross" 2>&1 | tail -3 ;;
    m3828)
      step "megatron m3828 proj_rms, default isolation (shm: CUDA IPC), empty compile caches"
      t0=$SECONDS
      CUDA_TILE_CACHE_DIR="$(mktemp -d)" TRITON_CACHE_DIR="$(mktemp -d)" timeout --foreground -s INT 200 \
        python3 -m mhctool.cli parity --kernel proj_rms --impl megatron:.anchors/megatron/m3828 -o "$out/m3828-proj.parquet" --top 6
      echo "wall $((SECONDS - t0)) s"
      python3 -c "import pyarrow.parquet as pq
rows = pq.read_table('$out/m3828-proj.parquet').to_pylist()
print('error rows:', sum(r['metric'] == 'error' for r in rows))
print('fp32 bwd failures:', sorted({(r['family'], r['tensor']) for r in rows if r['dtype'] == 'fp32' and r['direction'] == 'bwd' and r['passed'] is False and r['impl'] != 'torch'}))" ;;
    cost)
      step "isolation cost at the paper shape (h_post_bda bf16 through a worker, every transport)"
      python3 dev/isolation_cost.py ;;
    workers)
      for w in 1 2; do
        step "parity --scenario paper --kernel ${W_KERNELS:-h_aggregate,h_post_bda,proj_rms} --impl triton --workers $w"
        t0=$SECONDS
        timeout --foreground -s INT 280 python3 -m mhctool.cli parity --scenario paper --kernel "${W_KERNELS:-h_aggregate,h_post_bda,proj_rms}" \
          --impl triton --no-isolate --workers $w -o "$out/paper-w$w.parquet" --quiet
        echo "workers $w wall $((SECONDS - t0)) s"
      done
      cmp_rows "$out/paper-w1.parquet" "$out/paper-w2.parquet" ;;
    esac; done
  } 2>&1 | tee "$out/isolation.log"
  ;;
repro)
  {
    # SIGINT before the device's own limit, to mhctool only (--foreground: a compiler it runs, e.g. ptxas,
    # is not killed mid-case): mhctool finishes the case, keeps the finished cases and writes the report
    step "parity --scenario repro --impl triton,cutile --check determinism,batch-invariance"
    t0=$SECONDS; timeout --foreground -s INT "${REPRO_LIMIT:-420}" python3 -m mhctool.cli parity --scenario repro --impl "${REPRO_IMPL:-triton,cutile}" \
      --kernel "${REPRO_KERNELS:-all}" \
      --check determinism --check batch-invariance -o "$out/repro.parquet" --top 10; echo "repro wall $((SECONDS - t0)) s"
    python3 dev/repro_table.py "$out/repro.parquet"
  } 2>&1 | tee "$out/repro.log"
  ;;
verify)
  # after a kernel change, in one call (about 8 minutes on an H200): the GPU tests, the paper shape
  # for the changed kernels (VERIFY_KERNELS), h_post_bda in fp32 there (needs an H200's memory for
  # the float64 references) and the TF32 projection's parity
  {
    step "pytest -m gpu"
    timeout --foreground -s INT "${PYTEST_LIMIT:-250}" python3 -m pytest -m gpu -q -p no:cacheprovider 2>&1 | tail -5
    step "parity --scenario paper --kernel ${VERIFY_KERNELS:=h_post_bda,proj_rms,mapping} --impl triton,cutile"
    timeout --foreground -s INT 200 python3 -m mhctool.cli parity --scenario paper --kernel "$VERIFY_KERNELS" \
      --impl triton,cutile -o "$out/paper.parquet" --top 6
    step "h_post_bda fp32 at the paper shape"
    timeout --foreground -s INT 80 python3 -m mhctool.cli parity --kernel h_post_bda --impl triton \
      --shape 8192x4x4x7168 --dtype fp32 -o "$out/fp32.parquet" --quiet
    step "the TF32 projection at the paper shape"
    timeout --foreground -s INT 80 python3 -m mhctool.cli parity --kernel proj_rms,mapping --impl triton-tf32 \
      --shape 8192x4x4x7168 --dtype bf16 -o "$out/tf32.parquet" --quiet
  } 2>&1 | tee "$out/verify.log"
  ;;
train)
  # issue 61: mhctool train on the GPU (mhctool's kernels, the default GPU model), and Megatron PR
  # 3828's kernels at bf16 with Sinkhorn eps 1e-6 and 1e-8, at the default lr and one that grows the
  # logits: do num-zeros jump between two levels? TRAIN_STEPS picks steps (default: tests ours m3828;
  # "first": the first step's check over seeds and planted defects).
  {
    for s in ${TRAIN_STEPS:-tests ours m3828}; do case $s in
    tests)
      step "pytest -m gpu -k train"
      timeout --foreground -s INT 240 python3 -m pytest -m gpu -q -p no:cacheprovider -k train 2>&1 | tail -3 ;;
    ours)
      for impl in triton cutile; do
        step "train --impl $impl --device cuda (the default GPU model, bf16)"
        t0=$SECONDS
        timeout --foreground -s INT 200 python3 -m mhctool.cli train --impl $impl --device cuda --dtype bf16 --every 20 \
          -o "$out/train-$impl.parquet" --goldens "/tmp/train-$impl.json"
        echo "wall $((SECONDS - t0)) s"
      done ;;
    first)
      # the first step judged per tensor (docs/commands/train.md): mhctool's kernels over seeds
      # $FIRST_SEEDS (default 0-9), then each planted defect at seed 0, the default GPU model in bf16
      for impl in triton cutile; do
        for k in ${FIRST_SEEDS:-0 1 2 3 4 5 6 7 8 9}; do
          echo "$impl seed $k: $(timeout --foreground -s INT 120 python3 -m mhctool.cli train --impl $impl --device cuda \
            --dtype bf16 --steps 1 --seeds 1 --seed $k -q -o /tmp/first.parquet 2>&1 | grep 'first step' | cut -c1-240)"
        done
      done
      for d in sinkhorn_softmax_backward sinkhorn_one_pass_backward h_post_bda_bf16_bias_grad h_post_bda_transposed \
               sinkhorn_eps_1e8 sinkhorn_nan_last_token; do
        echo "$d: $(timeout --foreground -s INT 120 python3 -m mhctool.cli train --impl tests/impls/defects.py:$d \
          --device cuda --dtype bf16 --steps 1 --seeds 1 -q -o /tmp/first.parquet 2>&1 | grep 'first step' | cut -c1-300)"
      done ;;
    m3828)
      # the inputs as Megatron's HyperConnectionModule hands them over (h_pre, h_res, h_post in bf16)
      for cfg in ${M3828_CONFIGS:-"1e-6 0.01" "1e-8 0.01" "1e-6 0.05" "1e-8 0.05"}; do
        set -- $cfg
        step "train --impl megatron m3828 bf16, sinkhorn eps $1, lr $2, --input-dtypes library"
        timeout --foreground -s INT 150 python3 -m mhctool.cli train --impl megatron:.anchors/megatron/m3828 \
          --device cuda --dtype bf16 --knob sinkhorn.eps=$1 --lr $2 --no-trace --every 10 --no-isolate \
          --input-dtypes library -o "$out/m3828-eps$1-lr$2.parquet"
        python3 dev/zeros_table.py "$out/m3828-eps$1-lr$2.parquet"
      done ;;
    esac; done
  } 2>&1 | tee "$out/train.log"
  ;;
sweep)
  python3 dev/tile_sweep.py 2>&1 | tee "$out/sweep.log"
  ;;
bwd)
  # issue 20: the h_post_bda and proj_rms backward tiles (Triton, cuTile) side by side, one process
  python3 dev/bwd_sweep.py "${BWD_WHAT:-all}" --limit "${BWD_LIMIT:-480}" 2>&1 | tee "$out/bwd.log"
  ;;
tilekernels)
  # issue 62: DeepSeek's TileKernels as shipped (pip 2.1.0 from .tilelang, the GitHub layout from
  # .anchors/tilekernels-github), carried without .device (the two pass 64 MiB together):
  #   run(command="bash dev/gpu-session.sh tilekernels", carry=[".tilelang", ".anchors"])
  # TK_STEPS picks steps (default: all); TK_BENCH_IMPL what bench runs beside it.
  # TL_BUNDLE=.tilelang-gh: TileLang 0.1.11 for the GitHub layout (dev/make-tilelang-gh-bundle.sh)
  mkdir -p /tmp/tl && tar -xJf "${TL_BUNDLE:-.tilelang}/tilelang-site.tar.xz" -C /tmp/tl
  export PYTHONPATH="/tmp/tl${PYTHONPATH:+:$PYTHONPATH}"
  python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v "as the 'root' user"
  gh=.anchors/tilekernels-github
  {
    for s in ${TK_STEPS:-versions pytest pip github identify paper bench}; do case $s in
    versions)
      nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
      python3 -c "import sys, tilelang, tile_kernels, torch, triton; print(sys.version.split()[0], 'tilelang', tilelang.__version__, 'tile_kernels', getattr(tile_kernels, '__version__', '?'), 'torch', torch.__version__, 'triton', triton.__version__)" ;;
    pytest)
      step "pytest -m gpu -k tilekernels"
      timeout --foreground -s INT 240 python3 -m pytest -m gpu -q -p no:cacheprovider -k tilekernels 2>&1 | tail -15 ;;
    pip|github)
      spec=tilekernels:tile_kernels; [ "$s" = github ] && spec=tilekernels:$gh
      step "parity --kernel mhc --impl $spec (default scenario)"
      timeout --foreground -s INT "${TK_LIMIT:-200}" python3 -m mhctool.cli parity --kernel mhc --impl "$spec" \
        -o "$out/tk-$s.parquet" --top 12 ;;
    identify)
      for spec in ${TK_ID:-"sinkhorn tilekernels:tile_kernels fp32" "mapping tilekernels:tile_kernels bf16" \
                  "mix_aggregate tilekernels:tile_kernels bf16" "h_post_bda tilekernels:tile_kernels bf16" \
                  "h_aggregate tilekernels:tile_kernels bf16" "mapping tilekernels:$gh bf16"}; do
        set -- $spec
        step "identify --kernel $1 --impl $2 --dtype $3"
        timeout --foreground -s INT 120 python3 -m mhctool.cli identify --kernel "$1" --impl "$2" --dtype "$3" \
          --shape 16x2x4x256 -q -o "/tmp/identify-$1.parquet"
      done ;;
    paper)
      step "parity --scenario paper --dtype bf16 --impl ${TK_SPECS:-tilekernels:tile_kernels}"
      timeout --foreground -s INT "${TK_PAPER_LIMIT:-240}" python3 -m mhctool.cli parity --scenario paper --dtype bf16 \
        --kernel mhc --impl "${TK_SPECS:-tilekernels:tile_kernels}" -o "$out/tk-paper.parquet" --top 12 ;;
    bench)
      step "bench 8192x4x4x7168 bf16, graph replay"
      timeout --foreground -s INT "${TK_BENCH_LIMIT:-300}" python3 -m mhctool.cli bench --shape 8192x4x4x7168 \
        --kernel mhc --impl "${TK_BENCH_IMPL:-triton,tilekernels:tile_kernels}" --no-isolate --graph \
        --repeats 10 -o "$out/tk-bench.parquet" ;;
    esac; done
  } 2>&1 | tee "$out/tilekernels.log"
  ;;
spread)
  # issue 63: where a spread run's time goes, and the speed-up over 1, 2 and 4 GPUs (the same rows
  # each time). SPREAD_STEPS picks steps: paper (the paper scenario, Triton, --no-isolate; SPREAD_KERNELS narrows it)
  # gate (scenarios/gpu-gate-suite.toml) and gate-cold (the same, named apart: run first on a fresh machine, it fills
  # the compile caches); SPREAD_GPUS the GPU counts (default: 1 2 and 4 where present).
  {
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    have=$(nvidia-smi -L | wc -l)
    # the lent machine sets PYTHONDONTWRITEBYTECODE=1 and its packages have no compiled bytecode, so
    # every Python process compiles torch's, Triton's and sympy's sources again (sympy alone 3 s);
    # COMPILE_BYTECODE=1 compiles them once first, as a normally built image has them
    if [ -n "${COMPILE_BYTECODE:-}" ]; then
      t0=$SECONDS; python3 -m compileall -q -j 0 "$(python3 -c 'import site; print(site.getsitepackages()[0])')" > /dev/null 2>&1
      echo "compileall of site-packages: $((SECONDS - t0)) s"
    fi
    # each GPU's memory and use, a sample a second, summed up per step
    smi() { nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv,noheader,nounits -l 1 > "$out/smi-$1.csv" & echo $!; }
    smi_sum() { python3 -c "import sys, collections
m, u = collections.defaultdict(int), collections.defaultdict(list)
for line in open(sys.argv[1]):
    i, mem, use = (int(v) for v in line.split(','))
    m[i], _ = max(m[i], mem), u[i].append(use)
print('   GPU max MiB / mean use %:', ', '.join(f'{i}: {m[i]} / {sum(u[i]) / len(u[i]):.0f}' for i in sorted(m)))" "$1"; }
    for s in ${SPREAD_STEPS:-paper gate}; do
      for g in ${SPREAD_GPUS:-1 2 4}; do
        [ "$g" -gt "$have" ] && continue
        vis=$(seq -s, 0 $((g - 1)))
        w=$([ "$g" = 1 ] && echo 1 || echo auto)
        case $s in
        paper)
          step "paper: parity --scenario paper --kernel ${SPREAD_KERNELS:-all} --impl triton --no-isolate, $g GPU(s), --workers $w"
          t0=$SECONDS
          pid=$(smi paper-g$g)
          CUDA_VISIBLE_DEVICES=$vis timeout --foreground -s INT "${PAPER_LIMIT:-200}" python3 -m mhctool.cli parity --scenario paper \
            --kernel "${SPREAD_KERNELS:-all}" --impl triton --no-isolate --workers $w --profile \
            -o "$out/paper-g$g.parquet" --quiet
          echo "paper $g GPU(s) wall $((SECONDS - t0)) s"; kill "$pid"; smi_sum "$out/smi-paper-g$g.csv"; rm -f "$out/smi-paper-g$g.csv" ;;
        gate)
          step "gate: --suite scenarios/gpu-gate-suite.toml, $g GPU(s), --workers $w"
          t0=$SECONDS
          CUDA_VISIBLE_DEVICES=$vis timeout --foreground -s INT "${GATE_LIMIT:-200}" python3 -m mhctool.cli gate \
            --suite scenarios/gpu-gate-suite.toml --workers $w --profile -o "$out/gate-g$g.parquet" --junit /tmp/g.xml --summary /tmp/g.md 2>&1 | tail -16
          echo "gate $g GPU(s) wall $((SECONDS - t0)) s" ;;
        gate-cold)  # the first run of a fresh machine: fills the compile caches on disk
          step "gate (cold caches): --suite scenarios/gpu-gate-suite.toml, $g GPU(s), --workers $w"
          t0=$SECONDS
          CUDA_VISIBLE_DEVICES=$vis timeout --foreground -s INT "${GATE_LIMIT:-200}" python3 -m mhctool.cli gate \
            --suite scenarios/gpu-gate-suite.toml --workers $w --profile -o "$out/gate-cold-g$g.parquet" --junit /tmp/g.xml --summary /tmp/g.md 2>&1 | tail -16
          echo "gate (cold) $g GPU(s) wall $((SECONDS - t0)) s" ;;
        esac
      done
      for g in 2 4; do [ -f "$out/$s-g1.parquet" ] && [ -f "$out/$s-g$g.parquet" ] && cmp_rows "$out/$s-g1.parquet" "$out/$s-g$g.parquet"; done
    done
    # SPREAD_BEFORE: an earlier commit's one-GPU paper report (carried in .device/), against this one's
    [ -n "${SPREAD_BEFORE:-}" ] && [ -f "$out/paper-g1.parquet" ] && { step "paper rows against $SPREAD_BEFORE"; cmp_rows "$SPREAD_BEFORE" "$out/paper-g1.parquet"; cmp_verdicts "$SPREAD_BEFORE" "$out/paper-g1.parquet"; }
  } 2>&1 | tee "$out/spread.log"
  ;;
firstcalls)
  # issue 63: what a second GPU's first calls cost in a process that has made them on one (the
  # question behind threads over GPUs in one process): dev/first_calls.py's passes over GPUs 0, 1, 0,
  # after a run that fills the compile caches; then the two-GPU tests of --ranks
  {
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    for sc in ${FIRST_SCENARIOS:-gpu-gate paper}; do
      k=mhc; [ "$sc" = paper ] && k=h_aggregate,h_post_bda,proj_rms
      for impl in ${FIRST_IMPLS:-triton}; do
        step "first calls: $sc, $impl, filling the caches (GPU 0)"
        python3 dev/first_calls.py "$impl" --scenario "scenarios/$sc.toml" --kernels "$k" --devices 0 2>&1 | grep -E "^(pass|all|Traceback)"
        step "first calls: $sc, $impl, GPUs 0, 1, 0 in one process"
        python3 dev/first_calls.py "$impl" --scenario "scenarios/$sc.toml" --kernels "$k" --devices 0,1,0 2>&1 | grep -E "^(pass|all|Traceback)"
        step "first calls: $sc, $impl, GPU 0 in a fresh process (caches warm)"
        python3 dev/first_calls.py "$impl" --scenario "scenarios/$sc.toml" --kernels "$k" --devices 0 2>&1 | grep -E "^(pass|all|Traceback)"
      done
    done
    step "pytest tests/spread/test_sharded.py (two GPUs)"
    python3 -m pytest -q -p no:cacheprovider -m gpu tests/spread/test_sharded.py -k cuda 2>&1 | tail -4
  } 2>&1 | tee "$out/firstcalls.log"
  ;;
bench)
  # the side-by-side table (issue 18): ours and the libraries' kernels in one run; a library is
  # skipped where it has no such kernel, and its layout conversions are not timed
  ls .wheels/liger_kernel-*.whl >/dev/null 2>&1 && python3 -m pip install --no-deps --no-index -q .wheels/liger_kernel-*.whl 2>&1 | tail -1
  timeout --foreground -s INT "${BENCH_LIMIT:-540}" python3 -m mhctool.cli bench --shape 8192x4x4x7168 \
    --kernel "${BENCH_KERNELS:-mhc}" --impl "${BENCH_IMPL:-triton,triton-tf32,cutile,te:.anchors/te,megatron:.anchors/megatron/m3828,liger:liger_kernel}" \
    --no-isolate --graph --repeats 10 -o "$out/bench.parquet" 2>&1 | tee "$out/bench.log"
  ;;
esac
