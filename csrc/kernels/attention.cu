// Attention of a chunk of R rows against a KV cache that already holds them (cache_attention,
// spd_kernels/pdm.py): the PDM step's attention, 9 rows against thousands of cached keys, where
// the time is reading K and V once and spreading that over the GPU.
//
// Launch 1, attention_split: block (kv head j, key split s, pair block z). Its pairs m =
// row * G + g (the G query heads sharing kv head j, at most 64 pairs) share every key the block
// loads. Per tile of 32 keys:
//   - K and V go to shared memory; the next tile's loads are issued before this tile's math;
//   - scores on tensor cores: pairs are the MMA's rows, keys its columns, and the 16-byte pieces
//     of q and K are the fragments as loaded (the k-permutation of mma_stream.cuh);
//   - online softmax in base 2, a warp per pair and a lane per key, fp32 statistics;
//   - P V in fp32 FMAs, so the weights are not rounded to 16 bits (as in the reference).
// Row r sees keys 0 .. start + r (start read on the device). With one split the block
// normalises and rounds once. With several it writes its unnormalised sums and (max, sum) to
// ws, and launch 2, attention_combine, merges the splits holding each pair's keys in split order
// (deterministic). Splits past a block's last position exit at once, so one plan, and one CUDA
// graph, serves every position.
#include <cmath>

#include "mma_stream.cuh"

