// ldmatrix.x4 for the attention kernel.
#pragma once
#include "common/portable.h"

namespace nvfp4_dit {
namespace detail {

// ldmatrix.x4 of 8x16-byte rows: lane L gets 4 bytes at row L/4, byte 4*(L%4) of each matrix,
// which is exactly an 8-bit m16n8k32 fragment, and so an e2m1 m16n8k64 fragment.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t smem_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr));
}

}  // namespace detail
}  // namespace nvfp4_dit
