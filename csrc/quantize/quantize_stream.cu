// Streaming NVFP4 preprocessing of contiguous 16-bit rows (bf16/fp16, D == Dp, unit stride along
// D, 16-byte aligned rows), sm_90 and newer. Same contract and same bytes as quantize_tiles.cu
// (params.h; per-block code shared through quantize_block.cuh). The default where it applies
// (QuantizeKernel::kAuto); docs/quantize.md has the numbers.
//
// Why a second kernel: quantize_tiles.cu gives each CTA one tile, loaded into registers and then
// computed, so a warp waits for its loads before every tile, and its two launches read K twice
// from DRAM. Here CTAs are persistent, copies run ahead of the arithmetic, and every warp has one
// job (warp specialisation):
//  * the producer warp draws tickets and, for each 128-row tile, starts DP / 64 TMA box copies
//    (cp.async.bulk.tensor, 64 columns x 128 rows each) into a free shared-memory stage of a ring
//    (they complete on the stage's "full" mbarrier); for V, K and Q tiles it also puts the head's
//    per-column factors (means, balance, tensor scales) into the stage;
//  * eight consumer warps quantize the stage straight from shared memory, write the outputs and
//    release the stage on its "empty" mbarrier. They never wait on global memory: they meet at a
//    barrier only inside Q tiles (the block mean and tensor scale) and V^T tiles (gathering the
//    output rows);
//  * the reducer warp counts the K and V statistics tiles' arrivals across CTAs and finishes each
//    head's statistics (means, channel balance, tensor scales; the round trips to L2 that the
//    consumers would otherwise wait for).
// Column sums (Q block means, statistics tiles) run on tensor cores: ones(16x16) . tile, the tile
// read with ldmatrix.trans, fp32 accumulation; the same fragments give the column minima and maxima.
//
// Ticket order: quantize_schedule.cuh.
//
// Stages hold TMA boxes with the 128-byte swizzle, under which the thread layouts below read
// shared memory without bank conflicts (16-byte row reads, 4-byte V column reads and ldmatrix).
#include "common/portable.h"

#include <cuda_fp16.h>

#include "common/format.cuh"
#include "common/launch.h"
#include "quantize/params.h"
#include "quantize/quantize_block.cuh"
#include "quantize/quantize_math.cuh"
#include "quantize/quantize_schedule.cuh"

