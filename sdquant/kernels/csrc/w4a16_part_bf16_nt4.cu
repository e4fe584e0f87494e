// Instantiates the W4A16 kernels for __nv_bfloat16 activations, 4 token tile(s) of 8 (see w4a16_kernel.cuh).
#include "w4a16_kernel.cuh"

SDQ_W4A16_PART(__nv_bfloat16, 4, bf16_nt4)
