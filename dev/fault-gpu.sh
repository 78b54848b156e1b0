#!/usr/bin/env bash
# Issue 89's GPU fault matrix and the misaligned-address extension, in one device call:
#   run(command="source .device/setup.sh && bash dev/fault-gpu.sh", carry=[".device"])
# Logs, the table (fault-matrix.md) and one archive of every run's output and report under $OUT.
set -uo pipefail
O="${OUT:-/tmp/out}"; M=/tmp/matrix; rm -rf "$M"; mkdir -p "$O" "$M"
t0=$(date +%s)
python3 tests/kernels/test_fault_matrix.py "$M" > "$O/matrix.log" 2>&1
echo "matrix: $(( $(date +%s) - t0 )) s" >> "$O/matrix.log"
t0=$(date +%s)
python3 -m mhctool.cli parity --kernel sinkhorn,h_aggregate,h_post_bda --impl tests/impls/gpu_misaligned_ext.py \
  --device cuda -o "$M/ext.parquet" > "$M/ext.log" 2>&1
echo "exit $?, $(( $(date +%s) - t0 )) s" >> "$M/ext.log"
cp "$M/ext.log" "$O/" 2>/dev/null; cp "$M/fault-matrix.md" "$O/" 2>/dev/null
tar czf "$O/matrix.tgz" -C "$M" .
