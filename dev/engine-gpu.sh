#!/usr/bin/env bash
# `mhctool train --engine megatron:DIR` on the GPU machine, one device call per phase (each call has
# 10 minutes); from the project root, Megatron-core staged and packed as dev/README.md says:
#   run(command="source .device/setup.sh && source dev/mcore_gpu.sh && bash dev/engine-gpu.sh PHASE",
#       carry=[".device", ".anchors/mcore.tar.xz"], kind=...)
# Phases (what the guide's engine section cites):
#   recipe     one GPU: the slow-marked engine tests; the recipe in miniature with Megatron's fused
#              kernels; at a rate where H_res learns (hidden dropout 0, the only setting in which the
#              module calls its h_post_bda entry point), the planted H^T h_post_bda (traced), mhctool's
#              Triton kernels and Megatron's fused kernels, one seed each
#   parallel   two GPUs: the GPU suite, and the recipe at tensor parallel 2 with and without
#              sequence parallelism, Megatron's fused kernels and mhctool's Triton kernels
#   ensembles  four GPUs: over 8 seeds, Megatron's fused kernels, mhctool's Triton kernels and the
#              planted H^T (traced); a Sinkhorn with a NaN token (the engine's first non-finite watch)
#   ablation   four GPUs: dev/mcore_ablation.py's rows ($ROWS, default all 17) as 8-seed ensembles
#   first      one GPU (carry .anchors/megatron too): the first step's check over seeds 0-9
#              (dev/first_step_seeds.py) in mhctool's model and inside Megatron's, what PR 3828's
#              projection returns (dev/proj_rms_dtype.py), and the trajectories of the planted
#              defects the guide's detection table had not run inside Megatron (4 seeds)
#   detect     one GPU (carry .anchors/megatron too): PR 3828's adapter at the first step inside
#              Megatron's model over seeds 0-9 and in mhctool's model at seed 0, and the planted
#              defects' trajectories in mhctool's GPU default model (4 seeds each, side by side)
#   bench      one GPU: `bench --engine` (issue 91): BENCH_STEPS picks steps: toy (the slow-marked
#              GPU test's sizes), recipe (the recipe's sizes, every variant), streams (the overhead
#              over n = 2, 4, 8), recompute (on and off), big (BENCH_BIG: the largest shape timed),
#              probe (Triton's projection backward in place, with PYTHONPATH=dev/probes/proj_rms_inplace),
#              kept (Triton and cuTile with the weight's dtype kept), alone (the projection alone, bf16 and fp32)
# Logs and one archive (results.tar.gz: a run brings back a limited count of files) under $OUT.
set -uo pipefail
phase="${1:?usage: bash dev/engine-gpu.sh recipe|parallel|ensembles|ablation|first|detect|bench}"
O="${OUT:-/tmp/out}"; R=/tmp/results; mkdir -p "$O" "$R"
T=${TIMEOUT:-540}
FAST="--layers 4 --hidden 256 --heads 4 --seq 128 --batch 4 --recipe global_batch=8 --recipe warmup_fraction=0 --recipe hidden_dropout=0 --lr 0.01 --steps 12"
RECIPE="--layers 12 --hidden 512 --heads 8 --seq 256 --batch 4 --steps 8 --seeds 1"
HT=tests/impls/defects.py:h_post_bda_transposed
# a train run in the background: NAME IMPL ARGS...
train() { name=$1 impl=$2; shift 2
  timeout "$T" python3 -m mhctool.cli train --engine "megatron:$MCORE" --impl "$impl" "$@" \
    -o "$R/$name.parquet" --goldens "$R/$name.golden.json" > "$R/$name.log" 2>&1 & }
tests() { name=$1; shift; timeout "$T" python3 -m pytest -q -p no:cacheprovider "$@" > "$R/$name.log" 2>&1 & }
show() { for f in "$@"; do echo "== $f"; grep -v "^train: \|^│\|^┃\|^┏\|^┡\|^└" "$R/$f.log" | tail -12; done; }
nvidia-smi --query-gpu=name --format=csv,noheader > "$R/gpus.txt"
# bench --engine: NAME ARGS... (in the foreground: one timing at a time on the GPU)
bench() { name=$1; shift; t0=$SECONDS
  timeout --foreground -s INT "${BT:-300}" python3 -m mhctool.cli bench --engine "megatron:$MCORE" "$@" -o "$R/$name.parquet" \
    --plot "$R/$name.png" > "$R/$name.log" 2>&1; echo "== $name: exit $?, $((SECONDS - t0)) s"; cat "$R/$name.log" | grep -v "^bench: "; }
