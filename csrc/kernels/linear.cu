// Linear layers over a few rows on tensor cores: fused_linear and fused_swiglu
// (spd_kernels/linear.py), the dense part of the PDM step.
//
// With at most 16 rows the time is reading the weight once. The rows of x and the weight rows go
// through mma_stream.cuh (rows of x as the MMA's 16 rows, 8 weight rows as its columns, each
// 16-byte load used as a fragment as loaded). A warp takes 8 * NV output columns of each of S
// weights (SwiGLU's gate and up) over its block's K range.
//
// Launches: (1) with a norm, norm_rows writes rms_norm(x) to xn once (rounded to the model dtype
// twice, as the reference); (2) linear_mma over (column blocks, K splits); (3) with more than one
// split, linear_reduce sums the fp32 partials in split order (deterministic) and applies the
// epilogue, which otherwise runs in (2): round, SwiGLU, residual, rounded where the reference
// rounds.
#include "mma_stream.cuh"

namespace spd {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kMinBlocks = 4;  // resident blocks per SM the register use must allow

template <typename T>
__device__ __forceinline__ float finish(float a, float up, bool swiglu, const T* res) {
  float y = round_to<T>(a);
  if (swiglu) {
    const float s = round_to<T>(y / (1.f + expf(-y)));
    y = round_to<T>(s * round_to<T>(up));
  }
  if (res != nullptr) y = round_to<T>(to_f(*res) + y);
  return y;
}

template <typename T>
__global__ void __launch_bounds__(256)
norm_rows(const T* __restrict__ x, int64_t sx, const T* __restrict__ g, T* __restrict__ xn, int K,
          float eps) {
  __shared__ float s_part[8];
  __shared__ float s_rstd;
  pdl_enter();
  const int r = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const T* xr = x + (int64_t)r * sx;
  float ss = 0.f;
  for (int k = threadIdx.x; k < K; k += blockDim.x) {
    const float v = to_f(xr[k]);
    ss = fmaf(v, v, ss);
  }
  ss = warp_sum(ss);
  if (lane == 0) s_part[warp] = ss;
  __syncthreads();
  if (threadIdx.x == 0) {
    float s = 0.f;
    for (int w = 0; w < (int)(blockDim.x >> 5); ++w) s += s_part[w];
    s_rstd = rsqrtf(s / (float)K + eps);
  }
  __syncthreads();
  const float rs = s_rstd;
  for (int k = threadIdx.x; k < K; k += blockDim.x)
    xn[(int64_t)r * K + k] = Num<T>::from_f(to_f(g[k]) * round_to<T>(to_f(xr[k]) * rs));
}

// Block (bx, split): output columns [(bx * kWarps + warp) * 8 * NV, + 8 * NV) of each weight, K
// range [split * k_per, + k_per). TWO: R > 8, so x rows 8..15 are loaded too.
// kMinBlocks in the launch bounds: a register budget of 128 (see mma_stream.cuh).
template <typename T, int S, int NV, bool TWO>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
linear_mma(const T* __restrict__ x, int64_t sx, const T* __restrict__ w0,
           const T* __restrict__ w1, const T* __restrict__ res, int64_t sres, T* __restrict__ out,
           int64_t sout, float* __restrict__ ws, int R, int N, int K, int k_per) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, q = lane & 3;
  const int n0 = (blockIdx.x * kWarps + warp) * 8 * NV;
  const int k_lo = blockIdx.y * k_per, k_hi = min(K, k_lo + k_per);
  const T* wrow[S][NV];
#pragma unroll
  for (int s = 0; s < S; ++s)
#pragma unroll
    for (int v = 0; v < NV; ++v)  // columns past N re-read column N - 1; their sums are dropped
      wrow[s][v] = (s == 0 ? w0 : w1) + (int64_t)min(n0 + 8 * v + g, N - 1) * K;
  // Weights are no kernel's output: under a programmatic launch their first batch streams into
  // L2 while the kernel before is finishing.
  if (n0 < N && q == 0)
#pragma unroll
    for (int u = 0; u < kMmaUnroll; ++u)
      if (k_lo + u * kMmaChunk < k_hi)
#pragma unroll
        for (int s = 0; s < S; ++s)
#pragma unroll
          for (int v = 0; v < NV; ++v) prefetch_l2(wrow[s][v] + k_lo + u * kMmaChunk);
  pdl_enter();
  if (n0 >= N) return;  // the whole warp: no mma is left half-issued
  const bool a_ok = g < R, b_ok = TWO && g + 8 < R;
  const T* xa = x + (int64_t)min(g, R - 1) * sx;
  const T* xb = x + (int64_t)min(g + 8, R - 1) * sx;

