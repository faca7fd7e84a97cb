// Per-element arithmetic of the quantize kernel that is faster than, and provably equal to, the
// reference formulation in common/format.cuh. __host__ __device__ so that
// tests/test_quantize.py can check the equalities exhaustively on the host.
//
// 1. Division by a block scale: common/exact_division.cuh (shared with the attention kernel).
// 2. e2m1 encoding of the quotient by three fp32 roundings and a 3-way min instead of seven
//    comparisons (e2m1_code_biased); the host test checks every fp32 value in [0, 7).
// Torch-free and self-contained apart from common/format.cuh.
#pragma once

#include "common/portable.h"

#include <cuda_fp16.h>

#include "common/exact_division.cuh"
#include "common/format.cuh"
#include "quantize/params.h"

namespace nvfp4_dit {

// e2m1 magnitude code of a quotient 0 <= q < 7 (not NaN), nearest with ties to the even code
// (saturation at 6 is the caller's clamp), as a float bit pattern 0x4B000000 + code.
// e2m1's grid has spacing 0.5 below 2, 1 on [2, 4) and 2 from 4, so code = the least of
// RNE(2q), 2 + RNE(q) and 4 + RNE(q / 2) (each exact where its spacing holds, larger elsewhere;
// rounding is monotone, so the least of the rounded values is the rounded least). Each term is one
// fp32 operation that adds 2^23, whose ulp is 1, so the operation itself rounds to an integer with
// ties to even: ties land on even codes exactly as e2m1's. Three FP32 operations and one 3-way
// integer min of the bit patterns (VIMNMX3 on sm_90), where a comparison-based or exponent-based
// encoder needs six or more integer-pipe operations. The host test checks every fp32 q in [0, 7).
constexpr float kTwoPow23 = 8388608.0f;
constexpr uint32_t kBiasedCodeBits = 0x4B000000u;  // float_bits(kTwoPow23)

NVFP4_DIT_HD uint32_t umin3(uint32_t a, uint32_t b, uint32_t c) {
#ifdef __CUDA_ARCH__
  return __vimin3_u32(a, b, c);
#else
  return a < b ? (a < c ? a : c) : (b < c ? b : c);
#endif
}

NVFP4_DIT_HD uint32_t e2m1_code_biased(float q) {
  const uint32_t fine = nvfp4_dit::float_bits(rn_fma(q, 2.0f, kTwoPow23));          // RNE(2q)
  const uint32_t middle = nvfp4_dit::float_bits(rn_add(q, kTwoPow23 + 2.0f));        // 2 + RNE(q)
  const uint32_t coarse = nvfp4_dit::float_bits(rn_fma(q, 0.5f, kTwoPow23 + 4.0f));  // 4 + RNE(q/2)
  return umin3(fine, middle, coarse);
}

// Quotients |v| / sf of a block stay below 7 (e2m1_code_biased's domain) except
//  * when the scale saturated at 448 (amax above this, or inf/NaN), and
//  * for the two coarsest subnormal scales, bytes 1 and 2 (2^-9, 2^-8): rounding amax / 6 to
//    a multiple of 2^-9 can lower it by a third there, so quotients reach 9 (byte 1) or 7.5
//    (byte 2). From byte 3 on the bound is 6 * 3.5 / 3 = 7, exclusive (3.5 rounds to 4, even),
//    and for normal scales 6 / (1 - 2^-4) = 6.4.
// Those blocks take the clamped IEEE path. (Found by the GPU fuzz: head dims such as 17 leave
// blocks of one element, whose small |x - mean| lands on these scales.)
constexpr uint32_t kLastCoarseScaleByte = 2;

NVFP4_DIT_HD uint32_t byte_perm(uint32_t a, uint32_t b, uint32_t selector) {
#ifdef __CUDA_ARCH__
  return __byte_perm(a, b, selector);
#else
  const uint64_t bytes = (uint64_t(b) << 32) | a;
  uint32_t out = 0;
  for (int i = 0; i < 4; ++i) out |= uint32_t((bytes >> (8 * ((selector >> (4 * i)) & 7u))) & 0xFFu) << (8 * i);
  return out;
#endif
}

// sum_i (kBiasedCodeBits << 4i) mod 2^32 over i = 0..7: what the biased codes leave in a packed
// word (the terms from i = 2 on have no bits below 2^32).
constexpr uint32_t kBiasedPackOffset = kBiasedCodeBits + (kBiasedCodeBits << 4);

// Eight biased codes (e2m1_code_biased) and the values they came from -> one word of nibbles,
// element i in bits [4i+3:4i], sign bit = signbit(v[i]) (format.e2m1_encode; -0 included).
// The magnitudes are combined by shift-adds of the whole biased words (multiply-adds, which the
// FMA pipe can take) and the sum of the biases subtracted once: modulo 2^32 it is a constant.
// The signs are gathered bytewise: the top byte of v[2j+1] lands in byte j (sign at bit 8j+7),
// that of v[2j] likewise and shifted down by 4 (bit 8j+3).
NVFP4_DIT_HD uint32_t pack8_biased_codes_signs(const uint32_t (&code)[8], const float (&v)[8]) {
  uint32_t mag = code[7];
#pragma unroll
  for (int i = 6; i >= 0; --i) mag = mag * 16u + code[i];
  mag -= kBiasedPackOffset;
  const uint32_t odd = byte_perm(byte_perm(nvfp4_dit::float_bits(v[1]), nvfp4_dit::float_bits(v[3]), 0x7733u),
                                 byte_perm(nvfp4_dit::float_bits(v[5]), nvfp4_dit::float_bits(v[7]), 0x7733u), 0x6420u);
  const uint32_t even = byte_perm(byte_perm(nvfp4_dit::float_bits(v[0]), nvfp4_dit::float_bits(v[2]), 0x7733u),
                                  byte_perm(nvfp4_dit::float_bits(v[4]), nvfp4_dit::float_bits(v[6]), 0x7733u), 0x6420u);
  return mag | (odd & 0x80808080u) | ((even >> 4) & 0x08080808u);
}

// Valid keys of batch b: kv_lens[b] clamped to [0, seq_k], or seq_k without kv_lens. Params has
// the fields kv_lens, kv_lens_int64 and seq_k (QuantizeQkvParams).
template <typename Params>
NVFP4_DIT_HD int64_t valid_key_count(const Params& p, int64_t b) {
  if (p.kv_lens == nullptr) return p.seq_k;
  const int64_t n = p.kv_lens_int64 ? static_cast<const int64_t*>(p.kv_lens)[b]
                                    : static_cast<const int32_t*>(p.kv_lens)[b];
  return n < 0 ? 0 : (n > p.seq_k ? p.seq_k : n);
}

// Raw input element (bf16, fp16 or fp32 bits) to float: the quantiser reads Q, K and V straight
// from the caller's strides.
#if defined(__CUDACC__)
template <InputDtype DT>
struct InputTraits;
template <>
struct InputTraits<InputDtype::kBFloat16> {
  using Raw = uint16_t;
  static __device__ __forceinline__ float to_float(uint32_t bits) { return __uint_as_float(bits << 16); }
};
template <>
struct InputTraits<InputDtype::kFloat16> {
  using Raw = uint16_t;
  static __device__ __forceinline__ float to_float(uint32_t bits) {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
  }
};
template <>
struct InputTraits<InputDtype::kFloat32> {
  using Raw = uint32_t;
  static __device__ __forceinline__ float to_float(uint32_t bits) { return __uint_as_float(bits); }
};
#endif

}  // namespace nvfp4_dit
