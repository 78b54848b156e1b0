# Issue 77's engine on one GPU (run on the GPU machine from the project root, after
# `source .device/setup.sh && source dev/mcore_gpu.sh`): writes logs under ${OUT:-/tmp/out}.
# All at once on the one GPU: the slow-marked engine tests, the recipe in miniature (Megatron's fused
# kernels against its own path and the float64 one), a planted H^T h_post_bda and mhctool's Triton
# kernels swapped in at a rate where H_res learns, and the fast-math probe.
O=${OUT:-/tmp/out}; mkdir -p "$O"
timeout 560 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gpu.py -k megatron_engine --slow > "$O/pytest_engine.log" 2>&1 &
timeout 560 python3 -m mhctool.cli train --engine "megatron:$MCORE" --impl megatron --layers 12 --hidden 512 --heads 8 --seq 256 \
  --batch 4 --steps 8 --seeds 1 -o "$O/recipe.parquet" --goldens "$O/recipe.golden.json" > "$O/recipe.log" 2>&1 &
FAST="--layers 4 --hidden 256 --heads 4 --seq 128 --batch 4 --recipe global_batch=8 --recipe warmup_fraction=0 --lr 0.01 --steps 12 --seeds 1"
timeout 560 python3 -m mhctool.cli train --engine "megatron:$MCORE" --impl tests/impls/defects.py:h_post_bda_transposed $FAST \
  -o "$O/ht.parquet" > "$O/ht.log" 2>&1 &
timeout 560 python3 -m mhctool.cli train --engine "megatron:$MCORE" --impl triton $FAST -o "$O/triton.parquet" > "$O/triton.log" 2>&1 &
python3 dev/fast_math_probe.py "$O" > "$O/fast_math.log" 2>&1 &
wait
for f in pytest_engine recipe ht triton; do echo "== $f"; tail -12 "$O/$f.log"; done
echo "== fast math"; grep -A3 "on \[-1, 1\]\|Sinkhorn expf(fminf(x, 20)) at 8192" "$O/fast_math.txt" | head -24
