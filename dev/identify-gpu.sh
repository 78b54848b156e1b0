#!/usr/bin/env bash
# identify on the real libraries, on the GPU machine (issue 90: their identifications unchanged
# after identify's changes). Two calls, by what each carries (.device and .tilelang pass 64 MiB together):
#   run(command="bash dev/identify-gpu.sh triton", carry=[".tilelang", ".anchors/te", ".wheels"])
#       TransformerEngine and Liger-Kernel (Triton), then DeepSeek's TileKernels (TileLang)
#   (composites: the same carry, the composites alone)
#   run(command="source .device/setup.sh && bash dev/identify-gpu.sh megatron", carry=[".device", ".anchors/megatron"])
#       Megatron-LM's PR 3828 (cuTile) and dev branch
# Each identification's lines and its wall time go to $OUT/identify-PHASE.log.
set -uo pipefail
O="${OUT:-out}"; mkdir -p "$O"
# mhctool installed (its references/ and kernels/ are packages only then); .device/setup.sh does it too
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v "as the 'root' user"
id() { k=$1 i=$2; shift 2; t0=$SECONDS; echo "=== identify --kernel $k --impl $i $*"
  NVTE_DISABLE_TRITON_AUTOTUNING=1 timeout -s INT "${ID_LIMIT:-100}" python3 -m mhctool.cli identify --kernel "$k" \
    --impl "$i" -q -o "$O/id-$k-${i%%:*}.parquet" "$@" 2>&1 | cut -c1-2000
  echo "--- $((SECONDS - t0)) s"; }
case "${1:?triton|composites|after|megatron}" in
  composites) {  # the composites alone (TE, Liger, TileKernels)
    python3 -m pip install --no-deps --no-index -q .wheels/liger_kernel-*.whl 2>&1 | grep -v "as the 'root' user"
    id mix_aggregate te:.anchors/te
    id mix_aggregate liger:liger_kernel
    id mapping_sinkhorn liger:liger_kernel
    mkdir -p /tmp/tl && tar -xJf .tilelang/tilelang-site.tar.xz -C /tmp/tl
    PYTHONPATH="/tmp/tl${PYTHONPATH:+:$PYTHONPATH}" id mix_aggregate tilekernels:tile_kernels --dtype bf16 --shape 16x2x4x256
  } 2>&1 | tee "$O/identify-composites.log" ;;
  after) {  # what session 54's 'itself off' fix (cc451f5) and hint fix (fea5651) touch: TE's [tf32] mapping and
    # pre-path, TileKernels' bf16 pre-path, h_post_bda and h_aggregate
    id mapping te:.anchors/te
    id mix_aggregate te:.anchors/te
    mkdir -p /tmp/tl && tar -xJf .tilelang/tilelang-site.tar.xz -C /tmp/tl
    export PYTHONPATH="/tmp/tl${PYTHONPATH:+:$PYTHONPATH}"
    for k in mix_aggregate h_post_bda h_aggregate; do id $k tilekernels:tile_kernels --dtype bf16 --shape 16x2x4x256; done
  } 2>&1 | tee "$O/identify-after.log" ;;
  triton) {
    python3 -m pip install --no-deps --no-index -q .wheels/liger_kernel-*.whl 2>&1 | grep -v "as the 'root' user"
    id mapping_sinkhorn liger:liger_kernel
    id mix_aggregate liger:liger_kernel
    id mix_aggregate te:.anchors/te
    id mapping te:.anchors/te
    id sinkhorn te:.anchors/te
    id h_post_bda te:.anchors/te
    mkdir -p /tmp/tl && tar -xJf .tilelang/tilelang-site.tar.xz -C /tmp/tl
    export PYTHONPATH="/tmp/tl${PYTHONPATH:+:$PYTHONPATH}"
    for spec in "sinkhorn fp32" "mapping bf16" "mix_aggregate bf16" "h_post_bda bf16" "h_aggregate bf16"; do
      set -- $spec; id "$1" tilekernels:tile_kernels --dtype "$2" --shape 16x2x4x256
    done
  } 2>&1 | tee "$O/identify-triton.log" ;;
  megatron) {
    id sinkhorn megatron:.anchors/megatron/m3828
    id sinkhorn megatron:.anchors/megatron/dev
    id proj_rms megatron:.anchors/megatron/m3828
    id mapping megatron:.anchors/megatron/dev --shape 8x2x4x67
  } 2>&1 | tee "$O/identify-megatron.log" ;;
esac
