// Where every lane's MMA operands come from: the attention kernel's register construction as
// index functions. kernel.cuh builds each fragment and scale register through these, and the CPU
// model of the native instruction (tests/test_mma_model.py) evaluates the same functions on the
// host, so that model checks the kernel's own addressing against the PTX fragment tables.
//
// Lane l = 4g + t (g = l >> 2, t = l & 3). Shared-memory offsets are bytes from the start of a
// pipeline stage (AttentionTraits). Torch-free; host and device.
#pragma once
#include "common/portable.h"

#include "attention/traits.cuh"

namespace nvfp4_dit {

// Key (natural order, within a 128-key tile) of accumulator column 2t + e of n8 tile j, in rows g
// (element e) and g+8 (element 2 + e). Stored K row 8j + 2t + e holds token 32*(j/4) + 8t +
// 2*(j%4) + e (format.K_ROW_PERM), so a lane's 8 scores of a 32-key group are the keys 8t..8t+7:
// exactly the k range of the P·V A fragment it feeds, and P needs no shuffles.
__host__ __device__ constexpr int score_key(int j, int t, int e) { return 32 * (j >> 2) + 8 * t + 2 * (j & 3) + e; }

template <int kHeadDim, class QkFmt = QkFormatNvfp4>
struct Fragments {
  using T = AttentionTraits<kHeadDim, QkFmt>;
  static constexpr int kQRowBytes = T::kKRowBytes;     // data bytes of one Q or K row
  static constexpr int kSfRowBytes = T::kKSfRowBytes;  // scale bytes of one Q or K row
  // Scale words per Q/K row (QkFmt::sf_word of a chunk); a D=64 MXFP8 row has half a word.
  static constexpr int kSfWords = kSfRowBytes >= 4 ? kSfRowBytes / 4 : 1;

  // Both MMAs read SF_A with thread-id-a = 0 (lane 4g: row g, lane 4g+1: row g+8).
  static constexpr int kTidA = 0;

  // ---- Q: the A operand of Q·Kᵀ, loaded once from global memory --------------------------------
  // Register reg of chunk kc (32 bytes): row g (reg 0, 2) or g+8 (reg 1, 3), bytes
  // 16*(reg/2) + 4t..4t+3 of the chunk (e2m1: k = 32*(reg/2) + 8t..8t+7; e4m3: 16*(reg/2) + 4t..4t+3).
  // Bytes from the warp's first Q row.
  __host__ __device__ static constexpr int q_data(int kc, int reg, int g, int t) {
    return (g + 8 * (reg & 1)) * kQRowBytes + 32 * kc + 16 * (reg >> 1) + 4 * t;
  }
  // SF_A word w (QkFmt::sf_word of a chunk): lane 4g+0 row g, 4g+1 row g+8; lanes 4g+2/3 load
  // rows the MMA ignores. Bytes from the warp's first Q scale row.
  __host__ __device__ static constexpr int q_scale(int w, int g, int t) {
    return (g + 8 * (t & 1)) * kSfRowBytes + 4 * w;
  }

  // ---- ldmatrix.x4 of a pair of n8 tiles ---------------------------------------------------------
  // One ldmatrix.x4 loads the B fragments of n8 tiles 4*grp + 2jj and 4*grp + 2jj + 1 (grp: a
  // 32-row group of the stage's K or V^T rows). Lane `lane` gives the address of row lane%8 of
  // matrix lane/8; matrices 0, 1 are the two 16-byte halves (b0, b1) of the first tile, 2, 3 of
  // the second, so tile x of the pair takes ldmatrix results 2x and 2x + 1.
  __host__ __device__ static constexpr int ldsm_row(int grp, int jj, int lane) {
    return (4 * grp + 2 * jj + ((lane >> 3) >> 1)) * 8 + (lane & 7);
  }
  __host__ __device__ static constexpr int ldsm_chunk(int kc, int lane) { return 2 * kc + ((lane >> 3) & 1); }
  __host__ __device__ static constexpr int ldsm_result(int x, int breg) { return 2 * x + breg; }
  // The accumulator n8 tile that tile x of pair jj of group grp adds into.
  __host__ __device__ static constexpr int pair_tile(int grp, int jj, int x) { return 4 * grp + 2 * jj + x; }
  // thread-id-b of tile x of pair jj: lane 4g + tid_b holds the scales of that tile's column g.
  __host__ __device__ static constexpr int tid_b(int jj, int x) { return 2 * jj + x; }

