"""The 3D token order of a video call: its 128-token tiles are compact boxes of the latent grid.

Video DiTs flatten their latent tokens in (t, h, w) raster order, so a 128-token block is a strip
of one or two rows of one frame and a query's space-time neighbours spread over many key tiles.
With ``video_grid=(T, H, W)`` (and ``video_tokens=(start, end)``, the video's span in a joint
sequence) :func:`nvfp4_dit.attention` quantises and attends the video tokens in **tile order**:

* the span is cut into strips of ``tile_t`` frames x ``tile_h`` rows (``tile_t = min(2, T)``,
  ``tile_h = min(8, H)``), strip after strip (t-block major, then h-block);
* inside a strip the tokens go column after column (w), each column's ``tile_t x tile_h`` tokens
  t-major.

So each 128 consecutive tokens of a full strip are a ``2 x 8 x 8`` box (``1 x 8 x 16`` for a single
frame). Where T or H does not divide, the edge strips are thinner and a tile may span the end of
one strip and the start of the next; no position is padding, so the tile-order sequence has the
caller's length and the format's partial-tile rules apply only to the sequence's last tile, as
for any call. Tokens outside the span (text, audio) keep their positions.

Every back-end computes exactly "permute, attend, un-permute": the block map, ``block_mask`` and
:func:`nvfp4_dit.sparse.estimate_block_mask` index tiles in tile order; ``kv_lens``, ``attn_mask``
and ``always_keep`` stay in the caller's order (the op carries the masks over); the output and the
LSE come back in the caller's order. The CUDA kernels read and write through the order
(``csrc/common/token_order.h``), with no permuted copy of Q, K, V or O; the reference and the exact
fallback gather in PyTorch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["TokenOrder", "check_token_order", "keys_in_tile_order"]

TILE_FRAMES = 2
"""Frames of a strip (fewer for a shorter video)."""
TILE_ROWS = 8
"""Latent rows of a strip (fewer for a shorter latent)."""


@dataclass(frozen=True)
class TokenOrder:
    """The tile order of the video tokens ``[start, end)`` of a ``(T, H, W)`` grid (module doc)."""

    grid: tuple[int, int, int]
    span: tuple[int, int]

    @property
    def tile(self) -> tuple[int, int]:
        """``(tile_t, tile_h)``: a strip's frames and rows."""
        return min(TILE_FRAMES, self.grid[0]), min(TILE_ROWS, self.grid[1])

    def source_rows(self, seq_len: int, device=None) -> torch.Tensor:
        """int64 ``[seq_len]``: the caller's position of each tile-order position (the kernels'
        ``source_row``), so ``x[:, order.source_rows(S)]`` is ``x`` [B, S, ...] in tile order."""
        start, end = self.span
        t, h, w = self.grid
        tt, th = self.tile
        pos = torch.arange(end - start, device=device, dtype=torch.int64)
        slab = tt * h * w
        bt, pos = pos // slab, pos % slab
        frames = (t - bt * tt).clamp(max=tt)
        strip = frames * th * w
        bh, pos = pos // strip, pos % strip
        rows = (h - bh * th).clamp(max=th)
        column = frames * rows
        x, pos = pos // column, pos % column
        it, ih = pos // rows, pos % rows
        video = start + ((bt * tt + it) * h + bh * th + ih) * w + x
        all_rows = torch.arange(seq_len, device=device, dtype=torch.int64)
        all_rows[start:end] = video
        return all_rows


def check_token_order(video_grid, video_tokens, *, seq_q: int, seq_k: int, causal: bool) -> Optional[TokenOrder]:
    """The checked :class:`TokenOrder` of a call, or None without ``video_grid``. Raises TypeError
    for a wrong type and ValueError for a wrong value, naming the argument."""
    if video_grid is None:
        if video_tokens is not None:
            raise ValueError("video_tokens needs video_grid (the (T, H, W) grid of those tokens)")
        return None
    if (not isinstance(video_grid, (tuple, list)) or len(video_grid) != 3
            or any(isinstance(n, bool) or not isinstance(n, int) for n in video_grid)):
        raise TypeError(f"video_grid must be three ints (T, H, W), got {video_grid!r}")
    if min(video_grid) <= 0:
        raise ValueError(f"video_grid must be three positive ints (T, H, W), got {tuple(video_grid)}")
    grid = tuple(int(n) for n in video_grid)
    count = math.prod(grid)
    if seq_q != seq_k:
        raise ValueError(f"video_grid orders the tokens of self-attention: q and k must have the same length, "
                         f"got {seq_q} and {seq_k}")
    if causal:
        raise ValueError("video_grid cannot be combined with causal=True (tile order has no causal meaning)")
    if video_tokens is None:
        if count != seq_q:
            raise ValueError(f"video_grid {grid} holds {count} tokens but the sequence has {seq_q}: give "
                             f"video_tokens=(start, end), the video's span")
        span = (0, count)
    else:
        if (not isinstance(video_tokens, (tuple, list)) or len(video_tokens) != 2
                or any(isinstance(n, bool) or not isinstance(n, int) for n in video_tokens)):
            raise TypeError(f"video_tokens must be a (start, end) pair of ints, got {video_tokens!r}")
        span = (int(video_tokens[0]), int(video_tokens[1]))
        if not (0 <= span[0] < span[1] <= seq_q):
            raise ValueError(f"video_tokens must be a range with 0 <= start < end <= {seq_q}, got {span}")
        if span[1] - span[0] != count:
            raise ValueError(f"video_tokens {span} spans {span[1] - span[0]} tokens but video_grid {grid} holds {count}")
    if count >= 1 << 31:
        raise ValueError(f"video_grid {grid} holds {count} tokens, more than the kernels address (2^31 - 1)")
    return TokenOrder(grid, span)


def keys_in_tile_order(order: TokenOrder, kv_lens: Optional[torch.Tensor], key_bias: Optional[torch.Tensor],
                       seq_k: int, rows: Optional[torch.Tensor] = None
                       ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """A call's ``kv_lens`` [B] and per-key ``key_bias`` [B, H or 1, Sk] (fp32) carried into tile
    order, on the device without a host sync. A length outside the video span is a prefix in both
    orders; one inside it is not, so such a batch attends the whole span by length and its hidden
    video keys get a -inf bias: they are never attended but, like the keys of any per-key mask,
    enter the FP4 quantiser's statistics (the integrations' padding is text, outside the span).
    ``rows``: ``order.source_rows(seq_k)`` on the masks' device, where the caller has it already."""
    if kv_lens is None and key_bias is None:
        return None, None
    device = (kv_lens if kv_lens is not None else key_bias).device
    if rows is None:
        rows = order.source_rows(seq_k, device)
    if key_bias is not None:
        key_bias = key_bias.index_select(-1, rows)
    if kv_lens is not None:
        start, end = order.span
        cut = (kv_lens > start) & (kv_lens < end)
        hidden = cut[:, None] & (rows[None, :] >= kv_lens[:, None])
        cut_bias = torch.zeros(hidden.shape, dtype=torch.float32, device=device).masked_fill(hidden, -math.inf)
        key_bias = cut_bias[:, None, :] if key_bias is None else key_bias + cut_bias[:, None, :]
        kv_lens = torch.where(cut, torch.full_like(kv_lens, end), kv_lens)
    return kv_lens, key_bias
