#!/usr/bin/env bash
# Packs what `scripts/gpu-suite.sh` runs into one archive that fits the device tool's working
# tree (64 MiB with the repository, which is about 42 MiB): .gpu-carry/gpu.tar.xz, carried with
# `carry: [".gpu-carry"]` (git ignores it through .git/info/exclude). The CUDA binaries share
# most of their bytes (candle's kernels, the models), so one xz stream with a dictionary larger
# than the whole tar stores each shared part once.
#
#   scripts/pack-gpu.sh [BIN]          BIN: the binaries of `scripts/build-cuda.sh --tests`
#                                      (default .gpu/); PACK lists globs in BIN to take,
#                                      DEST the folder to write (default .gpu-carry): a second
#                                      set of binaries for a second call when all of them and
#                                      the repository exceed the working tree's 64 MiB
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${1:-.gpu}
PACK=${PACK:-"bench-ragged test-cuda-* test-*golden* test-nccl-* test-wavefront_schemes-* bench-slot-diffusion bench-masked-diffusion bench-recurrent-memory bench-diffusion-gemma bench-recurrent-depth bench-block-diffusion"}
DEST=${DEST:-.gpu-carry}
mkdir -p "$DEST"
files=()
for g in $PACK; do
  for f in "$BIN"/$g; do [ -e "$f" ] && files+=("$(basename "$f")"); done
done
runner=../shared/gpu/run-on-gpu.sh
[ -x "$runner" ] && cp "$runner" "$BIN/run-on-gpu.sh" && files+=(run-on-gpu.sh)
bytes=$(cd "$BIN" && cat "${files[@]}" | wc -c)
dict=$(( (bytes / 1048576 + 64) ))
echo "packing ${#files[@]} files, $((bytes / 1048576)) MiB, xz dictionary ${dict} MiB" >&2
tar cf - -C "$BIN" "${files[@]}" | xz -T1 --lzma2=preset=9,dict=${dict}MiB >"$DEST/gpu.tar.xz"
ls -la "$DEST/gpu.tar.xz" >&2
