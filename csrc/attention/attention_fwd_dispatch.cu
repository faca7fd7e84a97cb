// Back-end and head-dim dispatch of the attention forward kernel, plus the single-MMA probe the
// tests use to check the emulated back-end against a dense reference. Torch-free.
#include <cstdint>

#include "attention/api.h"
#include "attention/mma_emulated.cuh"
#include "attention/mma_native.cuh"

namespace nvfp4_dit {

cudaError_t attention_fwd(const AttentionFwdParams& p, int head_dim, bool with_lse, bool native,
                          cudaStream_t stream) {
  return NVFP4_DIT_HEAD_DIM_SWITCH(head_dim, kHeadDim, [&] {
    if (native) {
      return with_lse ? launch_attention_fwd<kHeadDim, true, MmaNative>(p, stream)
                      : launch_attention_fwd<kHeadDim, false, MmaNative>(p, stream);
    }
    return with_lse ? launch_attention_fwd<kHeadDim, true, MmaEmulated>(p, stream)
                    : launch_attention_fwd<kHeadDim, false, MmaEmulated>(p, stream);
  }());
}

template <class Mma, int kTidA, int kTidB>
__global__ void mma_fp4_probe_kernel(const uint32_t* a, const uint32_t* b, const uint32_t* sfa,
                                     const uint32_t* sfb, const float* c, float* d) {
  if constexpr (Mma::kCompiledHere) {
    const int l = threadIdx.x;
    const uint32_t ra[4] = {a[4 * l], a[4 * l + 1], a[4 * l + 2], a[4 * l + 3]};
    const uint32_t rb[2] = {b[2 * l], b[2 * l + 1]};
    float acc[4] = {c[4 * l], c[4 * l + 1], c[4 * l + 2], c[4 * l + 3]};
    Mma::template mma<kTidA, kTidB>(acc, ra, rb, sfa[l], sfb[l]);
    for (int i = 0; i < 4; ++i) d[4 * l + i] = acc[i];
  } else {
    __trap();
  }
}

template <class Mma, int kTidA, int kTidB>
static cudaError_t launch_probe(const uint32_t* a, const uint32_t* b, const uint32_t* sfa, const uint32_t* sfb,
                                const float* c, float* d, cudaStream_t stream) {
  mma_fp4_probe_kernel<Mma, kTidA, kTidB><<<1, 32, 0, stream>>>(a, b, sfa, sfb, c, d);
  return cudaGetLastError();
}

template <class Mma>
static cudaError_t probe_dispatch(const uint32_t* a, const uint32_t* b, const uint32_t* sfa, const uint32_t* sfb,
                                  const float* c, float* d, int tid_a, int tid_b, cudaStream_t stream) {
  // Every legal selector pair (PTX Table 37 for scale_vec::4X): thread-id-a 0..1, thread-id-b 0..3.
  switch (tid_a * 4 + tid_b) {
    case 0: return launch_probe<Mma, 0, 0>(a, b, sfa, sfb, c, d, stream);
    case 1: return launch_probe<Mma, 0, 1>(a, b, sfa, sfb, c, d, stream);
    case 2: return launch_probe<Mma, 0, 2>(a, b, sfa, sfb, c, d, stream);
    case 3: return launch_probe<Mma, 0, 3>(a, b, sfa, sfb, c, d, stream);
    case 4: return launch_probe<Mma, 1, 0>(a, b, sfa, sfb, c, d, stream);
    case 5: return launch_probe<Mma, 1, 1>(a, b, sfa, sfb, c, d, stream);
    case 6: return launch_probe<Mma, 1, 2>(a, b, sfa, sfb, c, d, stream);
    case 7: return launch_probe<Mma, 1, 3>(a, b, sfa, sfb, c, d, stream);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t mma_fp4_probe(const uint32_t* a, const uint32_t* b, const uint32_t* sfa, const uint32_t* sfb,
                          const float* c, float* d, int tid_a, int tid_b, bool native, cudaStream_t stream) {
  if (tid_a < 0 || tid_a > 1 || tid_b < 0 || tid_b > 3) return cudaErrorInvalidValue;
  return native ? probe_dispatch<MmaNative>(a, b, sfa, sfb, c, d, tid_a, tid_b, stream)
                : probe_dispatch<MmaEmulated>(a, b, sfa, sfb, c, d, tid_a, tid_b, stream);
}

}  // namespace nvfp4_dit
