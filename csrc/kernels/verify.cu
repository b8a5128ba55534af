// Greedy verification: fused final RMSNorm + LM-head GEMV + argmax + compare with the draft.
//
// Pass 1 (greedy_partial): a persistent grid (about one wave of resident blocks per hidden-row
// tile). Each block normalises its up to MAXR hidden rows into shared memory (rounded to the model
// dtype twice, exactly as the reference `norm_weight * (h * rstd).to(dtype)` does). Then every warp
// strides over groups of NV consecutive vocabulary rows; for each group it issues NV * U
// independent 16-byte loads per lane before the first FMA, reduces the dot products over the warp,
// rounds each logit to the model dtype (the reference's logits are in that dtype) and keeps the
// running maximum with the lowest index. Block maxima go to pval/pidx; logits never reach memory.
// Pass 2 (greedy_reduce): one block per hidden row reduces the per-block maxima and compares.
// (value, -index) is a total order, so the result does not depend on how rows are split.
#include <atomic>
#include <cfloat>
#include <climits>
#include <cstdlib>

#include "common.cuh"

namespace spd {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kMaxSmem = 96 * 1024;
constexpr int kMaxPartials = 2048;  // upper bound of the persistent grid's x size

// 16 bytes of T unpacked to fp32 (exact conversions): E elements.
template <typename T>
struct Chunk {
  static constexpr int E = 8;
  static __device__ __forceinline__ void unpack(const uint4& q, float* f) { unpack8<T>(q, f); }
};

template <>
struct Chunk<float> {
  static constexpr int E = 4;
  static __device__ __forceinline__ void unpack(const uint4& q, float* f) {
    f[0] = __uint_as_float(q.x);
    f[1] = __uint_as_float(q.y);
    f[2] = __uint_as_float(q.z);
    f[3] = __uint_as_float(q.w);
  }
};

// Vectorised dot products of NV weight rows with the nr normed rows in s_h.
// U chunks of 16 bytes per row and lane are loaded before any is used.
template <typename T, int MAXR, int NV, int U>
__device__ __forceinline__ void dot_vec(const T* const (&wr)[NV], const float* s_h, int D, int nr,
                                        int lane, float (&acc)[NV][MAXR]) {
  constexpr int E = Chunk<T>::E;
  constexpr int kStep = 32 * E;  // elements per warp-wide chunk
  for (int k0 = 0; k0 < D; k0 += kStep * U) {
    uint4 raw[NV][U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int k = k0 + u * kStep + lane * E;
#pragma unroll
      for (int n = 0; n < NV; ++n)
        raw[n][u] = k < D ? __ldg(reinterpret_cast<const uint4*>(wr[n] + k)) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int k = k0 + u * kStep + lane * E;
      if (k < D) {  // D % E == 0 here: a chunk is either all in or all out
        float wf[NV][E];
#pragma unroll
        for (int n = 0; n < NV; ++n) Chunk<T>::unpack(raw[n][u], wf[n]);
#pragma unroll
        for (int r = 0; r < MAXR; ++r) {
          if (r < nr) {
            float hv[E];
            const float4* hp = reinterpret_cast<const float4*>(s_h + r * D + k);
#pragma unroll
            for (int j = 0; j < E / 4; ++j) {
              const float4 t = hp[j];
              hv[4 * j] = t.x;
              hv[4 * j + 1] = t.y;
              hv[4 * j + 2] = t.z;
              hv[4 * j + 3] = t.w;
            }
#pragma unroll
            for (int n = 0; n < NV; ++n)
#pragma unroll
              for (int e = 0; e < E; ++e) acc[n][r] = fmaf(wf[n][e], hv[e], acc[n][r]);
          }
        }
      }
    }
  }
}

// Element-wise fallback (unaligned weight, odd D or row stride), same load batching.
template <typename T, int MAXR, int NV, int U>
__device__ __forceinline__ void dot_scalar(const T* const (&wr)[NV], const float* s_h, int D,
                                           int nr, int lane, float (&acc)[NV][MAXR]) {
  for (int k0 = 0; k0 < D; k0 += 32 * U) {
    float wv[NV][U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int k = k0 + u * 32 + lane;
#pragma unroll
      for (int n = 0; n < NV; ++n) wv[n][u] = k < D ? to_f(wr[n][k]) : 0.f;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int k = k0 + u * 32 + lane;
      if (k < D) {
#pragma unroll
        for (int r = 0; r < MAXR; ++r) {
          if (r < nr) {
            const float hv = s_h[r * D + k];
#pragma unroll
            for (int n = 0; n < NV; ++n) acc[n][r] = fmaf(wv[n][u], hv, acc[n][r]);
          }
        }
      }
    }
  }
}

template <typename T, int MAXR, int NV, int U>
__global__ void __launch_bounds__(kThreads)
greedy_partial(const T* __restrict__ h, int64_t stride_h, const T* __restrict__ g,
               const T* __restrict__ w, int64_t stride_w, float* __restrict__ pval,
               int* __restrict__ pidx, int R, int D, int V, int NB, float eps, float norm_offset,
               bool vec) {
  SPD_DYNAMIC_SHARED(float4, s_h4);  // [MAXR][D] fp32; float4 for 16-byte alignment
  float* s_h = reinterpret_cast<float*>(s_h4);
  __shared__ float s_part[kWarps][MAXR];
  __shared__ float s_rstd[MAXR];
  __shared__ float s_best[kWarps][MAXR];
  __shared__ int s_idx[kWarps][MAXR];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int r0 = blockIdx.y * MAXR;
  const int nr = min(MAXR, R - r0);
  const int groups = (V + NV - 1) / NV;
  const int gw0 = blockIdx.x * kWarps + warp;
  const int gstride = gridDim.x * kWarps;

  // Start pulling this warp's first weight batch into L2 while the norm prologue runs.
  if (vec && gw0 < groups) {
    constexpr int E = Chunk<T>::E;
#pragma unroll
    for (int n = 0; n < NV; ++n) {
      const T* row = w + (int64_t)min(gw0 * NV + n, V - 1) * stride_w;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int k = u * 32 * E + lane * E;
        if (k < D) prefetch_l2(row + k);
      }
    }
  }
  pdl_enter();  // the prefetch above reads no kernel's output; everything below may

