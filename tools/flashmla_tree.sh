#!/usr/bin/env bash
# A FlashMLA source tree small enough to carry to the GPU machine (about 30 MB): the csrc/
# headers and kernels of FlashMLA that jaxkv's build reads (jaxkv.cuda.flashmla: the sm90
# sparse decode in one library for jax.ffi and torch_bridge.flashmla) and CUTLASS's include/.
#
#   tools/flashmla_tree.sh FLASHMLA_CHECKOUT [CUTLASS_CHECKOUT] [DEST=.upstream/flashmla]
#
# CUTLASS_CHECKOUT defaults to FLASHMLA_CHECKOUT/csrc/cutlass (the submodule). Then
# FLASHMLA_SRC=$PWD/.upstream/flashmla. Nothing of FlashMLA is committed (.upstream/ is ignored).
set -euo pipefail
src=${1:?usage: $0 FLASHMLA_CHECKOUT [CUTLASS_CHECKOUT] [DEST]}
cutlass=${2:-$src/csrc/cutlass}
dest=${3:-.upstream/flashmla}
[ -f "$src/csrc/sm90/decode/sparse_fp8/splitkv_mla.cuh" ] || { echo "$src: not a FlashMLA checkout (no csrc/sm90/decode/sparse_fp8)"; exit 1; }
[ -f "$cutlass/include/cute/tensor.hpp" ] || { echo "$cutlass: no CUTLASS include/ (init FlashMLA's csrc/cutlass submodule or pass a CUTLASS checkout)"; exit 1; }
rm -rf "$dest" && mkdir -p "$dest/csrc/cutlass"
cp -r "$src"/csrc/{api,kerutils,sm90,smxx} "$src"/csrc/*.h "$dest/csrc/"
cp -r "$cutlass/include" "$dest/csrc/cutlass/"
du -sh "$dest"
