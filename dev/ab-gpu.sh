#!/usr/bin/env bash
# A change timed against what it replaces, in one GPU call: the working tree ("new"), then the tree
# with PATCH reversed ("old"; PATCH is `git diff BASE > PATCH` of the change, untracked in the root
# so that it travels), the same steps each side. From the project root, Megatron-core packed:
#   run(command="source .device/setup.sh >/dev/null 2>&1; source dev/mcore_gpu.sh; bash dev/ab-gpu.sh PATCH",
#       carry=[".device", ".anchors/mcore.tar.xz"])
# STEPS (default "tests postbwd bench step"; OLD_STEPS for the old side, default STEPS less the tests):
#   tests    the GPU tests matching TESTS_K (the new side only)
#   postbwd  dev/step_profile.py postbwd (the post-path backward's tiles at the step's call)
#   bench    bench of h_post_bda's Triton backward at the paper shape (graph replays): bf16 with the
#            recipe's dropout, fp32 without (bench-fp32: the latter alone)
#   step     bench --engine at issue 99's shape, plain and VARIANTS (default triton[module])
# Logs and reports under $OUT, named by side; summary.txt gathers the lines that matter.
set -uo pipefail
P=${1:?usage: bash dev/ab-gpu.sh PATCH}
O="${OUT:-/tmp/out}"; mkdir -p "$O"; S="$O/summary.txt"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> "$S"
SHAPE="--layers 12 --hidden 2048 --heads 16 --seq 4096 --batch 1 --recipe global_batch=8"
KEY="--knob dropout=0.1 --knob dropout_seed=1234 --knob dropout_offset=4294967000"
log() { name=$1; t=$2; shift 2; t0=$SECONDS; timeout --foreground -s INT "$t" "$@" > "$O/$name.log" 2>&1
  echo "== $name: exit $?, $((SECONDS - t0)) s" >> "$S"; }
side() {
  s=$1
  for step in $2; do
    case $step in
      tests) [ "$s" = new ] && log tests 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_gpu.py \
               -k "${TESTS_K:-h_post_bda or dropout}" && tail -3 "$O/tests.log" >> "$S" ;;
      postbwd) log "postbwd-$s" 150 python3 dev/step_profile.py postbwd; grep -v "^$" "$O/postbwd-$s.log" >> "$S" ;;
      bench|bench-fp32)
        [ "$step" = bench ] && log "bench-bf16-$s" 90 python3 -m mhctool.cli bench --kernel h_post_bda --impl triton --direction bwd --graph \
          --repeats 20 $KEY -o "$O/bench-bf16-$s.parquet"
        log "bench-fp32-$s" 90 python3 -m mhctool.cli bench --kernel h_post_bda --impl triton --direction bwd --graph \
          --repeats 20 --dtype fp32 -o "$O/bench-fp32-$s.parquet"
        grep -h "h_post_bda .* bwd .*triton" "$O"/bench-*-"$s".log >> "$S" ;;
      step)
        args=(); for v in ${VARIANTS:-triton[module]}; do args+=(--variant "$v"); done
        log "step-$s" "${STEP_T:-200}" python3 -m mhctool.cli bench --engine "megatron:$MCORE" $SHAPE --steps 5 \
          --warmup 2 --entry-steps 1 "${args[@]}" --no-kernels -o "$O/step-$s.parquet"
        grep -E "^bench --engine|^│ (plain|triton|cutile|native)" "$O/step-$s.log" | head -5 >> "$S" ;;
    esac
  done
}
echo "--- new (the working tree)" >> "$S"; side new "${STEPS:-tests postbwd bench step}"
patch -s -R -p1 < "$P" || { echo "the patch did not reverse" >> "$S"; exit 1; }
echo "--- old (the patch reversed)" >> "$S"; side old "${OLD_STEPS:-${STEPS:-postbwd bench step}}"
