// Streaming NVFP4 preprocessing of contiguous 16-bit rows (bf16/fp16, D == Dp, unit stride along
// D, 16-byte aligned rows), sm_90 and newer. Same contract and same bytes as quantize.cu
// (quantize.cuh; per-block code shared through quantize_block.cuh). Opt-in
// (QuantizeKernel::kStream, NVFP4_DIT_QUANTIZE_KERNEL=stream): on the H200 it is within a few
// percent of the tile kernel, faster in some runs and slower in others, and it takes fewer inputs
// (docs/quantize_performance.md has the numbers and the profiles).
//
// Why a second kernel: quantize.cu gives each CTA one tile, loaded into registers and then
// computed, so a warp waits for its loads before every tile; the tile kernel is latency-bound at
// 35-43 % of copy bandwidth. Here CTAs are persistent and copies run ahead of the arithmetic:
//  * one producer thread draws tickets and, for each 128-row tile, starts DP / 64 TMA box copies
//    (cp.async.bulk.tensor, 64 columns x 128 rows each) into a free shared-memory stage of a
//    ring; they complete on the stage's "full" mbarrier;
//  * eight consumer warps quantize the stage straight from shared memory, write the outputs and
//    release the stage on its "empty" mbarrier. They meet at a barrier only inside Q tiles (the
//    block mean) and K-mean tiles, never to wait for memory.
// Column sums (Q block means, K-mean tiles) run on tensor cores: ones(16x16) . tile, the tile read
// with ldmatrix.trans, fp32 accumulation.
//
// Ticket order, per (b, kv head) g: V(g), M(g + L), K(g), Q(g) after a prologue M(0 .. L-1), where
// M(g) are g's K-mean tiles, V/K its V^T and K tiles and Q the tiles of the query heads that share
// g. Every item depends only on lower tickets (K(g) and Q(g) need km(g), finished by M(g)), so the
// lowest unfinished ticket never waits; the lookahead L (host-chosen, about three pipeline
// depths) keeps K tiles from waiting for means still queued behind them.
//
// Stages hold TMA boxes with the 128-byte swizzle, under which the thread layouts below read
// shared memory without bank conflicts (16-byte row reads, 4-byte V column reads and ldmatrix).
#include <cfloat>

#include <cuda.h>  // CUtensorMap and its enums (types only: the encoder comes from the runtime)
#include <cuda_fp16.h>

#include "nvfp4_format.cuh"
#include "quantize.cuh"
#include "quantize_block.cuh"
#include "quantize_math.cuh"

