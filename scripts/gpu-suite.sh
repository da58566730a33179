#!/usr/bin/env bash
# On the GPU machine: the CUDA checks and the figures of the GPU path, run from the binaries
# `scripts/build-cuda.sh --tests` left in BIN (default .gpu/), or from the archive
# `scripts/pack-gpu.sh` made of them (.gpu-carry/gpu.tar.xz: what fits the device tool's 64 MiB
# working tree), unpacked to /tmp/wavefront-gpu. Run in the repository root.
#
#   scripts/gpu-suite.sh checks    golden suites of every family on cuda:0 (both attention
#                                  kernels), the kernels against their CPU references (the
#                                  paged ragged attention included), NCCL at one rank (the nccl
#                                  test and every tensor-parallel golden)
#   scripts/gpu-suite.sh quick     the checks, bench-ragged (paged K/V read in place against
#                                  concatenating the pages first), and the benches at the real
#                                  models' layer shapes with fewer layers
#   scripts/gpu-suite.sh figures   the benches at the real model shapes, bf16:
#                                  Huginn-0125, LLaDA-8B, ARMT on Llama-3.2-1B (32k prefill),
#                                  ReFusion on Qwen3-8B (sdpa and ragged attention),
#                                  DiffusionGemma-26B-A4B (4k prompt, 256-token canvas)
#   scripts/gpu-suite.sh gemma     DiffusionGemma-26B-A4B alone (#40 item 5: against vLLM's
#                                  145.7 ms per 256-token canvas at a 4k prompt)
#   scripts/gpu-suite.sh all       checks and figures
#   scripts/gpu-suite.sh open      the GPU findings still open (docs/benchmarks.md): Huginn's
#                                  zero-init diffusion case alone, five times (does its result
#                                  change between runs?), and the Dream joining test alone
#   scripts/gpu-suite.sh lease     one lease's worth, most needed first, each step bounded: the
#                                  kernels against their references, bench-ragged (split-key
#                                  against one-warp attention), the open findings, the golden
#                                  suites, the layer-shape benches through the ragged kernel,
#                                  DiffusionGemma, then the full-depth figures (run it with
#                                  DEADLINE set so it ends inside the call)
#   scripts/gpu-suite.sh survey    what had not run on a device since session 23: the kernels
#                                  against their references, every golden suite side by side,
#                                  SureLock's cost split (its statistics with nothing locked,
#                                  then with locking) at LLaDA-8B's layer shape, bench-ragged,
#                                  Huginn-0125 static AR alone against 16 concurrent, LLaDA-8B at
#                                  full depth with Fast-dLLM's modes, LLaDA2.0-mini at full depth
#                                  (run it with DEADLINE; logs packed into RESULTS/logs.tgz)
#   scripts/gpu-suite.sh ab        a change against the build before it, side by side in one
#                                  run: BINARY-old in BIN is the earlier build of BINARY (packed
#                                  with PACK naming both). The kernels against their references
#                                  and the golden suites of the new build, then each bench old
#                                  and new: SureLock's split at LLaDA-8B's layer shape, LLaDA-8B
#                                  at full depth (baseline, SureLock, Fast-dLLM's caches),
#                                  ReFusion's plan-infill at Qwen3-8B's layer shape, Huginn-0125
#                                  static AR 16 concurrent (run it with DEADLINE)
#   scripts/gpu-suite.sh next      what session 23's lease left (docs/benchmarks.md, "GPU
#                                  session 23"): ARMT's 8 x 8192 diagonal run that hit an
#                                  illegal address, under compute-sanitizer at a smaller size,
#                                  then as it failed; LLaDA's goldens side by side (they once
#                                  did not finish); DiffusionGemma's denoising step under ncu
#                                  (kernel names and times: where the 480 ms go); Huginn-0125
#                                  static AR alone and 16 concurrent; LLaDA2.0-mini; LLaDA-8B
#                                  with 8 requests
#
# Each step's output goes to RESULTS/<step>.log (RESULTS: default $OUT when the device tool sets
# it, else gpu-results/), and one line per step with its exit status and seconds to
# RESULTS/summary.txt. RUNNER starts a binary with the machine's CUDA 13 and NCCL libraries on
# LD_LIBRARY_PATH: default BIN/run-on-gpu.sh (the shared GPU recipe's launcher, carried in BIN
# next to the binaries or in the archive), else shared/gpu/run-on-gpu.sh. STEP_LIMIT
# bounds each step (seconds, default 900); DEADLINE (seconds from the start) skips the steps
# that would start after it, so a run fits a lease. The golden suites run side by side.
set -uo pipefail
cd "$(dirname "$0")/.."
WHAT=${1:-all}
BIN=${BIN:-.gpu}
if [ ! -d "$BIN" ] && [ -f .gpu-carry/gpu.tar.xz ]; then
  BIN=/tmp/wavefront-gpu
  mkdir -p "$BIN"
  if command -v xz >/dev/null; then
    xz -dc .gpu-carry/gpu.tar.xz | tar xf - -C "$BIN"
  else
    python3 -c 'import lzma,sys,tarfile; tarfile.open(fileobj=lzma.open(sys.argv[1])).extractall(sys.argv[2])' \
      .gpu-carry/gpu.tar.xz "$BIN"
  fi
