// Host emulation of the CUDA execution model, so the .cu kernels run on a CPU in tests.
//
// Built only into spd_kernels._spd_simt (setup.py compiles csrc/*.cu as C++ with SPD_SIMT_HOST
// defined); the real extension never sees this file. Each CUDA thread of a block is a fiber
// (ucontext) on the calling OS thread; a fiber runs until it reaches __syncthreads or a warp
// collective (shuffle, ballot, __syncwarp), then the next one runs, so execution is deterministic
// and a barrier that some threads never reach is reported as a deadlock instead of hanging.
// Blocks run one after another in grid order, so kernels that wait for other blocks cannot run
// here (none do). "Device" memory is host memory: the bindings get CPU tensors' addresses.
// What it checks is the arithmetic, indexing, masking and synchronisation of the kernels, not
// their speed or their behaviour under real concurrency (races between warps do not show).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>  // types and declarations only: simt_host.cpp defines the calls used

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <tuple>
#include <utility>

// Kernel qualifiers: host_defines.h makes __global__ / __device__ empty for a host compiler.
#undef __shared__
#define __shared__ static  // one block runs at a time, so a static is that block's shared memory
#define __launch_bounds__(...)
#define SPD_DYNAMIC_SHARED(T, name) T* name = static_cast<T*>(::spd::simt::dynamic_shared())

namespace spd {
namespace simt {

// The running fiber's coordinates (valid inside a kernel).
struct Coords {
  dim3 thread_idx, block_idx, block_dim, grid_dim;
};
extern Coords coords;

void sync_block();                           // __syncthreads
void sync_warp();                            // __syncwarp
uint64_t* warp_slots();                      // 32 exchange slots of the caller's warp
int lane();
int warp_size();                             // threads in the caller's warp (32 but the last)
void* dynamic_shared();                      // the launch's dynamic shared memory
void grid_dependency_wait();                 // common.cuh's pdl_wait(): marks the thread

// Runs body(block) for every block, each block's threads as fibers. 0 or a cudaError_t value:
// cudaErrorNotPermitted when a thread ended without grid_dependency_wait() (every kernel must
// call pdl_wait(): on a GPU it may be launched programmatically, see common.cuh).
int run_grid(dim3 grid, dim3 block, size_t smem, const std::function<void()>& body);

template <typename K>
struct Launcher {
  K kernel;
  dim3 grid, block;
  size_t smem;
  template <typename... A>
  void operator()(A... args) const {
    auto params = std::make_tuple(args...);  // one copy, shared by every thread (read-only)
    run_grid(grid, block, smem, [&] { std::apply(kernel, params); });
  }
};

template <typename K>
Launcher<K> launch(K kernel, dim3 grid, dim3 block, size_t smem, cudaStream_t) {  // synchronous
  return Launcher<K>{kernel, grid, block, smem};
}

// Every warp collective: each lane puts v in its slot, then read(slots, lanes) computes the
// lane's result from the whole warp's values. Lanes past the end of a partial warp have none.
template <typename T, typename F>
auto warp_collective(T v, F read) {
  static_assert(sizeof(T) <= 8, "warp collectives of values up to 8 bytes");
  uint64_t* slots = warp_slots();
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  slots[lane()] = bits;
  sync_warp();
  const auto out = read(static_cast<const uint64_t*>(slots), warp_size());
  sync_warp();  // nobody overwrites a slot before every lane has read
  return out;
}

template <typename T>
T exchange(T v, int src_lane) {
  return warp_collective(v, [src_lane](const uint64_t* slots, int) {
    T out;
    std::memcpy(&out, &slots[src_lane & 31], sizeof(T));
    return out;
  });
}

// The whole warp's values of v (lanes past the end of a partial warp read as 0).
template <typename T>
std::array<T, 32> gather(T v) {
  return warp_collective(v, [](const uint64_t* slots, int lanes) {
    std::array<T, 32> out{};
    for (int i = 0; i < lanes; ++i) std::memcpy(&out[i], &slots[i], sizeof(T));
    return out;
  });
}

// mma.sync m16n8k16 with fp32 accumulation (common.cuh's mma_16816 gives the fragment layout):
// the warp's fragments are gathered, each lane computes its four C elements in fp32 (the products
// of bf16 / f16 values are exact; the sum runs over k in order). simt_host.cpp.
void mma_m16n8k16(const uint32_t (&a)[4], const uint32_t (&b)[2], float (&c)[4], bool bf16);

}  // namespace simt
}  // namespace spd

