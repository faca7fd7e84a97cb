// Per-block NVFP4 quantization of the tile quantiser (quantize_tiles.cu). Torch-free; device code
// only, in an unnamed namespace so each TU has its own copy.
#pragma once

#include "common/portable.h"

#include <cuda_fp16.h>

#include "common/format.cuh"
#include "quantize/params.h"
#include "quantize/quantize_math.cuh"

namespace nvfp4_dit {
namespace {

////////////////////////////////////////////////////////////////////////////////////////////////
// One block of 16 values -> 8 data bytes (two words) + one scale byte, exactly as format.py.

__device__ __forceinline__ float max_nan(float a, float b) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

__device__ __forceinline__ float min_nan(float a, float b) {
  float r;
  asm("min.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

// max |v[e]| as a tree of depth 4 rather than a chain of 16 (max is exact and associative, so
// the order does not change the result); max.NaN makes a NaN reach the scale.
__device__ __forceinline__ float abs_max16(const float (&v)[16]) {
  float m[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) m[e] = max_nan(fabsf(v[e]), fabsf(v[e + 8]));
#pragma unroll
  for (int w = 4; w >= 1; w >>= 1)
#pragma unroll
    for (int e = 0; e < w; ++e) m[e] = max_nan(m[e], m[e + w]);
  return m[0];
}

// Per-CTA tables indexed by a scale byte (0..0x7F): its value and RN(1 / value), so a block's
// scale needs no decode and no IEEE reciprocal (the fast division of quantize_math.cuh).
struct ScaleTables {
  float value[128];
  float rcp[128];
};

__device__ __forceinline__ void fill_scale_tables(ScaleTables& t) {
  if (threadIdx.x < 128) {
    const float sf = nvfp4_dit::e4m3_to_float(threadIdx.x);
    t.value[threadIdx.x] = sf;
    t.rcp[threadIdx.x] = sf > 0.0f ? __frcp_rn(sf) : 0.0f;  // 0x7F (NaN) gives NaN; 0 is unused
  }
}

// Eight quotients |v| / sf (correctly rounded, clamped at 6 where they may exceed 7) and their
// values -> one word of e2m1 nibbles.
__device__ __forceinline__ uint32_t encode8(const float (&quot)[8], const float* v) {
#if NVFP4_DIT_NATIVE_E2M1_CVT
  // The hardware conversion rounds the signed quotient (nearest even, satfinite, sign kept).
  float signed_quot[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) signed_quot[e] = copysignf(quot[e], v[e]);
  return nvfp4_dit::pack8_e2m1(signed_quot);
#else
  uint32_t code[8];
  float v8[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    code[e] = e2m1_code_biased(quot[e]);
    v8[e] = v[e];
  }
  return pack8_biased_codes_signs(code, v8);
#endif
}

// The rare blocks that the fast division cannot take: scale saturated at 448 (inf, NaN, huge
// values) or one of the two coarsest subnormal scales (quotients up to 9). IEEE division, and
// the clamp at 6 that e2m1 saturation is. Out of line, so that the fast path has no branch per
// element; values in and words out by value, so that the call keeps them in registers.
struct Block16Bytes {
  uint32_t lo, hi, sf_bits;
};

__device__ __noinline__ Block16Bytes quantize_block16_ieee(float4 v0, float4 v1, float4 v2, float4 v3, float amax) {
  const float v[16] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w, v2.x, v2.y, v2.z, v2.w, v3.x, v3.y, v3.z, v3.w};
  Block16Bytes out{0, 0, 0};
  const float sf = nvfp4_dit::block_scale_value(amax, &out.sf_bits);
  if (!(sf > 0.0f)) return out;  // NaN scale: x / NaN encodes as 0
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float quot[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) quot[e] = fminf(__fdiv_rn(fabsf(v[8 * half + e]), sf), nvfp4_dit::kE2m1Max);
    (half ? out.hi : out.lo) = encode8(quot, v + 8 * half);
  }
  return out;
}

// The caller has synchronised the CTA since fill_scale_tables. Returns whether the block holds a
// NaN or an inf (then amax does: max.NaN keeps NaN): the scale saturates and hides them, so the
// caller raises a flag instead (params.h, nonfinite_*), at no cost on the finite path.
__device__ __forceinline__ bool quantize_block16(const float (&v)[16], const ScaleTables& tables, uint32_t& lo,
                                                 uint32_t& hi, uint32_t& sf_bits) {
  const float amax = abs_max16(v);
  const bool nonfinite = !(amax <= FLT_MAX);
  bool fast = amax <= kUnsaturatedAmax;  // false for NaN and inf
  if (fast) {
    sf_bits = nvfp4_dit::float_to_e4m3(amax_over_6(amax));
    if (sf_bits == 0) {  // zero scale: an all-zero block
      lo = hi = 0;
      return false;
    }
    fast = sf_bits > kLastCoarseScaleByte;
  }
  if (!fast) {
    const Block16Bytes out =
        quantize_block16_ieee(make_float4(v[0], v[1], v[2], v[3]), make_float4(v[4], v[5], v[6], v[7]),
                              make_float4(v[8], v[9], v[10], v[11]), make_float4(v[12], v[13], v[14], v[15]), amax);
    lo = out.lo;
    hi = out.hi;
    sf_bits = out.sf_bits;
    return nonfinite;
  }
  const float sf = tables.value[sf_bits], rcp = tables.rcp[sf_bits];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float quot[8];  // below 7
#pragma unroll
    for (int e = 0; e < 8; ++e) quot[e] = divide_by_scale(fabsf(v[8 * half + e]), sf, rcp);
    (half ? hi : lo) = encode8(quot, v + 8 * half);
  }
  return false;
}

// 16 consecutive floats of shared memory (16-byte aligned) as four 16-byte loads.
__device__ __forceinline__ void load_floats16(const float* src, float (&out)[16]) {
  const float4* v = reinterpret_cast<const float4*>(src);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float4 t = v[i];
    out[4 * i] = t.x;
    out[4 * i + 1] = t.y;
    out[4 * i + 2] = t.z;
    out[4 * i + 3] = t.w;
  }
}

