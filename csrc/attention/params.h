// Launch parameters of the NVFP4 attention forward kernel. Plain data, no torch, no CUDA types:
// the binding fills it, the kernel takes it as a __grid_constant__. Every stride and offset is
// int64 (the quantised K alone passes 2^31 bytes near 420k tokens at 40 heads).
#pragma once
#include "common/portable.h"
#include "common/token_order.h"

namespace nvfp4_dit {

struct AttentionFwdParams {
  // Quantized operands (format: CONTRIBUTING.md). Each [S, X] plane per (batch, head) is
  // contiguous; the batch/head strides are in bytes.
  const uint8_t* q_data;   // [B, H, Sqp, Dp/2]
  const uint8_t* q_sf;     // [B, H, Sqp, Dp/16]
  const uint8_t* k_data;   // [B, Hkv, Skp, Dp/2], rows permuted in 32-key groups
  const uint8_t* k_sf;     // [B, Hkv, Skp, Dp/16], permuted the same way
  const uint8_t* vt_data;  // [B, Hkv, Dp, Skp/2]
  const uint8_t* vt_sf;    // [B, Hkv, Dp, Skp/16]
  int64_t q_stride_b, q_stride_h;
  int64_t qsf_stride_b, qsf_stride_h;
  int64_t k_stride_b, k_stride_h;
  int64_t ksf_stride_b, ksf_stride_h;
  int64_t vt_stride_b, vt_stride_h;
  int64_t vtsf_stride_b, vtsf_stride_h;

  // The correction m_b . (k - km) / (q_scale * k_scale) of low-rank Q smoothing
  // (nvfp4_dit/smoothing.py), formed per key tile from the key projections and the Q block's
  // coefficients: (u_j0 + sum_i a_i u_ji) * key_proj_factor[tile] / (q_scale * k_scale).
  // key_proj: fp16 bits [B, H, Skp, kKeyProjectionColumns] (natural key order of the tiles),
  // key_proj_factor [B, H, Skp/128], q_coeff [B, H, Sqp/128, kBasisRank]; all contiguous.
  const uint16_t* key_proj;
  const float* key_proj_factor;
  const float* q_coeff;

  // The block map of a block-sparse launch, or nullptr for dense attention. Row r = bh * nblk +
  // (m - q_block_begin) (nblk = q_block_end - q_block_begin) visits the key tiles
  // block_tiles[block_offsets[r] .. block_offsets[r + 1]) (ascending; int32 CSR).
  // The CTAs take the B * H * nblk rows in the order work_order (each head's rows longest first).
  const int32_t* block_offsets;  // the launch's rows, plus one
  const int32_t* block_tiles;
  const int32_t* work_order;     // [B * H * nblk] rows

  // q . km [B, H, Sq] fp32 (only read when the LSE is written).
  const float* q_dot_km;
  int64_t qdk_stride_b, qdk_stride_h;

  // Tensor scales (fp32 powers of two, contiguous): Q per 128-row block [B, H, Sqp/128], K and V
  // per head [B, Hkv]. Scores come out of the MMAs in units of q_scale * k_scale, which the kernel
  // folds into its softmax scale; the output is O / rowsum * v_scale + v_mean.
  const float* q_scale;
  const float* k_scale;
  const float* v_scale;
  const float* v_mean;   // [B, Hkv, Dp] fp32, contiguous: V's per-head mean, added back to the output

  // Per-batch key lengths (int32 [B], each <= seq_k) or nullptr for seq_k everywhere.
  const int32_t* kv_lens;

  // Output [B, H, Sq, D] viewed through strides (elements): NHD and HND are both just strides.
  void* out;
  int64_t out_stride_b, out_stride_h, out_stride_s;
  // LSE [B, H, Sq] fp32, natural log (nullptr when not asked).
  float* lse;
  int64_t lse_stride_b, lse_stride_h;

  // The quantiser's NaN/inf flags (nonzero: a non-finite input reached this unit; FP4 scales would
  // hide it): [B, H, Sqp/128] per Q block, [B, Hkv] per kv head. Every row of a flagged Q block or
  // kv head's query heads is written as NaN (output and LSE), as exact attention would give.
  const uint32_t* nonfinite_q_blocks;
  const uint32_t* nonfinite_kv;

  int batch, heads, kv_heads;
  int seq_q, seq_k;      // true lengths
  int seq_q_pad, seq_k_pad;
  int head_dim_out;      // true head dim (<= padded head dim of the kernel instantiation)
  int q_block_begin, q_block_end;
  float scale;           // softmax scale (in q . k units)
  float scale_log2;      // scale * log2(e)
  int causal;            // SDPA is_causal: query i sees keys j <= i
  int out_bf16;          // 1: bf16 output, 0: fp16
  int out_vec2;          // 1: column pairs are 4-byte aligned (even strides and pointer)
  int grid_size;         // persistent CTAs launched
  // Query row s (in the quantiser's tile order) is written to row source_row(out_order, s) of out
  // and lse (a video call's 3D tiles, common/token_order.h); the identity for other calls.
  TokenOrder out_order;
};

}  // namespace nvfp4_dit
