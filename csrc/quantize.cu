// Fused NVFP4 preprocessing of Q, K and V (see quantize.cuh for the contract).
//
// Two kernel launches, the fewest the reductions allow without a grid-wide barrier:
//   1. key_mean_kernel: the per-(b, kv-head) K mean over the valid keys. Each CTA sums a chunk of
//      kKeyMeanChunk keys; the last CTA of a head to arrive adds the chunk sums in a fixed order
//      (deterministic) and writes km.
//   2. quantize_qkv_kernel: one CTA per 128-row tile of Q, K or V^T. A Q tile reduces its own
//      block mean, subtracts it, quantizes and writes q . km; a K tile subtracts km and writes its
//      rows permuted; a V tile transposes through shared memory and quantizes along tokens.
//      Padding rows/columns are written as zero data with zero scales.
// K tiles run first and in reverse head order, so the last heads reduced by launch 1 are still
// in L2 when launch 2 reads them again.
//
// Every offset is int64. No fast-math: the scale division is IEEE, the data division is the
// correctly rounded Markstein sequence of quantize_math.cuh, so the bytes equal format.py's.
#include <cuda_fp16.h>

#include "nvfp4_format.cuh"
#include "quantize.cuh"
#include "quantize_math.cuh"

namespace nvfp4_dit {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kTileRows = 128;
constexpr int kVTileBytes = 32 * 1024;  // shared memory of one V sub-tile

////////////////////////////////////////////////////////////////////////////////////////////////
// Inputs

template <InputDtype DT>
struct InputTraits;
template <>
struct InputTraits<InputDtype::kBFloat16> {
  using Raw = uint16_t;
  static __device__ __forceinline__ float to_float(uint32_t bits) { return __uint_as_float(bits << 16); }
};
template <>
struct InputTraits<InputDtype::kFloat16> {
  using Raw = uint16_t;
  static __device__ __forceinline__ float to_float(uint32_t bits) {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
  }
};
template <>
struct InputTraits<InputDtype::kFloat32> {
  using Raw = uint32_t;
  static __device__ __forceinline__ float to_float(uint32_t bits) { return __uint_as_float(bits); }
};

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

// Elements d0 .. d0+15 of one row. VEC: D == Dp, unit stride along D and 16-byte alignment, so
// the block is two (bf16/fp16) or four (fp32) 16-byte loads; otherwise strided scalar loads,
// with zeros past head_dim (the zero padding of D).
template <InputDtype DT, bool VEC>
__device__ __forceinline__ void load_block16(Block16<DT>& blk, const typename InputTraits<DT>::Raw* row,
                                             int64_t stride_d, int d0, int head_dim) {
  using Raw = typename InputTraits<DT>::Raw;
  if constexpr (VEC) {
    const uint4* p = reinterpret_cast<const uint4*>(row + d0);
#pragma unroll
    for (int i = 0; i < Block16<DT>::kWords / 4; ++i) {
      const uint4 t = __ldg(p + i);
      blk.w[4 * i + 0] = t.x;
      blk.w[4 * i + 1] = t.y;
      blk.w[4 * i + 2] = t.z;
      blk.w[4 * i + 3] = t.w;
    }
  } else {
#pragma unroll
    for (int e = 0; e < 16; ++e) {
      const int d = d0 + e;
      const uint32_t x = d < head_dim ? static_cast<uint32_t>(row[d * stride_d]) : 0u;
      if constexpr (sizeof(Raw) == 2) {
        if (e & 1) blk.w[e >> 1] |= x << 16;
        else blk.w[e >> 1] = x;
      } else {
        blk.w[e] = x;
      }
    }
  }
}

////////////////////////////////////////////////////////////////////////////////////////////////
// One block of 16 values -> 8 data bytes (two words) + one scale byte, exactly as format.py.

__device__ __forceinline__ float max_nan(float a, float b) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

__device__ __forceinline__ void quantize_block16(const float (&v)[16], uint32_t& lo, uint32_t& hi,
                                                 uint32_t& sf_bits) {
  float amax = 0.0f;
#pragma unroll
  for (int e = 0; e < 16; ++e) amax = max_nan(amax, fabsf(v[e]));  // a NaN makes the scale NaN
  const float sf = nvfp4::block_scale_value(amax, &sf_bits);
  lo = hi = 0;
  if (!(sf > 0.0f)) return;  // zero scale: all-zero block; NaN scale: x / NaN encodes as 0
  float quot[16];
  if (isinf(amax)) {
#pragma unroll
    for (int e = 0; e < 16; ++e) quot[e] = __fdiv_rn(fabsf(v[e]), sf);
  } else {
    const float rcp = __frcp_rn(sf);
#pragma unroll
    for (int e = 0; e < 16; ++e) quot[e] = divide_by_scale(fabsf(v[e]), sf, rcp);
  }
#if NVFP4_NATIVE_E2M1_CVT
  float lo8[8], hi8[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    lo8[e] = copysignf(quot[e], v[e]);
    hi8[e] = copysignf(quot[e + 8], v[e + 8]);
  }
  lo = nvfp4::pack8_e2m1(lo8);
  hi = nvfp4::pack8_e2m1(hi8);
#else
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    // The sign follows signbit(x / sf) = signbit(x), -0 included (format.e2m1_encode).
    const uint32_t c0 = e2m1_magnitude_code(quot[e]) | ((__float_as_uint(v[e]) >> 28) & 8u);
    const uint32_t c1 = e2m1_magnitude_code(quot[e + 8]) | ((__float_as_uint(v[e + 8]) >> 28) & 8u);
    lo |= c0 << (4 * e);
    hi |= c1 << (4 * e);
  }
#endif
}

