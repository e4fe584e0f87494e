// Instantiates the tight W4A16 kernel with the fused decode-block prologue / epilogue for half activations, one
// token tile of 8 (see w4a16_tight.cuh and w4a16.h's SdqW4A16FusedParams).
#include "w4a16_kernel.cuh"

SDQ_W4A16_PART_FUSED(half, f16)
