// Low-rank Q smoothing on the device: the CUDA twin of nvfp4_dit/smoothing.py. Per query head, from
// the 128-row block means q_mean: the center g, a basis of kBasisRank directions by subspace
// iteration on the deviations' Gram matrix and the basis scale s (the power of two above the
// deviations), each block's coefficients a_b (stored as a_b / s) and the mean it is smoothed by,
// g + basis^T a_b. One CTA per query head; every sum runs in a fixed order (per element a
// sequential loop, or a warp's xor tree), so the result is deterministic and does not depend on the
// heads beside it.
#pragma once

#include "common/portable.h"

#include "common/format.cuh"
#include "quantize/params.h"

namespace nvfp4_dit {

constexpr int kBasisRank = 15;                        // smoothing.Q_BASIS_RANK
constexpr int kKeyProjectionColumns = kBasisRank + 1;  // smoothing.KEY_PROJECTION_COLUMNS
constexpr int kBasisIterations = 8;                    // smoothing.BASIS_ITERATIONS
constexpr float kOrthogonalFloor = 6.103515625e-05f;  // 2^-14, smoothing._ORTHOGONAL_FLOOR

// smoothing.hash32: a 32-bit integer mix (lowbias32).
NVFP4_DIT_HOST_DEVICE inline uint32_t hash32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

// smoothing.basis_start: entry (i, c) of the iteration's start, in [-1, 1) (exact: 24-bit integer
// over 2^23, minus 1).
NVFP4_DIT_HOST_DEVICE inline float basis_start(int i, int c, int dp) {
  return float(hash32(uint32_t(i * dp + c)) >> 8) * (1.0f / 8388608.0f) - 1.0f;
}

#if defined(__CUDACC__)

// The warp's sum of x in a fixed xor tree: every lane gets the same bits.
__device__ __forceinline__ float warp_tree_sum(float x) {
#pragma unroll
  for (int off = 16; off; off >>= 1) x += __shfl_xor_sync(0xFFFFFFFFu, x, off);
  return x;
}

// Block means staged per step of the passes over a head's blocks.
constexpr int kBasisChunk = 16;

// Shared memory of the basis kernel (dynamic: 89 KB at Dp = 128).
template <int DP>
struct BasisStorage {
  float gram[DP][DP];                 // sum_b d_b d_b^T of the scaled deviations
  float basis[kBasisRank][DP];        // the current orthonormal rows
  float product[kBasisRank][DP];      // basis . gram, before Gram-Schmidt
  float chunk[kBasisChunk][DP];       // staged block means (or their scaled deviations)
  float coeff[kBasisChunk][kBasisRank];
  float center[DP];
  int finite[kBasisChunk];
  float warp_partial[32];
};

// Stages the block means [b0, b0 + kBasisChunk) of one head (rows past n: zero, not finite) and
// whether each is finite; ends with a barrier.
template <int DP, int kThreads>
__device__ __forceinline__ void stage_means(BasisStorage<DP>& sm, const float* means, int64_t n, int64_t b0) {
  for (int i = threadIdx.x; i < kBasisChunk * DP; i += kThreads) {
    const int64_t blk = b0 + i / DP;
    sm.chunk[i / DP][i % DP] = blk < n ? __ldcg(means + blk * DP + i % DP) : 0.0f;
  }
  __syncthreads();
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int j = warp; j < kBasisChunk; j += kThreads / 32) {
    bool ok = b0 + j < n;
#pragma unroll
    for (int c = lane; c < DP; c += 32) ok = ok && isfinite(sm.chunk[j][c]);
    ok = __all_sync(0xFFFFFFFFu, ok);
    if (lane == 0) sm.finite[j] = ok;
  }
  __syncthreads();
}

