// Ragged attention over gathered K/V (semantics: src/attention.rs, the CPU reference).
// Head-major layouts: q and out [n_heads, n_rows, head_dim], k and v [n_kv_heads, n_keys, head_dim].
// One warp per (query row, head): lanes split head_dim, a key's score is a warp-shuffle sum,
// the softmax is the online (running-maximum) form, so a row's keys are read once.
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
  bool qs = q >= p0, ks = k >= p0;
  if (!qs) return !ks;
  if (ks) return true;
  return k != p1 + (q - p0);
}

#define MAX_PER_LANE 8  // head_dim <= 256

template <typename T>
__device__ void ragged_attention(const T *__restrict__ q, const T *__restrict__ k,
                                 const T *__restrict__ v, T *__restrict__ out,
                                 const uint32_t *__restrict__ seq_table,  // 7 per sequence
                                 const uint32_t *__restrict__ row_seq,
                                 const uint32_t *__restrict__ row_index,
                                 const uint32_t *__restrict__ key_index, uint32_t n_rows,
                                 uint32_t n_keys, uint32_t n_heads, uint32_t n_kv_heads,
                                 uint32_t head_dim, float scale) {
  const uint32_t row = blockIdx.x, head = blockIdx.y, lane = threadIdx.x;
  const uint32_t *s = seq_table + 7 * row_seq[row];
  const uint32_t k0 = s[2], k1 = s[3], kind = s[4], p0 = s[5], p1 = s[6];
  const uint32_t g = head / (n_heads / n_kv_heads);
  const uint32_t qi = row_index[row];
  const T *qv = q + ((size_t)head * n_rows + row) * head_dim;
  const T *kg = k + (size_t)g * n_keys * head_dim, *vg = v + (size_t)g * n_keys * head_dim;
  float qr[MAX_PER_LANE], acc[MAX_PER_LANE];
#pragma unroll
  for (int i = 0; i < MAX_PER_LANE; ++i) {
    uint32_t d = lane + 32 * i;
    qr[i] = d < head_dim ? to_f(qv[d]) * scale : 0.f;
    acc[i] = 0.f;
  }
  float m = -INFINITY, l = 0.f;
  for (uint32_t j = k0; j < k1; ++j) {
    if (!allows(kind, p0, p1, qi, key_index[j])) continue;
    const T *kv = kg + (size_t)j * head_dim;
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
    const T *vv = vg + (size_t)j * head_dim;
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
  extern "C" __global__ void NAME(const T *q, const T *k, const T *v, T *out,                \
                                  const uint32_t *seq_table, const uint32_t *row_seq,         \
                                  const uint32_t *row_index, const uint32_t *key_index,       \
                                  uint32_t n_rows, uint32_t n_keys, uint32_t n_heads,         \
                                  uint32_t n_kv_heads, uint32_t head_dim, float scale) {      \
    ragged_attention<T>(q, k, v, out, seq_table, row_seq, row_index, key_index, n_rows,      \
                        n_keys, n_heads, n_kv_heads, head_dim, scale);                        \
  }

INSTANTIATE(ragged_attention_f32, float)
INSTANTIATE(ragged_attention_bf16, __nv_bfloat16)