namespace nvfp4_dit {
namespace {

constexpr int kConsumerWarps = 8;
constexpr int kConsumers = kConsumerWarps * 32;
constexpr int kStreamThreads = kConsumers + 64;    // + the producer and the reducer warp
// Two CTAs per SM where two fit (sm_90); sm_120's 100 KB of shared memory holds one (the launcher
// takes this kernel there only when forced), so it gets the registers of one and does not spill.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1200
constexpr int kStreamMinCtasPerSm = 1;
#else
constexpr int kStreamMinCtasPerSm = 2;
#endif
constexpr int kMaxStages = 8;
constexpr int kStatJobs = 8;  // statistics tiles handed from the consumers to the reducer warp, in flight

// A stage holds one 128-row tile as DP / 64 TMA boxes of 128 rows x 128 bytes, each stored with
// the 128-byte swizzle: 16-byte chunk c of row r sits at chunk c ^ (r % 8) of that row.
template <int DP>
struct StageGeometry {
  static constexpr int kBoxCols = 64;
  static constexpr int kBoxes = DP / kBoxCols;
  static constexpr int kBoxBytes = kTileRows * 128;
  static constexpr int kBytes = kBoxes * kBoxBytes;
};

// What a stage holds, written by the producer before it arrives on the stage's full barrier.
struct StageInfo {
  int32_t kind;
  int32_t valid_rows;  // rows of data (before S and kv_lens); the rest of the 128 are padding
  int64_t bh;          // b * Hkv + kvh (M, V, K) or b * H + h (Q)
  int64_t tile;        // 128-row tile of that head
  int64_t kv_head;     // b * Hkv + kvh of the statistics it needs (V, K, Q)
};

// A statistics tile whose column statistics the consumers stored, for the reducer warp to count.
struct StatJob {
  int64_t bh;      // b * Hkv + kvh
  int64_t tile;    // its 128-key tile; -1: no more jobs
  int32_t tensor;  // 0: K, 1: V
};

template <int DP>
struct StreamShared {
  uint64_t full[kMaxStages];
  uint64_t empty[kMaxStages];
  uint64_t job_ready[kStatJobs];  // the consumer warps stored the job's tile statistics
  uint64_t job_free[kStatJobs];   // the reducer warp took the job
  StageInfo info[kMaxStages];
  StatJob jobs[kStatJobs];
  // Per column, put there by the producer warp from the finished statistics of the tile's kv head.
  // K and V tiles quantise fma(x, factor, -offset) = (x - mean) * factor, factor 1 / (s k_scale)
  // or 1 / v_scale; Q tiles take factor = s (the balance) and offset = km (for q . km).
  float factor[kMaxStages][DP];
  float offset[kMaxStages][DP];
  float mean[kMaxStages][DP];                 // Q: the tile's block mean
  float q_dev[kMaxStages][kConsumerWarps];    // Q: each warp's max |q - qm| * s over its columns
  ScaleTables tables;
};

// Dynamic shared memory: StreamShared, then the stages from the next 1024-byte boundary (the
// 128-byte swizzle repeats every 8 rows = 1024 bytes).
template <int DP>
struct SharedLayout {
  static constexpr int kFixedBytes = int(sizeof(StreamShared<DP>)) + 1023;
};


// The device code needs sm_90 (mbarrier transaction counts, TMA); an sm_80 build keeps only empty
// entry points, which the launcher never starts.
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900

constexpr int kConsumerBarrier = 1;  // named barrier of the consumer warps (0 is __syncthreads)
constexpr int kProducerWarp = kConsumerWarps;     // warp 8
constexpr int kReducerWarp = kConsumerWarps + 1;  // warp 9
constexpr int64_t kChunkTiles = kKeyMeanChunk / kTileRows;
static_assert(kKeyMeanChunk % kTileRows == 0, "statistics chunks are whole tiles");

// Shared address of 16-byte chunk `chunk` (0 .. DP/8 - 1) of tile row `row`.
__device__ __forceinline__ uint32_t swizzled(uint32_t stage, int row, int chunk) {
  return stage + (chunk >> 3) * (kTileRows * 128) + row * 128 + (((chunk & 7) ^ (row & 7)) << 4);
}

// The statistics-ready flags and the chunk arrivals of the tile statistics (see arrivals() in
// quantize_block.cuh for the layout of the counters).
__device__ __forceinline__ uint32_t* stats_ready(const QuantizeQkvParams& p) {
  return p.work_counters + 1 + p.batch * p.heads_kv;
}
__device__ __forceinline__ uint32_t* chunk_arrivals(const QuantizeQkvParams& p, int64_t bh, int tensor,
                                                    int64_t n_chunks) {
  return p.work_counters + 1 + 2 * p.batch * p.heads_kv + (bh * kStatTensors + tensor) * n_chunks;
}

// One thread, after the statistics of kv head bh were stored by it or by threads synchronised with
// it: make them visible at gpu scope, then raise bh's ready flag.
__device__ __forceinline__ void publish_head_statistics(const QuantizeQkvParams& p, int64_t bh) {
  fence_acq_rel_gpu();
  atomicExch(stats_ready(p) + bh, 1u);
}

// Spin (this thread) until the statistics of kv head bh are published. Only the producer warp
// waits, for a V, K or Q ticket; the statistics tiles of that head hold lower tickets, and every
// lower ticket finishes without waiting on a higher one (consumers and the reducer warp wait on
// nothing but their own CTA's queues), so the wait always ends.
__device__ __forceinline__ void wait_head_statistics(const QuantizeQkvParams& p, int64_t bh) {
  const uint32_t* flag = stats_ready(p) + bh;
  uint32_t ready;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(ready) : "l"(flag) : "memory");
  while (!ready) {
    __nanosleep(200);
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(ready) : "l"(flag) : "memory");
  }
}

////////////////////////////////////////////////////////////////////////////////////////////////
// PTX wrappers

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

__device__ __forceinline__ void load_box(uint32_t dst, const TensorMap* map, int d0, int row0, int h, int b,
                                         uint64_t* bar, bool keep_in_l2) {
  if (keep_in_l2) NVFP4_DIT_LOAD_BOX("evict_last");
  else NVFP4_DIT_LOAD_BOX("evict_first");
}
#undef NVFP4_DIT_LOAD_BOX

