// The fiber scheduler behind simt_host.h, and the few CUDA runtime calls the kernels' launchers
// make, answered for one emulated device (this library does not link the CUDA runtime).
#include "simt_host.h"

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <vector>

namespace spd {
namespace simt {

Coords coords;

namespace {

constexpr size_t kStack = 256 * 1024;
constexpr int kMaxThreads = 1024;
constexpr size_t kMaxDynamicSmem = 227 * 1024;  // H100/H200 opt-in limit
// Emulated multiprocessors: persistent grids get 3 or 6 blocks, not 1. set_multiprocessors()
// changes it (132 plans the launches as on an H100 / H200).
int g_sms = 3;

// Switching between fibers. On x86-64 a few instructions save the callee-saved registers and
// swap stacks (swapcontext would also make a signal-mask system call on every switch, which
// dominates the run time); elsewhere ucontext.
#if defined(__x86_64__)
extern "C" void spd_simt_switch(void** save_sp, void* load_sp);
asm(R"(
  .text
  .globl spd_simt_switch
  .hidden spd_simt_switch
  .type spd_simt_switch, @function
spd_simt_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size spd_simt_switch, .-spd_simt_switch
)");

struct Context {
  void* sp = nullptr;
  // A fresh context on stack [base, base + size) that starts in entry() (which never returns).
  void prepare(char* base, size_t size, void (*entry)()) {
    uintptr_t top = (reinterpret_cast<uintptr_t>(base) + size) & ~uintptr_t(15);
    void** frame = reinterpret_cast<void**>(top - 8);  // entry sees rsp = 8 mod 16, as after a call
    *--frame = reinterpret_cast<void*>(entry);         // popped by ret
    for (int i = 0; i < 6; ++i) *--frame = nullptr;    // rbp rbx r12 r13 r14 r15
    sp = frame;
  }
  static void swap(Context& from, Context& to) { spd_simt_switch(&from.sp, to.sp); }
};
#else
struct Context {
  ucontext_t uc;
  void prepare(char* base, size_t size, void (*entry)()) {
    getcontext(&uc);
    uc.uc_stack.ss_sp = base;
    uc.uc_stack.ss_size = size;
    uc.uc_link = nullptr;  // entry() never returns
    makecontext(&uc, entry, 0);
  }
  static void swap(Context& from, Context& to) { swapcontext(&from.uc, &to.uc); }
};
#endif

// A barrier among fibers: `expected` live members; the last to arrive opens a new generation.
struct Barrier {
  int expected = 0, arrived = 0;
  unsigned generation = 0;
};

struct Fiber {
  Context ctx;
  dim3 tid;
  int warp = 0, lane = 0;
  bool started = false, done = false;
  bool waited = false;  // reached grid_dependency_wait()
  std::vector<char> stack;
};

struct Block {
  std::vector<Fiber> fibers;
  Barrier block_bar;
  std::vector<Barrier> warp_bars;
  std::vector<uint64_t> slots;  // 32 per warp
  std::vector<unsigned char> smem;
  const std::function<void()>* body = nullptr;
  Context scheduler;
  Fiber* current = nullptr;
  long progress = 0;  // arrivals and exits; a full pass without any is a deadlock
  int threads = 0;    // in the block
};

Block blk;
std::mutex launch_mutex;
int last_error = cudaSuccess;

void yield() { Context::swap(blk.current->ctx, blk.scheduler); }

void wait(Barrier& b) {
  const unsigned gen = b.generation;
  ++blk.progress;
  if (++b.arrived >= b.expected) {
    b.arrived = 0;
    ++b.generation;
    return;
  }
  while (b.generation == gen) yield();
}

// A thread that returns leaves its barriers, which may open them (CUDA counts live threads).
void leave(Barrier& b) {
  --b.expected;
  if (b.arrived > 0 && b.arrived >= b.expected) {
    b.arrived = 0;
    ++b.generation;
  }
}

void fiber_main() {
  Fiber* f = blk.current;
  (*blk.body)();
  f->done = true;
  ++blk.progress;
  leave(blk.warp_bars[f->warp]);
  leave(blk.block_bar);
  Context::swap(f->ctx, blk.scheduler);  // for good: a finished fiber is never resumed
  __builtin_unreachable();
}

int run_block(dim3 bidx) {
  const int n = (int)(coords.block_dim.x * coords.block_dim.y * coords.block_dim.z);
  const int warps = (n + 31) / 32;
  blk.threads = n;
  blk.block_bar = Barrier{n, 0, 0};
  blk.warp_bars.assign(warps, Barrier{});
  for (int w = 0; w < warps; ++w) blk.warp_bars[w].expected = std::min(32, n - 32 * w);
  std::fill(blk.slots.begin(), blk.slots.end(), 0xDEADBEEFDEADBEEFull);
  // Poison shared memory: a read of an element no thread wrote shows up as NaN / garbage.
  std::fill(blk.smem.begin(), blk.smem.end(), (unsigned char)0xFF);
  for (int i = 0; i < n; ++i) {
    Fiber& f = blk.fibers[i];
    f.tid = dim3(i % coords.block_dim.x, (i / coords.block_dim.x) % coords.block_dim.y,
                 i / (coords.block_dim.x * coords.block_dim.y));
    f.warp = i / 32;
    f.lane = i % 32;
    f.started = f.done = f.waited = false;
    f.ctx.prepare(f.stack.data(), f.stack.size(), fiber_main);
  }
  coords.block_idx = bidx;
  int live = n;
  while (live > 0) {
    const long before = blk.progress;
    live = 0;
    for (int i = 0; i < n; ++i) {
      Fiber& f = blk.fibers[i];
      if (f.done) continue;
      blk.current = &f;
      coords.thread_idx = f.tid;
      const bool first = !f.started;
      f.started = true;
      Context::swap(blk.scheduler, f.ctx);
      if (first) ++blk.progress;
      if (!f.done) ++live;
    }
    if (live > 0 && blk.progress == before) {
      std::fprintf(stderr,
                   "spd_kernels._spd_simt: deadlock in block (%u, %u, %u): %d thread(s) wait at "
                   "a barrier that the others never reach\n",
                   bidx.x, bidx.y, bidx.z, live);
      return cudaErrorLaunchFailure;  // the fibers are abandoned; their stacks are reused
    }
  }
  for (int i = 0; i < n; ++i)
    if (!blk.fibers[i].waited) {
      std::fprintf(stderr,
                   "spd_kernels._spd_simt: thread %d of block (%u, %u, %u) ended without "
                   "pdl_wait(), which a programmatic launch needs before any memory access\n",
                   i, bidx.x, bidx.y, bidx.z);
      return cudaErrorNotPermitted;
    }
  return cudaSuccess;
}

}  // namespace

void sync_block() { wait(blk.block_bar); }
void sync_warp() { wait(blk.warp_bars[blk.current->warp]); }
uint64_t* warp_slots() { return blk.slots.data() + 32 * blk.current->warp; }
int lane() { return blk.current->lane; }
int warp_size() { return std::min(32, blk.threads - 32 * blk.current->warp); }
void* dynamic_shared() { return blk.smem.data(); }
void grid_dependency_wait() { blk.current->waited = true; }

int run_grid(dim3 grid, dim3 block, size_t smem, const std::function<void()>& body) {
  std::lock_guard<std::mutex> lock(launch_mutex);  // one launch at a time: statics are shared
  const long threads = (long)block.x * block.y * block.z;
  if (threads <= 0 || threads > kMaxThreads || grid.x == 0 || grid.y == 0 || grid.z == 0 ||
      grid.y > 65535 || grid.z > 65535) {
    last_error = cudaErrorInvalidConfiguration;
    return last_error;
  }
  if (smem > kMaxDynamicSmem) {
    last_error = cudaErrorInvalidValue;
    return last_error;
  }
  if ((long)blk.fibers.size() < threads) {
    blk.fibers.resize(threads);
    for (auto& f : blk.fibers)
      if (f.stack.empty()) f.stack.resize(kStack);
  }
  blk.slots.assign(32 * ((threads + 31) / 32), 0);
  blk.smem.assign(smem + 16, 0);
  blk.body = &body;
  coords.block_dim = block;
  coords.grid_dim = grid;
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        const int err = run_block(dim3(x, y, z));
        if (err != cudaSuccess) {
          last_error = err;
          return err;
        }
      }
  return cudaSuccess;
}

}  // namespace simt
}  // namespace spd

