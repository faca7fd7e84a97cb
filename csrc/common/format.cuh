// NVFP4 format primitives on the device: the CUDA twin of nvfp4_dit/format.py.
//
// Every function here must give the same bits as its Python counterpart (tests compare the
// quantize kernel's bytes with format.py exactly).  Where the target has the conversion in
// hardware (sm_100a/sm_120a/sm_121a: cvt ... e2m1x2; sm_89+: cvt ... e4m3x2) we use it; the
// software paths are written to round identically (nearest, ties to even, satfinite).
//
// Torch-free: included by kernel translation units that compile standalone with nvcc.
#pragma once

#include "common/portable.h"
#include <cuda_fp16.h>

namespace nvfp4_dit {

// e2m1 conversions exist on the arch-specific Blackwell targets only (PTX ISA, cvt; nvcc 13.0
// rejects them for plain sm_120 and for sm_90a).
#if defined(__CUDA_ARCH_FEAT_SM120_ALL) || defined(__CUDA_ARCH_FEAT_SM121_ALL) || \
    defined(__CUDA_ARCH_FEAT_SM100_ALL) ||                                        \
    (defined(__CUDA_ARCH_SPECIFIC__) && (__CUDA_ARCH_SPECIFIC__ == 1200 || __CUDA_ARCH_SPECIFIC__ == 1210)) || \
    (defined(__CUDA_ARCH_FAMILY_SPECIFIC__) && (__CUDA_ARCH_FAMILY_SPECIFIC__ >= 1000))
#define NVFP4_DIT_NATIVE_E2M1_CVT 1
#else
#define NVFP4_DIT_NATIVE_E2M1_CVT 0
#endif

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 890)
#define NVFP4_DIT_NATIVE_E4M3_CVT 1
#else
#define NVFP4_DIT_NATIVE_E4M3_CVT 0
#endif

__host__ __device__ __forceinline__ uint32_t float_bits(float x) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(x);
#else
  uint32_t u;
  memcpy(&u, &x, sizeof(u));
  return u;
#endif
}

__host__ __device__ __forceinline__ float bits_float(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float x;
  memcpy(&x, &u, sizeof(x));
  return x;
#endif
}

// 2^exponent for exponent in [-126, 127], built from its bits (exact).
__host__ __device__ __forceinline__ float power_of_two(int exponent) {
  return bits_float(uint32_t(exponent + 127) << 23);
}

constexpr float kE2m1Max = 6.0f;
constexpr float kE4m3Max = 448.0f;
constexpr float kPRange = 2688.0f;  // 448 * 6: unnormalised P lives in [0, kPRange]
constexpr int kBlock = 16;          // elements per scale block

// ---------------------------------------------------------------------------------------------
// e2m1
// ---------------------------------------------------------------------------------------------

// One e2m1 code (low 4 bits): nearest, ties to the even code, saturating at 6; the sign bit
// follows signbit(x); NaN gives code 0.  Matches format.e2m1_encode.
__host__ __device__ __forceinline__ uint32_t float_to_e2m1_sw(float x) {
  const float a = fabsf(x);
  // At each midpoint the even code wins: <= rounds down to an even code, < rounds up to one.
  const uint32_t code = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) +
                        (a >= 3.5f) + (a > 5.0f);
  const uint32_t sign = (signbit(x) && !isnan(x)) ? 8u : 0u;
  return code | sign;
}

// Eight floats to one 32-bit word of e2m1 nibbles, element i in bits [4i+3:4i].
__device__ __forceinline__ uint32_t pack8_e2m1(const float (&v)[8]) {
#if NVFP4_DIT_NATIVE_E2M1_CVT
  uint32_t out;
  // cvt ... e2m1x2 d, a, b puts cvt(a) in the high nibble and cvt(b) in the low one.
  asm("{\n"
      ".reg .b8 b0, b1, b2, b3;\n"
      "cvt.rn.satfinite.e2m1x2.f32 b0, %2, %1;\n"
      "cvt.rn.satfinite.e2m1x2.f32 b1, %4, %3;\n"
      "cvt.rn.satfinite.e2m1x2.f32 b2, %6, %5;\n"
      "cvt.rn.satfinite.e2m1x2.f32 b3, %8, %7;\n"
      "mov.b32 %0, {b0, b1, b2, b3};\n"
      "}\n"
      : "=r"(out)
      : "f"(v[0]), "f"(v[1]), "f"(v[2]), "f"(v[3]), "f"(v[4]), "f"(v[5]), "f"(v[6]), "f"(v[7]));
  return out;
#else
  uint32_t out = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) out |= float_to_e2m1_sw(v[i]) << (4 * i);
  return out;