// Rows of [row0, row0 + span) below n_valid (the rest are padding): 0 .. span.
__host__ __device__ __forceinline__ int64_t rows_below(int64_t n_valid, int64_t row0, int64_t span) {
  const int64_t left = n_valid - row0;
  return left <= 0 ? 0 : (left >= span ? span : left);
}

// Raise a non-finite flag (zero on entry); only threads that met a NaN/inf get here.
__device__ __forceinline__ void raise_flag(uint32_t* flag, bool raise) {
  if (raise) atomicOr(flag, 1u);
}

__device__ __forceinline__ void store_u64(uint8_t* p, uint32_t lo, uint32_t hi) {
  *reinterpret_cast<uint2*>(p) = make_uint2(lo, hi);
}

__device__ __forceinline__ void store_u128(uint8_t* p, const uint32_t (&w)[4]) {
  *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
}

// MXFP8 Q/K (format.quantize_mx_blocks): this lane's 16 values are half of a 32-element block whose
// other half the xor-1 lane holds; every lane of the warp calls it (one shuffle, so also for
// padding rows, whose zeros give a zero block). The block's ue8m0 byte e + 127 (ue8m0_scale_byte),
// then e4m3(x / 2^e): the division by a power of two is exact (ldexpf), so each code is rounded
// once, as in format.py. 16 bytes into w; returns whether the block holds a NaN or an inf.
__device__ __forceinline__ bool quantize_mx_half32(const float (&v)[16], uint32_t (&w)[4], uint32_t& sf_bits) {
  const float half_amax = abs_max16(v);
  const float amax = max_nan(half_amax, __shfl_xor_sync(0xFFFFFFFFu, half_amax, 1));
  sf_bits = nvfp4_dit::ue8m0_scale_byte(amax);
  const int e = int(sf_bits) - nvfp4_dit::kUe8m0Bias;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t lo = nvfp4_dit::float2_to_e4m3x2(ldexpf(v[4 * i], -e), ldexpf(v[4 * i + 1], -e));
    const uint32_t hi = nvfp4_dit::float2_to_e4m3x2(ldexpf(v[4 * i + 2], -e), ldexpf(v[4 * i + 3], -e));
    w[i] = lo | (hi << 16);
  }
  return !(amax <= FLT_MAX);
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ uint32_t lds32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(addr));
  return v;
}