__device__ __forceinline__ void consumer_barrier() {
  asm volatile("bar.sync %0, %1;" ::"n"(kConsumerBarrier), "n"(kConsumers) : "memory");
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

// Column statistics of a stage's rows [0, valid_rows) for the 8 columns [n0, n0 + 8): 32 rows per
// ldmatrix.x4.trans (four 8x8 matrices = the B operands of two MMAs). Adds the sums of columns
// n0 + 2 * (lane % 4) + {0, 1} to acc[0], acc[1] (acc[2], acc[3]: the same, in the accumulator's
// second row; rows past valid_rows must hold zeros) and returns in lo, hi the min and max of column
// n0 + lane / 4 over the valid rows (the transposed fragment: lane 4g + t holds column n0 + g of
// rows 8i + 2t + {0, 1} of each matrix i).
template <InputDtype DT>
__device__ __forceinline__ void column_stats8(uint32_t stage, int n0, int valid_rows, float (&acc)[4], float& lo,
                                              float& hi) {
  const int lane = threadIdx.x & 31;
  float acc_odd[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // a second chain of MMAs: half the latency
  lo = INFINITY;
  hi = -INFINITY;
#pragma unroll
  for (int k0 = 0; k0 < kTileRows; k0 += 32) {
    uint32_t b[4];
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(b[0]), "=r"(b[1]), "=r"(b[2]), "=r"(b[3])
                 : "r"(swizzled(stage, k0 + lane, n0 / 8)));
    mma_ones<DT>(acc, b[0], b[1]);
    mma_ones<DT>(acc_odd, b[2], b[3]);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int row = k0 + 8 * i + 2 * (lane & 3);
      const float x0 = InputTraits<DT>::to_float(b[i] & 0xFFFFu), x1 = InputTraits<DT>::to_float(b[i] >> 16);
      if (row < valid_rows) {
        lo = min_nan(lo, x0);
        hi = max_nan(hi, x0);
      }
      if (row + 1 < valid_rows) {
        lo = min_nan(lo, x1);
        hi = max_nan(hi, x1);
      }
    }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) acc[i] += acc_odd[i];
#pragma unroll
  for (int off = 1; off < 4; off <<= 1) {  // the quad's rows together
    lo = min_nan(lo, __shfl_xor_sync(0xFFFFFFFFu, lo, off));
    hi = max_nan(hi, __shfl_xor_sync(0xFFFFFFFFu, hi, off));
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

// Position in the ring of stages: the stage index and the parity of its current phase, advanced
// by one per item (no division by the run-time stage count per item).
struct StageRing {
  int count, stage = 0;
  uint32_t phase = 0;
  __device__ __forceinline__ explicit StageRing(int num_stages) : count(num_stages) {}
  __device__ __forceinline__ void next() {
    if (++stage == count) {
      stage = 0;
      phase ^= 1u;
    }
  }
};

////////////////////////////////////////////////////////////////////////////////////////////////
// Producer warp

// Where an item's rows come from: its tensor map, batch and head, and the rows of data (the rest
// of the tile is padding: past S, or keys past kv_lens[b]).
struct ItemSource {
  const TensorMap* map;
  uint32_t b, h;
  int64_t rows;
};

__device__ __forceinline__ ItemSource item_source(const QuantizeQkvParams& p, const StreamMaps& maps,
                                                  const Schedule& sc, const Item& it) {
  if (it.kind == kQTile) {
    const uint32_t b = it.bh / sc.heads_q;
    return ItemSource{&maps.q, b, it.bh - b * sc.heads_q, p.seq_q};
  }
  const uint32_t b = it.bh / sc.heads_kv;
  const bool values = it.kind == kVTile || it.kind == kVStatTile;
  return ItemSource{values ? &maps.v : &maps.k, b, it.bh - b * sc.heads_kv, valid_key_count(p, b)};
}

// Lane 0 of the producer warp: publishes what stage s will hold, arrives on its full barrier with
// the bytes to expect and starts its TMA boxes (for kEnd, only the arrival).
template <int DP>
__device__ __forceinline__ void start_stage(const QuantizeQkvParams& p, const StreamMaps& maps, const Schedule& sc,
                                            StreamShared<DP>& sh, const Item& it, int s, uint32_t stages) {
  using G = StageGeometry<DP>;
  if (it.kind == kEnd) {
    sh.info[s] = StageInfo{kEnd, 0, 0, 0, 0};
    mbar_arrive(&sh.full[s]);
    return;
  }
  const ItemSource src = item_source(p, maps, sc, it);
  const int64_t row0 = int64_t(it.tile) * kTileRows;
  sh.info[s] = StageInfo{it.kind, int(rows_below(src.rows, row0, kTileRows)), it.bh, it.tile, it.kv_head};
  // Boxes are whole (TMA fills rows past S with zeros), so every stage receives G::kBytes.
  mbar_arrive_expect_tx(&sh.full[s], G::kBytes);
  // The statistics read of the keys and values asks L2 to keep them for the K and V^T tiles'
  // second read; every other read is the data's last.
  const uint32_t dst = stages + uint32_t(s) * G::kBytes;
#pragma unroll
  for (int box = 0; box < G::kBoxes; ++box)
    load_box(dst + box * G::kBoxBytes, src.map, box * G::kBoxCols, int(row0), int(src.h), int(src.b), &sh.full[s],
             is_stat_tile(it.kind));
}

// Per-column factors and offsets of one kv head's tiles (StreamShared::factor, offset), from its
// finished statistics, for the DP / 4 producer lanes that hold four columns each.
struct HeadColumns {
  float4 k_factor, k_offset, v_offset, balance, km;
  float v_factor;

  __device__ __forceinline__ void load(const QuantizeQkvParams& p, int64_t bh, int lane, int dp) {
    km = __ldcg(reinterpret_cast<const float4*>(p.k_mean + bh * dp) + lane);
    const float4 vm = __ldcg(reinterpret_cast<const float4*>(p.v_mean + bh * dp) + lane);
    balance = __ldcg(reinterpret_cast<const float4*>(p.balance + bh * dp) + lane);
    const float k_scale = __ldcg(p.k_scale + bh);
    v_factor = __frcp_rn(__ldcg(p.v_scale + bh));  // powers of two: exact
    k_factor = make_float4(__frcp_rn(balance.x * k_scale), __frcp_rn(balance.y * k_scale),
                           __frcp_rn(balance.z * k_scale), __frcp_rn(balance.w * k_scale));
    k_offset = make_float4(km.x * k_factor.x, km.y * k_factor.y, km.z * k_factor.z, km.w * k_factor.w);
    v_offset = make_float4(vm.x * v_factor, vm.y * v_factor, vm.z * v_factor, vm.w * v_factor);
  }

  // This lane's four columns of stage s for a tile of `kind` (V, K or Q).
  template <int DP>
  __device__ __forceinline__ void put(StreamShared<DP>& sh, int s, int32_t kind, int lane) const {
    float4 factor, offset;
    if (kind == kKTile) {
      factor = k_factor;
      offset = k_offset;
    } else if (kind == kVTile) {
      factor = make_float4(v_factor, v_factor, v_factor, v_factor);
      offset = v_offset;
    } else {
      factor = balance;
      offset = km;
    }
    reinterpret_cast<float4*>(sh.factor[s])[lane] = factor;
    reinterpret_cast<float4*>(sh.offset[s])[lane] = offset;
  }
};

// The producer warp: lane 0 draws a ticket per stage; the warp waits for the stage to be free and,
// for a V, K or Q tile, puts its head's per-column factors into the stage (waiting for the head's
// statistics when the head changes), so that no consumer waits on global memory; lane 0 then
// starts the stage. The next ticket's atomic is issued before the wait for a free stage, so its L2
// round trip overlaps the wait. (Holding one ticket ahead keeps the schedule's guarantee: the held
// ticket is higher than every ticket in this CTA's stages.) Every barrier of the ring is arrived on
// by each thread that accessed the stage, after its own accesses, so each access is ordered by its
// own release/acquire pair.
template <int DP>
__device__ void produce(const QuantizeQkvParams& p, const StreamMaps& maps, StreamShared<DP>& sh, uint32_t stages,
                        int num_stages, const ScheduleShape& shape) {
  constexpr int kColumnLanes = DP / 4;  // lanes holding four columns each
  const int lane = threadIdx.x & 31;
  const Schedule sc(p, shape);
  uint32_t ticket = lane == 0 ? atomicAdd(p.work_counters, 1u) : 0u;
  HeadColumns columns{};
  int64_t columns_head = -1;  // kv head whose columns the lanes hold
  for (StageRing ring(num_stages);; ring.next()) {
    const Item it = decode_ticket(sc, __shfl_sync(0xFFFFFFFFu, ticket, 0));
    if (lane == 0 && it.kind != kEnd) ticket = atomicAdd(p.work_counters, 1u);
    mbar_wait(&sh.empty[ring.stage], ring.phase ^ 1u);
    if (it.kind == kKTile || it.kind == kQTile || it.kind == kVTile) {
      if (int64_t(it.kv_head) != columns_head) {
        wait_head_statistics(p, it.kv_head);  // in every lane: its acquire orders its loads
        if (lane < kColumnLanes) columns.load(p, it.kv_head, lane, DP);
        columns_head = it.kv_head;
      }
      if (lane < kColumnLanes) columns.put(sh, ring.stage, it.kind, lane);
    }
    if (lane == 0) start_stage<DP>(p, maps, sc, sh, it, ring.stage, stages);
    else mbar_arrive(&sh.full[ring.stage]);
    if (it.kind == kEnd) return;
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

// 16 columns of a per-column stage vector (StreamShared::factor, offset, mean) as four 16-byte loads.
__device__ __forceinline__ void load_columns16(const float* vec, int cb, float (&out)[16]) {
  load_floats16(vec + cb * 16, out);
}

template <InputDtype DT, int DP>
__device__ __forceinline__ void consume_k_tile(const QuantizeQkvParams& p, const StreamShared<DP>& sh,
                                               const StageInfo& info, int s, uint32_t stage) {
  using Map = RowMap<DP>;
  const Map map;
  const int64_t row0 = info.tile * kTileRows;
  float factor[16], offset[16];  // (k - km) / (s_c k_scale) = fma(k, factor, -offset)
  load_columns16(sh.factor[s], map.cb, factor);
  load_columns16(sh.offset[s], map.cb, offset);
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
      for (int e = 0; e < 16; ++e) v[e] = fmaf(v[e], factor[e], -offset[e]);
      nonfinite |= quantize_block16(v, sh.tables, lo, hi, sf_bits);
    }
    store_u64(data + ps * Map::kRowsPerPass * (DP / 2), lo, hi);
    sf[ps * Map::kRowsPerPass * (DP / 16)] = static_cast<uint8_t>(sf_bits);
  }
  raise_flag(p.nonfinite_kv + info.bh, nonfinite);
}

template <InputDtype DT, int DP>
__device__ __forceinline__ void consume_q_tile(const QuantizeQkvParams& p, StreamShared<DP>& sh, const StageInfo& info,
                                               int s, uint32_t stage) {
  using Map = RowMap<DP>;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t n_blocks = p.seq_q_padded / kTileRows;
  const int64_t row0 = info.tile * kTileRows;

  // Block mean and max |q - qm| * s per column over the valid rows (padding rows zeroed first for
  // the sums), each warp over its column groups; then the block's tensor scale from every warp's.
  if (info.valid_rows < kTileRows) zero_padding_rows<DP>(stage, info.valid_rows);
  const float rows = float(info.valid_rows > 0 ? info.valid_rows : 1);
  float dev_max = 0.0f;
#pragma unroll
  for (int g = 0; g < ColumnSumMap<DP>::kGroupsPerWarp; ++g) {
    const int n0 = (warp + g * kConsumerWarps) * 8;
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    float lo, hi;
    column_stats8<DT>(stage, n0, info.valid_rows, acc, lo, hi);
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      // Column n0 + 2 * lane + j: its sum in lane < 4's acc[j], its min / max in lane 4 (2 lane + j).
      const int src = 4 * ((2 * lane + j) & 7);
      const float col_lo = __shfl_sync(0xFFFFFFFFu, lo, src), col_hi = __shfl_sync(0xFFFFFFFFu, hi, src);
      if (lane < 4) {
        const int c = n0 + 2 * lane + j;
        const float qm = __fdiv_rn(acc[j], rows);
        sh.mean[s][c] = qm;
        p.q_mean[(info.bh * n_blocks + info.tile) * DP + c] = qm;
        dev_max = max_nan(dev_max, channel_deviation(qm, col_lo, col_hi) * sh.factor[s][c]);  // times s_c
      }
    }
  }
#pragma unroll
  for (int off = 1; off < 4; off <<= 1) dev_max = max_nan(dev_max, __shfl_xor_sync(0xFFFFFFFFu, dev_max, off));
  if (lane == 0) sh.q_dev[s][warp] = dev_max;
  consumer_barrier();
  float block_dev = sh.q_dev[s][0];
#pragma unroll
  for (int w = 1; w < kConsumerWarps; ++w) block_dev = max_nan(block_dev, sh.q_dev[s][w]);
  const float q_scale = tensor_scale(block_dev);
  if (threadIdx.x == 0) p.q_scale[info.bh * n_blocks + info.tile] = q_scale;
  const float inv_scale = __frcp_rn(q_scale);  // a power of two: exact

  const Map map;
  float factor[16], offset[16], km[16];  // (q - qm) s_c / q_scale = fma(q, factor, -offset)
  load_columns16(sh.factor[s], map.cb, factor);
  load_columns16(sh.mean[s], map.cb, offset);
  load_columns16(sh.offset[s], map.cb, km);
#pragma unroll
  for (int e = 0; e < 16; ++e) {
    factor[e] *= inv_scale;
    offset[e] *= factor[e];
  }
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
        v[e] = fmaf(v[e], factor[e], -offset[e]);
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
// reads 128 contiguous bytes of a token row - and quantizes (v - vm) / v_scale along tokens; keys
// past the valid rows are padding, 0.
template <InputDtype DT, int DP, bool FULL>
__device__ __forceinline__ void consume_v_tile(const QuantizeQkvParams& p, const StreamShared<DP>& sh,
                                               const StageInfo& info, int s, uint32_t stage) {
  constexpr int kWordsPerRow = DP / 2;
  constexpr int kParts = kConsumers / kWordsPerRow;          // 4 (DP = 128) or 8 (DP = 64)
  constexpr int kBlocksPerThread = kTileRows / 16 / kParts;  // 2 or 1
  const int word = threadIdx.x % kWordsPerRow, part = threadIdx.x / kWordsPerRow;
  const float factor[2] = {sh.factor[s][2 * word], sh.factor[s][2 * word + 1]};
  const float offset[2] = {sh.offset[s][2 * word], sh.offset[s][2 * word + 1]};
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
      const uint32_t w = lds32(swizzled(stage, tok, word >> 2) + (word & 3) * 4);
      const bool valid = FULL || tok < info.valid_rows;
      v[0][e] = valid ? fmaf(InputTraits<DT>::to_float(w & 0xFFFFu), factor[0], -offset[0]) : 0.0f;
      v[1][e] = valid ? fmaf(InputTraits<DT>::to_float(w >> 16), factor[1], -offset[1]) : 0.0f;
    }
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      uint32_t sf_bits;
      nonfinite |= quantize_block16(v[c], sh.tables, out[c][2 * i], out[c][2 * i + 1], sf_bits);
      sfs[c] |= sf_bits << (8 * i);
    }
  }
  raise_flag(p.nonfinite_kv + info.bh, nonfinite);
  // The V^T rows gathered in the stage (its inputs consumed), then stored whole.
  const VtRowGather<DP, kTileRows> gather{stage};
  consumer_barrier();