fi
RESULTS=${RESULTS:-${OUT:-gpu-results}}
if [ -z "${RUNNER:-}" ]; then
  RUNNER=$BIN/run-on-gpu.sh
  [ -x "$RUNNER" ] || RUNNER=shared/gpu/run-on-gpu.sh
fi
LIMIT=${STEP_LIMIT:-900}
DEADLINE=${DEADLINE:-100000}
mkdir -p "$RESULTS"
: >"$RESULTS/summary.txt"
export WAVEFRONT_FIXTURES=$PWD/tests/fixtures WAVEFRONT_TEST_DEVICE=cuda:0

step() {
  local name=$1
  shift
  if [ "$SECONDS" -ge "$DEADLINE" ]; then
    printf '%-40s skipped (deadline)\n' "$name" | tee -a "$RESULTS/summary.txt"
    return
  fi
  if [ ! -x "$1" ] && ! command -v "$1" >/dev/null; then
    # Not in this call's archive (the binaries may travel in two parts).
    printf '%-40s absent\n' "$name" | tee -a "$RESULTS/summary.txt"
    return
  fi
  local t0=$SECONDS
  timeout "$LIMIT" "$RUNNER" "$@" >"$RESULTS/$name.log" 2>&1
  local rc=$?
  printf '%-40s exit %3d  %5ds\n' "$name" "$rc" $((SECONDS - t0)) | tee -a "$RESULTS/summary.txt"
}

checks() {
  # The kernels against their CPU references first: every later step runs on them.
  for t in "$BIN"/test-cuda-*; do
    [ -e "$t" ] && step "$(basename "$t")" "$t" --test-threads 1
  done
  # The golden suites, side by side (the GPU has room for all; each its own log).
  for t in "$BIN"/test-*; do
    case $(basename "$t") in
      test-cuda-*|test-nccl-*|test-hostile_files-*|test-reference-*|test-bench_ragged-*) continue ;;
    esac
    step "$(basename "$t")" "$t" --test-threads 4 &
  done
  wait
  # NCCL at one rank: the collective's own test and every tensor-parallel golden through it
  # (worlds beyond this machine's GPUs are skipped by name; huginn's split runs inside its
  # forward_matches_upstream).
  for t in "$BIN"/test-*golden* "$BIN"/test-nccl*; do
    [ -e "$t" ] || continue
    WAVEFRONT_TEST_COLLECTIVE=nccl step "nccl-$(basename "$t")" "$t" --test-threads 1 \
      parallel nccl forward_matches_upstream &
  done
  wait
}