#endif
}

// e2m1 code (low 4 bits) to float.
__host__ __device__ __forceinline__ float e2m1_to_float(uint32_t code) {
  const uint32_t e = (code >> 1) & 3u, m = code & 1u;
  const float mag = e ? (1.0f + 0.5f * m) * float(1u << e) * 0.5f : 0.5f * m;
  return (code & 8u) ? -mag : mag;
}

// Two e2m1 codes (bits [3:0] -> .x, bits [7:4] -> .y) to an exact half2.
__device__ __forceinline__ __half2 e2m1x2_to_half2(uint32_t byte) {
#if NVFP4_DIT_NATIVE_E2M1_CVT
  uint32_t out;
  asm("{\n.reg .b8 b;\nmov.b32 {b, _, _, _}, %1;\ncvt.rn.f16x2.e2m1x2 %0, b;\n}\n"
      : "=r"(out)
      : "r"(byte));
  return *reinterpret_cast<__half2*>(&out);
#else
  // Put sign|exp|mantissa of each nibble at fp16 bits 15 and 11..9: the exponent field then reads
  // e (bias 15) and an e = 0 code becomes the matching fp16 subnormal, so one exact multiply by
  // 2^14 rebases it to e2m1's bias of 1.
  const uint32_t lo = byte & 0xFu, hi = (byte >> 4) & 0xFu;
  const uint32_t bits = ((lo & 8u) << 12) | ((lo & 7u) << 9) | ((hi & 8u) << 28) | ((hi & 7u) << 25);
  const __half2 raw = *reinterpret_cast<const __half2*>(&bits);
  return __hmul2(raw, __float2half2_rn(16384.0f));
#endif
}

// ---------------------------------------------------------------------------------------------
// ue4m3 / e4m3fn scales
// ---------------------------------------------------------------------------------------------

// float -> e4m3fn bits: nearest even, satfinite (|x| > 448 and inf -> 448), NaN -> 0x7F.
// Matches format.e4m3_encode.
__host__ __device__ __forceinline__ uint32_t float_to_e4m3_sw(float x) {
  if (isnan(x)) return 0x7Fu;
  const uint32_t sign = signbit(x) ? 0x80u : 0u;
  const float a = fminf(fabsf(x), kE4m3Max);
  if (a < 0.015625f) {
    // Subnormal range: value m * 2^-9; scaling by 2^9 is exact and rintf rounds half to even.
    // m == 8 is the smallest normal, whose encoding 0x08 is also m.
    return sign | static_cast<uint32_t>(rintf(a * 512.0f));
  }
  uint32_t bits = float_bits(a);
  bits += 0x7FFFFu + ((bits >> 20) & 1u);  // round the fp32 mantissa to 3 bits, ties to even
  const uint32_t exp = (bits >> 23) - 127u + 7u;
  const uint32_t mant = (bits >> 20) & 7u;
  return sign | (exp << 3) | mant;
}

__device__ __forceinline__ uint32_t float_to_e4m3(float x) {
#if NVFP4_DIT_NATIVE_E4M3_CVT
  uint16_t out;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(out) : "f"(0.0f), "f"(x));
  return out & 0xFFu;
#else
  return float_to_e4m3_sw(x);
#endif
}

// Two floats to two e4m3 bytes: lo -> bits [7:0], hi -> bits [15:8].
__device__ __forceinline__ uint32_t float2_to_e4m3x2(float lo, float hi) {
#if NVFP4_DIT_NATIVE_E4M3_CVT
  uint16_t out;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(out) : "f"(hi), "f"(lo));
  return out;
#else
  return float_to_e4m3_sw(lo) | (float_to_e4m3_sw(hi) << 8);
#endif
}

__host__ __device__ __forceinline__ float e4m3_to_float(uint32_t b) {
  const uint32_t e = (b >> 3) & 15u, m = b & 7u;
  float mag;
  if ((b & 0x7Fu) == 0x7Fu) {
    mag = bits_float(0x7FC00000u);  // NaN
  } else if (e == 0) {
    mag = float(m) * 0.001953125f;  // m * 2^-9
  } else {
    mag = bits_float(((e + 120u) << 23) | (m << 20));
  }
  return (b & 0x80u) ? -mag : mag;
}

