// Fused anchor concat-projection: rows of mixed aggregation types in one launch.
// Block (class c, tile t): output features t*16 .. t*16+15 of every row of class c, where a row's
// class is its type e, or -1 when it has no usable projection (out of range or no weight: NaN row).
// The block finds its rows on the device (types never go to the host: graph-capturable), then
// streams its tile of W_e once for up to 16 of them at a time, so rows sharing a type do not
// multiply the weight traffic. Each warp owns 2 features and puts 8 independent 16-byte weight
// loads per lane in flight before using them; blocks of the heaviest type go first. The anchors
// (small, cached) are read in place through their strides, so the concat [h_{b_0}; ...; h_{b_e}] is
// never built. W_e and b_e come from a device pointer table. fp32 accumulation, one rounding.
#include <cmath>

#include "common.cuh"

namespace spd {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kPerWarp = 2;                  // output features per warp
constexpr int kTile = kWarps * kPerWarp;     // features per block: 160 tiles for N = 2560
// 256-element k steps whose weights are loaded before the FMAs: 8 16-byte loads per lane per step.
template <typename T>
constexpr int kUnroll = sizeof(T) == 4 ? 2 : 4;
constexpr int kRowGroup = 16;                // rows accumulated together (registers)

// Eight elements in one (bf16/f16) or two (f32) 16-byte registers, unpacked only when used.
template <typename T>
struct Raw8 {
  uint4 v;
  __device__ __forceinline__ void load_stream(const T* p) {
    v = __ldcs(reinterpret_cast<const uint4*>(p));  // read once: do not keep it in L1
  }
  __device__ __forceinline__ void zero() { v = make_uint4(0, 0, 0, 0); }
  __device__ __forceinline__ void unpack(float* f) const { unpack8<T>(v, f); }
};

template <>
struct Raw8<float> {
  float4 a, b;
  __device__ __forceinline__ void load_stream(const float* p) {
    a = __ldcs(reinterpret_cast<const float4*>(p));
    b = __ldcs(reinterpret_cast<const float4*>(p) + 1);
  }
  __device__ __forceinline__ void zero() { a = b = make_float4(0.f, 0.f, 0.f, 0.f); }
  __device__ __forceinline__ void unpack(float* f) const {
    f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w;
    f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
  }
};

// The type of row r, or -1 when it has no usable projection (out of range or no weight).
__device__ __forceinline__ int row_class(const void* types, bool types_i64,
                                         const int64_t* __restrict__ table, int M, int r) {
  const int64_t e = types_i64 ? static_cast<const int64_t*>(types)[r]
                              : (int64_t) static_cast<const int*>(types)[r];
  return (e >= 0 && e < M && table[e] != 0) ? (int)e : -1;
}

// One k step of a warp: elements k0 + u*256 .. +7 (u < U, all < D) of chunk j for nf features.
// The U * kPerWarp weight loads go out before any use; no bounds guards so the anchor loads of a
// row can be issued together too.
template <typename T, int U>
__device__ __forceinline__ void vec_step(const T* __restrict__ wj, int64_t K, int nf,
                                         const T* __restrict__ aj, int64_t stride_ar,
                                         const int* rows, int nr, int k0,
                                         float (&acc)[kRowGroup][kPerWarp]) {
  Raw8<T> w[U][kPerWarp];
#pragma unroll
  for (int u = 0; u < U; ++u)
#pragma unroll
    for (int f = 0; f < kPerWarp; ++f) {
      if (f < nf) w[u][f].load_stream(wj + f * K + k0 + u * 256);
      else w[u][f].zero();
    }
#pragma unroll
  for (int i = 0; i < kRowGroup; ++i) {
    if (i < nr) {  // nr is warp-uniform
      const T* ar = aj + rows[i] * stride_ar + k0;
      float av[U][8];
#pragma unroll
      for (int u = 0; u < U; ++u) load8<T>(ar + u * 256, av[u]);
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int f = 0; f < kPerWarp; ++f) {
          float wv[8];
          w[u][f].unpack(wv);
#pragma unroll
          for (int t = 0; t < 8; ++t) acc[i][f] = fmaf(wv[t], av[u][t], acc[i][f]);
        }
    }
  }
}

