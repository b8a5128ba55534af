// Fused anchor concat-projection: rows of mixed aggregation types in one launch.
// Block (x, r): output features x*64 .. x*64+63 of row r; each warp computes 8 of them as
// warp-reduced dot products of W_e's rows with the row's anchors, read in place (strided), so the
// concat [h_{b_0}; ...; h_{b_e}] is never built. W_e and b_e come from a device pointer table.
#include <cmath>

#include "common.cuh"

namespace spd {
namespace {

constexpr int kWarps = 8;
constexpr int kPerWarp = 8;

template <typename T>
__global__ void __launch_bounds__(kWarps * 32)
anchor_kernel(const T* __restrict__ a, int64_t stride_am, int64_t stride_ar, const void* types,
              bool types_i64, const int64_t* __restrict__ table, T* __restrict__ out,
              int64_t stride_or, int M, int D, int N, bool vec) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t r = blockIdx.y;
  const int64_t e = types_i64 ? static_cast<const int64_t*>(types)[r]
                              : (int64_t) static_cast<const int*>(types)[r];
  const bool ok = e >= 0 && e < M && table[e] != 0;
  const int n0 = blockIdx.x * (kWarps * kPerWarp) + warp * kPerWarp;
  T* o = out + r * stride_or;
  if (!ok) {  // bad type or no projection: NaN row, no memory read through the table
    if (lane < kPerWarp && n0 + lane < N) o[n0 + lane] = Num<T>::from_f(nanf(""));
    return;
  }
  const T* W = reinterpret_cast<const T*>(table[e]);
  const T* B = reinterpret_cast<const T*>(table[M + e]);
  const int64_t K = (e + 1) * (int64_t)D;
  for (int i = 0; i < kPerWarp; ++i) {
    const int n = n0 + i;
    if (n >= N) break;
    float acc = 0.f;
    for (int j = 0; j <= e; ++j) {
      const T* ar = a + j * stride_am + r * stride_ar;
      const T* wr = W + n * K + (int64_t)j * D;
      if (vec) {
        for (int k = lane * 8; k < D; k += 256) {
          float wv[8], av[8];
          load8<T>(wr + k, wv);
          load8<T>(ar + k, av);
#pragma unroll
          for (int t = 0; t < 8; ++t) acc += wv[t] * av[t];
        }
      } else {
        for (int k = lane; k < D; k += 32) acc += to_f(wr[k]) * to_f(ar[k]);
      }
    }
    acc = warp_sum(acc);
    if (lane == 0) {
      if (B != nullptr) acc += to_f(B[n]);
      o[n] = Num<T>::from_f(acc);
    }
  }
}

}  // namespace

int anchor_projection(const void* anchors, int64_t stride_am, int64_t stride_ar, const void* types,
                      bool types_i64, const int64_t* table, void* out, int64_t stride_or, int M,
                      int R, int D, int N, int dtype, bool vec, void* stream_ptr) {
  if (R <= 0 || N <= 0) return cudaSuccess;
  if (R > 65535) return cudaErrorInvalidValue;
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  dim3 grid((N + kWarps * kPerWarp - 1) / (kWarps * kPerWarp), R);
  switch (dtype) {
    case kBF16: anchor_kernel<__nv_bfloat16><<<grid, kWarps * 32, 0, stream>>>(static_cast<const __nv_bfloat16*>(anchors), stride_am, stride_ar, types, types_i64, table, static_cast<__nv_bfloat16*>(out), stride_or, M, D, N, vec); break;
    case kF16: anchor_kernel<__half><<<grid, kWarps * 32, 0, stream>>>(static_cast<const __half*>(anchors), stride_am, stride_ar, types, types_i64, table, static_cast<__half*>(out), stride_or, M, D, N, vec); break;
    case kF32: anchor_kernel<float><<<grid, kWarps * 32, 0, stream>>>(static_cast<const float*>(anchors), stride_am, stride_ar, types, types_i64, table, static_cast<float*>(out), stride_or, M, D, N, vec); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace spd