namespace spd {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kTile = 32;       // keys per tile: a lane each in the softmax
constexpr int kMaxPairs = 64;   // (row, query head) pairs per block: 4 MMA row tiles
constexpr int kPad = 32;        // elements added to each q / K row in shared memory: rows then sit
                                // 16 banks apart, so a quarter warp's 16-byte reads (rows g and
                                // g + 1, 4 pieces each) hit 32 different banks

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

template <typename T, int HD>
struct Tiles {
  static constexpr int kRow = HD + kPad;  // q and K row stride (elements)
  static constexpr int kLoads = 2 * kTile * HD / 8 / kThreads;  // K and V 16-byte pieces a thread
  uint4 q[kMaxPairs * kRow * sizeof(T) / 16];
  uint4 k[kTile * kRow * sizeof(T) / 16];
  uint4 v[kTile * HD * sizeof(T) / 16];
  float p[kMaxPairs][kTile + 1];          // scores, then softmax weights; +1: no bank conflicts
  float m[kMaxPairs], l[kMaxPairs], alpha[kMaxPairs];
};

// The 16-byte pieces of K and V rows t0 .. t0 + kTile - 1 this thread moves (zero past hi).
template <typename T, int HD>
__device__ __forceinline__ void load_tile(const T* kh, const T* vh, int64_t scs, int t0, int hi,
                                          uint4 (&regs)[Tiles<T, HD>::kLoads]) {
  constexpr int kPieces = HD / 8;
#pragma unroll
  for (int u = 0; u < Tiles<T, HD>::kLoads; ++u) {
    const int i = threadIdx.x + u * kThreads;
    const int which = i / (kTile * kPieces), key = i / kPieces % kTile, c = i % kPieces * 8;
    const int n = t0 + key;
    const T* src = (which == 0 ? kh : vh) + (int64_t)min(n, hi - 1) * scs + c;
    regs[u] = load_w16(src, n < hi);  // read once: kept out of L1
  }
}

template <typename T, int HD>
__device__ __forceinline__ void store_tile(Tiles<T, HD>& sh,
                                           const uint4 (&regs)[Tiles<T, HD>::kLoads]) {
  constexpr int kPieces = HD / 8;
  T* ks = reinterpret_cast<T*>(sh.k);
  T* vs = reinterpret_cast<T*>(sh.v);
#pragma unroll
  for (int u = 0; u < Tiles<T, HD>::kLoads; ++u) {
    const int i = threadIdx.x + u * kThreads;
    const int which = i / (kTile * kPieces), key = i / kPieces % kTile, c = i % kPieces * 8;
    T* dst = which == 0 ? ks + key * Tiles<T, HD>::kRow + c : vs + key * HD + c;
    *reinterpret_cast<uint4*>(dst) = regs[u];
  }
}

// Pairs [p_lo, p_lo + P) of kv head j over keys [lo, hi) of split blockIdx.y.
template <typename T, int HD>
__global__ void __launch_bounds__(kThreads)
attention_split(const T* __restrict__ q, int64_t sqh, int64_t sqr, const T* __restrict__ k,
                const T* __restrict__ v, int64_t sch, int64_t scs,
                const int64_t* __restrict__ start_ptr, T* __restrict__ out, int64_t sor,
                float* __restrict__ ws, int R, int S, int G, int chunk, int per_block,
                float scale_log2) {
  __shared__ Tiles<T, HD> sh;
  pdl_enter();
  constexpr int kRow = Tiles<T, HD>::kRow;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int j = blockIdx.x, split = blockIdx.y;
  const int RG = R * G;
  const int p_lo = blockIdx.z * per_block;
  const int P = min(per_block, RG - p_lo);
  if (P <= 0) return;
  const int64_t start = *start_ptr;
  // One past the last key any of the block's pairs sees.
  const int64_t end = min((int64_t)S, start + (p_lo + P - 1) / G + 1);
  const int lo = split * chunk;
  if (lo >= end) return;  // the whole block: nothing of this split is visible yet
  const int hi = (int)min(end, (int64_t)lo + chunk);

  // The q rows of the block's pairs and the first K / V tile: every load issued before the
  // first store (a fixed count a thread, so none waits for another). Rows P .. 16 * row tiles
  // are zero (their scores are unused).
  const int tiles_m = (P + 15) / 16;
  constexpr int kQLoads = kMaxPairs * HD / 8 / kThreads;
  uint4 qreg[kQLoads];
#pragma unroll
  for (int u = 0; u < kQLoads; ++u) {
    const int i = threadIdx.x + u * kThreads, p = i / (HD / 8), c = i % (HD / 8) * 8;
    const int m = p_lo + min(p, P - 1);  // rows past P: a real row's address, never loaded
    const T* src = q + (int64_t)(j * G + m % G) * sqh + (int64_t)(m / G) * sqr + c;
    qreg[u] = load_x16(src, p < P);
  }
  const T* kh = k + (int64_t)j * sch;
  const T* vh = v + (int64_t)j * sch;
  uint4 regs[Tiles<T, HD>::kLoads];
  load_tile<T, HD>(kh, vh, scs, lo, hi, regs);
  T* qs = reinterpret_cast<T*>(sh.q);
#pragma unroll
  for (int u = 0; u < kQLoads; ++u) {
    const int i = threadIdx.x + u * kThreads, p = i / (HD / 8), c = i % (HD / 8) * 8;
    if (p < tiles_m * 16) *reinterpret_cast<uint4*>(qs + p * kRow + c) = qreg[u];
  }
  for (int p = threadIdx.x; p < kMaxPairs; p += kThreads) {
    sh.m[p] = -INFINITY;
    sh.l[p] = 0.f;
  }

  // P V: thread (pair group pg, dims dg * 8 ..) holds pairs pg + kGroups * i.
  constexpr int kDimGroups = HD / 8;
  constexpr int kGroups = kThreads / kDimGroups;
  constexpr int kPerThread = kMaxPairs / kGroups;
  const int dg = threadIdx.x % kDimGroups, pg = threadIdx.x / kDimGroups;
  float acc[kPerThread][8];
#pragma unroll
  for (int i = 0; i < kPerThread; ++i)
#pragma unroll
    for (int d = 0; d < 8; ++d) acc[i][d] = 0.f;

  const int g = lane >> 2, qq = lane & 3;
  for (int t0 = lo; t0 < hi; t0 += kTile) {
    __syncthreads();  // the last tile's readers are done (and q is written, the first time)
    store_tile<T, HD>(sh, regs);
    __syncthreads();
    if (t0 + kTile < hi) load_tile<T, HD>(kh, vh, scs, t0 + kTile, hi, regs);

    // Scores: warp item c = (row tile, 8-key column tile), two MMA steps per 32 dims.
    const T* ks = reinterpret_cast<const T*>(sh.k);
    for (int c = warp; c < tiles_m * (kTile / 8); c += kWarps) {
      const int mt = c / (kTile / 8), nt = c % (kTile / 8);
      const T* qa = qs + (mt * 16 + g) * kRow + 8 * qq;
      const T* qb = qa + 8 * kRow;
      const T* kr = ks + (nt * 8 + g) * kRow + 8 * qq;
      float s[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int d0 = 0; d0 < HD; d0 += kMmaChunk) {
        const uint4 xa = *reinterpret_cast<const uint4*>(qa + d0);
        const uint4 xb = *reinterpret_cast<const uint4*>(qb + d0);
        const uint4 w = *reinterpret_cast<const uint4*>(kr + d0);
        const uint32_t a0[4] = {xa.x, xb.x, xa.y, xb.y}, a1[4] = {xa.z, xb.z, xa.w, xb.w};
        const uint32_t b0[2] = {w.x, w.y}, b1[2] = {w.z, w.w};
        mma_16816<T>(s, a0, b0);
        mma_16816<T>(s, a1, b1);
      }
      // s[i]: pair mt * 16 + g + 8 * (i >= 2), key nt * 8 + 2 qq + (i & 1)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int p = mt * 16 + g + (i >= 2 ? 8 : 0), col = nt * 8 + 2 * qq + (i & 1);
        const int64_t n = t0 + col, pos = start + (p_lo + p) / G;
        sh.p[p][col] = (n < hi && n <= pos) ? s[i] * scale_log2 : -INFINITY;
      }
    }
    __syncthreads();

    // Online softmax: warp per pair, lane per key.
    for (int p = warp; p < P; p += kWarps) {
      const float x = sh.p[p][lane], m_old = sh.m[p];
      const float m_new = fmaxf(m_old, warp_max(x));
      const float m_use = m_new == -INFINITY ? 0.f : m_new;  // no key yet: no NaN
      const float e = exp2f(x - m_use);
      const float sum = warp_sum(e);
      sh.p[p][lane] = e;
      if (lane == 0) {
        const float a = exp2f(m_old - m_use);
        sh.alpha[p] = a;
        sh.l[p] = sh.l[p] * a + sum;
        sh.m[p] = m_new;
      }
    }
    __syncthreads();

    const T* vs = reinterpret_cast<const T*>(sh.v) + dg * 8;
    const int keys = min(kTile, hi - t0);
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      const int p = pg + kGroups * i;
      const float a = p < P ? sh.alpha[p] : 0.f;
#pragma unroll
      for (int d = 0; d < 8; ++d) acc[i][d] *= a;
    }
    for (int key = 0; key < keys; ++key) {
      float vv[8];
      unpack8<T>(*reinterpret_cast<const uint4*>(vs + key * HD), vv);
#pragma unroll
      for (int i = 0; i < kPerThread; ++i) {
        const int p = pg + kGroups * i;
        if (p >= P) continue;
        const float e = sh.p[p][key];
#pragma unroll
        for (int d = 0; d < 8; ++d) acc[i][d] = fmaf(e, vv[d], acc[i][d]);
      }
    }
  }

  const bool partial = gridDim.y > 1;
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int p = pg + kGroups * i;
    if (p >= P) continue;
    const int m = p_lo + p;
    if (partial) {
      float* slot = ws + (((int64_t)j * gridDim.y + split) * RG + m) * (HD + 2);
#pragma unroll
      for (int d = 0; d < 8; ++d) slot[dg * 8 + d] = acc[i][d];
      if (dg == 0) {
        slot[HD] = sh.m[p];
        slot[HD + 1] = sh.l[p];
      }
    } else {
      const float l = sh.l[p];
      const float inv = 1.f / (l > 0.f ? l : 1.f);
      T* o = out + (int64_t)(m / G) * sor + (int64_t)(j * G + m % G) * HD + dg * 8;
#pragma unroll
      for (int d = 0; d < 8; ++d) o[d] = Num<T>::from_f(acc[i][d] * inv);
    }
  }
}

