// Entry points of the attention forward kernel: head dim 128, MXFP8 Q·Kᵀ, emulated MMA (sm_80/sm_90: fp16 mma.sync from the same registers; a trap on other targets).
// Torch-free; compiles standalone with nvcc or NVRTC into a cubin of its own (common/launch.h).
#include "attention/kernel.cuh"
#include "attention/mma_emulated.cuh"

NVFP4_DIT_ATTENTION_ENTRIES(emulated, MmaEmulated, mxfp8, QkFormatMxfp8, 128)
