// Instantiations of the attention forward kernel: head dim 128, NVFP4 Q·Kᵀ, native block-scaled MMA (sm_120a/sm_121a; a trap on other targets).
// Torch-free; compiles standalone with nvcc. The only place this back-end meets this head dim and format.
#include "attention/launcher.cuh"
#include "attention/mma_native.cuh"

namespace nvfp4_dit {
template cudaError_t launch_attention_fwd<128, false, MmaNative, QkNvfp4>(AttentionFwdParams, cudaStream_t);
template cudaError_t launch_attention_fwd<128, true, MmaNative, QkNvfp4>(AttentionFwdParams, cudaStream_t);
}  // namespace nvfp4_dit
