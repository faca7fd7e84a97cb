// The block map of a block-sparse call and the lists the kernels read (params.h: BlockListsParams),
// for one group of Q blocks, in two launches and a scan the host queues in between:
//
//   block_map_rows   per map row: the tiles the Q block keeps, as 32-tile bit words, the row's count,
//                    the words' popcount prefix and optionally the bool map; a warp estimates a row
//                    of at most kBlockMapWarpMaxTiles tiles (_by_warp), a CTA a longer one;
//   (host)           offsets = the exclusive scan of the row counts;
//   block_list_rows  a warp per row: the row's tiles at its offset, ascending, and the row's place
//                    in the visiting order.
//
// The estimate follows nvfp4_dit/sparse.py (map_rows): logits scale * s_ij / sqrt(max(sim_i, t)) +
// log w_j over the allowed tiles, a softmax, and the fewest tiles by descending mass (ties to the
// lower tile) whose mass reaches keep_mass. Sorted that way, the kept tiles are those above a
// threshold mass tau plus the first few (by index) of those equal to it; tau is the largest mass
// whose "at least tau" sum reaches keep_mass, found by bisection on the masses' bits (non-negative
// floats order as their bits) below the row's largest mass, each step one reduction over the row's
// threads, until one mass is left in the interval. Then the safeguards (an unreliable block keeps
// every tile and skips the selection, the diagonal tile and the always-kept key range stay), all
// within the allowed tiles. The mass sums run in another order than PyTorch's, so a tile on the
// edge of keep_mass may differ from sparse.map_rows; the lists of a given map are exact.
#include "common/launch.h"
#include "common/portable.h"
#include "quantize/params.h"

namespace nvfp4_dit {
namespace {

constexpr int kThreads = launch::kBlockListsThreads;
constexpr int kWarps = kThreads / 32;
constexpr int kListWarps = launch::kBlockListRowsPerCta;

__device__ __forceinline__ uint32_t lanes_below() {
  uint32_t mask;
  asm("mov.u32 %0, %%lanemask_lt;" : "=r"(mask));
  return mask;
}

template <bool kMax>
__device__ __forceinline__ float combine(float x, float y) {
  return kMax ? fmaxf(x, y) : x + y;
}

// The threads that estimate one map row: kRowWarps warps (1: a warp per row, no barriers; kWarps:
// the CTA). A row's masses sit in registers, kSlots per thread: thread t holds tiles t + kRowThreads * e.
template <int kRowWarps>
struct RowGroup {
  static constexpr int kRowThreads = 32 * kRowWarps;
  static constexpr int kMaxTiles = kRowWarps == 1 ? launch::kBlockMapWarpMaxTiles : launch::kBlockListsMaxTiles;
  static constexpr int kSlots = kMaxTiles / kRowThreads;
  static constexpr int kWords = kMaxTiles / 32;
  static_assert(kRowWarps == 1 || kRowWarps == kWarps, "a row is a warp's or the CTA's");

  int t;           // the thread within the group
  float* partial;  // 2 * kRowWarps floats of shared memory (the CTA's group)

  __device__ int lane() const { return t & 31; }
  __device__ int warp() const { return t / 32; }

  __device__ void sync() const {
    if (kRowWarps == 1) __syncwarp(); else __syncthreads();
  }

  // (a, b) combined over the group (each a sum or a maximum); every thread gets the result. The
  // butterfly gives every lane the same sums (each step adds the same two values).
  template <bool kMaxA, bool kMaxB>
  __device__ float2 reduce(float a, float b) const {
#pragma unroll
    for (int off = 16; off; off >>= 1) {
      a = combine<kMaxA>(a, __shfl_xor_sync(0xFFFFFFFFu, a, off));
      b = combine<kMaxB>(b, __shfl_xor_sync(0xFFFFFFFFu, b, off));
    }
    if (kRowWarps == 1) return make_float2(a, b);
    __syncthreads();  // earlier readers of partial are done
    if (lane() == 0) {
      partial[warp()] = a;
      partial[kRowWarps + warp()] = b;
    }
    __syncthreads();
    float2 r = make_float2(partial[0], partial[kRowWarps]);
#pragma unroll
    for (int w = 1; w < kRowWarps; ++w) {
      r.x = combine<kMaxA>(r.x, partial[w]);
      r.y = combine<kMaxB>(r.y, partial[kRowWarps + w]);
    }
    return r;
  }

  template <bool kMax>
  __device__ float reduce(float a) const {
    return reduce<kMax, kMax>(a, a).x;
  }

