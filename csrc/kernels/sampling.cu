// Exact speculative rejection sampling in one launch: one block per row does every pass over its
// row (the Triton split-row plan needs up to 20 launches, which dominate at one row).
//
// Row r, from logits (p = softmax(logits / T) restricted by top-k and top-p) or from given
// probabilities p; q on target ids, or on the draft vocabulary through t2d (target id -> draft
// column, -1 for none). Passes:
//   1. stats: max of x = logits / T, its first index (greedy), sum exp(x - max);
//   2. top-k: radix select of the k-th largest key, 8 bits a round (4 passes, counts only);
//   3. top-p: radix select over the top-k set of the smallest key whose strictly-larger mass is
//      below top_p * mass (4 passes; masses in 32-bit fixed point summed as integers);
//   4. the kept mass z (one pass), the accept test u0 * q(x) < p(x) (one thread);
//   5. on rejection: the residual mass sum max(p - q, 0) (p itself when that is empty), then an
//      inverse-CDF walk in tiles, each a block-wide scan, stopping at the tile that holds u1 * mass.
// The sampling rules are spd_kernels/sampling.py's (its module docstring): one total order, x
// descending and lower ids first; top-k keeps the first k tokens of it (a tie group at the k-th
// value cut by id: the nth tied id), top-p the tie group at its cut up to tie_keep's count; a
// row whose argmax (torch.argmax's order) is NaN or +-inf, or all -inf, is one-hot at it.
// Every sum is reduced in a fixed order (warp-private histograms, groups of equal digits found
// with __match_any_sync and summed with __reduce_add_sync), so results do not depend on timing.
// Uniforms are given [R, 2] (fp32) or drawn by Philox-4x32-10 exactly as Triton's
// tl.randint4x(seed, offset + r) and uint_to_uniform_float, so both backends draw the same numbers.
#include <cfloat>
#include <climits>
#include <cmath>

#include "common.cuh"

