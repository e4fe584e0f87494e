// The narrow-tile experiment's launcher interface (bench/narrow/), shared by its kernel file and its torch binding so
// that both see one parameter block (no torch headers here).
#pragma once
#include <cuda_runtime.h>

struct SdqNarrowParams {
  const void* a;       // x [m, k] activation dtype (rows 16-byte aligned), 1 <= m <= 8
  const void* b;       // weights, narrow layout int32 [n / 16, k / 64, 32, 4] (bench/narrow_tile.py narrow_from_cuda)
  const void* s;       // scales fp16 [G, n / 16, 8, 2]: half2 (row g8, row g8 + 8) of a tile, a lane
  const void* z;       // zeros (activation dtype) [G, n / 16, 8, 2], the same order
  void* out;           // y [m, n] activation dtype
  int m, n, k;
  int group_k16;       // group size / 16 (a multiple of 4: whole 64-K chunks)
  int variant;         // the CTA shape, see w4a16_narrow.cu
  int pdl;             // 0 plain launch; 1 programmatic dependent launch; 2 the same, next kernel let in after the wait
};

// 0 or a cudaError_t; -1: a shape, group or variant the kernel cannot run
extern "C" int sdq_narrow_launch(const SdqNarrowParams* p, int is_bf16, cudaStream_t stream);