  // ---- K: the B operand of Q·Kᵀ, global -> stage -> ldmatrix -------------------------------------
  // Where 16-byte chunk ch of stored row r of the tile lands (cp.async).
  __host__ __device__ static constexpr int k_smem(int r, int ch) {
    return T::kOffK + T::template swizzle<T::kKRowBytes>(r, ch);
  }
  __host__ __device__ static constexpr int k_ldsm(int grp, int kc, int jj, int lane) {
    return k_smem(ldsm_row(grp, jj, lane), ldsm_chunk(kc, lane));
  }
  // The stage holds the tile's K scale rows in stored order. SF_B word w: lane 4g+t gives column g
  // of n8 tile 4*grp + t (thread-id-b = t), i.e. stored row 8(4*grp + t) + g.
  __host__ __device__ static constexpr int k_scale(int grp, int w, int g, int t) {
    return T::kOffKSf + (32 * grp + 8 * t + g) * kSfRowBytes + 4 * w;
  }

  // ---- P: the A operand of P·V, built from this lane's scores ------------------------------------
  // preg[grp][r] packs the lane's 8 P values of 32-key group grp, row g (r = 0) or g+8 (r = 1);
  // value i is score element (j = 4*grp + i/2, e = i%2), key score_key(j, t, e). They lie in
  // 16-key block p_block(grp, t); the xor-1 partner lane holds the block's other 8.
  static constexpr int kPBlockPartnerXor = 1;
  __host__ __device__ static constexpr int p_block(int grp, int t) { return 2 * grp + (t >> 1); }
  // Register reg of the A fragment of k64 chunk kc is preg[p_group(kc, reg)][p_row(reg)].
  __host__ __device__ static constexpr int p_group(int kc, int reg) { return 2 * kc + (reg >> 1); }
  __host__ __device__ static constexpr int p_row(int reg) { return reg & 1; }
  // SF_A of chunk kc (byte b = k-block b of the chunk). With thread-id-a = 0, lane 4g (row g) and
  // 4g+1 (row g+8) need all four blocks; a lane holds blocks t>>1 and 2 + (t>>1), so it puts its
  // two in bytes 0 and 2 and takes bytes 1 and 3 from lane xor 2.
  // sf[q][r]: the scale byte of this lane's block of group 2kc + q, row half r.
  static constexpr int kPScaleShuffleXor = 2;
  __host__ __device__ static constexpr uint32_t p_scale_own(int t, uint32_t sf00, uint32_t sf01, uint32_t sf10,
                                                           uint32_t sf11) {
    return ((t & 1) ? sf01 : sf00) | (((t & 1) ? sf11 : sf10) << 16);
  }
  __host__ __device__ static constexpr uint32_t p_scale_word(uint32_t own, uint32_t from_xor2) {
    return own | (from_xor2 << 8);
  }

  // ---- V^T: the B operand of P·V ------------------------------------------------------------------
  // Row d of the tile's V^T (64 bytes, the tile's 128 keys) chunk ch.
  __host__ __device__ static constexpr int v_smem(int d, int ch) {
    return T::kOffV + T::template swizzle<T::kVRowBytes>(d, ch);
  }
  // The 8 scale bytes of V^T row d for the tile.
  __host__ __device__ static constexpr int v_scale_row(int d) { return T::kOffVSf + d * T::kVSfRowBytes; }
  // P·V step s of a tile (2 * kHeadDim / 16 steps): k64 chunk of keys, 32-row group of D, pair.
  static constexpr int kPvSteps = 2 * kHeadDim / 16;
  __host__ __device__ static constexpr int pv_chunk(int step) { return step / (kHeadDim / 16); }
  __host__ __device__ static constexpr int pv_group(int step) { return (step % (kHeadDim / 16)) >> 1; }
  __host__ __device__ static constexpr int pv_pair(int step) { return (step % (kHeadDim / 16)) & 1; }
  __host__ __device__ static constexpr int v_ldsm(int step, int lane) {
    return v_smem(ldsm_row(pv_group(step), pv_pair(step), lane), ldsm_chunk(pv_chunk(step), lane));
  }
  // SF_B word of a step: lane 4g+t gives D column g of n8 tile 4*grp + t.
  __host__ __device__ static constexpr int v_scale(int step, int g, int t) {
    return v_scale_row(32 * pv_group(step) + 8 * t + g) + 4 * pv_chunk(step);
  }
  // The output accumulator tile of tile x of a step's pair; its column 2t + e is D column out_col.
  __host__ __device__ static constexpr int o_tile(int step, int x) { return pair_tile(pv_group(step), pv_pair(step), x); }
  __host__ __device__ static constexpr int out_col(int j, int t, int e) { return 8 * j + 2 * t + e; }
};

}  // namespace nvfp4_dit
