// Entry points of the attention forward kernel: head dim 128, MXFP8 Q·Kᵀ, native MMA (sm_120a/sm_121a; a trap on other targets).
// Torch-free; compiles standalone with nvcc or NVRTC into a cubin of its own (common/launch.h).
#include "attention/kernel.cuh"
#include "attention/mma_native.cuh"

NVFP4_DIT_ATTENTION_ENTRIES(native, MmaNative, mxfp8, QkFormatMxfp8, 128)
