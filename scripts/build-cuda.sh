#!/usr/bin/env bash
# Builds the GPU binaries (`cuda` feature) on a machine without a GPU or a system CUDA toolkit.
#
#   scripts/build-cuda.sh [--tests] [OUT_DIR]
#
# 1. Assembles a CUDA 13.0 build kit from PyPI wheels under $WAVEFRONT_CUDA_KIT (default
#    ~/.cache/wavefront/cuda-kit, reused when present): nvcc 13.0 (the H100 hosts' driver is
#    CUDA 13.0 and may refuse newer PTX), headers, cudart, cublas, curand, nvrtc, NCCL 2.27.
#    No wheel ships libcuda (it comes with the driver), so a stub is built for linking only;
#    it must never be on a GPU machine's library path.
# 2. Builds `wavefront` and the bench binaries with `--features cuda` for sm_90 (H100/H200;
#    override with CUDA_COMPUTE_CAP) into target-cuda/, and copies them, stripped, to OUT_DIR
#    (default .gpu/, which git ignores). With --tests it also builds the golden and kernel test
#    binaries and copies them (run them there with WAVEFRONT_TEST_DEVICE=cuda:0).
#
# On the GPU machine, put its CUDA 13 libraries and NCCL on LD_LIBRARY_PATH (PyTorch's wheels
# ship them) and run the binaries with `--device cuda:0` (bf16 by default there).
set -euo pipefail
cd "$(dirname "$0")/.."
TESTS=0
if [ "${1:-}" = "--tests" ]; then TESTS=1; shift; fi
OUT=${1:-.gpu}
KIT=${WAVEFRONT_CUDA_KIT:-$HOME/.cache/wavefront/cuda-kit}
V=13.0.88

if [ ! -x "$KIT/root/bin/nvcc" ]; then
  echo "assembling the CUDA kit in $KIT (about 870 MB of wheels)" >&2
  python3 -m pip install -q --no-deps --target "$KIT/site" \
    nvidia-cuda-nvcc==$V nvidia-cuda-crt==$V nvidia-nvvm==$V nvidia-cuda-nvrtc==$V \
    nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85 nvidia-curand==10.4.0.35 \
    nvidia-cublas==13.0.0.19 nvidia-nccl-cu13==2.27.7
  nv=$KIT/site/nvidia
  mkdir -p "$KIT/root/lib64" "$KIT/static"
  ln -sfn "$nv/cu13/bin" "$KIT/root/bin"
  ln -sfn "$nv/cu13/include" "$KIT/root/include"
  cp -f "$nv/cu13/lib/libcudart_static.a" "$KIT/static/libcudart.a"
  for l in cudart.so.13 nvrtc.so.13 curand.so.10 cublas.so.13 cublasLt.so.13; do
    ln -sf "$nv/cu13/lib/lib$l" "$KIT/root/lib64/lib${l%%.so*}.so"
  done
  ln -sf "$nv/nccl/lib/libnccl.so.2" "$KIT/root/lib64/libnccl.so"
  # Link-time stand-in for the driver library: every cu* entry point cudarc declares, each
  # returning CUDA_ERROR_STUB_LIBRARY (34).
  cargo fetch -q
  sys=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/cudarc-0.19.10/src/driver/sys/mod.rs | head -1)
  grep -o "fn cu[A-Za-z0-9_]*" "$sys" | sort -u | sed 's/^fn \(.*\)/int \1(void){return 34;}/' >"$KIT/libcuda_stub.c"
  gcc -shared -fPIC -O2 -Wl,-soname,libcuda.so.1 -o "$KIT/root/lib64/libcuda.so" "$KIT/libcuda_stub.c"
fi

export CUDA_HOME=$KIT/root PATH=$KIT/root/bin:$PATH
export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90} CUDART_STATIC_DIR=$KIT/static CUDAFORGE_THREADS=${CUDAFORGE_THREADS:-2}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target-cuda}
nvcc --version | tail -1 >&2

bins=(wavefront bench-recurrent-depth bench-masked-diffusion bench-recurrent-memory bench-slot-diffusion bench-block-diffusion bench-diffusion-gemma bench-ragged)
args=()
for b in "${bins[@]}"; do args+=(--bin "$b"); done
cargo build --release --features cuda -p wavefront -p wavefront-bench -p wavefront-kernels "${args[@]}"
mkdir -p "$OUT"
for b in "${bins[@]}"; do strip -o "$OUT/$b" "$CARGO_TARGET_DIR/release/$b"; done

if [ "$TESTS" = 1 ]; then
  cargo test --release --features cuda --no-run --message-format=json \
    -p wavefront-models -p wavefront-schemes -p wavefront-kernels 2>/dev/null |
    python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        print(m["executable"])' |
    while read -r exe; do strip -o "$OUT/test-$(basename "$exe")" "$exe"; done
fi
ls -la "$OUT" >&2
