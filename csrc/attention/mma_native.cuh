// Native back-end: the block-scaled FP4 MMA of sm_120a / sm_121a.
//   mma.sync.aligned.m16n8k64.row.col.kind::mxf4nvf4.block_scale.scale_vec::4X
//       .f32.e2m1.e2m1.f32.ue4m3
// (PTX ISA, "Warp-level block scaling"). Fragments, lane l = 4g + t, nibble i of a register:
//   a0 = A[g][8t+i], a1 = A[g+8][8t+i], a2 = A[g][32+8t+i], a3 = A[g+8][32+8t+i]
//   b0 = B[8t+i][g], b1 = B[32+8t+i][g]; c/d as SM80 m16n8 (row g: c0,c1; row g+8: c2,c3)
// Scales (4X): byte j of a scale register scales k in [16j, 16j+16).
//   SF_A: lane 4g + 2*kTidA gives row g, lane 4g + 2*kTidA + 1 gives row g+8.
//   SF_B: lane 4g + kTidB gives column g.
#pragma once
#include <cstdint>

#include "attention/mma_selectors.cuh"
#include "common/config.h"

namespace nvfp4_dit {

struct MmaNative {
  static constexpr const char* kName = "native";
  // True in the device pass that can issue the instruction; the kernel body is compiled only
  // there (the same TU also builds for sm_80/90 targets, where it becomes a trap).
#if defined(NVFP4_DIT_NATIVE_MMA)
  static constexpr bool kCompiledHere = true;
#else
  static constexpr bool kCompiledHere = false;
#endif

  // d += (A * SF_A) (B * SF_B). Selectors are immediates, so ptxas range-checks them too.
  template <int kTidA, int kTidB>
  static __device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4],
                                             const uint32_t (&b)[2], uint32_t sfa, uint32_t sfb) {
    static_assert(ScaleSelectors4X<kTidA, kTidB>::kValid, "selector rules");
#if defined(NVFP4_DIT_NATIVE_MMA)
    asm volatile(
        "mma.sync.aligned.m16n8k64.row.col.kind::mxf4nvf4.block_scale.scale_vec::4X"
        ".f32.e2m1.e2m1.f32.ue4m3 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3}, "
        "%10, {%11, %12}, %13, {%14, %15};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(sfa), "n"(0),
          "n"(kTidA), "r"(sfb), "n"(0), "n"(kTidB));
#else
    (void)d; (void)a; (void)b; (void)sfa; (void)sfb;
    __trap();
#endif
  }
};

}  // namespace nvfp4_dit
