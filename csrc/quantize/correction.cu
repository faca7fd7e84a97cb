// The per-Q-block correction delta = qm . (k - km)^T / (q_scale k_scale) for a range of Q blocks
// (params.h), on int8 tensor cores, with a result that does not depend on summation order.
//
// Both operands are fixed point per row (nvfp4_dit.format.correction_fixed_point): the row's
// power-of-two exponent e (|x| < 2^e), X = rint(x 2^(22-e)) in [-2^22, 2^22], split into three
// signed 8-bit limbs X = l0 2^16 + l1 2^8 + l2. Every limb pair but l2 x l2 (eight s8 m16n8k32
// MMAs per step), summed per weight 2^32, 2^24, 2^16, 2^8 exactly in int32, gives
// T = Xq . Xk - lq2 . lk2 as an exact int64, rounded once to fp32 and scaled by powers of two, then
// stored as nvfp4_dit.format.Correction: per (Q block, 128-key tile) fp16 values under a power of
// two chosen from the operands' exponents (preprocess.correction_exponents). The reference
// computes the same integer with exact fp64 products, so the two agree bit for bit;
// preprocess.correction states the error bound against fp64.
//
// The full tensor is B*H*S^2/128 fp16 (8.8 GB at 118,800 tokens x 40 heads), so the pipeline
// asks for it one chunk of Q blocks at a time, sized to a memory budget, and the attention kernel
// consumes each chunk. A CTA owns 128 keys of one head: it reads them once in their input dtype
// (straight from the caller's strides, smoothed on the fly), keeps their limbs in shared memory
// and walks its share of the chunk's Q blocks 64 at a time. Every offset is int64.
#include <cuda_fp16.h>

#include "common/launch.h"
#include "common/ldmatrix.cuh"
#include "quantize/params.h"
#include "quantize/quantize_math.cuh"