#define threadIdx (::spd::simt::coords.thread_idx)
#define blockIdx (::spd::simt::coords.block_idx)
#define blockDim (::spd::simt::coords.block_dim)
#define gridDim (::spd::simt::coords.grid_dim)

inline void __syncthreads() { ::spd::simt::sync_block(); }
inline void __syncwarp(unsigned = 0xffffffffu) { ::spd::simt::sync_warp(); }
inline void __threadfence() {}

template <typename T>
inline T __shfl_xor_sync(unsigned, T v, int mask, int = 32) {
  return ::spd::simt::exchange(v, ::spd::simt::lane() ^ mask);
}
template <typename T>
inline T __shfl_sync(unsigned, T v, int src, int = 32) {
  return ::spd::simt::exchange(v, src);
}
template <typename T>
inline T __shfl_down_sync(unsigned, T v, unsigned delta, int = 32) {
  const int src = ::spd::simt::lane() + (int)delta;
  return ::spd::simt::exchange(v, src < 32 ? src : ::spd::simt::lane());  // CUDA: own value
}

template <typename T>
inline T __shfl_up_sync(unsigned, T v, unsigned delta, int = 32) {
  const int src = ::spd::simt::lane() - (int)delta;
  return ::spd::simt::exchange(v, src >= 0 ? src : ::spd::simt::lane());  // CUDA: own value
}

// Lanes of the caller's warp holding the same value (every lane must call, as with mask ~0).
template <typename T>
inline unsigned __match_any_sync(unsigned, T v) {
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  return ::spd::simt::warp_collective(v, [bits](const uint64_t* slots, int lanes) {
    unsigned out = 0;
    for (int i = 0; i < lanes; ++i) out |= (slots[i] == bits ? 1u : 0u) << i;
    return out;
  });
}

// Sum of v over the lanes in mask (each of them calls with the same mask).
inline unsigned __reduce_add_sync(unsigned mask, unsigned v) {
  return ::spd::simt::warp_collective(v, [mask](const uint64_t* slots, int) {
    unsigned out = 0;
    for (int i = 0; i < 32; ++i)
      if (mask >> i & 1u) out += (unsigned)slots[i];
    return out;
  });
}

inline unsigned __ballot_sync(unsigned, int pred) {
  return ::spd::simt::warp_collective(pred ? 1u : 0u, [](const uint64_t* slots, int lanes) {
    unsigned out = 0;
    for (int i = 0; i < lanes; ++i) out |= (slots[i] ? 1u : 0u) << i;
    return out;
  });
}

template <typename T>
inline T __ldg(const T* p) { return *p; }
template <typename T>
inline T __ldcs(const T* p) { return *p; }

inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)(((uint64_t)a * b) >> 32); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned)x); }

inline float __uint_as_float(unsigned x) { float f; std::memcpy(&f, &x, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned x; std::memcpy(&x, &f, 4); return x; }
inline float __int_as_float(int x) { float f; std::memcpy(&f, &x, 4); return f; }
inline int __float_as_int(float f) { int x; std::memcpy(&x, &f, 4); return x; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __fdividef(float a, float b) { return a / b; }

// Device code calls min / max unqualified on ints, int64 and floats.
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline int64_t min(int64_t a, int64_t b) { return a < b ? a : b; }
inline int64_t max(int64_t a, int64_t b) { return a > b ? a : b; }
inline float min(float a, float b) { return std::fmin(a, b); }
inline float max(float a, float b) { return std::fmax(a, b); }

// The typed overloads cuda_runtime.h declares only for nvcc.
template <typename F>
inline cudaError_t cudaFuncSetAttribute(F* f, cudaFuncAttribute attr, int value) {
  return cudaFuncSetAttribute(reinterpret_cast<const void*>(f), attr, value);
}
template <typename F>
inline cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* n, F* f, int threads,
                                                                  size_t smem) {
  return cudaOccupancyMaxActiveBlocksPerMultiprocessor(n, reinterpret_cast<const void*>(f),
                                                       threads, smem);
}

// Fibers switch only at barriers, so a read-modify-write is never interleaved.
template <typename T>
inline T atomicAdd(T* p, T v) { const T old = *p; *p = old + v; return old; }
template <typename T>
inline T atomicMax(T* p, T v) { const T old = *p; *p = old < v ? v : old; return old; }
template <typename T>
inline T atomicMin(T* p, T v) { const T old = *p; *p = v < old ? v : old; return old; }
template <typename T>
inline T atomicCAS(T* p, T cmp, T v) { const T old = *p; if (old == cmp) *p = v; return old; }
