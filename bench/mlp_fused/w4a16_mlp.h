// The batch-1 MLP experiment's launcher interface (bench/mlp_fused/), shared by its kernel file and its torch binding
// so that both see one parameter block (no torch headers here).
#pragma once
#include <cuda_runtime.h>

struct SdqMlpParams {
  const void* x;                                   // [m, k1] activation dtype (rows 16-byte aligned), m <= 8
  const void* b1; const void* s1; const void* z1;  // gate/up layout (repack_cuda): K = k1, N = n1, 64-feature blocks
                                                   // alternating gate, up
  const void* b2; const void* s2; const void* z2;  // down layout: K = n1 / 2, N = n2
  float* partial;                                  // [n1 / 128, m, n2] fp32
  void* out;                                       // [m, n2] activation dtype
  int m, k1, n1, n2;
  int g1_k16, g2_k16;                              // group sizes / 16 of the two layouts (>= 4, the chunk)
  int sum_v;                                       // the sum kernel: 0 8 partials a warp in flight, 1 all of them
  int pdl;                                         // 1: both launches with programmatic dependent launch
  int what;                                        // launch: 3 both kernels, 1 the MLP kernel only, 2 the sum only
};

// 0 or a cudaError_t; -1: a shape or group the kernels cannot run
extern "C" int sdq_mlp_launch(const SdqMlpParams* p, int is_bf16, cudaStream_t stream);
