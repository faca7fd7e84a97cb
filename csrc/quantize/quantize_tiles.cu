// The tile kernel of the NVFP4 preprocessing of Q, K and V (contract: quantize.cuh). It takes any
// input (fp32, strided, D < Dp, any GPU); quantize_stream.cu is the faster kernel for contiguous
// 16-bit rows on sm_90+.
//
// Two kernel launches (after the caller's memset of a small counter workspace), each CTA one
// work item by blockIdx, none waiting for another:
//   1. key_mean_v_kernel: K-mean chunks, each summing kKeyMeanChunk keys of one (b, kv-head)
//      (the last chunk of a head to arrive adds the chunk sums in a fixed order, deterministic,
//      and writes km), then the V^T tiles (transposed through shared memory, quantized along
//      tokens; they need no km).
//   2. key_query_kernel: K tiles (subtract km, write rows permuted) and Q tiles (reduce the
//      tile's own 128-row block mean, subtract it, quantize, write q . km). Stream order makes km
//      ready.
// Why two launches rather than one with a ticket order: in one launch a K or Q tile waits for its
// head's mean from other CTAs (a ticket atomic, a ready-flag poll, then the km load), which needs
// every earlier ticket's CTA to be resident and costs round trips to L2 per tile. Split, no CTA
// waits on another and each tile issues its loads first thing. The price: K is read twice from
// DRAM (by its mean chunks, then by its tiles after every head's mean); the streaming kernel's
// per-head order serves the second read from L2 (docs/quantize.md).
// Padding rows/columns are written as zero data with zero scales; keys past kv_lens are padding.
//
// Every offset is int64. No fast-math: the scale and data divisions are correctly rounded
// (quantize_math.cuh, checked exhaustively on the host), so the bytes equal format.py's.
#include <cfloat>

#include <cuda_fp16.h>

#include "common/format.cuh"
#include "quantize/quantize.cuh"
#include "quantize/quantize_block.cuh"
#include "quantize/quantize_math.cuh"

