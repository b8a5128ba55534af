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

#include "mma_stream.cuh"

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

// Compacts the rows of class cls among rows base .. base + blockDim.x - 1 into s_rows (in row
// order) and returns how many there are; every thread of the block (W warps) calls it.
template <int W>
__device__ __forceinline__ int collect_rows(const void* types, bool types_i64,
                                            const int64_t* __restrict__ table, int M, int R,
                                            int cls, int base, int* s_rows, int* s_warp_count) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int r = base + threadIdx.x;
  const bool match = r < R && row_class(types, types_i64, table, M, r) == cls;
  const unsigned bal = __ballot_sync(0xffffffffu, match);
  if (lane == 0) s_warp_count[warp] = __popc(bal);
  __syncthreads();
  int count = 0, offset = 0;
#pragma unroll
  for (int w = 0; w < W; ++w) {
    const int c = s_warp_count[w];
    offset += w < warp ? c : 0;
    count += c;
  }
  if (match) s_rows[offset + __popc(bal & ((1u << lane) - 1u))] = r;
  __syncthreads();
  return count;
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
  pdl_enter();
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
    const int count = collect_rows<kWarps>(types, types_i64, table, M, R, cls, base, s_rows,
                                           s_warp_count);

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

// --- tensor-core variant (bf16 / f16, 16-byte aligned rows): SPD_ANCHOR_VARIANT=1 ----------------
//
// Block (column tile, work item y). The work items are (type e, K split s) for every e < M, type
// after type, each split k_per columns of W_e's (e + 1) * D: blocks of about equal work whatever
// the type, where a block per (tile, type) made the heaviest type's blocks the tail. A block
// collects its type's rows (on the device) and streams its K range of W_e against up to 16 of them
// at a time through mma_stream.cuh (row g's activations at column k of the concat come from anchor
// k / D in place); warps take 16 columns each. Partial sums go to ws[y][row][column]; then
// anchor_mma_reduce sums each row's splits in order, adds the bias and rounds once (NaN for rows
// without a usable projection).
constexpr int kMmaWarps = 4;
constexpr int kMmaThreads = kMmaWarps * 32;
constexpr int kMmaNV = 2;                          // 8-column tiles per warp
constexpr int kMmaTile = kMmaWarps * 8 * kMmaNV;   // columns per block

// K splits of type e ((e + 1) * D columns of W_e, k_per a split): its work items.
__host__ __device__ __forceinline__ int type_splits(int e, int D, int k_per) {
  return (int)(((int64_t)(e + 1) * D + k_per - 1) / k_per);
}

// Work items before type e (splits of every type below it).
__device__ __forceinline__ int items_before(int e, int D, int k_per) {
  int y = 0;
  for (int i = 0; i < e; ++i) y += type_splits(i, D, k_per);
  return y;
}

template <typename T, bool TWO>
__device__ __forceinline__ void anchor_mma_group(const T* __restrict__ a, int64_t stride_am,
                                                 int64_t stride_ar, const int* rows, int nr,
                                                 const T* __restrict__ W, int64_t K, int D,
                                                 int N, int n0, int k_lo, int k_hi,
                                                 float* __restrict__ ws_y) {
  const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
  const T* wrow[1][kMmaNV];
#pragma unroll
  for (int v = 0; v < kMmaNV; ++v)  // columns past N re-read column N - 1; their sums are dropped
    wrow[0][v] = W + (int64_t)min(n0 + 8 * v + g, N - 1) * K;
  const T* ra = a + (int64_t)rows[min(g, nr - 1)] * stride_ar;
  const T* rb = a + (int64_t)rows[min(g + 8, nr - 1)] * stride_ar;
  auto at = [stride_am, D](const T* row) {
    return [row, stride_am, D](int k) {
      const int j = k / D;
      return row + j * stride_am + (k - j * D);
    };
  };
  float acc[1][kMmaNV][4] = {};
  mma_stream<T, 1, kMmaNV, TWO>(wrow, at(ra), at(rb), g < nr, g + 8 < nr, k_lo, k_hi, q, acc);
#pragma unroll
  for (int v = 0; v < kMmaNV; ++v)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int slot = g + (i >= 2 ? 8 : 0), n = n0 + 8 * v + 2 * q + (i & 1);
      if (slot < nr && n < N) ws_y[(int64_t)rows[slot] * N + n] = acc[0][v][i];
    }
}

