// In-place KV truncation: new lengths are read on the device (no host sync, graph-capturable);
// one launch covers every layer. Debug poison NaNs rows [new, old) of every buffer first.
#include "common.cuh"

namespace spd {
namespace {

__global__ void lengths_kernel(int64_t* lengths, const int64_t* new_lengths, int new_stride, int C) {
  pdl_enter();
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  int64_t n = new_lengths[(int64_t)c * new_stride];
  n = n < 0 ? 0 : n;
  const int64_t old = lengths[c];
  lengths[c] = n < old ? n : old;
}

// Block (c, b * outer + o): rows [new, old) of slice o of cache c in buffer b, a contiguous span.
template <typename U>
__global__ void poison_kernel(const int64_t* lengths, const int64_t* new_lengths, int new_stride,
                              const int64_t* table, int64_t outer, int64_t S, int64_t inner,
                              U nan_bits) {
  pdl_enter();
  const int64_t c = blockIdx.x;
  const int64_t b = blockIdx.y / outer, o = blockIdx.y % outer;
  const int64_t old = lengths[c] < S ? lengths[c] : S;  // never past the buffer, checked or not
  int64_t n = new_lengths[c * new_stride];
  n = n < 0 ? 0 : (n > old ? old : n);
  U* base = reinterpret_cast<U*>(table[b]) + (c * outer + o) * S * inner;
  for (int64_t i = n * inner + threadIdx.x; i < old * inner; i += blockDim.x) base[i] = nan_bits;
}

}  // namespace

int kv_truncate(int64_t* lengths, const int64_t* new_lengths, int new_stride, int C, void* stream) {
  if (C <= 0) return cudaSuccess;
  SPD_LAUNCH(lengths_kernel, (C + 255) / 256, 256, 0, static_cast<cudaStream_t>(stream))(
      lengths, new_lengths, new_stride, C);
  return cudaGetLastError();
}

int kv_poison(const int64_t* lengths, const int64_t* new_lengths, int new_stride,
              const int64_t* table, int n_buffers, int C, int64_t outer, int64_t S, int64_t inner,
              int dtype, void* stream_ptr) {
  if (C <= 0 || n_buffers <= 0) return cudaSuccess;
  if (C > 2147483647 || n_buffers * outer > 65535) return cudaErrorInvalidValue;
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  dim3 grid(C, (unsigned)(n_buffers * outer));
  auto k32 = poison_kernel<uint32_t>;
  auto k16 = poison_kernel<uint16_t>;
  switch (dtype) {
    case kF32: SPD_LAUNCH(k32, grid, 256, 0, stream)(lengths, new_lengths, new_stride, table, outer, S, inner, 0x7FC00000u); break;
    case kBF16: SPD_LAUNCH(k16, grid, 256, 0, stream)(lengths, new_lengths, new_stride, table, outer, S, inner, (uint16_t)0x7FC0u); break;
    case kF16: SPD_LAUNCH(k16, grid, 256, 0, stream)(lengths, new_lengths, new_stride, table, outer, S, inner, (uint16_t)0x7E00u); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace spd
