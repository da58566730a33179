// Ragged attention over paged K/V (semantics: src/attention.rs, the CPU reference).
// Head-major layouts: q and out [n_heads, n_rows, head_dim]. The keys of the call are one axis
// of n_keys rows made of *runs*: run r holds keys first_r .. first_{r+1} of that axis, its key
// i of kv head g at k_r + g * head_stride_r + i * head_dim (and likewise for v), so a run is a
// slice of a K/V page arena (consecutive pages of one head), the call's own fresh rows, or one
// contiguous [n_kv_heads, n_keys, head_dim] buffer (a single run). The run table holds 4 u64
// per run (k pointer, v pointer, head stride in elements, first key) and one more entry whose
// first key is n_keys.
// Two kernels over the same tables. `ragged_attention_*` (one warp per (query row, head),
// walking its keys one by one: lanes split head_dim, a key's score is a warp-shuffle sum) is
// kept as the baseline `bench-ragged` measures against. `ragged_split_*` is what the launcher
// runs: split-key (flash-decoding) attention, a block of 128 threads per (row, split, head) over
// `chunk` consecutive keys of its row's range, its threads in groups of TPK, each group on its
// own keys (two at a time, so the loads of several keys are in flight per thread), each thread
// on DPT consecutive dims of a key read as 16-byte loads. Every group keeps an online
// (running-maximum) softmax; the block merges its groups, and when a row has several splits
// `ragged_combine_*` merges their partial (max, sum, weighted values). Keys are read once per
// head, in place.
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

// ---- split-key (flash-decoding) attention ----

template <typename T> __device__ __forceinline__ T zero_of();
template <> __device__ __forceinline__ float zero_of<float>() { return 0.f; }
template <> __device__ __forceinline__ __nv_bfloat16 zero_of<__nv_bfloat16>() {
  return __float2bfloat16(0.f);
}

// N consecutive elements from p, of which the first n exist (n may be <= 0): as 16- or 8-byte
// loads when all N exist and p is aligned for them, else one by one (zeros past n).
template <typename T, int N>
__device__ __forceinline__ void load_frag(const T *__restrict__ p, T (&x)[N], int n) {
  constexpr int BYTES = N * (int)sizeof(T);
  if (n >= N) {
    if constexpr (BYTES % 16 == 0) {
      if (((uintptr_t)p & 15) == 0) {
#pragma unroll
        for (int c = 0; c < BYTES / 16; ++c)
          reinterpret_cast<uint4 *>(x)[c] = __ldg(reinterpret_cast<const uint4 *>(p) + c);
        return;
      }
    }
    if constexpr (BYTES % 8 == 0) {
      if (((uintptr_t)p & 7) == 0) {
#pragma unroll
        for (int c = 0; c < BYTES / 8; ++c)
          reinterpret_cast<uint2 *>(x)[c] = __ldg(reinterpret_cast<const uint2 *>(p) + c);
        return;
      }
    }
  }
#pragma unroll
  for (int i = 0; i < N; ++i) x[i] = i < n ? p[i] : zero_of<T>();
}

constexpr int SPLIT_THREADS = 128;
constexpr int SPLIT_UNROLL = 2;