// mma.sync m16n8k16 (fragment layout in common.cuh). Needs the whole warp of 32 lanes.
namespace spd {
namespace simt {
namespace {

float element(uint32_t reg, int j, bool bf16) {  // element j (0 = low half) of a packed pair
  const unsigned short h = (unsigned short)(j ? reg >> 16 : reg & 0xffffu);
  if (bf16) return __uint_as_float((uint32_t)h << 16);
  return __half2float(__ushort_as_half(h));
}

}  // namespace

void mma_m16n8k16(const uint32_t (&a)[4], const uint32_t (&b)[2], float (&c)[4], bool bf16) {
  std::array<std::array<uint32_t, 32>, 4> ga;
  std::array<std::array<uint32_t, 32>, 2> gb;
  for (int i = 0; i < 4; ++i) ga[i] = gather(a[i]);
  for (int i = 0; i < 2; ++i) gb[i] = gather(b[i]);
  if (warp_size() != 32) {
    std::fprintf(stderr, "spd_kernels._spd_simt: mma_m16n8k16 in a partial warp\n");
    std::abort();
  }
  float A[16][16], B[16][8];
  for (int l = 0; l < 32; ++l) {
    const int g = l >> 2, q = l & 3;
    for (int j = 0; j < 2; ++j) {
      A[g][2 * q + j] = element(ga[0][l], j, bf16);
      A[g + 8][2 * q + j] = element(ga[1][l], j, bf16);
      A[g][2 * q + 8 + j] = element(ga[2][l], j, bf16);
      A[g + 8][2 * q + 8 + j] = element(ga[3][l], j, bf16);
      B[2 * q + j][g] = element(gb[0][l], j, bf16);
      B[2 * q + 8 + j][g] = element(gb[1][l], j, bf16);
    }
  }
  const int g = lane() >> 2, q = lane() & 3;
  for (int i = 0; i < 4; ++i) {
    const int row = g + (i >= 2 ? 8 : 0), col = 2 * q + (i & 1);
    float s = 0.f;
    for (int k = 0; k < 16; ++k) s = std::fma(A[row][k], B[k][col], s);
    c[i] += s;
  }
}

}  // namespace simt
}  // namespace spd

