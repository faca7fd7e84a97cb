// Fused NVFP4 preprocessing of Q, K, V for the attention kernel, and the per-Q-block
// correction term qm . (k - km)^T computed in chunks.
//
// Torch-free: plain pointers, int64 element strides, a cudaStream_t. The kernels live in
// quantize_tiles.cu and correction.cu; this header only declares the host entry points, so
// the torch binding (csrc/quantize_binding.cpp, a host C++ TU) can include it.
//
// The byte format is the one of nvfp4_dit/format.py (the contract: CONTRIBUTING.md): blocks of 16,
// sf = e4m3_satfinite(amax16 / 6), data = e2m1(x / float(sf)), zero padding to 128 rows.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "common/config.h"

namespace nvfp4_dit {

// Element type of the Q/K/V inputs.
enum class InputDtype : int32_t { kBFloat16 = 0, kFloat16 = 1, kFloat32 = 2 };

// One logical [B, H, S, D] input read through its strides (in elements, any layout: NHD and
// HND are both just strides here, so no copy is ever made).
struct StridedInput {
  const void* ptr;
  int64_t stride_b;
  int64_t stride_h;
  int64_t stride_s;
  int64_t stride_d;
};

// Which kernel launch_quantize_qkv runs: the tile kernel (quantize_tiles.cu, any input), the streaming
// kernel (quantize_stream.cu: it fails with cudaErrorNotSupported where it does not apply), or
// (kAuto, the default) the streaming kernel where it applies in the configuration measured faster
// on the H200 (two CTAs of three or more stages per SM), else the tile kernel (docs/quantize.md).
enum class QuantizeKernel : int32_t { kTiles = 0, kStream = 1, kAuto = 2 };

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

  // Channel balance (format.channel_balance): on, Q is multiplied by s and K divided by it.
  // q_channel_amax holds max |q - qm| per (b, kv head, channel) over the group's rows as fp32
  // bits (zero on entry), written by launch_quantize_qkv's first launch.
  bool balance_qk;
  const uint32_t* q_channel_amax;  // [B, Hkv, Dp], or nullptr when balance_qk is off

  // Non-finite flags (zero on entry, set nonzero): FP4 scales saturate, so a NaN/inf input
  // would otherwise come out finite. The caller turns them into NaN rows (nvfp4_dit/ops.py).
  uint32_t* nonfinite_kv;        // [B * Hkv]: a valid key (j < kv_lens[b]) of K or V holds NaN/inf
  uint32_t* nonfinite_q_blocks;  // [B * H * Sqp/128]: that 128-row Q block holds NaN/inf

  // Workspace of the K and V statistics and the work-item order (see quantize_qkv_workspace_*).
  float* k_partial_sums;    // [quantize_qkv_workspace_floats]: chunk statistics
                            // [B * Hkv, kStatTensors, k_chunks, kStatVectors, Dp], then (streaming kernel)
                            // tile statistics [B * Hkv, kStatTensors, k_tiles, kStatVectors, Dp]; no initial value
  uint32_t* work_counters;  // [quantize_qkv_workspace_counters], zero on entry

  QuantizeKernel kernel;

  // Q and K as NVFP4 (above) or MXFP8: e4m3 data q_data [B, H, Sqp, Dp], k_data [B, Hkv, Skp, Dp]
  // and one ue8m0 byte per 32 elements, q_sf [B, H, Sqp, Dp/32], k_sf [B, Hkv, Skp, Dp/32]. The
  // streaming kernel writes NVFP4 only (it returns cudaErrorNotSupported for MXFP8).
  bool qk_mxfp8;
};

constexpr int kTileRows = 128;  // rows of a Q/K tile and tokens of a V^T tile, in every kernel

// Keys reduced by one statistics work item (quantize_tiles.cu), or per chunk of tile statistics
// (quantize_stream.cu).
constexpr int64_t kKeyMeanChunk = 1024;