#pragma unroll
  for (int c = 0; c < 2; ++c) gather.template put<kBlocksPerThread>(2 * word + c, part * kBlocksPerThread, out[c], sfs[c]);
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // generic writes, then TMA's again
  consumer_barrier();
  gather.store(p, info.bh, info.tile * kTileRows, threadIdx.x, kConsumers);
}

// The K and V statistics (sum, min, max per channel over the valid keys), in three levels: per
// 128-key tile (by the consumer warps), per chunk of kChunkTiles tiles and per head (by the reducer
// warp of whichever CTA completes the chunk or the head, in a fixed order: deterministic).
// Workspace: chunk statistics [B * Hkv, kStatTensors, k_chunks, kStatVectors, DP], then tile
// statistics [B * Hkv, kStatTensors, k_tiles, kStatVectors, DP].
__device__ __forceinline__ float* key_tile_stats(const QuantizeQkvParams& p, int64_t bh, int tensor, int64_t tile,
                                                 int64_t n_chunks, int64_t n_tiles, int dp) {
  const int64_t chunk_floats = p.batch * p.heads_kv * kStatTensors * n_chunks * kStatVectors * dp;
  return p.k_partial_sums + chunk_floats + ((bh * kStatTensors + tensor) * n_tiles + tile) * kStatVectors * dp;
}