// Known-answer kernels for the emulation itself (tests/test_kernels_cuda_ext.py).
namespace spd {
namespace simt {
namespace {

// out[9 * t + i]: lane t's results of the warp collectives, for 64 threads (two warps).
void collectives_kernel(int* out) {
  grid_dependency_wait();
  const int t = threadIdx.x, lane = t & 31;
  int* o = out + 9 * t;
  o[0] = __shfl_xor_sync(0xffffffffu, t, 5);
  o[1] = __shfl_up_sync(0xffffffffu, t, 3);
  o[2] = __shfl_down_sync(0xffffffffu, t, 3);
  o[3] = __shfl_sync(0xffffffffu, t, 7);
  o[4] = (int)__ballot_sync(0xffffffffu, lane % 3 == 0);
  const unsigned peers = __match_any_sync(0xffffffffu, lane % 4);
  o[5] = (int)peers;
  o[6] = (int)__reduce_add_sync(peers, (unsigned)t);
  __shared__ int s[64];
  s[t] = t * t;
  __syncthreads();
  o[7] = s[63 - t];  // written by another warp before the barrier
  o[8] = (int)blockIdx.x * 100 + (int)blockDim.x;
}

// Half of warp 0 waits at __syncthreads, the other half at __syncwarp: neither barrier can open.
void deadlock_kernel(int* out) {
  grid_dependency_wait();
  if (threadIdx.x < 16) __syncthreads();
  else if (threadIdx.x < 32) __syncwarp();
  else __syncthreads();
  out[threadIdx.x] = 1;
}

// Thread 5 ends without the wait every kernel owes a programmatic launch.
void no_wait_kernel(int* out) {
  if (threadIdx.x != 5) grid_dependency_wait();
  out[threadIdx.x] = 2;
}

}  // namespace

int set_multiprocessors(int n) {
  const int old = g_sms;
  if (n >= 1) g_sms = n;
  return old;
}

int selftest(int which, int* out) {
  auto kernel = which == 0 ? collectives_kernel : which == 1 ? deadlock_kernel : no_wait_kernel;
  launch(kernel, 1, 64, 0, nullptr)(out);
  return cudaGetLastError();
}

}  // namespace simt
}  // namespace spd

// CUDA runtime calls made by the launchers, for one emulated device.
extern "C" {

cudaError_t cudaGetLastError(void) {
  const int e = spd::simt::last_error;
  spd::simt::last_error = cudaSuccess;
  return static_cast<cudaError_t>(e);
}

cudaError_t cudaPeekAtLastError(void) { return static_cast<cudaError_t>(spd::simt::last_error); }

cudaError_t cudaGetDeviceCount(int* count) {
  *count = 1;
  return cudaSuccess;
}

cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int) {
  switch (attr) {
    case cudaDevAttrMultiProcessorCount: *value = spd::simt::g_sms; break;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = (int)spd::simt::kMaxDynamicSmem; break;
    case cudaDevAttrWarpSize: *value = 32; break;
    default: return cudaErrorInvalidValue;
  }
  return cudaSuccess;
}

cudaError_t cudaFuncSetAttribute(const void*, cudaFuncAttribute, int) { return cudaSuccess; }

cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* blocks, const void*, int,
                                                          size_t) {
  *blocks = 2;
  return cudaSuccess;
}

cudaError_t cudaRuntimeGetVersion(int* version) {
  *version = CUDART_VERSION;
  return cudaSuccess;
}

const char* cudaGetErrorName(cudaError_t err) {
  switch (err) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
    case cudaErrorNotPermitted: return "cudaErrorNotPermitted";
    default: return "cudaErrorUnknown";
  }
}

const char* cudaGetErrorString(cudaError_t err) {
  switch (err) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorLaunchFailure: return "unspecified launch failure (in the host emulation: a deadlock at a barrier)";
    case cudaErrorNotPermitted: return "operation not permitted (in the host emulation: a kernel thread ended without pdl_wait())";
    default: return "unknown error";
  }
}

}  // extern "C"
