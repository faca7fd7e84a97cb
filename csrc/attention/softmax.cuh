// Online softmax pieces of the attention kernel: quad-wide row reductions and the two-level P
// quantisation (DEVELOPERS.md "Softmax / P").
//
// A row of the m16n8 accumulator is spread over the 4 lanes of a quad (lanes 4g..4g+3), so row
// reductions use shfl-xor 1 and 2 only; xor 4 would mix rows g and g+1 (FlashInfer #3838).
#pragma once
#include <cstdint>
#include "../nvfp4_format.cuh"

namespace nvfp4_attn {

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

// Quantise one 16-key block of P' of which this lane holds 8 values (its xor-1 partner holds the
// other 8, see the K permutation). Scale sf = e4m3_rn_satfinite(max/6), rounded *before*
// dividing; data e2m1(P'/sf); sf = 0 gives an all-zero block. Returns the 8 packed nibbles and
// the scale byte in *sf_out. Multiplying by the correctly rounded reciprocal instead of dividing
// can differ from P'/sf by 1 ulp, which changes a code only for a P'/sf within 1 ulp of a
// rounding threshold.
__device__ __forceinline__ uint32_t quantize_p_block(float (&pv)[8], uint32_t* sf_out) {
  float bmax = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) bmax = fmaxf(bmax, pv[i]);
  bmax = fmaxf(bmax, __shfl_xor_sync(0xFFFFFFFFu, bmax, 1));
  uint32_t sf;
  const float sf_val = nvfp4::block_scale_value(bmax, &sf);   // e4m3_rn_satfinite(bmax / 6)
  const float inv = sf_val > 0.0f ? __frcp_rn(sf_val) : 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) pv[i] *= inv;
  *sf_out = sf;
  return nvfp4::pack8_e2m1(pv);
}

}  // namespace nvfp4_attn
