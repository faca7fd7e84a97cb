// The 3D token order of a video call (nvfp4_dit/token_order.py states the same rule in PyTorch).
//
// Positions [begin, end) of a sequence hold the tokens of a T x H x W video grid (raster order in
// the caller's tensors); every other position holds itself (text, audio). In tile order the video
// tokens are grouped into strips of tile_t frames x tile_h rows, strip after strip (t-block major),
// and inside a strip column after column (w), each column's tile_t x tile_h tokens t-major. So
// every 128 consecutive positions of a full strip are a tile_t x tile_h x (128 / (tile_t *
// tile_h)) box of the grid; edge strips (T or H not divisible) are thinner, and a 128-token tile
// may span the end of one strip and the start of the next. No position is padding: the tile-order
// sequence has the caller's length, and the kernels read and write through source_row().
//
// Plain data, shared by the host (ABI tests) and the kernels. Positions are int64; the video span
// is below 2^32 tokens (checked by the caller).
#pragma once

#include "common/portable.h"

namespace nvfp4_dit {

struct TokenOrder {
  int64_t begin;  // the video span [begin, end); end <= begin: the identity (no video order)
  int64_t end;
  int32_t t, h, w;        // the grid
  int32_t tile_t, tile_h; // a strip's frames and rows (tile_t <= t, tile_h <= h)
  int32_t reserved;       // keeps the struct a multiple of 8 bytes
};

NVFP4_DIT_HOST_DEVICE inline bool token_order_active(const TokenOrder& o) { return o.end > o.begin; }

// The caller's position of tile-order position s.
NVFP4_DIT_HOST_DEVICE inline int64_t source_row(const TokenOrder& o, int64_t s) {
  if (s < o.begin || s >= o.end) return s;
  uint32_t pos = uint32_t(s - o.begin);
  const uint32_t tt = uint32_t(o.tile_t), th = uint32_t(o.tile_h), w = uint32_t(o.w);
  const uint32_t slab = tt * uint32_t(o.h) * w;  // every t-block but the last is full
  const uint32_t bt = pos / slab;
  pos -= bt * slab;
  const uint32_t frames_left = uint32_t(o.t) - bt * tt, frames = frames_left < tt ? frames_left : tt;
  const uint32_t strip = frames * th * w;  // every strip of the t-block but the last is full
  const uint32_t bh = pos / strip;
  pos -= bh * strip;
  const uint32_t rows_left = uint32_t(o.h) - bh * th, rows = rows_left < th ? rows_left : th;
  const uint32_t column = frames * rows;
  const uint32_t x = pos / column;
  pos -= x * column;
  const uint32_t it = pos / rows, ih = pos - it * rows;
  return o.begin + (int64_t(bt * tt + it) * o.h + int64_t(bh * th + ih)) * o.w + x;
}

}  // namespace nvfp4_dit