// Consumer threads: hand job number `job` (counted alike by every consumer thread) to the reducer
// warp, once its slot is free: thread 0 writes it, and every thread's arrival releases its own
// stores (the job, the tile statistics).
template <int DP>
__device__ __forceinline__ void post_stat_job(StreamShared<DP>& sh, uint32_t job, const StatJob& what) {
  const int slot = int(job % kStatJobs);
  mbar_wait(&sh.job_free[slot], ((job / kStatJobs) & 1u) ^ 1u);
  if (threadIdx.x == 0) sh.jobs[slot] = what;
  mbar_arrive(&sh.job_ready[slot]);
}

// One statistics tile of K or V: its column statistics go to the workspace, and the tile to the
// reducer warp. The consumers never wait for the other CTAs' arrivals.
template <InputDtype DT, int DP>
__device__ __forceinline__ void consume_stat_tile(const QuantizeQkvParams& p, StreamShared<DP>& sh,
                                                  const StageInfo& info, uint32_t stage, uint32_t job) {
  constexpr int kGroups = ColumnSumMap<DP>::kGroupsPerWarp;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int tensor = info.kind == kVStatTile ? 1 : 0;
  float* stats = key_tile_stats(p, info.bh, tensor, info.tile, quantize_qkv_k_chunks(p.seq_k),
                                p.seq_k_padded / kTileRows, DP);
  if (info.valid_rows < kTileRows) zero_padding_rows<DP>(stage, info.valid_rows);
#pragma unroll
  for (int g = 0; g < kGroups; ++g) {
    const int n0 = (warp + g * kConsumerWarps) * 8;
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    float lo, hi;
    column_stats8<DT>(stage, n0, info.valid_rows, acc, lo, hi);
    if (lane < 4) *reinterpret_cast<float2*>(stats + n0 + 2 * lane) = make_float2(acc[0], acc[1]);
    if ((lane & 3) == 0) {
      stats[DP + n0 + lane / 4] = lo;
      stats[2 * DP + n0 + lane / 4] = hi;
    }
  }
  post_stat_job(sh, job, StatJob{info.bh, info.tile, tensor});
}