// One warp: features n0 .. n0+nf-1 (nf <= kPerWarp) of the nr <= kRowGroup rows listed in rows,
// all of type e. fp32 accumulation, bias added, rounded once.
template <typename T, bool kVec>
__device__ __forceinline__ void project_rows(const T* __restrict__ a, int64_t stride_am,
                                             int64_t stride_ar, const int* rows, int nr,
                                             const T* __restrict__ W, const T* __restrict__ B,
                                             int e, int D, int n0, int nf, T* __restrict__ out,
                                             int64_t stride_or, int lane) {
  constexpr int U = kUnroll<T>;
  const int64_t K = (int64_t)(e + 1) * D;  // row length of W_e
  const T* w0 = W + (int64_t)n0 * K;
  float acc[kRowGroup][kPerWarp];
#pragma unroll
  for (int i = 0; i < kRowGroup; ++i)
#pragma unroll
    for (int f = 0; f < kPerWarp; ++f) acc[i][f] = 0.f;

  for (int j = 0; j <= e; ++j) {
    const T* wj = w0 + (int64_t)j * D;
    const T* aj = a + j * stride_am;
    if constexpr (kVec) {  // D % 8 == 0: a lane's k0 and D differ by a multiple of 8
      int k0 = lane * 8;
      for (; k0 + 256 * (U - 1) < D; k0 += 256 * U)
        vec_step<T, U>(wj, K, nf, aj, stride_ar, rows, nr, k0, acc);
      if (U > 2 && k0 + 256 < D) {  // tail: a half step, then single steps
        vec_step<T, (U > 2 ? 2 : 1)>(wj, K, nf, aj, stride_ar, rows, nr, k0, acc);
        k0 += 512;
      }
      for (; k0 < D; k0 += 256) vec_step<T, 1>(wj, K, nf, aj, stride_ar, rows, nr, k0, acc);
    } else {  // unaligned: scalar loads
      for (int k = lane; k < D; k += 32) {
        float wv[kPerWarp];
#pragma unroll
        for (int f = 0; f < kPerWarp; ++f) wv[f] = f < nf ? to_f(wj[f * K + k]) : 0.f;
#pragma unroll
        for (int i = 0; i < kRowGroup; ++i) {
          if (i < nr) {
            const float av = to_f(aj[rows[i] * stride_ar + k]);
#pragma unroll
            for (int f = 0; f < kPerWarp; ++f) acc[i][f] = fmaf(wv[f], av, acc[i][f]);
          }
        }
      }
    }
  }

#pragma unroll
  for (int i = 0; i < kRowGroup; ++i) {
    if (i < nr) {
      T* o = out + rows[i] * stride_or + n0;
#pragma unroll
      for (int f = 0; f < kPerWarp; ++f) {
        float v = warp_sum(acc[i][f]);  // whole warp: nr is uniform
        if (lane == 0 && f < nf) {
          if (B != nullptr) v += to_f(B[n0 + f]);
          o[f] = Num<T>::from_f(v);
        }
      }
    }
  }
}

