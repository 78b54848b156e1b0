# Issue 77 on four H200s, part 1 (GPU machine, project root, after `source .device/setup.sh &&
# source dev/mcore_gpu.sh`); logs under ${OUT:-/tmp/out}. All at once, dealt over the GPUs:
# - the one-GPU ablation rows (0-7) as ensembles of 8 seeds;
# - inside Megatron's model over 8 seeds: two correct implementations (Megatron's fused kernels,
#   mhctool's Triton kernels swapped in) and the planted H^T h_post_bda, at a rate where H_res learns;
# - a Sinkhorn with a NaN token, to see the engine's first non-finite output and gradient.
O=${OUT:-/tmp/out}; mkdir -p "$O"
nvidia-smi --query-gpu=name --format=csv,noheader > "$O/gpus.txt"
# the runs' files stay on the machine; they come back packed (abl.tar.gz)
timeout 560 python3 dev/mcore_ablation.py /tmp/abl --rows 0,1,2,3,4,5,6,7 --seeds 8 --steps 8 --jobs 64 \
  --recipe '{"seq": 256}' > "$O/ablation.log" 2>&1 &
FAST="--layers 4 --hidden 256 --heads 4 --seq 128 --batch 4 --recipe global_batch=8 --recipe warmup_fraction=0 --recipe hidden_dropout=0 --lr 0.01 --steps 12"
for run in "megatron fused" "triton triton" "tests/impls/defects.py:h_post_bda_transposed ht"; do
  set -- $run
  timeout 560 python3 -m mhctool.cli train --engine "megatron:$MCORE" --impl "$1" $FAST --seeds 8 --workers 8 \
    -o "$O/$2.parquet" --goldens "$O/$2.golden.json" > "$O/$2.log" 2>&1 &
done
timeout 560 python3 -m mhctool.cli train --engine "megatron:$MCORE" --impl tests/impls/defects.py:sinkhorn_nan_last_token \
  $FAST --steps 3 --seeds 1 --no-trace -o "$O/nan.parquet" > "$O/nan.log" 2>&1 &
sleep 60; nvidia-smi > "$O/nvidia-smi-at-60s.txt"
wait
tar -czf "$O/abl.tar.gz" -C /tmp abl
for f in fused triton ht nan; do echo "== $f"; grep -v "^train: \|^│\|^┃\|^┏\|^┡\|^└" "$O/$f.log" | tail -14; done
echo "== ablation"; tail -9 "$O/ablation.log"
