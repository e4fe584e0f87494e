// Instantiates the W4A16 kernels for half activations, 2 token tile(s) of 8 (see w4a16_kernel.cuh).
#include "w4a16_kernel.cuh"

SDQ_W4A16_PART(half, 2, f16_nt2)
