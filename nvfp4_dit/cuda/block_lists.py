"""The block map of a block-sparse call and its lists, on the GPU (``csrc/quantize/block_lists.cu``).

The same map and lists as :func:`nvfp4_dit.sparse.lists_by_group` (the PyTorch twin, which the
``torch`` quantiser path and the reference use): per group of Q blocks, the pooled scores (one
batched matmul of the quantiser's block means) go to ``block_map_rows``, which estimates each Q
block's tiles in one warp, or one CTA past ``BLOCK_MAP_WARP_MAX_TILES`` tiles (softmax, the
threshold mass by bisection, the safeguards), and writes the map as bit words with its row counts;
a scan of the counts gives the CSR offsets, and ``block_list_rows`` writes the row lists and the
visiting order. A handful of launches per group instead of dozens of passes over the bool map, and
nothing waits for the GPU.
"""

from __future__ import annotations

from typing import Iterator, Optional

import torch

from .. import sparse as sp
from . import abi
from .launch import DeviceKernels

_MAP_ROWS, _MAP_ROWS_BY_WARP, _LIST_ROWS = abi.BLOCK_LISTS_ENTRIES


def supported(grid: sp.TileGrid) -> bool:
    """Whether the kernels take this call's rows (at most ``BLOCK_LISTS_MAX_TILES`` key tiles)."""
    return grid.nk <= abi.BLOCK_LISTS_MAX_TILES


def _strides_or_zero(t: torch.Tensor) -> list[int]:
    """Element strides, 0 along broadcast (size-1) dimensions."""
    return [0 if size == 1 else stride for size, stride in zip(t.shape, t.stride())]


def lists_by_group(dk: DeviceKernels, stats: Optional[sp.BlockStatistics], sparsity: sp.Sparsity,
                   grid: sp.TileGrid, stream: int,
                   with_map: bool = False) -> Iterator[tuple[tuple[int, int], Optional[torch.Tensor], sp.BlockLists]]:
    """Per group of Q blocks: ``((begin, end), rows_map, lists)`` as
    :func:`nvfp4_dit.sparse.lists_by_group` gives them, made by the kernels on ``stream``.
    ``rows_map`` (bool [B, H, rows, nk]) is written only ``with_map`` (else None). The list region
    past a group's entries is not written. ``stats`` is read when the map is estimated."""
    b, h, nq, nk = grid.batch, grid.heads, grid.nq, grid.nk
    if not supported(grid):
        raise ValueError(f"the block-list kernels take at most {abi.BLOCK_LISTS_MAX_TILES} key tiles, got {nk}")
    bh, words = b * h, -(-nk // 32)
    estimated = sparsity.estimated
    device = sp.map_device(stats, sparsity)
    i32 = dict(dtype=torch.int32, device=device)
    p = abi.BlockListsParams(
        scale=grid.scale, similarity_threshold=sp.SIMILARITY_THRESHOLD, causal=int(grid.causal),
        batch=b, heads=h, seq_k=grid.seq_k, num_q_blocks=nq, num_k_tiles=nk, words=words)
    # The tensors behind the parameters' addresses stay referenced by this frame while it launches.
    if estimated:
        weights = grid.tile_log_weights(device)
        similarity = stats.q_similarity.float().contiguous()
        p.log_weights, (p.log_weights_stride_b, p.log_weights_stride_h, _) = weights.data_ptr(), _strides_or_zero(weights)
        p.q_similarity, p.keep_mass = similarity.data_ptr(), sparsity.keep_mass
        if sparsity.always_keep is not None:
            p.always_keep_begin, p.always_keep_end = sparsity.always_keep
    if sparsity.block_mask is not None:
        mask = sparsity.block_mask if sparsity.block_mask.stride(-1) == 1 else sparsity.block_mask.contiguous()
        p.block_mask = mask.data_ptr()
        p.block_mask_stride_b, p.block_mask_stride_h, p.block_mask_stride_q, _ = _strides_or_zero(mask)
    if grid.kv_lens is not None:
        lens = grid.kv_lens.to(device=device, dtype=torch.int32).contiguous()
        p.kv_lens = lens.data_ptr()
    # A warp estimates a row of up to BLOCK_MAP_WARP_MAX_TILES tiles, a CTA a longer one.
    by_warp = nk <= abi.BLOCK_MAP_WARP_MAX_TILES
    rows_per_map_cta = abi.BLOCK_LISTS_THREADS // 32 if by_warp else 1
    map_rows, list_rows = (dk.kernel(name) for name in (_MAP_ROWS_BY_WARP if by_warp else _MAP_ROWS, _LIST_ROWS))
    for g0, g1 in sp.row_groups(nq, bh * nk):
        rows = g1 - g0
        sp.check_list_size(bh, rows, nk)
        scores = sp.pooled_scores(stats, g0, g1) if estimated else None
        bits = torch.empty(bh * rows, words, **i32)
        row_counts = torch.empty(bh * rows, **i32)
        word_prefix = torch.empty(bh * rows, words, **i32)
        rows_map = torch.empty(b, h, rows, nk, dtype=torch.bool, device=device) if with_map else None
        p.scores = None if scores is None else scores.data_ptr()
        p.block_begin, p.rows = g0, rows
        p.bits, p.row_counts, p.word_prefix = (t.data_ptr() for t in (bits, row_counts, word_prefix))
        p.row_map = None if rows_map is None else rows_map.data_ptr()
        map_rows.launch((-(-rows // rows_per_map_cta), bh), abi.BLOCK_LISTS_THREADS, [p], stream)

        offsets = sp.offsets_of(row_counts)
        tiles = torch.empty(bh * rows * nk, **i32)
        order = torch.empty(bh * rows, **i32)
        p.offsets, p.tiles, p.order = offsets.data_ptr(), tiles.data_ptr(), order.data_ptr()
        rows_per_cta = abi.BLOCK_LIST_ROWS_PER_CTA                 # a warp per map row (and its place in order)
        list_rows.launch((-(-rows // rows_per_cta), bh), 32 * rows_per_cta, [p], stream)
        yield (g0, g1), rows_map, sp.BlockLists(offsets=offsets, tiles=tiles, order=order)


def block_map(dk: DeviceKernels, stats: Optional[sp.BlockStatistics], sparsity: sp.Sparsity, grid: sp.TileGrid,
              stream: int) -> torch.Tensor:
    """The whole block map the kernels make for a call, bool [B, H, nq, nk] (for
    :func:`nvfp4_dit.sparse.estimate_block_mask`)."""
    return torch.cat([rows_map for _, rows_map, _ in lists_by_group(dk, stats, sparsity, grid, stream,
                                                                   with_map=True)], dim=2)
