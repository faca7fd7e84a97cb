// Launch parameters of the NVFP4 preprocessing of Q, K, V for the attention kernel (the tile
// quantiser) and of the per-Q-block correction term qm . (k - km)^T computed in chunks.
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
// the quantiser and the correction (their names carry `name` and `Dp`: common/launch.h).
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

struct CorrectionParams {
  const float* q_mean;  // [B, H, num_q_blocks, Dp], contiguous
  StridedInput k;       // the raw K input, logical [B, Hkv, Sk, D]
  InputDtype dtype;
  const void* kv_lens;  // [B] or nullptr, as in QuantizeQkvParams: keys past it have k_s = 0
  bool kv_lens_int64;
  const float* k_mean;  // [B, Hkv, Dp], contiguous
  const float* q_scale;  // [B, H, num_q_blocks] and
  const float* k_scale;  // [B, Hkv] tensor scales (contiguous): delta is written in their units
  // delta as nvfp4_dit.format.Correction stores it: fp16 values (bits) [B, H, block_end -
  // block_begin, Skp], the last dim contiguous, strides multiples of 128; the factor of the tile
  // whose first value is element i at delta_factor[i / 128].
  uint16_t* delta;
  float* delta_factor;
  int64_t delta_stride_b;
  int64_t delta_stride_h;
  int64_t delta_stride_blk;
  // A per-key additive mask (nvfp4_dit/masks.py), in units of the scaled scores: fp32 [B, H or 1,
  // Sk] through element strides (h stride 0 for one row per batch), or nullptr. It enters delta
  // as key_bias / (scale * q_scale * k_scale), -inf masking the key.
  const float* key_bias;
  int64_t key_bias_stride_b;
  int64_t key_bias_stride_h;
  float scale;          // the softmax scale (read only with key_bias)
  // A block-sparse call's correction, only where the attention kernel reads it, or nullptr for all
  // of it: CTA (key tile j, bh) computes the rows (Q blocks of the chunk) col_rows[col_offsets[
  // bh * nk + j] .. col_offsets[bh * nk + j + 1]) and writes each to entry col_entries[..] (values at
  // delta + 128 * entry, factor at delta_factor[entry])
  // (the chunk's compact layout that the attention kernel's block map reads, entries counted from
  // the chunk's first: AttentionFwdParams::block_offsets).
  const int32_t* col_offsets;  // the chunk's B * H * Skp/128 columns, plus one
  const int32_t* col_rows;
  const int32_t* col_entries;

  int64_t batch;
  int64_t heads_q;
  int64_t heads_kv;
  int64_t seq_k;
  int64_t seq_k_padded;
  int64_t head_dim;
  int64_t head_dim_padded;
  int64_t num_q_blocks;
  int64_t block_begin;  // Q blocks [block_begin, block_end) of q_mean
  int64_t block_end;
  // Key s (in tile order) is row source_row(k_order, s) of k; key_bias is in tile order already.
  TokenOrder k_order;
};



// The block map of a block-sparse call and its lists (quantize/block_lists.cu), for a group of
// consecutive correction chunks: `chunks` chunks of `step` Q blocks (the group's `rows` Q blocks
// from block_begin, the last chunk possibly shorter). A map row is (chunk c, bh = b * heads + h,
// Q block m of the chunk), stored at r = (c * batch * heads + bh) * step + m; rows past the group's
// end are empty. nvfp4_dit/sparse.py (map_rows, build_lists) states the same rules in PyTorch.
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
  int64_t step;
  int64_t chunks;

  // block_map_rows writes (col_counts zeroed before it):
  uint32_t* bits;        // [C, B*H*step, words]: bit j % 32 of word j / 32 = tile j listed
  int32_t* row_counts;   // [C, B*H*step]
  int32_t* word_prefix;  // [C, B*H*step, words]: tiles listed in the row's earlier words
  int32_t* col_counts;   // [C, B*H*nk]: Q blocks of the chunk that list (bh, tile)
  uint8_t* row_map;      // bool [B, H, rows, nk], or nullptr
  // block_list_rows and block_list_columns read the exclusive scans of the counts (per chunk, with
  // the total last) and write the lists (nvfp4_dit.sparse.BlockLists), E = B*H*step*nk per chunk:
  const int32_t* offsets;      // [C, B*H*step + 1]
  const int32_t* col_offsets;  // [C, B*H*nk + 1]
  int32_t* tiles;              // [C, E]
  int32_t* col_rows;           // [C, E]
  int32_t* col_entries;        // [C, E]
  // block_list_rows also writes each chunk's visiting order of its rows (BlockLists.order): per
  // head, the chunk's real rows by descending count (ties by Q block), then every padding row.
  int32_t* order;              // [C, B*H*step]: r - c * B*H*step of the row visited at that place
};

}  // namespace nvfp4_dit