  float acc[S][NV][4];
#pragma unroll
  for (int s = 0; s < S; ++s)
#pragma unroll
    for (int v = 0; v < NV; ++v)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[s][v][i] = 0.f;

  mma_stream<T, S, NV, TWO>(
      wrow, [xa](int k) { return xa + k; }, [xb](int k) { return xb + k; }, a_ok, b_ok, k_lo,
      k_hi, q, acc);

  // acc[s][v][i]: row g + 8 * (i >= 2), column n0 + 8 v + 2 q + (i & 1)
  const bool partial = gridDim.y > 1;
#pragma unroll
  for (int v = 0; v < NV; ++v)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = g + (i >= 2 ? 8 : 0), n = n0 + 8 * v + 2 * q + (i & 1);
      if (r >= R || n >= N) continue;
      if (partial) {
#pragma unroll
        for (int s = 0; s < S; ++s)
          ws[(((int64_t)blockIdx.y * S + s) * R + r) * N + n] = acc[s][v][i];
      } else {
        const float y = finish<T>(acc[0][v][i], acc[S - 1][v][i], S == 2,
                                  res != nullptr ? res + (int64_t)r * sres + n : nullptr);
        out[(int64_t)r * sout + n] = Num<T>::from_f(y);
      }
    }
}

template <typename T, int S>
__global__ void __launch_bounds__(256)
linear_reduce(const float* __restrict__ ws, int splits, const T* __restrict__ res, int64_t sres,
              T* __restrict__ out, int64_t sout, int R, int N) {
  pdl_enter();
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (int64_t)R * N) return;
  const int r = (int)(i / N), n = (int)(i % N);
  float a = 0.f, up = 0.f;
  for (int sp = 0; sp < splits; ++sp) {
    a += ws[(((int64_t)sp * S) * R + r) * N + n];
    if (S == 2) up += ws[(((int64_t)sp * S + 1) * R + r) * N + n];
  }
  const float y = finish<T>(a, up, S == 2, res != nullptr ? res + (int64_t)r * sres + n : nullptr);
  out[(int64_t)r * sout + n] = Num<T>::from_f(y);
}

template <typename T, int S>
int launch(const void* x, int64_t sx, const void* norm_weight, void* xn, const void* w0,
           const void* w1, const void* res, int64_t sres, void* out, int64_t sout, float* ws,
           int R, int N, int K, int splits, int k_per, float eps, cudaStream_t stream) {
  const T* xs = static_cast<const T*>(x);
  if (norm_weight != nullptr) {
    SPD_LAUNCH(norm_rows<T>, R, 256, 0, stream)(xs, sx, static_cast<const T*>(norm_weight),
                                                static_cast<T*>(xn), K, eps);
    xs = static_cast<const T*>(xn);
    sx = K;
  }
  constexpr int NV = 2 / S;  // two 16-byte weight loads per lane and chunk either way
  const dim3 grid((N + kWarps * 8 * NV - 1) / (kWarps * 8 * NV), splits);
  auto kernel = R > 8 ? linear_mma<T, S, NV, true> : linear_mma<T, S, NV, false>;
  SPD_LAUNCH(kernel, grid, kThreads, 0, stream)(
      xs, sx, static_cast<const T*>(w0), static_cast<const T*>(w1), static_cast<const T*>(res),
      sres, static_cast<T*>(out), sout, ws, R, N, K, k_per);
  if (splits > 1) {
    const int64_t n = (int64_t)R * N;
    auto reduce = linear_reduce<T, S>;
    SPD_LAUNCH(reduce, (unsigned)((n + 255) / 256), 256, 0, stream)(
        ws, splits, static_cast<const T*>(res), sres, static_cast<T*>(out), sout, R, N);
  }
  return cudaGetLastError();
}

