// Back-end and head-dim dispatch of the attention forward kernel, plus the single-MMA probe the
// tests use to check the emulated back-end against a dense reference. Torch-free.
#include <array>
#include <cstdint>
#include <utility>

#include "attention/api.h"
#include "attention/mma_emulated.cuh"
#include "attention/mma_native.cuh"
#include "attention/qk_format.cuh"

namespace nvfp4_dit {

template <int kHeadDim, class QkFmt>
static cudaError_t attention_fwd_as(const AttentionFwdParams& p, bool with_lse, bool native, cudaStream_t stream) {
  if (native) {
    return with_lse ? launch_attention_fwd<kHeadDim, true, MmaNative, QkFmt>(p, stream)
                    : launch_attention_fwd<kHeadDim, false, MmaNative, QkFmt>(p, stream);
  }
  return with_lse ? launch_attention_fwd<kHeadDim, true, MmaEmulated, QkFmt>(p, stream)
                  : launch_attention_fwd<kHeadDim, false, MmaEmulated, QkFmt>(p, stream);
}

cudaError_t attention_fwd(const AttentionFwdParams& p, int head_dim, bool with_lse, bool native, QkFormat qk_format,
                          cudaStream_t stream) {
  return NVFP4_DIT_HEAD_DIM_SWITCH(head_dim, kHeadDim, [&] {
    switch (qk_format) {
      case QkFormat::kNvfp4: return attention_fwd_as<kHeadDim, QkNvfp4>(p, with_lse, native, stream);
      case QkFormat::kMxfp8: return attention_fwd_as<kHeadDim, QkMxfp8>(p, with_lse, native, stream);
    }
    return cudaErrorInvalidValue;
  }());
}

// The single-MMA probes: one warp runs one MMA of a back-end with given per-lane registers, for
// selector combination I (Fp4Probe: I = 4 * thread-id-a + thread-id-b, the 8 legal pairs of
// scale_vec::4X; Mxf8Probe: I = 16 * thread-id-a + 4 * thread-id-b + byte-id, the 32 of 1X).
template <class Mma>
struct Fp4Probe {
  static constexpr bool kCompiledHere = Mma::kCompiledHere;
  static constexpr int kCombinations = 8;
  template <int I>
  static __device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                                             uint32_t sfa, uint32_t sfb) {
    Mma::template mma<I / 4, I % 4>(d, a, b, sfa, sfb);
  }
};

template <class Mma>
struct Mxf8Probe {
  static constexpr bool kCompiledHere = Mma::kCompiledHere;
  static constexpr int kCombinations = 32;
  template <int I>
  static __device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                                             uint32_t sfa, uint32_t sfb) {
    Mma::template mma_mxf8<I / 16, (I / 4) % 4, I % 4>(d, a, b, sfa, sfb);
  }
};

template <class Probe, int I>
__global__ void mma_probe_kernel(const uint32_t* a, const uint32_t* b, const uint32_t* sfa, const uint32_t* sfb,
                                 const float* c, float* d) {
  if constexpr (Probe::kCompiledHere) {
    const int l = threadIdx.x;
    const uint32_t ra[4] = {a[4 * l], a[4 * l + 1], a[4 * l + 2], a[4 * l + 3]};
    const uint32_t rb[2] = {b[2 * l], b[2 * l + 1]};
    float acc[4] = {c[4 * l], c[4 * l + 1], c[4 * l + 2], c[4 * l + 3]};
    Probe::template mma<I>(acc, ra, rb, sfa[l], sfb[l]);
    for (int i = 0; i < 4; ++i) d[4 * l + i] = acc[i];
  } else {
    __trap();
  }
}

using ProbeKernel = void (*)(const uint32_t*, const uint32_t*, const uint32_t*, const uint32_t*, const float*, float*);

template <class Probe, int... I>
static constexpr std::array<ProbeKernel, sizeof...(I)> probe_table(std::integer_sequence<int, I...>) {
  return {&mma_probe_kernel<Probe, I>...};
}

template <template <class> class Probe>
static cudaError_t launch_probe(const uint32_t* a, const uint32_t* b, const uint32_t* sfa, const uint32_t* sfb,
                                const float* c, float* d, int i, bool native, cudaStream_t stream) {
  constexpr int n = Probe<MmaNative>::kCombinations;
  static constexpr auto kNative = probe_table<Probe<MmaNative>>(std::make_integer_sequence<int, n>{});
  static constexpr auto kEmulated = probe_table<Probe<MmaEmulated>>(std::make_integer_sequence<int, n>{});
  if (i < 0 || i >= n) return cudaErrorInvalidValue;
  (native ? kNative : kEmulated)[i]<<<1, 32, 0, stream>>>(a, b, sfa, sfb, c, d);
  return cudaGetLastError();
}

cudaError_t mma_fp4_probe(const uint32_t* a, const uint32_t* b, const uint32_t* sfa, const uint32_t* sfb,
                          const float* c, float* d, int tid_a, int tid_b, bool native, cudaStream_t stream) {
  if (tid_a < 0 || tid_a > 1 || tid_b < 0 || tid_b > 3) return cudaErrorInvalidValue;
  return launch_probe<Fp4Probe>(a, b, sfa, sfb, c, d, 4 * tid_a + tid_b, native, stream);
}

cudaError_t mma_mxf8_probe(const uint32_t* a, const uint32_t* b, const uint32_t* sfa, const uint32_t* sfb,
                           const float* c, float* d, int tid_a, int tid_b, int byte_id, bool native,
                           cudaStream_t stream) {
  if (tid_a < 0 || tid_a > 1 || tid_b < 0 || tid_b > 3 || byte_id < 0 || byte_id > 3) return cudaErrorInvalidValue;
  return launch_probe<Mxf8Probe>(a, b, sfa, sfb, c, d, 16 * tid_a + 4 * tid_b + byte_id, native, stream);
}

}  // namespace nvfp4_dit