// Adds rows [0, n) of a [n, kStatVectors, DP] array in row order into this lane's columns
// [lane * kCols, lane * kCols + kCols): sums added, minima and maxima taken. Loads go out
// kChunkTiles rows of one statistic at a time (all three at once would spill the kernel).
template <int DP>
__device__ __forceinline__ void reduce_stat_rows(const float* rows, int64_t n, float (&sum)[DP / 32],
                                                 float (&lo)[DP / 32], float (&hi)[DP / 32]) {
  constexpr int kCols = DP / 32;
  using Vec = typename Select<kCols == 4, float4, float2>::type;
  const int lane = threadIdx.x & 31;
  for (int64_t r0 = 0; r0 < n; r0 += kChunkTiles) {
#pragma unroll
    for (int v = 0; v < kStatVectors; ++v) {
      Vec part[kChunkTiles];
#pragma unroll
      for (int u = 0; u < kChunkTiles; ++u)
        if (r0 + u < n) part[u] = __ldcg(reinterpret_cast<const Vec*>(rows + ((r0 + u) * kStatVectors + v) * DP) + lane);
#pragma unroll
      for (int u = 0; u < kChunkTiles; ++u)
        if (r0 + u < n)
#pragma unroll
          for (int c = 0; c < kCols; ++c) {
            const float x = reinterpret_cast<const float*>(&part[u])[c];
            if (v == 0) sum[c] += x;
            else if (v == 1) lo[c] = min_nan(lo[c], x);
            else hi[c] = max_nan(hi[c], x);
          }
    }
  }
}