namespace spd {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kItems = 4;              // consecutive entries a thread takes per tile of the walk
constexpr float kFix = 4294967040.0f;  // mass 1.0 in fixed point: the largest float below 2^32

struct Params {
  const void* x;
  int64_t stride_x;
  const void* q;
  int64_t stride_q;
  const int* t2d;  // null: q is on target ids
  const void* tok;
  const float* u;  // null: Philox(seed, offset + r)
  int64_t stride_u;
  const int64_t* seed;
  const int64_t* offset;
  int64_t* out_tok;
  bool* out_acc;
  int V, top_k;
  float temperature, top_p;
  bool tok_i64, from_logits, greedy, use_k, use_p;
};

// Monotone map fp32 -> uint32 (a < b <=> key(a) < key(b)): Triton's float_key shifted by 2^31.
__device__ __forceinline__ uint32_t ukey(float x) {
  const int b = __float_as_int(x);
  return (uint32_t)(b < 0 ? (b ^ 0x7FFFFFFF) : b) ^ 0x80000000u;
}

template <typename T, typename Q>
struct Row {
  const T* x;
  const Q* q;
  const int* t2d;
  int V;
  float temperature;
  bool from_logits, greedy;  // x holds logits (else probabilities); T = 0
  __device__ __forceinline__ float logit(int v) const {
    const float lg = to_f(x[v]);
    return greedy ? lg : lg / temperature;  // IEEE division, as the reference
  }
  __device__ __forceinline__ float qv(int v) const {
    if (t2d != nullptr) {
      const int c = t2d[v];
      return c >= 0 ? to_f(q[c]) : 0.f;
    }
    return to_f(q[v]);
  }
};

// What p needs once the thresholds are known (from logits).
struct Kept {
  float mx, z;        // max of x and the kept mass sum exp(x - mx)
  int amax;           // the argmax in torch.argmax's order (greedy, NaN / inf rows)
  bool one_hot;       // p is the one-hot of amax (a NaN / inf row)
  uint32_t ckey;      // kept iff key > ckey, or key == ckey and id <= cid
  int cid;
};

__device__ __forceinline__ bool in_set(uint32_t key, int v, uint32_t ckey, int cid) {
  return key > ckey || (key == ckey && v <= cid);
}

// The fp32 value of a ukey.
__device__ __forceinline__ float key_value(uint32_t u) {
  const int b = (int)(u ^ 0x80000000u);
  return __int_as_float(b < 0 ? (b ^ 0x7FFFFFFF) : b);
}

// How many of the n tokens of the tie group at the top-p cut are kept (at least 1): token j is
// dropped iff s + j * w >= bound, in double (j * w is exact there), as the reference.
__device__ int tie_keep(float s, float w, double bound, int n) {
  const double s64 = s, w64 = w;
  double est = w64 > 0.0 ? (bound - s64) / w64 : (double)n;
  est = est != est ? 1.0 : fmin(fmax(est, 1.0), (double)n);
  int c = (int)est;
  for (int i = 0; i < 2; ++i)
    if (c < n && s64 + (double)c * w64 < bound) ++c;
  for (int i = 0; i < 2; ++i)
    if (c > 1 && s64 + (double)(c - 1) * w64 >= bound) --c;
  return c;
}

template <typename T, typename Q>
__device__ __forceinline__ float p_of(const Row<T, Q>& row, const Kept& k, int v) {
  if (!row.from_logits) return to_f(row.x[v]);
  if (row.greedy || k.one_hot) return v == k.amax ? 1.f : 0.f;
  const float x = row.logit(v);
  if (!in_set(ukey(x), v, k.ckey, k.cid)) return 0.f;
  return expf(x - k.mx) / k.z;
}

struct Stat {
  float m, s;  // max and sum exp(x - m)
  int i;       // first index of the max
};

__device__ __forceinline__ float rescale(float s, float m, float to) {
  return m == -INFINITY ? 0.f : s * expf(m - to);
}

__device__ __forceinline__ Stat combine(const Stat& a, const Stat& b) {
  Stat r = (b.m > a.m || (b.m == a.m && b.i < a.i)) ? b : a;
  r.s = rescale(a.s, a.m, r.m) + rescale(b.s, b.m, r.m);
  return r;
}

struct Shared {
  uint64_t mass[kWarps][256];  // warp-private histograms of one radix round
  int cnt[kWarps][256];
  Stat stat[kWarps];
  float f[kWarps];
  int imin[kWarps], imax[kWarps];
  // one radix round's choice, and the accept test, broadcast to the block
  int sel_digit, before_cnt, sel_cnt, found;
  uint64_t before_mass;
  int64_t tok;
  float u1;
  bool accepted;
};

// Sum over the block in a fixed order (the same value in every thread).
__device__ float block_sum(float v, Shared& sh) {
  v = warp_sum(v);
  if ((threadIdx.x & 31) == 0) sh.f[threadIdx.x >> 5] = v;
  __syncthreads();
  float t = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) t += sh.f[w];
  __syncthreads();
  return t;
}

__device__ int block_min(int v, Shared& sh) {
  for (int o = 16; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(0xffffffffu, v, o));
  if ((threadIdx.x & 31) == 0) sh.imin[threadIdx.x >> 5] = v;
  __syncthreads();
  int t = INT_MAX;
  for (int w = 0; w < kWarps; ++w) t = min(t, sh.imin[w]);
  __syncthreads();
  return t;
}

__device__ Stat block_stat(Stat v, Shared& sh) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    Stat w;
    w.m = __shfl_xor_sync(0xffffffffu, v.m, o);
    w.s = __shfl_xor_sync(0xffffffffu, v.s, o);
    w.i = __shfl_xor_sync(0xffffffffu, v.i, o);
    v = combine(v, w);
  }
  if ((threadIdx.x & 31) == 0) sh.stat[threadIdx.x >> 5] = v;
  __syncthreads();
  Stat t = sh.stat[0];
  for (int w = 1; w < kWarps; ++w) t = combine(t, sh.stat[w]);
  __syncthreads();
  return t;
}

// The threshold key, 8 bits a round from the top. Top-k (phase_p false): the k-th largest key.
// Top-p: the key where the mass from the top (keys >= floor only) first reaches top_p of their
// total; if rounding keeps it from being reached, the lowest key present (keep everything).
struct Sel {
  uint32_t key;  // the threshold key
  int above;     // keys of the set above it
  int eq;        // keys of the set equal to it
};