namespace nvfp4_dit {
namespace {

constexpr int kThreads = 256;
// CTAs per SM for __launch_bounds__: 4 caps registers at 64 (a few bytes spill on bf16/fp16 with
// D = 128), and the extra warps hide more memory latency than the spill costs (faster than 3 or 2
// on the H200).
constexpr int kMinCtasPerSm = 4;
constexpr int kWarps = kThreads / 32;
// How far ahead (in waves of resident CTAs) a CTA prefetches a tile into L2.
constexpr int kPrefetchWaves = 1;
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

// Asks L2 to fetch rows [row0, row0 + rows) of head (b, h) of input t (contiguous rows of DP
// elements, VEC), one 128-byte line per thread and step. No registers wait for it, so DRAM has
// work while the CTAs compute and the tile's own loads later hit L2.
template <typename Raw, int DP>
__device__ __forceinline__ void prefetch_rows_l2(const StridedInput& t, int64_t b, int64_t h, int64_t row0,
                                                 int64_t rows) {
  constexpr int kLinesPerRow = (DP * int(sizeof(Raw)) + 127) / 128;
  const char* base = reinterpret_cast<const char*>(static_cast<const Raw*>(t.ptr) + row_offset(t, b, h, row0));
  const int64_t row_bytes = t.stride_s * int64_t(sizeof(Raw));
  for (int64_t i = threadIdx.x; i < rows * kLinesPerRow; i += kThreads)
    asm volatile("prefetch.global.L2 [%0];" ::"l"(base + (i / kLinesPerRow) * row_bytes + (i % kLinesPerRow) * 128));
}

// prefetch_rows_l2 of the valid rows of 128-row tile `tile` of [B, heads, S] input t (n_blocks
// tiles per head): keys (valid up to kv_lens) or queries (valid up to seq_q).
template <typename Raw, int DP>
__device__ __forceinline__ void prefetch_tile_l2(const QuantizeQkvParams& p, const StridedInput& t, int64_t heads,
                                                 int64_t n_blocks, int64_t tile, bool keys) {
  const int64_t bh = tile / n_blocks, blk = tile % n_blocks, b = bh / heads;
  const int64_t n_valid = keys ? valid_key_count(p, b) : p.seq_q;
  prefetch_rows_l2<Raw, DP>(t, b, bh % heads, blk * kTileRows, rows_below(n_valid, blk * kTileRows, kTileRows));
}

////////////////////////////////////////////////////////////////////////////////////////////////
// Work items 1: the K mean, kKeyMeanChunk keys per item

template <InputDtype DT, int DP, bool VEC, typename Shared>
__device__ __forceinline__ void key_mean_item(const QuantizeQkvParams& p, Shared& sm, int64_t item) {
  using Raw = typename InputTraits<DT>::Raw;
  constexpr int kColGroups = DP / 16;             // threads per row, 16 columns each
  constexpr int kRowsPerPass = kThreads / kColGroups;
  const int64_t n_chunks = quantize_qkv_k_chunks(p.seq_k);
  const int64_t bh = item / n_chunks;  // b * Hkv + kvh
  const int64_t chunk = item % n_chunks;
  const int64_t b = bh / p.heads_kv, h = bh % p.heads_kv;
  const int64_t n_valid = valid_key_count(p, b);
  const int cg = threadIdx.x % kColGroups;
  const int r0 = threadIdx.x / kColGroups;
  const Raw* base = static_cast<const Raw*>(p.k.ptr) + row_offset(p.k, b, h, 0);
  if constexpr (VEC) {  // the whole chunk at once, not kUnroll loads per thread at a time
    const int64_t first = chunk * kKeyMeanChunk;
    prefetch_rows_l2<Raw, DP>(p.k, b, h, first, rows_below(n_valid, first, kKeyMeanChunk));
  }

  float sum[16];
#pragma unroll
  for (int e = 0; e < 16; ++e) sum[e] = 0.0f;
  const int64_t key0 = chunk * kKeyMeanChunk;
  constexpr int kUnroll = 4;  // loads in flight per thread
  for (int pass = 0; pass < kKeyMeanChunk / kRowsPerPass; pass += kUnroll) {
    if (key0 + pass * kRowsPerPass >= n_valid) break;  // uniform across the CTA
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
    for (int e = 0; e < 16; ++e) sm.red[warp][lane * 16 + e] = sum[e];
  __syncthreads();

  float* partial = key_chunk_sums(p, bh, n_chunks, DP);
  if (threadIdx.x < DP) {
    float s = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) s += sm.red[w][threadIdx.x];
    partial[chunk * DP + threadIdx.x] = s;
  }
  // Publish the chunk sum, then count arrivals; the last CTA of this head finishes the mean.
  if (!cta_arrived_last(arrivals(p) + bh, n_chunks, sm.last_arrival)) return;
  if (threadIdx.x < DP) {
    float s = 0.0f;
    for (int64_t c = 0; c < n_chunks; ++c) s += __ldcg(partial + c * DP + threadIdx.x);
    p.k_mean[bh * DP + threadIdx.x] = key_mean(s, n_valid);
  }
}

////////////////////////////////////////////////////////////////////////////////////////////////
// Work items 2: Q, K and V^T tiles

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
    float red[kWarps][DP];
  };
  // Per-column vectors, column c at padded_column(c): a warp's eight column blocks then read
  // them as 16-byte vectors without bank conflicts (a pitch of 16 floats would put four
  // blocks on the same banks).
  float mean[DP + DP / 4];  // the Q tile's block mean
  float km[DP + DP / 4];    // km of the tile's kv head (K tiles: subtracted; Q tiles: q . km)
  ScaleTables tables;
  uint32_t last_arrival;  // this CTA added a head's last K-mean chunk
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
  const int valid_rows = int(rows_below(p.seq_q, row0, kTileRows));

  const Raw* base = static_cast<const Raw*>(p.q.ptr) + row_offset(p.q, b, h, row0);
  Block16<DT> x[Map::kPasses];
#pragma unroll
  for (int ps = 0; ps < Map::kPasses; ++ps) {
    const int r = r0 + ps * Map::kRowsPerPass;
    x[ps].zero();
    if (r < valid_rows) load_block16<DT, VEC>(x[ps], base + r * p.q.stride_s, p.q.stride_d, cb * 16, int(p.head_dim));
  }
  // While the loads are in flight: km (written by the previous launch) and the scale tables.
  if (threadIdx.x < DP) sm.km[padded_column(threadIdx.x)] = __ldcg(p.k_mean + (b * p.heads_kv + kvh) * DP + threadIdx.x);
  fill_scale_tables(sm.tables);

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
    sm.mean[padded_column(threadIdx.x)] = qm;
    p.q_mean[(bh * n_blocks + blk) * DP + threadIdx.x] = qm;
  }
  __syncthreads();

  // This thread's outputs of pass 0; pass ps writes kRowsPerPass * ps rows further.
  uint8_t* data = p.q_data + (bh * p.seq_q_padded + row0 + r0) * (DP / 2) + cb * 8;
  uint8_t* sf = p.q_sf + (bh * p.seq_q_padded + row0 + r0) * (DP / 16) + cb;
  bool nonfinite = false;
