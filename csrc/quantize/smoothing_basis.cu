// The entry points of the smoothing basis (quantize/smoothing.cuh): one CTA per query head, after
// the Q block means and before any K or Q tile. A unit of its own: it shares only the parameters
// with the tile kernels, and keeps its code out of their cubin.
#include "common/portable.h"

#include "common/launch.h"
#include "quantize/params.h"
#include "quantize/smoothing.cuh"

static_assert(sizeof(nvfp4_dit::BasisStorage<64>) == nvfp4_dit::launch::kSmoothingBasisSmemBytes[0] &&
                  sizeof(nvfp4_dit::BasisStorage<128>) == nvfp4_dit::launch::kSmoothingBasisSmemBytes[1],
              "common/launch.h states the basis kernel's shared memory");

#define NVFP4_DIT_BASIS_ENTRY(DP)                                                                               \
  extern "C" __global__ void __launch_bounds__(nvfp4_dit::launch::kQuantizeThreads, 1)                         \
      nvfp4_dit_smoothing_basis_d##DP(const __grid_constant__ nvfp4_dit::QuantizeQkvParams p) {                \
    extern __shared__ __align__(16) unsigned char basis_smem[];                                                \
    nvfp4_dit::smoothing_basis_head<DP, nvfp4_dit::launch::kQuantizeThreads>(                                  \
        p, *reinterpret_cast<nvfp4_dit::BasisStorage<DP>*>(basis_smem), blockIdx.x);                           \
  }
NVFP4_DIT_BASIS_ENTRY(64)
NVFP4_DIT_BASIS_ENTRY(128)
