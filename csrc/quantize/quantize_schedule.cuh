// The streaming quantiser's ticket order (quantize_stream.cu): which work item each ticket of the
// persistent CTAs' shared counter stands for, and the shape the host picks for it. Torch-free and
// __host__ __device__, so that tests/test_quantize.py can enumerate every ticket on the host
// and check that each item comes exactly once and after everything it waits for.
//
// Ticket order, per unit u of consecutive (b, kv head) pairs: V(u), M(u + L), K(u), Q(u) after a
// prologue M(0 .. L-1), where M(u) are its heads' statistics tiles (those of K, then those of V),
// V/K their V^T and K tiles and Q the tiles of the query heads that share them. Every item depends
// only on lower tickets (V(u), K(u) and Q(u) need the statistics of u's heads, finished by M(u)),
// and only the producer warp waits for one, so the lowest unfinished ticket never waits. The host
// picks the unit (heads enough that a run of one kind fills the pipeline) and the lookahead L (about
// three pipeline depths, so that producers do not wait for statistics still queued behind them):
// schedule_shape().
#pragma once

#include "common/portable.h"

#include "quantize/params.h"

namespace nvfp4_dit {

enum ItemKind : int32_t { kEnd = 0, kKStatTile = 1, kVTile = 2, kKTile = 3, kQTile = 4, kVStatTile = 5 };

__host__ __device__ __forceinline__ bool is_stat_tile(int32_t kind) { return kind == kKStatTile || kind == kVStatTile; }


// Tickets of one kv head g in the schedule below: its V^T tiles, K and V statistics tiles and K
// tiles, and the Q tiles of its query heads.
__host__ __device__ inline int64_t tickets_per_kv_head(const QuantizeQkvParams& p) {
  return 4 * (p.seq_k_padded / kTileRows) + (p.heads_q / p.heads_kv) * (p.seq_q_padded / kTileRows);
}

// Host side: whether every ticket of these sizes fits the streaming schedule's 32-bit counts.
NVFP4_DIT_HOST_DEVICE inline bool schedule_fits_32_bits(const QuantizeQkvParams& p) {
  return p.batch * p.heads_q <= 0x7FFFFFFFLL && tickets_per_kv_head(p) <= 0x7FFFFFFFLL / (p.batch * p.heads_kv);
}

// Units of kv heads whose runs of one tile kind (V^T, statistics, K, Q) last at least one pipeline
// depth (`depth`: stages in flight on the device), so that each SM runs one or two kinds' code at a
// time: with shorter runs four kinds are in flight at once and the consumers stall on instruction
// fetch. A unit is the fewest heads that divides B * Hkv and reaches the depth (all heads where none
// does). The statistics run ahead of the tiles that need them by about three depths: a tile's
// producer then finds them ready instead of waiting for statistics tiles still queued behind it.
NVFP4_DIT_HOST_DEVICE inline ScheduleShape schedule_shape(const QuantizeQkvParams& p, int64_t depth) {
  const int64_t heads = p.batch * p.heads_kv, n_kv = p.seq_k_padded / kTileRows;
  int64_t unit_heads = heads;
  for (int64_t g = 1; g < heads; ++g)
    if (heads % g == 0 && g * n_kv >= depth) {
      unit_heads = g;
      break;
    }
  const int64_t unit = unit_heads * tickets_per_kv_head(p);
  return ScheduleShape{unit_heads, (3 * depth + unit - 1) / unit};
}

// All counts in 32 bits (the launcher checks that every ticket fits): the producer decodes one
// ticket per stage, and 64-bit divisions there were a serial chain of several hundred cycles.
struct Schedule {
  uint32_t heads_kv;    // Hkv
  uint32_t heads_q;     // H
  uint32_t n_kv;        // K (and V^T) tiles per kv head, and statistics tiles per tensor
  uint32_t n_qh;        // Q tiles per query head
  uint32_t group;       // query heads per kv head
  uint32_t unit_heads;  // kv heads per unit
  uint32_t unit_kv;     // V^T (and K) tiles of a unit; its statistics tiles are 2 * unit_kv
  uint32_t unit_q_per_head;  // Q tiles of one kv head's query heads
  uint32_t lookahead;   // units whose statistics run ahead of their tiles
  uint32_t prologue;    // tickets of M(0 .. lookahead - 1)
  uint32_t unit;        // tickets of unit u: V(u), M(u + lookahead), K(u), Q(u)
  uint32_t full_units;  // units that hold an M
  uint32_t total;