#pragma unroll
  for (int ps = 0; ps < Map::kPasses; ++ps) {
    const int r = r0 + ps * Map::kRowsPerPass;
    uint32_t lo = 0, hi = 0, sf_bits = 0;
    float dot = 0.0f;
    if (r < valid_rows) {
      float v[16], qm[16], km[16];
      load_column_block(sm.mean, cb, qm);
      load_column_block(sm.km, cb, km);
#pragma unroll
      for (int e = 0; e < 16; ++e) {
        const float xe = x[ps].get(e);
        v[e] = xe - qm[e];
        dot = fmaf(xe, km[e], dot);
      }
      nonfinite |= quantize_block16(v, sm.tables, lo, hi, sf_bits);
    }
    store_u64(data + ps * Map::kRowsPerPass * (DP / 2), lo, hi);
    sf[ps * Map::kRowsPerPass * (DP / 16)] = static_cast<uint8_t>(sf_bits);
    // q . km: the kColBlocks threads of a row are consecutive lanes.
#pragma unroll
    for (int off = 1; off < Map::kColBlocks; off <<= 1) dot += __shfl_xor_sync(0xFFFFFFFFu, dot, off);
    if (cb == 0 && r < valid_rows) p.q_dot_km[bh * p.seq_q + row0 + r] = dot;
  }
  raise_flag(p.nonfinite_q_blocks + bh * n_blocks + blk, nonfinite);
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
  const int valid_rows = int(rows_below(valid_key_count(p, b), row0, kTileRows));

  const Raw* base = static_cast<const Raw*>(p.k.ptr) + row_offset(p.k, b, h, row0);
  Block16<DT> x[Map::kPasses];
#pragma unroll
  for (int ps = 0; ps < Map::kPasses; ++ps) {
    const int r = r0 + ps * Map::kRowsPerPass;
    x[ps].zero();
    if (r < valid_rows) load_block16<DT, VEC>(x[ps], base + r * p.k.stride_s, p.k.stride_d, cb * 16, int(p.head_dim));
  }
  // While the loads are in flight: km (written by the previous launch) and the scale tables.
  if (threadIdx.x < DP) sm.km[padded_column(threadIdx.x)] = __ldcg(p.k_mean + bh * DP + threadIdx.x);
  fill_scale_tables(sm.tables);
  __syncthreads();

  // This thread's outputs of pass 0, rows permuted; pass ps writes kRowsPerPass * ps rows further
  // (the permutation stays inside 32-row groups).
  static_assert(Map::kRowsPerPass % 32 == 0, "passes move whole 32-key groups");
  uint8_t* data = p.k_data + (bh * p.seq_k_padded + row0 + k_row_perm(r0)) * (DP / 2) + cb * 8;
  uint8_t* sf = p.k_sf + (bh * p.seq_k_padded + row0 + k_row_perm(r0)) * (DP / 16) + cb;
  bool nonfinite = false;
#pragma unroll
  for (int ps = 0; ps < Map::kPasses; ++ps) {
    const int r = r0 + ps * Map::kRowsPerPass;
    uint32_t lo = 0, hi = 0, sf_bits = 0;
    if (r < valid_rows) {
      float v[16], km[16];
      load_column_block(sm.km, cb, km);
#pragma unroll
      for (int e = 0; e < 16; ++e) v[e] = x[ps].get(e) - km[e];
      nonfinite |= quantize_block16(v, sm.tables, lo, hi, sf_bits);
    }
    store_u64(data + ps * Map::kRowsPerPass * (DP / 2), lo, hi);
    sf[ps * Map::kRowsPerPass * (DP / 16)] = static_cast<uint8_t>(sf_bits);
  }
  raise_flag(p.nonfinite_kv + bh, nonfinite);
}

