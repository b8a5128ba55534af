// The per-head half of qkv_rope_append (spd_kernels/pdm.py): after the q, k and v products (run
// by linear.cu), the per-head RMSNorm of q and k, RoPE, and the cache append, with the position
// read on the device (a CUDA graph replays it at any position).
//
// Block (row t, head j): j < H a query head, then KVH key heads, then KVH value heads. Thread i
// holds elements i and i + HD/2 of the head, the pair RoPE mixes. Rounded to the model dtype op by
// op where the reference (torch in bf16 / fp16) rounds, so the result matches it to the bit in
// most elements. q goes to q_out [H, T, HD]; k and v go to the caches [KVH, S, HD] at row start +
// t, dropped when that is past the capacity.
#include <cmath>

#include "common.cuh"

namespace spd {
namespace {

template <typename T>
__global__ void __launch_bounds__(128)
qk_rope_append(const T* __restrict__ qp, int64_t sqp, const T* __restrict__ kp, int64_t skp,
               const T* __restrict__ vp, int64_t svp, const T* __restrict__ q_norm,
               const T* __restrict__ k_norm, const T* __restrict__ cos, const T* __restrict__ sin,
               int64_t scs, const int64_t* __restrict__ start_ptr, T* __restrict__ q_out,
               T* __restrict__ k_cache, T* __restrict__ v_cache, int rows, int H, int KVH, int S,
               int P, int HD, float eps) {
  __shared__ float s_part[4];
  pdl_enter();
  const int t = blockIdx.x, j = blockIdx.y, i = threadIdx.x, half = HD / 2;
  const bool mine = i < half;  // threads past HD / 2 only help with the reduction
  const int64_t pos = *start_ptr + t;
  const bool ok = pos >= 0 && pos < S;
  const T* src = j < H ? qp + (int64_t)t * sqp + (int64_t)j * HD
               : j < H + KVH ? kp + (int64_t)t * skp + (int64_t)(j - H) * HD
                             : vp + (int64_t)t * svp + (int64_t)(j - H - KVH) * HD;
  float lo = mine ? to_f(src[i]) : 0.f, hi = mine ? to_f(src[i + half]) : 0.f;
  if (j >= H + KVH) {  // a value head: straight into the cache
    if (mine && ok) {
      T* dst = v_cache + ((int64_t)(j - H - KVH) * S + pos) * HD;
      dst[i] = Num<T>::from_f(lo);
      dst[i + half] = Num<T>::from_f(hi);
    }
    return;
  }
  if (q_norm != nullptr) {  // block-uniform: every thread reaches the barrier
    float ss = warp_sum(lo * lo + hi * hi);
    if ((i & 31) == 0) s_part[i >> 5] = ss;
    __syncthreads();
    ss = 0.f;
    for (int w = 0; w < (int)(blockDim.x >> 5); ++w) ss += s_part[w];
    const float r = rsqrtf(ss / (float)HD + eps);
    const T* g = j < H ? q_norm : k_norm;
    if (mine) {
      lo = round_to<T>(to_f(g[i]) * round_to<T>(lo * r));
      hi = round_to<T>(to_f(g[i + half]) * round_to<T>(hi * r));
    }
  }
  if (!mine) return;
  float c_lo = 0.f, c_hi = 0.f, s_lo = 0.f, s_hi = 0.f;  // past the tables: zeros
  if (pos >= 0 && pos < P) {  // P: rows of the RoPE tables
    const int64_t row = pos * scs;
    c_lo = to_f(cos[row + i]);
    c_hi = to_f(cos[row + i + half]);
    s_lo = to_f(sin[row + i]);
    s_hi = to_f(sin[row + i + half]);
  }
  // x * cos + rotate_half(x) * sin, rotate_half(x) = [-x_hi, x_lo]
  const float out_lo = round_to<T>(round_to<T>(lo * c_lo) + round_to<T>(-hi * s_lo));
  const float out_hi = round_to<T>(round_to<T>(hi * c_hi) + round_to<T>(lo * s_hi));
  T* dst;
  if (j < H) {
    dst = q_out + ((int64_t)j * rows + t) * HD;
  } else {
    if (!ok) return;
    dst = k_cache + ((int64_t)(j - H) * S + pos) * HD;
  }
  dst[i] = Num<T>::from_f(out_lo);
  dst[i + half] = Num<T>::from_f(out_hi);
}

template <typename T>
int launch(const void* qp, int64_t sqp, const void* kp, int64_t skp, const void* vp, int64_t svp,
           const void* q_norm, const void* k_norm, const void* cos, const void* sin, int64_t scs,
           const int64_t* start, void* q_out, void* k_cache, void* v_cache, int rows, int H,
           int KVH, int S, int P, int HD, float eps, cudaStream_t stream) {
  const int threads = (HD / 2 + 31) / 32 * 32;
  auto kernel = qk_rope_append<T>;
  SPD_LAUNCH(kernel, dim3(rows, H + 2 * KVH), threads, 0, stream)(
      static_cast<const T*>(qp), sqp, static_cast<const T*>(kp), skp, static_cast<const T*>(vp),
      svp, static_cast<const T*>(q_norm), static_cast<const T*>(k_norm),
      static_cast<const T*>(cos), static_cast<const T*>(sin), scs, start, static_cast<T*>(q_out),
      static_cast<T*>(k_cache), static_cast<T*>(v_cache), rows, H, KVH, S, P, HD, eps);
  return cudaGetLastError();
}

}  // namespace

int rope_append(const void* qp, int64_t stride_qp, const void* kp, int64_t stride_kp,
                const void* vp, int64_t stride_vp, const void* q_norm, const void* k_norm,
                const void* cos, const void* sin, int64_t stride_cs, const int64_t* start,
                void* q_out, void* k_cache, void* v_cache, int rows, int H, int KVH, int S, int P,
                int HD, float eps, int dtype, void* stream_ptr) {
  if (rows <= 0) return cudaSuccess;
  // The Python side checks all of this with messages; here it only keeps a bad call from
  // reading out of bounds.
  if (H <= 0 || KVH <= 0 || S <= 0 || P <= 0 || HD <= 0 || HD % 2 != 0 || HD > 256 || rows > 0x7fffffff ||
      H + 2 * KVH > 65535 || (q_norm == nullptr) != (k_norm == nullptr))
    return cudaErrorInvalidValue;
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  switch (dtype) {
    case kBF16:
      return launch<__nv_bfloat16>(qp, stride_qp, kp, stride_kp, vp, stride_vp, q_norm, k_norm,
                                   cos, sin, stride_cs, start, q_out, k_cache, v_cache, rows, H,
                                   KVH, S, P, HD, eps, stream);
    case kF16:
      return launch<__half>(qp, stride_qp, kp, stride_kp, vp, stride_vp, q_norm, k_norm, cos, sin,
                            stride_cs, start, q_out, k_cache, v_cache, rows, H, KVH, S, P, HD,
                            eps, stream);
    default:
      return cudaErrorInvalidValue;  // fp32: the products have no tensor-core path either
  }
}

}  // namespace spd
