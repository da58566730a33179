// Grouped matmul over layer-stacked weights (semantics: src/grouped.rs, the CPU reference).
// y[r, n] = sum_k x[r, k] * w[weight(g), n, k] for the rows r of group g. The grid's y axis walks
// a table of row tiles that never straddle a group ([group, first row, rows]), so each 16x16
// output tile multiplies by one weight, read in place from the stack; float32 accumulation.
#include <cuda_bf16.h>
#include <stdint.h>

#define TILE 16

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ void store(float *p, float x) { *p = x; }
__device__ __forceinline__ void store(__nv_bfloat16 *p, float x) { *p = __float2bfloat16(x); }

template <typename T>
__device__ void grouped_matmul(const T *__restrict__ x, const T *__restrict__ w, T *__restrict__ y,
                               const uint32_t *__restrict__ tiles,        // 3 per tile
                               const uint32_t *__restrict__ group_weight,  // per group
                               uint32_t k, uint32_t n) {
  __shared__ float xs[TILE][TILE + 1];
  __shared__ float ws[TILE][TILE + 1];
  const uint32_t *t = tiles + 3 * blockIdx.y;
  const uint32_t row0 = t[1], rows = t[2];
  const T *wl = w + (size_t)group_weight[t[0]] * n * k;
  const uint32_t tr = threadIdx.y, tc = threadIdx.x;
  const uint32_t col = blockIdx.x * TILE + tc;
  float acc = 0.f;
  for (uint32_t k0 = 0; k0 < k; k0 += TILE) {
    uint32_t kk = k0 + tc;
    xs[tr][tc] = (tr < rows && kk < k) ? to_f(x[(size_t)(row0 + tr) * k + kk]) : 0.f;
    uint32_t wn = blockIdx.x * TILE + tr;
    ws[tr][tc] = (wn < n && kk < k) ? to_f(wl[(size_t)wn * k + kk]) : 0.f;
    __syncthreads();
#pragma unroll
    for (int i = 0; i < TILE; ++i) acc += xs[tr][i] * ws[tc][i];
    __syncthreads();
  }
  if (tr < rows && col < n) store(y + (size_t)(row0 + tr) * n + col, acc);
}

#define INSTANTIATE(NAME, T)                                                                   \
  extern "C" __global__ void NAME(const T *x, const T *w, T *y, const uint32_t *tiles,        \
                                  const uint32_t *group_weight, uint32_t k, uint32_t n) {     \
    grouped_matmul<T>(x, w, y, tiles, group_weight, k, n);                                     \
  }

INSTANTIATE(grouped_matmul_f32, float)
INSTANTIATE(grouped_matmul_bf16, __nv_bfloat16)
