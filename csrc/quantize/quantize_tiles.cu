// The quantiser of Q, K and V for the attention kernel (contract: params.h). It takes bf16, fp16 or
// fp32 inputs on any GPU and reads K and V from DRAM about once, Q twice.
//
// Launches (after the caller's memset of a small counter workspace), each CTA one work item by
// blockIdx, none waiting for another:
//   0. with balance_qk, balance_statistics_kernel: max |q - qm| per channel of each kv group over
//      the Q statistics tiles (format.statistics_row_mask: at most kStatisticsTiles 128-row tiles
//      per head), one CTA per tile;
//   1. key_stats_kernel: the same tiles of K and of V of each (b, kv-head) reduced to per-channel
//      sums, minima and maxima (the last tile of a head to arrive adds them in a fixed order,
//      deterministic, and finishes the head: km, vm, the channel balance);
//   2. q_means_kernel: each Q tile's block mean qm and its rows' similarity (Q's first read);
//   3. (smoothing_basis.cu) each query head's smoothing basis, coefficients and smoothed block
//      means m = g + basis^T a (smoothing.cuh);
//   4. qk_tiles_kernel: K tiles ((k - km) / (s t), rows permuted) with their key projections for
//      every query head of the group, and Q tiles ((q - m) s / q_scale with the block's tensor
//      scale, and q . km: Q's second read);
//   5. v_tiles_kernel: V^T tiles ((v - vm) / t, transposed through shared memory, quantized along
//      tokens). A K or V tile does not wait for its head's tensor scale: it takes its own,
//      t = tensor_scale(tile amax), a power of two, records it and raises its head's maximum
//      (head_exponent_slot);
//   6., 7. the same two entry points' fix-up passes (K, then V): the head's scale is the largest
//      tile's (tensor_scale is monotone), so each K or V tile under a smaller one moves its scale
//      bytes down by the difference, which gives the bytes of quantising under the head's scale
//      directly as long as every byte stays in its normal range (format.scale_headroom, proven on
//      the host in tests/test_format.py); a tile whose bytes cannot move is quantised again (the
//      rare tile of blocks 2^-14 below the head's largest).
// Every input is read as 16-byte vectors (the host copies one that cannot be: launch.h), through
// p.order for a video call. Entry points exist per input dtype, head dim and (K and Q tiles) Q·Kᵀ
// format; the order and a tile's own or head scale are run-time branches.
// Statistics from a sample are exact transforms whatever their values (the means and the balance
// only move the inputs' centre and channel magnitudes), so the inputs are read once plus the
// statistics tiles (2,048 rows of a head at most: 1.7 % of it at 118,800 tokens); the price is a
// pass over the K and V scale bytes (1/32 of a bf16 input).
// Padding rows/columns are written as zero data with zero scales; keys past kv_lens are padding.
//
// Every offset is int64. No fast-math: the scale and data divisions are correctly rounded
// (quantize_math.cuh, checked exhaustively on the host), so the bytes equal format.py's.
#include "common/portable.h"

#include <cuda_fp16.h>

#include "attention/qk_format.cuh"
#include "common/format.cuh"
#include "common/launch.h"
#include "quantize/params.h"
#include "quantize/quantize_block.cuh"
#include "quantize/quantize_math.cuh"
#include "quantize/smoothing.cuh"

namespace nvfp4_dit {
namespace {

constexpr int kThreads = launch::kQuantizeThreads;
// CTAs per SM for __launch_bounds__. sm_80/sm_90: 3 (80 registers): at 4 (64 registers) the K
// tile's values, live across its amax pass, spill and the local traffic reaches DRAM; at 2 fewer
// tiles are in flight than DRAM needs (both slower on the H100). sm_120/sm_121 compile without
// spills: 2 (128 registers), 1 for the MXFP8 tiles (152 registers at D = 128), the fp32 NVFP4
// and V^T tiles and the statistics tiles.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1200
constexpr int kMinCtasPerSm = 2;
// fp32 inputs keep twice the bytes of a 16-bit tile in registers: at 128 registers they spilled.
constexpr int kWideMinCtasPerSm = 1;
constexpr int kMxfp8MinCtasPerSm = 1;
constexpr int kKeyStatsMinCtasPerSm = 1;
#else
constexpr int kMinCtasPerSm = 3;
constexpr int kWideMinCtasPerSm = 3;
constexpr int kMxfp8MinCtasPerSm = 3;
// The statistics tiles keep a sum, a minimum and a maximum of 16 columns per thread (48
// registers) next to their loads in flight: two CTAs per SM (128 registers) hold them unspilled.
constexpr int kKeyStatsMinCtasPerSm = 2;
#endif
constexpr int kWarps = kThreads / 32;
constexpr int kVTileBytes = 32 * 1024;  // shared memory of one V sub-tile

////////////////////////////////////////////////////////////////////////////////////////////////
// Inputs

// 16 consecutive elements along D, kept in their input encoding (half the registers of fp32).
template <InputDtype DT>
struct Block16 {
  using Raw = typename InputTraits<DT>::Raw;
  static constexpr int kWords = 16 * int(sizeof(Raw)) / 4;
  uint32_t w[kWords];

  __device__ __forceinline__ float get(int e) const {
    if constexpr (sizeof(Raw) == 2) {
      const uint32_t word = w[e >> 1];
      return InputTraits<DT>::to_float((e & 1) ? (word >> 16) : (word & 0xFFFFu));
    } else {
      return __uint_as_float(w[e]);
    }
  }
  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int i = 0; i < kWords; ++i) w[i] = 0;
  }
};

__device__ __forceinline__ int64_t row_offset(const StridedInput& t, int64_t b, int64_t h, int64_t s) {
  return b * t.stride_b + h * t.stride_h + s * t.stride_s;
}

// The NVFP4 K/Q tiles and the V^T tiles (the MXFP8 K/Q tiles: kMxfp8MinCtasPerSm).
template <InputDtype DT>
constexpr int kTilesMinCtasPerSm = DT == InputDtype::kFloat32 ? kWideMinCtasPerSm : kMinCtasPerSm;

// The input row of sequence position s: itself, or for a video call its row in the caller's
// tensors (p.order, common/token_order.h), so the tiles come out in tile order without a permuted
// copy of the inputs. An inactive order is the identity.
__device__ __forceinline__ int64_t input_row(const QuantizeQkvParams& p, int64_t s) { return source_row(p.order, s); }

// Elements d0 .. d0+15 of one row: two (bf16/fp16) or four (fp32) 16-byte loads. Every input is
// read this way (D == Dp, unit stride along D, 16-byte aligned rows: the host copies any other).
template <InputDtype DT>
__device__ __forceinline__ void load_block16(Block16<DT>& blk, const typename InputTraits<DT>::Raw* row, int d0) {
  const uint4* p = reinterpret_cast<const uint4*>(row + d0);
#pragma unroll
  for (int i = 0; i < Block16<DT>::kWords / 4; ++i) {
    const uint4 t = __ldg(p + i);
    blk.w[4 * i + 0] = t.x;
    blk.w[4 * i + 1] = t.y;
    blk.w[4 * i + 2] = t.z;
    blk.w[4 * i + 3] = t.w;
  }
}

// The same 16 elements of an input of run-time dtype `dt` as fp32 values. The statistics kernels read
// at most kStatisticsTiles tiles of a head, so they take the dtype at run time: one instantiation
// per head dim serves every input. `row` points at the row's first element.
__device__ __forceinline__ void load_block16_as_float(Block16<InputDtype::kFloat32>& blk, const void* row, InputDtype dt,
                                                      int d0) {
  if (dt == InputDtype::kFloat32) {
    load_block16<InputDtype::kFloat32>(blk, static_cast<const uint32_t*>(row), d0);
    return;
  }
  Block16<InputDtype::kBFloat16> raw;  // the 16-bit words; bf16 or fp16 decode them
  load_block16<InputDtype::kBFloat16>(raw, static_cast<const uint16_t*>(row), d0);
#pragma unroll
  for (int e = 0; e < 16; ++e) {
    const uint32_t bits = (e & 1) ? raw.w[e >> 1] >> 16 : raw.w[e >> 1] & 0xFFFFu;
    const float x = dt == InputDtype::kBFloat16 ? InputTraits<InputDtype::kBFloat16>::to_float(bits)
                                                : InputTraits<InputDtype::kFloat16>::to_float(bits);
    blk.w[e] = __float_as_uint(x);
  }
}

