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

// The 8-bit probe: one m16n8k32 kind::mxf8f6f4 MMA (MmaNative::mma_mxf8 / MmaEmulated::mma_mxf8)
// for selectors I = 16 * thread-id-a + 4 * thread-id-b + byte-id.
template <class Mma, int I>
__global__ void mma_mxf8_probe_kernel(const uint32_t* a, const uint32_t* b, const uint32_t* sfa,
                                      const uint32_t* sfb, const float* c, float* d) {
  if constexpr (Mma::kCompiledHere) {
    const int l = threadIdx.x;
    const uint32_t ra[4] = {a[4 * l], a[4 * l + 1], a[4 * l + 2], a[4 * l + 3]};
    const uint32_t rb[2] = {b[2 * l], b[2 * l + 1]};
    float acc[4] = {c[4 * l], c[4 * l + 1], c[4 * l + 2], c[4 * l + 3]};
    Mma::template mma_mxf8<I / 16, (I / 4) % 4, I % 4>(acc, ra, rb, sfa[l], sfb[l]);
    for (int i = 0; i < 4; ++i) d[4 * l + i] = acc[i];
  } else {
    __trap();
  }
}

using Mxf8ProbeKernel = void (*)(const uint32_t*, const uint32_t*, const uint32_t*, const uint32_t*, const float*,
                                 float*);

template <class Mma, int... I>
static constexpr std::array<Mxf8ProbeKernel, sizeof...(I)> mxf8_probe_table(std::integer_sequence<int, I...>) {
  return {&mma_mxf8_probe_kernel<Mma, I>...};
}

cudaError_t mma_mxf8_probe(const uint32_t* a, const uint32_t* b, const uint32_t* sfa, const uint32_t* sfb,
                           const float* c, float* d, int tid_a, int tid_b, int byte_id, bool native,
                           cudaStream_t stream) {
  if (tid_a < 0 || tid_a > 1 || tid_b < 0 || tid_b > 3 || byte_id < 0 || byte_id > 3) return cudaErrorInvalidValue;
  static constexpr auto kNative = mxf8_probe_table<MmaNative>(std::make_integer_sequence<int, 32>{});
  static constexpr auto kEmulated = mxf8_probe_table<MmaEmulated>(std::make_integer_sequence<int, 32>{});
  const int i = 16 * tid_a + 4 * tid_b + byte_id;
  (native ? kNative : kEmulated)[i]<<<1, 32, 0, stream>>>(a, b, sfa, sfb, c, d);
  return cudaGetLastError();
}

cudaError_t mma_fp4_probe(const uint32_t* a, const uint32_t* b, const uint32_t* sfa, const uint32_t* sfb,
                          const float* c, float* d, int tid_a, int tid_b, bool native, cudaStream_t stream) {
  if (tid_a < 0 || tid_a > 1 || tid_b < 0 || tid_b > 3) return cudaErrorInvalidValue;
  return native ? probe_dispatch<MmaNative>(a, b, sfa, sfb, c, d, tid_a, tid_b, stream)
                : probe_dispatch<MmaEmulated>(a, b, sfa, sfb, c, d, tid_a, tid_b, stream);
}

}  // namespace nvfp4_dit
