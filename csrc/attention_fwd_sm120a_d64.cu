// Instantiations of the attention forward kernel: head dim 64, native block-scaled FP4 MMA (sm_120a/sm_121a; a trap on other targets).
// Torch-free; compiles standalone with nvcc. The only place this back-end meets this head dim.
#include "attention/launcher.cuh"
#include "attention/mma_sm120a.cuh"

namespace nvfp4_attn {
template cudaError_t launch_attention_fwd<64, false, MmaSm120a>(AttentionFwdParams, cudaStream_t);
template cudaError_t launch_attention_fwd<64, true, MmaSm120a>(AttentionFwdParams, cudaStream_t);
}  // namespace nvfp4_attn