template <int kCols>
__device__ __forceinline__ void init_stats(float (&sum)[kCols], float (&lo)[kCols], float (&hi)[kCols]) {
#pragma unroll
  for (int c = 0; c < kCols; ++c) {
    sum[c] = 0.0f;
    lo[c] = INFINITY;
    hi[c] = -INFINITY;
  }
}

// Reducer warp, one job: count the tile on its chunk; the last tile of a chunk reduces the chunk's
// tile statistics into the chunk's and counts the chunk on its head; the last chunk of a head (of
// K and V together) reduces the chunk statistics, finishes the head (finish_head_statistics) and
// raises its ready flag. Lane l holds columns [l * kCols, l * kCols + kCols).
template <int DP>
__device__ __forceinline__ void reduce_stat_job(const QuantizeQkvParams& p, const StatJob& job) {
  constexpr int kCols = DP / 32;
  const int lane = threadIdx.x & 31;
  const int64_t n_chunks = quantize_qkv_k_chunks(p.seq_k), n_tiles = p.seq_k_padded / kTileRows;
  const int64_t chunk = job.tile / kChunkTiles, first = chunk * kChunkTiles;
  const int64_t tiles = n_tiles - first < kChunkTiles ? n_tiles - first : kChunkTiles;

  bool last = lane == 0 && count_arrival(chunk_arrivals(p, job.bh, job.tensor, n_chunks) + chunk, tiles);
  last = __shfl_sync(0xFFFFFFFFu, last, 0);
  __syncwarp();  // lane 0's acquire before the other lanes' loads
  if (!last) return;
  float sum[kCols], lo[kCols], hi[kCols];
  init_stats(sum, lo, hi);
  reduce_stat_rows<DP>(key_tile_stats(p, job.bh, job.tensor, first, n_chunks, n_tiles, DP), tiles, sum, lo, hi);
  float* chunk_stats = key_chunk_stats(p, job.bh, job.tensor, chunk, n_chunks, DP);
#pragma unroll
  for (int c = 0; c < kCols; ++c) {
    chunk_stats[lane * kCols + c] = sum[c];
    chunk_stats[DP + lane * kCols + c] = lo[c];
    chunk_stats[2 * DP + lane * kCols + c] = hi[c];
  }
  __syncwarp();  // the lanes' chunk statistics before lane 0's release
  last = lane == 0 && count_arrival(arrivals(p) + job.bh, kStatTensors * n_chunks);
  last = __shfl_sync(0xFFFFFFFFu, last, 0);
  __syncwarp();
  if (!last) return;
  float tsum[kStatTensors][kCols], tlo[kStatTensors][kCols], thi[kStatTensors][kCols];
#pragma unroll
  for (int t = 0; t < kStatTensors; ++t) {
    init_stats(tsum[t], tlo[t], thi[t]);
    reduce_stat_rows<DP>(key_chunk_stats(p, job.bh, t, 0, n_chunks, DP), n_chunks, tsum[t], tlo[t], thi[t]);
  }
  finish_head_statistics<kCols>(p, job.bh, lane * kCols, true, DP, tsum, tlo, thi, [](float x) {
#pragma unroll
    for (int off = 16; off; off >>= 1) x = max_nan(x, __shfl_xor_sync(0xFFFFFFFFu, x, off));
    return x;
  });
  __syncwarp();  // the lanes' statistics before lane 0's release
  if (lane == 0) publish_head_statistics(p, job.bh);
}

