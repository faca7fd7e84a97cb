// The NVFP4 attention forward kernel: one template, the MMA back-end a template argument.
//
// CTA = 128 Q rows x 8 warps (16 rows each), 128-key tiles in ascending key order, a kStages
// cp.async pipeline for K, V^T, their scales and the next tile's key projections. Per 128-key tile at D=128
// each warp issues 32 QK^T + 32 PV m16n8k64 block-scaled MMAs (512 per CTA).
//
// Data path per tile (no register shuffles of data, thanks to the K row permutation):
//   S = corr (C operand) + FP4(Q) FP4(K)^T      Q fragments live in registers for the whole tile;
//       corr, the low-rank smoothing's correction of the tile's 128 keys, formed one tile ahead
//       in shared memory from their key projections and the Q block's coefficients
//   mask on the true token index; running max m (quad max); P' = exp2((S-m)c + log2 2688)
//   per 16 keys: sf = e4m3(max/6), e2m1(P'/sf) packed straight into the PV A fragment;
//   the row sum takes the unquantised P'; O = O * alpha + FP4(P) FP4(V).
// Epilogue: O / rowsum in bf16/fp16 through int64 strides (NHD or HND), optional LSE.
//
// Persistent: gridDim.x CTAs stride over (batch, head, Q block) work items; within a head the
// Q blocks are adjacent so concurrent CTAs share K/V in L2; causal runs the longest blocks first.
// Block-sparse (a block map, params.h; separate instantiations): a work item visits only its listed
// key tiles, whose indices the stage ring streams; the host lists each head's rows longest first.
#pragma once
#include "common/portable.h"
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "attention/fragments.cuh"
#include "attention/mask.cuh"
#include "attention/params.h"
#include "attention/softmax.cuh"
#include "attention/traits.cuh"
#include "common/launch.h"
#include "common/ldmatrix.cuh"

namespace nvfp4_dit {

namespace detail {

__device__ __forceinline__ void cp_async16(uint32_t smem_addr, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr), "l"(gmem));
}
__device__ __forceinline__ void cp_async8(uint32_t smem_addr, const void* gmem) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(smem_addr), "l"(gmem));
}
__device__ __forceinline__ void cp_async4(uint32_t smem_addr, const void* gmem) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_addr), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// One ldmatrix.x4 = the B fragments of the n8 tiles 2kPair and 2kPair + 1 of a 32-row group
// (Fragments: ldsm_result, tid_b, pair_tile), then their two MMAs; acc points at the group's tile 0.
// MmaOp: a qk_format.cuh MMA (Nvfp4MmaOp / Mxfp8MmaOp); kByteId: the chunk's scale byte (MXFP8).
template <class MmaOp, class Frag, int kPair, int kByteId>
__device__ __forceinline__ void ldsm_mma_pair(float (*acc)[4], const uint32_t (&a)[4], uint32_t sfa, uint32_t sfb,
                                              uint32_t smem_addr) {
  uint32_t r[4];
  ldmatrix_x4(r, smem_addr);
  const uint32_t b0[2] = {r[Frag::ldsm_result(0, 0)], r[Frag::ldsm_result(0, 1)]};
  const uint32_t b1[2] = {r[Frag::ldsm_result(1, 0)], r[Frag::ldsm_result(1, 1)]};
  MmaOp::template mma<Frag::kTidA, Frag::tid_b(kPair, 0), kByteId>(acc[Frag::pair_tile(0, kPair, 0)], a, b0, sfa, sfb);
  MmaOp::template mma<Frag::kTidA, Frag::tid_b(kPair, 1), kByteId>(acc[Frag::pair_tile(0, kPair, 1)], a, b1, sfa, sfb);
}

// The same with the pair and the byte-id chosen at run time (selectors are template arguments;
// in the unrolled loops both are constants and the branches fold away).
template <class MmaOp, class Frag, int kByteId = 0>
__device__ __forceinline__ void ldsm_mma_pair(int pair, float (*acc)[4], const uint32_t (&a)[4], uint32_t sfa,
                                              uint32_t sfb, uint32_t smem_addr) {
  if (pair == 0) {
    ldsm_mma_pair<MmaOp, Frag, 0, kByteId>(acc, a, sfa, sfb, smem_addr);
  } else {
    ldsm_mma_pair<MmaOp, Frag, 1, kByteId>(acc, a, sfa, sfb, smem_addr);
  }
}