// Row s of head (b, h) of input t, whose elements are `dt`.
__device__ __forceinline__ const void* input_row_address(const StridedInput& t, InputDtype dt, int64_t b, int64_t h,
                                                         int64_t s) {
  return static_cast<const char*>(t.ptr) + row_offset(t, b, h, s) * (dt == InputDtype::kFloat32 ? 4 : 2);
}

////////////////////////////////////////////////////////////////////////////////////////////////
// Shared memory and the CTA's column statistics

// Shared index of column c of a per-column vector: 4 floats of padding after every 16 columns.
__device__ __forceinline__ int padded_column(int c) { return c + (c >> 4) * 4; }

// Columns cb * 16 .. cb * 16 + 15 of such a vector as four 16-byte loads (the compiler cannot see
// through padded_column that they are contiguous and aligned, and issued up to 16 scalar loads).
__device__ __forceinline__ void load_column_block(const float* vec, int cb, float (&out)[16]) {
  load_floats16(vec + padded_column(cb * 16), out);
}

template <int DP>
struct SharedStorage {
  union {
    unsigned char v_tile[kVTileBytes];
    float red[kStatVectors][kWarps][DP];  // per-warp column statistics: sum, min, max
  };
  // Per-column vectors, column c at padded_column(c): a warp's eight column blocks then read
  // them as 16-byte vectors without bank conflicts (a pitch of 16 floats would put four
  // blocks on the same banks). A tile quantises fma(x, factor, -offset) = (x - mean) * factor.
  float offset[DP + DP / 4];  // mean * factor
  float factor[DP + DP / 4];  // a power of two: the channel balance (Q tiles: over the tensor scale)
  float km[DP + DP / 4];      // Q tiles: km of the tile's kv head (q . km)
  float mean[DP + DP / 4];    // Q tiles: the tile's column means qm
  float warp_partial[kWarps];
  int32_t input_rows[kTileRows];  // "rows" loads: each tile row's input row, relative to the tile's first
  ScaleTables tables;
  uint32_t last_arrival;  // this CTA added a head's last statistics tile
};

// Column statistics: per column, a sum, a minimum or a maximum over rows (NaN-propagating).
enum ColumnStat { kColumnSum, kColumnMin, kColumnMax };

__device__ __forceinline__ float combine_stat(ColumnStat kind, float a, float b) {
  return kind == kColumnSum ? a + b : kind == kColumnMin ? min_nan(a, b) : max_nan(a, b);
}

__device__ __forceinline__ float stat_identity(ColumnStat kind) {
  return kind == kColumnSum ? 0.0f : kind == kColumnMin ? INFINITY : -INFINITY;
}

// x combined over the CTA (a sum in a fixed warp order, deterministic; or a NaN-propagating min or
// max); every thread calls it (two barriers).
template <int DP>
__device__ __forceinline__ float cta_reduce(ColumnStat kind, float x, SharedStorage<DP>& sm) {
#pragma unroll
  for (int off = 16; off; off >>= 1) x = combine_stat(kind, x, __shfl_xor_sync(0xFFFFFFFFu, x, off));
  __syncthreads();  // earlier readers of warp_partial are done
  if ((threadIdx.x & 31) == 0) sm.warp_partial[threadIdx.x / 32] = x;
  __syncthreads();
  float r = sm.warp_partial[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) r = combine_stat(kind, r, sm.warp_partial[w]);
  return r;
}

template <int kStats>
__device__ __forceinline__ void init_column_stats(const ColumnStat (&kinds)[kStats], float (&st)[kStats][16]) {
#pragma unroll
  for (int i = 0; i < kStats; ++i)
#pragma unroll
    for (int e = 0; e < 16; ++e) st[i][e] = stat_identity(kinds[i]);
}

// Per-thread statistics of 16 columns (over this thread's rows) into the CTA's per-warp partials
// sm.red[i], the lanes that hold the same columns (lane % kColBlocks) combined first. The caller
// synchronises before reading them with cta_column_stats.
template <int kColBlocks, int DP, int kStats>
__device__ __forceinline__ void stage_column_stats(SharedStorage<DP>& sm, const ColumnStat (&kinds)[kStats],
                                                   float (&st)[kStats][16]) {
  static_assert(kStats <= kStatVectors, "one shared partial per statistic");
#pragma unroll
  for (int off = kColBlocks; off < 32; off <<= 1)
#pragma unroll
    for (int i = 0; i < kStats; ++i)
#pragma unroll
      for (int e = 0; e < 16; ++e) st[i][e] = combine_stat(kinds[i], st[i][e], __shfl_xor_sync(0xFFFFFFFFu, st[i][e], off));
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane < kColBlocks)
#pragma unroll
    for (int i = 0; i < kStats; ++i)
#pragma unroll
      for (int e = 0; e < 16; ++e) sm.red[i][warp][lane * 16 + e] = st[i][e];
}

// The CTA's statistics of column c (after the barrier that follows stage_column_stats), the warps
// in a fixed order (deterministic sums).
template <int DP, int kStats>
__device__ __forceinline__ void cta_column_stats(const SharedStorage<DP>& sm, const ColumnStat (&kinds)[kStats], int c,
                                                 float (&out)[kStats]) {
#pragma unroll
  for (int i = 0; i < kStats; ++i) {
    out[i] = stat_identity(kinds[i]);
#pragma unroll
    for (int w = 0; w < kWarps; ++w) out[i] = combine_stat(kinds[i], out[i], sm.red[i][w][c]);
  }
}

////////////////////////////////////////////////////////////////////////////////////////////////
// Work items 1: the K and V statistics, one statistics tile per item

// Item (bh, tensor, j): the sum, min and max per channel of statistics tile j of K (tensor 0) or V
// (1) of kv head bh over its valid keys (none when the head has fewer tiles). The CTA that adds a
// head's last tile finishes the head (finish_head_statistics: means, balance).
template <int DP>
__device__ __forceinline__ void key_stats_item(const QuantizeQkvParams& p, SharedStorage<DP>& sm, int64_t item) {
  constexpr int kColGroups = DP / 16;             // threads per row, 16 columns each
  constexpr int kRowsPerPass = kThreads / kColGroups;
  constexpr int kPasses = kTileRows / kRowsPerPass;  // every load of the tile in flight at once
  const int64_t bh = item / (kStatTensors * kStatisticsTiles);  // b * Hkv + kvh
  const int tensor = int(item / kStatisticsTiles % kStatTensors);
  const int64_t j = item % kStatisticsTiles;
  const int64_t b = bh / p.heads_kv, h = bh % p.heads_kv;
  const int64_t n_valid = valid_key_count(p, b);
  const int64_t key0 = j * statistics_stride(n_valid) * kTileRows;
  const StridedInput& in = tensor == 0 ? p.k : p.v;
  const int cg = threadIdx.x % kColGroups;
  const int r0 = threadIdx.x / kColGroups;

  constexpr ColumnStat kKinds[kStatVectors] = {kColumnSum, kColumnMin, kColumnMax};
  float st[kStatVectors][16];
  init_column_stats(kKinds, st);
  Block16<InputDtype::kFloat32> blk[kPasses];
#pragma unroll
  for (int u = 0; u < kPasses; ++u) {
    const int64_t key = key0 + u * kRowsPerPass + r0;
    blk[u].zero();
    if (key < n_valid) load_block16_as_float(blk[u], input_row_address(in, p.dtype, b, h, input_row(p, key)), p.dtype, cg * 16);
  }
#pragma unroll
  for (int u = 0; u < kPasses; ++u)
    if (key0 + u * kRowsPerPass + r0 < n_valid)
#pragma unroll
      for (int e = 0; e < 16; ++e) {
        const float xe = blk[u].get(e);
        st[0][e] += xe;
        st[1][e] = min_nan(st[1][e], xe);
        st[2][e] = max_nan(st[2][e], xe);
      }
  stage_column_stats<kColGroups>(sm, kKinds, st);
  __syncthreads();

  if (threadIdx.x < DP) {
    float* out = statistics_tile_partials(p, bh, tensor, j, DP);
    float stats[kStatVectors];
    cta_column_stats(sm, kKinds, threadIdx.x, stats);
#pragma unroll
    for (int i = 0; i < kStatVectors; ++i) out[i * DP + threadIdx.x] = stats[i];
  }
  // Publish the tile's statistics, then count arrivals; the last CTA of this head finishes it.
  if (!cta_arrived_last(arrivals(p) + bh, kStatTensors * kStatisticsTiles, sm.last_arrival)) return;
  const bool active = threadIdx.x < DP;
  const int c = active ? int(threadIdx.x) : 0;
  float tsum[kStatTensors][1], tlo[kStatTensors][1], thi[kStatTensors][1];
#pragma unroll
  for (int t = 0; t < kStatTensors; ++t) {
    tsum[t][0] = 0.0f;
    tlo[t][0] = INFINITY;
    thi[t][0] = -INFINITY;
    for (int64_t k = 0; k < kStatisticsTiles; ++k) {
      const float* st = statistics_tile_partials(p, bh, t, k, DP);
      tsum[t][0] += __ldcg(st + c);
      tlo[t][0] = min_nan(tlo[t][0], __ldcg(st + DP + c));
      thi[t][0] = max_nan(thi[t][0], __ldcg(st + 2 * DP + c));
    }
  }
  finish_head_statistics<1>(p, bh, c, active, DP, tsum, tlo, thi, [&sm](float x) { return cta_reduce(kColumnMax, x, sm); });
}

