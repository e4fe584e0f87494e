// sdquant W4A16 decode kernel for sm_90: the launcher's C interface (no torch headers, so the kernel file
// compiles alone with nvcc; the torch binding includes only this header).
#pragma once
#include <cuda_runtime.h>

struct SdqW4A16Params {
  const void* a;       // [m, k] fp16/bf16, row-major, rows 16-byte aligned (k % 8 == 0), m <= 32
  const void* b;       // [n/64, k/16, 32 lanes, 4] int32 fragments (int4_layout.repack_cuda)
  const void* s;       // [g, n/64, 8, 8] scales, fp16 (applied in fp32 to the group sums)
  const void* zs;      // [g, n/64, 8, 8] integer zero points stored in the activation dtype
  void* c;             // [m, n] output, activation dtype
  float* partial;      // [splits, m, n] fp32 scratch (read only when splits > 1)
  int* locks;          // >= ceil(n/256) ints, zero on entry and left zero on exit
  int m, n, k;
  int group_k16;       // group size / 16 (k / 16 for per-channel)
  int splits;          // split-K factor (>= 1); sdq_w4a16_auto_splits picks one
  int is_bf16;
  int evict_first;     // 1: weights copied with an L2 evict-first policy (variant 0 only)
  int variant;         // kernel variant id (w4a16_sm90.cu's list; 0 = the run-3 kernel, the only one for m > 16)
};

#ifdef __cplusplus
extern "C" {
#endif
// Returns 0 or a cudaError_t / negative code for bad parameters (-1: shape, -2: m too large).
int sdq_w4a16_launch(const SdqW4A16Params* p, cudaStream_t stream);
// Split-K factor for this shape and variant: target2 / 2 CTAs per SM (0 = the variant's default: 2.5 per SM for
// variant 0, every resident slot for the others); reads the SM count and the occupancy calculator.
int sdq_w4a16_auto_splits(int m, int n, int k, int group_k16, int is_bf16, int variant, int target2);
// Resident CTAs per SM of the kernel the launcher would pick for (m, group, dtype, variant).
int sdq_w4a16_occupancy(int m, int group_k16, int is_bf16, int variant);
// Runs a tiny kernel that copies through cp.async with an L2::evict_first cache policy; 0 = it worked.
int sdq_probe_evict_first(cudaStream_t stream);
#ifdef __cplusplus
}
#endif