template <class MmaOp, class Frag>
__device__ __forceinline__ void ldsm_mma_pair(int pair, int byte_id, float (*acc)[4], const uint32_t (&a)[4],
                                              uint32_t sfa, uint32_t sfb, uint32_t smem_addr) {
  if constexpr (MmaOp::kByteIds == 1) {
    (void)byte_id;
    ldsm_mma_pair<MmaOp, Frag, 0>(pair, acc, a, sfa, sfb, smem_addr);
  } else {
    static_assert(MmaOp::kByteIds == 4, "byte-id 0..3");
    switch (byte_id) {
      case 0: ldsm_mma_pair<MmaOp, Frag, 0>(pair, acc, a, sfa, sfb, smem_addr); break;
      case 1: ldsm_mma_pair<MmaOp, Frag, 1>(pair, acc, a, sfa, sfb, smem_addr); break;
      case 2: ldsm_mma_pair<MmaOp, Frag, 2>(pair, acc, a, sfa, sfb, smem_addr); break;
      default: ldsm_mma_pair<MmaOp, Frag, 3>(pair, acc, a, sfa, sfb, smem_addr); break;
    }
  }
}

__device__ __forceinline__ uint32_t ld_global_u32(const uint8_t* p) {
  return *reinterpret_cast<const uint32_t*>(p);
}

__device__ __forceinline__ void store_pair(void* out, int64_t offset, float x0, float x1, bool bf16) {
  if (bf16) {
    *reinterpret_cast<__nv_bfloat162*>(static_cast<__nv_bfloat16*>(out) + offset) = __floats2bfloat162_rn(x0, x1);
  } else {
    *reinterpret_cast<__half2*>(static_cast<__half*>(out) + offset) = __floats2half2_rn(x0, x1);
  }
}
__device__ __forceinline__ void store_one(void* out, int64_t offset, float x, bool bf16) {
  if (bf16) {
    static_cast<__nv_bfloat16*>(out)[offset] = __float2bfloat16_rn(x);
  } else {
    static_cast<__half*>(out)[offset] = __float2half_rn(x);
  }
}

// One key's correction sum coeff . u (smoothing.py, step 4), by a pair of lanes (half 0, half 1):
// each sums its 8 of the 16 terms in order, coeff(k) . u_k for its projections `u_bits` (terms
// 8 * half + k; term 0's coefficient is 1), and the pair adds the halves. Both lanes get the sum,
// in units of the tile's factor.
template <class Coeff>
__device__ __forceinline__ float key_correction_sum(uint4 u_bits, Coeff coeff) {
  const uint32_t w[4] = {u_bits.x, u_bits.y, u_bits.z, u_bits.w};
  float acc = 0.0f;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float2 u = __half22float2(*reinterpret_cast<const __half2*>(&w[k]));
    acc = fmaf(coeff(2 * k), u.x, acc);
    acc = fmaf(coeff(2 * k + 1), u.y, acc);
  }
  return acc + __shfl_xor_sync(0xFFFFFFFFu, acc, 1);
}

}  // namespace detail