// The reducer warp: takes the consumers' statistics jobs in order until the end job (tile -1).
template <int DP>
__device__ void reduce_statistics(const QuantizeQkvParams& p, StreamShared<DP>& sh) {
  for (uint32_t n = 0;; ++n) {
    const int slot = int(n % kStatJobs);
    mbar_wait(&sh.job_ready[slot], (n / kStatJobs) & 1u);
    const StatJob job = sh.jobs[slot];
    mbar_arrive(&sh.job_free[slot]);  // every lane, after its read of the job
    if (job.tile < 0) return;
    reduce_stat_job<DP>(p, job);
  }
}

template <InputDtype DT, int DP>
__device__ void consume(const QuantizeQkvParams& p, StreamShared<DP>& sh, uint32_t stages, int num_stages) {
  using G = StageGeometry<DP>;
  uint32_t stat_jobs = 0;
  for (StageRing ring(num_stages);; ring.next()) {
    const int s = ring.stage;
    mbar_wait(&sh.full[s], ring.phase);
    const StageInfo info = sh.info[s];
    if (info.kind == kEnd) {
      post_stat_job(sh, stat_jobs, StatJob{0, -1, 0});
      return;
    }
    const uint32_t stage = stages + uint32_t(s) * G::kBytes;
    if (is_stat_tile(info.kind)) {
      consume_stat_tile<DT, DP>(p, sh, info, stage, stat_jobs++);
    } else if (info.kind == kVTile) {
      if (info.valid_rows == kTileRows) consume_v_tile<DT, DP, true>(p, sh, info, s, stage);
      else consume_v_tile<DT, DP, false>(p, sh, info, s, stage);
    } else if (info.kind == kKTile) {
      consume_k_tile<DT, DP>(p, sh, info, s, stage);
    } else {
      consume_q_tile<DT, DP>(p, sh, info, s, stage);
    }
    mbar_arrive(&sh.empty[s]);  // every thread, after its reads of the stage
  }
}

#endif  // sm_90+

template <InputDtype DT, int DP>
__device__ __forceinline__ void quantize_qkv_stream(const QuantizeQkvParams& p, const StreamMaps& maps, int num_stages,
                                                    const ScheduleShape& shape) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) unsigned char smem[];
  auto& sh = *reinterpret_cast<StreamShared<DP>*>(smem);
  const uint32_t stages = (smem_addr(smem) + uint32_t(sizeof(StreamShared<DP>)) + 1023u) & ~1023u;
  fill_scale_tables(sh.tables);
  if (threadIdx.x == 0) {
    // Arrival counts: every thread of the warps that access a stage or a job slot.
    for (int s = 0; s < num_stages; ++s) {
      mbar_init(&sh.full[s], 32);
      mbar_init(&sh.empty[s], kConsumers);
    }
    for (int j = 0; j < kStatJobs; ++j) {
      mbar_init(&sh.job_ready[j], kConsumers);
      mbar_init(&sh.job_free[j], 32);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const int warp = threadIdx.x / 32;
  if (warp == kProducerWarp) produce<DP>(p, maps, sh, stages, num_stages, shape);
  else if (warp == kReducerWarp) reduce_statistics<DP>(p, sh);
  else consume<DT, DP>(p, sh, stages, num_stages);
#endif
}

}  // namespace

static_assert(launch::kStreamThreads == kStreamThreads && launch::kStreamMaxStages == kMaxStages &&
                  launch::kStreamStageBytes[0] == StageGeometry<64>::kBytes &&
                  launch::kStreamStageBytes[1] == StageGeometry<128>::kBytes &&
                  launch::kStreamFixedSmemBytes[0] == SharedLayout<64>::kFixedBytes &&
                  launch::kStreamFixedSmemBytes[1] == SharedLayout<128>::kFixedBytes,
              "common/launch.h states the streaming kernel's launch geometry");

}  // namespace nvfp4_dit

// Entry points (common/launch.h).
#define NVFP4_DIT_STREAM_ENTRY(NAME, DT, DP)                                                             \
  extern "C" __global__ void __launch_bounds__(nvfp4_dit::kStreamThreads, nvfp4_dit::kStreamMinCtasPerSm) \
      nvfp4_dit_quantize_stream_##NAME##_d##DP(const __grid_constant__ nvfp4_dit::QuantizeQkvParams p,                      \
                                               const __grid_constant__ nvfp4_dit::StreamMaps maps,        \
                                               int num_stages, const nvfp4_dit::ScheduleShape shape) {    \
    nvfp4_dit::quantize_qkv_stream<nvfp4_dit::InputDtype::DT, DP>(p, maps, num_stages, shape);            \
  }
NVFP4_DIT_STREAM_ENTRY(bf16, kBFloat16, 64)
NVFP4_DIT_STREAM_ENTRY(bf16, kBFloat16, 128)
NVFP4_DIT_STREAM_ENTRY(fp16, kFloat16, 64)
NVFP4_DIT_STREAM_ENTRY(fp16, kFloat16, 128)