namespace nvfp4_dit {
namespace {

constexpr int kConsumerWarps = 8;
constexpr int kConsumers = kConsumerWarps * 32;
constexpr int kStreamThreads = kConsumers + 32;  // + the producer warp
constexpr int kMaxStages = 8;

// A stage holds one 128-row tile as DP / 64 TMA boxes of 128 rows x 128 bytes, each stored with
// the 128-byte swizzle: 16-byte chunk c of row r sits at chunk c ^ (r % 8) of that row.
template <int DP>
struct StageGeometry {
  static constexpr int kBoxCols = 64;
  static constexpr int kBoxes = DP / kBoxCols;
  static constexpr int kBoxBytes = kTileRows * 128;
  static constexpr int kBytes = kBoxes * kBoxBytes;
};

enum ItemKind : int32_t { kEnd = 0, kMeanTile = 1, kVTile = 2, kKTile = 3, kQTile = 4 };

// What a stage holds, written by the producer before it arrives on the stage's full barrier.
struct StageInfo {
  int32_t kind;
  int32_t valid_rows;  // rows of data (before S and kv_lens); the rest of the 128 are padding
  int64_t bh;          // b * Hkv + kvh (M, V, K) or b * H + h (Q)
  int64_t tile;        // 128-row tile of that head
  int64_t kv_head;     // b * Hkv + kvh of the K mean it needs (K, Q)
};

template <int DP>
struct StreamShared {
  uint64_t full[kMaxStages];
  uint64_t empty[kMaxStages];
  StageInfo info[kMaxStages];
  float mean[kMaxStages][DP];         // Q: the tile's block mean
  float red[kConsumers / DP][DP];     // K mean: partial sums of the final reduction
  ScaleTables tables;
  uint32_t last_arrival;              // K mean: this CTA completed a chunk / the head
};

// Dynamic shared memory: StreamShared, then the stages from the next 1024-byte boundary (the
// 128-byte swizzle repeats every 8 rows = 1024 bytes).
template <int DP>
struct SharedLayout {
  static constexpr int kFixedBytes = int(sizeof(StreamShared<DP>)) + 1023;
};

// The TMA descriptors of Q, K and V: logical [B, H, S, D] through the inputs' strides, boxes of 64
// columns x 128 rows, rows past S read as zeros.
struct StreamMaps {
  CUtensorMap q, k, v;
};

// The device code needs sm_90 (mbarrier transaction counts, TMA); an sm_80 build keeps only an
// empty kernel, which the launcher never starts (cudaFuncAttributes::binaryVersion).
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900

constexpr int kConsumerBarrier = 1;  // named barrier of the consumer warps (0 is __syncthreads)
constexpr int64_t kChunkTiles = kKeyMeanChunk / kTileRows;
static_assert(kKeyMeanChunk % kTileRows == 0, "K-mean chunks are whole tiles");

// Shared address of 16-byte chunk `chunk` (0 .. DP/8 - 1) of tile row `row`.
__device__ __forceinline__ uint32_t swizzled(uint32_t stage, int row, int chunk) {
  return stage + (chunk >> 3) * (kTileRows * 128) + row * 128 + (((chunk & 7) ^ (row & 7)) << 4);
}

// The km-ready flags and the chunk arrivals of the tile sums (see arrivals() in
// quantize_block.cuh for the layout of the counters).
__device__ __forceinline__ uint32_t* km_ready(const QuantizeQkvParams& p) {
  return p.work_counters + 1 + p.batch * p.heads_kv;
}
__device__ __forceinline__ uint32_t* chunk_arrivals(const QuantizeQkvParams& p) {
  return p.work_counters + 1 + 2 * p.batch * p.heads_kv;
}

// After km is stored by the participating threads: make km visible, then raise bh's ready flag.
template <typename Sync>
__device__ __forceinline__ void publish_key_mean(const QuantizeQkvParams& p, int64_t bh, Sync sync) {
  sync();
  if (threadIdx.x == 0) {
    fence_acq_rel_gpu();
    atomicExch(km_ready(p) + bh, 1u);
  }
}

// Spin (this thread) until km of kv head bh is published. The mean items hold lower tickets than
// every item that waits, and a ticket is only drawn by a running CTA, so they are running or
// done: the wait always ends.
__device__ __forceinline__ void wait_key_mean_ready(const QuantizeQkvParams& p, int64_t bh) {
  const uint32_t* flag = km_ready(p) + bh;
  uint32_t ready;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(ready) : "l"(flag) : "memory");
  while (!ready) {
    __nanosleep(200);
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(ready) : "l"(flag) : "memory");
  }
}

////////////////////////////////////////////////////////////////////////////////////////////////
// PTX wrappers

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)),
               "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  const uint32_t addr = smem_addr(bar);
  uint32_t done;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 p, [%1], %2;\n"
        " selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(addr), "r"(parity)
        : "memory");
  } while (!done);
}

// One TMA box (64 columns x 128 rows at column d0, row row0 of head h of batch b) into shared
// memory, completing on `bar`, with an L2 eviction priority: evict_last for data read again soon,
// evict_first for data read for the last time. The policy is a constant of each asm block (a
// policy register selected at run time did not work for cp.async on the H200).
#define NVFP4_DIT_LOAD_BOX(POLICY)                                                                          \
  asm volatile("{\n .reg .b64 pol;\n createpolicy.fractional.L2::" POLICY ".b64 pol, 1.0;\n"              \
               " cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint" \
               " [%0], [%1, {%2, %3, %4, %5}], [%6], pol;\n}" ::"r"(dst),                                 \
               "l"(reinterpret_cast<uint64_t>(map)), "r"(d0), "r"(row0), "r"(h), "r"(b), "r"(smem_addr(bar)) \
               : "memory")

__device__ __forceinline__ void load_box(uint32_t dst, const CUtensorMap* map, int d0, int row0, int h, int b,
                                         uint64_t* bar, bool keep_in_l2) {
  if (keep_in_l2) NVFP4_DIT_LOAD_BOX("evict_last");
  else NVFP4_DIT_LOAD_BOX("evict_first");
}
#undef NVFP4_DIT_LOAD_BOX

__device__ __forceinline__ void consumer_barrier() {
  asm volatile("bar.sync %0, %1;" ::"n"(kConsumerBarrier), "n"(kConsumers) : "memory");
}

__device__ __forceinline__ uint4 lds128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}

__device__ __forceinline__ uint32_t lds32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(addr));
  return v;
}

// acc += ones(16x16) . B for one 16x8 B operand (b_lo: k 0-7, b_hi: k 8-15) of the input dtype:
// every row of acc receives the 8 column sums of B (products by 1 are exact, fp32 accumulation).
template <InputDtype DT>
__device__ __forceinline__ void mma_ones(float (&acc)[4], uint32_t b_lo, uint32_t b_hi) {
  if constexpr (DT == InputDtype::kBFloat16)
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %4, %4, %4}, {%5, %6}, "
        "{%0, %1, %2, %3};"
        : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
        : "r"(0x3F803F80u), "r"(b_lo), "r"(b_hi));
  else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %4, %4, %4}, {%5, %6}, "
        "{%0, %1, %2, %3};"
        : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
        : "r"(0x3C003C00u), "r"(b_lo), "r"(b_hi));
}

