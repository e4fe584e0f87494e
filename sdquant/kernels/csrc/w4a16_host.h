// sdquant W4A16: host-side state kept per device. A kernel's attributes (the dynamic shared-memory opt-in) and its
// occupancy belong to the device they were set or queried on, and one process may drive several GPUs, so the
// launchers cache them per device ordinal rather than once per process.
#pragma once
#include <cuda_runtime.h>

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

}  // namespace sdq_w4a16