template <int kHeadDim, bool kSparse, class Mma, class QkFmt>
__device__ __forceinline__ void attention_fwd_body(const AttentionFwdParams& p) {
  using T = AttentionTraits<kHeadDim, QkFmt>;
  using F = Fragments<kHeadDim, QkFmt>;
  using QkMma = typename QkFmt::template Mma<Mma>;
  using PvMma = Nvfp4MmaOp<Mma>;
  constexpr int kStages = T::kStages;
  constexpr int kKC = T::kKChunks;
  constexpr int kSfRow = F::kSfRowBytes;
  // Tiles loaded ahead. The PV of tile n runs in iteration n+1, so a stage is busy for two
  // iterations after it is consumed: prefetch distance = stages - 2.
  constexpr int kPrefetch = kStages - 2;
  static_assert(kPrefetch >= 1, "the software-pipelined PV needs at least 3 stages");
  constexpr int kPVSteps = F::kPvSteps;   // (64-key chunks) x (pairs of n8 tiles of D)
  static_assert(kPVSteps % 8 == 0, "PV steps are spread over the 8 P blocks of a tile");

  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ int item_first;   // a block-sparse work item's first list entry
  __shared__ int item_kv;      // and its b * Hkv + kv head, read back by the epilogue
  // The work item's coefficients [1, a_1 .. a_15] and the corrections of the current and the next
  // key tile (fp32, natural key order), double-buffered by tile parity.
  __shared__ __align__(16) float coeff_s[T::kProjColumns];
  __shared__ float inv_score_unit_s;   // 1 / (q_scale k_scale) of the work item
  __shared__ __align__(16) float corr_s[2][T::kBlockN];
  const uint32_t smem_base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const int tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;

  const int nblk = p.q_block_end - p.q_block_begin;
  const int64_t total = int64_t(p.batch) * p.heads * nblk;
  const int group = p.heads / p.kv_heads;
  const int64_t nblk_all = p.seq_q_pad / T::kBlockM;

  // The block-sparse kernels are their own instantiations: the dense ones keep every register.
  constexpr bool sparse = kSparse;
  for (int64_t work = blockIdx.x; work < total; work += gridDim.x) {
    int bh;   // B * H fits 32 bits; 64-bit products at the uses
    int list_row = 0;
    int mi;
    if constexpr (sparse) {   // a launch's rows fit 32 bits (the host checks): 32-bit division
      const int r = p.work_order[work];
      list_row = r;
      bh = r / nblk;
      mi = r % nblk;
    } else {
      bh = int(work / nblk);
      mi = int(work % nblk);
      if (p.causal) mi = nblk - 1 - mi;   // the longest rows first (a map orders its own)
    }
    const int m_blk = p.q_block_begin + mi;
    const int b = int(bh / p.heads), h = int(bh % p.heads), hk = h / group;
    const int bhk = b * p.kv_heads + hk;
    // Scores are in units of q_scale * k_scale (a power of two): fold it into the softmax scale.
    const float score_unit = p.q_scale[int64_t(bh) * nblk_all + m_blk] * p.k_scale[bhk];
    const float c = p.scale_log2 * score_unit;
    const int kv_len = p.kv_lens != nullptr ? min(max(p.kv_lens[b], 0), p.seq_k) : p.seq_k;
    int n_end = (kv_len + T::kBlockN - 1) / T::kBlockN;
    if (p.causal) n_end = min(n_end, m_blk + 1);
    // A block map lists the row's tiles (within the limits above: the host drops the others) from
    // its first entry on. That entry is kept in shared memory, so no address derived from it stays
    // in a register (the D=128 kernels are at the register limit); the previous item's last reader
    // passed the barrier that ends it.
    if constexpr (sparse) {
      const int first = p.block_offsets[list_row];
      n_end = p.block_offsets[list_row + 1] - first;
      if (tid == 0) {
        item_first = first;
        item_kv = bhk;
      }
      __syncthreads();
    }

    const uint8_t* k_base = p.k_data + b * p.k_stride_b + hk * p.k_stride_h;
    const uint8_t* ksf_base = p.k_sf + b * p.ksf_stride_b + hk * p.ksf_stride_h;
    const uint8_t* vt_base = p.vt_data + b * p.vt_stride_b + hk * p.vt_stride_h;
    const uint8_t* vtsf_base = p.vt_sf + b * p.vtsf_stride_b + hk * p.vtsf_stride_h;
    // The key tile of the n-th tile visited (n of a dense row, entry n of a listed one).
    auto tile_of = [&](int n) { return sparse ? p.block_tiles[item_first + n] : n; };
    const int64_t vt_row = p.seq_k_pad / 2, vtsf_row = p.seq_k_pad / 16;
    // The key projections of query head bh, tile i: projections at proj_tile(i), factor at
    // proj_factor(i) (computed where used: no address stays in a register across the loop).
    auto proj_tile = [&](int i) {
      return p.key_proj + (int64_t(bh) * p.seq_k_pad + int64_t(i) * T::kBlockN) * T::kProjColumns;
    };
    auto proj_factor = [&](int i) { return p.key_proj_factor + int64_t(bh) * (p.seq_k_pad / T::kBlockN) + i; };
    // This thread's key and half of the correction sum (two lanes per key).
    const int corr_key = tid >> 1, corr_half = tid & 1;

    // Stage of the n-th tile visited.
    auto load_stage = [&](int stage, int n) {
      const int tile = tile_of(n);
      const uint32_t sbase = smem_base + stage * T::kStageBytes;
      constexpr int kKChunksRow = T::kKRowBytes / 16;
      const uint8_t* k_tile = k_base + int64_t(tile) * T::kBlockN * T::kKRowBytes;
#pragma unroll
      for (int i = tid; i < T::kBlockN * kKChunksRow; i += T::kThreads) {
        const int r = i / kKChunksRow, ch = i % kKChunksRow;
        detail::cp_async16(sbase + F::k_smem(r, ch), k_tile + r * T::kKRowBytes + ch * 16);
      }
#pragma unroll
      for (int i = tid; i < kHeadDim * 4; i += T::kThreads) {
        const int d = i >> 2, ch = i & 3;
        detail::cp_async16(sbase + F::v_smem(d, ch), vt_base + d * vt_row + int64_t(tile) * T::kVRowBytes + ch * 16);
      }
      const uint8_t* ksf_tile = ksf_base + int64_t(tile) * T::kBlockN * kSfRow;
      for (int i = tid; i < T::kKSfBytes / 16; i += T::kThreads) {
        detail::cp_async16(sbase + T::kOffKSf + i * 16, ksf_tile + i * 16);
      }
      for (int i = tid; i < kHeadDim; i += T::kThreads) {
        detail::cp_async8(sbase + F::v_scale_row(i), vtsf_base + i * vtsf_row + int64_t(tile) * T::kVSfRowBytes);
      }
      {   // the next tile's key projections (the last tile's own again): its corrections are formed this iteration
        const int next = tile_of(min(n + 1, n_end - 1));
        detail::cp_async16(sbase + T::kOffProj + tid * 16, proj_tile(next) + tid * 8);
        if (tid == 0) detail::cp_async4(sbase + T::kOffProjFactor, proj_factor(next));
      }
    };
    static_assert(T::kBlockN * T::kProjColumns * 2 == T::kThreads * 16, "one 16-byte copy per thread");

    // Prologue: the first kPrefetch tiles in flight while Q goes to registers; the coefficients, and
    // the first tile's corrections from global memory (the loop's first barrier publishes them; the
    // previous item's readers passed the barrier that ended it).
#pragma unroll
    for (int s = 0; s < kPrefetch; ++s) {
      if (s < n_end) load_stage(s, s);
      detail::cp_async_commit();
    }
    {
      const float* coeff_g = p.q_coeff + (int64_t(bh) * nblk_all + m_blk) * (T::kProjColumns - 1);
      const float inv_score_unit = 1.0f / score_unit;   // a power of two: exact
      if (tid < T::kProjColumns) coeff_s[tid] = tid == 0 ? 1.0f : coeff_g[tid - 1];
      if (tid == 0) inv_score_unit_s = inv_score_unit;
      if (n_end > 0) {
        const int first = tile_of(0);
        const uint4 u = *reinterpret_cast<const uint4*>(proj_tile(first) + corr_key * T::kProjColumns + corr_half * 8);
        const float sum = detail::key_correction_sum(u, [&](int k) {
          const int term = corr_half * 8 + k;
          return term == 0 ? 1.0f : coeff_g[term - 1];
        });
        if (corr_half == 0) corr_s[0][corr_key] = sum * (*proj_factor(first) * inv_score_unit);
      }
    }

    const int row_warp = m_blk * T::kBlockM + warp * 16;
    uint32_t qa[kKC][4];
    uint32_t qsf[F::kSfWords];
    {
      const uint8_t* q_rows = p.q_data + b * p.q_stride_b + h * p.q_stride_h + int64_t(row_warp) * F::kQRowBytes;
      const uint8_t* qsf_rows = p.q_sf + b * p.qsf_stride_b + h * p.qsf_stride_h + int64_t(row_warp) * kSfRow;
#pragma unroll
      for (int kc = 0; kc < kKC; ++kc) {
#pragma unroll
        for (int reg = 0; reg < 4; ++reg) qa[kc][reg] = detail::ld_global_u32(q_rows + F::q_data(kc, reg, g, t));
      }
#pragma unroll
      for (int w = 0; w < F::kSfWords; ++w) qsf[w] = load_sf_word<kSfRow>(qsf_rows + F::q_scale(0, g, t), w);
    }
    const int row_g = row_warp + g, row_g8 = row_g + 8;
    const int limit_g = key_limit(kv_len, p.causal, row_g);
    const int limit_g8 = key_limit(kv_len, p.causal, row_g8);

    float o[T::kNTilesO][4];
#pragma unroll
    for (int j = 0; j < T::kNTilesO; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
    float m_run[2] = {-INFINITY, -INFINITY};
    float l_part[2] = {0.0f, 0.0f};
    // FP4(P) of the previous tile (the PV A fragments and their SF_A words), consumed one tile
    // late so its MMAs overlap this tile's softmax.
    uint32_t pa_prev[2][4] = {};
    uint32_t sfp_prev[2] = {};

    // One PV step: ldmatrix.x4 of V^T (two n8 tiles of D) and two MMAs; kPVSteps per tile.
    auto pv_step = [&](int step, uint32_t sb_v, const uint8_t* sp_v) {
      const int kc = F::pv_chunk(step);
      const uint32_t sfb = *reinterpret_cast<const uint32_t*>(sp_v + F::v_scale(step, g, t));
      detail::ldsm_mma_pair<PvMma, F>(F::pv_pair(step), &o[4 * F::pv_group(step)], pa_prev[kc],
                                      sfp_prev[kc], sfb, sb_v + F::v_ldsm(step, lane));
    };

    for (int n = 0; n < n_end; ++n) {
      detail::cp_async_wait<kPrefetch - 1>();
      // Tile n is visible to all, and every warp has finished iteration n-1, which read stages
      // n-1 (K) and n-2 (V): the stage of tile n+kPrefetch = n-2 (mod 4) is free.
      __syncthreads();
      {
        const int nn = n + kPrefetch;
        if (nn < n_end) load_stage(nn % kStages, nn);
        detail::cp_async_commit();
      }
      const int stage = n % kStages;
      const uint32_t sb = smem_base + stage * T::kStageBytes;
      const uint8_t* sp = smem + stage * T::kStageBytes;
      // On the first tile P(prev) is all zero (codes and scales): point it at this tile's
      // initialised stage so the MMAs add exact zeros, and the loop body stays branch-free.
      const int stage_prev = n > 0 ? (n + kStages - 1) % kStages : stage;
      const uint32_t sb_prev = smem_base + stage_prev * T::kStageBytes;
      const uint8_t* sp_prev = smem + stage_prev * T::kStageBytes;

      // The next tile's corrections (its projections came with this tile's stage) into the other
      // buffer, last read in iteration n - 1; the next iteration's barrier publishes them. Before
      // the scores: fewer registers are live here.
      {   // (after the last tile: unused)
        const uint4 u = *reinterpret_cast<const uint4*>(sp + T::kOffProj + corr_key * (T::kProjColumns * 2) + corr_half * 16);
        const float* a = coeff_s + corr_half * 8;
        const float sum = detail::key_correction_sum(u, [&](int k) { return a[k]; });
        const float factor = *reinterpret_cast<const float*>(sp + T::kOffProjFactor);
        if (corr_half == 0) corr_s[(n + 1) & 1][corr_key] = sum * (factor * inv_score_unit_s);
      }

      // ---- S = corr + FP4(Q) FP4(K)^T --------------------------------------------------------
      float s[T::kNTilesS][4];
      // The corrections are in natural key order; a lane's keys of group q are score_key(4q, t, 0)
      // + 2a + e for tile 4q + a, element e.
      const float* corr = corr_s[n & 1];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const float2* d2 = reinterpret_cast<const float2*>(corr + score_key(4 * q, t, 0));
#pragma unroll
        for (int a = 0; a < 4; ++a) {
          const float2 d = d2[a];
          s[4 * q + a][0] = s[4 * q + a][2] = d.x;
          s[4 * q + a][1] = s[4 * q + a][3] = d.y;
        }
      }
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        uint32_t sfb = 0;   // the K scale word of the chunk: loaded at its word's first chunk
#pragma unroll
        for (int kc = 0; kc < kKC; ++kc) {
          const int w = QkFmt::sf_word(kc);
          if (QkFmt::byte_id(kc) == 0) sfb = load_sf_word<kSfRow>(sp + F::k_scale(q, 0, g, t), w);
#pragma unroll
          for (int jj = 0; jj < 2; ++jj) {
            detail::ldsm_mma_pair<QkMma, F>(jj, QkFmt::byte_id(kc), &s[4 * q], qa[kc], qsf[w], sfb,
                                            sb + F::k_ldsm(q, kc, jj, lane));
          }
        }
      }

      // ---- masks (true token index), online max -----------------------------------------------
      const int tile_start = tile_of(n) * T::kBlockN;
      if (tile_start + T::kBlockN > min(limit_g, limit_g8)) {
        apply_key_mask(s, tile_start, t, limit_g, limit_g8);
      }
      // Block maxima of the raw scores per 16 keys (this lane's 8 + its xor-1 partner's); the row
      // max is the max of a quad's block maxima, and the P' block max is exp2 of the block max.
      float bmax[4][2];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          float x = fmaxf(s[4 * q][2 * r], s[4 * q][2 * r + 1]);
#pragma unroll
          for (int a = 1; a < 4; ++a) x = fmaxf(x, fmaxf(s[4 * q + a][2 * r], s[4 * q + a][2 * r + 1]));
          bmax[q][r] = fmaxf(x, __shfl_xor_sync(0xFFFFFFFFu, x, F::kPBlockPartnerXor));
        }
      }
      float bias[2], alpha[2];   // P' = exp2(s * c + bias), bias = log2(2688) - m * c
      bool rescale = false;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float mx = fmaxf(fmaxf(bmax[0][r], bmax[1][r]), fmaxf(bmax[2][r], bmax[3][r]));
        mx = fmaxf(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, 2));
        const float m_new = fmaxf(m_run[r], mx);
        // A row with no visible key so far keeps m = -inf; use 0 so exp2 gives 0, not NaN.
        const float m_use = m_new == -INFINITY ? 0.0f : m_new;
        alpha[r] = fast_exp2((m_run[r] - m_use) * c);   // 0 on the first visible tile
        rescale |= alpha[r] != 1.0f;
        m_run[r] = m_new;
        bias[r] = kLog2PRange - m_use * c;
        l_part[r] *= alpha[r];
      }

      // ---- P' of tile n and its two-level quantisation, interleaved with O += P(n-1) V(n-1) ----
      // The PV MMAs of the previous tile are independent of this softmax, so the tensor pipe
      // works while the ALUs quantise (the order below is the issue order).
      uint32_t preg[4][2], psf[4][2];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
