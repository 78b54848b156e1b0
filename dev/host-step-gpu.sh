#!/usr/bin/env bash
# Issue 99 in one GPU call (BUDGET s, default 560): where the host's time goes on the module path
# (dev/host_gpu.py, both backends), the step of native and the two [module] variants (the figure
# against the paper's 6.7%), then mhctool's own model with triton[module] for the rest of the time.
# From the project root, cuTile and Megatron-core staged as dev/fused-path-gpu.sh says.
set -uo pipefail
O="${OUT:-/tmp/out}"; mkdir -p "$O"; B=${BUDGET:-560}; SECONDS=0
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$O/host.txt"
for b in triton cutile; do
  echo "## $b" >> "$O/host.txt"; timeout --foreground -s INT 120 python3 dev/host_gpu.py $b >> "$O/host.txt" 2>&1
  echo "== host $b: exit $?, $SECONDS s" >> "$O/host.txt"
done
VARIANTS="${VARIANTS:-native triton[module] cutile[module]}" T=${STEP_T:-330} bash dev/fused-path-gpu.sh step
left=$((B - SECONDS - 15))
if [ "$left" -gt 60 ]; then
  IMPLS="triton[module]" OWN_T=$left OWN_PLANTED="" bash dev/fused-path-gpu.sh own
else
  echo "== own: no time left ($left s)" >> "$O/summary.txt"
fi
echo "== total $SECONDS s" >> "$O/summary.txt"