////////////////////////////////////////////////////////////////////////////////////////////////
// Work items 2: Q, K and V^T tiles

// Rows of a Q or K tile: thread (row r0 + kRowsPerPass * pass, column block cb).
template <int DP>
struct RowTileMap {
  static constexpr int kColBlocks = DP / 16;
  static constexpr int kRowsPerPass = kThreads / kColBlocks;
  static constexpr int kPasses = kTileRows / kRowsPerPass;
};

// Where 128-row tile `tile` of a Q or K input lies (head bh = b * heads + h, block blk from row
// row0, valid_rows rows of data before the padding) and this thread's place in it (RowTileMap).
template <int DP>
struct RowTile {
  int64_t bh, blk, b, h, row0;
  int valid_rows, cb, r0;

  __device__ __forceinline__ RowTile(int64_t tile, int64_t n_blocks, int64_t heads, int64_t seq_valid)
      : bh(tile / n_blocks), blk(tile % n_blocks), b(bh / heads), h(bh % heads), row0(blk * kTileRows),
        valid_rows(int(rows_below(seq_valid, row0, kTileRows))),
        cb(int(threadIdx.x) % RowTileMap<DP>::kColBlocks), r0(int(threadIdx.x) / RowTileMap<DP>::kColBlocks) {}

  __device__ __forceinline__ static RowTile queries(const QuantizeQkvParams& p, int64_t tile) {
    return RowTile(tile, p.seq_q_padded / kTileRows, p.heads_q, p.seq_q);
  }
  // Keys past kv_lens[b] are padding like the keys past seq_k (format.quantize_qkv).
  __device__ __forceinline__ static RowTile keys(const QuantizeQkvParams& p, int64_t tile) {
    const int64_t n_blocks = p.seq_k_padded / kTileRows;
    return RowTile(tile, n_blocks, p.heads_kv, valid_key_count(p, tile / n_blocks / p.heads_kv));
  }
  // The kv head a Q tile reads (b * Hkv + kvh).
  __device__ __forceinline__ int64_t kv_head(const QuantizeQkvParams& p) const {
    return b * p.heads_kv + h / (p.heads_q / p.heads_kv);
  }

  // Loads this thread's kPasses blocks of 16 columns of input t into x (zeros past valid_rows).
  // A video call's loads (an active p.order) first stage the tile's input rows in shared memory (one
  // barrier): computed at each load site, next to the zeroed registers of every pass, they spilled
  // at 128 registers.
  // kAnyDtype (x holds fp32): the input's dtype is p.dtype, read with load_block16_as_float.
  template <InputDtype DT, bool kAnyDtype = false>
  __device__ __forceinline__ void load(const QuantizeQkvParams& p, const StridedInput& t, int32_t* input_rows,
                                       Block16<DT> (&x)[RowTileMap<DP>::kPasses]) const {
    static_assert(!kAnyDtype || DT == InputDtype::kFloat32, "any dtype is read as fp32");
    using Raw = typename InputTraits<DT>::Raw;
    const bool ordered = token_order_active(p.order);  // uniform across the CTA
    if (ordered) {
      if (threadIdx.x < kTileRows) input_rows[threadIdx.x] = int32_t(input_row(p, row0 + threadIdx.x) - row0);
      __syncthreads();
    }
    const Raw* base = static_cast<const Raw*>(t.ptr) + row_offset(t, b, h, row0);
#pragma unroll
    for (int ps = 0; ps < RowTileMap<DP>::kPasses; ++ps) {
      const int r = r0 + ps * RowTileMap<DP>::kRowsPerPass;
      x[ps].zero();
      if (r < valid_rows) {
        const int rel = ordered ? input_rows[r] : r;
        if constexpr (kAnyDtype) {
          load_block16_as_float(x[ps], input_row_address(t, p.dtype, b, h, row0 + rel), p.dtype, cb * 16);
        } else {
          load_block16<DT>(x[ps], base + rel * t.stride_s, cb * 16);
        }
      }
    }
  }
};

// Column c's sum over a row tile's registers (rows past valid_rows hold zeros) for thread c < DP,
// 0 for the others; every thread calls it (one barrier, after which the staged partials may be
// read).
template <int DP, InputDtype DT>
__device__ __forceinline__ float tile_column_sum(SharedStorage<DP>& sm, const Block16<DT> (&x)[RowTileMap<DP>::kPasses]) {
  using Map = RowTileMap<DP>;
  constexpr ColumnStat kKinds[1] = {kColumnSum};
  float st[1][16];
  init_column_stats(kKinds, st);
#pragma unroll
  for (int ps = 0; ps < Map::kPasses; ++ps)
#pragma unroll
    for (int e = 0; e < 16; ++e) st[0][e] += x[ps].get(e);
  stage_column_stats<Map::kColBlocks>(sm, kKinds, st);
  __syncthreads();
  float sum[1] = {0.0f};
  if (threadIdx.x < DP) cta_column_stats(sm, kKinds, threadIdx.x, sum);
  return sum[0];
}

// Loads 128-row Q tile `tile` (of [B, H, Sqp/128] tiles) into registers and its column means over
// the valid rows into sm.mean; thread c < DP also returns qm_c. Ends with a barrier. Shared by the
// Q tiles and the balance statistics, which then take max |fl(q - qm)| from the registers: two
// passes over registers rather than a min and a max per column, which would not fit in 64 of them.
template <InputDtype DT, int DP, bool kAnyDtype = false>
__device__ __forceinline__ float q_tile_load(const QuantizeQkvParams& p, SharedStorage<DP>& sm,
                                             const RowTile<DP>& t, Block16<DT> (&x)[RowTileMap<DP>::kPasses]) {
  using Map = RowTileMap<DP>;
  t.template load<DT, kAnyDtype>(p, p.q, sm.input_rows, x);
  const float sum = tile_column_sum(sm, x);
  float qm = 0.0f;
  if (threadIdx.x < DP) {
    qm = __fdiv_rn(sum, float(t.valid_rows > 0 ? t.valid_rows : 1));
    sm.mean[padded_column(threadIdx.x)] = qm;
  }
  __syncthreads();
  return qm;
}

// max over this thread's valid rows of |fl(q - qm)| * scale per column (scale a power of two per
// column, or 1), into dev[e] (kPerColumn) or one value: exactly the magnitudes format.quantize_qkv
// takes its maxima of. NaN-propagating; 0 without valid rows.
template <bool kPerColumn, InputDtype DT, int DP>
__device__ __forceinline__ void q_tile_deviation(const SharedStorage<DP>& sm, const RowTile<DP>& t,
                                                 const Block16<DT> (&x)[RowTileMap<DP>::kPasses], const float* scale,
                                                 float (&dev)[kPerColumn ? 16 : 1]) {
  using Map = RowTileMap<DP>;
  float m[16], f[16];
  load_column_block(sm.mean, t.cb, m);
  if (scale != nullptr) load_column_block(scale, t.cb, f);
#pragma unroll
  for (int e = 0; e < (kPerColumn ? 16 : 1); ++e) dev[e] = 0.0f;
#pragma unroll
  for (int ps = 0; ps < Map::kPasses; ++ps)
    if (t.r0 + ps * Map::kRowsPerPass < t.valid_rows)
#pragma unroll
      for (int e = 0; e < 16; ++e) {
        const float d = fabsf(__fsub_rn(x[ps].get(e), m[e])) * (scale != nullptr ? f[e] : 1.0f);
        float& slot = dev[kPerColumn ? e : 0];
        slot = max_nan(slot, d);
      }
}

