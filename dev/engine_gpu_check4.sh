# The planted H^T h_post_bda inside Megatron's model, traced (same set-up as dev/engine_gpu_check.sh).
O=${OUT:-/tmp/out}; mkdir -p "$O"
FAST="--layers 4 --hidden 256 --heads 4 --seq 128 --batch 4 --recipe global_batch=8 --recipe warmup_fraction=0 --recipe hidden_dropout=0 --lr 0.01 --steps 12 --seeds 1"
timeout 560 python3 -m mhctool.cli train --engine "megatron:$MCORE" --impl tests/impls/defects.py:h_post_bda_transposed $FAST \
  -o "$O/traced.parquet" > "$O/traced.log" 2>&1
grep -v "^train: \|^│\|^┃\|^┏\|^┡\|^└" "$O/traced.log" | tail -9