template <typename T, bool kVec>
__global__ void __launch_bounds__(kThreads, 2)  // <= 128 registers: 16 warps per SM
anchor_kernel(const T* __restrict__ a, int64_t stride_am, int64_t stride_ar, const void* types,
              bool types_i64, const int64_t* __restrict__ table, T* __restrict__ out,
              int64_t stride_or, int M, int R, int D, int N, int tiles) {
  __shared__ int s_rows[kThreads];      // rows of this block's class found in one pass
  __shared__ int s_warp_count[kWarps];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int q = blockIdx.x / tiles;
  const int tile = blockIdx.x - q * tiles;
  // Blocks start roughly in index order: the heaviest type (longest W rows) first, so the tail of
  // the launch is the cheap blocks. Class -1 (q == M): rows with no usable projection.
  const int cls = M - 1 - q;
  const int n_tile = tile * kTile;
  const int n0 = n_tile + warp * kPerWarp;
  const int nf = min(kPerWarp, N - n0);  // <= 0: this warp has no features (still syncs)
  const T* W = nullptr;
  const T* B = nullptr;
  if (cls >= 0) {
    if (table[cls] == 0) return;  // uniform: no row has this class (they are class -1)
    W = reinterpret_cast<const T*>(table[cls]);
    B = reinterpret_cast<const T*>(table[M + cls]);
  }

  for (int base = 0; base < R; base += kThreads) {
    // Compact the rows of class cls among rows base .. base+kThreads-1 into s_rows.
    const int r = base + threadIdx.x;
    const bool match = r < R && row_class(types, types_i64, table, M, r) == cls;
    const unsigned bal = __ballot_sync(0xffffffffu, match);
    if (lane == 0) s_warp_count[warp] = __popc(bal);
    __syncthreads();
    int count = 0, offset = 0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const int c = s_warp_count[w];
      offset += w < warp ? c : 0;
      count += c;
    }
    if (match) s_rows[offset + __popc(bal & ((1u << lane) - 1u))] = r;
    __syncthreads();

    if (cls < 0) {  // NaN rows, nothing read through the table
      for (int p = threadIdx.x; p < count * kTile; p += kThreads) {
        const int n = n_tile + p % kTile;
        if (n < N) out[s_rows[p / kTile] * stride_or + n] = Num<T>::from_f(nanf(""));
      }
    } else if (nf > 0) {
      for (int g = 0; g < count; g += kRowGroup)
        project_rows<T, kVec>(a, stride_am, stride_ar, s_rows + g, min(kRowGroup, count - g), W,
                              B, cls, D, n0, nf, out, stride_or, lane);
    }
    __syncthreads();  // s_rows and s_warp_count are rewritten by the next pass
  }
}

template <typename T>
void launch(dim3 grid, cudaStream_t stream, const void* anchors, int64_t stride_am,
            int64_t stride_ar, const void* types, bool types_i64, const int64_t* table, void* out,
            int64_t stride_or, int M, int R, int D, int N, int tiles, bool vec) {
  const T* a = static_cast<const T*>(anchors);
  T* o = static_cast<T*>(out);
  auto kernel = vec ? anchor_kernel<T, true> : anchor_kernel<T, false>;
  SPD_LAUNCH(kernel, grid, kThreads, 0, stream)(a, stride_am, stride_ar, types, types_i64, table,
                                                o, stride_or, M, R, D, N, tiles);
}

}  // namespace

int anchor_projection(const void* anchors, int64_t stride_am, int64_t stride_ar, const void* types,
                      bool types_i64, const int64_t* table, void* out, int64_t stride_or, int M,
                      int R, int D, int N, int dtype, bool vec, void* stream_ptr) {
  if (R <= 0 || N <= 0) return cudaSuccess;
  if (M <= 0) return cudaErrorInvalidValue;
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const int64_t tiles = (N + kTile - 1) / kTile;
  const int64_t blocks = tiles * (M + 1);  // one per (tile, type) plus the NaN class
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
  const dim3 grid((unsigned)blocks);
  switch (dtype) {
    case kBF16: launch<__nv_bfloat16>(grid, stream, anchors, stride_am, stride_ar, types, types_i64, table, out, stride_or, M, R, D, N, (int)tiles, vec); break;
    case kF16: launch<__half>(grid, stream, anchors, stride_am, stride_ar, types, types_i64, table, out, stride_or, M, R, D, N, (int)tiles, vec); break;
    case kF32: launch<float>(grid, stream, anchors, stride_am, stride_ar, types, types_i64, table, out, stride_or, M, R, D, N, (int)tiles, vec); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace spd
