// Shared device helpers: element types, rounding like torch, vector loads, warp reductions.
#pragma once
#ifdef SPD_SIMT_HOST
#include "simt_host.h"  // the host emulation used by tests (spd_kernels._spd_simt)
// kernel<<<grid, block, smem, stream>>>(args) runs the grid's threads as fibers, synchronously.
#define SPD_LAUNCH(kernel, grid, block, smem, stream) \
  ::spd::simt::launch(kernel, grid, block, smem, stream)
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
// kernel<<<grid, block, smem, stream>>>(args), or the same as a programmatic dependent launch
// when set_programmatic_launch(true) was called (see Launch below).
#define SPD_LAUNCH(kernel, grid, block, smem, stream) \
  ::spd::make_launch(kernel, grid, block, smem, stream)
#define SPD_DYNAMIC_SHARED(T, name) extern __shared__ T name[]
#endif

#include <cstdint>
#include <type_traits>
#include <utility>

#include "spd_cuda.h"

namespace spd {

#ifdef SPD_SIMT_HOST
constexpr bool kHostEmulation = true;  // compiled for the host emulation (simt_host.h)
#else
constexpr bool kHostEmulation = false;
#endif

// Programmatic dependent launch (sm_90+). With it on, a kernel may start while the one before it
// on the stream is still running (once every block of that one has called pdl_trigger()), so its
// launch and ramp overlap the other's tail. Every kernel of this extension therefore calls
// pdl_wait() before it reads anything an earlier kernel may have written, and before any store
// (the earlier kernel may still read a buffer it is about to reuse); only loads of what no kernel
// writes (weights) and L2 prefetches may come first. Without the launch attribute both are no-ops.
// The host emulation checks that every thread of every launch reaches pdl_wait().
__device__ __forceinline__ void pdl_wait() {
#if defined(SPD_SIMT_HOST)
  simt::grid_dependency_wait();
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Lets the next kernel on the stream launch (it still waits for this one in its pdl_wait()).
__device__ __forceinline__ void pdl_trigger() {
#if !defined(SPD_SIMT_HOST) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;");
#endif
}

// What every kernel does on entry (after any weight prefetch): let the next kernel launch, then
// wait for the one before. The Triton kernels' pdl_enter (spd_kernels/_triton.py) is the same.
__device__ __forceinline__ void pdl_enter() {
  pdl_trigger();
  pdl_wait();
}

#ifndef SPD_SIMT_HOST
// SPD_LAUNCH(...)(args): a plain launch, or with programmaticStreamSerializationAllowed when the
// process-wide switch is on. Errors are left for the launcher's cudaGetLastError().
template <typename... P>
struct Launch {
  void (*kernel)(P...);
  dim3 grid, block;
  size_t smem;
  cudaStream_t stream;
  template <typename... A>
  void operator()(A&&... args) const {
    if (!programmatic_launch()) {
      kernel<<<grid, block, smem, stream>>>(std::forward<A>(args)...);
      return;
    }
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    cudaLaunchKernelEx(&cfg, kernel, std::forward<A>(args)...);
  }
};

template <typename... P>
Launch<P...> make_launch(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem,
                         cudaStream_t stream) {
  return Launch<P...>{kernel, grid, block, smem, stream};
}
#endif

template <typename T>
struct Num;

template <>
struct Num<float> {
  static __device__ __forceinline__ float to_f(float x) { return x; }
  static __device__ __forceinline__ float from_f(float x) { return x; }
};

template <>
struct Num<__nv_bfloat16> {
  static __device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
  static __device__ __forceinline__ __nv_bfloat16 from_f(float x) { return __float2bfloat16_rn(x); }
};

template <>
struct Num<__half> {
  static __device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
  static __device__ __forceinline__ __half from_f(float x) { return __float2half_rn(x); }
};

template <typename T>
__device__ __forceinline__ float to_f(T x) { return Num<T>::to_f(x); }

// x rounded to T's precision (round to nearest even, as torch's .to(dtype)), kept in fp32.
template <typename T>
__device__ __forceinline__ float round_to(float x) { return Num<T>::to_f(Num<T>::from_f(x)); }

// Eight consecutive elements as fp32. p must be 16-byte aligned (32 for float).
template <typename T>
__device__ __forceinline__ void load8(const T* p, float* out);

template <>
__device__ __forceinline__ void load8<__nv_bfloat16>(const __nv_bfloat16* p, float* out) {
  uint4 raw = __ldg(reinterpret_cast<const uint4*>(p));
  const __nv_bfloat162* h2 = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 f = __bfloat1622float2(h2[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

template <>
__device__ __forceinline__ void load8<__half>(const __half* p, float* out) {
  uint4 raw = __ldg(reinterpret_cast<const uint4*>(p));
  const __half2* h2 = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 f = __half22float2(h2[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

template <>
__device__ __forceinline__ void load8<float>(const float* p, float* out) {
  float4 a = __ldg(reinterpret_cast<const float4*>(p));
  float4 b = __ldg(reinterpret_cast<const float4*>(p) + 1);
  out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w;
  out[4] = b.x; out[5] = b.y; out[6] = b.z; out[7] = b.w;
}

// Eight bf16 / f16 values held in 16 bytes (a uint4 already loaded), as fp32: exact conversions.
template <typename T>
__device__ __forceinline__ void unpack8(const uint4& q, float* f);

template <>
__device__ __forceinline__ void unpack8<__nv_bfloat16>(const uint4& q, float* f) {
  const uint32_t u[4] = {q.x, q.y, q.z, q.w};  // bit operations keep q in registers
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(u[i] << 16);
    f[2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
  }
}

template <>
__device__ __forceinline__ void unpack8<__half>(const uint4& q, float* f) {
  const uint32_t u[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __half2float(__ushort_as_half((unsigned short)(u[i] & 0xffffu)));
    f[2 * i + 1] = __half2float(__ushort_as_half((unsigned short)(u[i] >> 16)));
  }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// (value, index) order of an argmax as torch.argmax: NaN above every number (-inf included),
// ties, NaN ties too, to the lowest index.
__device__ __forceinline__ bool better(float v, int i, float bv, int bi) {
  const bool vn = v != v, bn = bv != bv;
  if (vn || bn) return vn && (!bn || i < bi);
  return v > bv || (v == bv && i < bi);
}

// A hint to start pulling p's cache line into L2 (nothing in the host emulation).
__device__ __forceinline__ void prefetch_l2(const void* p) {
#ifndef SPD_SIMT_HOST
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
#else
  (void)p;
#endif
}

// One warp-wide tensor-core product, mma.sync m16n8k16 with fp32 accumulation (sm_80 and
// newer): c += A B for A 16 x 16 (row-major) and B 16 x 8 (column-major), elements of T (bf16 or
// f16), two per 32-bit register, the lower index in the low half. With g = lane / 4, q = lane % 4
// (the PTX ISA's fragment layout):
//   a[0] = A[g][2q, 2q+1]    a[1] = A[g+8][2q, 2q+1]    a[2] = A[g][2q+8, 2q+9]    a[3] = A[g+8][2q+8, 2q+9]
//   b[0] = B[2q, 2q+1][g]    b[1] = B[2q+8, 2q+9][g]
//   c[0], c[1] = C[g][2q, 2q+1]                         c[2], c[3] = C[g+8][2q, 2q+1]
// Every lane of the warp must call it, converged. The emulation computes it in fp32 (simt_host.h).
#ifdef SPD_SIMT_HOST
template <typename T>
__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4],
                                          const uint32_t (&b)[2]) {
  simt::mma_m16n8k16(a, b, c, std::is_same<T, __nv_bfloat16>::value);
}
#else
template <typename T>
__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4],
                                          const uint32_t (&b)[2]);
template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&c)[4], const uint32_t (&a)[4],
                                                         const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
template <>
__device__ __forceinline__ void mma_16816<__half>(float (&c)[4], const uint32_t (&a)[4],
                                                  const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
#endif

inline bool vec_aligned(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 31u) == 0; }

}  // namespace spd
