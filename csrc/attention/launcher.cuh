// Host side of the attention kernel: grid sizing (persistent, from the SM count and occupancy)
// and the launch. Included by the instantiation TUs (csrc/attention_fwd_*.cu) only.
#pragma once
#include <algorithm>
#include <cuda_runtime.h>

#include "attention/api.h"
#include "attention/kernel.cuh"

namespace nvfp4_dit {

template <int kHeadDim, bool kWithLse, class Mma, class QkFmt>
cudaError_t launch_attention_fwd(AttentionFwdParams p, cudaStream_t stream) {
  using T = AttentionTraits<kHeadDim, QkFmt>;
  auto kernel = attention_fwd_kernel<kHeadDim, kWithLse, Mma, QkFmt>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, T::kSmemBytes);
  if (err != cudaSuccess) return err;
  int device = 0, sms = 0, per_sm = 0;
  if ((err = cudaGetDevice(&device)) != cudaSuccess) return err;
  if ((err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device)) != cudaSuccess) return err;
  if ((err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, T::kThreads, T::kSmemBytes)) != cudaSuccess) return err;
  const int64_t work = int64_t(p.batch) * p.heads * (p.q_block_end - p.q_block_begin);
  if (work <= 0) return cudaSuccess;
  p.grid_size = int(std::min<int64_t>(work, int64_t(std::max(per_sm, 1)) * sms));
  kernel<<<p.grid_size, T::kThreads, T::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace nvfp4_dit