// The mean pairwise cosine of the block's raw rows, for the block-sparse estimate: with x_i the
// unit rows (0 for a zero row) and n the nonzero rows, (|sum x_i|^2 - n) / (n (n - 1)); 1 for
// n < 2. Ends with a barrier.
template <InputDtype DT, int DP>
__device__ __forceinline__ void q_tile_similarity(const QuantizeQkvParams& p, SharedStorage<DP>& sm,
                                                  const RowTile<DP>& t, const Block16<DT> (&x)[RowTileMap<DP>::kPasses],
                                                  int64_t tile) {
  using Map = RowTileMap<DP>;
  constexpr ColumnStat kKinds[1] = {kColumnSum};
  float st[1][16];
  init_column_stats(kKinds, st);
  float nonzero = 0.0f;
  // One pass over the registers: each row's norm, then its unit row into the column sums.
#pragma unroll
  for (int ps = 0; ps < Map::kPasses; ++ps) {
    float n2 = 0.0f;
#pragma unroll
    for (int e = 0; e < 16; ++e) n2 = fmaf(x[ps].get(e), x[ps].get(e), n2);
    // The kColBlocks threads of a row are consecutive lanes.
#pragma unroll
    for (int off = 1; off < Map::kColBlocks; off <<= 1) n2 += __shfl_xor_sync(0xFFFFFFFFu, n2, off);
    const bool row = t.r0 + ps * Map::kRowsPerPass < t.valid_rows && n2 > 0.0f;
    const float inv = row ? rsqrtf(n2) : 0.0f;
    if (row && t.cb == 0) nonzero += 1.0f;
#pragma unroll
    for (int e = 0; e < 16; ++e) st[0][e] = fmaf(x[ps].get(e), inv, st[0][e]);
  }
  stage_column_stats<Map::kColBlocks>(sm, kKinds, st);
  __syncthreads();
  float s2 = 0.0f;
  if (threadIdx.x < DP) {
    float col[1];
    cta_column_stats(sm, kKinds, threadIdx.x, col);
    s2 = col[0] * col[0];
  }
  s2 = cta_reduce(kColumnSum, s2, sm);
  const float n = cta_reduce(kColumnSum, nonzero, sm);
  if (threadIdx.x == 0) p.q_similarity[tile] = n >= 2.0f ? (s2 - n) / (n * (n - 1.0f)) : 1.0f;
}

// Bytes of one Q/K row's data and scales, and of one thread's 16 columns, in Q·Kᵀ format QkFmt
// (attention/qk_format.cuh: NVFP4 or MXFP8).
template <int DP, class QkFmt>
struct QkRowBytes {
  static constexpr bool kMx = QkFmt::kBits == 8;
  static constexpr int kData = kMx ? DP : DP / 2;
  static constexpr int kScales = kMx ? DP / 32 : DP / 16;
  static constexpr int kBlockData = kMx ? 16 : 8;
  // The scale byte of column block cb (MXFP8: written by the even lane of each pair).
  __device__ __forceinline__ static int scale_col(int cb) { return kMx ? cb / 2 : cb; }
};

// Quantise this thread's 16 values v of a Q or K row (zeros for padding rows) and store them at
// data / sf (the thread's place in its row): NVFP4 blocks of 16, or half an MXFP8 block of 32
// (every lane takes part: the pair shares its amax). Lowers `headroom` to the block's
// (scale_headroom). Returns whether a valid row met NaN/inf.
template <int DP, class QkFmt>
__device__ __forceinline__ bool quantize_qk_block(const float (&v)[16], bool valid, const ScaleTables& tables,
                                                  int cb, uint8_t* data, uint8_t* sf, int& headroom) {
  if constexpr (QkFmt::kBits == 8) {
    uint32_t w[4], sf_bits;
    const bool nonfinite = quantize_mx_half32(v, w, sf_bits);
    store_u128(data, w);
    if ((cb & 1) == 0) *sf = static_cast<uint8_t>(sf_bits);
    headroom = min(headroom, mxfp8_scale_headroom(sf_bits, w));
    return nonfinite && valid;
  } else {
    uint32_t lo = 0, hi = 0, sf_bits = 0;
    const bool nonfinite = valid && quantize_block16(v, tables, lo, hi, sf_bits);
    store_u64(data, lo, hi);
    *sf = static_cast<uint8_t>(sf_bits);
    headroom = min(headroom, nvfp4_scale_headroom(sf_bits));
    return nonfinite;
  }
}

// Q tile `tile`'s block mean qm over its valid rows (q_mean: the smoothing basis and the block-sparse
// estimate read it) and its rows' similarity, before the basis kernel.
template <InputDtype DT, int DP>
__device__ __forceinline__ void q_means_tile(const QuantizeQkvParams& p, SharedStorage<DP>& sm, int64_t tile) {
  const RowTile<DP> t = RowTile<DP>::queries(p, tile);
  Block16<DT> x[RowTileMap<DP>::kPasses];
  const float qm = q_tile_load<DT, DP>(p, sm, t, x);
  if (threadIdx.x < DP) p.q_mean[tile * DP + threadIdx.x] = qm;
  q_tile_similarity<DT, DP>(p, sm, t, x, tile);
}

template <InputDtype DT, int DP, class QkFmt>
__device__ __forceinline__ void q_tile(const QuantizeQkvParams& p, SharedStorage<DP>& sm, int64_t tile) {
  using Map = RowTileMap<DP>;
  const RowTile<DP> t = RowTile<DP>::queries(p, tile);  // tile = bh * n_blocks + blk
  const int64_t bhk = t.kv_head(p);
  const int cb = t.cb, r0 = t.r0, valid_rows = t.valid_rows;

  Block16<DT> x[Map::kPasses];
  t.template load<DT>(p, p.q, sm.input_rows, x);
  // The block's smoothing mean m = g + basis^T a (the basis kernel's), its tensor scale
  // t(max |fl(q - m_c)| * s_c); then quantise (q - m) * s_c / t.
  const int c = int(threadIdx.x);
  const float qm = c < DP ? __ldcg(p.q_smooth_mean + tile * DP + c) : 0.0f;
  const float s = c < DP ? p.balance[bhk * DP + c] : 1.0f;
  if (c < DP) {
    sm.mean[padded_column(c)] = qm;
    sm.factor[padded_column(c)] = s;
  }
  __syncthreads();
  float dev[1];
  q_tile_deviation<false>(sm, t, x, sm.factor, dev);
  const float q_scale = tensor_scale(cta_reduce(kColumnMax, dev[0], sm));  // powers of two: exact
  if (c < DP) {
    const float f = __fdiv_rn(s, q_scale);
    sm.factor[padded_column(c)] = f;
    sm.offset[padded_column(c)] = qm * f;
    sm.km[padded_column(c)] = __ldcg(p.k_mean + bhk * DP + c);
    if (c == 0) p.q_scale[tile] = q_scale;
  }
  fill_scale_tables(sm.tables);
  __syncthreads();

  // This thread's outputs of pass 0; pass ps writes kRowsPerPass * ps rows further.
  using Row = QkRowBytes<DP, QkFmt>;
  uint8_t* data = p.q_data + (tile * kTileRows + r0) * Row::kData + cb * Row::kBlockData;
  uint8_t* sf = p.q_sf + (tile * kTileRows + r0) * Row::kScales + Row::scale_col(cb);
  bool nonfinite = false;
#pragma unroll
  for (int ps = 0; ps < Map::kPasses; ++ps) {
    const int r = r0 + ps * Map::kRowsPerPass;
    float dot = 0.0f;
    float v[16] = {};
    if (r < valid_rows) {
      float off[16], f[16], km[16];
      load_column_block(sm.offset, cb, off);
      load_column_block(sm.factor, cb, f);
      load_column_block(sm.km, cb, km);
#pragma unroll
      for (int e = 0; e < 16; ++e) {
        const float xe = x[ps].get(e);
        v[e] = fmaf(xe, f[e], -off[e]);  // (x - qm) * f, one rounding: f is a power of two
        dot = fmaf(xe, km[e], dot);
      }
    }
    int unused_headroom = kAnyShift;  // a Q block's scale is its own
    nonfinite |= quantize_qk_block<DP, QkFmt>(v, r < valid_rows, sm.tables, cb,
                                            data + ps * Map::kRowsPerPass * Row::kData,
                                            sf + ps * Map::kRowsPerPass * Row::kScales, unused_headroom);
    // q . km: the kColBlocks threads of a row are consecutive lanes.
#pragma unroll
    for (int off = 1; off < Map::kColBlocks; off <<= 1) dot += __shfl_xor_sync(0xFFFFFFFFu, dot, off);
    if (cb == 0 && r < valid_rows) p.q_dot_km[t.bh * p.seq_q + t.row0 + r] = dot;
  }
  raise_flag(p.nonfinite_q_blocks + tile, nonfinite);
}

