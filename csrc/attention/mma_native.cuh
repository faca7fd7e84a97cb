// Native back-end: the block-scaled FP4 MMA of sm_120a / sm_121a (and the 8-bit one of MXFP8 Q·Kᵀ).
//   mma.sync.aligned.m16n8k64.row.col.kind::mxf4nvf4.block_scale.scale_vec::4X
//       .f32.e2m1.e2m1.f32.ue4m3
// (PTX ISA, "Warp-level block scaling"). Fragments, lane l = 4g + t, nibble i of a register:
//   a0 = A[g][8t+i], a1 = A[g+8][8t+i], a2 = A[g][32+8t+i], a3 = A[g+8][32+8t+i]
//   b0 = B[8t+i][g], b1 = B[32+8t+i][g]; c/d as SM80 m16n8 (row g: c0,c1; row g+8: c2,c3)
// Scales (4X): byte j of a scale register scales k in [16j, 16j+16).
//   SF_A: lane 4g + 2*kTidA gives row g, lane 4g + 2*kTidA + 1 gives row g+8.
//   SF_B: lane 4g + kTidB gives column g.
#pragma once
#include "common/portable.h"

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

  // The 8-bit Q·Kᵀ MMA: d += (A * SF_A) (B * SF_B), e4m3 x e4m3, one ue8m0 scale per row / column
  // for the whole k32; byte kByteId of the scale registers, lanes as for 4X.
  //   mma.sync.aligned.m16n8k32.row.col.kind::mxf8f6f4.block_scale.scale_vec::1X
  //       .f32.e4m3.e4m3.f32.ue8m0
  // Fragments (bytes of a register, k = 4t + i): a0 = A[g][k], a1 = A[g+8][k], a2 = A[g][16+k],
  // a3 = A[g+8][16+k]; b0 = B[k][g], b1 = B[16+k][g].
  template <int kTidA, int kTidB, int kByteId>
  static __device__ __forceinline__ void mma_mxfp8(float (&d)[4], const uint32_t (&a)[4],
                                                  const uint32_t (&b)[2], uint32_t sfa, uint32_t sfb) {
    static_assert(ScaleSelectors1X<kTidA, kTidB, kByteId>::kValid, "selector rules");
#if defined(NVFP4_DIT_NATIVE_MMA)
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.kind::mxf8f6f4.block_scale.scale_vec::1X"
        ".f32.e4m3.e4m3.f32.ue8m0 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3}, "
        "%10, {%11, %12}, %13, {%14, %15};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(sfa), "n"(kByteId),
          "n"(kTidA), "r"(sfb), "n"(kByteId), "n"(kTidB));
#else
    (void)d; (void)a; (void)b; (void)sfa; (void)sfb;
    __trap();
#endif
  }
};

}  // namespace nvfp4_dit
