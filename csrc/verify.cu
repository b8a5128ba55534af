// Greedy verification: fused final RMSNorm + LM-head GEMV + argmax + compare with the draft.
//
// Pass 1 (greedy_partial): block (x, y) takes kBlockV vocabulary rows and up to MAXR hidden rows.
// It normalises its hidden rows into shared memory (rounded to the model dtype twice, exactly as
// the reference `norm_weight * (h * rstd).to(dtype)` does), then each warp streams kRowsPerWarp
// rows of the LM head with 16-byte loads, reduces the dot products over the warp, rounds the
// logit to the model dtype (the reference's logits are in that dtype) and keeps the running
// maximum with the lowest index. The block's maxima go to pval/pidx; logits never reach memory.
// Pass 2 (greedy_reduce): one block per hidden row reduces the per-block maxima and compares.
#include <cfloat>
#include <climits>

#include "common.cuh"

namespace spd {
namespace {

constexpr int kWarps = 8;
constexpr int kRowsPerWarp = 8;
constexpr int kBlockV = kWarps * kRowsPerWarp;
constexpr int kMaxSmem = 96 * 1024;

template <typename T, int MAXR>
__global__ void __launch_bounds__(kWarps * 32)
greedy_partial(const T* __restrict__ h, int64_t stride_h, const T* __restrict__ g,
               const T* __restrict__ w, int64_t stride_w, float* __restrict__ pval,
               int* __restrict__ pidx, int R, int D, int V, int NB, float eps, bool vec) {
  extern __shared__ float s_h[];  // [MAXR][D]
  __shared__ float s_rstd[MAXR];
  __shared__ float s_best[kWarps][MAXR];
  __shared__ int s_idx[kWarps][MAXR];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int r0 = blockIdx.y * MAXR;
  const int nr = min(MAXR, R - r0);

  for (int r = warp; r < nr; r += kWarps) {
    const T* x = h + (int64_t)(r0 + r) * stride_h;
    float ss = 0.f;
    for (int k = lane; k < D; k += 32) {
      float v = to_f(x[k]);
      ss += v * v;
    }
    ss = warp_sum(ss);
    if (lane == 0) s_rstd[r] = rsqrtf(ss / (float)D + eps);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < nr * D; i += blockDim.x) {
    const int r = i / D, k = i - r * D;
    const float v = round_to<T>(to_f(h[(int64_t)(r0 + r) * stride_h + k]) * s_rstd[r]);
    s_h[r * D + k] = round_to<T>(to_f(g[k]) * v);
  }
  __syncthreads();

  float best[MAXR];
  int bidx[MAXR];
#pragma unroll
  for (int r = 0; r < MAXR; ++r) {
    best[r] = -FLT_MAX;
    bidx[r] = INT_MAX;
  }
  const int v0 = blockIdx.x * kBlockV + warp * kRowsPerWarp;
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int v = v0 + i;
    if (v >= V) break;
    const T* wr = w + (int64_t)v * stride_w;
    float acc[MAXR];
#pragma unroll
    for (int r = 0; r < MAXR; ++r) acc[r] = 0.f;
    if (vec) {
      for (int k = lane * 8; k < D; k += 256) {
        float wv[8];
        load8<T>(wr + k, wv);
#pragma unroll
        for (int r = 0; r < MAXR; ++r) {
          if (r < nr) {
            const float4* hp = reinterpret_cast<const float4*>(s_h + r * D + k);
            const float4 a = hp[0], b = hp[1];
            acc[r] += wv[0] * a.x + wv[1] * a.y + wv[2] * a.z + wv[3] * a.w +
                      wv[4] * b.x + wv[5] * b.y + wv[6] * b.z + wv[7] * b.w;
          }
        }
      }
    } else {
      for (int k = lane; k < D; k += 32) {
        const float wv = to_f(wr[k]);
#pragma unroll
        for (int r = 0; r < MAXR; ++r)
          if (r < nr) acc[r] += wv * s_h[r * D + k];
      }
    }
#pragma unroll
    for (int r = 0; r < MAXR; ++r) {
      const float s = round_to<T>(warp_sum(acc[r]));
      if (s > best[r]) {  // v increases within the warp: strict > keeps the lowest index
        best[r] = s;
        bidx[r] = v;
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
    float b = -FLT_MAX;
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

__global__ void __launch_bounds__(256)
greedy_reduce(const float* __restrict__ pval, const int* __restrict__ pidx, int NB,
              const void* draft, bool draft_i64, int64_t* target, bool* accepted) {
  __shared__ float s_v[8];
  __shared__ int s_i[8];
  const int r = blockIdx.x;
  float b = -FLT_MAX;
  int bi = INT_MAX;
  for (int i = threadIdx.x; i < NB; i += blockDim.x) {
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

template <typename T, int MAXR>
int launch_partial(const void* hidden, int64_t stride_h, const void* norm_weight,
                   const void* weight, int64_t stride_w, float* pval, int* pidx, int R, int D,
                   int V, int NB, float eps, cudaStream_t stream) {
  const size_t smem = (size_t)MAXR * D * sizeof(float);
  static bool attr_set = false;  // one opt-in per instantiation (> 48 KiB dynamic smem)
  if (!attr_set) {
    cudaError_t e = cudaFuncSetAttribute(greedy_partial<T, MAXR>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, kMaxSmem);
    if (e != cudaSuccess) return e;
    attr_set = true;
  }
  const bool vec = (D % 8 == 0) && (stride_w % 8 == 0) && vec_aligned(weight);
  dim3 grid(NB, (R + MAXR - 1) / MAXR);
  greedy_partial<T, MAXR><<<grid, kWarps * 32, smem, stream>>>(
      static_cast<const T*>(hidden), stride_h, static_cast<const T*>(norm_weight),
      static_cast<const T*>(weight), stride_w, pval, pidx, R, D, V, NB, eps, vec);
  return cudaGetLastError();
}

template <typename T>
int dispatch_rows(const void* hidden, int64_t stride_h, const void* norm_weight,
                  const void* weight, int64_t stride_w, float* pval, int* pidx, int R, int D,
                  int V, int NB, float eps, cudaStream_t stream) {
  const int fit = kMaxSmem / (D * (int)sizeof(float));  // hidden rows whose normed copy fits
  int maxr = 1;
  while (maxr < 8 && maxr < R && maxr * 2 <= fit) maxr *= 2;
  switch (maxr) {
    case 8: return launch_partial<T, 8>(hidden, stride_h, norm_weight, weight, stride_w, pval, pidx, R, D, V, NB, eps, stream);
    case 4: return launch_partial<T, 4>(hidden, stride_h, norm_weight, weight, stride_w, pval, pidx, R, D, V, NB, eps, stream);
    case 2: return launch_partial<T, 2>(hidden, stride_h, norm_weight, weight, stride_w, pval, pidx, R, D, V, NB, eps, stream);
    default: return launch_partial<T, 1>(hidden, stride_h, norm_weight, weight, stride_w, pval, pidx, R, D, V, NB, eps, stream);
  }
}

}  // namespace

int verify_greedy_num_blocks(int V) { return (V + kBlockV - 1) / kBlockV; }

int verify_greedy(const void* hidden, int64_t stride_h, const void* norm_weight, const void* weight,
                  int64_t stride_w, const void* draft, bool draft_i64, float* pval, int* pidx,
                  int64_t* target, bool* accepted, int R, int D, int V, float eps, int dtype,
                  void* stream_ptr) {
  if (R <= 0) return cudaSuccess;
  if (D <= 0 || V <= 0 || D * (int)sizeof(float) > kMaxSmem) return cudaErrorInvalidValue;
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const int NB = verify_greedy_num_blocks(V);
  int err;
  switch (dtype) {
    case kBF16: err = dispatch_rows<__nv_bfloat16>(hidden, stride_h, norm_weight, weight, stride_w, pval, pidx, R, D, V, NB, eps, stream); break;
    case kF16: err = dispatch_rows<__half>(hidden, stride_h, norm_weight, weight, stride_w, pval, pidx, R, D, V, NB, eps, stream); break;
    case kF32: err = dispatch_rows<float>(hidden, stride_h, norm_weight, weight, stride_w, pval, pidx, R, D, V, NB, eps, stream); break;
    default: return cudaErrorInvalidValue;
  }
  if (err != cudaSuccess) return err;
  greedy_reduce<<<R, 256, 0, stream>>>(pval, pidx, NB, draft, draft_i64, target, accepted);
  return cudaGetLastError();
}

}  // namespace spd