namespace nvfp4_dit {
namespace {

constexpr int kThreads = launch::kCorrectionThreads;  // 8 warps: 4 (Q blocks, m16 each) x 2 (keys, 64 each)
constexpr int kTileM = launch::kCorrectionTileM;      // Q blocks per step
constexpr int kTileN = launch::kCorrectionTileN;      // keys per CTA
constexpr int kFixedBits = 22;
constexpr int kExponentLimit = 100;  // row exponents are clamped to [-100, 100]
constexpr int kLimbs = 3;
constexpr int kWeights = 4;  // limb pairs of weight 2^32, 2^24, 2^16, 2^8 (l2 x l2, weight 1, is left out)
constexpr int kRowPad = 16;  // bytes: rows stay 16-byte aligned for ldmatrix, and 8 rows hit 8 distinct bank quads
constexpr int kStoredValueBits = 15;  // stored values lie below 2^15 in units of their tile's factor
constexpr float kFp16Max = 65504.0f;

template <int DP>
struct CorrectionSmem {
  static constexpr int kRow = DP + kRowPad;
  int8_t k[kLimbs][kTileN][kRow];  // limb l of the fixed-point smoothed keys
  int8_t q[kLimbs][kTileM][kRow];  // limb l of the fixed-point Q block means of the current step
  float km[DP];
  float key_factor[kTileN];  // 2^(ek - 22)
  float row_factor[kTileM];  // 2^(eq - 22) / (q_scale k_scale)
  float bias_divisor[kTileM];  // scale * q_scale * k_scale: a key bias in the kernel's score units
  int store_exponent[kTileM];  // the stored tile's power of two (preprocess.correction_exponents)
  int key_exponent_max;        // the largest ek of the CTA's keys
};
static_assert(sizeof(CorrectionSmem<64>) == launch::kCorrectionSmemBytes[0], "launch.h: correction shared memory");
static_assert(sizeof(CorrectionSmem<128>) == launch::kCorrectionSmemBytes[1], "launch.h: correction shared memory");

// Non-finite inputs become 0 so that every integer below is defined (the output of such blocks
// is poisoned downstream anyway).
__device__ __forceinline__ float finite_or_zero(float x) {
  return (__float_as_uint(x) & 0x7F800000u) == 0x7F800000u ? 0.0f : x;
}

// The row exponent e of a row whose largest |x| is amax: |x| < 2^e (amax's biased exponent - 126).
__device__ __forceinline__ int row_exponent(float amax) {
  const int e = static_cast<int>((__float_as_uint(amax) >> 23) & 0xFFu) - 126;
  return min(max(e, -kExponentLimit), kExponentLimit);
}

// The exponent of an fp32 power of two (a normal number).
__device__ __forceinline__ int power_of_two_exponent(float x) {
  return static_cast<int>((__float_as_uint(x) >> 23) & 0xFFu) - 127;
}

// One value as format.store_correction stores it: times 2^-e (inverse), finite values saturated
// at +-65504, fp16 round to nearest even; +-inf (a masked key) and NaN pass.
__device__ __forceinline__ __half stored_value(float v, float inverse) {
  float x = v * inverse;
  if (isfinite(v)) x = fminf(fmaxf(x, -kFp16Max), kFp16Max);
  return __float2half_rn(x);
}

// Four consecutive values of a row -> one 32-bit word per limb (byte i = value i).
__device__ __forceinline__ void limb_words(const float* v, float mult, uint32_t (&w)[kLimbs]) {
  w[0] = w[1] = w[2] = 0u;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int x = min(max(__float2int_rn(v[i] * mult), -(1 << kFixedBits)), 1 << kFixedBits);
    const int l2 = ((x + 128) & 255) - 128;
    const int x1 = (x - l2) >> 8;
    const int l1 = ((x1 + 128) & 255) - 128;
    const int l0 = (x1 - l1) >> 8;
    w[0] |= static_cast<uint32_t>(l0 & 255) << (8 * i);
    w[1] |= static_cast<uint32_t>(l1 & 255) << (8 * i);
    w[2] |= static_cast<uint32_t>(l2 & 255) << (8 * i);
  }
}

// Consecutive values v[0, n) of one row, from column d0, as limbs into rows[l][row][d0..].
template <int kN, int kRow>
__device__ __forceinline__ void store_limbs(int8_t (&rows)[kLimbs][kN][kRow], int row, int d0, const float* v, int n,
                                            float mult) {
#pragma unroll
  for (int c = 0; c < n / 4; ++c) {
    uint32_t w[kLimbs];
    limb_words(v + 4 * c, mult, w);
#pragma unroll
    for (int l = 0; l < kLimbs; ++l) *reinterpret_cast<uint32_t*>(&rows[l][row][d0 + 4 * c]) = w[l];
  }
}

// Two threads per key, half a row each: load, smooth, exponent of the whole row, limbs.
// K is read as 16-byte vectors (D == Dp, unit stride, 16-byte rows: the host copies any other K).
template <InputDtype DT, int DP>
__device__ __forceinline__ void convert_keys(CorrectionSmem<DP>& s, const CorrectionParams& p,
                                             const typename InputTraits<DT>::Raw* k_row, bool key_valid) {
  using Raw = typename InputTraits<DT>::Raw;
  constexpr int kHalf = DP / 2;
  const int key = threadIdx.x >> 1, d0 = (threadIdx.x & 1) * kHalf;
  float v[kHalf];
  constexpr int kWords = kHalf * int(sizeof(Raw)) / 4;
  uint32_t w[kWords];
  const uint4* src = reinterpret_cast<const uint4*>(k_row + d0);
#pragma unroll
  for (int i = 0; i < kWords / 4; ++i) {
    const uint4 t = key_valid ? __ldg(src + i) : make_uint4(0, 0, 0, 0);
    w[4 * i] = t.x;
    w[4 * i + 1] = t.y;
    w[4 * i + 2] = t.z;
    w[4 * i + 3] = t.w;
  }
#pragma unroll
  for (int e = 0; e < kHalf; ++e) {
    if constexpr (sizeof(Raw) == 2) {
      v[e] = InputTraits<DT>::to_float((e & 1) ? (w[e >> 1] >> 16) : (w[e >> 1] & 0xFFFFu));
    } else {
      v[e] = InputTraits<DT>::to_float(w[e]);
    }
  }
  float amax = 0.0f;
#pragma unroll
  for (int e = 0; e < kHalf; ++e) {
    // Padded keys (and the padded head-dim columns, where km is 0) stay exactly zero.
    v[e] = key_valid ? finite_or_zero(v[e] - s.km[d0 + e]) : 0.0f;
    amax = fmaxf(amax, fabsf(v[e]));
  }
  amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 1));
  const int e = row_exponent(amax);
  if ((threadIdx.x & 1) == 0) {
    s.key_factor[key] = power_of_two(e - kFixedBits);
    atomicMax(&s.key_exponent_max, e);
  }
  store_limbs(s.k, key, d0, v, kHalf, power_of_two(kFixedBits - e));
}

