// Instantiates the W4A16 kernels for half activations, 1 token tile(s) of 8 (see w4a16_kernel.cuh).
#include "w4a16_kernel.cuh"

SDQ_W4A16_PART(half, 1, f16_nt1)
