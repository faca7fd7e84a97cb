// Emulated back-end (sm_80 / sm_90): takes the *same* registers as MmaNative::mma (packed e2m1
// A/B fragments, ue4m3 scale registers, selectors) and reproduces the block-scaled m16n8k64
// with four fp16 mma.sync.m16n8k16 steps. e2m1 x ue4m3 has at most 6 significant bits and lies
// in [2^-10, 2688], so the dequantised operands and their products are exact in fp16 and the
// MMA accumulates them in fp32.
//
// No data shuffles: in both the e2m1 k64 and the fp16 k16 fragment, which k a lane owns depends
// only on t = lane & 3 and is the same for A and B, so any per-thread relabelling of k that is
// consistent between A and B is exact. Step j = 2h + s (h = k half, s = nibble quad) uses
//   A reg0/reg2 = nibbles 4s..4s+1 / 4s+2..4s+3 of a[2h]   (row g)
//   A reg1/reg3 = the same nibbles of a[2h+1]             (row g+8)
//   B reg0/reg1 = nibbles 4s..4s+1 / 4s+2..4s+3 of b[h]
// All of this thread's k in step j lie in k-block kb = 2h + (t >> 1).
// Scales come from the lanes the selectors name (three quad shuffles).
#pragma once
#include "common/portable.h"
#include <cuda_fp16.h>

#include "attention/mma_selectors.cuh"
#include "common/config.h"

namespace nvfp4_dit {

namespace emu {

// Two e2m1 nibbles (low byte of v: element 0 low nibble) -> fp16x2 of value * 2^-14:
// magnitude bits e1 e0 m land in fp16 exponent[1:0] and mantissa[9], sign in bit 15.
__device__ __forceinline__ uint32_t e2m1x2_to_f16x2_scaled(uint32_t v) {
  const uint32_t u = (v & 0xFu) | ((v & 0xF0u) << 12);
  return ((u & 0x00070007u) << 9) | ((u & 0x00080008u) << 12);
}

__device__ __forceinline__ uint32_t hmul2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// ue4m3 byte -> fp16x2 {s, s}, exact: 7 bits << 7 is s * 2^-8 in fp16.
__device__ __forceinline__ uint32_t ue4m3_to_f16x2(uint32_t byte) {
  const uint32_t h = (byte & 0x7Fu) << 7;
  return hmul2(h | (h << 16), 0x5C005C00u);   // * 256 (0x5C00 = 256.0 in fp16)
}

// Dequantise a nibble pair: (nibbles * 2^-14) * 2^14 * s, each product exact.
__device__ __forceinline__ uint32_t dequant_pair(uint32_t v, uint32_t scale_f16x2) {
  return hmul2(hmul2(e2m1x2_to_f16x2_scaled(v), 0x74007400u), scale_f16x2);   // 0x7400 = 2^14
}

__device__ __forceinline__ void mma_f16_16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Two e4m3 bytes (element 0 in bits [7:0]) -> fp16x2, exact: the 7 magnitude bits shifted into
// an fp16 are the value times 2^-8 for normals and subnormals alike (as ue4m3_to_f16x2 does).
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t v) {
  const uint32_t u = (v & 0xFFu) | ((v & 0xFF00u) << 8);
  return hmul2(((u & 0x007F007Fu) << 7) | ((u & 0x00800080u) << 8), 0x5C005C00u);   // * 256
}

// ue8m0 byte -> 2^(byte - 127) as fp32 bits; byte 0 (2^-127, which a block only gets when all of
// its values are below 2^-118 of the head's largest) gives 0.
__device__ __forceinline__ float ue8m0_to_float(uint32_t byte) { return __uint_as_float((byte & 0xFFu) << 23); }

}  // namespace emu

struct MmaEmulated {
  static constexpr const char* kName = "emulated";
#if defined(NVFP4_DIT_EMULATED_MMA)
  static constexpr bool kCompiledHere = true;
#else
  static constexpr bool kCompiledHere = false;
#endif

