// The per-Q-block correction delta = qm . (k - km)^T for a range of Q blocks (quantize.cuh).
//
// The full tensor is B*H*S^2/128 fp32 (17.6 GB at 118,800 tokens x 40 heads), so the pipeline
// asks for it one chunk of Q blocks at a time, sized to a memory budget, and the attention
// kernel consumes each chunk. K is read in its input dtype straight from its strides and
// smoothed on the fly, so no fp32 copy of k - km is ever materialised.
//
// One launch per chunk: an fp32 register-tiled GEMM, CTA tile 64 Q blocks x 128 keys, the head
// dim in slices of 32 through shared memory, 4 x 8 outputs per thread. Every offset is int64.
#include <cuda_fp16.h>

#include "quantize.cuh"
#include "quantize_math.cuh"

namespace nvfp4_dit {
namespace {

constexpr int kThreads = 256;
constexpr int kTileM = 64;    // Q blocks per CTA
constexpr int kTileN = 128;   // keys per CTA
constexpr int kSliceD = 32;   // head-dim slice held in shared memory
constexpr int kPadN = 4;      // keeps float4 alignment, breaks the row-to-row bank pattern

template <InputDtype DT>
__device__ __forceinline__ float load_as_float(const void* base, int64_t offset) {
  if constexpr (DT == InputDtype::kBFloat16) {
    return __uint_as_float(static_cast<uint32_t>(static_cast<const uint16_t*>(base)[offset]) << 16);
  } else if constexpr (DT == InputDtype::kFloat16) {
    return __half2float(static_cast<const __half*>(base)[offset]);
  } else {
    return static_cast<const float*>(base)[offset];
  }
}

template <InputDtype DT, int DP, bool VEC_STORE>
__global__ void __launch_bounds__(kThreads) qk_correction_kernel(const QkCorrectionParams p) {
  __shared__ __align__(16) float qs[kSliceD][kTileM];
  __shared__ __align__(16) float ks[kSliceD][kTileN + kPadN];

  const int64_t n_tile = blockIdx.x;
  const int64_t m_tile = blockIdx.y;
  const int64_t bh = blockIdx.z;  // b * H + h
  const int64_t b = bh / p.heads_q, h = bh % p.heads_q;
  const int64_t kvh = h / (p.heads_q / p.heads_kv);
  const int64_t n_rows = p.block_end - p.block_begin;
  const int64_t key0 = n_tile * kTileN;
  const int64_t m0 = m_tile * kTileM;

  const int tn = threadIdx.x % 16, tm = threadIdx.x / 16;
  float acc[4][8];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[i][j] = 0.0f;

  const float* qm_base = p.q_mean + (bh * p.num_q_blocks + p.block_begin + m0) * DP;
  const float* km = p.k_mean + (b * p.heads_kv + kvh) * DP;
  const int64_t k_row0 = b * p.k.stride_b + kvh * p.k.stride_h;
  // K loader: thread -> key (threadIdx.x % 128), half of the slice (threadIdx.x / 128).
  const int lk = threadIdx.x % kTileN, lhalf = threadIdx.x / kTileN;
  const int64_t key = key0 + lk;
  const int64_t n_valid = valid_key_count(p, b);  // keys past kv_lens[b] are padding: k_s = 0

  for (int d0 = 0; d0 < DP; d0 += kSliceD) {
    // Q means: 64 rows x 32 columns, 8 per thread, stored transposed; lanes run along m so the
    // shared-memory stores are conflict-free (q_mean is small and L2-resident).
#pragma unroll
    for (int i = 0; i < kTileM * kSliceD / kThreads; ++i) {
      const int idx = threadIdx.x + i * kThreads;
      const int m = idx % kTileM, dd = idx / kTileM;
      qs[dd][m] = (m0 + m < n_rows) ? qm_base[int64_t(m) * DP + d0 + dd] : 0.0f;
    }
    // K smoothed on the fly; padded keys and padded head-dim columns are exactly zero.
#pragma unroll
    for (int e = 0; e < 16; ++e) {
      const int dd = lhalf * 16 + e;
      const int d = d0 + dd;
      float x = 0.0f;
      if (key < n_valid && d < p.head_dim)
        x = load_as_float<DT>(p.k.ptr, k_row0 + key * p.k.stride_s + d * p.k.stride_d) - km[d];
      ks[dd][lk] = x;
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kSliceD; ++kk) {
      const float4 a = *reinterpret_cast<const float4*>(&qs[kk][tm * 4]);
      const float4 b0 = *reinterpret_cast<const float4*>(&ks[kk][tn * 4]);
      const float4 b1 = *reinterpret_cast<const float4*>(&ks[kk][64 + tn * 4]);
      const float av[4] = {a.x, a.y, a.z, a.w};
      const float bv[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
    }
    __syncthreads();
  }

  float* out = p.delta + b * p.delta_stride_b + h * p.delta_stride_h;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t m = m0 + tm * 4 + i;
    if (m >= n_rows) continue;
    float* row = out + m * p.delta_stride_blk + key0;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int n = half * 64 + tn * 4;
      if constexpr (VEC_STORE) {
        *reinterpret_cast<float4*>(row + n) =
            make_float4(acc[i][4 * half], acc[i][4 * half + 1], acc[i][4 * half + 2], acc[i][4 * half + 3]);
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j) row[n + j] = acc[i][4 * half + j];
      }
    }
  }
}

template <InputDtype DT, int DP>
cudaError_t launch_typed(const QkCorrectionParams& p, cudaStream_t stream) {
  const int64_t rows = p.block_end - p.block_begin;
  const dim3 grid(unsigned(p.seq_k_padded / kTileN), unsigned((rows + kTileM - 1) / kTileM),
                  unsigned(p.batch * p.heads_q));
  const bool vec = (reinterpret_cast<uintptr_t>(p.delta) & 15u) == 0 && p.delta_stride_b % 4 == 0 &&
                   p.delta_stride_h % 4 == 0 && p.delta_stride_blk % 4 == 0;
  if (vec) qk_correction_kernel<DT, DP, true><<<grid, kThreads, 0, stream>>>(p);
  else qk_correction_kernel<DT, DP, false><<<grid, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

template <InputDtype DT>
cudaError_t launch_dtype(const QkCorrectionParams& p, cudaStream_t stream) {
  if (p.head_dim_padded == 128) return launch_typed<DT, 128>(p, stream);
  if (p.head_dim_padded == 64) return launch_typed<DT, 64>(p, stream);
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t launch_qk_correction(const QkCorrectionParams& p, cudaStream_t stream) {
  const int64_t rows = p.block_end - p.block_begin;
  if (p.batch <= 0 || p.heads_q <= 0 || p.heads_kv <= 0 || p.heads_q % p.heads_kv != 0 ||
      p.block_begin < 0 || p.block_end > p.num_q_blocks || rows < 0 || p.seq_k_padded % kTileN != 0 ||
      p.seq_k_padded < p.seq_k || p.head_dim <= 0 || p.head_dim > p.head_dim_padded)
    return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  if (p.batch * p.heads_q > 65535 || (rows + kTileM - 1) / kTileM > 65535) return cudaErrorInvalidConfiguration;
  switch (p.dtype) {
    case InputDtype::kBFloat16: return launch_dtype<InputDtype::kBFloat16>(p, stream);
    case InputDtype::kFloat16: return launch_dtype<InputDtype::kFloat16>(p, stream);
    case InputDtype::kFloat32: return launch_dtype<InputDtype::kFloat32>(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace nvfp4_dit
