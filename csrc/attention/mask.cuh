// Masks of the attention kernel, always on the true token index (never the stored column: K
// rows are permuted inside 32-key groups, stored row 8a + 2b + c holding token 8b + 2a + c).
//
// In the m16n8 score accumulator, n8 tile j of a 128-key tile and column 2t + e (lane 4g + t)
// hold stored row 8j + 2t + e, i.e. token 32*(j/4) + 8t + 2*(j%4) + e of the tile.
#pragma once

namespace nvfp4_dit {

__device__ __forceinline__ int score_token(int tile_start, int j, int t, int e) {
  return tile_start + 32 * (j >> 2) + 8 * t + 2 * (j & 3) + e;
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
