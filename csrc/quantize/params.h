// Launch parameters of the NVFP4 preprocessing of Q, K, V for the attention kernel (the tile
// quantiser with its low-rank Q smoothing) and of the block-sparse map's lists.
//
// Plain data: no torch, no CUDA types. The host launcher (nvfp4_dit/cuda/launch.py) fills a mirror of
// these structs (nvfp4_dit/cuda/abi.py; tests/test_kernel_abi.py compiles this header with the
// host compiler and checks every field's offset); the kernels take them by value.
//
// The byte format is the one of nvfp4_dit/format.py (the contract: CONTRIBUTING.md): blocks of 16,
// sf = e4m3_satfinite(amax16 / 6), data = e2m1(x / float(sf)), zero padding to 128 rows.
#pragma once

#include "common/portable.h"

#include "common/config.h"
#include "common/token_order.h"

namespace nvfp4_dit {

// Element type of the Q/K/V inputs.
enum class InputDtype : int32_t { kBFloat16 = 0, kFloat16 = 1, kFloat32 = 2 };

// M(name, InputDtype, Dp) for every input dtype and padded head dim: the per-input entry points of
// the quantiser (their names carry `name` and `Dp`: common/launch.h).
#define NVFP4_DIT_FOR_EACH_INPUT(M) \
  M(bf16, kBFloat16, 64) M(bf16, kBFloat16, 128) M(fp16, kFloat16, 64) M(fp16, kFloat16, 128) \
  M(fp32, kFloat32, 64) M(fp32, kFloat32, 128)

// One logical [B, H, S, D] input read through its strides (in elements, any layout: NHD and
// HND are both just strides here, so no copy is ever made).
struct StridedInput {
  const void* ptr;
  int64_t stride_b;
  int64_t stride_h;
  int64_t stride_s;
  int64_t stride_d;
};

struct QuantizeQkvParams {
  StridedInput q, k, v;
  InputDtype dtype;
  const void* kv_lens;   // [B] valid keys per batch, or nullptr (all seq_k keys valid)
  bool kv_lens_int64;    // kv_lens holds int64 (else int32)

  int64_t batch;
  int64_t heads_q;
  int64_t heads_kv;       // heads_q % heads_kv == 0 (GQA)
  int64_t seq_q;
  int64_t seq_k;
  int64_t head_dim;       // D of the inputs
  int64_t head_dim_padded;  // Dp: 64 or 128
  int64_t seq_q_padded;   // multiple of 128
  int64_t seq_k_padded;   // multiple of 128

  // Outputs, all contiguous in the layouts of nvfp4_dit/format.py.
  uint8_t* q_data;   // [B, H, Sqp, Dp/2]
  uint8_t* q_sf;     // [B, H, Sqp, Dp/16]
  uint8_t* k_data;   // [B, Hkv, Skp, Dp/2], rows permuted inside 32-key groups
  uint8_t* k_sf;     // [B, Hkv, Skp, Dp/16], permuted the same way
  uint8_t* vt_data;  // [B, Hkv, Dp, Skp/2]
  uint8_t* vt_sf;    // [B, Hkv, Dp, Skp/16]
  float* q_mean;     // [B, H, Sqp/128, Dp]
  float* k_mean;     // [B, Hkv, Dp]
  float* v_mean;     // [B, Hkv, Dp]
  float* q_scale;    // [B, H, Sqp/128] tensor scale of each Q block (a power of two)
  float* k_scale;    // [B, Hkv]
  float* v_scale;    // [B, Hkv]
  float* balance;    // [B, Hkv, Dp] the channel balance s (1 where balance_qk is off)
  float* q_dot_km;   // [B, H, Sq]
  // Block statistics for the block-sparse estimate (nvfp4_dit/sparse.py): the mean of the raw K
  // over the valid keys of each 128-key tile (0 for a tile without one), and the mean pairwise
  // cosine of the raw Q rows of each 128-row block (1 for a block of fewer than two nonzero rows).
  float* k_tile_mean;   // [B, Hkv, Skp/128, Dp]
  float* q_similarity;  // [B, H, Sqp/128]