#pragma unroll
          for (int i = 0; i < kPVSteps / 8; ++i) pv_step((2 * q + r) * (kPVSteps / 8) + i, sb_prev, sp_prev);
          float pv[8];
#pragma unroll
          for (int a = 0; a < 4; ++a) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const float x = fast_exp2(fmaf(s[4 * q + a][2 * r + e], c, bias[r]));
              pv[2 * a + e] = x;
              l_part[r] += x;
            }
          }
          preg[q][r] = quantize_p_block(pv, fast_exp2(fmaf(bmax[q][r], c, bias[r])), &psf[q][r]);
        }
      }
      // O now holds everything up to tile n-1 in the frame of the previous max: move it to this
      // tile's max. Most tiles of a long row leave the max alone; skip when the whole warp can.
      if (__any_sync(0xFFFFFFFFu, rescale)) {
#pragma unroll
        for (int j = 0; j < T::kNTilesO; ++j) {
          o[j][0] *= alpha[0];
          o[j][1] *= alpha[0];
          o[j][2] *= alpha[1];
          o[j][3] *= alpha[1];
        }
      }
#pragma unroll
      for (int kc = 0; kc < 2; ++kc) {
#pragma unroll
        for (int reg = 0; reg < 4; ++reg) pa_prev[kc][reg] = preg[F::p_group(kc, reg)][F::p_row(reg)];
        const uint32_t own = F::p_scale_own(t, psf[2 * kc][0], psf[2 * kc][1], psf[2 * kc + 1][0], psf[2 * kc + 1][1]);
        sfp_prev[kc] = F::p_scale_word(own, __shfl_xor_sync(0xFFFFFFFFu, own, F::kPScaleShuffleXor));
      }
    }
    // The last tile's PV (its stage is still resident: no load was issued past n_end).
    if (n_end > 0) {
      const int stage_last = (n_end - 1) % kStages;
#pragma unroll
      for (int i = 0; i < kPVSteps; ++i) pv_step(i, smem_base + stage_last * T::kStageBytes, smem + stage_last * T::kStageBytes);
    }
    // The block-sparse kernels read their kv head back from shared memory (no register across the
    // loop), before the barrier: past it, warp 0 may already write the next item's.
    const int kv = sparse ? item_kv : bhk;
    detail::cp_async_wait<0>();
    __syncthreads();   // the next work item's prologue reuses the stages

    // ---- epilogue ------------------------------------------------------------------------------
    // out = O / rowsum * v_scale + v_mean; a row with no visible key gives 0 (not v_mean, not NaN).
    const float v_scale = p.v_scale[kv];
    const float* v_mean = p.v_mean + int64_t(kv) * kHeadDim;
    const bool poisoned = p.nonfinite_q_blocks[int64_t(bh) * nblk_all + m_blk] != 0u || p.nonfinite_kv[kv] != 0u;
    const float kNaN = __uint_as_float(0x7FC00000u);   // NVRTC has no NAN macro
    float l[2], out_scale[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      l[r] = quad_sum(l_part[r]);
      out_scale[r] = poisoned ? kNaN : l[r] > 0.0f ? (1.0f / l[r]) * v_scale : 0.0f;
    }
    const bool bf16 = p.out_bf16 != 0;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = r ? row_g8 : row_g;
      if (row >= p.seq_q) continue;
      const int64_t out_row = source_row(p.out_order, row);  // the caller's row of a video call
      const int64_t base = b * p.out_stride_b + h * p.out_stride_h + out_row * p.out_stride_s;
      const bool has_keys = l[r] > 0.0f || poisoned;