template <typename T>
__global__ void __launch_bounds__(kMmaThreads, 4)  // <= 128 registers (mma_stream.cuh)
anchor_mma(const T* __restrict__ a, int64_t stride_am, int64_t stride_ar, const void* types,
           bool types_i64, const int64_t* __restrict__ table, float* __restrict__ ws, int M,
           int R, int D, int N, int k_per) {
  __shared__ int s_rows[kMmaThreads];
  __shared__ int s_warp_count[kMmaWarps];
  pdl_enter();
  int e = 0, split = blockIdx.y;  // this block's work item: split `split` of type e
  for (; e < M; ++e) {
    const int splits = type_splits(e, D, k_per);
    if (split < splits) break;
    split -= splits;
  }
  if (e >= M || table[e] == 0) return;  // uniform: no weight, its rows are NaN rows
  const T* W = reinterpret_cast<const T*>(table[e]);
  const int64_t K = (int64_t)(e + 1) * D;
  const int k_lo = split * k_per, k_hi = (int)min((int64_t)k_lo + k_per, K);
  const int n0 = (blockIdx.x * kMmaWarps + (threadIdx.x >> 5)) * 8 * kMmaNV;
  float* ws_y = ws + (int64_t)blockIdx.y * R * N;
  for (int base = 0; base < R; base += kMmaThreads) {
    const int count = collect_rows<kMmaWarps>(types, types_i64, table, M, R, e, base, s_rows,
                                               s_warp_count);
    if (n0 < N) {  // warp-uniform; the whole warp runs each mma
      for (int g0 = 0; g0 < count; g0 += kMmaRows) {
        const int nr = min(kMmaRows, count - g0);
        if (nr > 8)
          anchor_mma_group<T, true>(a, stride_am, stride_ar, s_rows + g0, nr, W, K, D, N, n0,
                                    k_lo, k_hi, ws_y);
        else
          anchor_mma_group<T, false>(a, stride_am, stride_ar, s_rows + g0, nr, W, K, D, N, n0,
                                     k_lo, k_hi, ws_y);
      }
    }
    __syncthreads();  // s_rows and s_warp_count are rewritten by the next pass
  }
}

// out[r][n] = round(sum of row r's splits in order + bias), NaN for rows of no usable type.
template <typename T>
__global__ void __launch_bounds__(256)
anchor_mma_reduce(const float* __restrict__ ws, const void* types, bool types_i64,
                  const int64_t* __restrict__ table, T* __restrict__ out, int64_t stride_or,
                  int M, int R, int D, int N, int k_per) {
  pdl_enter();
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (int64_t)R * N) return;
  const int r = (int)(i / N), n = (int)(i % N);
  const int e = row_class(types, types_i64, table, M, r);
  float v = nanf("");
  if (e >= 0) {
    const int y0 = items_before(e, D, k_per);
    const int splits = type_splits(e, D, k_per);
    v = 0.f;
    for (int s = 0; s < splits; ++s) v += ws[((int64_t)(y0 + s) * R + r) * N + n];
    const T* B = reinterpret_cast<const T*>(table[M + e]);
    if (B != nullptr) v += to_f(B[n]);
  }
  out[(int64_t)r * stride_or + n] = Num<T>::from_f(v);
}

template <typename T>
int launch_mma(const void* anchors, int64_t stride_am, int64_t stride_ar, const void* types,
               bool types_i64, const int64_t* table, void* out, int64_t stride_or, float* ws,
               int M, int R, int D, int N, int k_per, int items, cudaStream_t stream) {
  const T* a = static_cast<const T*>(anchors);
  const dim3 grid((N + kMmaTile - 1) / kMmaTile, items);
  SPD_LAUNCH(anchor_mma<T>, grid, kMmaThreads, 0, stream)(a, stride_am, stride_ar, types,
                                                          types_i64, table, ws, M, R, D, N, k_per);
  const int64_t n = (int64_t)R * N;
  auto reduce = anchor_mma_reduce<T>;
  SPD_LAUNCH(reduce, (unsigned)((n + 255) / 256), 256, 0, stream)(
      ws, types, types_i64, table, static_cast<T*>(out), stride_or, M, R, D, N, k_per);
  return cudaGetLastError();
}

}  // namespace

int anchor_projection_items(int M, int D, int k_per) {
  int64_t y = 0;
  for (int e = 0; e < M; ++e) y += type_splits(e, D, k_per);
  return y > 65535 ? -1 : (int)y;
}

int anchor_projection_mma(const void* anchors, int64_t stride_am, int64_t stride_ar,
                          const void* types, bool types_i64, const int64_t* table, void* out,
                          int64_t stride_or, float* ws, int M, int R, int D, int N, int k_per,
                          int dtype, void* stream_ptr) {
  if (R <= 0 || N <= 0) return cudaSuccess;
  const int items = M > 0 && k_per > 0 ? anchor_projection_items(M, D, k_per) : -1;
  if (items <= 0 || D <= 0 || D % 8 != 0 || k_per % kMmaChunk != 0 || ws == nullptr ||
      (int64_t)(N + kMmaTile - 1) / kMmaTile > 0x7fffffff)
    return cudaErrorInvalidValue;
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  switch (dtype) {
    case kBF16: return launch_mma<__nv_bfloat16>(anchors, stride_am, stride_ar, types, types_i64, table, out, stride_or, ws, M, R, D, N, k_per, items, stream);
    case kF16: return launch_mma<__half>(anchors, stride_am, stride_ar, types, types_i64, table, out, stride_or, ws, M, R, D, N, k_per, items, stream);
    default: return cudaErrorInvalidValue;  // fp32: the FFMA kernel above
  }
}

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