__device__ __forceinline__ void store_u64(uint8_t* p, uint32_t lo, uint32_t hi) {
  *reinterpret_cast<uint2*>(p) = make_uint2(lo, hi);
}

// Stored row of token t inside its 32-key group: r = 8a + 2b + c holds token 8b + 2a + c.
__device__ __forceinline__ int k_row_perm(int t) {
  const int c = t & 1, a = (t >> 1) & 3, b = (t >> 3) & 3;
  return (t & ~31) | (a << 3) | (b << 1) | c;
}


////////////////////////////////////////////////////////////////////////////////////////////////
// Launch 1: K mean

template <InputDtype DT, int DP, bool VEC>
__global__ void __launch_bounds__(kThreads) key_mean_kernel(const QuantizeQkvParams p) {
  using Raw = typename InputTraits<DT>::Raw;
  constexpr int kColGroups = DP / 16;             // threads per row, 16 columns each
  constexpr int kRowsPerPass = kThreads / kColGroups;
  __shared__ float red[kWarps][DP];
  __shared__ bool last_arrival;

  const int64_t bh = blockIdx.y;  // b * Hkv + kvh
  const int64_t b = bh / p.heads_kv, h = bh % p.heads_kv;
  const int64_t chunk = blockIdx.x;
  const int64_t n_valid = valid_key_count(p, b);
  const int cg = threadIdx.x % kColGroups;
  const int r0 = threadIdx.x / kColGroups;
  const Raw* base = static_cast<const Raw*>(p.k.ptr) + row_offset(p.k, b, h, 0);

  float sum[16];
#pragma unroll
  for (int e = 0; e < 16; ++e) sum[e] = 0.0f;
  const int64_t key0 = chunk * kKeyMeanChunk;
  constexpr int kUnroll = 4;  // loads in flight per thread
  for (int pass = 0; pass < kKeyMeanChunk / kRowsPerPass; pass += kUnroll) {
    Block16<DT> blk[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t key = key0 + (pass + u) * kRowsPerPass + r0;
      blk[u].zero();
      if (key < n_valid) load_block16<DT, VEC>(blk[u], base + key * p.k.stride_s, p.k.stride_d, cg * 16, int(p.head_dim));
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
#pragma unroll
      for (int e = 0; e < 16; ++e) sum[e] += blk[u].get(e);
  }
  // Lanes with equal lane % kColGroups hold the same columns.
#pragma unroll
  for (int off = kColGroups; off < 32; off <<= 1)
#pragma unroll
    for (int e = 0; e < 16; ++e) sum[e] += __shfl_xor_sync(0xFFFFFFFFu, sum[e], off);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane < kColGroups)
#pragma unroll
    for (int e = 0; e < 16; ++e) red[warp][lane * 16 + e] = sum[e];
  __syncthreads();

  const int64_t n_chunks = quantize_qkv_k_chunks(p.seq_k);
  float* partial = p.k_partial_sums + bh * n_chunks * DP;
  if (threadIdx.x < DP) {
    float s = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) s += red[w][threadIdx.x];
    partial[chunk * DP + threadIdx.x] = s;
  }
  // Publish the chunk sum, then count arrivals; the last CTA of this head finishes the mean.
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    const uint32_t prev = atomicAdd(p.k_chunk_arrivals + bh, 1u);
    last_arrival = prev == static_cast<uint32_t>(n_chunks - 1);
  }
  __syncthreads();
  if (!last_arrival) return;
  __threadfence();
  if (threadIdx.x < DP) {
    float s = 0.0f;
    for (int64_t c = 0; c < n_chunks; ++c) s += __ldcg(partial + c * DP + threadIdx.x);
    // Zero when a batch has no valid keys (format.k_mean clamps the count to 1).
    p.k_mean[bh * DP + threadIdx.x] = __fdiv_rn(s, float(n_valid > 0 ? n_valid : 1));
  }
  if (threadIdx.x == 0) p.k_chunk_arrivals[bh] = 0;  // leave the workspace as it was found
}

