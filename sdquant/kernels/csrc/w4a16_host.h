// sdquant W4A16: host-side state kept per device. A kernel's attributes (the dynamic shared-memory opt-in) and its
// occupancy belong to the device they were set or queried on, and one process may drive several GPUs, so the
// launchers cache them per device ordinal rather than once per process.
#pragma once
#include <cuda_runtime.h>

#include <cstdlib>

namespace sdq_w4a16 {

constexpr int SDQ_DEVICES = 16;  // ordinals cached; a larger one recomputes at every call

// f()'s result (>= 0) for device `dev`, computed once: slot[dev] holds it + 1 (0 = not yet)
template <typename F>
inline int per_device(int (&slot)[SDQ_DEVICES], int dev, F&& f) {
  if (dev < 0 || dev >= SDQ_DEVICES) return f();
  if (slot[dev] == 0) slot[dev] = f() + 1;
  return slot[dev] - 1;
}
// the same for the calling thread's current device
template <typename F>
inline int per_current_device(int (&slot)[SDQ_DEVICES], F&& f) {
  int dev = -1;
  if (cudaGetDevice(&dev) != cudaSuccess) dev = -1;
  return per_device(slot, dev, f);
}

// The dynamic shared-memory opt-in of a kernel, plus (SDQ_CARVEOUT in the environment, read once a process; a measurement
// switch, unset by default) its preferred L1 / shared-memory carveout in percent, so that every kernel of the extension
// can ask for the same split of the unified memory (bench/chain.py).
inline int sdq_carveout() {
  static const int v = [] {
    const char* e = std::getenv("SDQ_CARVEOUT");
    return e != nullptr && *e != '\0' ? std::atoi(e) : -1;
  }();
  return v;
}
template <typename K>
inline int set_smem_attrs(K* kern, int smem) {
  cudaError_t e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (e == cudaSuccess && sdq_carveout() >= 0)
    e = cudaFuncSetAttribute(kern, cudaFuncAttributePreferredSharedMemoryCarveout, sdq_carveout());
  return static_cast<int>(e);
}

}  // namespace sdq_w4a16