// Block (row, split, head block): HG query heads of one kv group (grid z = n_heads / HG), so a
// key read once serves every head of the block (grouped-query attention reads each K/V byte
// once per group, not once per head).
template <typename T, int TPK, int DPT, int HG>
__device__ void ragged_split(const T *__restrict__ q, T *__restrict__ out, float *__restrict__ part,
                             const uint64_t *__restrict__ runs, uint32_t n_runs,
                             const uint32_t *__restrict__ seq_table,
                             const uint32_t *__restrict__ row_seq,
                             const uint32_t *__restrict__ row_index,
                             const uint32_t *__restrict__ key_index, uint32_t n_rows,
                             uint32_t n_heads, uint32_t n_kv_heads, uint32_t head_dim, float scale,
                             uint32_t chunk) {
  constexpr int GROUPS = SPLIT_THREADS / TPK;
  constexpr int STEP = GROUPS * SPLIT_UNROLL;
  constexpr int SPAN = TPK * DPT;  // dims a group covers (>= head_dim)
  const uint32_t row = blockIdx.x, split = blockIdx.y, head0 = blockIdx.z * HG,
                 n_splits = gridDim.y;
  const uint32_t tid = threadIdx.x, grp = tid / TPK, lane = tid % TPK;
  const uint32_t *s = seq_table + 7 * row_seq[row];
  const uint32_t kind = s[4], p0 = s[5], p1 = s[6];
  const uint32_t ks = min(s[3], s[2] + split * chunk), ke = min(s[3], ks + chunk);
  const uint32_t g = head0 / (n_heads / n_kv_heads);
  const uint32_t qi = row_index[row];
  const int d0 = (int)lane * DPT, have = (int)head_dim - d0;
  float qr[HG][DPT], acc[HG][DPT], m[HG], l[HG];
#pragma unroll
  for (int h = 0; h < HG; ++h) {
    const T *qv = q + ((size_t)(head0 + h) * n_rows + row) * head_dim + d0;
#pragma unroll
    for (int i = 0; i < DPT; ++i) {
      qr[h][i] = i < have ? to_f(qv[i]) * scale : 0.f;
      acc[h][i] = 0.f;
    }
    m[h] = -INFINITY;
    l[h] = 0.f;
  }
  if (ks < ke) {
    uint32_t lo = 0, hi = n_runs;
    while (hi - lo > 1) {
      uint32_t mid = (lo + hi) / 2;
      if (runs[4 * mid + 3] <= ks) lo = mid; else hi = mid;
    }
    uint32_t r = lo;
    uint64_t first = runs[4 * r + 3], end = runs[4 * r + 7];
    const T *kb = (const T *)runs[4 * r] + g * runs[4 * r + 2];
    const T *vb = (const T *)runs[4 * r + 1] + g * runs[4 * r + 2];
    for (uint32_t base = ks; base < ke; base += STEP) {
      alignas(16) T kx[SPLIT_UNROLL][DPT];
      alignas(16) T vx[SPLIT_UNROLL][DPT];
      bool ok[SPLIT_UNROLL];
#pragma unroll
      for (int u = 0; u < SPLIT_UNROLL; ++u) {
        const uint32_t j = base + u * GROUPS + grp;
        ok[u] = j < ke;
        if (ok[u]) {
          while (j >= end) {
            ++r;
            first = end;
            end = runs[4 * r + 7];
            kb = (const T *)runs[4 * r] + g * runs[4 * r + 2];
            vb = (const T *)runs[4 * r + 1] + g * runs[4 * r + 2];
          }
          const size_t at = (size_t)(j - first) * head_dim + d0;
          load_frag<T, DPT>(kb + at, kx[u], have);
          load_frag<T, DPT>(vb + at, vx[u], have);
          ok[u] = allows(kind, p0, p1, qi, key_index[j]);
        } else {
#pragma unroll
          for (int i = 0; i < DPT; ++i) kx[u][i] = vx[u][i] = zero_of<T>();
        }
      }
#pragma unroll
      for (int u = 0; u < SPLIT_UNROLL; ++u) {
        float kf[DPT];
#pragma unroll
        for (int i = 0; i < DPT; ++i) kf[i] = to_f(kx[u][i]);
        float dot[HG];
#pragma unroll
        for (int h = 0; h < HG; ++h) {
          dot[h] = 0.f;
#pragma unroll
          for (int i = 0; i < DPT; ++i) dot[h] += qr[h][i] * kf[i];
        }
#pragma unroll
        for (int o = TPK / 2; o > 0; o >>= 1)
#pragma unroll
          for (int h = 0; h < HG; ++h) dot[h] += __shfl_xor_sync(0xffffffffu, dot[h], o);
        if (ok[u]) {
#pragma unroll
          for (int h = 0; h < HG; ++h) {
            const float m_new = fmaxf(m[h], dot[h]);
            const float c_old = __expf(m[h] - m_new), c_new = __expf(dot[h] - m_new);
#pragma unroll
            for (int i = 0; i < DPT; ++i)
              acc[h][i] = acc[h][i] * c_old + c_new * to_f(vx[u][i]);
            l[h] = l[h] * c_old + c_new;
            m[h] = m_new;
          }
        }
      }
    }
  }
  // Merge the block's groups: each group's (max, sum) and its dims of the weighted values.
  __shared__ float sm_m[HG][GROUPS], sm_l[HG][GROUPS];
  __shared__ float sm_acc[HG][GROUPS * SPAN];
#pragma unroll
  for (int h = 0; h < HG; ++h) {
    if (lane == 0) {
      sm_m[h][grp] = m[h];
      sm_l[h][grp] = l[h];
    }
#pragma unroll
    for (int i = 0; i < DPT; ++i) sm_acc[h][grp * SPAN + d0 + i] = acc[h][i];
  }
  __syncthreads();
#pragma unroll 1
  for (int h = 0; h < HG; ++h) {
    float mx = -INFINITY;
#pragma unroll
    for (int k = 0; k < GROUPS; ++k) mx = fmaxf(mx, sm_m[h][k]);
    float w[GROUPS];
    float sum = 0.f;
#pragma unroll
    for (int k = 0; k < GROUPS; ++k) {
      w[k] = sm_m[h][k] == -INFINITY ? 0.f : __expf(sm_m[h][k] - mx);
      sum += sm_l[h][k] * w[k];
    }
    const uint32_t head = head0 + h;
    if (n_splits == 1) {
      T *o = out + ((size_t)head * n_rows + row) * head_dim;
      const float inv = sum > 0.f ? 1.f / sum : 0.f;
      for (uint32_t d = tid; d < head_dim; d += SPLIT_THREADS) {
        float a = 0.f;
#pragma unroll
        for (int k = 0; k < GROUPS; ++k) a += sm_acc[h][k * SPAN + d] * w[k];
        store(o + d, a * inv);
      }
    } else {
      float *pp = part + (((size_t)row * n_heads + head) * n_splits + split) * (head_dim + 2);
      for (uint32_t d = tid; d < head_dim; d += SPLIT_THREADS) {
        float a = 0.f;
#pragma unroll
        for (int k = 0; k < GROUPS; ++k) a += sm_acc[h][k * SPAN + d] * w[k];
        pp[d] = a;
      }
      if (tid == 0) {
        pp[head_dim] = mx;
        pp[head_dim + 1] = sum;
      }
    }
  }
}