////////////////////////////////////////////////////////////////////////////////////////////////
// Launch 2: Q, K and V^T tiles

template <int DP>
struct SharedStorage {
  union {
    unsigned char v_tile[kVTileBytes];
    float red[kWarps][DP];
  };
  float mean[DP];  // q block mean (Q tiles) or km (K tiles)
  float km[DP];    // km for q . km (Q tiles)
};

// Rows of a Q or K tile: thread (row r0 + kRowsPerPass * pass, column block cb).
template <int DP>
struct RowTileMap {
  static constexpr int kColBlocks = DP / 16;
  static constexpr int kRowsPerPass = kThreads / kColBlocks;
  static constexpr int kPasses = kTileRows / kRowsPerPass;
};

template <InputDtype DT, int DP, bool VEC>
__device__ __forceinline__ void q_tile(const QuantizeQkvParams& p, SharedStorage<DP>& sm, int64_t tile) {
  using Raw = typename InputTraits<DT>::Raw;
  using Map = RowTileMap<DP>;
  const int64_t n_blocks = p.seq_q_padded / kTileRows;
  const int64_t blk = tile % n_blocks;
  const int64_t bh = tile / n_blocks;  // b * H + h
  const int64_t b = bh / p.heads_q, h = bh % p.heads_q;
  const int64_t kvh = h / (p.heads_q / p.heads_kv);
  const int cb = threadIdx.x % Map::kColBlocks;
  const int r0 = threadIdx.x / Map::kColBlocks;
  const int64_t row0 = blk * kTileRows;
  const int64_t rows_left = p.seq_q - row0;
  const int valid_rows = rows_left <= 0 ? 0 : (rows_left >= kTileRows ? kTileRows : int(rows_left));

  if (threadIdx.x < DP) sm.km[threadIdx.x] = p.k_mean[(b * p.heads_kv + kvh) * DP + threadIdx.x];

  const Raw* base = static_cast<const Raw*>(p.q.ptr) + row_offset(p.q, b, h, row0);
  Block16<DT> x[Map::kPasses];
#pragma unroll
  for (int ps = 0; ps < Map::kPasses; ++ps) {
    const int r = r0 + ps * Map::kRowsPerPass;
    x[ps].zero();
    if (r < valid_rows) load_block16<DT, VEC>(x[ps], base + r * p.q.stride_s, p.q.stride_d, cb * 16, int(p.head_dim));
  }

  // Column sums over the tile's valid rows (padding rows were loaded as zeros).
  float sum[16];
#pragma unroll
  for (int e = 0; e < 16; ++e) {
    sum[e] = 0.0f;
#pragma unroll
    for (int ps = 0; ps < Map::kPasses; ++ps) sum[e] += x[ps].get(e);
  }
#pragma unroll
  for (int off = Map::kColBlocks; off < 32; off <<= 1)
#pragma unroll
    for (int e = 0; e < 16; ++e) sum[e] += __shfl_xor_sync(0xFFFFFFFFu, sum[e], off);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane < Map::kColBlocks)