  template <int kTidA, int kTidB>
  static __device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4],
                                             const uint32_t (&b)[2], uint32_t sfa, uint32_t sfb) {
    static_assert(ScaleSelectors4X<kTidA, kTidB>::kValid, "selector rules");
    const int lane = threadIdx.x & 31;
    const int quad = lane & ~3;
    const int t = lane & 3;
    const uint32_t sfa_row_g = __shfl_sync(0xFFFFFFFFu, sfa, quad | (2 * kTidA));
    const uint32_t sfa_row_g8 = __shfl_sync(0xFFFFFFFFu, sfa, quad | (2 * kTidA + 1));
    const uint32_t sfb_col_g = __shfl_sync(0xFFFFFFFFu, sfb, quad | kTidB);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int shift = 8 * (2 * h + (t >> 1));   // byte kb of the scale words
      const uint32_t sa0 = emu::ue4m3_to_f16x2((sfa_row_g >> shift) & 0xFFu);
      const uint32_t sa1 = emu::ue4m3_to_f16x2((sfa_row_g8 >> shift) & 0xFFu);
      const uint32_t sb = emu::ue4m3_to_f16x2((sfb_col_g >> shift) & 0xFFu);
#pragma unroll
      for (int s = 0; s < 2; ++s) {
        const uint32_t lo = a[2 * h] >> (16 * s), hi = a[2 * h + 1] >> (16 * s);
        const uint32_t bb = b[h] >> (16 * s);
        const uint32_t fa[4] = {emu::dequant_pair(lo, sa0), emu::dequant_pair(hi, sa1),
                                emu::dequant_pair(lo >> 8, sa0), emu::dequant_pair(hi >> 8, sa1)};
        const uint32_t fb[2] = {emu::dequant_pair(bb, sb), emu::dequant_pair(bb >> 8, sb)};
        emu::mma_f16_16816(d, fa, fb);
      }
    }
  }

  // The 8-bit Q·Kᵀ MMA (MmaNative::mma_mxfp8) from the same registers: e4m3 values are exact in
  // fp16, so two fp16 m16n8k16 steps give the unscaled k32 dot products exactly in fp32 products;
  // the ue8m0 scales (2^-127..2^127, beyond fp16) multiply the fp32 result. Step s takes bytes
  // 2s, 2s+1 of every register: k = 4t + 2s + e of A and B alike (a consistent relabelling).
  // Scales: rows g / g+8 from lanes quad + 2 kTidA (+1), columns 2t / 2t+1 from lanes 8t + kTidB
  // and 8t + 4 + kTidB (column c from lane 4c + kTidB), byte kByteId of each.
  template <int kTidA, int kTidB, int kByteId>
  static __device__ __forceinline__ void mma_mxfp8(float (&d)[4], const uint32_t (&a)[4],
                                                  const uint32_t (&b)[2], uint32_t sfa, uint32_t sfb) {
    static_assert(ScaleSelectors1X<kTidA, kTidB, kByteId>::kValid, "selector rules");
    const int lane = threadIdx.x & 31;
    const int quad = lane & ~3;
    const int t = lane & 3;
    const uint32_t sfa_row_g = __shfl_sync(0xFFFFFFFFu, sfa, quad | (2 * kTidA));
    const uint32_t sfa_row_g8 = __shfl_sync(0xFFFFFFFFu, sfa, quad | (2 * kTidA + 1));
    const uint32_t sfb_col_0 = __shfl_sync(0xFFFFFFFFu, sfb, 8 * t + kTidB);
    const uint32_t sfb_col_1 = __shfl_sync(0xFFFFFFFFu, sfb, 8 * t + 4 + kTidB);
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      const uint32_t fa[4] = {emu::e4m3x2_to_f16x2(a[0] >> (16 * s)), emu::e4m3x2_to_f16x2(a[1] >> (16 * s)),
                              emu::e4m3x2_to_f16x2(a[2] >> (16 * s)), emu::e4m3x2_to_f16x2(a[3] >> (16 * s))};
      const uint32_t fb[2] = {emu::e4m3x2_to_f16x2(b[0] >> (16 * s)), emu::e4m3x2_to_f16x2(b[1] >> (16 * s))};
      emu::mma_f16_16816(acc, fa, fb);
    }
    constexpr int kShift = 8 * kByteId;
    const float sg = emu::ue8m0_to_float(sfa_row_g >> kShift), sg8 = emu::ue8m0_to_float(sfa_row_g8 >> kShift);
    const float s0 = emu::ue8m0_to_float(sfb_col_0 >> kShift), s1 = emu::ue8m0_to_float(sfb_col_1 >> kShift);
    d[0] = fmaf(acc[0], sg * s0, d[0]);
    d[1] = fmaf(acc[1], sg * s1, d[1]);
    d[2] = fmaf(acc[2], sg8 * s0, d[2]);
    d[3] = fmaf(acc[3], sg8 * s1, d[3]);
  }
};

}  // namespace nvfp4_dit
