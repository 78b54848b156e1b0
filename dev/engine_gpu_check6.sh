# Issue 77 on four H200s, part 2 (as engine_gpu_check5.sh), all at once:
# - the two-GPU ablation rows (8-12: sequence parallelism off and on, PR 3828 and dev, own path and
#   fused) as ensembles of 8 seeds, a pair of GPUs a run;
# - `train --ranks 2 --recipe sequence_parallel=true`, the recipe as it runs, with Megatron's fused
#   kernels and with mhctool's Triton kernels swapped in;
# - the slow-marked engine tests (one at tensor and sequence parallel 2);
# - over 8 seeds again, judged with the zero findings' block rule: mhctool's Triton kernels, and the
#   planted H^T h_post_bda with its tracing.
# Everything comes back in one file, results.tar.gz (a run brings back a limited count of files).
O=${OUT:-/tmp/out}; R=/tmp/results; mkdir -p "$O" "$R"
timeout 560 python3 dev/mcore_ablation.py "$R/abl2" --rows 8,9,10,11,12 --seeds 8 --steps 8 --jobs 40 \
  --recipe '{"seq": 256}' > "$R/ablation2.log" 2>&1 &
RECIPE="--layers 12 --hidden 512 --heads 8 --seq 256 --batch 4 --steps 8 --seeds 1 --ranks 2 --recipe sequence_parallel=true"
for run in "megatron sp_fused" "triton sp_triton"; do
  set -- $run
  timeout 560 python3 -m mhctool.cli train --engine "megatron:$MCORE" --impl "$1" $RECIPE \
    -o "$R/$2.parquet" --goldens "$R/$2.golden.json" > "$R/$2.log" 2>&1 &
done
FAST="--layers 4 --hidden 256 --heads 4 --seq 128 --batch 4 --recipe global_batch=8 --recipe warmup_fraction=0 --recipe hidden_dropout=0 --lr 0.01 --steps 12"
for run in "triton triton" "tests/impls/defects.py:h_post_bda_transposed ht"; do
  set -- $run
  timeout 560 python3 -m mhctool.cli train --engine "megatron:$MCORE" --impl "$1" $FAST --seeds 8 --workers 8 \
    -o "$R/$2.parquet" --goldens "$R/$2.golden.json" > "$R/$2.log" 2>&1 &
done
timeout 560 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gpu.py -k megatron_engine --slow > "$R/pytest_engine.log" 2>&1 &
sleep 90; nvidia-smi > "$R/nvidia-smi-at-90s.txt"
wait
tar -czf "$O/results.tar.gz" -C /tmp results
for f in sp_fused sp_triton triton ht pytest_engine; do echo "== $f"; grep -v "^train: \|^│\|^┃\|^┏\|^┡\|^└" "$R/$f.log" | tail -9; done
echo "== ablation"; tail -6 "$R/ablation2.log"
