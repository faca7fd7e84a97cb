// Torch-free entry points of the attention kernel, called by csrc/attention_binding.cpp.
// The back-end is picked here by name; the instantiations live in csrc/attention_fwd_*.cu.
#pragma once
#include <cuda_runtime_api.h>

#include "attention/params.h"

namespace nvfp4_dit {

template <int kHeadDim, bool kWithLse, class Mma, class QkFmt>
cudaError_t launch_attention_fwd(AttentionFwdParams p, cudaStream_t stream);

// Q·Kᵀ operand formats (nvfp4_dit/format.py QK_FORMATS, in that order).
enum class QkFormat : int { kNvfp4 = 0, kMxfp8 = 1 };

// head_dim: 64 or 128 (padded). native: the sm_120a/121a block-scaled MMA; otherwise the
// fp16-emulated back-end (sm_80/90). Returns cudaErrorInvalidValue for other head dims or formats.
cudaError_t attention_fwd(const AttentionFwdParams& p, int head_dim, bool with_lse, bool native, QkFormat qk_format,
                          cudaStream_t stream);

// Test probe: one warp runs a single m16n8k64 block-scaled MMA of the chosen back-end with the
// given per-lane registers (a: 32x4, b: 32x2, sfa, sfb: 32, c/d: 32x4; device pointers).
cudaError_t mma_fp4_probe(const uint32_t* a, const uint32_t* b, const uint32_t* sfa, const uint32_t* sfb,
                          const float* c, float* d, int tid_a, int tid_b, bool native, cudaStream_t stream);

// The same for one m16n8k32 8-bit MMA (kind::mxf8f6f4, e4m3, ue8m0 scale_vec::1X) with byte-id.
cudaError_t mma_mxf8_probe(const uint32_t* a, const uint32_t* b, const uint32_t* sfa, const uint32_t* sfb,
                           const float* c, float* d, int tid_a, int tid_b, int byte_id, bool native,
                           cudaStream_t stream);

}  // namespace nvfp4_dit