template <typename T, typename Q>
__device__ Sel radix_select(const Row<T, Q>& row, float mx, bool phase_p, uint32_t fkey, int fid,
                            int top_k, float top_p, Shared& sh) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  uint32_t prefix = 0;
  int above = 0;          // count of the keys above the prefix chosen so far
  uint64_t above_m = 0;   // and their mass
  uint64_t bound = 0;     // top_p * total mass (warp 0)
  int eq = 0;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int b = lane; b < 256; b += 32) {
      sh.cnt[warp][b] = 0;
      sh.mass[warp][b] = 0;
    }
    __syncwarp();
    for (int v0 = 0; v0 < row.V; v0 += kThreads) {  // the same trip count for every thread
      const int v = v0 + (int)threadIdx.x;
      bool ok = v < row.V;
      float x = 0.f;
      uint32_t key = 0;
      if (ok) {
        x = row.logit(v);
        key = ukey(x);
        ok = ((uint64_t)key >> (shift + 8)) == prefix && in_set(key, v, fkey, fid);
      }
      const int digit = ok ? (int)((key >> shift) & 255u) : 256 + lane;  // others: a group each
      const unsigned peers = __match_any_sync(0xffffffffu, digit);
      const bool leader = ok && lane == __ffs((int)peers) - 1;
      if (phase_p) {
        const uint32_t fx = ok ? (uint32_t)(expf(x - mx) * kFix) : 0u;
        const unsigned lo = __reduce_add_sync(peers, fx & 0xffffu);
        const unsigned hi = __reduce_add_sync(peers, fx >> 16);
        if (leader) sh.mass[warp][digit] += ((uint64_t)hi << 16) + lo;
      }
      if (leader) sh.cnt[warp][digit] += __popc(peers);
      __syncwarp();  // the next group's leader may be another lane
    }
    __syncthreads();
    if (warp == 0) {
      // Lane l holds positions 8l .. 8l+7 counted from the top digit (digit 255 - position).
      int c[8];
      uint64_t m[8];
      int csum = 0;
      uint64_t msum = 0;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int digit = 255 - (lane * 8 + j);
        c[j] = 0;
        m[j] = 0;
        for (int w = 0; w < kWarps; ++w) {
          c[j] += sh.cnt[w][digit];
          m[j] += sh.mass[w][digit];
        }
        csum += c[j];
        msum += m[j];
      }
      int cex = csum;  // inclusive scan over lanes, then exclusive
      uint64_t mex = msum;
      for (int o = 1; o < 32; o <<= 1) {
        const int cu = __shfl_up_sync(0xffffffffu, cex, o);
        const uint64_t mu = __shfl_up_sync(0xffffffffu, mex, o);
        if (lane >= o) {
          cex += cu;
          mex += mu;
        }
      }
      if (phase_p && shift == 24) {  // the first round sees every key >= floor
        const uint64_t total = __shfl_sync(0xffffffffu, mex, 31);
        bound = (uint64_t)((double)top_p * (double)total);
        if (bound == 0) bound = 1;  // a tiny top_p: the first key with mass (never an empty digit)
      }
      cex -= csum;
      mex -= msum;
      int hit = -1, low = -1;
      int hit_c = 0, low_c = 0;
      uint64_t hit_m = 0, low_m = 0;
      int cb = cex;
      uint64_t mb = mex;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const bool reach = phase_p ? (above_m + mb + m[j] >= bound)
                                   : ((int64_t)above + cb + c[j] >= (int64_t)top_k);
        if (hit < 0 && reach) {
          hit = j;
          hit_c = cb;
          hit_m = mb;
        }
        if (c[j] > 0) {
          low = j;
          low_c = cb;
          low_m = mb;
        }
        cb += c[j];
        mb += m[j];
      }
      const unsigned hits = __ballot_sync(0xffffffffu, hit >= 0);
      const unsigned lows = __ballot_sync(0xffffffffu, low >= 0);
      if (hits != 0) {
        if (lane == __ffs((int)hits) - 1) {
          sh.sel_digit = 255 - (lane * 8 + hit);
          sh.sel_cnt = c[hit];
          sh.before_cnt = hit_c;
          sh.before_mass = hit_m;
        }
      } else if (phase_p && lows != 0) {  // top-p not reached: the lowest digit present
        if (lane == 31 - __clz((int)lows)) {
          sh.sel_digit = 255 - (lane * 8 + low);
          sh.sel_cnt = c[low];
          sh.before_cnt = low_c;
          sh.before_mass = low_m;
        }
      } else if (lane == 0) {  // nothing matched (cannot happen for valid k): the lowest digit
        sh.sel_digit = 0;
        sh.sel_cnt = 0;
        sh.before_cnt = csum;  // unused afterwards
        sh.before_mass = 0;
      }
    }
    __syncthreads();
    prefix = (prefix << 8) | (uint32_t)sh.sel_digit;
    above += sh.before_cnt;
    above_m += sh.before_mass;
    eq = sh.sel_cnt;
    __syncthreads();  // sh is rewritten by the next round
  }
  return Sel{prefix, above, eq};
}