// Per-head statistics of the keys: for K and V (kStatTensors), per channel the sum, the minimum and
// the maximum over the valid keys (kStatVectors). They give the means (km, vm), max |k - km| and
// max |v - vm| per channel (the tensor scales and the balance) without a second pass.
constexpr int kStatTensors = 2;  // 0: K, 1: V
constexpr int kStatVectors = 3;  // 0: sum, 1: min, 2: max

__host__ __device__ inline int64_t quantize_qkv_k_chunks(int64_t seq_k) {
  return seq_k <= 0 ? 1 : (seq_k + kKeyMeanChunk - 1) / kKeyMeanChunk;
}

__host__ __device__ inline int64_t quantize_qkv_k_tiles(int64_t seq_k) { return seq_k <= 0 ? 1 : (seq_k + 127) / 128; }

// Floats of k_partial_sums needed for these sizes: per (b, kv-head) and tensor the statistics of
// each chunk, and for the streaming kernel then those of each 128-key tile (its first level).
__host__ __device__ inline int64_t quantize_qkv_workspace_floats(int64_t batch, int64_t heads_kv, int64_t seq_k,
                                                                 int64_t head_dim_padded, bool streaming) {
  const int64_t per_head = quantize_qkv_k_chunks(seq_k) + (streaming ? quantize_qkv_k_tiles(seq_k) : 0);
  return batch * heads_kv * kStatTensors * per_head * kStatVectors * head_dim_padded;
}

// 32-bit counters of work_counters (zero them before every launch_quantize_qkv): the streaming
// kernel's ticket dispenser, per (b, kv-head) the chunk arrivals and the statistics-ready flag, then
// per (b, kv-head), tensor and chunk its tile arrivals (the tile kernel uses only the chunk arrivals).
__host__ __device__ inline int64_t quantize_qkv_workspace_counters(int64_t batch, int64_t heads_kv, int64_t seq_k) {
  return 1 + 2 * batch * heads_kv + batch * heads_kv * kStatTensors * quantize_qkv_k_chunks(seq_k);
}

// Kernel launches on `stream` that reduce the K and V statistics (means, tensor scales, the
// balance) and quantize every Q, K and V^T tile (and write the Q block means and scales and q . km):
// two for the tile kernel (the statistics, then the tiles), one for the streaming kernel; with
// balance_qk, first one more that reads Q for the balance statistics (q_channel_amax). Returns
// the launch error.
cudaError_t launch_quantize_qkv(const QuantizeQkvParams& params, cudaStream_t stream);

// The streaming kernel behind launch_quantize_qkv (quantize_stream.cu) for bf16/fp16 inputs whose
// rows are contiguous and 16-byte aligned with D == Dp, NVFP4 Q/K, on sm_90 and newer (TMA). Returns
// cudaErrorNotSupported, launching nothing, for any other input or device.
cudaError_t launch_quantize_qkv_stream(const QuantizeQkvParams& params, cudaStream_t stream);

struct CorrectionParams {
  const float* q_mean;  // [B, H, num_q_blocks, Dp], contiguous
  StridedInput k;       // the raw K input, logical [B, Hkv, Sk, D]
  InputDtype dtype;
  const void* kv_lens;  // [B] or nullptr, as in QuantizeQkvParams: keys past it have k_s = 0
  bool kv_lens_int64;
  const float* k_mean;  // [B, Hkv, Dp], contiguous
  const float* q_scale;  // [B, H, num_q_blocks] and
  const float* k_scale;  // [B, Hkv] tensor scales (contiguous): delta is written in their units
  float* delta;         // [B, H, block_end - block_begin, Skp], last dim contiguous
  int64_t delta_stride_b;
  int64_t delta_stride_h;
  int64_t delta_stride_blk;

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
};

// delta[b, h, m - block_begin, j] = sum_d q_mean[b, h, m, d] * (k[b, kvh, j, d] - k_mean[b, kvh, d])
// / (q_scale[b, h, m] * k_scale[b, kvh]) in fp32 (the division by a power of two is exact) for valid
// keys j < min(kv_lens[b], Sk), and 0 for the padded ones. One launch.
cudaError_t launch_correction(const CorrectionParams& params, cudaStream_t stream);

}  // namespace nvfp4_dit