  __host__ __device__ __forceinline__ Schedule(const QuantizeQkvParams& p, const ScheduleShape& shape) {
    const uint32_t heads = uint32_t(p.batch * p.heads_kv), units = heads / uint32_t(shape.unit_heads);
    heads_kv = uint32_t(p.heads_kv);
    heads_q = uint32_t(p.heads_q);
    n_kv = uint32_t(p.seq_k_padded / kTileRows);
    n_qh = uint32_t(p.seq_q_padded / kTileRows);
    group = heads_q / heads_kv;
    unit_heads = uint32_t(shape.unit_heads);
    unit_kv = unit_heads * n_kv;
    unit_q_per_head = group * n_qh;
    lookahead = shape.lookahead < int64_t(units) ? uint32_t(shape.lookahead) : units;
    prologue = lookahead * 2 * unit_kv;
    unit = unit_heads * (4 * n_kv + unit_q_per_head);  // unit_heads * tickets_per_kv_head(p)
    full_units = units - lookahead;
    total = units * unit;  // each unit's M once: in the prologue or in a unit
  }
};

struct Item {
  int32_t kind;
  uint32_t bh;       // b * Hkv + kvh (M, V, K) or b * H + h (Q)
  uint32_t tile;     // 128-row tile of that head
  uint32_t kv_head;  // b * Hkv + kvh whose statistics it needs (V, K, Q) or that it reduces (M)
};

// Tile r (0 .. unit_kv - 1) of a V^T or K run of unit u: head-major.
__host__ __device__ __forceinline__ Item unit_kv_item(const Schedule& sc, int32_t kind, uint32_t u, uint32_t r) {
  const uint32_t sub = r / sc.n_kv, g = u * sc.unit_heads + sub;
  return Item{kind, g, r - sub * sc.n_kv, g};
}

// Tile r (0 .. 2 * unit_kv - 1) of the statistics run M(u): the K statistics tiles, then V's.
__host__ __device__ __forceinline__ Item unit_stat_item(const Schedule& sc, uint32_t u, uint32_t r) {
  return r < sc.unit_kv ? unit_kv_item(sc, kKStatTile, u, r) : unit_kv_item(sc, kVStatTile, u, r - sc.unit_kv);
}

// Ticket t -> work item.
__host__ __device__ __forceinline__ Item decode_ticket(const Schedule& sc, uint32_t t) {
  if (t >= sc.total) return Item{kEnd, 0, 0, 0};
  if (t < sc.prologue) {
    const uint32_t u = t / (2 * sc.unit_kv);
    return unit_stat_item(sc, u, t - u * 2 * sc.unit_kv);
  }
  t -= sc.prologue;
  uint32_t u, r;
  const bool has_stats = t < sc.full_units * sc.unit;
  if (has_stats) {
    u = t / sc.unit;
    r = t - u * sc.unit;
  } else {
    t -= sc.full_units * sc.unit;
    const uint32_t short_unit = sc.unit - 2 * sc.unit_kv;
    u = t / short_unit;
    r = t - u * short_unit;
    u += sc.full_units;
  }
  if (r < sc.unit_kv) return unit_kv_item(sc, kVTile, u, r);
  r -= sc.unit_kv;
  if (has_stats) {
    if (r < 2 * sc.unit_kv) return unit_stat_item(sc, u + sc.lookahead, r);
    r -= 2 * sc.unit_kv;
  }
  if (r < sc.unit_kv) return unit_kv_item(sc, kKTile, u, r);
  r -= sc.unit_kv;
  const uint32_t sub = r / sc.unit_q_per_head, g = u * sc.unit_heads + sub;
  r -= sub * sc.unit_q_per_head;
  const uint32_t b = g / sc.heads_kv, kvh = g - b * sc.heads_kv, head_in_group = r / sc.n_qh;
  return Item{kQTile, b * sc.heads_q + kvh * sc.group + head_in_group, r - head_in_group * sc.n_qh, g};
}

}  // namespace nvfp4_dit