// Column sums of a stage's 128 rows for the 8 columns [n0, n0 + 8): 32 rows per ldmatrix.x4.trans
// (four 8x8 matrices = the B operands of two MMAs). Adds the sums of columns
// n0 + 2 * (lane % 4) + {0, 1} to acc[0], acc[1] (acc[2], acc[3]: the same, in the accumulator's
// second row).
template <InputDtype DT>
__device__ __forceinline__ void add_column_sums8(uint32_t stage, int n0, float (&acc)[4]) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int k0 = 0; k0 < kTileRows; k0 += 32) {
    uint32_t b0, b1, b2, b3;
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(b0), "=r"(b1), "=r"(b2), "=r"(b3)
                 : "r"(swizzled(stage, k0 + lane, n0 / 8)));
    mma_ones<DT>(acc, b0, b1);
    mma_ones<DT>(acc, b2, b3);
  }
}

// Column groups of 8 that consumer warp `warp` sums: DP = 128 -> warp and warp + 8; DP = 64 -> warp.
template <int DP>
struct ColumnSumMap {
  static constexpr int kGroupsPerWarp = DP / 8 / kConsumerWarps;
  static_assert(kGroupsPerWarp >= 1, "one group of 8 columns per warp at least");
};

// Rows past valid_rows hold keys past kv_lens (or TMA's zero fill past the sequence): zero them,
// so that column sums see zeros. Generic-proxy writes to memory that TMA will write again:
// ordered by the proxy fence.
template <int DP>
__device__ __forceinline__ void zero_padding_rows(uint32_t stage, int valid_rows) {
  constexpr int kChunks = DP * 2 / 16;
  for (int i = valid_rows * kChunks + int(threadIdx.x); i < kTileRows * kChunks; i += kConsumers)
    asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};" ::"r"(swizzled(stage, i / kChunks, i % kChunks)), "r"(0)
                 : "memory");
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  consumer_barrier();
}

////////////////////////////////////////////////////////////////////////////////////////////////
// Ticket order

struct Schedule {
  int64_t heads;      // B * Hkv
  int64_t n_kv;       // K (and V^T, and K-mean) tiles per kv head
  int64_t n_qh;       // Q tiles per query head
  int64_t group;      // query heads per kv head
  int64_t lookahead;  // heads whose K mean runs ahead of their K tiles
  int64_t prologue;   // tickets of M(0 .. lookahead - 1)
  int64_t unit;       // tickets of one kv head g: V(g), M(g + lookahead), K(g), Q(g)
  int64_t full_units; // heads whose unit holds an M
  int64_t total;

  __device__ __forceinline__ Schedule(const QuantizeQkvParams& p, int64_t mean_lookahead) {
    heads = p.batch * p.heads_kv;
    n_kv = p.seq_k_padded / kTileRows;
    n_qh = p.seq_q_padded / kTileRows;
    group = p.heads_q / p.heads_kv;
    lookahead = mean_lookahead < heads ? mean_lookahead : heads;
    prologue = lookahead * n_kv;
    unit = 3 * n_kv + group * n_qh;
    full_units = heads - lookahead;
    total = heads * unit;  // each head's M once: in the prologue or in a unit
  }
};

struct Item {
  int32_t kind;
  int64_t bh, tile;
};

// Ticket t -> work item.
__device__ __forceinline__ Item decode_ticket(const Schedule& sc, const QuantizeQkvParams& p, int64_t t) {
  if (t >= sc.total) return Item{kEnd, 0, 0};
  if (t < sc.prologue) return Item{kMeanTile, t / sc.n_kv, t % sc.n_kv};
  t -= sc.prologue;
  int64_t g, r;
  bool has_mean = t < sc.full_units * sc.unit;
  if (has_mean) {
    g = t / sc.unit;
    r = t % sc.unit;
  } else {
    t -= sc.full_units * sc.unit;
    g = sc.full_units + t / (sc.unit - sc.n_kv);
    r = t % (sc.unit - sc.n_kv);
  }
  if (r < sc.n_kv) return Item{kVTile, g, r};
  r -= sc.n_kv;
  if (has_mean) {
    if (r < sc.n_kv) return Item{kMeanTile, g + sc.lookahead, r};
    r -= sc.n_kv;
  }
  if (r < sc.n_kv) return Item{kKTile, g, r};
  r -= sc.n_kv;
  const int64_t b = g / p.heads_kv, kvh = g % p.heads_kv;
  return Item{kQTile, b * p.heads_q + kvh * sc.group + r / sc.n_qh, r % sc.n_qh};
}

