#!/usr/bin/env bash
# On the GPU machine: the CUDA checks and the H100 figures of the GPU path, run from the
# binaries `scripts/build-cuda.sh --tests` left in BIN (default .gpu/), in the repository root.
#
#   scripts/gpu-suite.sh checks    golden suites of every family on cuda:0 (both attention
#                                  kernels), the kernels against their CPU references, NCCL at
#                                  one rank (the nccl test and every tensor-parallel golden)
#   scripts/gpu-suite.sh figures   the benches at the real model shapes, bf16:
#                                  Huginn-0125, LLaDA-8B, ARMT on Llama-3.2-1B (32k prefill),
#                                  ReFusion on Qwen3-8B (sdpa and ragged attention)
#   scripts/gpu-suite.sh all       both
#
# Each step's output goes to RESULTS/<step>.log (RESULTS: $OUT when the device tool sets it,
# else gpu-results/), and one line per step with its exit status and seconds to
# RESULTS/summary.txt. RUNNER starts a binary with the machine's CUDA 13 and NCCL libraries on
# LD_LIBRARY_PATH: default BIN/run-on-gpu.sh (the shared GPU recipe's launcher, carried in BIN
# next to the binaries), else shared/gpu/run-on-gpu.sh. STEP_LIMIT bounds each step (seconds,
# default 900).
set -uo pipefail
cd "$(dirname "$0")/.."
WHAT=${1:-all}
BIN=${BIN:-.gpu}
RESULTS=${OUT:-gpu-results}
if [ -z "${RUNNER:-}" ]; then
  RUNNER=$BIN/run-on-gpu.sh
  [ -x "$RUNNER" ] || RUNNER=shared/gpu/run-on-gpu.sh
fi
LIMIT=${STEP_LIMIT:-900}
mkdir -p "$RESULTS"
: >"$RESULTS/summary.txt"
export WAVEFRONT_FIXTURES=$PWD/tests/fixtures WAVEFRONT_TEST_DEVICE=cuda:0

step() {
  local name=$1
  shift
  local t0=$SECONDS
  timeout "$LIMIT" "$RUNNER" "$@" >"$RESULTS/$name.log" 2>&1
  local rc=$?
  printf '%-40s exit %3d  %5ds\n' "$name" "$rc" $((SECONDS - t0)) | tee -a "$RESULTS/summary.txt"
}

checks() {
  for t in "$BIN"/test-*; do
    step "$(basename "$t")" "$t" --test-threads 1
  done
  # NCCL at one rank: the collective's own test and every tensor-parallel golden through it
  # (worlds beyond this machine's GPUs are skipped by name; huginn's split runs inside its
  # forward_matches_upstream).
  for t in "$BIN"/test-*golden* "$BIN"/test-nccl*; do
    [ -e "$t" ] || continue
    WAVEFRONT_TEST_COLLECTIVE=nccl step "nccl-$(basename "$t")" "$t" --test-threads 1 \
      parallel nccl forward_matches_upstream
  done
}

figures() {
  local b=$BIN
  # Huginn-0125: n_embd 5280, 55 heads, prelude/core/coda 2/4/2, 3.5 B parameters.
  step huginn-0125 "$b/bench-recurrent-depth" --device cuda:0 --dtype bf16 --n-embd 5280 \
    --n-heads 55 --intermediate-size 17920 --vocab-size 65536 --max-new-tokens 32 \
    --batched-max-new-tokens 16 --repeat 2 --concurrency 1,8,32 --memory-budget-mb 24000
  # LLaDA-8B: d_model 4096, 32 heads, 32 layers, MLP 12288, vocab 126464; gen length 256.
  for attention in sdpa ragged; do
    step "llada-8b-$attention" "$b/bench-masked-diffusion" --device cuda:0 --dtype bf16 \
      --d-model 4096 --n-heads 32 --n-layers 32 --mlp-hidden-size 12288 --vocab-size 126464 \
      --qk-scale 1 --gen-length 256 --block-length 32 --concurrency 1,8 --attention "$attention"
  done
  # ARMT on Llama-3.2-1B: hidden 2048, 16 layers, 32 heads (8 kv), MLP 8192, vocab 128256;
  # segments of 1024 with 16 memory tokens; one 32k-token prefill per execution.
  step armt-llama-3.2-1b "$b/bench-recurrent-memory" --device cuda:0 --dtype bf16 \
    --layers 16 --hidden-size 2048 --heads 32 --kv-heads 8 --intermediate-size 8192 \
    --vocab-size 128256 --segment-size 1024 --lengths 32768 --concurrent 8 \
    --concurrent-length 8192
  # ReFusion on Qwen3-8B: hidden 4096, 32 heads (8 kv) of 128, 36 layers, MLP 12288, vocab
  # 151936; gen length 256, in the random and the consensus regime.
  for attention in sdpa ragged; do
    for consensus in 0 2; do
      step "refusion-qwen3-8b-c$consensus-$attention" "$b/bench-slot-diffusion" --device cuda:0 \
        --dtype bf16 --hidden-size 4096 --num-attention-heads 32 --num-key-value-heads 8 \
        --head-dim 128 --num-hidden-layers 36 --intermediate-size 12288 --vocab-size 151936 \
        --gen-length 256 --concurrency 1,8 --consensus "$consensus" --attention "$attention"
    done
  done
  # LLaDA2.0-mini's layer shape (hidden 2048, 16 heads of 128 with 4 kv heads, 256 experts of
  # 512 with 8 per token in 8 groups keeping 4, one shared expert, vocab 157184) at 8 of its 20
  # layers (the random weights are drawn on the host in float32); gen length 256, blocks of 32.
  for attention in sdpa ragged; do
    step "llada2-mini-8l-$attention" "$b/bench-block-diffusion" --device cuda:0 --dtype bf16 \
      --hidden-size 2048 --heads 16 --kv-heads 4 --layers 8 --intermediate-size 5120 \
      --experts 256 --experts-per-token 8 --moe-intermediate-size 512 --vocab-size 157184 \
      --gen-length 256 --block-length 32 --steps 32 --concurrency 1,8 --rows 32,256 \
      --attention "$attention"
  done
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$RESULTS/gpu.txt" 2>&1
case $WHAT in
  checks) checks ;;
  figures) figures ;;
  all) checks; figures ;;
  *) echo "usage: $0 checks|figures|all" >&2; exit 2 ;;
esac