// One head's smoothing (nvfp4_dit/smoothing.py, steps 1-3): writes q_center, q_basis, q_coeff and
// q_smooth_mean of head bh = b * H + h from its n block means in q_mean.
template <int DP, int kThreads>
__device__ void smoothing_basis_head(const QuantizeQkvParams& p, BasisStorage<DP>& sm, int64_t bh) {
  static_assert(kThreads == 256 && DP % 32 == 0, "the thread layout below");
  const int64_t n = p.seq_q_padded / 128;
  const float* means = p.q_mean + bh * n * DP;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;

  // 1. The center: the mean of the finite block means, each column summed in block order.
  float sum = 0.0f, count = 0.0f;
  for (int64_t b0 = 0; b0 < n; b0 += kBasisChunk) {
    stage_means<DP, kThreads>(sm, means, n, b0);
    if (tid < DP)
      for (int j = 0; j < kBasisChunk; ++j)
        if (sm.finite[j]) {
          sum += sm.chunk[j][tid];
          count += 1.0f;
        }
    __syncthreads();
  }
  if (tid < DP) sm.center[tid] = __fdiv_rn(sum, fmaxf(count, 1.0f));
  __syncthreads();

  // 2. The power of two that puts the deviations at most 1 (max is exact in any order).
  float amax = 0.0f;
  for (int64_t b0 = 0; b0 < n; b0 += kBasisChunk) {
    stage_means<DP, kThreads>(sm, means, n, b0);
    if (tid < DP)
      for (int j = 0; j < kBasisChunk; ++j)
        if (sm.finite[j]) amax = fmaxf(amax, fabsf(__fsub_rn(sm.chunk[j][tid], sm.center[tid])));
    __syncthreads();
  }
#pragma unroll
  for (int off = 16; off; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, off));
  if (lane == 0) sm.warp_partial[warp] = amax;
  __syncthreads();
  amax = sm.warp_partial[0];
  for (int w = 1; w < kThreads / 32; ++w) amax = fmaxf(amax, sm.warp_partial[w]);
  int exponent = 0;
  frexpf(amax > 0.0f ? amax : 1.0f, &exponent);
  exponent = min(max(exponent, -126), 127);
  const float unit = power_of_two(-exponent), basis_scale = power_of_two(exponent);

  // 3. The Gram matrix of the scaled deviations: thread t owns a kSub x kSub square, each entry
  // summed in block order.
  constexpr int kSub = DP == 128 ? 8 : 4;
  static_assert((DP / kSub) * (DP / kSub) == kThreads, "one square per thread");
  const int row0 = (tid / (DP / kSub)) * kSub, col0 = (tid % (DP / kSub)) * kSub;
  float acc[kSub][kSub];
#pragma unroll
  for (int x = 0; x < kSub; ++x)
#pragma unroll
    for (int y = 0; y < kSub; ++y) acc[x][y] = 0.0f;
  for (int64_t b0 = 0; b0 < n; b0 += kBasisChunk) {
    stage_means<DP, kThreads>(sm, means, n, b0);
    for (int i = tid; i < kBasisChunk * DP; i += kThreads) {
      const int j = i / DP, c = i % DP;
      sm.chunk[j][c] = sm.finite[j] ? __fsub_rn(sm.chunk[j][c], sm.center[c]) * unit : 0.0f;
    }
    __syncthreads();
    for (int j = 0; j < kBasisChunk; ++j) {
      float a[kSub], bv[kSub];
#pragma unroll
      for (int x = 0; x < kSub; ++x) {
        a[x] = sm.chunk[j][row0 + x];
        bv[x] = sm.chunk[j][col0 + x];
      }
#pragma unroll
      for (int x = 0; x < kSub; ++x)
#pragma unroll
        for (int y = 0; y < kSub; ++y) acc[x][y] = fmaf(a[x], bv[y], acc[x][y]);
    }
    __syncthreads();
  }
#pragma unroll
  for (int x = 0; x < kSub; ++x)