// The id of the m-th token (from 1, in id order) whose key is `key`; INT_MAX if none. Tiles of
// one entry a thread, counted with ballots, stopping at the tile that holds it.
template <typename T, typename Q>
__device__ int nth_tied_id(const Row<T, Q>& row, uint32_t key, int m, Shared& sh) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  int carry = 0;
  if (threadIdx.x == 0) sh.found = INT_MAX;
  __syncthreads();
  for (int v0 = 0; v0 < row.V; v0 += kThreads) {
    const int v = v0 + (int)threadIdx.x;
    const bool tie = v < row.V && ukey(row.logit(v)) == key;
    const unsigned b = __ballot_sync(0xffffffffu, tie);
    if (lane == 0) sh.imin[warp] = __popc(b);
    __syncthreads();
    int before = carry, tile = 0;
    for (int w = 0; w < kWarps; ++w) {
      if (w < warp) before += sh.imin[w];
      tile += sh.imin[w];
    }
    before += __popc(b & ((1u << lane) - 1u));
    if (tie && before + 1 == m) sh.found = v;
    __syncthreads();
    carry += tile;
    const int f = sh.found;
    __syncthreads();
    if (f != INT_MAX) return f;  // the same in every thread
  }
  return INT_MAX;
}

// Philox-4x32-10 of (seed, counter): Triton's tl.randint4x, lanes c0 and c1 as uniforms the way
// uint_to_uniform_float maps them.
__device__ __forceinline__ float philox_uniform(uint32_t c) {
  int x = (int)c;
  x = x < 0 ? ~x : x;  // -x - 1 without overflow
  return (float)x * 4.6566127342e-10f;
}