////////////////////////////////////////////////////////////////////////////////////////////////
// Producer warp

// One thread: draws a ticket per stage, waits for the stage to be free, publishes what it holds
// and starts its TMA boxes.
template <int DP>
__device__ void produce(const QuantizeQkvParams& p, const StreamMaps& maps, StreamShared<DP>& sh, uint32_t stages,
                        int num_stages, int64_t mean_lookahead) {
  using G = StageGeometry<DP>;
  const Schedule sc(p, mean_lookahead);
  for (uint32_t n = 0;; ++n) {
    const Item it = decode_ticket(sc, p, atomicAdd(p.work_counters, 1u));
    const int s = int(n % uint32_t(num_stages));
    mbar_wait(&sh.empty[s], ((n / uint32_t(num_stages)) & 1u) ^ 1u);
    const CUtensorMap* map = nullptr;
    int64_t rows = 0, b = 0, h = 0, kv_head = it.bh;
    if (it.kind == kQTile) {
      map = &maps.q;
      b = it.bh / p.heads_q;
      h = it.bh % p.heads_q;
      kv_head = b * p.heads_kv + h / sc.group;
      rows = p.seq_q;
    } else if (it.kind != kEnd) {
      map = it.kind == kVTile ? &maps.v : &maps.k;
      b = it.bh / p.heads_kv;
      h = it.bh % p.heads_kv;
      rows = valid_key_count(p, b);  // keys past kv_lens[b] are padding
    }
    const int64_t row0 = it.tile * kTileRows;
    const int valid_rows = int(rows_below(rows, row0, kTileRows));
    sh.info[s] = StageInfo{it.kind, valid_rows, it.bh, it.tile, kv_head};
    if (it.kind == kEnd) {
      mbar_arrive(&sh.full[s]);
      return;
    }
    // Boxes are whole (TMA fills rows past S with zeros), so every stage receives G::kBytes.
    mbar_arrive_expect_tx(&sh.full[s], G::kBytes);
    // The K-mean read of the keys asks L2 to keep them for the K tiles' second read; every
    // other read is the data's last.
    const uint32_t dst = stages + uint32_t(s) * G::kBytes;
#pragma unroll
    for (int box = 0; box < G::kBoxes; ++box)
      load_box(dst + box * G::kBoxBytes, map, box * G::kBoxCols, int(row0), int(h), int(b), &sh.full[s],
               it.kind == kMeanTile);
  }
}

////////////////////////////////////////////////////////////////////////////////////////////////
// Consumer warps

// Q/K thread layout: a thread owns column block cb (16 columns) of kPasses rows. A quarter warp
// (8 lanes) reads two adjacent rows x four column blocks: under the swizzle (chunk ^ row % 8) the
// even and the odd row take the even and the odd 16-byte chunks of a 128-byte line, 8 distinct
// bank groups.
template <int DP>
struct RowMap {
  static constexpr int kColBlocks = DP / 16;
  static constexpr int kCbGroups = kColBlocks / 4;  // 2 (DP = 128) or 1 (DP = 64)
  static constexpr int kRowsPerWarp = 8 / kCbGroups;
  static constexpr int kRowsPerPass = kConsumerWarps * kRowsPerWarp;
  static constexpr int kPasses = kTileRows / kRowsPerPass;
  int cb, r0;
  __device__ __forceinline__ RowMap() {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int quarter = lane >> 3, i = lane & 7;
    cb = (i >> 1) + 4 * (quarter % kCbGroups);
    r0 = warp * kRowsPerWarp + (i & 1) + 2 * (quarter / kCbGroups);
  }
};

// 16 elements (chunks chunk, chunk + 1) of a stage row to floats.
template <InputDtype DT>
__device__ __forceinline__ void load_row16(uint32_t stage, int row, int chunk, float (&x)[16]) {
  const uint4 a = lds128(swizzled(stage, row, chunk)), c = lds128(swizzled(stage, row, chunk + 1));
  const uint32_t w[8] = {a.x, a.y, a.z, a.w, c.x, c.y, c.z, c.w};
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    x[2 * i] = InputTraits<DT>::to_float(w[i] & 0xFFFFu);
    x[2 * i + 1] = InputTraits<DT>::to_float(w[i] >> 16);
  }
}