// The scale of one block: e4m3(amax / 6), with an IEEE division so the bits match torch.
__host__ __device__ __forceinline__ float block_scale_value(float amax, uint32_t* bits_out) {
#ifdef __CUDA_ARCH__
  const uint32_t bits = float_to_e4m3(__fdiv_rn(amax, kE2m1Max));
#else
  const uint32_t bits = float_to_e4m3_sw(amax / kE2m1Max);
#endif
  *bits_out = bits;
  return e4m3_to_float(bits);
}

// ---------------------------------------------------------------------------------------------
// Tensor scales and the channel balance (format.tensor_scale, format.channel_balance)
// ---------------------------------------------------------------------------------------------

constexpr int kBalanceMaxExponent = 64;

// The smallest power of two t with absmax / t <= 2688, in [2^-126, 2^127]; 1 for 0 or non-finite.
// 2688 = 0.65625 * 2^12, so with absmax = m * 2^e (m in [0.5, 1)) the exponent is
// e - 12 + (m > 0.65625): integers only, as in format.py. tensor_scale_exponent gives log2 t.
__host__ __device__ __forceinline__ int tensor_scale_exponent(float absmax) {
  if (!(absmax > 0.0f) || !(absmax <= 3.4028234663852886e38f)) return 0;
  int e;
  const float m = frexpf(absmax, &e);
  const int exponent = e - 12 + (m > 0.65625f ? 1 : 0);
  return exponent < -126 ? -126 : (exponent > 127 ? 127 : exponent);
}

__host__ __device__ __forceinline__ float tensor_scale(float absmax) {
  return power_of_two(tensor_scale_exponent(absmax));
}

// The channel balance s_c of one channel from its statistics and the head's maxima over
// channels (format.channel_balance): 2^e with 2^(2e-1) <= r < 2^(2e+1),
// r = (amax_k * top_q) / (amax_q * top_k), the products exact in fp64.
__host__ __device__ __forceinline__ float channel_balance(float amax_q, float amax_k, float top_q, float top_k) {
  const double num = double(amax_k) * double(top_q), den = double(amax_q) * double(top_k);
  const double kMax = 1.7976931348623157e308;
  if (!(num > 0.0) || !(den > 0.0) || !(num <= kMax) || !(den <= kMax)) return 1.0f;
  int en, ed;
  const double mn = frexp(num, &en), md = frexp(den, &ed);
  const int floor_log2 = en - ed - (mn < md ? 1 : 0);
  // floor((n + 1) / 2) for negative n too
  int exponent = (floor_log2 + 1) >= 0 ? (floor_log2 + 1) / 2 : -((-(floor_log2 + 1) + 1) / 2);
  exponent = exponent < -kBalanceMaxExponent ? -kBalanceMaxExponent
                                             : (exponent > kBalanceMaxExponent ? kBalanceMaxExponent : exponent);
  return power_of_two(exponent);
}

// ---------------------------------------------------------------------------------------------
// MXFP8 Q/K (format.quantize_mx_blocks): e4m3 data, one ue8m0 scale per 32 elements
// ---------------------------------------------------------------------------------------------

constexpr int kMxBlock = 32;
constexpr int kUe8m0Bias = 127;

// The ue8m0 byte of a block with largest magnitude amax: 2^e with e the smallest integer such
// that amax / 2^e <= 448. 448 = 0.875 * 2^9, so with amax = m * 2^E (m in [0.5, 1))
// e = E - 9 + (m > 0.875), clamped to [-127, 127]; byte e + 127; 0 for a zero or non-finite block.
__host__ __device__ __forceinline__ uint32_t ue8m0_scale_byte(float amax) {
  if (!(amax > 0.0f) || !(amax <= 3.4028234663852886e38f)) return 0u;
  int e;
  const float m = frexpf(amax, &e);
  int exponent = e - 9 + (m > 0.875f ? 1 : 0);
  exponent = exponent < -kUe8m0Bias ? -kUe8m0Bias : (exponent > kUe8m0Bias ? kUe8m0Bias : exponent);
  return uint32_t(exponent + kUe8m0Bias);
}

// 2^(byte - 127) as a float (byte 0 is 2^-127, an fp32 subnormal).
__host__ __device__ __forceinline__ float ue8m0_to_float(uint32_t byte) {
  return byte == 0 ? bits_float(0x00400000u) : bits_float(byte << 23);
}

// x / scale for quantisation (IEEE division; a zero scale gives 0 so the block is all-zero).
__host__ __device__ __forceinline__ float scale_for_e2m1(float x, float scale) {
#ifdef __CUDA_ARCH__
  return scale == 0.0f ? 0.0f : __fdiv_rn(x, scale);
#else
  return scale == 0.0f ? 0.0f : x / scale;
#endif
}

}  // namespace nvfp4_dit