  // RMSNorm prologue: all warps share the sum of squares of every row.
  float ss[MAXR];
#pragma unroll
  for (int r = 0; r < MAXR; ++r) ss[r] = 0.f;
  for (int k = threadIdx.x; k < D; k += kThreads) {
#pragma unroll
    for (int r = 0; r < MAXR; ++r)
      if (r < nr) {
        const float v = to_f(h[(int64_t)(r0 + r) * stride_h + k]);
        ss[r] = fmaf(v, v, ss[r]);
      }
  }
#pragma unroll
  for (int r = 0; r < MAXR; ++r) {
    const float s = warp_sum(ss[r]);
    if (lane == 0) s_part[warp][r] = s;
  }
  __syncthreads();
  if (threadIdx.x < nr) {
    float s = 0.f;
#pragma unroll
    for (int wi = 0; wi < kWarps; ++wi) s += s_part[wi][threadIdx.x];
    s_rstd[threadIdx.x] = rsqrtf(s / (float)D + eps);
  }
  __syncthreads();
#pragma unroll
  for (int r = 0; r < MAXR; ++r) {
    if (r < nr) {
      const T* x = h + (int64_t)(r0 + r) * stride_h;
      const float rs = s_rstd[r];
      for (int k = threadIdx.x; k < D; k += kThreads) {
        // zero-centred (norm_offset != 0): (h * (offset + w)).to(dtype), as Qwen3.5 / Qwen3-Next
        s_h[r * D + k] = norm_offset != 0.f
                             ? round_to<T>(to_f(x[k]) * rs * (norm_offset + to_f(g[k])))
                             : round_to<T>(to_f(g[k]) * round_to<T>(to_f(x[k]) * rs));
      }
    }
  }
  __syncthreads();

  float best[MAXR];
  int bidx[MAXR];
#pragma unroll
  for (int r = 0; r < MAXR; ++r) {
    best[r] = -INFINITY;
    bidx[r] = INT_MAX;
  }
  for (int gi = gw0; gi < groups; gi += gstride) {
    const int v0 = gi * NV;
    const T* wr[NV];
#pragma unroll
    for (int n = 0; n < NV; ++n)  // rows past V re-read row V-1; their results are dropped
      wr[n] = w + (int64_t)min(v0 + n, V - 1) * stride_w;
    float acc[NV][MAXR];
#pragma unroll
    for (int n = 0; n < NV; ++n)
#pragma unroll
      for (int r = 0; r < MAXR; ++r) acc[n][r] = 0.f;
    if (vec)
      dot_vec<T, MAXR, NV, U>(wr, s_h, D, nr, lane, acc);
    else
      dot_scalar<T, MAXR, NV, U>(wr, s_h, D, nr, lane, acc);
#pragma unroll
    for (int n = 0; n < NV; ++n) {
      if (v0 + n < V) {  // warp-uniform
#pragma unroll
        for (int r = 0; r < MAXR; ++r) {
          if (r >= nr) continue;
          const float s = round_to<T>(warp_sum(acc[n][r]));
          if (better(s, v0 + n, best[r], bidx[r])) {  // NaN first, then the lowest index
            best[r] = s;
            bidx[r] = v0 + n;
          }
        }
      }
    }
  }
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < MAXR; ++r) {
      s_best[warp][r] = best[r];
      s_idx[warp][r] = bidx[r];
    }
  }
  __syncthreads();
  if (threadIdx.x < nr) {
    const int r = threadIdx.x;
    float b = -INFINITY;
    int bi = INT_MAX;
    for (int wi = 0; wi < kWarps; ++wi)
      if (better(s_best[wi][r], s_idx[wi][r], b, bi)) {
        b = s_best[wi][r];
        bi = s_idx[wi][r];
      }
    pval[(int64_t)(r0 + r) * NB + blockIdx.x] = b;
    pidx[(int64_t)(r0 + r) * NB + blockIdx.x] = bi;
  }
}

