// Per-element arithmetic of the quantize kernel that is faster than, and provably equal to, the
// reference formulation in nvfp4_format.cuh. __host__ __device__ so that
// tests/test_quantize_kernel.py can check the equalities exhaustively on the host.
//
// 1. Division by a block scale. format.py divides every element by the rounded scale in IEEE
//    fp32. With r = RN(1/sf) computed once per block, q0 = RN(a*r), rem = a - q0*sf (exact with
//    an fma) and q = RN(q0 + rem*r) is the correctly rounded a/sf for finite a, sf > 0 and no
//    underflow of the result (Markstein's theorem; the host test checks every e4m3 scale around
//    every e2m1 decision threshold). Underflowing quotients are far below the first e2m1
//    threshold (0.25) and encode as 0 either way; inf is handled by the caller.
// 2. e2m1 magnitude encoding by one fp32 addition instead of seven comparisons: adding
//    2^(22+e) (e = the e2m1 exponent of a, at least 0) leaves a's value rounded to e2m1's grid
//    spacing (0.5, 1 or 2) in the low mantissa bits of the sum, ties to even exactly as e2m1's
//    even codes. The host test checks every fp32 value in [0, 8].
// Torch-free and self-contained apart from nvfp4_format.cuh.
#pragma once

#include <cstdint>

#include <cuda_fp16.h>

#include "nvfp4_format.cuh"
#include "quantize.cuh"

namespace nvfp4_dit {

#if defined(__CUDACC__)
#define NVFP4_DIT_HD __host__ __device__ __forceinline__
#else
#define NVFP4_DIT_HD inline
#endif

NVFP4_DIT_HD float rn_mul(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

NVFP4_DIT_HD float rn_fma(float a, float b, float c) {
#ifdef __CUDA_ARCH__
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

NVFP4_DIT_HD float rn_add(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

NVFP4_DIT_HD float rn_rcp(float a) {
#ifdef __CUDA_ARCH__
  return __frcp_rn(a);
#else
  return 1.0f / a;
#endif
}

// RN(a / sf) for finite a >= 0 and sf > 0 (see 1. above); rcp = RN(1 / sf).
NVFP4_DIT_HD float divide_by_scale(float a, float sf, float rcp) {
  const float q0 = rn_mul(a, rcp);
  const float rem = rn_fma(-q0, sf, a);
  return rn_fma(rem, rcp, q0);
}

// e2m1 magnitude code (0..7) of a >= 0 (not NaN): nearest, ties to even, saturating at 6.
NVFP4_DIT_HD uint32_t e2m1_magnitude_code(float a) {
  a = a < nvfp4::kE2m1Max ? a : nvfp4::kE2m1Max;
  const float at_least_one = a > 1.0f ? a : 1.0f;
  const uint32_t exp_bits = nvfp4::float_bits(at_least_one) & 0x7F800000u;
  const float magic = nvfp4::bits_float(exp_bits + (22u << 23));
  const uint32_t sum = nvfp4::float_bits(rn_add(a, magic));
  // Low bits: a / spacing, rounded (0..4); exp_bits >> 22 = 2 * (127 + e).
  return (sum & 7u) + (exp_bits >> 22) - 254u;
}

// The same for 0 <= a < 7 without the saturation: a block's quotients stay below 6.4 unless its
// scale saturated at 448 (amax > 6 * 464), and the kernel sends those blocks to the clamped path.
// The sum a + 2^(22+e) lies in [2^(22+e), 2^(23+e)), so its exponent field is 149 + e and
// (sum >> 22) = 2 * (149 + e).
NVFP4_DIT_HD uint32_t e2m1_magnitude_code_below7(float a) {
  const float at_least_one = a > 1.0f ? a : 1.0f;
  const uint32_t exp_bits = nvfp4::float_bits(at_least_one) & 0x7F800000u;
  const uint32_t sum = nvfp4::float_bits(rn_add(a, nvfp4::bits_float(exp_bits + (22u << 23))));
  return (sum & 7u) + (sum >> 22) - 298u;
}

// Quotients |v| / sf of a block stay below 7 (e2m1_magnitude_code_below7's domain) except
//  * when the scale saturated at 448 (amax above this, or inf/NaN), and
//  * for the two coarsest subnormal scales, bytes 1 and 2 (2^-9, 2^-8): rounding amax / 6 to
//    a multiple of 2^-9 can lower it by a third there, so quotients reach 9 (byte 1) or 7.5
//    (byte 2). From byte 3 on the bound is 6 * 3.5 / 3 = 7, exclusive (3.5 rounds to 4, even),
//    and for normal scales 6 / (1 - 2^-4) = 6.4.
// Those blocks take the clamped IEEE path. (Found by the GPU fuzz: head dims such as 17 leave
// blocks of one element, whose small |x - mean| lands on these scales.)
constexpr float kUnsaturatedAmax = 6.0f * 464.0f;
constexpr uint32_t kLastCoarseScaleByte = 2;

// amax / 6 rounded (block_scale_value's IEEE division) for finite 0 <= amax <= kUnsaturatedAmax:
// Markstein with RN(1/6). Underflowing results (amax < 2^-120) are far below the smallest
// e4m3 scale and encode as 0 either way.
constexpr float kRcp6 = 0.16666667163372039794921875f;  // RN(1/6)
NVFP4_DIT_HD float amax_over_6(float amax) { return divide_by_scale(amax, 6.0f, kRcp6); }

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

// Eight e2m1 magnitude codes (0..7) and the values they came from -> one word of nibbles,
// element i in bits [4i+3:4i], sign bit = signbit(v[i]) (format.e2m1_encode; -0 included).
// The signs are gathered bytewise: the top byte of v[2j+1] lands in byte j (sign at bit 8j+7),
// that of v[2j] likewise and shifted down by 4 (bit 8j+3).
NVFP4_DIT_HD uint32_t pack8_codes_signs(const uint32_t (&code)[8], const float (&v)[8]) {
  uint32_t mag = code[7];
#pragma unroll
  for (int i = 6; i >= 0; --i) mag = (mag << 4) + code[i];
  const uint32_t odd = byte_perm(byte_perm(nvfp4::float_bits(v[1]), nvfp4::float_bits(v[3]), 0x7733u),
                                 byte_perm(nvfp4::float_bits(v[5]), nvfp4::float_bits(v[7]), 0x7733u), 0x6420u);
  const uint32_t even = byte_perm(byte_perm(nvfp4::float_bits(v[0]), nvfp4::float_bits(v[2]), 0x7733u),
                                  byte_perm(nvfp4::float_bits(v[4]), nvfp4::float_bits(v[6]), 0x7733u), 0x6420u);
  return mag | (odd & 0x80808080u) | ((even >> 4) & 0x08080808u);
}

// Valid keys of batch b: kv_lens[b] clamped to [0, seq_k], or seq_k without kv_lens. Params is
// QuantizeQkvParams or QkCorrectionParams (fields kv_lens, kv_lens_int64, seq_k).
template <typename Params>
NVFP4_DIT_HD int64_t valid_key_count(const Params& p, int64_t b) {
  if (p.kv_lens == nullptr) return p.seq_k;
  const int64_t n = p.kv_lens_int64 ? static_cast<const int64_t*>(p.kv_lens)[b]
                                    : static_cast<const int32_t*>(p.kv_lens)[b];
  return n < 0 ? 0 : (n > p.seq_k ? p.seq_k : n);
}

// Raw input element (bf16, fp16 or fp32 bits) to float: shared by the quantize and the
// correction kernels, which both read Q/K straight from the caller's strides.
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
