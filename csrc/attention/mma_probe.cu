// The single-MMA probes the tests and the self-test use to check a back-end's MMA against a dense
// product (nvfp4_dit/selftest.py), and scripts/check_sass.py to read the selector encoding off the
// SASS. Torch-free; one cubin per target (common/launch.h names the entry points).
#include "attention/mma_emulated.cuh"
#include "attention/mma_native.cuh"
#include "common/portable.h"

namespace nvfp4_dit {

// The single-MMA probes: one warp runs one MMA of a back-end with given per-lane registers, for
// selector combination I (Nvfp4Probe: I = 4 * thread-id-a + thread-id-b, the 8 legal pairs of
// scale_vec::4X; Mxfp8Probe: I = 16 * thread-id-a + 4 * thread-id-b + byte-id, the 32 of 1X).
template <class Mma>
struct Nvfp4Probe {
  static constexpr bool kCompiledHere = Mma::kCompiledHere;
  static constexpr int kCombinations = 8;
  template <int I>
  static __device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                                             uint32_t sfa, uint32_t sfb) {
    Mma::template mma<I / 4, I % 4>(d, a, b, sfa, sfb);
  }
};

template <class Mma>
struct Mxfp8Probe {
  static constexpr bool kCompiledHere = Mma::kCompiledHere;
  static constexpr int kCombinations = 32;
  template <int I>
  static __device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                                             uint32_t sfa, uint32_t sfb) {
    Mma::template mma_mxfp8<I / 16, (I / 4) % 4, I % 4>(d, a, b, sfa, sfb);
  }
};

template <class Probe, int I>
__device__ __forceinline__ void mma_probe(const uint32_t* a, const uint32_t* b, const uint32_t* sfa, const uint32_t* sfb,
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

}  // namespace nvfp4_dit

// One entry point per back-end and selector combination I (the selectors are immediates).
#define NVFP4_DIT_PROBE_ENTRY(PROBE, NAME, MMA, KIND, I)                                                    \
  extern "C" __global__ void __launch_bounds__(32) nvfp4_dit_mma_probe_##NAME##_##KIND##_##I(              \
      const uint32_t* a, const uint32_t* b, const uint32_t* sfa, const uint32_t* sfb, const float* c, float* d) { \
    nvfp4_dit::mma_probe<nvfp4_dit::PROBE<nvfp4_dit::MMA>, I>(a, b, sfa, sfb, c, d);                        \
  }
#define NVFP4_DIT_PROBE_KINDS(PROBE, NAME, I)                  \
  NVFP4_DIT_PROBE_ENTRY(PROBE, NAME, MmaNative, native, I)     \
  NVFP4_DIT_PROBE_ENTRY(PROBE, NAME, MmaEmulated, emulated, I)
// Nvfp4Probe: I = 4 * thread-id-a + thread-id-b; Mxfp8Probe: I = 16 * thread-id-a + 4 * thread-id-b + byte-id.
NVFP4_DIT_PROBE_KINDS(Nvfp4Probe, nvfp4, 0) NVFP4_DIT_PROBE_KINDS(Nvfp4Probe, nvfp4, 1) NVFP4_DIT_PROBE_KINDS(Nvfp4Probe, nvfp4, 2) NVFP4_DIT_PROBE_KINDS(Nvfp4Probe, nvfp4, 3)
NVFP4_DIT_PROBE_KINDS(Nvfp4Probe, nvfp4, 4) NVFP4_DIT_PROBE_KINDS(Nvfp4Probe, nvfp4, 5) NVFP4_DIT_PROBE_KINDS(Nvfp4Probe, nvfp4, 6) NVFP4_DIT_PROBE_KINDS(Nvfp4Probe, nvfp4, 7)
NVFP4_DIT_PROBE_KINDS(Mxfp8Probe, mxfp8, 0) NVFP4_DIT_PROBE_KINDS(Mxfp8Probe, mxfp8, 1) NVFP4_DIT_PROBE_KINDS(Mxfp8Probe, mxfp8, 2) NVFP4_DIT_PROBE_KINDS(Mxfp8Probe, mxfp8, 3)
NVFP4_DIT_PROBE_KINDS(Mxfp8Probe, mxfp8, 4) NVFP4_DIT_PROBE_KINDS(Mxfp8Probe, mxfp8, 5) NVFP4_DIT_PROBE_KINDS(Mxfp8Probe, mxfp8, 6) NVFP4_DIT_PROBE_KINDS(Mxfp8Probe, mxfp8, 7)
NVFP4_DIT_PROBE_KINDS(Mxfp8Probe, mxfp8, 8) NVFP4_DIT_PROBE_KINDS(Mxfp8Probe, mxfp8, 9) NVFP4_DIT_PROBE_KINDS(Mxfp8Probe, mxfp8, 10) NVFP4_DIT_PROBE_KINDS(Mxfp8Probe, mxfp8, 11)
NVFP4_DIT_PROBE_KINDS(Mxfp8Probe, mxfp8, 12) NVFP4_DIT_PROBE_KINDS(Mxfp8Probe, mxfp8, 13) NVFP4_DIT_PROBE_KINDS(Mxfp8Probe, mxfp8, 14) NVFP4_DIT_PROBE_KINDS(Mxfp8Probe, mxfp8, 15)
NVFP4_DIT_PROBE_KINDS(Mxfp8Probe, mxfp8, 16) NVFP4_DIT_PROBE_KINDS(Mxfp8Probe, mxfp8, 17) NVFP4_DIT_PROBE_KINDS(Mxfp8Probe, mxfp8, 18) NVFP4_DIT_PROBE_KINDS(Mxfp8Probe, mxfp8, 19)
NVFP4_DIT_PROBE_KINDS(Mxfp8Probe, mxfp8, 20) NVFP4_DIT_PROBE_KINDS(Mxfp8Probe, mxfp8, 21) NVFP4_DIT_PROBE_KINDS(Mxfp8Probe, mxfp8, 22) NVFP4_DIT_PROBE_KINDS(Mxfp8Probe, mxfp8, 23)
NVFP4_DIT_PROBE_KINDS(Mxfp8Probe, mxfp8, 24) NVFP4_DIT_PROBE_KINDS(Mxfp8Probe, mxfp8, 25) NVFP4_DIT_PROBE_KINDS(Mxfp8Probe, mxfp8, 26) NVFP4_DIT_PROBE_KINDS(Mxfp8Probe, mxfp8, 27)
NVFP4_DIT_PROBE_KINDS(Mxfp8Probe, mxfp8, 28) NVFP4_DIT_PROBE_KINDS(Mxfp8Probe, mxfp8, 29) NVFP4_DIT_PROBE_KINDS(Mxfp8Probe, mxfp8, 30) NVFP4_DIT_PROBE_KINDS(Mxfp8Probe, mxfp8, 31)
