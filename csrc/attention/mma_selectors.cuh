// The scale-selector rules both MMA back-ends enforce at compile time (PTX ISA Table 37 for
// kind::mxf4nvf4 scale_vec::4X): thread-id-a in {0, 1}, thread-id-b in {0..3}, byte-id 0 (the
// back-ends pass byte-id 0 always). ptxas checks them only when they are immediates, and values
// passed in registers were seen accepted silently, hence the static_asserts.
#pragma once

namespace nvfp4_dit {

template <int kTidA, int kTidB>
struct ScaleSelectors4X {
  static_assert(kTidA == 0 || kTidA == 1, "thread-id-a must be 0 or 1 for scale_vec::4X");
  static_assert(kTidB >= 0 && kTidB <= 3, "thread-id-b must be in 0..3");
  static constexpr bool kValid = true;
};

}  // namespace nvfp4_dit
