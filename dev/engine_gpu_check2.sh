# The engine with Megatron's hidden dropout off (the only setting in which its module calls the
# h_post_bda entry point while training): a planted H^T h_post_bda, mhctool's Triton kernels and
# Megatron's fused kernels, side by side on one GPU. Same set-up as dev/engine_gpu_check.sh.
O=${OUT:-/tmp/out}; mkdir -p "$O"
FAST="--layers 4 --hidden 256 --heads 4 --seq 128 --batch 4 --recipe global_batch=8 --recipe warmup_fraction=0 --recipe hidden_dropout=0 --lr 0.01 --steps 12 --seeds 1"
for impl in tests/impls/defects.py:h_post_bda_transposed triton megatron; do
  name=$(basename "${impl%%:*}" .py)
  timeout 560 python3 -m mhctool.cli train --engine "megatron:$MCORE" --impl $impl $FAST -o "$O/$name.parquet" > "$O/$name.log" 2>&1 &
done
wait
for f in defects triton megatron; do echo "== $f"; grep -v "^train: \|^│\|^┃\|^┏\|^┡\|^└" "$O/$f.log" | tail -12; done