// The per-column factor and offset of a K or V^T tile of kv head bh before its tensor scale: K
// takes (k - km) / s_c, V v - vm (s_c a power of two: exact), as fma(x, factor, -offset).
template <int DP>
__device__ __forceinline__ void key_tile_columns(const QuantizeQkvParams& p, SharedStorage<DP>& sm, int64_t bh,
                                                 bool values) {
  const int c = int(threadIdx.x);
  if (c < DP) {
    const float f = values ? 1.0f : __frcp_rn(p.balance[bh * DP + c]);
    const float mean = __ldcg((values ? p.v_mean : p.k_mean) + bh * DP + c);
    sm.factor[padded_column(c)] = f;
    sm.offset[padded_column(c)] = mean * f;
    sm.km[padded_column(c)] = mean;
  }
}

// The tensor scale 2^exponent of a K or V tile: its own (own_scale, the tiles pass: the exponent of
// its amax, recorded by record_tile_scale) or its head's `head` (the fix-up pass re-quantising a
// tile). Every thread calls it alike (cta_reduce's barriers) and gets the same.
template <int DP>
__device__ __forceinline__ int tile_scale_exponent(SharedStorage<DP>& sm, bool own_scale, int head, float amax,
                                                   float& tile_amax) {
  if (!own_scale) return head;
  tile_amax = cta_reduce(kColumnMax, amax, sm);
  return tensor_scale_exponent(tile_amax);
}

// Records a tile quantised under its own tensor scale 2^exponent: the exponent and the headroom of
// its scale bytes (the least over its blocks) for the fix-up pass, and raises its head's slot.
template <int DP>
__device__ __forceinline__ void record_tile_scale(const QuantizeQkvParams& p, SharedStorage<DP>& sm, int tensor,
                                                  int64_t tile, int64_t bh, int exponent, float tile_amax,
                                                  int headroom) {
  const int least = int(cta_reduce(kColumnMin, float(headroom), sm));  // small integers: exact in fp32
  if (threadIdx.x != 0) return;
  int32_t* record = tile_record(p, tensor, tile);
  record[0] = exponent;
  record[1] = least;
  if (!(tile_amax <= FLT_MAX)) atomicMax(head_exponent_slot(p, bh, tensor), kNonfiniteExponent);
  else if (tile_amax > 0.0f) atomicMax(head_exponent_slot(p, bh, tensor), uint32_t(exponent + kExponentBias));
}

// The key projections of K tile `tile` (smoothing.key_projections) for each query head of its kv
// head: u_j = [g . k'_j (+ key_bias_j / scale), (basis_i . k'_j) s] of the tile's keys, k' = k - km (0 past
// the valid keys), each an fp32 sum over the columns in order, then fp16 under the tile's power of
// two (smoothing.projection_exponents). Runs after the tile's quantisation, when its registers are
// free: the rows come again from L2, a pass of kRows keys at a time staged in shared memory as k',
// and thread t sums key t / kPerRow's projection columns (t % kPerRow) * kCols .. + kCols.
template <InputDtype DT, int DP>
__device__ __forceinline__ void key_tile_projections(const QuantizeQkvParams& p, SharedStorage<DP>& sm,
                                                     const RowTile<DP>& t) {
  using Map = RowTileMap<DP>;
  using Raw = typename InputTraits<DT>::Raw;
  constexpr int kRows = Map::kRowsPerPass;  // keys per staged pass
  constexpr int kCols = kRows * kKeyProjectionColumns / kThreads;
  constexpr int kPerRow = kKeyProjectionColumns / kCols;
  constexpr int kPitch = DP + 4;            // 16-byte row reads of 8 keys fall on distinct banks
  static_assert(kCols * kPerRow == kKeyProjectionColumns && kRows * kPerRow == kThreads, "thread layout");
  static_assert((kRows * kPitch + kKeyProjectionColumns * DP) * 4 <= kVTileBytes, "staging fits v_tile");
  float* staged = reinterpret_cast<float*>(sm.v_tile);
  float* weights = staged + kRows * kPitch;  // [kKeyProjectionColumns][DP]: g, then the basis rows
  const int64_t group = p.heads_q / p.heads_kv;
  const int row = int(threadIdx.x) / kPerRow, col0 = (int(threadIdx.x) % kPerRow) * kCols;
  const bool ordered = token_order_active(p.order);  // sm.input_rows holds the tile's rows (RowTile::load)
  const Raw* base = static_cast<const Raw*>(p.k.ptr) + row_offset(p.k, t.b, t.h, t.row0);
  for (int64_t g = 0; g < group; ++g) {
    const int64_t bhq = t.b * p.heads_q + t.h * group + g;
    __syncthreads();  // the previous readers of the staging area are done
    for (int i = threadIdx.x; i < kKeyProjectionColumns * DP; i += kThreads) {
      const int r = i / DP, c = i % DP;
      weights[i] = r == 0 ? __ldcg(p.q_center + bhq * DP + c) : __ldcg(p.q_basis + (bhq * kBasisRank + r - 1) * DP + c);
    }
    const float basis_scale = __ldcg(p.q_basis_scale + bhq);
    float u[Map::kPasses][kCols];
    float amax = 0.0f;
#pragma unroll 1
    for (int ps = 0; ps < Map::kPasses; ++ps) {
      {  // this thread's 16 columns of the pass's row t.r0, as k'
        const int r = t.r0 + ps * kRows;
        Block16<DT> blk;
        blk.zero();
        if (r < t.valid_rows) load_block16<DT>(blk, base + (ordered ? sm.input_rows[r] : r) * p.k.stride_s, t.cb * 16);
        float km[16];
        load_column_block(sm.km, t.cb, km);
        float* dst = staged + t.r0 * kPitch + t.cb * 16;
#pragma unroll
        for (int e = 0; e < 16; e += 4) {
          float4 v;
          v.x = r < t.valid_rows ? __fsub_rn(blk.get(e), km[e]) : 0.0f;
          v.y = r < t.valid_rows ? __fsub_rn(blk.get(e + 1), km[e + 1]) : 0.0f;
          v.z = r < t.valid_rows ? __fsub_rn(blk.get(e + 2), km[e + 2]) : 0.0f;
          v.w = r < t.valid_rows ? __fsub_rn(blk.get(e + 3), km[e + 3]) : 0.0f;
          *reinterpret_cast<float4*>(dst + e) = v;
        }
      }
      __syncthreads();
      float acc[kCols];
#pragma unroll
      for (int j = 0; j < kCols; ++j) acc[j] = 0.0f;
      const float* key = staged + row * kPitch;
#pragma unroll 4
      for (int c = 0; c < DP; c += 4) {
        const float4 k4 = *reinterpret_cast<const float4*>(key + c);
#pragma unroll
        for (int j = 0; j < kCols; ++j) {
          const float4 w4 = *reinterpret_cast<const float4*>(weights + (col0 + j) * DP + c);
          acc[j] = fmaf(w4.x, k4.x, acc[j]);
          acc[j] = fmaf(w4.y, k4.y, acc[j]);
          acc[j] = fmaf(w4.z, k4.z, acc[j]);
          acc[j] = fmaf(w4.w, k4.w, acc[j]);
        }
      }
      const int64_t key_index = t.row0 + ps * kRows + row;  // in the tiles' order
      if (col0 == 0 && p.key_bias != nullptr && key_index < p.seq_k)
        acc[0] += __fdiv_rn(p.key_bias[t.b * p.key_bias_stride_b + (t.h * group + g) * p.key_bias_stride_h + key_index],
                            p.scale);
#pragma unroll
      for (int j = 0; j < kCols; ++j) {
        if (col0 + j > 0) acc[j] *= basis_scale;  // a power of two: exact
        u[ps][j] = acc[j];
        if (isfinite(acc[j])) amax = fmaxf(amax, fabsf(acc[j]));
      }
      __syncthreads();  // the staged rows are consumed
    }
    amax = cta_reduce(kColumnMax, amax, sm);
    int amax_exponent = 0;
    frexpf(amax > 0.0f ? amax : 1.0f, &amax_exponent);
    const int exponent = amax > 0.0f ? min(max(amax_exponent - 15, -126), 111) : -126;
    const float inverse = power_of_two(-exponent);
    if (threadIdx.x == 0) p.key_proj_factor[bhq * (p.seq_k_padded / kTileRows) + t.blk] = power_of_two(exponent);
#pragma unroll
    for (int ps = 0; ps < Map::kPasses; ++ps) {
      uint32_t h[kCols];
#pragma unroll
      for (int j = 0; j < kCols; ++j) {
        const float v = u[ps][j] * inverse;
        h[j] = __half_as_ushort(__float2half_rn(isfinite(u[ps][j]) ? fminf(fmaxf(v, -65504.0f), 65504.0f) : v));
      }
      uint16_t* out = p.key_proj + (bhq * p.seq_k_padded + t.row0 + ps * kRows + row) * kKeyProjectionColumns + col0;
      if constexpr (kCols == 2) {
        *reinterpret_cast<uint32_t*>(out) = h[0] | (h[1] << 16);
      } else {
        *reinterpret_cast<uint2*>(out) = make_uint2(h[0] | (h[1] << 16), h[2] | (h[3] << 16));
      }
    }
  }
}

