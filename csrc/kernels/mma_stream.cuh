// Streaming weight rows against up to 16 rows of activations on tensor cores: the inner loop of
// the dense layers (linear.cu) and of the anchor projection (features.cu).
//
// The activation rows are the 16 rows of mma.m16n8k16's A (rows past the real ones are zero) and
// 8 weight rows are its B. Per 32 columns of K (a chunk) lane (g = lane / 4, q = lane % 4) loads
// 16 contiguous bytes, columns 8q .. 8q + 7, of weight row g of each of its tiles and of
// activation rows g and g + 8, and those registers are the fragments of two mma steps as loaded:
// a dot product does not care in which order k is summed, and both operands map the MMA's logical
// k to the same memory column (logical 2q + j and 2q + 8 + j of step s sit at 8q + 4s + j and
// 8q + 4s + 2 + j). So there is no shuffle, shared memory or conversion, and each weight byte is
// loaded once. Kernels using it need __launch_bounds__(threads, blocks) with a register budget of
// at most 128: with ptxas's default it sank 12 of a batch's 16 loads below the first mma and
// waited for each in turn.
#pragma once

#include "common.cuh"

namespace spd {

constexpr int kMmaChunk = 32;   // k columns per warp step: 4 lanes x 8 elements
constexpr int kMmaUnroll = 4;   // chunks whose loads are all issued before the first mma
constexpr int kMmaRows = 16;    // activation rows per pass: the MMA's M

// 16 bytes of activations through the read-only path, or zeros when !ok.
__device__ __forceinline__ uint4 load_x16(const void* p, bool ok) {
  return ok ? __ldg(reinterpret_cast<const uint4*>(p)) : make_uint4(0, 0, 0, 0);
}

// The same for a weight, which is read once: kept out of L1 (the activations stay there).
__device__ __forceinline__ uint4 load_w16(const void* p, bool ok) {
#ifdef SPD_SIMT_HOST
  return load_x16(p, ok);
#else
  uint4 v;
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %5, 0;\n"
      " mov.b32 %0, 0;\n mov.b32 %1, 0;\n mov.b32 %2, 0;\n mov.b32 %3, 0;\n"
      " @p ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n}\n"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p), "r"((int)ok));
  return v;
#endif
}

// acc[s][v] += X * W[s][v]^T over columns [k_lo, k_hi) for one warp. wrow[s][v]: this lane's
// weight row (row g of tile v of weight s). xa(k) / xb(k): pointers to activation rows g and
// g + 8 at column k (a multiple of 8), read only when a_ok / b_ok (TWO = false: row g + 8 is
// never read). k_lo is a multiple of 32, k_hi of 8 (a lane's 8 columns are all in or all out).
// acc[s][v][i] ends up holding activation row g + 8 * (i >= 2), output column 8 v + 2 q + (i & 1)
// of the tile. Every lane of the warp must call it, with the same bounds.
template <typename T, int S, int NV, bool TWO, typename XA, typename XB>
__device__ __forceinline__ void mma_stream(const T* const (&wrow)[S][NV], XA xa, XB xb, bool a_ok,
                                           bool b_ok, int k_lo, int k_hi, int q,
                                           float (&acc)[S][NV][4]) {
  for (int k0 = k_lo; k0 < k_hi; k0 += kMmaChunk * kMmaUnroll) {
    uint4 wq[kMmaUnroll][S][NV], qa[kMmaUnroll], qb[kMmaUnroll];
#pragma unroll
    for (int u = 0; u < kMmaUnroll; ++u) {
      const int k = k0 + u * kMmaChunk + 8 * q;
      const bool in = k < k_hi;
#pragma unroll
      for (int s = 0; s < S; ++s)
#pragma unroll
        for (int v = 0; v < NV; ++v) wq[u][s][v] = load_w16(wrow[s][v] + k, in);
      qa[u] = load_x16(xa(in ? k : k_lo), in && a_ok);
      qb[u] = TWO ? load_x16(xb(in ? k : k_lo), in && b_ok) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kMmaUnroll; ++u) {
      const uint32_t a0[4] = {qa[u].x, qb[u].x, qa[u].y, qb[u].y};  // step 0: columns 8q + 0..3
      const uint32_t a1[4] = {qa[u].z, qb[u].z, qa[u].w, qb[u].w};  // step 1: columns 8q + 4..7
#pragma unroll
      for (int s = 0; s < S; ++s)
#pragma unroll
        for (int v = 0; v < NV; ++v) {
          const uint32_t b0[2] = {wq[u][s][v].x, wq[u][s][v].y};
          const uint32_t b1[2] = {wq[u][s][v].z, wq[u][s][v].w};
          mma_16816<T>(acc[s][v], a0, b0);
          mma_16816<T>(acc[s][v], a1, b1);
        }
    }
  }
}

}  // namespace spd