// km of kv head bh into the 16 registers of column block cb, once km is ready (the K-mean
// chunks hold lower tickets, see the schedule).
template <int DP>
__device__ __forceinline__ void load_key_mean(const QuantizeQkvParams& p, int64_t bh, int cb, float (&km)[16]) {
  wait_key_mean_ready(p, bh);
  const float4* src = reinterpret_cast<const float4*>(p.k_mean + bh * DP + cb * 16);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float4 t = __ldcg(src + i);
    km[4 * i] = t.x;
    km[4 * i + 1] = t.y;
    km[4 * i + 2] = t.z;
    km[4 * i + 3] = t.w;
  }
}

template <InputDtype DT, int DP>
__device__ __forceinline__ void consume_k_tile(const QuantizeQkvParams& p, const StreamShared<DP>& sh,
                                               const StageInfo& info, uint32_t stage, const float (&km)[16]) {
  using G = StageGeometry<DP>;
  using Map = RowMap<DP>;
  const Map map;
  const int64_t row0 = info.tile * kTileRows;
  // Pass 0's outputs, rows permuted; pass ps writes kRowsPerPass * ps rows further (the
  // permutation stays inside 32-row groups).
  static_assert(Map::kRowsPerPass % 32 == 0, "passes move whole 32-key groups");
  const int64_t stored0 = info.bh * p.seq_k_padded + row0 + k_row_perm(map.r0);
  uint8_t* data = p.k_data + stored0 * (DP / 2) + map.cb * 8;
  uint8_t* sf = p.k_sf + stored0 * (DP / 16) + map.cb;
  bool nonfinite = false;
#pragma unroll
  for (int ps = 0; ps < Map::kPasses; ++ps) {
    const int r = map.r0 + ps * Map::kRowsPerPass;
    uint32_t lo = 0, hi = 0, sf_bits = 0;
    if (r < info.valid_rows) {
      float v[16];
      load_row16<DT>(stage, r, 2 * map.cb, v);
#pragma unroll
      for (int e = 0; e < 16; ++e) v[e] -= km[e];
      nonfinite |= quantize_block16(v, sh.tables, lo, hi, sf_bits);
    }
    store_u64(data + ps * Map::kRowsPerPass * (DP / 2), lo, hi);
    sf[ps * Map::kRowsPerPass * (DP / 16)] = static_cast<uint8_t>(sf_bits);
  }
  raise_flag(p.nonfinite_kv + info.bh, nonfinite);
}

template <InputDtype DT, int DP>
__device__ __forceinline__ void consume_q_tile(const QuantizeQkvParams& p, StreamShared<DP>& sh, const StageInfo& info,
                                               int s, uint32_t stage, const float (&km)[16]) {
  using Map = RowMap<DP>;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t n_blocks = p.seq_q_padded / kTileRows;
  const int64_t row0 = info.tile * kTileRows;

  // Block mean over the valid rows (padding rows zeroed first).
  if (info.valid_rows < kTileRows) zero_padding_rows<DP>(stage, info.valid_rows);
  const float rows = float(info.valid_rows > 0 ? info.valid_rows : 1);
#pragma unroll
  for (int g = 0; g < ColumnSumMap<DP>::kGroupsPerWarp; ++g) {
    const int n0 = (warp + g * kConsumerWarps) * 8;
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    add_column_sums8<DT>(stage, n0, acc);
    if (lane < 4) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int c = n0 + 2 * lane + j;
        const float qm = __fdiv_rn(acc[j], rows);
        sh.mean[s][c] = qm;
        p.q_mean[(info.bh * n_blocks + info.tile) * DP + c] = qm;
      }
    }
  }
  consumer_barrier();

  const Map map;
  float qm[16];
#pragma unroll
  for (int e = 0; e < 16; ++e) qm[e] = sh.mean[s][map.cb * 16 + e];
  uint8_t* data = p.q_data + (info.bh * p.seq_q_padded + row0) * (DP / 2) + map.cb * 8;
  uint8_t* sf = p.q_sf + (info.bh * p.seq_q_padded + row0) * (DP / 16) + map.cb;
  float* dot_out = p.q_dot_km + info.bh * p.seq_q + row0;
  bool nonfinite = false;
#pragma unroll
  for (int ps = 0; ps < Map::kPasses; ++ps) {
    const int r = map.r0 + ps * Map::kRowsPerPass;
    uint32_t lo = 0, hi = 0, sf_bits = 0;
    float dot = 0.0f;
    if (r < info.valid_rows) {
      float v[16];
      load_row16<DT>(stage, r, 2 * map.cb, v);
#pragma unroll
      for (int e = 0; e < 16; ++e) {
        dot = fmaf(v[e], km[e], dot);
        v[e] -= qm[e];
      }
      nonfinite |= quantize_block16(v, sh.tables, lo, hi, sf_bits);
    }
    store_u64(data + r * (DP / 2), lo, hi);
    sf[r * (DP / 16)] = static_cast<uint8_t>(sf_bits);
    // q . km: the lanes of a row differ in bits 1, 2 (and 3 for DP = 128) of the lane index.
#pragma unroll
    for (int off = 2; off < 2 * Map::kColBlocks; off <<= 1) dot += __shfl_xor_sync(0xFFFFFFFFu, dot, off);
    if (map.cb == 0 && r < info.valid_rows) dot_out[r] = dot;
  }
  raise_flag(p.nonfinite_q_blocks + info.bh * n_blocks + info.tile, nonfinite);
}