// Four threads per Q block, a quarter row each. Item m0 + r of the CTA's work is chunk row m0 + r,
// or, with a block map, chunk row rows[m0 + r].
template <int DP>
__device__ __forceinline__ void convert_q_means(CorrectionSmem<DP>& s, const CorrectionParams& p, int64_t bh,
                                                int64_t m0, int64_t n_items, const int32_t* rows, float k_scale) {
  constexpr int kQuarter = DP / 4;
  const int r = threadIdx.x >> 2, d0 = (threadIdx.x & 3) * kQuarter;
  const int64_t m = m0 + r;
  const bool valid = m < n_items;
  const int64_t row = !valid ? 0 : rows != nullptr ? int64_t(rows[m]) : m;
  const int64_t block = bh * p.num_q_blocks + p.block_begin + row;
  const float4* src = reinterpret_cast<const float4*>(p.q_mean + block * DP + d0);
  float v[kQuarter];
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < kQuarter / 4; ++i) {
    const float4 t = valid ? __ldg(src + i) : make_float4(0.f, 0.f, 0.f, 0.f);
    v[4 * i] = finite_or_zero(t.x);
    v[4 * i + 1] = finite_or_zero(t.y);
    v[4 * i + 2] = finite_or_zero(t.z);
    v[4 * i + 3] = finite_or_zero(t.w);
  }
#pragma unroll
  for (int e = 0; e < kQuarter; ++e) amax = fmaxf(amax, fabsf(v[e]));
  amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 1));
  amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 2));
  const int e = row_exponent(amax);
  if ((threadIdx.x & 3) == 0) {
    // To the attention kernel's score units: 1 / (q_scale k_scale) is a power of two, so exact.
    const float q_scale = p.q_scale[block];
    s.row_factor[r] = valid ? power_of_two(e - kFixedBits) * __frcp_rn(q_scale * k_scale) : 0.0f;
    s.bias_divisor[r] = p.scale * (q_scale * k_scale);
    // |delta| < Dp 2^(eq + ek - u), u the exponent of q_scale k_scale: below 2^15 in units of 2^e.
    constexpr int kLog2Dp = DP == 128 ? 7 : 6;
    const int u = power_of_two_exponent(q_scale) + power_of_two_exponent(k_scale);
    s.store_exponent[r] = min(max(e + s.key_exponent_max - u + kLog2Dp - kStoredValueBits, -126), 111);
  }
  store_limbs(s.q, r, d0, v, kQuarter, power_of_two(kFixedBits - e));
}