quick() {
  local b=$BIN
  if [ -x "$b/bench-ragged" ]; then
    step bench-ragged "$b/bench-ragged"
    step bench-ragged-consecutive "$b/bench-ragged" --consecutive
  fi
  # ReFusion at Qwen3-8B's layer shape (hidden 4096, 32 heads of 128, 8 kv heads, MLP 12288)
  # with 8 of its 36 layers: plan-infill over paged caches, sdpa against ragged attention.
  for attention in sdpa ragged; do
    step "refusion-qwen3-8b-8l-c2-$attention" "$b/bench-slot-diffusion" --device cuda:0 \
      --dtype bf16 --hidden-size 4096 --num-attention-heads 32 --num-key-value-heads 8 \
      --head-dim 128 --num-hidden-layers 8 --intermediate-size 12288 --vocab-size 151936 \
      --gen-length 256 --concurrency 1,8 --consensus 2 --attention "$attention"
  done
  # LLaDA-8B's layer shape with 8 of its 32 layers.
  for attention in sdpa ragged; do
    step "llada-8b-8l-$attention" "$b/bench-masked-diffusion" --device cuda:0 --dtype bf16 \
      --d-model 4096 --n-heads 32 --n-layers 8 --mlp-hidden-size 12288 --vocab-size 126464 \
      --qk-scale 1 --gen-length 256 --block-length 32 --concurrency 1,8 --attention "$attention"
  done
  # ARMT on Llama-3.2-1B (all 16 layers), an 8k prefill per execution.
  step armt-llama-3.2-1b-8k "$b/bench-recurrent-memory" --device cuda:0 --dtype bf16 \
    --layers 16 --hidden-size 2048 --heads 32 --kv-heads 8 --intermediate-size 8192 \
    --vocab-size 128256 --segment-size 1024 --lengths 8192 --concurrent 4 \
    --concurrent-length 4096
}

gemma() {
  local b=$BIN
  # DiffusionGemma-26B-A4B's real shape (random weights drawn on the device), a 4096-token
  # prompt, one 256-token canvas of 48 denoising steps (early stop off so times compare), and
  # single forwards: the denoising step, the prompt's encoder pass, the sampler's statistics
  # and the self-conditioning product.
  [ -x "$b/bench-diffusion-gemma" ] && step diffusion-gemma-26b-a4b "$b/bench-diffusion-gemma" \
    --real --device cuda:0 --dtype bf16 --prompt-len 4096 --canvases 1 --steps 48 \
    --concurrency 1
}