// V^T tile: a thread reads one 32-bit word (two columns) of each of 16 tokens per block - a warp
// reads 128 contiguous bytes of a token row - and quantizes along tokens.
template <InputDtype DT, int DP, bool FULL>
__device__ __forceinline__ void consume_v_tile(const QuantizeQkvParams& p, const StreamShared<DP>& sh,
                                               const StageInfo& info, uint32_t stage) {
  using G = StageGeometry<DP>;
  constexpr int kWordsPerRow = DP / 2;
  constexpr int kParts = kConsumers / kWordsPerRow;          // 4 (DP = 128) or 8 (DP = 64)
  constexpr int kBlocksPerThread = kTileRows / 16 / kParts;  // 2 or 1
  const int word = threadIdx.x % kWordsPerRow, part = threadIdx.x / kWordsPerRow;
  uint32_t out[2][2 * kBlocksPerThread];
  uint32_t sfs[2] = {0, 0};
  bool nonfinite = false;
#pragma unroll
  for (int i = 0; i < kBlocksPerThread; ++i) {
    const int tb = part * kBlocksPerThread + i;
    float v[2][16];
#pragma unroll
    for (int e = 0; e < 16; ++e) {
      const int tok = tb * 16 + e;
      uint32_t w = lds32(swizzled(stage, tok, word >> 2) + (word & 3) * 4);
      if (!FULL && tok >= info.valid_rows) w = 0;  // padding keys
      v[0][e] = InputTraits<DT>::to_float(w & 0xFFFFu);
      v[1][e] = InputTraits<DT>::to_float(w >> 16);
    }
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      uint32_t sf_bits;
      nonfinite |= quantize_block16(v[c], sh.tables, out[c][2 * i], out[c][2 * i + 1], sf_bits);
      sfs[c] |= sf_bits << (8 * i);
    }
  }
  raise_flag(p.nonfinite_kv + info.bh, nonfinite);
  const int64_t tb0 = info.tile * (kTileRows / 16) + part * kBlocksPerThread;
#pragma unroll
  for (int c = 0; c < 2; ++c) store_vt_blocks<kBlocksPerThread>(p, info.bh * DP + 2 * word + c, tb0, out[c], sfs[c]);
}

// One tile of a K mean: its column sums go to the workspace. The CTA that completes a chunk's
// tiles adds their sums (fixed order) into the chunk's sum, and the CTA that completes a head's
// chunks adds those (fixed order), writes km and raises the head's ready flag: deterministic, and
// the tiles of a head reduce in parallel across CTAs.
template <InputDtype DT, int DP>
__device__ __forceinline__ void consume_mean_tile(const QuantizeQkvParams& p, StreamShared<DP>& sh,
                                                  const StageInfo& info, uint32_t stage) {
  constexpr int kGroups = ColumnSumMap<DP>::kGroupsPerWarp;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t n_chunks = quantize_qkv_k_chunks(p.seq_k), n_tiles = p.seq_k_padded / kTileRows;
  float* chunk_sums = p.k_partial_sums + info.bh * n_chunks * DP;
  float* tile_sums = p.k_partial_sums + p.batch * p.heads_kv * n_chunks * DP + info.bh * n_tiles * DP;

  if (info.valid_rows < kTileRows) zero_padding_rows<DP>(stage, info.valid_rows);
#pragma unroll
  for (int g = 0; g < kGroups; ++g) {
    const int n0 = (warp + g * kConsumerWarps) * 8;
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    add_column_sums8<DT>(stage, n0, acc);
    if (lane < 4) *reinterpret_cast<float2*>(tile_sums + info.tile * DP + n0 + 2 * lane) = make_float2(acc[0], acc[1]);
  }
  const int64_t chunk = info.tile / kChunkTiles, first = chunk * kChunkTiles;
  const int64_t tiles = n_tiles - first < kChunkTiles ? n_tiles - first : kChunkTiles;
  const auto sync = [] { consumer_barrier(); };
  if (!arrived_last(chunk_arrivals(p) + info.bh * n_chunks + chunk, tiles, sh.last_arrival, sync)) return;
  if (threadIdx.x < DP) {
    float sum = 0.0f;
    for (int64_t t = first; t < first + tiles; ++t) sum += __ldcg(tile_sums + t * DP + threadIdx.x);
    chunk_sums[chunk * DP + threadIdx.x] = sum;
  }
  if (!arrived_last(arrivals(p) + info.bh, n_chunks, sh.last_arrival, sync)) return;
  constexpr int kParts = kConsumers / DP;
  const int d = threadIdx.x % DP, part = threadIdx.x / DP;
  float sum = 0.0f;
#pragma unroll 8
  for (int64_t c = part; c < n_chunks; c += kParts) sum += __ldcg(chunk_sums + c * DP + d);
  sh.red[part][d] = sum;
  consumer_barrier();
  if (threadIdx.x < DP) {
    float total = 0.0f;
#pragma unroll
    for (int i = 0; i < kParts; ++i) total += sh.red[i][threadIdx.x];
    p.k_mean[info.bh * DP + threadIdx.x] = key_mean(total, valid_key_count(p, info.bh / p.heads_kv));
  }
  publish_key_mean(p, info.bh, sync);
}

