// Masks of the attention kernel, always on the true token index (never the stored column: K
// rows are permuted inside 32-key groups; score_key in fragments.cuh maps a score to its key).
#pragma once
#include "attention/fragments.cuh"

namespace nvfp4_dit {

__device__ __forceinline__ int score_token(int tile_start, int j, int t, int e) {
  return tile_start + score_key(j, t, e);
}

// Keys j < limit are visible to a row: limit = kv_len, or min(kv_len, row + 1) when causal
// (SDPA's is_causal: query i sees keys j <= i).
__device__ __forceinline__ int key_limit(int kv_len, bool causal, int row) {
  return causal ? min(kv_len, row + 1) : kv_len;
}

template <int kNTiles>
__device__ __forceinline__ void apply_key_mask(float (&s)[kNTiles][4], int tile_start, int t,
                                               int limit_row_g, int limit_row_g8) {
#pragma unroll
  for (int j = 0; j < kNTiles; ++j) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int tok = score_token(tile_start, j, t, e);
      if (tok >= limit_row_g) s[j][e] = -INFINITY;
      if (tok >= limit_row_g8) s[j][2 + e] = -INFINITY;
    }
  }
}

}  // namespace nvfp4_dit