figures() {
  local b=$BIN
  gemma
  # Huginn-0125: n_embd 5280, 55 heads, prelude/core/coda 2/4/2, 3.5 B parameters.
  step huginn-0125 "$b/bench-recurrent-depth" --device cuda:0 --dtype bf16 --n-embd 5280 \
    --n-heads 55 --intermediate-size 17920 --vocab-size 65536 --max-new-tokens 32 \
    --batched-max-new-tokens 16 --repeat 2 --concurrency 1,8,32 --memory-budget-mb 24000 --cold-pool
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

lease() {
  local b=$BIN t
  for t in "$BIN"/test-cuda-*; do
    [ -e "$t" ] && LIMIT=60 step "$(basename "$t")" "$t" --test-threads 1
  done
  [ -x "$b/bench-ragged" ] && LIMIT=60 step bench-ragged "$b/bench-ragged"
  for t in "$BIN"/test-huginn_diffusion_golden-*; do
    for i in 1 2 3; do
      LIMIT=40 step "zeroinit-alone-$i" "$t" --test-threads 1 --exact diffusion_cases_one_at_a_time
    done
  done
  for t in "$BIN"/test-wavefront_schemes-*; do
    LIMIT=60 step dream-joining-alone "$t" --test-threads 1 --nocapture \
      masked_diffusion::dream_tests::served_requests_joining_a_running_batch_match_their_runs_alone
  done
  # LLaDA's goldens one test at a time first (a run of them side by side once did not finish:
  # the log names the test that was running).
  for t in "$BIN"/test-llada_golden-*; do
    LIMIT=60 step llada-golden-one-at-a-time "$t" --test-threads 1
  done
  # The golden suites side by side (both attention kernels: the ragged one is split-key now).
  for t in "$BIN"/test-*; do
    case $(basename "$t") in
      test-cuda-*|test-nccl-*|test-hostile_files-*|test-reference-*|test-bench_ragged-*) continue ;;
      test-llada_golden-*) continue ;;
    esac
    LIMIT=120 step "$(basename "$t")" "$t" --test-threads 4 &
  done
  wait
  LIMIT=60 step refusion-qwen3-8b-8l-c2-ragged "$b/bench-slot-diffusion" --device cuda:0 \
    --dtype bf16 --hidden-size 4096 --num-attention-heads 32 --num-key-value-heads 8 \
    --head-dim 128 --num-hidden-layers 8 --intermediate-size 12288 --vocab-size 151936 \
    --gen-length 256 --concurrency 1,8 --consensus 2 --attention ragged
  LIMIT=60 step llada-8b-8l-ragged "$b/bench-masked-diffusion" --device cuda:0 --dtype bf16 \
    --d-model 4096 --n-heads 32 --n-layers 8 --mlp-hidden-size 12288 --vocab-size 126464 \
    --qk-scale 1 --gen-length 256 --block-length 32 --concurrency 1,8 --attention ragged
  # DiffusionGemma-26B-A4B's single forwards (a denoising step over a 4k prompt's cache, the
  # prompt's encoder pass) through both attention kernels: the full layers' heads of 512 go
  # through the split-key kernel.
  for attention in sdpa ragged; do
    LIMIT=75 step "diffusion-gemma-26b-a4b-forwards-$attention" "$b/bench-diffusion-gemma" \
      --real --device cuda:0 --dtype bf16 --prompt-len 4096 --forwards-only \
      --attention "$attention"
  done
  # Full depth, weights drawn on the device.
  LIMIT=90 step llada-8b-ragged "$b/bench-masked-diffusion" --device cuda:0 --dtype bf16 \
    --d-model 4096 --n-heads 32 --n-layers 32 --mlp-hidden-size 12288 --vocab-size 126464 \
    --qk-scale 1 --gen-length 256 --block-length 32 --concurrency 1,8 --attention ragged
  LIMIT=90 step refusion-qwen3-8b-c2-ragged "$b/bench-slot-diffusion" --device cuda:0 \
    --dtype bf16 --hidden-size 4096 --num-attention-heads 32 --num-key-value-heads 8 \
    --head-dim 128 --num-hidden-layers 36 --intermediate-size 12288 --vocab-size 151936 \
    --gen-length 256 --concurrency 1,8 --consensus 2 --attention ragged
  LIMIT=90 step armt-llama-3.2-1b "$b/bench-recurrent-memory" --device cuda:0 --dtype bf16 \
    --layers 16 --hidden-size 2048 --heads 32 --kv-heads 8 --intermediate-size 8192 \
    --vocab-size 128256 --segment-size 1024 --lengths 32768 --concurrent 8 \
    --concurrent-length 8192
  LIMIT=120 step huginn-0125 "$b/bench-recurrent-depth" --device cuda:0 --dtype bf16 \
    --n-embd 5280 --n-heads 55 --intermediate-size 17920 --vocab-size 65536 \
    --max-new-tokens 32 --batched-max-new-tokens 16 --repeat 1 --concurrency 1,16 \
    --memory-budget-mb 24000 --cold-pool
  LIMIT=90 step llada2-mini-ragged "$b/bench-block-diffusion" --device cuda:0 --dtype bf16 \
    --hidden-size 2048 --heads 16 --kv-heads 4 --layers 20 --intermediate-size 5120 \
    --experts 256 --experts-per-token 8 --moe-intermediate-size 512 --vocab-size 157184 \
    --gen-length 256 --block-length 32 --steps 32 --concurrency 1,8 --rows 32,256 \
    --attention ragged
}

