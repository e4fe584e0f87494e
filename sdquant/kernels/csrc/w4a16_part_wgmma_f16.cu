// Instantiates the wgmma W4A16 kernel (variants 62-63) for half activations (see w4a16_wgmma.cuh).
#include "w4a16_wgmma.cuh"

SDQ_W4A16_WGMMA_PART(half, wgmma_f16)