  // The rank of this thread's flag among the group's set flags of one slot (in thread order), after
  // `before` set flags of earlier slots; `before` grows by the slot's count.
  __device__ int rank_in_slot(bool flag, int& before) const {
    const uint32_t ballot = __ballot_sync(0xFFFFFFFFu, flag);
    int rank = before + __popc(ballot & lanes_below());
    if (kRowWarps == 1) {
      before += __popc(ballot);
      return rank;
    }
    __syncthreads();
    if (lane() == 0) partial[warp()] = static_cast<float>(__popc(ballot));
    __syncthreads();
    for (int w = 0; w < kRowWarps; ++w) {
      const int n = static_cast<int>(partial[w]);
      if (w < warp()) rank += n;
      before += n;
    }
    return rank;
  }
};

__device__ __forceinline__ int64_t map_row_index(const BlockListsParams& p, int64_t bh, int64_t g) {
  return bh * p.rows + g;
}

// Tile j of Q block i holds a visible key for the causal rule, kv_lens and the caller's map.
__device__ __forceinline__ bool tile_allowed(const BlockListsParams& p, int64_t b, int64_t h, int64_t i, int j,
                                             int64_t visible_keys) {
  if (static_cast<int64_t>(j) * 128 >= visible_keys) return false;
  if (p.causal && j > i) return false;
  if (p.block_mask != nullptr &&
      p.block_mask[b * p.block_mask_stride_b + h * p.block_mask_stride_h + i * p.block_mask_stride_q + j] == 0)
    return false;
  return true;
}

// The group's sum of the masses whose bits are at least `bits`, and how many masses have bits in
// [lo, hi) (exact: at most kMaxTiles).
template <class Group>
__device__ __forceinline__ float2 mass_from(const Group& group, const float (&mass)[Group::kSlots], uint32_t bits,
                                            uint32_t lo, uint32_t hi) {
  float sum = 0.0f, count = 0.0f;
#pragma unroll
  for (int e = 0; e < Group::kSlots; ++e) {
    const uint32_t m = __float_as_uint(mass[e]);
    sum += m >= bits ? mass[e] : 0.0f;
    count += m >= lo && m < hi ? 1.0f : 0.0f;
  }
  return group.template reduce<false, false>(sum, count);
}

// The estimate of one row into `selected` (bit words in shared memory, zeroed by the caller): the
// fewest allowed tiles by descending mass (ties to the lower tile) whose mass reaches keep_mass.
template <class Group>
__device__ void select_by_mass(const Group& group, const BlockListsParams& p, int64_t b, int64_t h, int64_t bh,
                               int64_t g, int64_t i, int64_t visible_keys, uint32_t* selected) {
  constexpr int kSlots = Group::kSlots;
  const int nk = static_cast<int>(p.num_k_tiles);
  const float* scores = p.scores + (bh * p.rows + g) * p.num_k_tiles;
  const float* log_weights = p.log_weights + b * p.log_weights_stride_b + h * p.log_weights_stride_h;
  const float row_factor = rsqrtf(fmaxf(p.q_similarity[bh * p.num_q_blocks + i], p.similarity_threshold));
  float mass[kSlots];
  float top = -INFINITY;
#pragma unroll
  for (int e = 0; e < kSlots; ++e) {
    const int j = group.t + Group::kRowThreads * e;
    float z = -INFINITY;
    if (j < nk && log_weights[j] > -INFINITY && tile_allowed(p, b, h, i, j, visible_keys))
      z = scores[j] * p.scale * row_factor + log_weights[j];
    mass[e] = z;
    top = fmaxf(top, z);
  }
  top = group.template reduce<true>(top);
  if (top == -INFINITY) return;  // no candidate: the estimate keeps nothing
  float total = 0.0f;
#pragma unroll
  for (int e = 0; e < kSlots; ++e) {
    mass[e] = expf(mass[e] - top);
    total += mass[e];
  }
  total = group.template reduce<false>(total);
  float local_sum = 0.0f, local_top = 0.0f;
#pragma unroll
  for (int e = 0; e < kSlots; ++e) {
    const float m = mass[e] / total;
    mass[e] = m >= 0.0f ? m : 0.0f;  // a NaN row (non-finite inputs) keeps nothing, as in PyTorch
    local_sum += __float_as_uint(mass[e]) >= 1u ? mass[e] : 0.0f;
    local_top = fmaxf(local_top, mass[e]);
  }
  // The positive masses' sum and the largest mass.
  const float2 positive = group.template reduce<false, true>(local_sum, local_top);
  // tau: the largest bits with mass_from(tau) >= keep_mass, in [1, largest mass]; if even every
  // positive mass together stays below keep_mass (rounding), every positive mass is kept. mass_from
  // is a step function of the bits that drops just past each mass, so tau is the bits of a mass:
  // once [tau, hi) holds a single mass, tau is that mass.
  uint32_t tau = 1u;
  int tied_kept = 1 << 30, tied_total = 0;
  if (positive.x >= p.keep_mass) {
    uint32_t hi = __float_as_uint(positive.y) + 1u;  // mass_from(hi) == 0 < keep_mass
    while (hi - tau > 1u) {
      const uint32_t mid = tau + (hi - tau) / 2u;
      const float2 step = mass_from(group, mass, mid, tau, hi);  // y: masses in [tau, hi)
      if (step.y == 1.0f) break;
      if (step.x >= p.keep_mass) tau = mid; else hi = mid;
    }
    if (hi - tau > 1u) {  // the single mass in [tau, hi)
      float in_range = 0.0f;
#pragma unroll
      for (int e = 0; e < kSlots; ++e) {
        const uint32_t m = __float_as_uint(mass[e]);
        if (m >= tau && m < hi) in_range = mass[e];
      }
      tau = __float_as_uint(group.template reduce<true>(in_range));
    }
    // Masses above tau are all kept; of those equal to it, in tile order, while the mass before
    // each stays below keep_mass.
    const float2 split = mass_from(group, mass, tau + 1u, tau, tau + 1u);  // above tau; equal to it
    tied_total = static_cast<int>(split.y);
    float before = split.x;
    const float tied_mass = __uint_as_float(tau);
    for (tied_kept = 0; before < p.keep_mass && tied_kept < nk; ++tied_kept) before += tied_mass;
  }
  // Tie ranks in tile order (slot e first, then thread) only where the ties outnumber the kept ones;
  // if every positive mass is kept (tau = 1), there are none.
  const bool rank_ties = tied_total > tied_kept;  // group-uniform
  int tied_before_slot = 0;
#pragma unroll
  for (int e = 0; e < kSlots; ++e) {
    const int j = group.t + Group::kRowThreads * e;
    const uint32_t bits = __float_as_uint(mass[e]);
    const bool tied = bits == tau && mass[e] > 0.0f;
    bool keep = bits > tau || (tied && !rank_ties);
    if (rank_ties) {  // every thread of the group takes part
      const int rank = group.rank_in_slot(tied, tied_before_slot);
      keep = keep || (tied && rank < tied_kept);
    }
    if (keep && j < nk) atomicOr(&selected[j / 32], 1u << (j % 32));
  }
  group.sync();
}

// One map row per group of kRowWarps warps; a CTA holds kWarps / kRowWarps rows.
template <int kRowWarps>
__device__ void block_map_rows(const BlockListsParams& p) {
  using Group = RowGroup<kRowWarps>;
  constexpr int kRows = kWarps / kRowWarps;
  __shared__ uint32_t selected_rows[kRows][Group::kWords];
  __shared__ int32_t word_count_rows[kRows][Group::kWords];
  __shared__ float partial_rows[kRows][2 * kRowWarps];

  const int row_in_cta = threadIdx.x / Group::kRowThreads;
  const Group group{static_cast<int>(threadIdx.x % Group::kRowThreads), partial_rows[row_in_cta]};
  uint32_t* selected = selected_rows[row_in_cta];
  int32_t* word_count = word_count_rows[row_in_cta];
  const int64_t g = static_cast<int64_t>(blockIdx.x) * kRows + row_in_cta, bh = blockIdx.y;
  if (g >= p.rows) return;  // past the last row: the whole group
  const int64_t b = bh / p.heads, h = bh % p.heads;
  const int nk = static_cast<int>(p.num_k_tiles), words = static_cast<int>(p.words);
  const int64_t i = p.block_begin + g;
  int64_t visible_keys = p.seq_k;
  if (p.kv_lens != nullptr) visible_keys = min(max(static_cast<int64_t>(p.kv_lens[b]), int64_t(0)), p.seq_k);

  for (int w = group.t; w < words; w += Group::kRowThreads) selected[w] = 0u;
  group.sync();
  const bool estimated = p.scores != nullptr;
  bool keep_all = !estimated;
  if (estimated) {
    // The safeguard: a block whose rows share no direction keeps every tile (no selection).
    keep_all = p.q_similarity[bh * p.num_q_blocks + i] < p.similarity_threshold;
    if (!keep_all) select_by_mass(group, p, b, h, bh, g, i, visible_keys, selected);
  }
  // The row's outputs, addressed after the selection (fewer registers live across it).
  const int64_t r = map_row_index(p, bh, g);
  uint32_t* bits = p.bits + r * p.words;
  int32_t* prefix = p.word_prefix + r * p.words;
  const float* log_weights = estimated ? p.log_weights + b * p.log_weights_stride_b + h * p.log_weights_stride_h : nullptr;
  uint8_t* row_map = p.row_map != nullptr ? p.row_map + (bh * p.rows + g) * p.num_k_tiles : nullptr;
  const int lane = group.lane();
  for (int w = group.warp(); w < words; w += kRowWarps) {
    const int j = 32 * w + lane;
    bool keep = false;
    if (j < nk && tile_allowed(p, b, h, i, j, visible_keys) && (!estimated || log_weights[j] > -INFINITY)) {
      keep = keep_all || ((selected[w] >> lane) & 1u) != 0u;
      if (estimated) {
        keep = keep || j == i ||
               (static_cast<int64_t>(j) * 128 < p.always_keep_end && static_cast<int64_t>(j + 1) * 128 > p.always_keep_begin);
      }
    }
    const uint32_t word = __ballot_sync(0xFFFFFFFFu, keep);
    if (lane == 0) {
      bits[w] = word;
      word_count[w] = __popc(word);
    }
    if (row_map != nullptr && j < nk) row_map[j] = keep;
  }
  group.sync();
  if (group.warp() == 0) {  // the words' exclusive prefix, 32 words at a time
    int32_t total = 0;
    for (int w0 = 0; w0 < words; w0 += 32) {
      const int w = w0 + lane;
      const int32_t n = w < words ? word_count[w] : 0;
      int32_t inclusive = n;
#pragma unroll
      for (int off = 1; off < 32; off <<= 1) {
        const int32_t y = __shfl_up_sync(0xFFFFFFFFu, inclusive, off);
        if (lane >= off) inclusive += y;
      }
      if (w < words) prefix[w] = total + inclusive - n;
      total += __shfl_sync(0xFFFFFFFFu, inclusive, 31);
    }
    if (lane == 0) p.row_counts[r] = total;
  }
}

__device__ void block_list_rows(const BlockListsParams& p) {
  const int64_t g = static_cast<int64_t>(blockIdx.x) * kListWarps + threadIdx.x / 32, bh = blockIdx.y;
  if (g >= p.rows) return;
  const int64_t r = map_row_index(p, bh, g);
  const int64_t base = p.offsets[r];
  const int lane = threadIdx.x & 31;
  for (int64_t w = 0; w < p.words; ++w) {  // lane l writes tile 32 w + l if listed: coalesced
    const uint32_t word = p.bits[r * p.words + w];
    if ((word >> lane) & 1u) p.tiles[base + p.word_prefix[r * p.words + w] + __popc(word & lanes_below())] = 32 * w + lane;
  }
  // The row's place in the visiting order: among its head's rows, after those with more tiles and
  // the earlier ones with as many (the kernel's longest-first schedule).
  const int32_t* counts = p.row_counts + map_row_index(p, bh, 0);  // the head's rows
  const int32_t own = counts[g];
  int64_t rank = 0;
  for (int64_t g0 = 0; g0 < p.rows; g0 += 32) {
    const int64_t other = g0 + lane;
    bool ahead = false;
    if (other < p.rows) {
      const int32_t n = counts[other];
      ahead = n > own || (n == own && other < g);
    }
    rank += __popc(__ballot_sync(0xFFFFFFFFu, ahead));
  }
  if (lane == 0) p.order[bh * p.rows + rank] = static_cast<int32_t>(r);
}

}  // namespace
}  // namespace nvfp4_dit

// Entry points (common/launch.h).
// Four CTAs per SM: 64 registers, enough for a row's masses without spilling.
extern "C" __global__ void __launch_bounds__(nvfp4_dit::kThreads, 4)
    nvfp4_dit_block_map_rows(const __grid_constant__ nvfp4_dit::BlockListsParams p) {
  nvfp4_dit::block_map_rows<nvfp4_dit::kWarps>(p);
}
// Three CTAs per SM: 80 registers, enough for a warp's 32 masses per thread.
extern "C" __global__ void __launch_bounds__(nvfp4_dit::kThreads, 3)
    nvfp4_dit_block_map_rows_by_warp(const __grid_constant__ nvfp4_dit::BlockListsParams p) {
  nvfp4_dit::block_map_rows<1>(p);
}
extern "C" __global__ void __launch_bounds__(32 * nvfp4_dit::kListWarps)
    nvfp4_dit_block_list_rows(const __grid_constant__ nvfp4_dit::BlockListsParams p) {
  nvfp4_dit::block_list_rows(p);
}