// Block (pair m, kv head j), a thread per dim: the splits holding the pair's keys (those below
// its position + 1), rescaled to the largest max and summed in split order; one rounding.
template <typename T>
__global__ void __launch_bounds__(256)
attention_combine(const float* __restrict__ ws, const int64_t* __restrict__ start_ptr,
                  T* __restrict__ out, int64_t sor, int R, int S, int G, int HD, int splits,
                  int chunk) {
  pdl_enter();
  const int m = blockIdx.x, j = blockIdx.y, d = threadIdx.x;
  const int RG = R * G, r = m / G;
  const int64_t seen = min((int64_t)S, *start_ptr + r + 1);
  const int used = seen > 0 ? (int)((seen + chunk - 1) / chunk) : 0;
  const float* base = ws + ((int64_t)j * splits * RG + m) * (HD + 2);
  const int64_t step = (int64_t)RG * (HD + 2);  // from one split's slot to the next's
  float top = -INFINITY;
  for (int s = 0; s < used; ++s) top = fmaxf(top, base[s * step + HD]);
  float a = 0.f, l = 0.f;
  for (int s = 0; s < used; ++s) {
    const float* slot = base + s * step;
    const float w = slot[HD] == -INFINITY ? 0.f : exp2f(slot[HD] - top);
    l += slot[HD + 1] * w;
    a += slot[d] * w;
  }
  out[(int64_t)r * sor + (int64_t)(j * G + m % G) * HD + d] =
      Num<T>::from_f(a / (l > 0.f ? l : 1.f));
}

