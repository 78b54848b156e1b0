#!/usr/bin/env bash
# Issue 99 on the GPU machine (the fused mHC path with its dropout drawn in the kernel), one device
# call per phase; from the project root, cuTile staged and Megatron-core packed as dev/README.md says:
#   run(command="source .device/setup.sh && source dev/mcore_gpu.sh && bash dev/fused-path-gpu.sh PHASE",
#       carry=[".device", ".anchors/mcore.tar.xz"])
# Phases:
#   kernels  the dropout's GPU tests (both backends' kernels against float64, the mask exact); parity
#            of h_post_bda (the default scenario, dropout cases included) and at the paper shape
#            with the recipe's dropout; its timing with and without dropout (graph replays)
#   step     bench --engine at issue 99's shape (12 layers, hidden 2048, 16 heads, seq 4096,
#            micro-batch 1 of 8, n = 4, recompute on, hidden dropout 0.1): every variant, the
#            overhead attributed op by op (VARIANTS picks them; STEP_ARGS adds options)
#   train    train --engine with the whole-module variants at the hidden dropout: the first step
#            and the trajectories (SEEDS, default 4), and the planted post-paths at the first step
#   profile  the module path's kernels, one call at the step's shape (dev/step_profile.py), and the
#            mapping forward's tiles
#   own      the module variants in mhctool's own model (first step and 8 seeds, dropout on), and the
#            planted post-paths at the first step there
#   sweep    the overhead over n = 2, 4, 8 and recompute on and off at the step's shape
#   first    the tests, the dropout's timing and the paper shape's parity of 'kernels', then 'step' for native
#            and the two [module] variants
# Logs under $OUT (a run brings back at most 8 files: the logs are concatenated into one).
set -uo pipefail
phase="${1:?usage: bash dev/fused-path-gpu.sh first|second|kernels|step|train|profile|own|sweep}"
O="${OUT:-/tmp/out}"; R=/tmp/results; mkdir -p "$O" "$R"
SHAPE="--layers 12 --hidden 2048 --heads 16 --seq 4096 --batch 1 --recipe global_batch=8"
FAST="--layers 4 --hidden 256 --heads 4 --seq 128 --batch 4 --recipe global_batch=8 --recipe warmup_fraction=0 --lr 0.01 --steps 12"
D=tests/impls/defects.py
log() { name=$1; shift; t0=$SECONDS; timeout --foreground -s INT "${T:-540}" "$@" > "$R/$name.log" 2>&1
  echo "== $name: exit $?, $((SECONDS - t0)) s" | tee -a "$O/summary.txt"; grep -v "^bench: \|^train: " "$R/$name.log" | tail -"${TAIL:-40}" >> "$O/summary.txt"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$O/summary.txt"
case "$phase" in
  kernels)
    log tests python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gpu.py -k dropout
    log small python3 -m mhctool.cli parity --kernel h_post_bda --impl triton --impl cutile --device cuda -q -o "$R/small.parquet"
    log bench0 python3 -m mhctool.cli bench --kernel h_post_bda --impl torch,triton,cutile --graph --repeats 20 -o "$O/bench-nodrop.parquet"
    log bench1 python3 -m mhctool.cli bench --kernel h_post_bda --impl torch,triton,cutile --graph --repeats 20 \
      --knob dropout=0.1 --knob dropout_seed=1234 --knob dropout_offset=4294967000 -o "$O/bench-drop.parquet"
    TAIL=16 log paper python3 -m mhctool.cli parity --scenario paper --kernel h_post_bda --impl triton --impl cutile \
      --device cuda --no-isolate --top 6 -o "$O/paper-hpb.parquet" ;;
  first)  # the first call of a session: the kernels' GPU tests, dropout timing and parity at the paper
          # shape, then the step of four variants
    log tests python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gpu.py -k dropout
    log bench1 python3 -m mhctool.cli bench --kernel h_post_bda --impl triton,cutile --graph --repeats 20 \
      --knob dropout=0.1 --knob dropout_seed=1234 --knob dropout_offset=4294967000 -o "$O/bench-drop.parquet"
    T=100 TAIL=16 log paper python3 -m mhctool.cli parity --scenario paper --kernel h_post_bda --impl triton \
      --impl cutile --device cuda --no-isolate --top 6 -o "$O/paper-hpb.parquet"
    T=420 TAIL=60 log step python3 -m mhctool.cli bench --engine "megatron:$MCORE" $SHAPE --steps 5 --warmup 2 \
      --entry-steps 1 --variant native --variant "triton[module]" --variant "cutile[module]" --no-kernels \
      -o "$O/step.parquet" --plot "$O/step.png" ;;
  second)  # after the first: the cuTile dropout again (its launch's int32 scalars), the paper shape's parity,
           # then train's first step and trajectories of triton[module] in Megatron's GPT, and the planted post-paths
    T=60 log tests python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gpu.py -k dropout
    [ -n "${CUTILE_BENCH:-}" ] && T=40 log bench1 python3 -m mhctool.cli bench --kernel h_post_bda --impl cutile \
      --graph --repeats 20 --knob dropout=0.1 --knob dropout_seed=1234 --knob dropout_offset=4294967000 \
      -o "$O/bench-drop-cutile.parquet"
    T=90 TAIL=16 log paper python3 -m mhctool.cli parity --scenario paper --kernel h_post_bda --impl triton \
      --impl cutile --device cuda --no-isolate --top 6 -o "$O/paper-hpb.parquet"
    T=${TRAIN_T:-150} TAIL=14 log "train-triton[module]" python3 -m mhctool.cli train --engine "megatron:$MCORE" \
      --impl "triton[module]" $FAST --seeds "${SEEDS:-1}" -o "$O/train-triton-module.parquet"
    for d in ${PLANTED:-h_post_bda_dropout_fresh_mask_again}; do
      T=60 TAIL=6 log "planted-$d" python3 -m mhctool.cli train --engine "megatron:$MCORE" --impl "$D:$d[module]" \
        $FAST --steps 2 --seeds 1 --no-trace -o "$R/planted-$d.parquet"
    done ;;
  step)
    args=(); for v in ${VARIANTS:-}; do args+=(--variant "$v"); done
    T=${T:-570} TAIL=60 log step python3 -m mhctool.cli bench --engine "megatron:$MCORE" $SHAPE --steps 5 --warmup 2 \
      --entry-steps 1 "${args[@]}" ${STEP_ARGS:---no-kernels} -o "$O/step.parquet" --plot "$O/step.png" ;;
  train)
    for impl in ${IMPLS:-triton[module] cutile[module]}; do
      TAIL=14 log "train-$impl" python3 -m mhctool.cli train --engine "megatron:$MCORE" --impl "$impl" $FAST \
        --seeds "${SEEDS:-4}" -o "$R/train-$impl.parquet"
    done
    for d in h_post_bda_dropout_fresh_mask_again h_post_bda_transposed h_post_bda_dropout_bias_outside; do
      TAIL=6 log "planted-$d" python3 -m mhctool.cli train --engine "megatron:$MCORE" --impl "$D:$d[module]" $FAST \
        --steps 2 --seeds 1 --no-trace -o "$R/planted-$d.parquet"
    done ;;
  profile)  # the module path's kernels one call at the step's shape, and the mapping forward's tiles
    for b in triton cutile; do T=120 TAIL=30 log "profile-$b" python3 dev/step_profile.py profile --backend $b; done
    T=120 TAIL=12 log mapfwd-step python3 dev/step_profile.py mapfwd
    T=120 TAIL=12 log mapfwd-paper python3 dev/step_profile.py mapfwd --shape 8192,4,4,7168 ;;
  own)  # the module variants in mhctool's own model (its GPU default, 30 steps), the post-path's dropout on
    for impl in ${IMPLS:-triton[module] cutile[module]}; do
      T=${OWN_T:-240} TAIL=10 log "own-$impl" python3 -m mhctool.cli train --impl "$impl" --device cuda --steps 30 \
        --seeds "${SEEDS:-8}" --knob h_post_bda.dropout=0.1 -o "$O/own-${impl%%[*}-module.parquet"
    done
    for d in ${OWN_PLANTED-h_post_bda_dropout_fresh_mask_again h_post_bda_transposed h_post_bda_dropout_bias_outside}; do
      T=90 TAIL=4 log "own-planted-$d" python3 -m mhctool.cli train --impl "$D:$d[module]" --device cuda --steps 2 \
        --seeds 1 --knob h_post_bda.dropout=0.1 --no-trace -o "$R/own-planted-$d.parquet"
    done ;;
  sweep)
    T=570 log sweep python3 -m mhctool.cli bench --engine "megatron:$MCORE" $SHAPE --steps 4 --warmup 2 --entry-steps 1 \
      --variant native --variant "triton[module]" --sweep "${SWEEP:-streams=2,4,8}" --no-kernels -o "$O/sweep.parquet" \
      --plot "$O/sweep.png" ;;
esac
cp "$O/summary.txt" "$O/summary-$phase.txt" 2>/dev/null || true
