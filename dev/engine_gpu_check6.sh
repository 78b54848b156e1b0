# Issue 77 on four H200s, part 2 (as engine_gpu_check5.sh): at tensor parallel 2, a pair of GPUs a
# trajectory, all at once:
# - the two-GPU ablation rows (8-12: sequence parallelism off and on, PR 3828 and dev, own path and
#   fused) as ensembles of 8 seeds;
# - `train --ranks 2 --recipe sequence_parallel=true`, the recipe as it runs, with Megatron's fused
#   kernels and with mhctool's Triton kernels swapped in;
# - the slow-marked engine tests.
O=${OUT:-/tmp/out}; mkdir -p "$O"
timeout 560 python3 dev/mcore_ablation.py /tmp/abl2 --rows 8,9,10,11,12 --seeds 8 --steps 8 --jobs 40 \
  --recipe '{"seq": 256}' > "$O/ablation2.log" 2>&1 &
RECIPE="--layers 12 --hidden 512 --heads 8 --seq 256 --batch 4 --steps 8 --seeds 1 --ranks 2 --recipe sequence_parallel=true"
for run in "megatron sp_fused" "triton sp_triton"; do
  set -- $run
  timeout 560 python3 -m mhctool.cli train --engine "megatron:$MCORE" --impl "$1" $RECIPE \
    -o "$O/$2.parquet" --goldens "$O/$2.golden.json" > "$O/$2.log" 2>&1 &
done
timeout 560 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gpu.py -k megatron_engine --slow > "$O/pytest_engine.log" 2>&1 &
sleep 90; nvidia-smi > "$O/nvidia-smi-at-90s.txt"
wait
tar -czf "$O/abl2.tar.gz" -C /tmp abl2
for f in sp_fused sp_triton pytest_engine; do echo "== $f"; grep -v "^train: \|^│\|^┃\|^┏\|^┡\|^└" "$O/$f.log" | tail -12; done
echo "== ablation"; tail -7 "$O/ablation2.log"