template <typename T, int HD>
int launch(const void* q, int64_t sqh, int64_t sqr, const void* k, const void* v, int64_t sch,
           int64_t scs, const int64_t* start, void* out, int64_t sor, float* ws, int KVH, int R,
           int S, int G, int splits, int chunk, float scale_log2, cudaStream_t stream) {
  const int RG = R * G;
  const int blocks_z = (RG + kMaxPairs - 1) / kMaxPairs;
  const int per_block = (RG + blocks_z - 1) / blocks_z;  // balanced: 36 pairs, not 64 + 0
  auto kernel = attention_split<T, HD>;
  SPD_LAUNCH(kernel, dim3(KVH, splits, blocks_z), kThreads, 0, stream)(
      static_cast<const T*>(q), sqh, sqr, static_cast<const T*>(k), static_cast<const T*>(v), sch,
      scs, start, static_cast<T*>(out), sor, ws, R, S, G, chunk, per_block, scale_log2);
  if (splits > 1) {
    auto combine = attention_combine<T>;
    SPD_LAUNCH(combine, dim3(RG, KVH), HD, 0, stream)(ws, start, static_cast<T*>(out), sor, R, S,
                                                      G, HD, splits, chunk);
  }
  return cudaGetLastError();
}

template <typename T>
int launch_hd(int HD, const void* q, int64_t sqh, int64_t sqr, const void* k, const void* v,
              int64_t sch, int64_t scs, const int64_t* start, void* out, int64_t sor, float* ws,
              int KVH, int R, int S, int G, int splits, int chunk, float scale_log2,
              cudaStream_t stream) {
  if (HD == 64)
    return launch<T, 64>(q, sqh, sqr, k, v, sch, scs, start, out, sor, ws, KVH, R, S, G, splits,
                         chunk, scale_log2, stream);
  return launch<T, 128>(q, sqh, sqr, k, v, sch, scs, start, out, sor, ws, KVH, R, S, G, splits,
                        chunk, scale_log2, stream);
}

}  // namespace

int cache_attention(const void* q, int64_t stride_qh, int64_t stride_qr, const void* k,
                    const void* v, int64_t stride_ch, int64_t stride_cs, const int64_t* start,
                    void* out, int64_t stride_or, float* ws, int H, int R, int KVH, int S, int HD,
                    int splits, int chunk, float scale_log2, int dtype, void* stream_ptr) {
  if (R <= 0) return cudaSuccess;
  // The Python side checks all of this with messages; here it only keeps a bad call from
  // reading out of bounds.
  if (KVH <= 0 || H <= 0 || H % KVH != 0 || S <= 0 || (HD != 64 && HD != 128) || splits < 1 ||
      chunk <= 0 || chunk % kTile != 0 || (int64_t)(splits - 1) * chunk >= S ||
      (int64_t)splits * chunk < S || (splits > 1 && ws == nullptr) || splits > 65535 ||
      (int64_t)R * (H / KVH) > 0x7fffffff / 64)
    return cudaErrorInvalidValue;
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const int G = H / KVH;
  switch (dtype) {
    case kBF16:
      return launch_hd<__nv_bfloat16>(HD, q, stride_qh, stride_qr, k, v, stride_ch, stride_cs,
                                      start, out, stride_or, ws, KVH, R, S, G, splits, chunk,
                                      scale_log2, stream);
    case kF16:
      return launch_hd<__half>(HD, q, stride_qh, stride_qr, k, v, stride_ch, stride_cs, start,
                               out, stride_or, ws, KVH, R, S, G, splits, chunk, scale_log2,
                               stream);
    default:
      return cudaErrorInvalidValue;  // fp32 caches: the Triton kernel
  }
}

}  // namespace spd