next_steps() {
  local b=$BIN t
  # ARMT's illegal address: the same execution at a quarter of the length under
  # compute-sanitizer (memcheck names the kernel and the address), then the failing size.
  if command -v compute-sanitizer >/dev/null; then
    LIMIT=150 step armt-diagonal-8x2048-memcheck compute-sanitizer --tool memcheck \
      --print-limit 5 "$b/bench-recurrent-memory" --device cuda:0 --dtype bf16 --layers 16 \
      --hidden-size 2048 --heads 32 --kv-heads 8 --intermediate-size 8192 --vocab-size 128256 \
      --segment-size 1024 --lengths 2048 --concurrent 8 --concurrent-length 2048
  fi
  LIMIT=90 step armt-diagonal-8x8192 "$b/bench-recurrent-memory" --device cuda:0 --dtype bf16 \
    --layers 16 --hidden-size 2048 --heads 32 --kv-heads 8 --intermediate-size 8192 \
    --vocab-size 128256 --segment-size 1024 --lengths 8192 --concurrent 8 \
    --concurrent-length 8192
  for t in "$BIN"/test-llada_golden-*; do
    LIMIT=90 step llada-golden-side-by-side "$t" --test-threads 4 &
  done
  for t in "$BIN"/test-wavefront_schemes-*; do
    LIMIT=120 step schemes-beside-llada "$t" --test-threads 4 &
  done
  wait
  # Where DiffusionGemma's denoising step spends its time: one forward-only run under ncu,
  # kernel names and durations only (no replay of every metric).
  if command -v ncu >/dev/null; then
    LIMIT=150 step diffusion-gemma-ncu ncu --clock-control none --metrics gpu__time_duration.sum \
      --launch-count 4000 --csv "$b/bench-diffusion-gemma" --real --device cuda:0 --dtype bf16 \
      --prompt-len 1024 --forwards-only
  fi
  LIMIT=150 step huginn-0125-static "$b/bench-recurrent-depth" --device cuda:0 --dtype bf16 \
    --n-embd 5280 --n-heads 55 --intermediate-size 17920 --vocab-size 65536 \
    --max-new-tokens 16 --batched-max-new-tokens 16 --repeat 1 --single ar-static \
    --batched ar-static --concurrency 1,16 --memory-budget-mb 24000 --cold-pool
  LIMIT=120 step llada2-mini-ragged "$b/bench-block-diffusion" --device cuda:0 --dtype bf16 \
    --hidden-size 2048 --heads 16 --kv-heads 4 --layers 20 --intermediate-size 5120 \
    --experts 256 --experts-per-token 8 --moe-intermediate-size 512 --vocab-size 157184 \
    --gen-length 256 --block-length 32 --steps 32 --concurrency 1,8 --rows 32,256 \
    --attention ragged
  LIMIT=150 step llada-8b-ragged-x8 "$b/bench-masked-diffusion" --device cuda:0 --dtype bf16 \
    --d-model 4096 --n-heads 32 --n-layers 32 --mlp-hidden-size 12288 --vocab-size 126464 \
    --qk-scale 1 --gen-length 256 --block-length 32 --concurrency 8 --attention ragged \
    --schemes low-confidence,wino,dual-threshold
}

# The kernels against their references, then every golden suite carried, side by side.
carried_checks() {
  local t
  for t in "$BIN"/test-cuda-*; do
    [ -e "$t" ] && LIMIT=60 step "$(basename "$t")" "$t" --test-threads 1
  done
  for t in "$BIN"/test-*; do
    case $(basename "$t") in
      test-cuda-*|test-nccl-*|test-hostile_files-*|test-reference-*|test-bench_ragged-*) continue ;;
    esac
    LIMIT=100 step "$(basename "$t")" "$t" --test-threads 4 &
  done
  wait
}

