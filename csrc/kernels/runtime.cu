// Runtime queries for the bindings (kept here so bindings.cpp needs no CUDA headers).
#include <atomic>

#include "common.cuh"

namespace spd {

int device_count(int* count) {
  *count = 0;
  return cudaGetDeviceCount(count);
}

int current_device(int* device) {
  *device = -1;
  return cudaGetDevice(device);
}

const char* error_name(int err) { return cudaGetErrorName(static_cast<cudaError_t>(err)); }

const char* error_string(int err) { return cudaGetErrorString(static_cast<cudaError_t>(err)); }

namespace {
std::atomic<bool> g_programmatic{false};
}

bool set_programmatic_launch(bool on) { return g_programmatic.exchange(on); }

bool programmatic_launch() { return g_programmatic.load(std::memory_order_relaxed); }

int runtime_version() {
  int v = 0;
  cudaRuntimeGetVersion(&v);
  return v;
}

}  // namespace spd