// A K tile under its own tensor scale (own_scale: the tiles pass) or its head's 2^head_exponent (the
// fix-up pass quantising it again). Both passes reach it from one call site (tiles_or_fix_up), so
// each entry point holds one inlined copy; own_scale is uniform, its branches cost nothing
// measurable.
template <InputDtype DT, int DP, class QkFmt>
__device__ __forceinline__ void k_tile(const QuantizeQkvParams& p, SharedStorage<DP>& sm, int64_t tile, bool own_scale,
                                    int head_exponent) {
  using Map = RowTileMap<DP>;
  const RowTile<DP> t = RowTile<DP>::keys(p, tile);  // tile = bh * n_blocks + blk
  const int64_t bh = t.bh;
  const int cb = t.cb, r0 = t.r0, valid_rows = t.valid_rows;
  Block16<DT> x[Map::kPasses];
  t.template load<DT>(p, p.k, sm.input_rows, x);
  // While the loads are in flight: km and the balance (written by the previous launch), the tables.
  key_tile_columns(p, sm, bh, false);
  fill_scale_tables(sm.tables);
  // The tile's mean of the raw keys, for the block-sparse estimate (its barrier also publishes the
  // tables and columns above).
  const float key_sum = tile_column_sum(sm, x);
  if (threadIdx.x < DP) p.k_tile_mean[tile * DP + threadIdx.x] = valid_rows > 0 ? __fdiv_rn(key_sum, float(valid_rows)) : 0.0f;

  float amax = 0.0f, tile_amax = 0.0f;
  if (own_scale) {
    // four columns at a time: the tile's values stay live across this pass, so it holds few more
    const float4* off4 = reinterpret_cast<const float4*>(sm.offset + padded_column(cb * 16));
    const float4* f4 = reinterpret_cast<const float4*>(sm.factor + padded_column(cb * 16));
#pragma unroll
    for (int g = 0; g < 4; ++g) {
      const float4 off = off4[g], f = f4[g];
#pragma unroll
      for (int ps = 0; ps < Map::kPasses; ++ps)
        if (r0 + ps * Map::kRowsPerPass < valid_rows) {
          amax = max_nan(amax, fabsf(fmaf(x[ps].get(4 * g), f.x, -off.x)));
          amax = max_nan(amax, fabsf(fmaf(x[ps].get(4 * g + 1), f.y, -off.y)));
          amax = max_nan(amax, fabsf(fmaf(x[ps].get(4 * g + 2), f.z, -off.z)));
          amax = max_nan(amax, fabsf(fmaf(x[ps].get(4 * g + 3), f.w, -off.w)));
        }
    }
  }
  const int exponent = tile_scale_exponent(sm, own_scale, head_exponent, amax, tile_amax);
  const float inverse = power_of_two(-exponent);

  // This thread's outputs of pass 0, rows permuted; pass ps writes kRowsPerPass * ps rows further
  // (the permutation stays inside 32-row groups).
  static_assert(Map::kRowsPerPass % 32 == 0, "passes move whole 32-key groups");
  using Row = QkRowBytes<DP, QkFmt>;
  uint8_t* data = p.k_data + (tile * kTileRows + k_row_perm(r0)) * Row::kData + cb * Row::kBlockData;
  uint8_t* sf = p.k_sf + (tile * kTileRows + k_row_perm(r0)) * Row::kScales + Row::scale_col(cb);
  bool nonfinite = false;
  int headroom = kAnyShift;
#pragma unroll
  for (int ps = 0; ps < Map::kPasses; ++ps) {
    const int r = r0 + ps * Map::kRowsPerPass;
    float v[16] = {};
    if (r < valid_rows) {
      float off[16], f[16];
      load_column_block(sm.offset, cb, off);
      load_column_block(sm.factor, cb, f);
      // fl((k - km) / s) / t, as format.quantize_qkv rounds it (t a power of two)
#pragma unroll
      for (int e = 0; e < 16; ++e) v[e] = fmaf(x[ps].get(e), f[e], -off[e]) * inverse;
    }
    nonfinite |= quantize_qk_block<DP, QkFmt>(v, r < valid_rows, sm.tables, cb,
                                            data + ps * Map::kRowsPerPass * Row::kData,
                                            sf + ps * Map::kRowsPerPass * Row::kScales, headroom);
  }
  raise_flag(p.nonfinite_kv + bh, nonfinite);
  if (own_scale) {
    record_tile_scale(p, sm, 0, tile, bh, exponent, tile_amax, headroom);
    key_tile_projections<DT, DP>(p, sm, t);
  }
}