__device__ __forceinline__ uint4 lds128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}

// The V^T outputs of kTokens tokens (a tile or a sub-tile) of one kv head: DP rows of kTokens / 2
// data and kTokens / 16 scale bytes, each row quantized by several threads of different warps
// (kBlocks 16-token blocks each). Stored by those threads, a warp's store would touch 32 rows with
// a partial 32-byte sector each (measured at up to a fifth of a quantiser's time on the H200).
// So the threads put their bytes into shared
// memory (`base`, kBytes), meet at a barrier, and store whole rows: kTokens / 32 lanes per row.
template <int DP, int kTokens>
struct VtRowGather {
  static constexpr int kRowBytes = kTokens / 2;
  static constexpr int kChunks = kRowBytes / 16;  // 16-byte chunks per row
  static constexpr int kScaleRowBytes = kTokens / 16;
  static constexpr int kBytes = DP * (kRowBytes + kScaleRowBytes);
  static_assert(kChunks == 2 || kChunks == 4, "a sub-tile of 64 or a tile of 128 tokens");
  uint32_t base;

  // Byte `byte` of row `row`, its 16-byte chunk swizzled by the row: the writers of one store
  // instruction (rows 2 apart) then hit two banks each instead of eight.
  __device__ __forceinline__ uint32_t data(int row, int byte) const {
    return base + row * kRowBytes + (byte ^ (((row >> 1) & (kChunks - 1)) << 4));
  }
  __device__ __forceinline__ uint32_t scale(int row, int byte) const {
    return base + DP * kRowBytes + row * kScaleRowBytes + byte;
  }

  // This thread's kBlocks blocks of row `row` from block `tb` of the tile (8 data bytes and one
  // scale byte each).
  template <int kBlocks>
  __device__ __forceinline__ void put(int row, int tb, const uint32_t (&words)[2 * kBlocks], uint32_t sfs) const {
    static_assert(kBlocks == 1 || kBlocks == 2, "one or two blocks per thread");
    if constexpr (kBlocks == 2) {
      asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(data(row, tb * 8)), "r"(words[0]), "r"(words[1]),
                   "r"(words[2]), "r"(words[3])
                   : "memory");
      asm volatile("st.shared.u16 [%0], %1;" ::"r"(scale(row, tb)), "h"(static_cast<uint16_t>(sfs)) : "memory");
    } else {
      asm volatile("st.shared.v2.u32 [%0], {%1, %2};" ::"r"(data(row, tb * 8)), "r"(words[0]), "r"(words[1]) : "memory");
      asm volatile("st.shared.u8 [%0], %1;" ::"r"(scale(row, tb)), "h"(static_cast<uint16_t>(sfs)) : "memory");
    }
  }

  // After the barrier: the rows of kv head bh (b * Hkv + kvh) at tokens [tok0, tok0 + kTokens),
  // by `threads` threads (thread `tid`).
  __device__ __forceinline__ void store(const QuantizeQkvParams& p, int64_t bh, int64_t tok0, int tid,
                                        int threads) const {
    for (int i = tid; i < DP * kChunks; i += threads) {
      const int row = i / kChunks, chunk = i % kChunks;
      *reinterpret_cast<uint4*>(p.vt_data + (bh * DP + row) * (p.seq_k_padded / 2) + tok0 / 2 + chunk * 16) =
          lds128(data(row, chunk * 16));
    }
    for (int row = tid; row < DP; row += threads) {
      uint8_t* dst = p.vt_sf + (bh * DP + row) * (p.seq_k_padded / 16) + tok0 / 16;
      if constexpr (kScaleRowBytes == 8) {
        uint2 v;
        asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(scale(row, 0)));
        *reinterpret_cast<uint2*>(dst) = v;
      } else {
        *reinterpret_cast<uint32_t*>(dst) = lds32(scale(row, 0));
      }
    }
  }
};

// Stored row of token t inside its 32-key group: r = 8a + 2b + c holds token 8b + 2a + c. It
// moves rows only inside their group: k_row_perm(t + 32 n) = k_row_perm(t) + 32 n.
__device__ __forceinline__ int k_row_perm(int t) {
  const int c = t & 1, a = (t >> 1) & 3, b = (t >> 3) & 3;
  return (t & ~31) | (a << 3) | (b << 1) | c;
}

