// The little the kernels take from the C++ standard library, for nvcc and NVRTC alike: NVRTC
// (the run-time compiler) has no standard headers, so under it the fixed-width integers and the
// float limits are spelled out here. Host code (tests, the ABI probe) gets the real headers.
#pragma once

#if defined(__CUDACC_RTC__)
using int8_t = signed char;
using uint8_t = unsigned char;
using int16_t = short;
using uint16_t = unsigned short;
using int32_t = int;
using uint32_t = unsigned int;
using int64_t = long long;
using uint64_t = unsigned long long;
using uintptr_t = unsigned long long;
#ifndef FLT_MAX
#define FLT_MAX 3.402823466e+38F
#endif
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif
#else
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#endif

// Functions shared by device code and host code (tests compile some headers with the host compiler).
#if defined(__CUDACC__)
#define NVFP4_DIT_HOST_DEVICE __host__ __device__
#else
#define NVFP4_DIT_HOST_DEVICE
#endif

namespace nvfp4_dit {

// std::conditional, which NVRTC lacks.
template <bool kFirst, class A, class B>
struct Select {
  using type = A;
};
template <class A, class B>
struct Select<false, A, B> {
  using type = B;
};

}  // namespace nvfp4_dit