#pragma unroll
    for (int y = 0; y < kSub; ++y) sm.gram[row0 + x][col0 + y] = acc[x][y];
  for (int i = tid; i < kBasisRank * DP; i += kThreads) sm.basis[i / DP][i % DP] = basis_start(i / DP, i % DP, DP);
  __syncthreads();

  // 4. Subspace iteration: basis <- Gram-Schmidt(basis . gram), kBasisIterations times.
  for (int it = 0; it < kBasisIterations; ++it) {
    for (int i = tid; i < kBasisRank * DP; i += kThreads) {
      const int r = i / DP, c = i % DP;
      float y = 0.0f;
      for (int k = 0; k < DP; ++k) y = fmaf(sm.basis[r][k], sm.gram[k][c], y);
      sm.product[r][c] = y;
    }
    __syncthreads();
    if (warp == 0) {  // Gram-Schmidt in row order, one warp (lane owns columns lane + 32 k)
      constexpr int kPer = DP / 32;
      float first_norm = 0.0f;  // the first row's norm before Gram-Schmidt
      for (int r = 0; r < kBasisRank; ++r) {
        float x[kPer];
        float s = 0.0f;
#pragma unroll
        for (int k = 0; k < kPer; ++k) {
          x[k] = sm.product[r][lane + 32 * k];
          s = fmaf(x[k], x[k], s);
        }
        const float before = sqrtf(warp_tree_sum(s));
        // Two sweeps over the earlier rows: one leaves a row that was mostly along them with
        // rounding error along them of the size of what remains ("twice is enough").
        for (int sweep = 0; sweep < 2; ++sweep) {
          for (int q = 0; q < r; ++q) {
            float d = 0.0f;
#pragma unroll
            for (int k = 0; k < kPer; ++k) d = fmaf(x[k], sm.basis[q][lane + 32 * k], d);
            d = warp_tree_sum(d);
#pragma unroll
            for (int k = 0; k < kPer; ++k) x[k] = fmaf(-d, sm.basis[q][lane + 32 * k], x[k]);
          }
        }
        s = 0.0f;
#pragma unroll
        for (int k = 0; k < kPer; ++k) s = fmaf(x[k], x[k], s);
        const float after = sqrtf(warp_tree_sum(s));
        // The floor, a fraction of the first row's norm, in the last step only: earlier steps keep
        // every nonzero row (smoothing._ORTHOGONAL_FLOOR).
        if (r == 0) first_norm = before;
        const float floor = it == kBasisIterations - 1 ? kOrthogonalFloor : 0.0f;
        const bool keep = after > floor * first_norm && after > 0.0f;
#pragma unroll
        for (int k = 0; k < kPer; ++k) sm.basis[r][lane + 32 * k] = keep ? __fdiv_rn(x[k], after) : 0.0f;
        __syncwarp();
      }
    }
    __syncthreads();
  }
  for (int i = tid; i < kBasisRank * DP; i += kThreads) p.q_basis[bh * kBasisRank * DP + i] = sm.basis[i / DP][i % DP];
  if (tid < DP) p.q_center[bh * DP + tid] = sm.center[tid];
  if (tid == 0) p.q_basis_scale[bh] = basis_scale;

  // 5. Each block's coefficients a_bi = basis_i . (qm_b - g) (a warp's tree), stored over the basis
  // scale, and its smoothed mean g + sum_i a_bi basis_i (the terms in order).
  for (int64_t b0 = 0; b0 < n; b0 += kBasisChunk) {
    stage_means<DP, kThreads>(sm, means, n, b0);
    for (int item = warp; item < kBasisChunk * kBasisRank; item += kThreads / 32) {
      const int j = item / kBasisRank, r = item % kBasisRank;
      float d = 0.0f;
#pragma unroll
      for (int c = lane; c < DP; c += 32) d = fmaf(sm.basis[r][c], __fsub_rn(sm.chunk[j][c], sm.center[c]), d);
      d = warp_tree_sum(d);
      if (lane == 0) {
        sm.coeff[j][r] = d;
        if (b0 + j < n) p.q_coeff[(bh * n + b0 + j) * kBasisRank + r] = d * unit;
      }
    }
    __syncthreads();
    for (int i = tid; i < kBasisChunk * DP; i += kThreads) {
      const int j = i / DP, c = i % DP;
      if (b0 + j >= n) continue;
      float m = sm.center[c];
#pragma unroll
      for (int r = 0; r < kBasisRank; ++r) m = fmaf(sm.coeff[j][r], sm.basis[r][c], m);
      p.q_smooth_mean[(bh * n + b0 + j) * DP + c] = m;
    }
    __syncthreads();
  }
}

#endif  // __CUDACC__

}  // namespace nvfp4_dit