// Work counters (one zeroed workspace, quantize_qkv_workspace_counters): per (b, kv-head) the
// arrivals of its statistics tiles, then per (b, kv-head) and tensor its head exponent slot.
__device__ __forceinline__ uint32_t* arrivals(const QuantizeQkvParams& p) { return p.work_counters; }

// The statistics of statistics tile j of tensor `tensor` (0: K, 1: V) of kv head bh in the
// workspace: [kStatVectors, dp] (sum, min, max per channel; QuantizeQkvParams::k_partial_sums).
__device__ __forceinline__ float* statistics_tile_partials(const QuantizeQkvParams& p, int64_t bh, int tensor, int64_t j, int dp) {
  return p.k_partial_sums + ((bh * kStatTensors + tensor) * kStatisticsTiles + j) * kStatVectors * dp;
}

// Rows that the statistics tiles of a head of n_valid rows read (format.statistics_row_mask).
__device__ __forceinline__ int64_t statistics_row_count(int64_t n_valid) {
  const int64_t stride = statistics_stride(n_valid);
  int64_t n = 0;
  for (int64_t j = 0; j < kStatisticsTiles; ++j) n += rows_below(n_valid, j * stride * kTileRows, kTileRows);
  return n;
}

// A K or V tile is quantised under its own tensor scale 2^e, e = tensor_scale_exponent(tile amax),
// and the head's is the largest of them (tensor_scale is monotone): each tile raises its head's
// slot to e + kExponentBias (a slot of 0: no nonzero tile, the head's scale is 1), or to
// kNonfiniteExponent where the tile met NaN/inf (the head's scale is 1, format.tensor_scale).
constexpr int kExponentBias = 128;
constexpr uint32_t kNonfiniteExponent = 0xFFFFu;

__device__ __forceinline__ uint32_t* head_exponent_slot(const QuantizeQkvParams& p, int64_t bh, int tensor) {
  return p.work_counters + p.batch * p.heads_kv + bh * kStatTensors + tensor;
}

// Tile `tile` of K (tensor 0) or V's record in tile_records: its exponent, then its headroom.
__device__ __forceinline__ int32_t* tile_record(const QuantizeQkvParams& p, int tensor, int64_t tile) {
  const int64_t kv_tiles = p.batch * p.heads_kv * (p.seq_k_padded / kTileRows);
  return p.tile_records + (tensor * kv_tiles + tile) * 2;
}

__device__ __forceinline__ int head_exponent(uint32_t slot) {
  return slot == 0 || slot == kNonfiniteExponent ? 0 : int(slot) - kExponentBias;
}

// How many binades a block's scale byte can move down so that the block under a tensor scale that
// much larger has the same codes and the moved byte (format.scale_headroom); kAnyShift where any
// move is exact. NVFP4: a zero byte stays zero; exponent field E moves E - 1 and stays normal.
// MXFP8 (byte b = 2^(b-127)): down to kMxShiftFloor; a zero byte whose codes are all +-0 stays so.
constexpr int kAnyShift = 255;
constexpr int kMxShiftFloor = 25;

__device__ __forceinline__ int nvfp4_scale_headroom(uint32_t byte) {
  return byte == 0 ? kAnyShift : ((int(byte) >> 3) > 1 ? (int(byte) >> 3) - 1 : 0);
}

__device__ __forceinline__ int mxfp8_scale_headroom(uint32_t byte, const uint32_t (&codes)[4]) {
  if (byte != 0) return int(byte) > kMxShiftFloor ? int(byte) - kMxShiftFloor : 0;
  const uint32_t magnitudes = (codes[0] | codes[1] | codes[2] | codes[3]) & 0x7F7F7F7Fu;
  return magnitudes == 0 ? kAnyShift : 0;
}

// Four scale bytes moved down by `step` (NVFP4: binades << 3, MXFP8: binades), zero bytes kept:
// within the headroom no byte borrows from its neighbour.
__device__ __forceinline__ uint32_t shift_scale_bytes(uint32_t word, uint32_t step) {
  uint32_t out = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t b = (word >> (8 * i)) & 0xFFu;
    out |= (b == 0 ? 0u : b - step) << (8 * i);
  }
  return out;
}

