# Issue 77 on four H200s, part 4 (as engine_gpu_check5.sh): dev's rows with one factor changed
# (13-16: recompute off, its block size 1, eps 1e-8 on its own path and fused), 8 seeds each, 8 runs a
# GPU; the runs' files come back packed (abl3.tar.gz).
O=${OUT:-/tmp/out}; mkdir -p "$O"
timeout 215 python3 dev/mcore_ablation.py /tmp/abl3 --rows 13,14,15,16 --seeds 8 --steps 8 --jobs 32 \
  --recipe '{"seq": 256}' > "$O/ablation3.log" 2>&1
tar -czf "$O/abl3.tar.gz" -C /tmp abl3
tail -5 "$O/ablation3.log"