// A V^T tile, under its own or its head's tensor scale as k_tile.
template <InputDtype DT, int DP>
__device__ __forceinline__ void v_tile(const QuantizeQkvParams& p, SharedStorage<DP>& sm, int64_t tile, bool own_scale,
                                    int head_exponent) {
  using Raw = typename InputTraits<DT>::Raw;
  // A sub-tile of kSubRows tokens x DP fits kVTileBytes; fp32 input needs two per 128 rows.
  constexpr int kSubRows = kVTileBytes / (DP * int(sizeof(Raw))) < kTileRows
                               ? kVTileBytes / (DP * int(sizeof(Raw)))
                               : kTileRows;
  constexpr int kBlocksPerCol = kSubRows / 16;          // 16-token blocks per d in a sub-tile
  constexpr int kCols = 4 / int(sizeof(Raw));            // columns per 32-bit shared word
  constexpr int kColGroups = DP / kCols;
  constexpr int kThreadsPerGroup = kThreads / kColGroups;  // threads sharing one column group
  constexpr int kBlocksPerThread = kBlocksPerCol / kThreadsPerGroup;
  static_assert((kBlocksPerThread == 1 || kBlocksPerThread == 2) && kBlocksPerCol % kThreadsPerGroup == 0,
                "V tile split");
  constexpr int kChunksPerRow = DP * int(sizeof(Raw)) / 16;  // 16-byte chunks of one token row

  const int64_t n_blocks = p.seq_k_padded / kTileRows;
  const int64_t blk = tile % n_blocks;
  const int64_t bh = tile / n_blocks;
  const int64_t b = bh / p.heads_kv, h = bh % p.heads_kv;
  const int cg = threadIdx.x % kColGroups;
  const int part = threadIdx.x / kColGroups;
  const int64_t n_valid = valid_key_count(p, b);  // keys past kv_lens[b] are zero padding
  Raw* stile = reinterpret_cast<Raw*>(sm.v_tile);
  const Raw* base = static_cast<const Raw*>(p.v.ptr) + row_offset(p.v, b, h, 0);
  key_tile_columns(p, sm, bh, true);  // read after the first barrier below
  constexpr int kSubTiles = kTileRows / kSubRows;
  int exponent = head_exponent, headroom = kAnyShift;
  float tile_amax = 0.0f;
  if constexpr (kSubTiles > 1) {
    if (own_scale) {  // the tile's amax before its first sub-tile (fp32, D = 128): the loads then hit L2
      __syncthreads();  // the columns
      float amax = 0.0f;
      for (int i = threadIdx.x; i < kTileRows * DP; i += kThreads) {
        const int64_t tok = blk * kTileRows + i / DP;
        const int dd = i % DP;
        if (tok < n_valid) {
          const float x = InputTraits<DT>::to_float(base[input_row(p, tok) * p.v.stride_s + dd]);
          amax = max_nan(amax, fabsf(fmaf(x, sm.factor[padded_column(dd)], -sm.offset[padded_column(dd)])));
        }
      }
      exponent = tile_scale_exponent(sm, own_scale, head_exponent, amax, tile_amax);
    }
  }

  for (int sub = 0; sub < kSubTiles; ++sub) {
    const int64_t tok0 = blk * kTileRows + sub * kSubRows;
    if (sub) __syncthreads();  // the previous sub-tile is consumed
    // Every load of the sub-tile in flight at once (one memory latency), then the stores.
    constexpr int kLoads = kSubRows * kChunksPerRow / kThreads;
    static_assert(kSubRows * kChunksPerRow % kThreads == 0, "whole 16-byte chunks per thread");
    uint4 val[kLoads];
#pragma unroll
    for (int j = 0; j < kLoads; ++j) {
      const int i = int(threadIdx.x) + j * kThreads;
      const int64_t tok = tok0 + i / kChunksPerRow;
      val[j] = make_uint4(0, 0, 0, 0);
      if (tok < n_valid)
        val[j] = __ldg(reinterpret_cast<const uint4*>(base + input_row(p, tok) * p.v.stride_s) + i % kChunksPerRow);
    }
#pragma unroll
    for (int j = 0; j < kLoads; ++j) reinterpret_cast<uint4*>(stile)[int(threadIdx.x) + j * kThreads] = val[j];
    __syncthreads();

    // Each thread reads one 32-bit word per token: kCols adjacent columns (two 16-bit or one
    // fp32 element; a warp reads 128 contiguous bytes of a token row, conflict-free), and
    // quantizes kBlocksPerThread consecutive 16-token blocks of each of those columns. Tokens
    // past n_valid are padding: 0, not (0 - vm) / v_scale.
    uint32_t words[kCols][2 * kBlocksPerThread];
    uint32_t sfs[kCols] = {};
    bool nonfinite = false;
    float f[kCols], off[kCols];
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      f[c] = sm.factor[padded_column(cg * kCols + c)];
      off[c] = sm.offset[padded_column(cg * kCols + c)];
    }
    const uint32_t* swords = reinterpret_cast<const uint32_t*>(sm.v_tile);
    if constexpr (kSubTiles == 1) {
      if (own_scale) {  // the tile's amax from the staged tile
        float amax = 0.0f;
#pragma unroll
        for (int i = 0; i < kBlocksPerThread; ++i)
#pragma unroll
          for (int e = 0; e < 16; ++e) {
            const int tb = part * kBlocksPerThread + i;
            const uint32_t w = swords[(tb * 16 + e) * (DP / kCols) + cg];
            if (tok0 + tb * 16 + e < n_valid) {
#pragma unroll
              for (int c = 0; c < kCols; ++c) {
                const uint32_t bits = kCols == 2 ? (c ? w >> 16 : w & 0xFFFFu) : w;
                amax = max_nan(amax, fabsf(fmaf(InputTraits<DT>::to_float(bits), f[c], -off[c])));
              }
            }
          }
        exponent = tile_scale_exponent(sm, own_scale, head_exponent, amax, tile_amax);
      }
    }
    const float inverse = power_of_two(-exponent);
#pragma unroll
    for (int i = 0; i < kBlocksPerThread; ++i) {
      const int tb = part * kBlocksPerThread + i;
      float v[kCols][16];
#pragma unroll
      for (int e = 0; e < 16; ++e) {
        const uint32_t w = swords[(tb * 16 + e) * (DP / kCols) + cg];
        const bool valid = tok0 + tb * 16 + e < n_valid;
        // fl(v - vm) / t, as format.quantize_qkv rounds it (t a power of two)
        if constexpr (kCols == 2) {
          v[0][e] = valid ? fmaf(InputTraits<DT>::to_float(w & 0xFFFFu), f[0], -off[0]) * inverse : 0.0f;
          v[1][e] = valid ? fmaf(InputTraits<DT>::to_float(w >> 16), f[1], -off[1]) * inverse : 0.0f;
        } else {
          v[0][e] = valid ? fmaf(InputTraits<DT>::to_float(w), f[0], -off[0]) * inverse : 0.0f;
        }
      }
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        uint32_t sf_bits;
        nonfinite |= quantize_block16(v[c], sm.tables, words[c][2 * i], words[c][2 * i + 1], sf_bits);
        sfs[c] |= sf_bits << (8 * i);
        headroom = min(headroom, nvfp4_scale_headroom(sf_bits));
      }
    }
    raise_flag(p.nonfinite_kv + bh, nonfinite);
    // The sub-tile's V^T rows gathered in the staging buffer (its inputs consumed), then stored whole.
    const VtRowGather<DP, kSubRows> gather{smem_addr(sm.v_tile)};
    static_assert(VtRowGather<DP, kSubRows>::kBytes <= kVTileBytes, "the gather fits the staging buffer");
    __syncthreads();
#pragma unroll
    for (int c = 0; c < kCols; ++c)
      gather.template put<kBlocksPerThread>(cg * kCols + c, part * kBlocksPerThread, words[c], sfs[c]);
    __syncthreads();
    gather.store(p, bh, tok0, threadIdx.x, kThreads);
  }
  if (own_scale) record_tile_scale(p, sm, 1, tile, bh, exponent, tile_amax, headroom);
}

// Launch 1: the K and V statistics items (key_stats_item), any input dtype.
template <int DP>
__device__ __forceinline__ void key_stats_kernel(const QuantizeQkvParams& p) {
  __shared__ __align__(16) SharedStorage<DP> sm;
  key_stats_item<DP>(p, sm, blockIdx.x);
}

// The fix-up of tile `tile` of tensor kTensor (0: K in format QkFmt; 1: V^T, which has no Q·Kᵀ
// format): the tile moves to its head's tensor scale 2^exponent by shifting its scale bytes within
// their headroom, or returns true when it must be quantised again under it (the rare tile of blocks
// 2^-14 below the head's largest). The first tile of a head writes the head's scale. Uniform across
// the CTA.
template <int kTensor, int DP, class QkFmt = void>
__device__ __forceinline__ bool fix_up_tile(const QuantizeQkvParams& p, int64_t tile, int& exponent) {
  const int64_t n_kblocks = p.seq_k_padded / kTileRows;
  const int64_t bh = tile / n_kblocks, blk = tile % n_kblocks;
  exponent = head_exponent(__ldcg(head_exponent_slot(p, bh, kTensor)));
  if (blk == 0 && threadIdx.x == 0) (kTensor == 0 ? p.k_scale : p.v_scale)[bh] = power_of_two(exponent);
  const int32_t* record = tile_record(p, kTensor, tile);
  const int shift = exponent - __ldcg(record), headroom = __ldcg(record + 1);
  if (shift == 0 || headroom == kAnyShift) return false;
  if (shift < 0 || shift > headroom) return true;
  if constexpr (kTensor == 0) {  // the tile's 128 rows of K scales, contiguous
    using Row = QkRowBytes<DP, QkFmt>;
    const uint32_t step = Row::kMx ? uint32_t(shift) : uint32_t(shift) << 3;
    constexpr int kWords = kTileRows * Row::kScales / 4;
    static_assert(kWords <= kThreads, "a word per thread");
    uint32_t* words = reinterpret_cast<uint32_t*>(p.k_sf + tile * kTileRows * Row::kScales);
    if (threadIdx.x < kWords) words[threadIdx.x] = shift_scale_bytes(words[threadIdx.x], step);
  } else {  // DP rows of V^T scales, 8 bytes of this tile each
    static_assert(DP * 2 <= kThreads, "a word per thread");
    if (threadIdx.x < DP * 2) {
      const int64_t row = bh * DP + threadIdx.x / 2;
      uint32_t* word = reinterpret_cast<uint32_t*>(p.vt_sf + row * (p.seq_k_padded / 16) + blk * (kTileRows / 16)) +
                       threadIdx.x % 2;
      *word = shift_scale_bytes(*word, uint32_t(shift) << 3);
    }
  }
  return false;
}