__device__ __forceinline__ void mma_s8(int32_t (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <InputDtype DT, int DP>
__device__ __forceinline__ void correction_kernel(const CorrectionParams& p) {
  using Raw = typename InputTraits<DT>::Raw;
  using Smem = CorrectionSmem<DP>;
  constexpr int kRow = Smem::kRow;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Smem& s = *reinterpret_cast<Smem*>(smem_raw);

  const int64_t key0 = int64_t(blockIdx.x) * kTileN;
  const int64_t bh = blockIdx.z;  // b * H + h
  const int64_t b = bh / p.heads_q, h = bh % p.heads_q;
  const int64_t kvh = h / (p.heads_q / p.heads_kv);
  const int64_t n_valid = valid_key_count(p, b);  // keys past kv_lens[b] are padding: k_s = 0
  // The rows this CTA computes: every row of the chunk, or those of its column of the block map.
  int64_t n_items = p.block_end - p.block_begin;
  const int32_t* rows = nullptr;
  const int32_t* entries = nullptr;
  if (p.col_offsets != nullptr) {
    const int64_t col = bh * (p.seq_k_padded / kTileN) + blockIdx.x;
    const int32_t first = p.col_offsets[col];
    n_items = p.col_offsets[col + 1] - first;
    rows = p.col_rows + first;
    entries = p.col_entries + first;
    if (n_items <= int64_t(blockIdx.y) * kTileM) return;   // uniform: this CTA has no listed row
  }

  for (int d = threadIdx.x; d < DP; d += kThreads) s.km[d] = p.k_mean[(b * p.heads_kv + kvh) * DP + d];
  if (threadIdx.x == 0) s.key_exponent_max = -kExponentLimit;
  __syncthreads();

  const int64_t key = key0 + (threadIdx.x >> 1);
  const bool key_valid = key < n_valid;
  const Raw* k_row = static_cast<const Raw*>(p.k.ptr) + b * p.k.stride_b + kvh * p.k.stride_h +
                     (key_valid ? source_row(p.k_order, key) : 0) * p.k.stride_s;
  convert_keys<DT, DP>(s, p, k_row, key_valid);

  const float k_scale = p.k_scale[b * p.heads_kv + kvh];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int wm = warp & 3, wn = warp >> 2;  // Q blocks [16 wm, 16 wm + 16), keys [64 wn, 64 wn + 64)
  // ldmatrix.x4 row addresses. A (Q limbs): matrix j = lane / 8 covers rows 8 (j & 1).., bytes
  // 16 (j >> 1).. of a 16 x 32 fragment. B (key limbs): matrix j covers keys 8 (j >> 1).., bytes
  // 16 (j & 1).., so results 0, 1 are the b0, b1 of one n8 tile and 2, 3 those of the next.
  const int j = lane >> 3;
  const uint32_t q_addr = static_cast<uint32_t>(
      __cvta_generic_to_shared(&s.q[0][wm * 16 + (j & 1) * 8 + (lane & 7)][(j >> 1) * 16]));
  const uint32_t k_addr = static_cast<uint32_t>(
      __cvta_generic_to_shared(&s.k[0][wn * 64 + (j >> 1) * 8 + (lane & 7)][(j & 1) * 16]));
  constexpr uint32_t kQLimbBytes = kTileM * kRow, kKLimbBytes = kTileN * kRow;
  const int64_t out_offset = b * p.delta_stride_b + h * p.delta_stride_h;
  // Pairs of values as one 4-byte store where delta is 4-byte aligned (every stride is a multiple of 128).
  const bool vec_store = reinterpret_cast<uintptr_t>(p.delta) % 4 == 0;
  const float* key_bias = p.key_bias != nullptr ? p.key_bias + b * p.key_bias_stride_b + h * p.key_bias_stride_h
                                                : nullptr;

#pragma unroll 1
  for (int64_t m0 = int64_t(blockIdx.y) * kTileM; m0 < n_items; m0 += int64_t(gridDim.y) * kTileM) {
    __syncthreads();  // the previous step's fragments are read; the key limbs are written
    convert_q_means<DP>(s, p, bh, m0, n_items, rows, k_scale);
    __syncthreads();

    // A warp whose 16 rows are all past the step's items has nothing to compute (a sparse column
    // lists fewer rows than the step holds; the chunk's last step): its MMAs would be discarded.
    if (m0 + wm * 16 >= n_items) continue;
    // Two passes of 32 keys per warp keep the accumulators at 64 registers (two CTAs per SM).
#pragma unroll 1
    for (int pass = 0; pass < 2; ++pass) {
      // acc[w][tile]: the limb pairs of weight 2^(32 - 8w), per n8 tile of the pass's 32 keys.
      int32_t acc[kWeights][4][4];
#pragma unroll
      for (int w = 0; w < kWeights; ++w)
#pragma unroll
        for (int t = 0; t < 4; ++t)
#pragma unroll
          for (int i = 0; i < 4; ++i) acc[w][t][i] = 0;

#pragma unroll
      for (int kk = 0; kk < DP / 32; ++kk) {
        uint32_t a[kLimbs][4];
#pragma unroll
        for (int l = 0; l < kLimbs; ++l) detail::ldmatrix_x4(a[l], q_addr + l * kQLimbBytes + kk * 32);
#pragma unroll
        for (int pair = 0; pair < 2; ++pair) {
          uint32_t bf[kLimbs][4];
#pragma unroll
          for (int l = 0; l < kLimbs; ++l)
            detail::ldmatrix_x4(bf[l], k_addr + l * kKLimbBytes + (pass * 2 + pair) * 16 * kRow + kk * 32);
#pragma unroll
          for (int x = 0; x < 2; ++x) {
            int32_t(&c0)[4] = acc[0][2 * pair + x];
            int32_t(&c1)[4] = acc[1][2 * pair + x];
            int32_t(&c2)[4] = acc[2][2 * pair + x];
            int32_t(&c3)[4] = acc[3][2 * pair + x];
            mma_s8(c0, a[0], bf[0][2 * x], bf[0][2 * x + 1]);
            mma_s8(c1, a[0], bf[1][2 * x], bf[1][2 * x + 1]);
            mma_s8(c1, a[1], bf[0][2 * x], bf[0][2 * x + 1]);
            mma_s8(c2, a[0], bf[2][2 * x], bf[2][2 * x + 1]);
            mma_s8(c2, a[1], bf[1][2 * x], bf[1][2 * x + 1]);
            mma_s8(c2, a[2], bf[0][2 * x], bf[0][2 * x + 1]);
            mma_s8(c3, a[1], bf[2][2 * x], bf[2][2 * x + 1]);
            mma_s8(c3, a[2], bf[1][2 * x], bf[1][2 * x + 1]);
          }
        }
      }

      // C fragment: registers 0, 1 are row g, keys 2 tig, 2 tig + 1 of the tile; 2, 3 are row g + 8.
      const int g = lane >> 2, tig = lane & 3;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = wm * 16 + g + 8 * half;
        const int64_t m = m0 + r;
        if (m >= n_items) continue;
        const float rf = s.row_factor[r];
        const int store_exponent = s.store_exponent[r];
        const float inverse = power_of_two(-store_exponent);
        // The entry's first value (a multiple of 128): its factor sits at entry / 128.
        const int64_t entry = entries != nullptr ? int64_t(entries[m]) * kTileN
                                                 : out_offset + m * p.delta_stride_blk + key0;
        uint16_t* row = p.delta + entry;
        if (wn == 0 && pass == 0 && tig == 0) p.delta_factor[entry / kTileN] = power_of_two(store_exponent);
#pragma unroll
        for (int t = 0; t < 4; ++t) {
          const int n = wn * 64 + pass * 32 + t * 8 + 2 * tig;
          __half v[2];
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            const int c = 2 * half + i;
            const int64_t total = (int64_t(acc[0][t][c]) << 32) + (int64_t(acc[1][t][c]) << 24) +
                                  (int64_t(acc[2][t][c]) << 16) + (int64_t(acc[3][t][c]) << 8);
            float x = (__ll2float_rn(total) * s.key_factor[n + i]) * rf;
            if (key_bias != nullptr && key0 + n + i < p.seq_k)
              x += __fdiv_rn(key_bias[key0 + n + i], s.bias_divisor[r]);
            v[i] = stored_value(x, inverse);
          }
          if (vec_store) {
            *reinterpret_cast<__half2*>(row + n) = __halves2half2(v[0], v[1]);
          } else {
            row[n] = __half_as_ushort(v[0]);
            row[n + 1] = __half_as_ushort(v[1]);
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace nvfp4_dit

// Entry points (common/launch.h): every input dtype and padded head dim.
#define NVFP4_DIT_CORRECTION_ENTRIES(NAME, DT, DP)                                                           \
  extern "C" __global__ void __launch_bounds__(nvfp4_dit::kThreads, 2)                                       \
      nvfp4_dit_correction_##NAME##_d##DP(const __grid_constant__ nvfp4_dit::CorrectionParams p) {           \
    nvfp4_dit::correction_kernel<nvfp4_dit::InputDtype::DT, DP>(p);                                          \
  }
NVFP4_DIT_FOR_EACH_INPUT(NVFP4_DIT_CORRECTION_ENTRIES)