#pragma unroll
    for (int e = 0; e < 16; ++e) sm.red[warp][lane * 16 + e] = sum[e];
  __syncthreads();
  if (threadIdx.x < DP) {
    float s = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) s += sm.red[w][threadIdx.x];
    const float qm = __fdiv_rn(s, float(valid_rows > 0 ? valid_rows : 1));
    sm.mean[threadIdx.x] = qm;
    p.q_mean[(bh * n_blocks + blk) * DP + threadIdx.x] = qm;
  }
  __syncthreads();

  uint8_t* data = p.q_data + (bh * p.seq_q_padded + row0) * (DP / 2);
  uint8_t* sf = p.q_sf + (bh * p.seq_q_padded + row0) * (DP / 16);
#pragma unroll
  for (int ps = 0; ps < Map::kPasses; ++ps) {
    const int r = r0 + ps * Map::kRowsPerPass;
    uint32_t lo = 0, hi = 0, sf_bits = 0;
    float dot = 0.0f;
    if (r < valid_rows) {
      float v[16];
#pragma unroll
      for (int e = 0; e < 16; ++e) {
        const float xe = x[ps].get(e);
        v[e] = xe - sm.mean[cb * 16 + e];
        dot = fmaf(xe, sm.km[cb * 16 + e], dot);
      }
      quantize_block16(v, lo, hi, sf_bits);
    }
    store_u64(data + r * (DP / 2) + cb * 8, lo, hi);
    sf[r * (DP / 16) + cb] = static_cast<uint8_t>(sf_bits);
    // q . km: the kColBlocks threads of a row are consecutive lanes.
#pragma unroll
    for (int off = 1; off < Map::kColBlocks; off <<= 1) dot += __shfl_xor_sync(0xFFFFFFFFu, dot, off);
    if (cb == 0 && r < valid_rows) p.q_dot_km[bh * p.seq_q + row0 + r] = dot;
  }
}

template <InputDtype DT, int DP, bool VEC>
__device__ __forceinline__ void k_tile(const QuantizeQkvParams& p, SharedStorage<DP>& sm, int64_t tile) {
  using Raw = typename InputTraits<DT>::Raw;
  using Map = RowTileMap<DP>;
  const int64_t n_blocks = p.seq_k_padded / kTileRows;
  const int64_t blk = tile % n_blocks;
  const int64_t bh = tile / n_blocks;  // b * Hkv + kvh
  const int64_t b = bh / p.heads_kv, h = bh % p.heads_kv;
  const int cb = threadIdx.x % Map::kColBlocks;
  const int r0 = threadIdx.x / Map::kColBlocks;
  const int64_t row0 = blk * kTileRows;
  // Keys past kv_lens[b] are padding like the keys past seq_k (format.quantize_qkv).
  const int64_t rows_left = valid_key_count(p, b) - row0;
  const int valid_rows = rows_left <= 0 ? 0 : (rows_left >= kTileRows ? kTileRows : int(rows_left));

  const Raw* base = static_cast<const Raw*>(p.k.ptr) + row_offset(p.k, b, h, row0);
  Block16<DT> x[Map::kPasses];
#pragma unroll
  for (int ps = 0; ps < Map::kPasses; ++ps) {
    const int r = r0 + ps * Map::kRowsPerPass;
    x[ps].zero();
    if (r < valid_rows) load_block16<DT, VEC>(x[ps], base + r * p.k.stride_s, p.k.stride_d, cb * 16, int(p.head_dim));
  }
  if (threadIdx.x < DP) sm.mean[threadIdx.x] = p.k_mean[bh * DP + threadIdx.x];
  __syncthreads();

  uint8_t* data = p.k_data + (bh * p.seq_k_padded + row0) * (DP / 2);
  uint8_t* sf = p.k_sf + (bh * p.seq_k_padded + row0) * (DP / 16);
#pragma unroll
  for (int ps = 0; ps < Map::kPasses; ++ps) {
    const int r = r0 + ps * Map::kRowsPerPass;
    uint32_t lo = 0, hi = 0, sf_bits = 0;
    if (r < valid_rows) {
      float v[16];
#pragma unroll
      for (int e = 0; e < 16; ++e) v[e] = x[ps].get(e) - sm.mean[cb * 16 + e];
      quantize_block16(v, lo, hi, sf_bits);
    }
    const int stored = k_row_perm(r);
    store_u64(data + stored * (DP / 2) + cb * 8, lo, hi);
    sf[stored * (DP / 16) + cb] = static_cast<uint8_t>(sf_bits);
  }
}

