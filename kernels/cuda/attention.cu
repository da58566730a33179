// Ragged attention over paged K/V (semantics: src/attention.rs, the CPU reference).
// Head-major layouts: q and out [n_heads, n_rows, head_dim]. The keys of the call are one axis
// of n_keys rows made of *runs*: run r holds keys first_r .. first_{r+1} of that axis, its key
// i of kv head g at k_r + g * head_stride_r + i * head_dim (and likewise for v), so a run is a
// slice of a K/V page arena (consecutive pages of one head), the call's own fresh rows, or one
// contiguous [n_kv_heads, n_keys, head_dim] buffer (a single run). The run table holds 4 u64
// per run (k pointer, v pointer, head stride in elements, first key) and one more entry whose
// first key is n_keys.
// One warp per (query row, head): lanes split head_dim, a key's score is a warp-shuffle sum,
// the softmax is the online (running-maximum) form, so a row's keys are read once, in place.
#include <cuda_bf16.h>
#include <stdint.h>

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ void store(float *p, float x) { *p = x; }
__device__ __forceinline__ void store(__nv_bfloat16 *p, float x) { *p = __float2bfloat16(x); }

__device__ __forceinline__ bool allows(uint32_t kind, uint32_t p0, uint32_t p1, uint32_t q, uint32_t k) {
  if (kind == 0) return true;
  if (kind == 1) return k <= q;
  if (kind == 3) return k / max(p0, 1u) <= q / max(p0, 1u);
  if (kind == 4) return k <= q && (k < p0 || (k - p0) / max(p1, 1u) == (q - p0) / max(p1, 1u));
  if (kind == 5) return k <= q && q - k < p0;
  if (kind == 6) return k >= p0 || p0 - k < p1;
  bool qs = q >= p0, ks = k >= p0;
  if (!qs) return !ks;
  if (ks) return true;
  return k != p1 + (q - p0);
}

#define MAX_PER_LANE 8  // head_dim <= 256

template <typename T>
__device__ void ragged_attention(const T *__restrict__ q, T *__restrict__ out,
                                 const uint64_t *__restrict__ runs, uint32_t n_runs,
                                 const uint32_t *__restrict__ seq_table,  // 7 per sequence
                                 const uint32_t *__restrict__ row_seq,
                                 const uint32_t *__restrict__ row_index,
                                 const uint32_t *__restrict__ key_index, uint32_t n_rows,
                                 uint32_t n_heads, uint32_t n_kv_heads, uint32_t head_dim,
                                 float scale) {
  const uint32_t row = blockIdx.x, head = blockIdx.y, lane = threadIdx.x;
  const uint32_t *s = seq_table + 7 * row_seq[row];
  const uint32_t k0 = s[2], k1 = s[3], kind = s[4], p0 = s[5], p1 = s[6];
  const uint32_t g = head / (n_heads / n_kv_heads);
  const uint32_t qi = row_index[row];
  const T *qv = q + ((size_t)head * n_rows + row) * head_dim;
  float qr[MAX_PER_LANE], acc[MAX_PER_LANE];
#pragma unroll
  for (int i = 0; i < MAX_PER_LANE; ++i) {
    uint32_t d = lane + 32 * i;
    qr[i] = d < head_dim ? to_f(qv[d]) * scale : 0.f;
    acc[i] = 0.f;
  }
  // The last run whose first key is at most k0 (runs[4 * n_runs + 3] = n_keys > k0 when the
  // sequence has keys); empty runs are passed over by the walk below.
  uint32_t lo = 0, hi = n_runs;
  while (hi - lo > 1) {
    uint32_t mid = (lo + hi) / 2;
    if (runs[4 * mid + 3] <= k0) lo = mid; else hi = mid;
  }
  uint32_t r = lo;
  uint64_t first = runs[4 * r + 3], end = runs[4 * r + 7];
  const T *kb = (const T *)runs[4 * r] + g * runs[4 * r + 2];
  const T *vb = (const T *)runs[4 * r + 1] + g * runs[4 * r + 2];
  float m = -INFINITY, l = 0.f;
  for (uint32_t j = k0; j < k1; ++j) {
    while (j >= end) {
      ++r;
      first = end;
      end = runs[4 * r + 7];
      kb = (const T *)runs[4 * r] + g * runs[4 * r + 2];
      vb = (const T *)runs[4 * r + 1] + g * runs[4 * r + 2];
    }
    if (!allows(kind, p0, p1, qi, key_index[j])) continue;
    const size_t at = (size_t)(j - first) * head_dim;
    const T *kv = kb + at;
    float dot = 0.f;
#pragma unroll
    for (int i = 0; i < MAX_PER_LANE; ++i) {
      uint32_t d = lane + 32 * i;
      if (d < head_dim) dot += qr[i] * to_f(kv[d]);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
    float m_new = fmaxf(m, dot);
    float c_old = __expf(m - m_new), c_new = __expf(dot - m_new);
    const T *vv = vb + at;
#pragma unroll
    for (int i = 0; i < MAX_PER_LANE; ++i) {
      uint32_t d = lane + 32 * i;
      if (d < head_dim) acc[i] = acc[i] * c_old + c_new * to_f(vv[d]);
    }
    l = l * c_old + c_new;
    m = m_new;
  }
  T *o = out + ((size_t)head * n_rows + row) * head_dim;
  float inv = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
  for (int i = 0; i < MAX_PER_LANE; ++i) {
    uint32_t d = lane + 32 * i;
    if (d < head_dim) store(o + d, acc[i] * inv);
  }
}

#define INSTANTIATE(NAME, T)                                                                  \
  extern "C" __global__ void NAME(const T *q, T *out, const uint64_t *runs, uint32_t n_runs, \
                                  const uint32_t *seq_table, const uint32_t *row_seq,         \
                                  const uint32_t *row_index, const uint32_t *key_index,       \
                                  uint32_t n_rows, uint32_t n_heads, uint32_t n_kv_heads,     \
                                  uint32_t head_dim, float scale) {                           \
    ragged_attention<T>(q, out, runs, n_runs, seq_table, row_seq, row_index, key_index,      \
                        n_rows, n_heads, n_kv_heads, head_dim, scale);                        \
  }

INSTANTIATE(ragged_attention_f32, float)
INSTANTIATE(ragged_attention_bf16, __nv_bfloat16)