__device__ void philox_pair(uint64_t seed, uint64_t counter, float* u0, float* u1) {
  uint32_t c0 = (uint32_t)counter, c1 = (uint32_t)(counter >> 32), c2 = 0, c3 = 0;
  uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
  for (int i = 0; i < 10; ++i) {
    const uint32_t a0 = c0, a2 = c2;
    c0 = __umulhi(0xCD9E8D57u, a2) ^ c1 ^ k0;
    c2 = __umulhi(0xD2511F53u, a0) ^ c3 ^ k1;
    c1 = 0xCD9E8D57u * a2;
    c3 = 0xD2511F53u * a0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  *u0 = philox_uniform(c0);
  *u1 = philox_uniform(c1);
}

// sum exp(x - mx) over the kept set of k whose keys are >= from (summed like every other pass).
template <typename T, typename Q>
__device__ float kept_mass(const Row<T, Q>& row, const Kept& k, uint32_t from, Shared& sh) {
  float s = 0.f;
  for (int v = threadIdx.x; v < row.V; v += kThreads) {
    const float x = row.logit(v);
    const uint32_t key = ukey(x);
    if (key >= from && in_set(key, v, k.ckey, k.cid)) s += expf(x - k.mx);
  }
  return block_sum(s, sh);
}

template <typename T, typename Q>
__global__ void __launch_bounds__(kThreads) rejection_kernel(Params P) {
  __shared__ Shared sh;
  pdl_enter();
  const int r = blockIdx.x;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  Row<T, Q> row{static_cast<const T*>(P.x) + (int64_t)r * P.stride_x,
                static_cast<const Q*>(P.q) + (int64_t)r * P.stride_q, P.t2d, P.V, P.temperature,
                P.from_logits, P.greedy};
  Kept k{0.f, 1.f, 0, false, 0u, INT_MAX};

  if (P.from_logits) {
    Stat st{-INFINITY, 0.f, INT_MAX};
    int nan_i = INT_MAX;
    for (int v = threadIdx.x; v < P.V; v += kThreads) {  // increasing v: strict > keeps the first
      const float x = row.logit(v);
      if (x != x) {
        nan_i = min(nan_i, v);
      } else if (x > st.m) {
        st.s = rescale(st.s, st.m, x) + 1.f;
        st.m = x;
        st.i = v;
      } else if (x != -INFINITY) {
        st.s += expf(x - st.m);
      }
    }
    st = block_stat(st, sh);
    nan_i = block_min(nan_i, sh);
    k.mx = st.m;
    k.amax = nan_i != INT_MAX ? nan_i : (st.i == INT_MAX ? 0 : st.i);
    k.z = st.s;
    k.one_hot = nan_i != INT_MAX || st.m == INFINITY || st.m == -INFINITY;  // the same in every thread
    if ((P.use_k || P.use_p) && !k.one_hot) {  // both false when greedy
      if (P.use_k) {
        const Sel a = radix_select(row, k.mx, false, 0u, INT_MAX, P.top_k, 0.f, sh);
        k.ckey = a.key;
        k.cid = nth_tied_id(row, a.key, P.top_k - a.above, sh);
      }
      if (P.use_p) {
        const double bound = (double)P.top_p * (double)kept_mass(row, k, 0u, sh);
        const Sel b = radix_select(row, k.mx, true, k.ckey, k.cid, 0, P.top_p, sh);
        const float s = kept_mass(row, k, b.key + 1u, sh);  // the mass before its tie group
        const int keep = tie_keep(s, expf(key_value(b.key) - k.mx), bound, b.eq);
        k.cid = nth_tied_id(row, b.key, keep, sh);
        k.ckey = b.key;
      }
      k.z = kept_mass(row, k, 0u, sh);
    }
  }

  if (threadIdx.x == 0) {  // the accept test
    const int64_t tok = P.tok_i64 ? static_cast<const int64_t*>(P.tok)[r]
                                  : (int64_t) static_cast<const int*>(P.tok)[r];
    const bool valid = tok >= 0 && tok < P.V;
    const int tc = valid ? (int)tok : (tok < 0 ? 0 : P.V - 1);
    const float px = valid ? p_of(row, k, tc) : 0.f;
    const float qx = row.qv(tc);
    float u0, u1;
    if (P.u != nullptr) {
      u0 = P.u[(int64_t)r * P.stride_u];
      u1 = P.u[(int64_t)r * P.stride_u + 1];
    } else {
      philox_pair((uint64_t)P.seed[0], (uint64_t)(P.offset[0] + r), &u0, &u1);
    }
    sh.tok = tok;
    sh.u1 = u1;
    sh.accepted = u0 * qx < px;
  }
  __syncthreads();
  const bool accepted = sh.accepted;
  int64_t out = sh.tok;
  const float u1 = sh.u1;

  if (!accepted) {
    float s_res = 0.f, s_p = 0.f;
    for (int v = threadIdx.x; v < P.V; v += kThreads) {
      const float p = p_of(row, k, v);
      s_res += fmaxf(p - row.qv(v), 0.f);
      s_p += p;
    }
    s_res = block_sum(s_res, sh);
    s_p = block_sum(s_p, sh);
    const bool from_p = s_res <= 0.f;  // p <= q everywhere: draw from p itself
    const float goal = u1 * (from_p ? s_p : s_res);
    // Inverse CDF: the first index whose running mass exceeds goal and that has mass, clamped
    // to the last index with mass (rounding at the top end), as sample_from_probs.
    float carry = 0.f;
    int found = INT_MAX, last = -1;
    for (int base = 0; base < P.V; base += kThreads * kItems) {
      const int v0 = base + (int)threadIdx.x * kItems;
      float w[kItems];
      float mine = 0.f;
#pragma unroll
      for (int j = 0; j < kItems; ++j) {
        const int v = v0 + j;
        float wj = 0.f;
        if (v < P.V) {
          const float p = p_of(row, k, v);
          wj = from_p ? p : fmaxf(p - row.qv(v), 0.f);
        }
        w[j] = wj;
        mine += wj;
      }
      float incl = mine;  // scan over the warp's lanes
      for (int o = 1; o < 32; o <<= 1) {
        const float up = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += up;
      }
      float excl = __shfl_up_sync(0xffffffffu, incl, 1);
      if (lane == 0) excl = 0.f;
      if (lane == 31) sh.f[warp] = incl;
      __syncthreads();
      float before = carry, tile = 0.f;
      for (int wi = 0; wi < kWarps; ++wi) {
        if (wi < warp) before += sh.f[wi];
        tile += sh.f[wi];
      }
      float cdf = before + excl;
      int my_found = INT_MAX, my_last = -1;
#pragma unroll
      for (int j = 0; j < kItems; ++j) {
        cdf += w[j];
        if (w[j] > 0.f) {
          my_last = v0 + j;
          if (cdf > goal && my_found == INT_MAX) my_found = v0 + j;
        }
      }
      for (int o = 16; o > 0; o >>= 1) {
        my_found = min(my_found, __shfl_xor_sync(0xffffffffu, my_found, o));
        my_last = max(my_last, __shfl_xor_sync(0xffffffffu, my_last, o));
      }
      if (lane == 0) {
        sh.imin[warp] = my_found;
        sh.imax[warp] = my_last;
      }
      __syncthreads();
      for (int wi = 0; wi < kWarps; ++wi) {
        found = min(found, sh.imin[wi]);
        last = max(last, sh.imax[wi]);
      }
      __syncthreads();  // sh.f and sh.imin are rewritten by the next tile
      carry += tile;
      if (found != INT_MAX) break;  // the same in every thread
    }
    if (found == INT_MAX) found = P.V;
    out = min((int64_t)found, (int64_t)max(last, 0));
  }
  if (threadIdx.x == 0) {
    P.out_tok[r] = out;
    P.out_acc[r] = accepted;
  }
}

template <typename T, typename Q>
int launch(const Params& p, int R, cudaStream_t stream) {
  auto kernel = rejection_kernel<T, Q>;
  SPD_LAUNCH(kernel, R, kThreads, 0, stream)(p);
  return cudaGetLastError();
}

template <typename T>
int launch_q(const Params& p, int q_dtype, int R, cudaStream_t stream) {
  switch (q_dtype) {
    case kF32: return launch<T, float>(p, R, stream);
    case kBF16: return launch<T, __nv_bfloat16>(p, R, stream);
    case kF16: return launch<T, __half>(p, R, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

int rejection_sample(const void* x, int64_t stride_x, int x_dtype, const void* q,
                     int64_t stride_q, int q_dtype, const int* t2d, const void* tok, bool tok_i64,
                     const float* u, int64_t stride_u, const int64_t* seed, const int64_t* offset,
                     int64_t* out_tok, bool* out_acc, int R, int V, float temperature, int top_k,
                     float top_p, bool from_logits, void* stream_ptr) {
  if (R <= 0) return cudaSuccess;
  if (V <= 0 || (u == nullptr && (seed == nullptr || offset == nullptr)))
    return cudaErrorInvalidValue;
  Params p;
  p.x = x;
  p.stride_x = stride_x;
  p.q = q;
  p.stride_q = stride_q;
  p.t2d = t2d;
  p.tok = tok;
  p.u = u;
  p.stride_u = stride_u;
  p.seed = seed;
  p.offset = offset;
  p.out_tok = out_tok;
  p.out_acc = out_acc;
  p.V = V;
  p.top_k = top_k;
  p.top_p = top_p;
  p.tok_i64 = tok_i64;
  p.from_logits = from_logits;
  p.greedy = from_logits && temperature == 0.f;
  p.temperature = p.greedy ? 1.f : temperature;
  p.use_k = from_logits && !p.greedy && top_k > 0 && top_k < V;
  p.use_p = from_logits && !p.greedy && top_p < 1.f;
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  switch (x_dtype) {
    case kF32: return launch_q<float>(p, q_dtype, R, stream);
    case kBF16: return launch_q<__nv_bfloat16>(p, q_dtype, R, stream);
    case kF16: return launch_q<__half>(p, q_dtype, R, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace spd