#pragma unroll
      for (int j = 0; j < T::kNTilesO; ++j) {
        const int col = F::out_col(j, t, 0);
        const float2 vm = has_keys ? *reinterpret_cast<const float2*>(v_mean + col) : make_float2(0.0f, 0.0f);
        const float x0 = fmaf(o[j][2 * r], out_scale[r], vm.x), x1 = fmaf(o[j][2 * r + 1], out_scale[r], vm.y);
        if (p.out_vec2 && col + 1 < p.head_dim_out) {
          detail::store_pair(p.out, base + col, x0, x1, bf16);
        } else {
          if (col < p.head_dim_out) detail::store_one(p.out, base + col, x0, bf16);
          if (col + 1 < p.head_dim_out) detail::store_one(p.out, base + col + 1, x1, bf16);
        }
      }
      if (p.lse != nullptr) {   // uniform: the LSE costs a branch, not an instantiation
        if (t == 0) {
          float lse = poisoned ? kNaN : -INFINITY;
          if (l[r] > 0.0f && !poisoned) {
            const float qdk = p.q_dot_km[b * p.qdk_stride_b + h * p.qdk_stride_h + row];
            lse = m_run[r] * (p.scale * score_unit) + logf(l[r]) - kLnPRange + p.scale * qdk;
          }
          p.lse[b * p.lse_stride_b + h * p.lse_stride_h + out_row] = lse;
        }
      }
    }
  }
}

