// Divisions of the NVFP4 format done without an IEEE divide, provably equal to it: shared by the
// quantize kernels (block scales, x / scale) and the attention kernel (the scale of each P block).
// __host__ __device__ so that tests/test_quantize.py checks the equalities exhaustively on the host.
//
// Division by a block scale. format.py divides every element by the rounded scale in IEEE fp32.
// With r = RN(1/sf) computed once per block, q0 = RN(a*r), rem = a - q0*sf (exact with an fma)
// and q = RN(q0 + rem*r) is the correctly rounded a/sf for finite a, sf > 0 and no underflow of
// the result (Markstein's theorem; the host test checks every e4m3 scale around every e2m1
// decision threshold). Underflowing quotients are far below the first e2m1 threshold (0.25) and
// encode as 0 either way; inf is handled by the caller.
#pragma once

#include "common/portable.h"

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

// RN(a / sf) for finite a >= 0 and sf > 0 (see above); rcp = RN(1 / sf).
NVFP4_DIT_HD float divide_by_scale(float a, float sf, float rcp) {
  const float q0 = rn_mul(a, rcp);
  const float rem = rn_fma(-q0, sf, a);
  return rn_fma(rem, rcp, q0);
}

// The largest block amax whose scale does not saturate at 448 (with margin): the domain of
// amax_over_6 below, and the bound the quantize kernel's fast path takes (quantize_math.cuh).
constexpr float kUnsaturatedAmax = 6.0f * 464.0f;

// amax / 6 rounded (block_scale_value's IEEE division) for finite 0 <= amax <= kUnsaturatedAmax:
// Markstein with RN(1/6). Underflowing results (amax < 2^-120) are far below the smallest
// e4m3 scale and encode as 0 either way.
constexpr float kRcp6 = 0.16666667163372039794921875f;  // RN(1/6)
NVFP4_DIT_HD float amax_over_6(float amax) { return divide_by_scale(amax, 6.0f, kRcp6); }

}  // namespace nvfp4_dit