template <InputDtype DT, int DP, bool VEC>
__device__ __forceinline__ void v_tile(const QuantizeQkvParams& p, SharedStorage<DP>& sm, int64_t tile) {
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

  for (int sub = 0; sub < kTileRows / kSubRows; ++sub) {
    const int64_t tok0 = blk * kTileRows + sub * kSubRows;
    if (sub) __syncthreads();  // the previous sub-tile is consumed
    if constexpr (VEC) {
      // Every load of the sub-tile in flight at once (one memory latency), then the stores.
      constexpr int kLoads = kSubRows * kChunksPerRow / kThreads;
      static_assert(kSubRows * kChunksPerRow % kThreads == 0, "whole 16-byte chunks per thread");
      uint4 val[kLoads];
#pragma unroll
      for (int j = 0; j < kLoads; ++j) {
        const int i = int(threadIdx.x) + j * kThreads;
        const int64_t tok = tok0 + i / kChunksPerRow;
        val[j] = make_uint4(0, 0, 0, 0);
        if (tok < n_valid) val[j] = __ldg(reinterpret_cast<const uint4*>(base + tok * p.v.stride_s) + i % kChunksPerRow);
      }
#pragma unroll
      for (int j = 0; j < kLoads; ++j) reinterpret_cast<uint4*>(stile)[int(threadIdx.x) + j * kThreads] = val[j];
    } else {
      for (int i = threadIdx.x; i < kSubRows * DP; i += kThreads) {
        const int r = i / DP, dd = i % DP;
        const int64_t tok = tok0 + r;
        stile[i] = (tok < n_valid && dd < p.head_dim) ? base[tok * p.v.stride_s + dd * p.v.stride_d] : Raw(0);
      }
    }
    __syncthreads();

    // Each thread reads one 32-bit word per token: kCols adjacent columns (two 16-bit or one
    // fp32 element; a warp reads 128 contiguous bytes of a token row, conflict-free), and
    // quantizes kBlocksPerThread consecutive 16-token blocks of each of those columns.
    uint32_t words[kCols][2 * kBlocksPerThread];
    uint32_t sfs[kCols] = {};
    bool nonfinite = false;
    const uint32_t* swords = reinterpret_cast<const uint32_t*>(sm.v_tile);
#pragma unroll
    for (int i = 0; i < kBlocksPerThread; ++i) {
      const int tb = part * kBlocksPerThread + i;
      float v[kCols][16];
#pragma unroll
      for (int e = 0; e < 16; ++e) {
        const uint32_t w = swords[(tb * 16 + e) * (DP / kCols) + cg];
        if constexpr (kCols == 2) {
          v[0][e] = InputTraits<DT>::to_float(w & 0xFFFFu);
          v[1][e] = InputTraits<DT>::to_float(w >> 16);
        } else {
          v[0][e] = InputTraits<DT>::to_float(w);
        }
      }
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        uint32_t sf_bits;
        nonfinite |= quantize_block16<DT != InputDtype::kFloat32>(v[c], sm.tables, words[c][2 * i], words[c][2 * i + 1],
                                                                 sf_bits);
        sfs[c] |= sf_bits << (8 * i);
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
}

// Each CTA of a launch first prefetches (L2) the input tile of the block `prefetch_distance`
// ahead, about one wave of resident CTAs: that CTA starts about when this one ends.

// Launch 1: blocks [0, mean_items) reduce K-mean chunks, the rest quantize V^T tiles.
template <InputDtype DT, int DP, bool VEC>
__global__ void __launch_bounds__(kThreads, kMinCtasPerSm)
    key_mean_v_kernel(const QuantizeQkvParams p, int64_t prefetch_distance) {
  using Raw = typename InputTraits<DT>::Raw;
  __shared__ __align__(16) SharedStorage<DP> sm;
  const int64_t mean_items = p.batch * p.heads_kv * quantize_qkv_k_chunks(p.seq_k);
  const int64_t n_blocks = p.seq_k_padded / kTileRows;
  const int64_t item = blockIdx.x;
  if constexpr (VEC) {
    const int64_t ahead = item + prefetch_distance - mean_items;  // a V^T tile (mean chunks prefetch themselves)
    if (ahead >= 0 && ahead < p.batch * p.heads_kv * n_blocks)
      prefetch_tile_l2<Raw, DP>(p, p.v, p.heads_kv, n_blocks, ahead, true);
  }
  if (item < mean_items) {
    key_mean_item<DT, DP, VEC>(p, sm, item);
    return;
  }
  fill_scale_tables(sm.tables);  // v_tile synchronises before its first block
  v_tile<DT, DP, VEC>(p, sm, item - mean_items);
}

// Launch 2: blocks [0, kv_tiles) quantize K tiles, the rest Q tiles.
template <InputDtype DT, int DP, bool VEC>
__global__ void __launch_bounds__(kThreads, kMinCtasPerSm)
    key_query_kernel(const QuantizeQkvParams p, int64_t prefetch_distance) {
  using Raw = typename InputTraits<DT>::Raw;
  __shared__ __align__(16) SharedStorage<DP> sm;
  const int64_t n_kblocks = p.seq_k_padded / kTileRows, n_qblocks = p.seq_q_padded / kTileRows;
  const int64_t kv_tiles = p.batch * p.heads_kv * n_kblocks;
  const int64_t item = blockIdx.x;
  if constexpr (VEC) {
    const int64_t ahead = item + prefetch_distance;
    if (ahead < kv_tiles)
      prefetch_tile_l2<Raw, DP>(p, p.k, p.heads_kv, n_kblocks, ahead, true);
    else if (ahead - kv_tiles < p.batch * p.heads_q * n_qblocks)
      prefetch_tile_l2<Raw, DP>(p, p.q, p.heads_q, n_qblocks, ahead - kv_tiles, false);
  }
  if (item < kv_tiles) k_tile<DT, DP, VEC>(p, sm, item);
  else q_tile<DT, DP, VEC>(p, sm, item - kv_tiles);
}

template <InputDtype DT, int DP, bool VEC>
cudaError_t launch_typed(const QuantizeQkvParams& p, cudaStream_t stream) {
  const int64_t kv_heads = p.batch * p.heads_kv;
  const int64_t kv_tiles = kv_heads * (p.seq_k_padded / kTileRows);
  const int64_t first = kv_heads * quantize_qkv_k_chunks(p.seq_k) + kv_tiles;
  const int64_t second = kv_tiles + p.batch * p.heads_q * (p.seq_q_padded / kTileRows);
  if (first > 0x7FFFFFFFLL || second > 0x7FFFFFFFLL) return cudaErrorInvalidConfiguration;
  int device = 0, sms = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return err;
  const int64_t prefetch_distance = int64_t(kPrefetchWaves) * sms * kMinCtasPerSm;
  key_mean_v_kernel<DT, DP, VEC><<<unsigned(first), kThreads, 0, stream>>>(p, prefetch_distance);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  key_query_kernel<DT, DP, VEC><<<unsigned(second), kThreads, 0, stream>>>(p, prefetch_distance);
  return cudaGetLastError();
}

template <InputDtype DT>
cudaError_t launch_dtype(const QuantizeQkvParams& p, cudaStream_t stream) {
  const int64_t eb = sizeof(typename InputTraits<DT>::Raw);
  const bool vec = vector_loads_ok(p.q, eb, p.head_dim, p.head_dim_padded) &&
                   vector_loads_ok(p.k, eb, p.head_dim, p.head_dim_padded) &&
                   vector_loads_ok(p.v, eb, p.head_dim, p.head_dim_padded);
  return NVFP4_DIT_HEAD_DIM_SWITCH(
      p.head_dim_padded, DP, vec ? launch_typed<DT, DP, true>(p, stream) : launch_typed<DT, DP, false>(p, stream));
}

}  // namespace

cudaError_t launch_quantize_qkv(const QuantizeQkvParams& p, cudaStream_t stream) {
  if (p.batch <= 0 || p.heads_q <= 0 || p.heads_kv <= 0 || p.heads_q % p.heads_kv != 0 ||
      p.seq_q_padded % kTileRows != 0 || p.seq_k_padded % kTileRows != 0 ||
      p.seq_q_padded < p.seq_q || p.seq_k_padded < p.seq_k || p.seq_q_padded <= 0 || p.seq_k_padded <= 0 ||
      padded_head_dim(p.head_dim) != p.head_dim_padded)
    return cudaErrorInvalidValue;
  if (p.kernel != QuantizeKernel::kTiles) {
    const cudaError_t err = launch_quantize_qkv_stream(p, stream);
    if (err != cudaErrorNotSupported || p.kernel == QuantizeKernel::kStream) return err;
  }
  switch (p.dtype) {
    case InputDtype::kBFloat16: return launch_dtype<InputDtype::kBFloat16>(p, stream);
    case InputDtype::kFloat16: return launch_dtype<InputDtype::kFloat16>(p, stream);
    case InputDtype::kFloat32: return launch_dtype<InputDtype::kFloat32>(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace nvfp4_dit