  // Low-rank Q smoothing (nvfp4_dit/smoothing.py, quantize/smoothing.cuh): per query head the
  // center g, kBasisRank basis rows and the basis scale s, per Q block its coefficients a_b / s and
  // the mean it is smoothed by, g + basis^T a_b; per key and query head the kKeyProjectionColumns
  // projections u_j = [g . k'_j (+ key_bias_j / scale), (basis_i . k'_j) s] as fp16 bits under one power-of-two
  // factor per 128-key tile (k' = k - km, 0 past the valid keys; natural key order of the tiles).
  float* q_center;          // [B, H, Dp]
  float* q_basis;           // [B, H, kBasisRank, Dp]
  float* q_basis_scale;     // [B, H] the basis scale s: coefficients a_b / s, projections (row . k') s
  float* q_coeff;           // [B, H, Sqp/128, kBasisRank]
  float* q_smooth_mean;     // [B, H, Sqp/128, Dp]
  uint16_t* key_proj;       // [B, H, Skp, kKeyProjectionColumns]
  float* key_proj_factor;   // [B, H, Skp/128]
  // A per-key additive mask (nvfp4_dit/masks.py) in units of the scaled scores, fp32 [B, H or 1, Sk]
  // through element strides (h stride 0 for one row per batch), in the tiles' key order, or
  // nullptr: it joins u_j0 as key_bias / scale, -inf masking the key.
  const float* key_bias;
  int64_t key_bias_stride_b;
  int64_t key_bias_stride_h;
  float scale;              // the softmax scale (read only with key_bias)

  // Channel balance (format.channel_balance): on, Q is multiplied by s and K divided by it.
  // q_channel_amax holds max |q - qm| per (b, kv head, channel) over the group's rows as fp32
  // bits (zero on entry), written by the balance statistics kernel, which runs first.
  bool balance_qk;
  const uint32_t* q_channel_amax;  // [B, Hkv, Dp], or nullptr when balance_qk is off

  // Non-finite flags (zero on entry, set nonzero): FP4 scales saturate, so a NaN/inf input
  // would otherwise come out finite. The caller turns them into NaN rows (nvfp4_dit/ops.py).
  uint32_t* nonfinite_kv;        // [B * Hkv]: a valid key (j < kv_lens[b]) of K or V holds NaN/inf
  uint32_t* nonfinite_q_blocks;  // [B * H * Sqp/128]: that 128-row Q block holds NaN/inf

  // Workspace (see quantize_qkv_workspace_*): the statistics tiles' partials, the counters (zeroed
  // before every quantisation) and the K and V tiles' own tensor scales.
  float* k_partial_sums;    // [quantize_qkv_workspace_floats]: per tile its statistics
                            // [B * Hkv, kStatTensors, kStatisticsTiles, kStatVectors, Dp]; no initial value
  uint32_t* work_counters;  // [quantize_qkv_workspace_counters], zero on entry
  int32_t* tile_records;    // [kStatTensors, B * Hkv * Skp/128, 2]: per K / V tile its exponent and
                            // headroom (quantize_tiles.cu); no initial value

  // Q and K are NVFP4 (above) or, from the quantize_tiles_*_mxfp8 entry points, MXFP8: e4m3 data
  // q_data [B, H, Sqp, Dp], k_data [B, Hkv, Skp, Dp] and one ue8m0 byte per 32 elements,
  // q_sf [B, H, Sqp, Dp/32], k_sf [B, Hkv, Skp, Dp/32].

