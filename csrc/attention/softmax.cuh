// Online softmax pieces of the attention kernel: quad-wide row reductions and the two-level P
// quantisation (CONTRIBUTING.md, the NVFP4 contract, "Softmax / P").
//
// A row of the m16n8 accumulator is spread over the 4 lanes of a quad (lanes 4g..4g+3), so row
// reductions use shfl-xor 1 and 2 only; xor 4 would mix rows g and g+1 (FlashInfer #3838).
#pragma once
#include "common/portable.h"
#include "common/exact_division.cuh"
#include "common/format.cuh"

namespace nvfp4_dit {

// log2(2688): P' = exp2((s - m) * scale * log2(e) + log2(448 * 6)) lies in [0, 2688].
constexpr float kLog2PRange = 11.392317422778761f;
constexpr float kLnPRange = 7.896552599182988f;   // ln(2688)

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xFFFFFFFFu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xFFFFFFFFu, x, 2));
}

__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xFFFFFFFFu, x, 1);
  return x + __shfl_xor_sync(0xFFFFFFFFu, x, 2);
}

// ue4m3 byte (sign 0, never NaN here) -> float, branch-free and exact: its 7 bits shifted into an
// fp16 are the value times 2^-8 for normals and subnormals alike.
__device__ __forceinline__ float ue4m3_to_float(uint32_t bits) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>((bits & 0x7Fu) << 7))) * 256.0f;
}

// 2^x in one MUFU op (ex2.approx.ftz: ~2 ulp; -inf gives +0). exp2f adds a subnormal rescue
// (a compare and two multiplies per value) that P' does not need: anything below 2^-126 of
// 2688 quantises to 0 anyway.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Quantise one 16-key block of P' of which this lane holds 8 values (its xor-1 partner holds the
// other 8, see the K permutation); block_max is the max of all 16 (exp2 of the block's max
// score, exp2 being monotonic). Scale sf = e4m3_rn_satfinite(max/6), rounded *before*
// dividing; data e2m1(P'/sf); sf = 0 gives an all-zero block. Returns the 8 packed nibbles and
// the scale byte in *sf_out. Multiplying by the reciprocal instead of dividing can differ from
// P'/sf by an ulp, which changes a code only for a P'/sf within an ulp of a rounding threshold.
// max/6 needs no IEEE divide: block_max <= 2688 (+ the ex2 error) lies in amax_over_6's domain,
// where its e4m3 byte equals that of the IEEE quotient for every fp32 input (tests/test_quantize.py).
__device__ __forceinline__ uint32_t quantize_p_block(float (&pv)[8], float block_max, uint32_t* sf_out) {
  const uint32_t sf = nvfp4_dit::float_to_e4m3(nvfp4_dit::amax_over_6(block_max));   // e4m3_rn_satfinite(max / 6)
  const float sf_val = ue4m3_to_float(sf);
  float inv = 0.0f;
  if (sf_val > 0.0f) asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(inv) : "f"(sf_val));
#pragma unroll
  for (int i = 0; i < 8; ++i) pv[i] *= inv;
  *sf_out = sf;
  return nvfp4_dit::pack8_e2m1(pv);
}

}  // namespace nvfp4_dit