template <InputDtype DT, int DP, bool VEC>
__device__ __forceinline__ void v_tile(const QuantizeQkvParams& p, SharedStorage<DP>& sm, int64_t tile) {
  using Raw = typename InputTraits<DT>::Raw;
  // A sub-tile of kSubRows tokens x DP fits kVTileBytes; fp32 input needs two per 128 rows.
  constexpr int kSubRows = kVTileBytes / (DP * int(sizeof(Raw))) < kTileRows
                               ? kVTileBytes / (DP * int(sizeof(Raw)))
                               : kTileRows;
  constexpr int kBlocksPerCol = kSubRows / 16;          // 16-token blocks per d in a sub-tile
  constexpr int kThreadsPerCol = kThreads / DP;          // threads sharing one d
  constexpr int kBlocksPerThread = kBlocksPerCol / kThreadsPerCol;
  static_assert(kBlocksPerThread >= 1 && kBlocksPerCol % kThreadsPerCol == 0, "V tile split");
  constexpr int kChunksPerRow = DP * int(sizeof(Raw)) / 16;  // 16-byte chunks of one token row

  const int64_t n_blocks = p.seq_k_padded / kTileRows;
  const int64_t blk = tile % n_blocks;
  const int64_t bh = tile / n_blocks;
  const int64_t b = bh / p.heads_kv, h = bh % p.heads_kv;
  const int d = threadIdx.x % DP;
  const int part = threadIdx.x / DP;
  const int64_t n_valid = valid_key_count(p, b);  // keys past kv_lens[b] are zero padding
  Raw* stile = reinterpret_cast<Raw*>(sm.v_tile);
  const Raw* base = static_cast<const Raw*>(p.v.ptr) + row_offset(p.v, b, h, 0);

  for (int sub = 0; sub < kTileRows / kSubRows; ++sub) {
    const int64_t tok0 = blk * kTileRows + sub * kSubRows;
    if (sub) __syncthreads();  // the previous sub-tile is consumed
    if constexpr (VEC) {
      for (int i = threadIdx.x; i < kSubRows * kChunksPerRow; i += kThreads) {
        const int r = i / kChunksPerRow, ch = i % kChunksPerRow;
        const int64_t tok = tok0 + r;
        uint4 val = make_uint4(0, 0, 0, 0);
        if (tok < n_valid) val = __ldg(reinterpret_cast<const uint4*>(base + tok * p.v.stride_s) + ch);
        reinterpret_cast<uint4*>(stile)[i] = val;
      }
    } else {
      for (int i = threadIdx.x; i < kSubRows * DP; i += kThreads) {
        const int r = i / DP, dd = i % DP;
        const int64_t tok = tok0 + r;
        stile[i] = (tok < n_valid && dd < p.head_dim) ? base[tok * p.v.stride_s + dd * p.v.stride_d] : Raw(0);
      }
    }
    __syncthreads();

    uint32_t words[2 * kBlocksPerThread];
    uint32_t sfs = 0;
#pragma unroll
    for (int i = 0; i < kBlocksPerThread; ++i) {
      const int tb = part * kBlocksPerThread + i;
      float v[16];
#pragma unroll
      for (int e = 0; e < 16; ++e) v[e] = InputTraits<DT>::to_float(stile[(tb * 16 + e) * DP + d]);
      uint32_t sf_bits;
      quantize_block16(v, words[2 * i], words[2 * i + 1], sf_bits);
      sfs |= sf_bits << (8 * i);
    }
    // This thread's blocks are contiguous along tokens: 8 bytes of data and 1 scale byte each.
    const int64_t tb0 = tok0 / 16 + part * kBlocksPerThread;
    uint8_t* data = p.vt_data + ((bh * DP + d) * p.seq_k_padded) / 2 + tb0 * 8;
    uint8_t* sf = p.vt_sf + ((bh * DP + d) * p.seq_k_padded) / 16 + tb0;
#pragma unroll
    for (int i = 0; i < kBlocksPerThread; i += 2) {
      if (i + 1 < kBlocksPerThread) {
        *reinterpret_cast<uint4*>(data + i * 8) = make_uint4(words[2 * i], words[2 * i + 1], words[2 * i + 2], words[2 * i + 3]);
      } else {
        store_u64(data + i * 8, words[2 * i], words[2 * i + 1]);
      }
    }
    if constexpr (kBlocksPerThread == 4) *reinterpret_cast<uint32_t*>(sf) = sfs;
    else if constexpr (kBlocksPerThread == 2) *reinterpret_cast<uint16_t*>(sf) = static_cast<uint16_t>(sfs);
    else
#pragma unroll
      for (int i = 0; i < kBlocksPerThread; ++i) sf[i] = static_cast<uint8_t>(sfs >> (8 * i));
  }
}