  // The "rows" entry points (16-byte loads) read row s of Q, K and V from row source_row(order, s)
  // (a video call's 3D tiles, common/token_order.h; seq_q == seq_k): every output above is in tile
  // order, as if the inputs had been permuted first. The other entry points ignore it.
  TokenOrder order;
};

constexpr int kTileRows = 128;  // rows of a Q/K tile and tokens of a V^T tile, in every kernel

// Per-head statistics of the keys: for K and V (kStatTensors), per channel the sum, the minimum and
// the maximum over the valid keys of the head's statistics tiles (kStatVectors). They give the
// means (km, vm) and max |k - km| per channel (the balance).
constexpr int kStatTensors = 2;  // 0: K, 1: V
constexpr int kStatVectors = 3;  // 0: sum, 1: min, 2: max

// The statistics tiles of a head of n_valid rows (format.statistics_row_mask): the 128-row tiles
// j * statistics_stride(n_valid), j < kStatisticsTiles, that hold valid rows.
constexpr int64_t kStatisticsTiles = 16;

NVFP4_DIT_HOST_DEVICE inline int64_t statistics_stride(int64_t n_valid) {
  const int64_t tiles = n_valid > 0 ? (n_valid + kTileRows - 1) / kTileRows : 0;
  return tiles <= kStatisticsTiles ? 1 : (tiles + kStatisticsTiles - 1) / kStatisticsTiles;
}

// Floats of k_partial_sums needed for these sizes: per (b, kv-head), tensor and statistics tile its
// statistics.
NVFP4_DIT_HOST_DEVICE inline int64_t quantize_qkv_workspace_floats(int64_t batch, int64_t heads_kv,
                                                                 int64_t head_dim_padded) {
  return batch * heads_kv * kStatTensors * kStatisticsTiles * kStatVectors * head_dim_padded;
}

// 32-bit counters of work_counters (zeroed before every quantisation): per (b, kv-head) the
// arrivals of its statistics tiles, then per (b, kv-head) and tensor the largest tile exponent
// (quantize_tiles.cu, head_exponent).
NVFP4_DIT_HOST_DEVICE inline int64_t quantize_qkv_workspace_counters(int64_t batch, int64_t heads_kv) {
  return batch * heads_kv * (1 + kStatTensors);
}

// int32 of tile_records: two per K and per V tile.
NVFP4_DIT_HOST_DEVICE inline int64_t quantize_qkv_workspace_records(int64_t batch, int64_t heads_kv,
                                                                  int64_t seq_k_padded) {
  return kStatTensors * batch * heads_kv * (seq_k_padded / kTileRows) * 2;
}

// The block map of a block-sparse call and its lists (quantize/block_lists.cu), for a group of
// `rows` consecutive Q blocks from block_begin (a group bounds the map's memory). Map row r = bh *
// rows + g (bh = b * heads + h) is Q block block_begin + g. nvfp4_dit/sparse.py (map_rows,
// build_lists) states the same rules in PyTorch.
struct BlockListsParams {
  // The estimate (scores != nullptr): per row the raw pooled scores mean(q_i) . mean(k_j), fp32
  // [B, H, rows, nk] contiguous; the blocks' similarity [B, H, num_q_blocks] contiguous; the
  // tiles' log visible-key weight [B, H or 1, nk] (last dim contiguous) through element strides.
  // Without scores every allowed tile is kept.
  const float* scores;
  const float* q_similarity;
  const float* log_weights;
  int64_t log_weights_stride_b;
  int64_t log_weights_stride_h;
  // The caller's map, bool [B or 1, H or 1, num_q_blocks, nk] (last dim contiguous) through
  // element strides (0 where broadcast), or nullptr.
  const uint8_t* block_mask;
  int64_t block_mask_stride_b;
  int64_t block_mask_stride_h;
  int64_t block_mask_stride_q;
  const int32_t* kv_lens;  // [B] or nullptr (all seq_k keys valid); clamped to [0, seq_k]
  float scale;             // the softmax scale
  float keep_mass;         // in (0, 1)
  float similarity_threshold;
  int causal;
  int64_t always_keep_begin;  // a key range whose tiles the estimate keeps; empty if begin >= end
  int64_t always_keep_end;

  int64_t batch;
  int64_t heads;
  int64_t seq_k;
  int64_t num_q_blocks;
  int64_t num_k_tiles;  // nk <= kBlockListsMaxTiles
  int64_t words;        // 32-tile words of a row: ceil(nk / 32)
  int64_t block_begin;
  int64_t rows;

  // block_map_rows writes:
  uint32_t* bits;        // [B*H*rows, words]: bit j % 32 of word j / 32 = tile j listed
  int32_t* row_counts;   // [B*H*rows]
  int32_t* word_prefix;  // [B*H*rows, words]: tiles listed in the row's earlier words
  uint8_t* row_map;      // bool [B, H, rows, nk], or nullptr
  // block_list_rows reads the exclusive scan of the row counts (with the total last) and writes the
  // lists (nvfp4_dit.sparse.BlockLists) and the visiting order of the rows: per head, by descending
  // count (ties by Q block).
  const int32_t* offsets;  // [B*H*rows + 1]
  int32_t* tiles;          // [B*H*rows*nk]
  int32_t* order;          // [B*H*rows]: the row visited at that place
};

}  // namespace nvfp4_dit