// Reduces the first NP of the NB partial slots of each row.
__global__ void __launch_bounds__(256)
greedy_reduce(const float* __restrict__ pval, const int* __restrict__ pidx, int NB, int NP,
              const void* draft, bool draft_i64, int64_t* target, bool* accepted) {
  __shared__ float s_v[8];
  __shared__ int s_i[8];
  pdl_enter();
  const int r = blockIdx.x;
  float b = -INFINITY;
  int bi = INT_MAX;
  for (int i = threadIdx.x; i < NP; i += blockDim.x) {
    const float v = pval[(int64_t)r * NB + i];
    const int ii = pidx[(int64_t)r * NB + i];
    if (better(v, ii, b, bi)) {
      b = v;
      bi = ii;
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, b, o);
    const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
    if (better(ov, oi, b, bi)) {
      b = ov;
      bi = oi;
    }
  }
  if ((threadIdx.x & 31) == 0) {
    s_v[threadIdx.x >> 5] = b;
    s_i[threadIdx.x >> 5] = bi;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int wi = 1; wi < (int)(blockDim.x >> 5); ++wi)
      if (better(s_v[wi], s_i[wi], b, bi)) {
        b = s_v[wi];
        bi = s_i[wi];
      }
    const int64_t d = draft_i64 ? static_cast<const int64_t*>(draft)[r]
                                : (int64_t) static_cast<const int*>(draft)[r];
    target[r] = bi;
    accepted[r] = (d == (int64_t)bi);
  }
}

constexpr int kMaxDevices = 64;

// Resident blocks of one instantiation on the current device for this smem size, cached per
// device (the smem opt-in is per device too). 0 on error.
template <typename K>
int resident_blocks(K kernel, size_t smem, std::atomic<unsigned long long>* cache, int* err) {
  int dev = 0;
  if ((*err = cudaGetDevice(&dev)) != cudaSuccess) return 0;
  const unsigned long long key = (unsigned long long)(smem + 1) << 32;
  // The emulated device's SM count can change between calls (simulated(multiprocessors=...)):
  // no cache there.
  const bool cached = dev < kMaxDevices && !kHostEmulation;
  if (cached) {
    const unsigned long long c = cache[dev].load(std::memory_order_relaxed);
    if ((c >> 32) << 32 == key) return (int)(c & 0xffffffffu);
  }
  int sms = 0, per_sm = 0;
  if ((*err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   kMaxSmem)) != cudaSuccess ||
      (*err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev)) != cudaSuccess ||
      (*err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, smem)) !=
          cudaSuccess)
    return 0;
  const int n = max(1, per_sm) * max(1, sms);
  if (cached) cache[dev].store(key | (unsigned)n, std::memory_order_relaxed);
  return n;
}

// Launches pass 1; *np receives the number of partial slots written per row.
template <typename T, int MAXR, int NV, int U>
int launch_partial(const void* hidden, int64_t stride_h, const void* norm_weight,
                   const void* weight, int64_t stride_w, float* pval, int* pidx, int R, int D,
                   int V, int NB, float eps, float norm_offset, cudaStream_t stream, int* np) {
  static std::atomic<unsigned long long> cache[kMaxDevices];
  const size_t smem = (size_t)MAXR * D * sizeof(float);
  auto kernel = greedy_partial<T, MAXR, NV, U>;
  int err = cudaSuccess;
  const int resident = resident_blocks(kernel, smem, cache, &err);
  if (err != cudaSuccess) return err;
  // One wave in all: blocks of different row tiles then read the same weights at about the
  // same time, so R > MAXR mostly hits L2 instead of re-reading HBM.
  const int gy = (R + MAXR - 1) / MAXR;
  const int groups = (V + NV - 1) / NV;
  int gx = min(NB, (groups + kWarps - 1) / kWarps);
  gx = max(1, min(gx, resident / gy));
  constexpr int E = Chunk<T>::E;
  const bool vec = (D % E == 0) && (stride_w % E == 0) &&
                   (reinterpret_cast<uintptr_t>(weight) & 15u) == 0;
  SPD_LAUNCH(kernel, dim3(gx, gy), kThreads, smem, stream)(
      static_cast<const T*>(hidden), stride_h, static_cast<const T*>(norm_weight),
      static_cast<const T*>(weight), stride_w, pval, pidx, R, D, V, NB, eps, norm_offset, vec);
  *np = gx;
  return cudaGetLastError();
}