template <InputDtype DT, int DP, bool VEC>
__global__ void __launch_bounds__(kThreads) quantize_qkv_kernel(const QuantizeQkvParams p) {
  __shared__ __align__(16) SharedStorage<DP> sm;
  const int64_t k_tiles = p.batch * p.heads_kv * (p.seq_k_padded / kTileRows);
  int64_t tile = blockIdx.x;
  if (tile < k_tiles) {
    k_tile<DT, DP, VEC>(p, sm, k_tiles - 1 - tile);
    return;
  }
  tile -= k_tiles;
  if (tile < k_tiles) {
    v_tile<DT, DP, VEC>(p, sm, tile);
    return;
  }
  q_tile<DT, DP, VEC>(p, sm, tile - k_tiles);
}

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; }

// D == Dp, unit stride along D, 16-byte aligned rows.
bool vector_loads_ok(const StridedInput& t, int64_t elem_bytes, int64_t head_dim, int64_t dp) {
  const int64_t per16 = 16 / elem_bytes;
  return head_dim == dp && t.stride_d == 1 && aligned16(t.ptr) && t.stride_b % per16 == 0 &&
         t.stride_h % per16 == 0 && t.stride_s % per16 == 0;
}

template <InputDtype DT, int DP, bool VEC>
cudaError_t launch_typed(const QuantizeQkvParams& p, cudaStream_t stream) {
  const int64_t n_chunks = quantize_qkv_k_chunks(p.seq_k);
  const int64_t kv_heads = p.batch * p.heads_kv;
  if (kv_heads > 65535) return cudaErrorInvalidConfiguration;
  key_mean_kernel<DT, DP, VEC><<<dim3(unsigned(n_chunks), unsigned(kv_heads)), kThreads, 0, stream>>>(p);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  const int64_t tiles = 2 * kv_heads * (p.seq_k_padded / kTileRows) + p.batch * p.heads_q * (p.seq_q_padded / kTileRows);
  if (tiles > 0x7FFFFFFFLL) return cudaErrorInvalidConfiguration;
  quantize_qkv_kernel<DT, DP, VEC><<<unsigned(tiles), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

template <InputDtype DT>
cudaError_t launch_dtype(const QuantizeQkvParams& p, cudaStream_t stream) {
  const int64_t eb = sizeof(typename InputTraits<DT>::Raw);
  const bool vec = vector_loads_ok(p.q, eb, p.head_dim, p.head_dim_padded) &&
                   vector_loads_ok(p.k, eb, p.head_dim, p.head_dim_padded) &&
                   vector_loads_ok(p.v, eb, p.head_dim, p.head_dim_padded);
  if (p.head_dim_padded == 128)
    return vec ? launch_typed<DT, 128, true>(p, stream) : launch_typed<DT, 128, false>(p, stream);
  if (p.head_dim_padded == 64)
    return vec ? launch_typed<DT, 64, true>(p, stream) : launch_typed<DT, 64, false>(p, stream);
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t launch_quantize_qkv(const QuantizeQkvParams& p, cudaStream_t stream) {
  if (p.batch <= 0 || p.heads_q <= 0 || p.heads_kv <= 0 || p.heads_q % p.heads_kv != 0 ||
      p.seq_q_padded % kTileRows != 0 || p.seq_k_padded % kTileRows != 0 ||
      p.seq_q_padded < p.seq_q || p.seq_k_padded < p.seq_k || p.seq_q_padded <= 0 || p.seq_k_padded <= 0 ||
      p.head_dim <= 0 || p.head_dim > p.head_dim_padded)
    return cudaErrorInvalidValue;
  switch (p.dtype) {
    case InputDtype::kBFloat16: return launch_dtype<InputDtype::kBFloat16>(p, stream);
    case InputDtype::kFloat16: return launch_dtype<InputDtype::kFloat16>(p, stream);
    case InputDtype::kFloat32: return launch_dtype<InputDtype::kFloat32>(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace nvfp4_dit
