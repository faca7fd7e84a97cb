// The scale-selector rules both MMA back-ends enforce at compile time (PTX ISA Table 37): for
// kind::mxf4nvf4 scale_vec::4X thread-id-a in {0, 1}, thread-id-b in {0..3}, byte-id 0 (the
// back-ends pass byte-id 0 always); for kind::mxf8f6f4 scale_vec::1X the same and byte-id 0..3. ptxas checks them only when they are immediates, and values
// passed in registers were seen accepted silently, hence the static_asserts.
#pragma once

namespace nvfp4_dit {

template <int kTidA, int kTidB>
struct ScaleSelectors4X {
  static_assert(kTidA == 0 || kTidA == 1, "thread-id-a must be 0 or 1 for scale_vec::4X");
  static_assert(kTidB >= 0 && kTidB <= 3, "thread-id-b must be in 0..3");
  static constexpr bool kValid = true;
};

// kind::mxf8f6f4 scale_vec::1X: the same lanes, and byte-id 0..3 picks the byte of the register.
template <int kTidA, int kTidB, int kByteId>
struct ScaleSelectors1X {
  static_assert(kTidA == 0 || kTidA == 1, "thread-id-a must be 0 or 1");
  static_assert(kTidB >= 0 && kTidB <= 3, "thread-id-b must be in 0..3");
  static_assert(kByteId >= 0 && kByteId <= 3, "byte-id must be in 0..3 for scale_vec::1X");
  static constexpr bool kValid = true;
};

}  // namespace nvfp4_dit