// SPD_VERIFY_VARIANT (read once): 0 = 2 rows x 4 chunks in flight per lane (default),
// 1 = 4 rows x 2 chunks, 2 = 2 rows x 8 chunks.
int variant() {
  static const int v = [] {
    const char* s = std::getenv("SPD_VERIFY_VARIANT");
    const int x = s ? std::atoi(s) : 0;
    return (x >= 0 && x <= 2) ? x : 0;
  }();
  return v;
}

template <typename T, int MAXR>
int dispatch_variant(const void* hidden, int64_t stride_h, const void* norm_weight,
                     const void* weight, int64_t stride_w, float* pval, int* pidx, int R, int D,
                     int V, int NB, float eps, float norm_offset, cudaStream_t stream, int* np) {
  switch (variant()) {
    case 1: return launch_partial<T, MAXR, 4, 2>(hidden, stride_h, norm_weight, weight, stride_w, pval, pidx, R, D, V, NB, eps, norm_offset, stream, np);
    case 2: return launch_partial<T, MAXR, 2, 8>(hidden, stride_h, norm_weight, weight, stride_w, pval, pidx, R, D, V, NB, eps, norm_offset, stream, np);
    default: return launch_partial<T, MAXR, 2, 4>(hidden, stride_h, norm_weight, weight, stride_w, pval, pidx, R, D, V, NB, eps, norm_offset, stream, np);
  }
}

template <typename T>
int dispatch_rows(const void* hidden, int64_t stride_h, const void* norm_weight,
                  const void* weight, int64_t stride_w, float* pval, int* pidx, int R, int D,
                  int V, int NB, float eps, float norm_offset, cudaStream_t stream, int* np) {
  const int fit = kMaxSmem / (D * (int)sizeof(float));  // hidden rows whose normed copy fits
  int maxr = 1;
  while (maxr < 8 && maxr < R && maxr * 2 <= fit) maxr *= 2;
  switch (maxr) {
    case 8: return dispatch_variant<T, 8>(hidden, stride_h, norm_weight, weight, stride_w, pval, pidx, R, D, V, NB, eps, norm_offset, stream, np);
    case 4: return dispatch_variant<T, 4>(hidden, stride_h, norm_weight, weight, stride_w, pval, pidx, R, D, V, NB, eps, norm_offset, stream, np);
    case 2: return dispatch_variant<T, 2>(hidden, stride_h, norm_weight, weight, stride_w, pval, pidx, R, D, V, NB, eps, norm_offset, stream, np);
    default: return dispatch_variant<T, 1>(hidden, stride_h, norm_weight, weight, stride_w, pval, pidx, R, D, V, NB, eps, norm_offset, stream, np);
  }
}

}  // namespace

// Partial slots per row: an upper bound of the persistent grid's x size (pass 1 uses the first
// min(this, resident blocks) of them).
int verify_greedy_num_blocks(int V) {
  return max(1, min((V + kWarps - 1) / kWarps, kMaxPartials));
}

int verify_greedy(const void* hidden, int64_t stride_h, const void* norm_weight, const void* weight,
                  int64_t stride_w, const void* draft, bool draft_i64, float* pval, int* pidx,
                  int64_t* target, bool* accepted, int R, int D, int V, float eps,
                  float norm_offset, int dtype, void* stream_ptr) {
  if (R <= 0) return cudaSuccess;
  if (D <= 0 || V <= 0 || D * (int)sizeof(float) > kMaxSmem) return cudaErrorInvalidValue;
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const int NB = verify_greedy_num_blocks(V);
  int np = 0;
  int err;
  switch (dtype) {
    case kBF16: err = dispatch_rows<__nv_bfloat16>(hidden, stride_h, norm_weight, weight, stride_w, pval, pidx, R, D, V, NB, eps, norm_offset, stream, &np); break;
    case kF16: err = dispatch_rows<__half>(hidden, stride_h, norm_weight, weight, stride_w, pval, pidx, R, D, V, NB, eps, norm_offset, stream, &np); break;
    case kF32: err = dispatch_rows<float>(hidden, stride_h, norm_weight, weight, stride_w, pval, pidx, R, D, V, NB, eps, norm_offset, stream, &np); break;
    default: return cudaErrorInvalidValue;
  }
  if (err != cudaSuccess) return err;
  SPD_LAUNCH(greedy_reduce, R, 256, 0, stream)(pval, pidx, NB, np, draft, draft_i64, target,
                                               accepted);
  return cudaGetLastError();
}

}  // namespace spd