survey() {
  local b=$BIN t
  carried_checks
  # SureLock at LLaDA-8B's layer shape, 8 of its 32 layers: the baseline, SureLock's statistics
  # with nothing locked (eps 0: the posteriors, KL and kept rows of every step, no row skipped),
  # and SureLock locking (the skipped rows' path on top).
  local llada8=(--device cuda:0 --dtype bf16 --d-model 4096 --n-heads 32 --n-layers 8
    --mlp-hidden-size 12288 --vocab-size 126464 --qk-scale 1 --gen-length 128 --block-length 32
    --concurrency 1 --attention ragged)
  LIMIT=40 step surelock-split "$b/bench-masked-diffusion" "${llada8[@]}" \
    --schemes low-confidence,surelock
  LIMIT=30 step surelock-eps0 "$b/bench-masked-diffusion" "${llada8[@]}" --schemes surelock \
    --surelock-eps 0
  # Which kernels a SureLock step launches (names and times of 600 launches mid-run, at 2 of
  # LLaDA-8B's layers): does its cost follow the launches per layer?
  if command -v ncu >/dev/null; then
    LIMIT=60 step surelock-ncu ncu --clock-control none --metrics gpu__time_duration.sum \
      --launch-skip 4000 --launch-count 600 --csv --log-file "$RESULTS/surelock-ncu.csv" \
      "$b/bench-masked-diffusion" --device cuda:0 --dtype bf16 --d-model 4096 --n-heads 32 \
      --n-layers 2 --mlp-hidden-size 12288 --vocab-size 126464 --qk-scale 1 --gen-length 64 \
      --block-length 32 --concurrency 1 --attention ragged --schemes surelock
  fi
  LIMIT=100 step huginn-0125-static "$b/bench-recurrent-depth" --device cuda:0 --dtype bf16 \
    --n-embd 5280 --n-heads 55 --intermediate-size 17920 --vocab-size 65536 \
    --max-new-tokens 16 --batched-max-new-tokens 16 --repeat 1 --single ar-static \
    --batched ar-static --concurrency 1,16 --memory-budget-mb 24000 --cold-pool
  LIMIT=75 step llada-8b-fast-dllm "$b/bench-masked-diffusion" --device cuda:0 --dtype bf16 \
    --d-model 4096 --n-heads 32 --n-layers 32 --mlp-hidden-size 12288 --vocab-size 126464 \
    --qk-scale 1 --gen-length 256 --block-length 32 --concurrency 1 --attention ragged \
    --schemes low-confidence,prefix-threshold,dual-threshold
  LIMIT=75 step llada2-mini-ragged "$b/bench-block-diffusion" --device cuda:0 --dtype bf16 \
    --hidden-size 2048 --heads 16 --kv-heads 4 --layers 20 --intermediate-size 5120 \
    --experts 256 --experts-per-token 8 --moe-intermediate-size 512 --vocab-size 157184 \
    --gen-length 256 --block-length 32 --steps 32 --concurrency 1,8 --rows 32,256 \
    --attention ragged
  [ -x "$b/bench-ragged" ] && LIMIT=40 step bench-ragged "$b/bench-ragged"
  # The device tool returns at most 8 files: every log in one archive.
  tar czf "$RESULTS/logs.tgz" -C "$RESULTS" --exclude logs.tgz . 2>/dev/null
  # The tables on stdout, for the reply's tail.
  for t in surelock-split surelock-eps0 bench-ragged huginn-0125-static llada-8b-fast-dllm \
    llada2-mini-ragged; do
    [ -f "$RESULTS/$t.log" ] && { echo "== $t"; grep '^|' "$RESULTS/$t.log" | cut -c1-220; }
  done
  if [ -f "$RESULTS/surelock-ncu.csv" ]; then
    echo "== surelock-ncu: launches and device time by kernel"
    python3 - "$RESULTS/surelock-ncu.csv" <<'PY'
import collections, csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
head = rows[0]
name, unit, value = head.index("Kernel Name"), head.index("Metric Unit"), head.index("Metric Value")
agg = collections.defaultdict(lambda: [0, 0.0])
for r in rows[1:]:
    scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}[r[unit]]
    a = agg[r[name][:60]]
    a[0] += 1
    a[1] += float(r[value].replace(",", "")) * scale
for k, (n, us) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:15]:
    print(f"{n:6d} {us:10.1f} us  {k}")
PY
  fi
  cat "$RESULTS/summary.txt"
}