template <InputDtype DT, int DP>
__device__ void consume(const QuantizeQkvParams& p, StreamShared<DP>& sh, uint32_t stages, int num_stages) {
  using G = StageGeometry<DP>;
  const int lane = threadIdx.x & 31;
  const RowMap<DP> map;
  float km[16];
  int64_t km_head = -1;  // kv head whose km is in km[]
  for (uint32_t n = 0;; ++n) {
    const int s = int(n % uint32_t(num_stages));
    mbar_wait(&sh.full[s], (n / uint32_t(num_stages)) & 1u);
    const StageInfo info = sh.info[s];
    if (info.kind == kEnd) return;
    const uint32_t stage = stages + uint32_t(s) * G::kBytes;
    if (info.kind == kMeanTile) {
      consume_mean_tile<DT, DP>(p, sh, info, stage);
    } else if (info.kind == kVTile) {
      if (info.valid_rows == kTileRows) consume_v_tile<DT, DP, true>(p, sh, info, stage);
      else consume_v_tile<DT, DP, false>(p, sh, info, stage);
    } else {
      if (info.kv_head != km_head) {
        load_key_mean<DP>(p, info.kv_head, map.cb, km);
        km_head = info.kv_head;
      }
      if (info.kind == kKTile) consume_k_tile<DT, DP>(p, sh, info, stage, km);
      else consume_q_tile<DT, DP>(p, sh, info, s, stage, km);
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(&sh.empty[s]);
  }
}

#endif  // sm_90+

template <InputDtype DT, int DP>
__global__ void __launch_bounds__(kStreamThreads, 2) quantize_qkv_stream_kernel(
    const QuantizeQkvParams p, const __grid_constant__ StreamMaps maps, int num_stages, int64_t mean_lookahead) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) unsigned char smem[];
  auto& sh = *reinterpret_cast<StreamShared<DP>*>(smem);
  const uint32_t stages = (smem_addr(smem) + uint32_t(sizeof(StreamShared<DP>)) + 1023u) & ~1023u;
  fill_scale_tables(sh.tables);
  if (threadIdx.x == 0) {
    for (int s = 0; s < num_stages; ++s) {
      mbar_init(&sh.full[s], 1);
      mbar_init(&sh.empty[s], kConsumerWarps);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (threadIdx.x == kConsumers) produce<DP>(p, maps, sh, stages, num_stages, mean_lookahead);
  else if (threadIdx.x < kConsumers) consume<DT, DP>(p, sh, stages, num_stages);
#endif
}

// cuTensorMapEncodeTiled from the driver, through the runtime (no link against libcuda).
using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

EncodeTiled encode_tiled() {
  static const EncodeTiled fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult status;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &status) !=
            cudaSuccess ||
        status != cudaDriverEntryPointSuccess)
      return EncodeTiled(nullptr);
    return reinterpret_cast<EncodeTiled>(f);
  }();
  return fn;
}