case "$phase" in
  bench)
    for s in ${BENCH_STEPS:-toy recipe}; do case $s in
      toy) bench toy --impl triton --layers 2 --hidden 128 --heads 4 --seq 64 --batch 2 --vocab 1024 --recipe global_batch=4 \
             --steps 4 --warmup 2 --entry-steps 2 ;;
      recipe) bench recipe ;;
      streams) bench streams --variant native --variant triton --sweep streams=2,4,8 --no-kernels ;;
      recompute) bench recompute --variant native --variant triton --sweep recompute=true,false --no-kernels ;;
      big) bench big ${BENCH_BIG:---hidden 2048 --heads 16 --seq 4096 --batch 1 --recipe global_batch=8} ;;
      # after the weight's dtype kept (2026-11-29): the two swapped-in variants and the baseline
      kept) bench kept --variant triton --variant cutile --steps 5 --warmup 2 --entry-steps 2 ;;
      # the projection alone at the recipe's step shape, bf16 and fp32 operands (dev upcasts both)
      alone) for d in bf16 fp32; do timeout 200 python3 -m mhctool.cli bench --kernel proj_rms --impl torch,triton,cutile \
               --shape 1024x4x4x512 --dtype $d -o "$R/alone-$d.parquet" 2>&1 | grep -v "^bench: " | tail -12; done ;;
      # Triton's projection backward in place (dev/probes/proj_rms_inplace: put it on PYTHONPATH)
      probe) PROBE_PROJ_RMS="$R/probe" bench probe --variant triton --no-kernels --steps 3 --warmup 2 --entry-steps 0
             python3 -c "import glob, json; [print(f, json.dumps({k: v for k, v in json.load(open(f)).items() if k != 'calls'})) for f in glob.glob('$R/probe/*.json')]" ;;
    esac; done ;;
  recipe)
    tests pytest_engine tests/kernels/test_gpu.py -k megatron_engine --slow
    train recipe megatron $RECIPE
    train ht "$HT" $FAST --seeds 1
    train triton triton $FAST --seeds 1
    train fused megatron $FAST --seeds 1
    wait; show pytest_engine recipe ht triton fused ;;
  parallel)
    tests pytest_gpu -m gpu
    for impl in megatron triton; do
      train "tp2sp_$impl" $impl $RECIPE --ranks 2 --recipe sequence_parallel=true
    done
    train tp2_megatron megatron $RECIPE --ranks 2 --recipe sequence_parallel=false
    wait; show pytest_gpu tp2sp_megatron tp2sp_triton tp2_megatron ;;
  ensembles)
    train fused megatron $FAST --seeds 8
    train triton triton $FAST --seeds 8
    train ht "$HT" $FAST --seeds 8
    train nan tests/impls/defects.py:sinkhorn_nan_last_token $FAST --steps 3 --seeds 1 --no-trace
    sleep 60; nvidia-smi > "$R/nvidia-smi-at-60s.txt"
    wait; show fused triton ht nan ;;
  ablation)
    timeout "$T" python3 dev/mcore_ablation.py "$R/abl" --rows "${ROWS:-0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16}" \
      --seeds 8 --steps 8 --jobs "${JOBS:-64}" --recipe '{"seq": 256}' > "$R/ablation.log" 2>&1
    tail -9 "$R/ablation.log" ;;
  first)
    M3828=.anchors/megatron/m3828 LOG=tests/impls/conventions.py:sinkhorn_log_domain@sinkhorn.eps=0,sinkhorn.domain=log
    python3 dev/proj_rms_dtype.py "megatron:$M3828" > "$R/proj_dtype.log" 2>&1
    SIZES="--size layers=4 --size hidden=256 --size heads=4 --size seq=128 --size batch=4 --size lr=0.01"
    RECIPES="--recipe global_batch=8 --recipe warmup_fraction=0 --recipe hidden_dropout=0"
    for half in 0-4 5-9; do
      timeout "$T" python3 dev/first_step_seeds.py "engine:megatron:$MCORE" --seeds $half $SIZES $RECIPES \
        --impl cutile --impl "$LOG" --impl "megatron:$M3828" --impl tests/impls/defects.py:sinkhorn_one_iteration_short \
        > "$R/engine_first_$half.log" 2>&1 &
    done
    timeout "$T" python3 dev/first_step_seeds.py model --seeds 0-9 --impl "megatron:$M3828+mhctool.kernels.torch.mhc:mapping" \
      --impl "megatron:$M3828" --impl tests/impls/defects.py:sinkhorn_one_iteration_short > "$R/model_first.log" 2>&1 &
    for d in h_post_bda_bf16_bias_grad sinkhorn_eps_1e8 sinkhorn_one_iteration_short; do
      train "traj_$d" "tests/impls/defects.py:$d" $FAST --seeds 4 --workers 4
    done
    wait; cat "$R/proj_dtype.log"; for f in "$R"/*first*.log; do echo "== $f"; cut -c1-330 "$f"; done
    show traj_h_post_bda_bf16_bias_grad traj_sinkhorn_eps_1e8 traj_sinkhorn_one_iteration_short ;;
  detect)
    M3828=.anchors/megatron/m3828
    SIZES="--size layers=4 --size hidden=256 --size heads=4 --size seq=128 --size batch=4 --size lr=0.01"
    RECIPES="--recipe global_batch=8 --recipe warmup_fraction=0 --recipe hidden_dropout=0"
    for half in 0-4 5-9; do
      timeout "$T" python3 dev/first_step_seeds.py "engine:megatron:$MCORE" --seeds $half $SIZES $RECIPES \
        --impl "megatron:$M3828" > "$R/engine_adapter_$half.log" 2>&1 &
    done
    timeout "$T" python3 dev/first_step_seeds.py model --seeds 0 --impl "megatron:$M3828+mhctool.kernels.torch.mhc:mapping" \
      --impl "megatron:$M3828" > "$R/model_adapter.log" 2>&1 &
    for d in sinkhorn_one_pass_backward h_post_bda_bf16_bias_grad h_post_bda_transposed sinkhorn_eps_1e8 \
             sinkhorn_one_iteration_short sinkhorn_nan_last_token; do
      timeout -s INT "$T" python3 -m mhctool.cli train --impl "tests/impls/defects.py:$d" --device cuda --dtype bf16 \
        --seeds 4 -q -o "$R/gpu_$d.parquet" > "$R/gpu_$d.log" 2>&1 &
    done
    wait; for f in "$R"/*adapter*.log "$R"/gpu_*.log; do echo "== $f"; cut -c1-400 "$f"; done ;;
  *) echo "unknown phase $phase"; exit 2 ;;
esac
tar -czf "$O/results.tar.gz" -C /tmp results
