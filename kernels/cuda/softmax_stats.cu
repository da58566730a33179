// Fused per-row softmax statistics (semantics: src/softmax_stats.rs, the CPU reference).
// One block per row: a max/argmax reduction, a sum-of-exp reduction, then (optionally) the KL
// divergence to the previous step's log-probabilities and the row's own log-probabilities.
// Per row out: [lse, top_prob, top_id (as bits), kl].
#include <cuda_bf16.h>
#include <stdint.h>

#define THREADS 256

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ void softmax_stats(const T *__restrict__ logits, const float *__restrict__ prev,
                              float *__restrict__ log_probs_out, float *__restrict__ stats,
                              uint32_t vocab) {
  __shared__ float sv[THREADS];
  __shared__ uint32_t si[THREADS];
  const uint32_t row = blockIdx.x, tid = threadIdx.x;
  const T *x = logits + (size_t)row * vocab;
  float best = -INFINITY;
  uint32_t best_i = 0xffffffffu;
  for (uint32_t i = tid; i < vocab; i += THREADS) {
    float v = to_f(x[i]);
    if (v > best) { best = v; best_i = i; }
  }
  sv[tid] = best; si[tid] = best_i;
  __syncthreads();
  for (uint32_t s = THREADS / 2; s > 0; s >>= 1) {
    if (tid < s) {
      float o = sv[tid + s]; uint32_t oi = si[tid + s];
      if (o > sv[tid] || (o == sv[tid] && oi < si[tid])) { sv[tid] = o; si[tid] = oi; }
    }
    __syncthreads();
  }
  const float mx = sv[0];
  const uint32_t top = si[0];
  __syncthreads();
  float sum = 0.f;
  for (uint32_t i = tid; i < vocab; i += THREADS) sum += __expf(to_f(x[i]) - mx);
  sv[tid] = sum;
  __syncthreads();
  for (uint32_t s = THREADS / 2; s > 0; s >>= 1) {
    if (tid < s) sv[tid] += sv[tid + s];
    __syncthreads();
  }
  const float lse = mx + logf(sv[0]);
  __syncthreads();
  float kl = 0.f;
  for (uint32_t i = tid; i < vocab; i += THREADS) {
    float lp = to_f(x[i]) - lse;
    if (prev) {
      float p = __expf(lp);
      if (p > 0.f) kl += p * (lp - prev[(size_t)row * vocab + i]);
    }
    if (log_probs_out) log_probs_out[(size_t)row * vocab + i] = lp;
  }
  sv[tid] = kl;
  __syncthreads();
  for (uint32_t s = THREADS / 2; s > 0; s >>= 1) {
    if (tid < s) sv[tid] += sv[tid + s];
    __syncthreads();
  }
  if (tid == 0) {
    float *o = stats + 4 * row;
    o[0] = lse;
    o[1] = __expf(mx - lse);
    o[2] = __uint_as_float(top);
    o[3] = prev ? sv[0] : __int_as_float(0x7fc00000);
  }
}

#define INSTANTIATE(NAME, T)                                                                  \
  extern "C" __global__ void NAME(const T *logits, const float *prev, float *log_probs_out,   \
                                  float *stats, uint32_t vocab) {                             \
    softmax_stats<T>(logits, prev, log_probs_out, stats, vocab);                              \
  }

INSTANTIATE(softmax_stats_f32, float)
INSTANTIATE(softmax_stats_bf16, __nv_bfloat16)
