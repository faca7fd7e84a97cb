// Instantiations of the attention forward kernel: head dim 128, MXFP8 Q·Kᵀ, fp16-emulated MMA (sm_80/sm_90; a trap on other targets).
// Torch-free; compiles standalone with nvcc. The only place this back-end meets this head dim and format.
#include "attention/launcher.cuh"
#include "attention/mma_emulated.cuh"

namespace nvfp4_dit {
template cudaError_t launch_attention_fwd<128, false, MmaEmulated, QkMxfp8>(AttentionFwdParams, cudaStream_t);
template cudaError_t launch_attention_fwd<128, true, MmaEmulated, QkMxfp8>(AttentionFwdParams, cudaStream_t);
}  // namespace nvfp4_dit