// Merges a row's splits: grid (rows, heads), partials [rows, heads, splits, head_dim + 2].
template <typename T>
__device__ void ragged_combine(const float *__restrict__ part, T *__restrict__ out, uint32_t n_rows,
                               uint32_t n_heads, uint32_t head_dim, uint32_t n_splits) {
  const uint32_t row = blockIdx.x, head = blockIdx.y;
  const size_t stride = head_dim + 2;
  const float *pp = part + ((size_t)row * n_heads + head) * n_splits * stride;
  float mx = -INFINITY;
  for (uint32_t k = 0; k < n_splits; ++k) mx = fmaxf(mx, pp[k * stride + head_dim]);
  T *o = out + ((size_t)head * n_rows + row) * head_dim;
  for (uint32_t d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float a = 0.f, sum = 0.f;
    for (uint32_t k = 0; k < n_splits; ++k) {
      const float mk = pp[k * stride + head_dim];
      if (mk == -INFINITY) continue;
      const float wk = __expf(mk - mx);
      a += pp[k * stride + d] * wk;
      sum += pp[k * stride + head_dim + 1] * wk;
    }
    store(o + d, sum > 0.f ? a / sum : 0.f);
  }
}

#define INSTANTIATE_SPLIT(NAME, T, TPK, DPT, HG)                                              \
  extern "C" __global__ void __launch_bounds__(SPLIT_THREADS)                                 \
      NAME(const T *q, T *out, float *part, const uint64_t *runs, uint32_t n_runs,            \
           const uint32_t *seq_table, const uint32_t *row_seq, const uint32_t *row_index,     \
           const uint32_t *key_index, uint32_t n_rows, uint32_t n_heads, uint32_t n_kv_heads, \
           uint32_t head_dim, float scale, uint32_t chunk) {                                  \
    ragged_split<T, TPK, DPT, HG>(q, out, part, runs, n_runs, seq_table, row_seq, row_index,  \
                                  key_index, n_rows, n_heads, n_kv_heads, head_dim, scale,    \
                                  chunk);                                                     \
  }

