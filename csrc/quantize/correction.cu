// The per-Q-block correction delta = qm . (k - km)^T / (q_scale k_scale) for a range of Q blocks
// (params.h).
//
// The full tensor is B*H*S^2/128 fp32 (17.6 GB at 118,800 tokens x 40 heads), so the pipeline
// asks for it one chunk of Q blocks at a time, sized to a memory budget, and the attention
// kernel consumes each chunk. K is read in its input dtype straight from its strides and
// smoothed on the fly, so no fp32 copy of k - km is ever materialised.
//
// One launch per chunk: an fp32 register-tiled GEMM (exact fp32 FMAs, no TF32), CTA tile 64 Q
// blocks x 128 keys with 128 threads of 8 x 8 outputs each, the head dim in slices of 16 through
// two shared-memory stages (the next slice's global loads are in flight while the current one is
// multiplied). Every offset is int64.
#include <cuda_fp16.h>

#include "common/launch.h"
#include "quantize/params.h"
#include "quantize/quantize_math.cuh"

namespace nvfp4_dit {
namespace {

constexpr int kThreads = launch::kCorrectionThreads;
constexpr int kTileM = launch::kCorrectionTileM;  // Q blocks per CTA
constexpr int kTileN = launch::kCorrectionTileN;  // keys per CTA (one per thread when loading)
constexpr int kSliceD = 16;   // head-dim slice per pipeline stage (two stages in shared memory)
constexpr int kPadN = 4;      // keeps float4 alignment, breaks the row-to-row bank pattern

// One thread's share of a slice, held in registers between the global load and the shared store
// (software pipelining: the next slice is in flight while the current one is multiplied).
template <InputDtype DT>
struct SliceRegs {
  using Raw = typename InputTraits<DT>::Raw;
  static constexpr int kKWords = kSliceD * int(sizeof(Raw)) / 4;  // 16 key elements
  float4 qm[2];            // 8 consecutive q_mean values of one Q block
  uint32_t k[kKWords];     // 16 consecutive head-dim elements of one key, input encoding
};

template <InputDtype DT, int DP, bool VEC_LOAD>
__device__ __forceinline__ void load_slice(SliceRegs<DT>& r, const CorrectionParams& p, const float* qm_row,
                                           bool m_valid, const typename InputTraits<DT>::Raw* k_row, bool key_valid,
                                           int d0) {
  using Raw = typename InputTraits<DT>::Raw;
  const int dq = (threadIdx.x / kTileM) * 8;  // this thread's 8 columns of the q_mean slice
  const float4 zero4 = make_float4(0.f, 0.f, 0.f, 0.f);
  r.qm[0] = m_valid ? *reinterpret_cast<const float4*>(qm_row + d0 + dq) : zero4;
  r.qm[1] = m_valid ? *reinterpret_cast<const float4*>(qm_row + d0 + dq + 4) : zero4;
  if constexpr (VEC_LOAD) {
    const uint4* src = reinterpret_cast<const uint4*>(k_row + d0);
#pragma unroll
    for (int i = 0; i < SliceRegs<DT>::kKWords / 4; ++i) {
      const uint4 t = key_valid ? __ldg(src + i) : make_uint4(0, 0, 0, 0);
      r.k[4 * i] = t.x;
      r.k[4 * i + 1] = t.y;
      r.k[4 * i + 2] = t.z;
      r.k[4 * i + 3] = t.w;
    }
  } else {
#pragma unroll
    for (int e = 0; e < kSliceD; ++e) {
      const int d = d0 + e;
      const uint32_t x = (key_valid && d < p.head_dim) ? static_cast<uint32_t>(k_row[d * p.k.stride_d]) : 0u;
      if constexpr (sizeof(Raw) == 2) {
        if (e & 1) r.k[e >> 1] |= x << 16;
        else r.k[e >> 1] = x;
      } else {
        r.k[e] = x;
      }
    }
  }
}

template <InputDtype DT>
__device__ __forceinline__ float slice_k(const SliceRegs<DT>& r, int e) {
  using Raw = typename InputTraits<DT>::Raw;
  if constexpr (sizeof(Raw) == 2) {
    const uint32_t w = r.k[e >> 1];
    return InputTraits<DT>::to_float((e & 1) ? (w >> 16) : (w & 0xFFFFu));
  } else {
    return __uint_as_float(r.k[e]);
  }
}

template <InputDtype DT, int DP, bool VEC_LOAD, bool VEC_STORE>
__device__ __forceinline__ void correction_kernel(const CorrectionParams& p) {
  using Raw = typename InputTraits<DT>::Raw;
  __shared__ __align__(16) float qs[2][kSliceD][kTileM];
  __shared__ __align__(16) float ks[2][kSliceD][kTileN + kPadN];
  __shared__ float km_s[DP];

  const int64_t key0 = int64_t(blockIdx.x) * kTileN;
  const int64_t m0 = int64_t(blockIdx.y) * kTileM;
  const int64_t bh = blockIdx.z;  // b * H + h
  const int64_t b = bh / p.heads_q, h = bh % p.heads_q;
  const int64_t kvh = h / (p.heads_q / p.heads_kv);
  const int64_t n_rows = p.block_end - p.block_begin;
  const int64_t n_valid = valid_key_count(p, b);  // keys past kv_lens[b] are padding: k_s = 0

  for (int d = threadIdx.x; d < DP; d += kThreads) km_s[d] = p.k_mean[(b * p.heads_kv + kvh) * DP + d];

  // Loader roles: q_mean row (threadIdx.x % 64) and column half (threadIdx.x / 64); key threadIdx.x.
  const int lm = threadIdx.x % kTileM, lq = (threadIdx.x / kTileM) * 8;
  const bool m_valid = m0 + lm < n_rows;
  const float* qm_row = p.q_mean + (bh * p.num_q_blocks + p.block_begin + m0 + lm) * DP;
  const int64_t key = key0 + threadIdx.x;
  const bool key_valid = key < n_valid;
  const Raw* k_row = static_cast<const Raw*>(p.k.ptr) + b * p.k.stride_b + kvh * p.k.stride_h +
                     (key_valid ? key : 0) * p.k.stride_s;

  // Compute roles: 8 Q blocks (tm) x 8 keys (tn*4 + j and 64 + tn*4 + j).
  const int tn = threadIdx.x % 16, tm = threadIdx.x / 16;
  float acc[8][8];
#pragma unroll
  for (int i = 0; i < 8; ++i)
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[i][j] = 0.0f;

  SliceRegs<DT> regs;
  __syncthreads();  // km_s
  auto store_slice = [&](int buf, int d0) {
    const float qv[8] = {regs.qm[0].x, regs.qm[0].y, regs.qm[0].z, regs.qm[0].w,
                         regs.qm[1].x, regs.qm[1].y, regs.qm[1].z, regs.qm[1].w};
#pragma unroll
    for (int e = 0; e < 8; ++e) qs[buf][lq + e][lm] = qv[e];
#pragma unroll
    for (int e = 0; e < kSliceD; ++e) {
      // Padded keys (and the padded head-dim columns, where km is 0) stay exactly zero.
      ks[buf][e][threadIdx.x] = key_valid ? slice_k<DT>(regs, e) - km_s[d0 + e] : 0.0f;
    }
  };

  load_slice<DT, DP, VEC_LOAD>(regs, p, qm_row, m_valid, k_row, key_valid, 0);
  store_slice(0, 0);
  __syncthreads();
  constexpr int kSlices = DP / kSliceD;
#pragma unroll 1
  for (int s = 0; s < kSlices; ++s) {
    const int buf = s & 1;
    if (s + 1 < kSlices) load_slice<DT, DP, VEC_LOAD>(regs, p, qm_row, m_valid, k_row, key_valid, (s + 1) * kSliceD);
#pragma unroll
    for (int kk = 0; kk < kSliceD; ++kk) {
      const float4 a0 = *reinterpret_cast<const float4*>(&qs[buf][kk][tm * 8]);
      const float4 a1 = *reinterpret_cast<const float4*>(&qs[buf][kk][tm * 8 + 4]);
      const float4 b0 = *reinterpret_cast<const float4*>(&ks[buf][kk][tn * 4]);
      const float4 b1 = *reinterpret_cast<const float4*>(&ks[buf][kk][64 + tn * 4]);
      const float av[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
      const float bv[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
      for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
    }
    if (s + 1 < kSlices) store_slice(buf ^ 1, (s + 1) * kSliceD);
    __syncthreads();
  }

  float* out = p.delta + b * p.delta_stride_b + h * p.delta_stride_h;
  const float k_scale = p.k_scale[b * p.heads_kv + kvh];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int64_t m = m0 + tm * 8 + i;
    if (m >= n_rows) continue;
    float* row = out + m * p.delta_stride_blk + key0;
    // To the attention kernel's score units: a power of two, so the product is exact.
    const float unit = __frcp_rn(p.q_scale[bh * p.num_q_blocks + p.block_begin + m] * k_scale);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int n = half * 64 + tn * 4;
      if constexpr (VEC_STORE) {
        *reinterpret_cast<float4*>(row + n) = make_float4(acc[i][4 * half] * unit, acc[i][4 * half + 1] * unit,
                                                          acc[i][4 * half + 2] * unit, acc[i][4 * half + 3] * unit);
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j) row[n + j] = acc[i][4 * half + j] * unit;
      }
    }
  }
}

}  // namespace
}  // namespace nvfp4_dit