// max |fl(x - mean)| over the keys of one channel, from their min and max: fl(x - mean) is monotone
// in x, so this is the maximum over the keys exactly (format.quantize_qkv takes it over every key).
// 0 without keys (min +inf, max -inf); NaN when an input or the mean is.
__device__ __forceinline__ float channel_deviation(float mean, float lo, float hi) {
  return max_nan(max_nan(__fsub_rn(hi, mean), __fsub_rn(mean, lo)), 0.0f);
}

// A head's statistics are finished by whichever CTA adds the last partial. Each CTA's threads store
// their partials and meet at a barrier (the CTA's, or a warp's: __syncwarp); then one thread
// counts the CTA on `counter` with count_arrival: it releases the partials at gpu scope first (a
// fence is cumulative over the writes the barrier ordered before it: CUTLASS's semaphore pattern),
// and the last arriver fences again (acquire) before its threads, after another barrier, read the
// other CTAs' partials. fence.acq_rel rather than __threadfence, which is fence.sc.gpu
// (MEMBAR.SC.GPU) in every thread.
__device__ __forceinline__ void fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }

__device__ __forceinline__ bool count_arrival(uint32_t* counter, int64_t expected) {
  fence_acq_rel_gpu();
  const bool last = atomicAdd(counter, 1u) == static_cast<uint32_t>(expected - 1);
  if (last) fence_acq_rel_gpu();
  return last;
}

// count_arrival for a whole CTA: `slot` (shared) carries thread 0's verdict to the others.
__device__ __forceinline__ bool cta_arrived_last(uint32_t* counter, int64_t expected, uint32_t& slot) {
  __syncthreads();
  if (threadIdx.x == 0) slot = count_arrival(counter, expected);
  __syncthreads();
  return slot;
}

// A mean from the sum over n rows: zero when there are none (format.k_mean clamps the count to 1).
__device__ __forceinline__ float key_mean(float sum, int64_t n) {
  return __fdiv_rn(sum, float(n > 0 ? n : 1));
}

// Finishes the statistics of kv head bh from the per-channel totals over its statistics tiles (sum,
// min, max of K and of V) of channels c0 .. c0 + kCols - 1, held by this thread (`active`; inactive
// threads take part in the reductions only): writes km, vm and the channel balance s
// (format.quantize_qkv). group_max(x) is the NaN-propagating max of x over every thread holding
// channels of the head; all of them call this alike. The tensor scales come from the tiles.
template <int kCols, typename GroupMax>
__device__ __forceinline__ void finish_head_statistics(const QuantizeQkvParams& p, int64_t bh, int c0, bool active,
                                                       int dp, const float (&sum)[kStatTensors][kCols],
                                                       const float (&lo)[kStatTensors][kCols],
                                                       const float (&hi)[kStatTensors][kCols], GroupMax group_max) {
  const int64_t n_rows = statistics_row_count(valid_key_count(p, bh / p.heads_kv));
  float km[kCols], vm[kCols], dev_k[kCols], amax_q[kCols];
  float top_k = 0.0f, top_q = 0.0f;
#pragma unroll
  for (int c = 0; c < kCols; ++c) {
    km[c] = key_mean(sum[0][c], n_rows);
    vm[c] = key_mean(sum[1][c], n_rows);
    dev_k[c] = active ? channel_deviation(km[c], lo[0][c], hi[0][c]) : 0.0f;
    amax_q[c] = active && p.balance_qk ? __uint_as_float(p.q_channel_amax[bh * dp + c0 + c]) : 0.0f;
    top_k = max_nan(top_k, dev_k[c]);
    top_q = max_nan(top_q, amax_q[c]);
  }
  top_k = group_max(top_k);
  top_q = group_max(top_q);
#pragma unroll
  for (int c = 0; c < kCols; ++c) {
    const float s = p.balance_qk ? channel_balance(amax_q[c], dev_k[c], top_q, top_k) : 1.0f;
    if (active) {
      p.k_mean[bh * dp + c0 + c] = km[c];
      p.v_mean[bh * dp + c0 + c] = vm[c];
      p.balance[bh * dp + c0 + c] = s;
    }
  }
}

}  // namespace
}  // namespace nvfp4_dit
