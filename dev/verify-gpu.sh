#!/usr/bin/env bash
# One GPU call after a change to the module path (sessions 61-62: the recompute memo, Triton's
# remembered dispatch, the residual's gradient handed from the post-path to the pre-path): their
# GPU tests (GPU_TESTS=all: the whole GPU tier); Triton's parity over every family (PARITY=1); the
# host's time (HOST=1: dev/host_gpu.py triton, dispatch on and off); the
# tile sweeps of dev/step_profile.py named in PROFILES (default postbwd: the post-path backward's;
# also fold, mapfwd, postfwd); then the step of VARIANTS (default
# the two [module] variants) for the rest of BUDGET s (default 480).
set -uo pipefail
O="${OUT:-/tmp/out}"; mkdir -p "$O"; B=${BUDGET:-480}; SECONDS=0
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$O/summary.txt"
note() { echo "== $1: exit $2, $SECONDS s" >> "$O/summary.txt"; }
if [ "${GPU_TESTS:-}" = all ]; then  # the whole GPU tier (the fault matrix in it): under 4 minutes
  timeout 280 python3 -m pytest -q -p no:cacheprovider -m gpu > "$O/tests.log" 2>&1; note tests $?
else
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_recompute_memo.py \
    tests/kernels/test_residual_link.py tests/kernels/test_gpu.py -k "memo or remembered or beside or link or linked or bits or dropout" \
    > "$O/tests.log" 2>&1; note tests $?
fi
tail -6 "$O/tests.log" >> "$O/summary.txt"
if [ "${PARITY:-0}" = 1 ]; then
  timeout 150 python3 -m mhctool.cli parity --kernel all --impl triton --device cuda --workers 4 -q \
    -o "$O/parity-triton.parquet" > "$O/parity.log" 2>&1; note parity $?
  tail -8 "$O/parity.log" >> "$O/summary.txt"
fi
if [ "${HOST:-0}" = 1 ]; then
  timeout 60 python3 dev/host_gpu.py triton > "$O/host.txt" 2>&1; note host $?
  grep "remembered\|host per\|host us" "$O/host.txt" >> "$O/summary.txt"
fi
for mode in ${PROFILES:-postbwd}; do  # dev/step_profile.py's tile sweeps (fold, mapfwd, postfwd, postbwd)
  timeout 150 python3 dev/step_profile.py "$mode" > "$O/$mode.txt" 2>&1; note "$mode" $?
  cat "$O/$mode.txt" >> "$O/summary.txt"
done
VARIANTS="${VARIANTS:-triton[module] cutile[module]}" T=$((B - SECONDS)) bash dev/fused-path-gpu.sh step
