// The two formats of the Q·Kᵀ operands (nvfp4_dit/format.py, QK_FORMATS); P·V is NVFP4 in both.
//
//   QkFormatNvfp4  e2m1 data (2 per byte), one ue4m3 scale per 16 elements; m16n8k64 MMAs
//            (kind::mxf4nvf4, scale_vec::4X): a scale register holds the 4 scales of one chunk.
//   QkFormatMxfp8  e4m3 data (1 per byte), one ue8m0 scale per 32 elements; m16n8k32 MMAs
//            (kind::mxf8f6f4, scale_vec::1X): a scale register holds the scales of 4 chunks and
//            the byte-id selector picks the chunk's byte.
//
// In both, one MMA chunk of a row is 32 bytes and the 8-bit fragment of an m16n8k32 is byte for
// byte the e2m1 fragment of an m16n8k64 (PTX fragment tables), so every data address of the kernel
// (Q loads, the K stage, ldmatrix) is the same function of the row's byte count. Only the row
// sizes, the scale words and the MMA differ; they are here.
#pragma once
#include "common/portable.h"

namespace nvfp4_dit {

// The MMA a Q·Kᵀ chunk uses, on back-end Backend (MmaNative or MmaEmulated): one signature for
// both formats, with the byte-id selector a template argument (0 for scale_vec::4X).
template <class Backend>
struct Nvfp4MmaOp {
  static constexpr bool kCompiledHere = Backend::kCompiledHere;
  static constexpr int kByteIds = 1;   // legal byte-id values
  template <int kTidA, int kTidB, int kByteId>
  static __device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                                             uint32_t sfa, uint32_t sfb) {
    static_assert(kByteId == 0, "scale_vec::4X reads the whole scale register: byte-id 0");
    Backend::template mma<kTidA, kTidB>(d, a, b, sfa, sfb);
  }
};

template <class Backend>
struct Mxfp8MmaOp {
  static constexpr bool kCompiledHere = Backend::kCompiledHere;
  static constexpr int kByteIds = 4;
  template <int kTidA, int kTidB, int kByteId>
  static __device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                                             uint32_t sfa, uint32_t sfb) {
    Backend::template mma_mxfp8<kTidA, kTidB, kByteId>(d, a, b, sfa, sfb);
  }
};

struct QkFormatNvfp4 {
  static constexpr const char* kName = "nvfp4";
  static constexpr int kFormatIndex = 0;   // position in QK_FORMATS (and common/launch.h tables)
  static constexpr int kBits = 4;          // bits per element
  static constexpr int kChunkElems = 64;   // elements of D per MMA (32 bytes)
  template <int kHeadDim>
  static constexpr int kRowBytes = kHeadDim / 2;
  template <int kHeadDim>
  static constexpr int kSfRowBytes = kHeadDim / 16;
  // The scale word of chunk kc in a row's scale bytes, and the byte-id of the chunk in it.
  __host__ __device__ static constexpr int sf_word(int kc) { return kc; }
  __host__ __device__ static constexpr int byte_id(int) { return 0; }
  template <class Backend>
  using Mma = Nvfp4MmaOp<Backend>;
};

struct QkFormatMxfp8 {
  static constexpr const char* kName = "mxfp8";
  static constexpr int kFormatIndex = 1;
  static constexpr int kBits = 8;
  static constexpr int kChunkElems = 32;
  template <int kHeadDim>
  static constexpr int kRowBytes = kHeadDim;
  template <int kHeadDim>
  static constexpr int kSfRowBytes = kHeadDim / 32;
  __host__ __device__ static constexpr int sf_word(int kc) { return kc / 4; }
  __host__ __device__ static constexpr int byte_id(int kc) { return kc % 4; }
  template <class Backend>
  using Mma = Mxfp8MmaOp<Backend>;
};

// A row's scale word w: 4 bytes, or the 2 bytes of a D=64 MXFP8 row (which a 4-byte load could
// not read aligned); the bytes past the row are never selected.
template <int kSfRowBytes>
__device__ __forceinline__ uint32_t load_sf_word(const uint8_t* row, int w) {
  if constexpr (kSfRowBytes >= 4) {
    return *reinterpret_cast<const uint32_t*>(row + 4 * w);
  } else {
    static_assert(kSfRowBytes == 2, "scale rows are 2, 4 or 8 bytes");
    return *reinterpret_cast<const uint16_t*>(row);
  }
}

}  // namespace nvfp4_dit
