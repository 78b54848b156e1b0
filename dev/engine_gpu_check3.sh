# On two GPUs (nvidia-h200-x2), same set-up as dev/engine_gpu_check.sh: the GPU test suite, and the
# recipe at tensor parallel 2 with and without sequence parallelism, side by side.
O=${OUT:-/tmp/out}; mkdir -p "$O"
timeout 560 python3 -m pytest -m gpu -q -p no:cacheprovider > "$O/pytest_gpu.log" 2>&1 &
R="--impl megatron --layers 12 --hidden 512 --heads 8 --seq 256 --batch 4 --steps 8 --seeds 1 --recipe tp=2"
timeout 560 python3 -m mhctool.cli train --engine "megatron:$MCORE" $R --recipe sequence_parallel=true -o "$O/tp2sp.parquet" > "$O/tp2sp.log" 2>&1 &
timeout 560 python3 -m mhctool.cli train --engine "megatron:$MCORE" $R --recipe sequence_parallel=false -o "$O/tp2.parquet" > "$O/tp2.log" 2>&1 &
wait
tail -3 "$O/pytest_gpu.log"
for f in tp2sp tp2; do echo "== $f"; grep -v "^train: \|^┃\|^┏\|^┡\|^└" "$O/$f.log" | tail -16; done