// The K or V tiles of a launch, in the tiles pass (fix_up false: tile blockIdx.x under its own scale)
// or the fix-up pass (grid-stride over every tile: fix_up_tile, and quantise_tile again under the
// head's scale where the bytes cannot move). One call site of quantise_tile(tile, own_scale,
// head_exponent) serves both passes, so the tile's code is inlined once.
template <int kTensor, int DP, class QkFmt, class QuantiseTile>
__device__ __forceinline__ void tiles_or_fix_up(const QuantizeQkvParams& p, bool fix_up, int64_t kv_tiles,
                                                QuantiseTile quantise_tile) {
  for (int64_t tile = blockIdx.x; tile < kv_tiles; tile += fix_up ? gridDim.x : kv_tiles) {
    int exponent = 0;
    if (fix_up) {
      if (!fix_up_tile<kTensor, DP, QkFmt>(p, tile, exponent)) continue;
      __syncthreads();  // the previous tile's shared memory is consumed
    }
    quantise_tile(tile, !fix_up, exponent);
  }
}

// Launches 2 and 4: blocks [0, kv_tiles) quantize K tiles, then the Q tiles, each reading its input
// once; with `fix_up`, the K tiles' fix-up pass instead.
template <InputDtype DT, int DP, class QkFmt>
__device__ __forceinline__ void qk_tiles_kernel(const QuantizeQkvParams& p, bool fix_up) {
  __shared__ __align__(16) SharedStorage<DP> sm;
  const int64_t kv_tiles = p.batch * p.heads_kv * (p.seq_k_padded / kTileRows);
  if (!fix_up && blockIdx.x >= kv_tiles) {
    q_tile<DT, DP, QkFmt>(p, sm, blockIdx.x - kv_tiles);
    return;
  }
  tiles_or_fix_up<0, DP, QkFmt>(p, fix_up, kv_tiles, [&](int64_t tile, bool own_scale, int exponent) {
    k_tile<DT, DP, QkFmt>(p, sm, tile, own_scale, exponent);
  });
}

// Launches 3 and 5: one V^T tile per block, reading its input once; with `fix_up`, their fix-up
// pass. Its own entry point (the V^T tiles do not depend on the Q·Kᵀ format), so each cubin holds
// their code once per input dtype and head dim.
template <InputDtype DT, int DP>
__device__ __forceinline__ void v_tiles_kernel(const QuantizeQkvParams& p, bool fix_up) {
  __shared__ __align__(16) SharedStorage<DP> sm;
  const int64_t kv_tiles = p.batch * p.heads_kv * (p.seq_k_padded / kTileRows);
  tiles_or_fix_up<1, DP, void>(p, fix_up, kv_tiles, [&](int64_t tile, bool own_scale, int exponent) {
    fill_scale_tables(sm.tables);  // v_tile synchronises before its first block
    v_tile<DT, DP>(p, sm, tile, own_scale, exponent);
  });
}

// Launch 2a: one Q tile per block, its block mean and similarity (q_means_tile).
template <InputDtype DT, int DP>
__device__ __forceinline__ void q_means_kernel(const QuantizeQkvParams& p) {
  __shared__ __align__(16) SharedStorage<DP> sm;
  q_means_tile<DT, DP>(p, sm, blockIdx.x);
}

// The balance statistics: one CTA per Q statistics tile (kStatisticsTiles per query head, those
// past the head's rows return at once), max |q - qm| per column into the kv head's q_channel_amax
// (fp32 bits of non-negative values, or NaN: they order like unsigned integers).
template <int DP>
__device__ __forceinline__ void balance_statistics_kernel(const QuantizeQkvParams& p) {
  __shared__ __align__(16) SharedStorage<DP> sm;
  const int64_t bh = blockIdx.x / kStatisticsTiles, j = blockIdx.x % kStatisticsTiles;
  const int64_t blk = j * statistics_stride(p.seq_q);
  if (blk * kTileRows >= p.seq_q) return;
  using Map = RowTileMap<DP>;
  const RowTile<DP> t = RowTile<DP>::queries(p, bh * (p.seq_q_padded / kTileRows) + blk);
  Block16<InputDtype::kFloat32> x[Map::kPasses];
  q_tile_load<InputDtype::kFloat32, DP, true>(p, sm, t, x);
  constexpr ColumnStat kKinds[1] = {kColumnMax};
  float dev[1][16];
  q_tile_deviation<true>(sm, t, x, nullptr, dev[0]);
  stage_column_stats<Map::kColBlocks>(sm, kKinds, dev);
  __syncthreads();
  if (threadIdx.x < DP) {
    float amax[1];
    cta_column_stats(sm, kKinds, threadIdx.x, amax);
    atomicMax(const_cast<uint32_t*>(p.q_channel_amax) + t.kv_head(p) * DP + threadIdx.x, __float_as_uint(amax[0]));
  }
}

}  // namespace
}  // namespace nvfp4_dit

// Entry points (common/launch.h): the statistics per padded head dim (any input dtype); the tiles
// per input dtype and padded head dim, the K and Q tiles in each Q·Kᵀ format.
#define NVFP4_DIT_STATISTICS_ENTRIES(DP)                                                                        \
  extern "C" __global__ void __launch_bounds__(nvfp4_dit::kThreads, nvfp4_dit::kMinCtasPerSm)                   \
      nvfp4_dit_balance_statistics_d##DP(const __grid_constant__ nvfp4_dit::QuantizeQkvParams p) {               \
    nvfp4_dit::balance_statistics_kernel<DP>(p);                                                                 \
  }                                                                                                              \
  extern "C" __global__ void __launch_bounds__(nvfp4_dit::kThreads, nvfp4_dit::kKeyStatsMinCtasPerSm)           \
      nvfp4_dit_key_stats_d##DP(const __grid_constant__ nvfp4_dit::QuantizeQkvParams p) {                        \
    nvfp4_dit::key_stats_kernel<DP>(p);                                                                          \
  }
#define NVFP4_DIT_TILES_ENTRIES(NAME, DT, DP)                                                                     \
  extern "C" __global__ void __launch_bounds__(nvfp4_dit::kThreads, nvfp4_dit::kTilesMinCtasPerSm<nvfp4_dit::InputDtype::DT>) \
      nvfp4_dit_quantize_tiles_##NAME##_d##DP##_nvfp4(const __grid_constant__ nvfp4_dit::QuantizeQkvParams p,    \
                                                       int32_t fix_up) {                                         \
    nvfp4_dit::qk_tiles_kernel<nvfp4_dit::InputDtype::DT, DP, nvfp4_dit::QkFormatNvfp4>(p, fix_up != 0);         \
  }                                                                                                              \
  extern "C" __global__ void __launch_bounds__(nvfp4_dit::kThreads, nvfp4_dit::kMxfp8MinCtasPerSm)             \
      nvfp4_dit_quantize_tiles_##NAME##_d##DP##_mxfp8(const __grid_constant__ nvfp4_dit::QuantizeQkvParams p,    \
                                                       int32_t fix_up) {                                         \
    nvfp4_dit::qk_tiles_kernel<nvfp4_dit::InputDtype::DT, DP, nvfp4_dit::QkFormatMxfp8>(p, fix_up != 0);         \
  }                                                                                                              \
  extern "C" __global__ void __launch_bounds__(nvfp4_dit::kThreads, nvfp4_dit::kTilesMinCtasPerSm<nvfp4_dit::InputDtype::DT>) \
      nvfp4_dit_q_means_##NAME##_d##DP(const __grid_constant__ nvfp4_dit::QuantizeQkvParams p) {                   \
    nvfp4_dit::q_means_kernel<nvfp4_dit::InputDtype::DT, DP>(p);                                                 \
  }                                                                                                              \
  extern "C" __global__ void __launch_bounds__(nvfp4_dit::kThreads, nvfp4_dit::kTilesMinCtasPerSm<nvfp4_dit::InputDtype::DT>) \
      nvfp4_dit_quantize_v_tiles_##NAME##_d##DP(const __grid_constant__ nvfp4_dit::QuantizeQkvParams p,          \
                                                 int32_t fix_up) {                                               \
    nvfp4_dit::v_tiles_kernel<nvfp4_dit::InputDtype::DT, DP>(p, fix_up != 0);                                     \
  }
NVFP4_DIT_STATISTICS_ENTRIES(64)
NVFP4_DIT_STATISTICS_ENTRIES(128)
NVFP4_DIT_FOR_EACH_INPUT(NVFP4_DIT_TILES_ENTRIES)
