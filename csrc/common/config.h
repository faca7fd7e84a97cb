// What the CUDA core is built for: the head dims with a kernel instantiation and the GPU
// architectures of each MMA kind. The one C++ statement of these facts; nvfp4_dit/format.py
// (head dims) and nvfp4_dit/cuda/build.py (architectures) state them for Python, and
// tests/test_build.py compiles this header on the host and checks that both agree.
// Torch-free, host and device.
#pragma once

#include "common/portable.h"

namespace nvfp4_dit {

// Padded head dims the kernels are instantiated for. A head dim d runs at the smallest one that
// holds it (zero padding along D is exact); above the largest there is no kernel.
constexpr int kHeadDims[] = {64, 128};
constexpr int kNumHeadDims = sizeof(kHeadDims) / sizeof(kHeadDims[0]);
constexpr int kMaxHeadDim = kHeadDims[kNumHeadDims - 1];

// The padded head dim of head dim d, or 0 when there is none (d < 1 or d > kMaxHeadDim). Written
// without indexing kHeadDims so that device code can call it; the asserts tie the two together.
NVFP4_DIT_HOST_DEVICE constexpr int64_t padded_head_dim(int64_t d) { return d < 1 || d > 128 ? 0 : d <= 64 ? 64 : 128; }
static_assert(kNumHeadDims == 2 && padded_head_dim(1) == kHeadDims[0] && padded_head_dim(kHeadDims[0]) == kHeadDims[0] &&
                  padded_head_dim(kHeadDims[0] + 1) == kHeadDims[1] && padded_head_dim(kHeadDims[1]) == kHeadDims[1] &&
                  padded_head_dim(kMaxHeadDim + 1) == 0,
              "padded_head_dim follows kHeadDims");

// Compute capabilities (10 * major + minor) with the native block-scaled FP4 MMA (sm_120a,
// sm_121a); the emulated MMA (fp16 mma.sync from the same registers) covers [80, 90].
constexpr int kNativeCapabilities[] = {120, 121};
constexpr int kEmulatedMinCapability = 80;
constexpr int kEmulatedMaxCapability = 90;

}  // namespace nvfp4_dit

// Device passes that can issue each MMA kind. The native instruction exists only on the
// arch-specific targets (plain sm_120 rejects it); the emulated one needs fp16 mma.sync.
// NVRTC defines only __CUDA_ARCH_SPECIFIC__ (1200, 1210) for the arch-specific targets, nvcc both.
#if defined(__CUDA_ARCH__) &&                                                            \
    (defined(__CUDA_ARCH_FEAT_SM120_ALL) || defined(__CUDA_ARCH_FEAT_SM121_ALL) ||      \
     (defined(__CUDA_ARCH_SPECIFIC__) && (__CUDA_ARCH_SPECIFIC__ == 1200 || __CUDA_ARCH_SPECIFIC__ == 1210)))
#define NVFP4_DIT_NATIVE_MMA 1
#endif
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800 && __CUDA_ARCH__ < 1000
#define NVFP4_DIT_EMULATED_MMA 1
#endif