template <int kHeadDim, bool kSparse, class Mma, class QkFmt>
__device__ __forceinline__ void attention_fwd_entry(const AttentionFwdParams& p) {
  static_assert(AttentionTraits<kHeadDim, QkFmt>::kThreads == launch::kAttentionThreads &&
                    AttentionTraits<kHeadDim, QkFmt>::kSmemBytes ==
                        launch::kAttentionSmemBytes[QkFmt::kFormatIndex][kHeadDim == 64 ? 0 : 1],
                "common/launch.h states the attention kernel's launch geometry");
  if constexpr (Mma::kCompiledHere) {
    attention_fwd_body<kHeadDim, kSparse, Mma, QkFmt>(p);
  } else {
    __trap();   // the host never launches a back-end on an arch it was not built for
  }
}

}  // namespace nvfp4_dit

// The entry points of one back-end, Q·Kᵀ format and head dim: dense and block-sparse (each writes
// the LSE where p.lse is set; common/launch.h); each instantiation TU (attention_fwd_*.cu) expands it once.
#define NVFP4_DIT_ATTENTION_ENTRY(KIND, MMA, FORMAT, FMT, D, SUFFIX, SPARSE)                                    \
  extern "C" __global__ void __launch_bounds__(nvfp4_dit::launch::kAttentionThreads, 1)                       \
      nvfp4_dit_attention_fwd_##KIND##_##FORMAT##_d##D##SUFFIX(const __grid_constant__ nvfp4_dit::AttentionFwdParams p) { \
    nvfp4_dit::attention_fwd_entry<D, SPARSE, nvfp4_dit::MMA, nvfp4_dit::FMT>(p);                             \
  }
#define NVFP4_DIT_ATTENTION_ENTRIES(KIND, MMA, FORMAT, FMT, D)                                                \
  NVFP4_DIT_ATTENTION_ENTRY(KIND, MMA, FORMAT, FMT, D, , false)                                                \
  NVFP4_DIT_ATTENTION_ENTRY(KIND, MMA, FORMAT, FMT, D, _sparse, true)