// Entry points (common/launch.h): every input dtype and padded head dim, 16-byte or scalar loads of
// K (16-byte ones need D == Dp, unit stride and 16-byte rows) and float4 or scalar stores of delta.
#define NVFP4_DIT_CORRECTION_ENTRY(NAME, DT, DP, LOAD, VEC_LOAD, STORE, VEC_STORE)                            \
  extern "C" __global__ void __launch_bounds__(nvfp4_dit::kThreads)                                          \
      nvfp4_dit_correction_##NAME##_d##DP##_##LOAD##_##STORE(const __grid_constant__ nvfp4_dit::CorrectionParams p) {         \
    nvfp4_dit::correction_kernel<nvfp4_dit::InputDtype::DT, DP, VEC_LOAD, VEC_STORE>(p);                    \
  }
#define NVFP4_DIT_CORRECTION_ENTRIES(NAME, DT, DP)                                       \
  NVFP4_DIT_CORRECTION_ENTRY(NAME, DT, DP, vec, true, vecstore, true)                  \
  NVFP4_DIT_CORRECTION_ENTRY(NAME, DT, DP, vec, true, scalarstore, false)              \
  NVFP4_DIT_CORRECTION_ENTRY(NAME, DT, DP, scalar, false, vecstore, true)              \
  NVFP4_DIT_CORRECTION_ENTRY(NAME, DT, DP, scalar, false, scalarstore, false)
NVFP4_DIT_CORRECTION_ENTRIES(bf16, kBFloat16, 64)
NVFP4_DIT_CORRECTION_ENTRIES(bf16, kBFloat16, 128)
NVFP4_DIT_CORRECTION_ENTRIES(fp16, kFloat16, 64)
NVFP4_DIT_CORRECTION_ENTRIES(fp16, kFloat16, 128)
NVFP4_DIT_CORRECTION_ENTRIES(fp32, kFloat32, 64)
NVFP4_DIT_CORRECTION_ENTRIES(fp32, kFloat32, 128)
