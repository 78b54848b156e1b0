#!/usr/bin/env bash
# Issue 99 when one short GPU call is all there is (session 60: ~450 s): train in mhctool's own
# model with triton[module] (first step and 8 seeds, dropout 0.1) and the planted post-paths there,
# then the module path's profile and the mapping forward's tiles while time is left (BUDGET s).
# From the project root, as dev/fused-path-gpu.sh is run.
set -uo pipefail
O="${OUT:-/tmp/out}"; mkdir -p "$O"; B=${BUDGET:-430}; SECONDS=0
IMPLS="triton[module]" OWN_T=${OWN_T:-120} bash dev/fused-path-gpu.sh own
for step in "profile --backend triton" "mapfwd" "profile --backend cutile" "mapfwd --shape 8192,4,4,7168"; do
  left=$((B - SECONDS)); [ "$left" -lt 40 ] && { echo "== $step: no time left" >> "$O/summary.txt"; continue; }
  t0=$SECONDS; timeout --foreground -s INT $((left < 120 ? left : 120)) python3 dev/step_profile.py $step > "/tmp/p.log" 2>&1
  echo "== step_profile $step: exit $?, $((SECONDS - t0)) s" >> "$O/summary.txt"; tail -40 /tmp/p.log >> "$O/summary.txt"
done