ab() {
  local b=$BIN t v
  carried_checks
  local llada8=(--device cuda:0 --dtype bf16 --d-model 4096 --n-heads 32 --n-layers 8
    --mlp-hidden-size 12288 --vocab-size 126464 --qk-scale 1 --gen-length 128 --block-length 32
    --concurrency 1 --attention ragged)
  local llada32=(--device cuda:0 --dtype bf16 --d-model 4096 --n-heads 32 --n-layers 32
    --mlp-hidden-size 12288 --vocab-size 126464 --qk-scale 1 --gen-length 128 --block-length 32
    --concurrency 1 --attention ragged
    --schemes low-confidence,surelock,dual-cache,prefix-threshold,dual-threshold)
  local refusion8=(--device cuda:0 --dtype bf16 --hidden-size 4096 --num-attention-heads 32
    --num-key-value-heads 8 --head-dim 128 --num-hidden-layers 8 --intermediate-size 12288
    --vocab-size 151936 --gen-length 256 --concurrency 1,8 --consensus 2 --attention ragged)
  local huginn=(--device cuda:0 --dtype bf16 --n-embd 5280 --n-heads 55 --intermediate-size 17920
    --vocab-size 65536 --max-new-tokens 16 --batched-max-new-tokens 16 --repeat 1
    --single ar-static --batched ar-static --concurrency 16 --memory-budget-mb 24000 --cold-pool)
  for v in old new; do
    t=$([ $v = old ] && echo -old)
    LIMIT=40 step "surelock-split-$v" "$b/bench-masked-diffusion$t" "${llada8[@]}" \
      --schemes low-confidence,surelock
    LIMIT=30 step "surelock-eps0-$v" "$b/bench-masked-diffusion$t" "${llada8[@]}" \
      --schemes surelock --surelock-eps 0
  done
  for v in old new; do
    t=$([ $v = old ] && echo -old)
    LIMIT=75 step "llada-8b-$v" "$b/bench-masked-diffusion$t" "${llada32[@]}"
  done
  for v in old new; do
    t=$([ $v = old ] && echo -old)
    LIMIT=40 step "refusion-qwen3-8b-8l-$v" "$b/bench-slot-diffusion$t" "${refusion8[@]}"
  done
  for v in old new; do
    t=$([ $v = old ] && echo -old)
    LIMIT=60 step "huginn-0125-x16-$v" "$b/bench-recurrent-depth$t" "${huginn[@]}"
  done
  tar czf "$RESULTS/logs.tgz" -C "$RESULTS" --exclude logs.tgz . 2>/dev/null
  for t in surelock-split surelock-eps0 llada-8b refusion-qwen3-8b-8l huginn-0125-x16; do
    for v in old new; do
      [ -f "$RESULTS/$t-$v.log" ] && { echo "== $t-$v"; grep '^|' "$RESULTS/$t-$v.log" | grep -v '^|--' | cut -c1-200; }
    done
  done
  cat "$RESULTS/summary.txt"
}

open_findings() {
  local t
  for t in "$BIN"/test-huginn_diffusion_golden-*; do
    for i in 1 2 3 4 5; do
      step "zeroinit-alone-$i" "$t" --test-threads 1 --exact diffusion_cases_one_at_a_time
    done
  done
  for t in "$BIN"/test-wavefront_schemes-*; do
    step dream-joining-alone "$t" --test-threads 1 --nocapture \
      masked_diffusion::dream_tests::served_requests_joining_a_running_batch_match_their_runs_alone
  done
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$RESULTS/gpu.txt" 2>&1
case $WHAT in
  checks) checks ;;
  quick) checks; quick ;;
  figures) figures ;;
  all) checks; figures ;;
  open) open_findings ;;
  gemma) gemma ;;
  lease) lease ;;
  next) next_steps ;;
  survey) survey ;;
  ab) ab ;;
  *) echo "usage: $0 checks|quick|figures|all|open|gemma|lease|next|survey|ab" >&2; exit 2 ;;
esac