// TMA descriptor of one logical [B, H, S, D] input (D == DP, unit stride along D). A dimension of
// extent 1 gets a nominal stride: only coordinate 0 is ever read there.
template <int DP>
bool encode_input_map(CUtensorMap* map, const StridedInput& t, InputDtype dtype, int64_t batch, int64_t heads,
                      int64_t seq) {
  const EncodeTiled encode = encode_tiled();
  if (encode == nullptr || seq <= 0 || seq > 0x7FFFFFFFLL) return false;
  const cuuint64_t row_bytes = cuuint64_t(t.stride_s) * 2;
  const cuuint64_t dims[4] = {cuuint64_t(DP), cuuint64_t(seq), cuuint64_t(heads), cuuint64_t(batch)};
  const cuuint64_t strides[3] = {seq == 1 ? cuuint64_t(DP) * 2 : row_bytes,
                                 heads == 1 ? 16 : cuuint64_t(t.stride_h) * 2,
                                 batch == 1 ? 16 : cuuint64_t(t.stride_b) * 2};
  if (t.stride_s < 0 || t.stride_h < 0 || t.stride_b < 0) return false;
  const cuuint32_t box[4] = {StageGeometry<DP>::kBoxCols, kTileRows, 1, 1};
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  const CUtensorMapDataType type =
      dtype == InputDtype::kBFloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  return encode(map, type, 4, const_cast<void*>(t.ptr), dims, strides, box, element_strides,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

template <InputDtype DT, int DP>
cudaError_t launch_stream_typed(const QuantizeQkvParams& p, cudaStream_t stream) {
  auto kernel = quantize_qkv_stream_kernel<DT, DP>;
  cudaFuncAttributes attr;
  cudaError_t err = cudaFuncGetAttributes(&attr, kernel);
  if (err != cudaSuccess) return err;
  if (attr.binaryVersion < 90) return cudaErrorNotSupported;  // built for sm_80: no TMA
  StreamMaps maps;
  if (!encode_input_map<DP>(&maps.q, p.q, p.dtype, p.batch, p.heads_q, p.seq_q) ||
      !encode_input_map<DP>(&maps.k, p.k, p.dtype, p.batch, p.heads_kv, p.seq_k) ||
      !encode_input_map<DP>(&maps.v, p.v, p.dtype, p.batch, p.heads_kv, p.seq_k))
    return cudaErrorNotSupported;
  int device = 0, sms = 0, smem_sm = 0, smem_block = 0, reserved = 0;
  if ((err = cudaGetDevice(&device)) != cudaSuccess ||
      (err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device)) != cudaSuccess ||
      (err = cudaDeviceGetAttribute(&smem_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device)) != cudaSuccess ||
      (err = cudaDeviceGetAttribute(&smem_block, cudaDevAttrMaxSharedMemoryPerBlockOptin, device)) != cudaSuccess ||
      (err = cudaDeviceGetAttribute(&reserved, cudaDevAttrReservedSharedMemoryPerBlock, device)) != cudaSuccess)
    return err;
  // Two CTAs per SM where three stages each fit (the H200 at DP = 128), else one.
  constexpr int kStage = StageGeometry<DP>::kBytes;
  constexpr int kFixed = SharedLayout<DP>::kFixedBytes;
  int stages = (smem_sm / 2 - reserved - kFixed) / kStage;
  if (stages < 3) stages = (smem_block - kFixed) / kStage;
  if (stages > kMaxStages) stages = kMaxStages;
  if (stages < 2) return cudaErrorNotSupported;
  const int smem = kFixed + stages * kStage;
  if ((err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem)) != cudaSuccess)
    return err;
  int per_sm = 0;
  if ((err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kStreamThreads, smem)) != cudaSuccess)
    return err;
  if (per_sm < 1) return cudaErrorNotSupported;
  // K means run ahead of the K tiles by about three pipeline depths (stages in flight on the
  // device): a K tile's consumer then finds km ready instead of waiting for tiles still queued
  // behind it. That is ~3 * depth / 4 tiles of keys kept in L2 (~20 MB on the H200) whatever S.
  const int64_t grid = int64_t(sms) * per_sm;
  const int64_t unit = 3 * (p.seq_k_padded / kTileRows) + (p.heads_q / p.heads_kv) * (p.seq_q_padded / kTileRows);
  const int64_t lookahead = (3 * grid * stages + unit - 1) / unit;
  kernel<<<unsigned(grid), kStreamThreads, smem, stream>>>(p, maps, stages, lookahead);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_quantize_qkv_stream(const QuantizeQkvParams& p, cudaStream_t stream) {
  if (p.dtype == InputDtype::kFloat32 || !vector_loads_ok(p.q, 2, p.head_dim, p.head_dim_padded) ||
      !vector_loads_ok(p.k, 2, p.head_dim, p.head_dim_padded) || !vector_loads_ok(p.v, 2, p.head_dim, p.head_dim_padded))
    return cudaErrorNotSupported;
  const bool bf16 = p.dtype == InputDtype::kBFloat16;
  if (p.head_dim_padded == 128)
    return bf16 ? launch_stream_typed<InputDtype::kBFloat16, 128>(p, stream)
                : launch_stream_typed<InputDtype::kFloat16, 128>(p, stream);
  if (p.head_dim_padded == 64)
    return bf16 ? launch_stream_typed<InputDtype::kBFloat16, 64>(p, stream)
                : launch_stream_typed<InputDtype::kFloat16, 64>(p, stream);
  return cudaErrorNotSupported;
}

}  // namespace nvfp4_dit