// The MMA alone on one warp, fragments filled element by element from the PTX ISA's layout
// (common.cuh), not through mma_stream's 16-byte trick: c [16, 8] = a [16, 16] @ b [8, 16]^T.
// A known-answer check of the instruction and of the layout this code assumes (on a GPU against
// the hardware, in the emulation against simt_host.cpp).
template <typename T>
__global__ void mma_check(const T* __restrict__ a, const T* __restrict__ b, float* __restrict__ c) {
  pdl_enter();
  const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
  auto pair = [](const T* p) {  // elements p[0] (low half) and p[1]
    uint32_t lo, hi;
    const T x0 = p[0], x1 = p[1];
    memcpy(&lo, &x0, 2);
    memcpy(&hi, &x1, 2);
    return (lo & 0xffffu) | (hi << 16);
  };
  const uint32_t fa[4] = {pair(a + g * 16 + 2 * q), pair(a + (g + 8) * 16 + 2 * q),
                          pair(a + g * 16 + 2 * q + 8), pair(a + (g + 8) * 16 + 2 * q + 8)};
  const uint32_t fb[2] = {pair(b + g * 16 + 2 * q), pair(b + g * 16 + 2 * q + 8)};
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  mma_16816<T>(acc, fa, fb);
  for (int i = 0; i < 4; ++i) c[(g + (i >= 2 ? 8 : 0)) * 8 + 2 * q + (i & 1)] = acc[i];
}

}  // namespace

int mma_selftest(const void* a, const void* b, float* c, int dtype, void* stream_ptr) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  switch (dtype) {
    case kBF16:
      SPD_LAUNCH(mma_check<__nv_bfloat16>, 1, 32, 0, stream)(
          static_cast<const __nv_bfloat16*>(a), static_cast<const __nv_bfloat16*>(b), c);
      break;
    case kF16:
      SPD_LAUNCH(mma_check<__half>, 1, 32, 0, stream)(static_cast<const __half*>(a),
                                                      static_cast<const __half*>(b), c);
      break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

int fused_linear(const void* x, int64_t stride_x, const void* norm_weight, void* xn,
                 const void* w0, const void* w1, const void* residual, int64_t stride_res,
                 void* out, int64_t stride_out, float* ws, int R, int N, int K, int splits,
                 int k_per, float eps, int dtype, void* stream_ptr) {
  if (R <= 0 || N <= 0) return cudaSuccess;
  // The Python side checks all of this with messages; here it only keeps a bad call from
  // reading out of bounds.
  if (R > kMmaRows || K <= 0 || K % 8 != 0 || splits < 1 || k_per <= 0 || k_per % kMmaChunk != 0 ||
      (int64_t)(splits - 1) * k_per >= K || (int64_t)splits * k_per < K ||
      (splits > 1 && ws == nullptr) || (norm_weight != nullptr && xn == nullptr) ||
      (int64_t)(N + kWarps * 8 - 1) / (kWarps * 8) > 0x7fffffff || splits > 65535)
    return cudaErrorInvalidValue;
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const bool swiglu = w1 != nullptr;
  switch (dtype) {
    case kBF16:
      return swiglu ? launch<__nv_bfloat16, 2>(x, stride_x, norm_weight, xn, w0, w1, residual, stride_res, out, stride_out, ws, R, N, K, splits, k_per, eps, stream)
                    : launch<__nv_bfloat16, 1>(x, stride_x, norm_weight, xn, w0, w1, residual, stride_res, out, stride_out, ws, R, N, K, splits, k_per, eps, stream);
    case kF16:
      return swiglu ? launch<__half, 2>(x, stride_x, norm_weight, xn, w0, w1, residual, stride_res, out, stride_out, ws, R, N, K, splits, k_per, eps, stream)
                    : launch<__half, 1>(x, stride_x, norm_weight, xn, w0, w1, residual, stride_res, out, stride_out, ws, R, N, K, splits, k_per, eps, stream);
    default:
      return cudaErrorInvalidValue;  // fp32 has no 16-bit tensor-core path: the Triton kernel
  }
}

}  // namespace spd
