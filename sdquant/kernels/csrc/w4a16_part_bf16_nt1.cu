// Instantiates the W4A16 kernels for __nv_bfloat16 activations, 1 token tile(s) of 8 (see w4a16_kernel.cuh).
#include "w4a16_kernel.cuh"

SDQ_W4A16_PART(__nv_bfloat16, 1, bf16_nt1)