// (threads per key, dims per thread, heads per block): the list `split_shape` in
// src/cuda.rs chooses from.
#define INSTANTIATE_SPLITS(SUFFIX, T)                                 \
  INSTANTIATE_SPLIT(ragged_split_##SUFFIX##_8_1_1, T, 8, 1, 1)        \
  INSTANTIATE_SPLIT(ragged_split_##SUFFIX##_8_2_1, T, 8, 2, 1)        \
  INSTANTIATE_SPLIT(ragged_split_##SUFFIX##_8_4_1, T, 8, 4, 1)        \
  INSTANTIATE_SPLIT(ragged_split_##SUFFIX##_8_8_1, T, 8, 8, 1)        \
  INSTANTIATE_SPLIT(ragged_split_##SUFFIX##_8_16_1, T, 8, 16, 1)      \
  INSTANTIATE_SPLIT(ragged_split_##SUFFIX##_16_16_1, T, 16, 16, 1)    \
  INSTANTIATE_SPLIT(ragged_split_##SUFFIX##_32_16_1, T, 32, 16, 1)    \
  INSTANTIATE_SPLIT(ragged_split_##SUFFIX##_8_4_2, T, 8, 4, 2)        \
  INSTANTIATE_SPLIT(ragged_split_##SUFFIX##_8_8_2, T, 8, 8, 2)        \
  INSTANTIATE_SPLIT(ragged_split_##SUFFIX##_16_8_2, T, 16, 8, 2)      \
  INSTANTIATE_SPLIT(ragged_split_##SUFFIX##_32_8_2, T, 32, 8, 2)      \
  INSTANTIATE_SPLIT(ragged_split_##SUFFIX##_32_16_2, T, 32, 16, 2)    \
  INSTANTIATE_SPLIT(ragged_split_##SUFFIX##_8_4_4, T, 8, 4, 4)        \
  INSTANTIATE_SPLIT(ragged_split_##SUFFIX##_8_8_4, T, 8, 8, 4)        \
  INSTANTIATE_SPLIT(ragged_split_##SUFFIX##_16_8_4, T, 16, 8, 4)      \
  INSTANTIATE_SPLIT(ragged_split_##SUFFIX##_32_8_4, T, 32, 8, 4)      \
  INSTANTIATE_SPLIT(ragged_split_##SUFFIX##_8_4_8, T, 8, 4, 8)        \
  INSTANTIATE_SPLIT(ragged_split_##SUFFIX##_16_4_8, T, 16, 4, 8)      \
  INSTANTIATE_SPLIT(ragged_split_##SUFFIX##_32_4_8, T, 32, 4, 8)      \
  extern "C" __global__ void ragged_combine_##SUFFIX(const float *part, T *out, uint32_t n_rows, \
                                                     uint32_t n_heads, uint32_t head_dim,        \
                                                     uint32_t n_splits) {                        \
    ragged_combine<T>(part, out, n_rows, n_heads, head_dim, n_splits);                           \
  }

INSTANTIATE_SPLITS(f32, float)
INSTANTIATE_SPLITS(bf16, __nv_bfloat16)

// ---- rows into K/V pages ----
// Row r of src [n_heads, n, head_dim] (head stride src_hs, row stride src_rs, in elements; a
// row's values consecutive) goes to row slots[r] of dst [n_heads, dst_rows, head_dim]
// (contiguous, head stride dst_hs = dst_rows * head_dim); a slot of 0xffffffff leaves row r out
// (it goes to another arena). One launch writes every row of a call's sequence into one page
// arena, in place of a copy per run of consecutive indices. Elements move as raw bits.
template <typename E>
__device__ void scatter_rows(E *__restrict__ dst, const E *__restrict__ src,
                             const uint32_t *__restrict__ slots, uint32_t n_heads, uint32_t n,
                             uint32_t head_dim, uint64_t dst_hs, uint64_t src_hs,
                             uint64_t src_rs) {
  const uint64_t total = (uint64_t)n_heads * n * head_dim;
  for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < total;
       i += (uint64_t)gridDim.x * blockDim.x) {
    const uint32_t c = (uint32_t)(i % head_dim);
    const uint64_t hr = i / head_dim;
    const uint32_t r = (uint32_t)(hr % n), h = (uint32_t)(hr / n);
    const uint32_t slot = slots[r];
    if (slot == 0xffffffffu) continue;
    dst[h * dst_hs + (uint64_t)slot * head_dim + c] = src[h * src_hs + r * src_rs + c];
  }
}

#define INSTANTIATE_SCATTER(SUFFIX, E)                                                         \
  extern "C" __global__ void scatter_rows_##SUFFIX(E *dst, const E *src, const uint32_t *slots, \
                                                   uint32_t n_heads, uint32_t n,               \
                                                   uint32_t head_dim, uint64_t dst_hs,         \
                                                   uint64_t src_hs, uint64_t src_rs) {         \
    scatter_rows<E>(dst, src, slots, n_heads, n, head_dim, dst_hs, src_hs, src_rs);           \
  }

INSTANTIATE_SCATTER(f32, uint32_t)
INSTANTIATE_SCATTER(bf16, uint16_t)
