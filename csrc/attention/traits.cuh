// Tile geometry and shared-memory layout of the attention kernel, as constexpr.
// Sized for sm_120's ~99 KB per block so the emulated build on sm_80/90 runs the same layouts.
#pragma once
#include "common/portable.h"

#include "attention/qk_format.cuh"
#include "common/config.h"

namespace nvfp4_dit {

template <int kHeadDim_, class QkFmt_ = QkFormatNvfp4>
struct AttentionTraits {
  using QkFmt = QkFmt_;
  static constexpr int kHeadDim = kHeadDim_;
  static_assert(padded_head_dim(kHeadDim) == kHeadDim, "kHeadDim must be one of kHeadDims (common/config.h)");
  static constexpr int kBlockM = 128;       // Q rows per tile
  static constexpr int kBlockN = 128;       // keys per tile
  static constexpr int kWarps = 8;          // every warp owns 16 Q rows
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kKChunks = kHeadDim / QkFmt::kChunkElems;   // MMA chunks of D in Q·Kᵀ
  static constexpr int kNTilesS = kBlockN / 8;     // n8 tiles of the score tile (16)
  static constexpr int kNTilesO = kHeadDim / 8;    // n8 tiles of the output (8 or 16)

  // Bytes of one K row (D/2 or D) and one V^T row (128 tokens / 2).
  static constexpr int kKRowBytes = QkFmt::template kRowBytes<kHeadDim>;
  static constexpr int kVRowBytes = kBlockN / 2;
  static constexpr int kKSfRowBytes = QkFmt::template kSfRowBytes<kHeadDim>;
  static constexpr int kVSfRowBytes = kBlockN / 16;

  static constexpr int kKBytes = kBlockN * kKRowBytes;
  static constexpr int kKSfBytes = kBlockN * kKSfRowBytes;
  static constexpr int kVBytes = kHeadDim * kVRowBytes;
  static constexpr int kVSfBytes = kHeadDim * kVSfRowBytes;
  // The key projections of the tile after this stage's (the corrections are formed one tile ahead):
  // 128 x kProjColumns fp16, then their fp32 factor (padded to 128 bytes).
  static constexpr int kProjColumns = 16;
  static constexpr int kProjBytes = kBlockN * kProjColumns * 2 + 128;

  static constexpr int kOffK = 0;
  static constexpr int kOffV = kOffK + kKBytes;
  static constexpr int kOffKSf = kOffV + kVBytes;
  static constexpr int kOffVSf = kOffKSf + kKSfBytes;
  static constexpr int kOffProj = kOffVSf + kVSfBytes;
  static constexpr int kOffProjFactor = kOffProj + kBlockN * kProjColumns * 2;
  static constexpr int kStageBytes = kOffProj + kProjBytes;
  // cp.async stages: 2 tiles ahead + current + previous (its PV), or 1 ahead where 4 stages do
  // not fit sm_120's 99 KB per block (8-bit K at D=128).
  static constexpr int kStages = 4 * kStageBytes <= 99 * 1024 ? 4 : 3;
  static constexpr int kSmemBytes = kStages * kStageBytes;
  static_assert(kStageBytes % 128 == 0, "stages stay 128-byte aligned");
  static_assert(kSmemBytes <= 99 * 1024, "must fit sm_120's per-block shared memory");

  // 16-byte chunk swizzle for ldmatrix: 8 consecutive rows of one chunk column land in 8
  // distinct bank groups. rows_per_line = rows sharing a 128-byte line.
  template <int kRowBytes>
  __host__ __device__ static constexpr int swizzle(int row, int chunk) {
    constexpr int kChunksPerRow = kRowBytes / 16;
    constexpr int kRowsPerLine = 128 / kRowBytes;
    return row * kRowBytes + ((chunk ^ ((row / kRowsPerLine) % kChunksPerRow)) << 4);
  }
};

}  // namespace nvfp4_dit
