"""Block-sparse attention: the block map of a call, its per-call estimate, and the lists the kernels read.

A **block map** is bool ``[B, H, nq, nk]`` over 128-row Q blocks and 128-key tiles (``nq =
ceil(Sq/128)``, ``nk = ceil(Sk/128)``): True = the Q block attends the keys of that tile. A skipped
tile contributes nothing (the LSE covers the visited keys only); a Q block that visits no tile
gives output 0 and LSE -inf, like a row with no visible key. Every back-end honours the same map:
the kernel visits only the listed tiles, the reference masks the others, and the exact fallback
attends exactly the listed keys.

A call gets its map (:class:`Sparsity`) from

* ``block_mask``: the caller's map, bool ``[B or 1, H or 1, nq, nk]``;
* ``keep_mass``: **the estimate**, made in every call from the quantiser's block statistics (nothing
  is cached between calls or denoising steps). For each Q block ``i`` and key tile ``j`` the pooled
  score ``scale * mean(q_i) . mean(k_j) / sqrt(s_i) + log(w_j)`` (``s_i``: the block's mean pairwise
  cosine, below; the mean of rows that share a direction only that far is shorter than they are by
  ``sqrt(s_i)``, and the division restores the rows' logit spread. ``w_j``: the tile's visible key
  weight, its count of valid keys or the sum of ``exp(bias)`` under a key mask) goes through a softmax over the
  allowed tiles; the block keeps the fewest tiles, by descending estimated mass (ties to the lower
  tile index), whose mass reaches ``keep_mass``. ``keep_mass=1.0`` keeps every allowed tile.
  Safeguards: a Q block whose rows point in unrelated directions (mean pairwise cosine below
  :data:`SIMILARITY_THRESHOLD`: its mean is no stand-in for its rows) keeps every tile; the
  "diagonal" tile (the key tile holding the block's own token indices, where it exists) is kept;
  ``always_keep=(start, end)`` keeps the tiles of a key range (text tokens, sinks).
  With both ``block_mask`` and ``keep_mass`` the estimate chooses within the given map.

Tiles that causality or ``kv_lens`` hide entirely are never listed (the estimated mass excludes
those keys). On the GPU the statistics come from the quantiser (``q_mean``, ``k_tile_mean``,
``q_similarity``: :mod:`nvfp4_dit.format`), so the estimate reads no input again; the reference and
exact paths compute the same statistics in PyTorch.

**The lists.** The kernel reads the map as CSR rows (per Q block an offset into a list of ascending
tile indices) and a visiting order (each head's rows longest first); :func:`build_lists` makes them
on the device for a group of Q blocks (:func:`row_groups` bounds a group's map), sized for the worst
case (every tile), so a sparse call never waits for the GPU and stays capturable in a CUDA graph. On the GPU the block-list kernels
(:mod:`nvfp4_dit.cuda.block_lists`) make the same map and lists in a few launches; the functions
here are their PyTorch twin, which the reference, the ``torch`` quantiser path and the tests use.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from . import format as fmt
from . import preprocess
from .checks import check_keep_mass

SIMILARITY_THRESHOLD = 0.02
"""A Q block whose mean pairwise cosine is below this keeps every tile. Measured on 128-row blocks
at D = 128 (docs/measurements.md): independent random rows give |s| <= 0.004; RoPE'd video tokens
in raster order (scripts/video_inputs.py) 0.07 to 0.37; real DiT queries, whose channels share a
bias, more."""

WORK_ELEMENTS = 1 << 23
"""Map elements (Q blocks x key tiles x heads) handled at once by the estimate and the list
builder: bounds their temporaries to a few hundred MB at any length."""


@dataclass(frozen=True)
class Sparsity:
    """How a call chooses its block map (checked by :func:`check_sparsity`)."""

    block_mask: Optional[torch.Tensor] = None   # bool [B or 1, H or 1, nq, nk]
    keep_mass: Optional[float] = None            # (0, 1]
    always_keep: Optional[tuple[int, int]] = None   # key range [start, end), with keep_mass

    @property
    def estimated(self) -> bool:
        return self.keep_mass is not None and self.keep_mass < 1.0


def num_blocks(seq: int) -> int:
    """128-token blocks of a sequence (one for an empty one, as the padded layouts have)."""
    return fmt.round_up(max(seq, 1), fmt.SEQ_TILE) // fmt.SEQ_TILE


def check_sparsity(block_mask, keep_mass, always_keep, *, batch: int, heads: int, seq_q: int, seq_k: int,
                   device: torch.device) -> Optional[Sparsity]:
    """The checked :class:`Sparsity` of a call, or None for dense attention (no map, or
    ``keep_mass=1.0`` alone). Raises TypeError for a wrong type or dtype and ValueError for a wrong
    shape, device or value, naming the argument."""
    keep_mass = check_keep_mass(keep_mass)
    if block_mask is not None:
        if not isinstance(block_mask, torch.Tensor):
            raise TypeError(f"block_mask must be a torch.Tensor, got {type(block_mask).__name__}")
        if block_mask.dtype != torch.bool:
            raise TypeError(f"block_mask must be a bool tensor (True = visit the tile), got {block_mask.dtype}")
        nq, nk = num_blocks(seq_q), num_blocks(seq_k)
        shape = tuple(block_mask.shape)
        if len(shape) != 4 or shape[0] not in (1, batch) or shape[1] not in (1, heads) or shape[2:] != (nq, nk):
            raise ValueError(f"block_mask must have shape [B or 1, H or 1, ceil(Sq/128), ceil(Sk/128)] = "
                             f"[{batch} or 1, {heads} or 1, {nq}, {nk}], got {list(shape)}")
        if block_mask.device != device:
            raise ValueError(f"block_mask is on {block_mask.device} but q is on {device}")
    if always_keep is not None:
        if keep_mass is None:
            raise ValueError("always_keep applies to the estimated map: give keep_mass with it")
        if (not isinstance(always_keep, (tuple, list)) or len(always_keep) != 2
                or any(isinstance(x, bool) or not isinstance(x, int) for x in always_keep)):
            raise TypeError(f"always_keep must be a (start, end) pair of ints, got {always_keep!r}")
        start, end = always_keep
        if not (0 <= start < end <= seq_k):
            raise ValueError(f"always_keep must be a key range with 0 <= start < end <= {seq_k}, got {always_keep}")
        always_keep = (start, end)
    if block_mask is None and (keep_mass is None or keep_mass == 1.0):
        return None   # keep_mass=1.0 alone keeps every tile: dense attention
    return Sparsity(block_mask=block_mask, keep_mass=keep_mass, always_keep=always_keep)


@dataclass(frozen=True)
class VideoTokens:
    """The video tokens of a transformer forward, as an integration learns them from the model's
    input in every forward (nothing is kept across forwards): the latent token grid ``(T, H, W)``
    and where the video sits in a joint sequence with other tokens (text, audio): ``"first"``
    (HunyuanVideo, Mochi: video then text) or ``"last"`` (CogVideoX: text then video)."""

    grid: tuple[int, int, int]
    position: str = "first"

    def __post_init__(self):
        if (len(self.grid) != 3 or any(isinstance(n, bool) or not isinstance(n, int) or n <= 0 for n in self.grid)):
            raise ValueError(f"grid must be three positive ints (T, H, W), got {self.grid!r}")
        if self.position not in ("first", "last"):
            raise ValueError(f"position must be 'first' or 'last', got {self.position!r}")

    @classmethod
    def of_latent(cls, dims, patch, position: str = "first") -> Optional["VideoTokens"]:
        """The tokens of a latent of ``dims`` (T, H, W) cut into patches of ``patch`` (pt, ph, pw),
        or None where that makes no grid (an unreadable patch size, or one past the latent)."""
        try:
            dims, patch = tuple(int(n) for n in dims), tuple(int(n) for n in patch)
        except (TypeError, ValueError):
            return None
        if len(dims) != 3 or len(patch) != 3 or min(patch) <= 0:
            return None
        grid = tuple(n // p for n, p in zip(dims, patch))
        return cls(grid, position) if min(grid) > 0 else None

    @property
    def count(self) -> int:
        t, h, w = self.grid
        return t * h * w

    def span(self, seq_len: int) -> Optional[tuple[int, int]]:
        """``(start, end)`` of the video tokens in an attention call's sequence of ``seq_len``
        tokens, or None where that sequence does not hold the whole video (cross-attention keys, a
        context-parallel shard)."""
        n = self.count
        if seq_len < n:
            return None
        return (0, n) if self.position == "first" else (seq_len - n, seq_len)

    def order(self, seq_q: int, seq_k: int, causal: bool = False):
        """The 3D tile order (:class:`nvfp4_dit.token_order.TokenOrder`) of a self-attention call
        over these tokens, or None for other calls (cross-attention, causal, a shard without the
        video)."""
        from .token_order import TokenOrder

        span = self.span(seq_k)
        return None if span is None or seq_q != seq_k or causal else TokenOrder(self.grid, span)

    def other_keys(self, seq_len: int) -> Optional[tuple[int, int]]:
        """The keys that are not video (text, audio) as one ``(start, end)`` range, to be kept by
        a block-sparse call's estimate (``always_keep``); None where every key is video or the
        sequence does not hold the video."""
        span = self.span(seq_len)
        if span is None or span == (0, seq_len):
            return None
        return (span[1], seq_len) if span[0] == 0 else (0, span[0])


@dataclass(frozen=True)
class BlockStatistics:
    """What the estimate reads: ``q_mean`` [B, H, nq, D'] and ``k_tile_mean`` [B, Hkv, nk, D'] (raw
    means, D' the head dim or its padding), ``q_similarity`` [B, H, nq]."""

    q_mean: torch.Tensor
    k_tile_mean: torch.Tensor
    q_similarity: torch.Tensor

    @classmethod
    def of(cls, qq: fmt.QuantizedQKV) -> "BlockStatistics":
        """The statistics a quantiser wrote (the CUDA quantiser's or :func:`nvfp4_dit.preprocess.quantize_qkv`'s)."""
        return cls(qq.q_mean, qq.k_tile_mean, qq.q_similarity)

    @classmethod
    def of_inputs(cls, qh: torch.Tensor, kh: torch.Tensor, kv_lens: Optional[torch.Tensor]) -> "BlockStatistics":
        """The same statistics from [B, H, S, D] inputs, in PyTorch (the exact path's)."""
        return cls(preprocess.q_block_means(qh), preprocess.k_tile_means(kh, kv_lens),
                   preprocess.q_block_similarity(qh))


@dataclass(frozen=True)
class TileGrid:
    """The tiles of one call and what hides keys from them: ``kv_lens`` int [B] on the device (or
    None), ``key_bias`` fp32 [B, H or 1, Sk] (a per-key mask, :class:`nvfp4_dit.masks.KeyMask`) or
    None, ``causal`` (query i sees keys j <= i)."""

    batch: int
    heads: int
    seq_q: int
    seq_k: int
    scale: float
    causal: bool = False
    kv_lens: Optional[torch.Tensor] = None
    key_bias: Optional[torch.Tensor] = None

    @property
    def nq(self) -> int:
        return num_blocks(self.seq_q)

    @property
    def nk(self) -> int:
        return num_blocks(self.seq_k)

    def allowed(self, i0: int, i1: int, device) -> torch.Tensor:
        """bool [B, 1, i1 - i0, nk]: the tiles of Q blocks [i0, i1) that hold a visible key."""
        tiles = torch.arange(self.nk, device=device)
        if self.kv_lens is None:
            has_key = torch.full((self.batch, self.nk), self.seq_k > 0, dtype=torch.bool, device=device)
        else:
            lens = self.kv_lens.to(device).long().clamp(0, self.seq_k)
            has_key = tiles[None, :] * fmt.SEQ_TILE < lens[:, None]
        allowed = has_key[:, None, None, :].expand(self.batch, 1, i1 - i0, self.nk)
        if self.causal:
            blocks = torch.arange(i0, i1, device=device)
            allowed = allowed & (tiles[None, :] <= blocks[:, None])
        return allowed

    def tile_log_weights(self, device) -> torch.Tensor:
        """fp32 [B, H or 1, nk]: log of each tile's visible key weight (-inf for none)."""
        nk, sk = self.nk, self.seq_k
        valid = fmt.valid_key_mask(self.kv_lens, self.batch, sk, device)
        if self.key_bias is None:
            count = fmt.pad_dim(valid, 1, nk * fmt.SEQ_TILE).view(self.batch, nk, fmt.SEQ_TILE).sum(-1)
            return count.float().log()[:, None, :]
        bias = torch.where(valid[:, None, :], self.key_bias.to(device, torch.float32), -math.inf)
        bias = fmt.pad_dim(bias, 2, nk * fmt.SEQ_TILE, -math.inf)
        return bias.unflatten(2, (nk, fmt.SEQ_TILE)).logsumexp(-1)


def _kept_by_mass(scores: torch.Tensor, keep_mass: float) -> torch.Tensor:
    """bool like ``scores`` (-inf: not a candidate): per row, the fewest entries by descending
    softmax mass (stable: ties to the lower index) whose mass reaches ``keep_mass``."""
    p = torch.softmax(scores, dim=-1).nan_to_num_(0.0)   # a row without candidates: all 0
    ranked, order = torch.sort(p, dim=-1, descending=True, stable=True)
    before = ranked.cumsum(-1) - ranked
    return torch.zeros_like(p, dtype=torch.bool).scatter_(-1, order, (before < keep_mass) & (ranked > 0))


def pooled_scores(stats: BlockStatistics, i0: int, i1: int) -> torch.Tensor:
    """fp32 [B, H, i1 - i0, nk] (contiguous): ``mean(q_i) . mean(k_j)`` for Q blocks [i0, i1), each
    query head against its kv head's tiles."""
    qm, km = stats.q_mean, stats.k_tile_mean
    b, h, rows = qm.shape[0], qm.shape[1], i1 - i0
    hkv, nk, d = km.shape[1], km.shape[2], min(qm.shape[-1], km.shape[-1])
    q_rows = qm[:, :, i0:i1, :d].float().reshape(b, hkv, (h // hkv) * rows, d)
    return torch.matmul(q_rows, km[..., :d].float().transpose(-1, -2)).view(b, h, rows, nk)


def map_device(stats: Optional[BlockStatistics], sparsity: Sparsity, device=None) -> torch.device:
    """Where a call's block map is made: on its statistics' device, else its block mask's, else
    ``device`` (a map of every allowed tile needs neither)."""
    if stats is not None:
        return stats.q_mean.device
    if sparsity.block_mask is not None:
        return sparsity.block_mask.device
    if device is None:
        raise ValueError("a block map needs the block statistics, a block_mask or a device")
    return torch.device(device)


def map_rows(stats: Optional[BlockStatistics], sparsity: Sparsity, grid: TileGrid, i0: int, i1: int,
             log_weights: Optional[torch.Tensor] = None, device=None) -> torch.Tensor:
    """The block map of Q blocks [i0, i1): bool [B, H, i1 - i0, nk] (contiguous).

    ``stats`` is read only when the map is estimated (``keep_mass < 1``); ``log_weights`` is
    :meth:`TileGrid.tile_log_weights`, passed in when several row ranges share it."""
    b, h, nk, rows = grid.batch, grid.heads, grid.nk, i1 - i0
    device = map_device(stats, sparsity, device)
    allowed = grid.allowed(i0, i1, device)
    if sparsity.block_mask is not None:
        allowed = allowed & sparsity.block_mask[:, :, i0:i1]
    allowed = allowed.expand(b, h, rows, nk)
    if not sparsity.estimated:
        return allowed.contiguous()
    scores = pooled_scores(stats, i0, i1) * grid.scale
    # A block's mean is shorter than its rows by sqrt(similarity) (RoPE turns neighbours apart):
    # scaled back to the rows' length, its scores regain the rows' spread.
    scores = scores * stats.q_similarity[:, :, i0:i1, None].clamp_min(SIMILARITY_THRESHOLD).rsqrt()
    if log_weights is None:
        log_weights = grid.tile_log_weights(device)
    allowed = allowed & (log_weights[:, :, None, :] > -math.inf)   # a key mask may hide whole tiles
    scores = torch.where(allowed, scores + log_weights[:, :, None, :], -math.inf)
    keep = _kept_by_mass(scores, sparsity.keep_mass)
    # The safeguards: unreliable blocks keep everything; the diagonal and the always-kept keys stay.
    keep |= (stats.q_similarity[:, :, i0:i1] < SIMILARITY_THRESHOLD)[..., None]
    tiles = torch.arange(nk, device=device)
    keep |= (tiles[None, :] == torch.arange(i0, i1, device=device)[:, None])
    if sparsity.always_keep is not None:
        start, end = sparsity.always_keep
        keep |= (tiles * fmt.SEQ_TILE < end) & ((tiles + 1) * fmt.SEQ_TILE > start)
    return keep & allowed


def row_groups(num_q_blocks: int, elements_per_row: int, budget: Optional[int] = None) -> list[tuple[int, int]]:
    """Split Q blocks into ``(begin, end)`` groups whose map has at most ``budget`` elements
    (default :data:`WORK_ELEMENTS`; one block at least)."""
    per = max(1, (WORK_ELEMENTS if budget is None else budget) // max(elements_per_row, 1))
    return [(i, min(i + per, num_q_blocks)) for i in range(0, num_q_blocks, per)]


def block_map(stats: Optional[BlockStatistics], sparsity: Sparsity, grid: TileGrid, device=None) -> torch.Tensor:
    """The whole block map of a call, bool [B, H, nq, nk], estimated in bounded groups of rows
    (``device``: where, if neither statistics nor a block mask say, :func:`map_device`)."""
    device = map_device(stats, sparsity, device)
    weights = grid.tile_log_weights(device) if sparsity.estimated else None
    parts = [map_rows(stats, sparsity, grid, i0, i1, weights, device)
             for i0, i1 in row_groups(grid.nq, grid.batch * grid.heads * grid.nk)]
    return torch.cat(parts, dim=2)


# ---------------------------------------------------------------------------------------------
# The lists the kernels read
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class BlockLists:
    """The block map of a group of ``rows`` consecutive Q blocks as int32 device lists: row ``bh *
    rows + g`` is Q block g of the group for (batch, head) bh."""

    offsets: torch.Tensor  # [BH * rows + 1] CSR row offsets
    tiles: torch.Tensor    # [BH * rows * nk] the entries' tile indices, ascending within a row
    order: torch.Tensor    # [BH * rows]: the rows in visiting order, each head's longest first


def offsets_of(counts: torch.Tensor) -> torch.Tensor:
    """int32 [n + 1]: the exclusive cumulative sums of ``counts`` and their total."""
    out = torch.zeros(counts.numel() + 1, dtype=torch.int32, device=counts.device)
    torch.cumsum(counts.flatten(), 0, dtype=torch.int32, out=out[1:])
    return out


def visiting_order(counts: torch.Tensor, nk: int) -> torch.Tensor:
    """int32 [BH * rows]: the kernel's visiting order of the rows from their tile ``counts`` [BH,
    rows]: each head's rows, longest first (ties by Q block)."""
    bh, rows = counts.shape
    key = torch.arange(bh, device=counts.device)[:, None] * (nk + 1) + (nk - counts)
    return torch.argsort(key.flatten(), stable=True).to(torch.int32)


def check_list_size(bh: int, rows: int, nk: int) -> None:
    """The lists of a group of ``rows`` Q blocks are int32: ValueError past their range."""
    if bh * rows * nk >= 2**31:
        raise ValueError(f"a block map of {bh * rows * nk} elements exceeds int32 lists")


def build_lists(rows_map: torch.Tensor) -> BlockLists:
    """The lists of a block map ``rows_map`` bool [B, H, rows, nk]. Device ops only, sized for the
    worst case (every tile): no host sync."""
    b, h, rows, nk = rows_map.shape
    bh = b * h
    check_list_size(bh, rows, nk)
    flat = rows_map.reshape(bh * rows, nk)
    counts = flat.sum(-1, dtype=torch.int32)
    offsets = offsets_of(counts)
    # Each listed tile's entry: its row's offset plus its rank in the row. Scans run along short
    # rows: torch scans each long row in one thread block.
    entry = offsets[:-1, None] + torch.cumsum(flat, -1, dtype=torch.int32) - 1
    tiles = torch.zeros(flat.numel() + 1, dtype=torch.int32, device=flat.device)
    tile_ids = torch.arange(nk, dtype=torch.int32, device=flat.device).expand(bh * rows, nk)
    tiles.scatter_(0, torch.where(flat, entry, flat.numel()).flatten().long(), tile_ids.flatten())
    return BlockLists(offsets=offsets, tiles=tiles[:-1], order=visiting_order(counts.view(bh, rows), nk))


def lists_by_group(stats: Optional[BlockStatistics], sparsity: Sparsity, grid: TileGrid):
    """Per group of Q blocks (:func:`row_groups`): ``((begin, end), rows_map, lists)``, the group's
    block map (:func:`map_rows`) and its lists (:func:`build_lists`), made on the device when the
    group is reached."""
    weights = grid.tile_log_weights(map_device(stats, sparsity)) if sparsity.estimated else None
    for i0, i1 in row_groups(grid.nq, grid.batch * grid.heads * grid.nk):
        rows_map = map_rows(stats, sparsity, grid, i0, i1, weights)
        yield (i0, i1), rows_map, build_lists(rows_map)


# ---------------------------------------------------------------------------------------------
# The exact attention of a block map
# ---------------------------------------------------------------------------------------------

def inputs_block_map(qh: torch.Tensor, kh: torch.Tensor, sparsity: Sparsity, grid: TileGrid) -> torch.Tensor:
    """The block map of a call from its [B, H, S, D] inputs (the statistics in PyTorch): what the
    exact and SDPA paths attend."""
    stats = BlockStatistics.of_inputs(qh, kh, grid.kv_lens) if sparsity.estimated else None
    return block_map(stats, sparsity, grid, qh.device)


def expand_rows(block_map: torch.Tensor, r0: int, r1: int, seq_k: int) -> torch.Tensor:
    """bool [B|1, H|1, r1 - r0, Sk]: the block map of query rows [r0, r1) (r0 a multiple of 128)
    at token resolution."""
    i0, i1 = r0 // fmt.SEQ_TILE, -(-r1 // fmt.SEQ_TILE)
    rows = block_map[:, :, i0:i1].repeat_interleave(fmt.SEQ_TILE, dim=2)[:, :, : r1 - r0]
    return rows.repeat_interleave(fmt.SEQ_TILE, dim=3)[..., :seq_k]


def exact_row_chunks(batch: int, heads: int, seq_q: int, seq_k: int,
                     budget: int = 1 << 26) -> list[tuple[int, int]]:
    """Query row ranges (multiples of 128) whose token-resolution mask has at most ``budget``
    elements (one Q block at least)."""
    per = max(1, budget // max(batch * heads * fmt.SEQ_TILE * max(seq_k, 1), 1)) * fmt.SEQ_TILE
    return [(r, min(r + per, seq_q)) for r in range(0, seq_q, per)]


def estimate_block_mask(q: torch.Tensor, k: torch.Tensor, keep_mass: float, *, layout: str = "NHD",
                        causal: bool = False, scale: Optional[float] = None,
                        kv_lens: Optional[torch.Tensor] = None, attn_mask: Optional[torch.Tensor] = None,
                        always_keep: Optional[tuple[int, int]] = None,
                        block_mask: Optional[torch.Tensor] = None, backend: str = "auto",
                        video_grid: Optional[tuple[int, int, int]] = None,
                        video_tokens: Optional[tuple[int, int]] = None) -> torch.Tensor:
    """The block map a call of :func:`nvfp4_dit.attention` with these arguments would use: bool
    ``[B, H, ceil(Sq/128), ceil(Sk/128)]``, True = visited (to inspect or log it).

    The statistics and the map come from where the call would take them: the CUDA quantiser and
    the block-list kernels (:mod:`nvfp4_dit.cuda.block_lists`) where ``backend`` resolves to the
    kernel, PyTorch otherwise (whose means and mass sums may differ in the last bits, so a tile on
    the edge of ``keep_mass`` may differ). ``attn_mask`` must have a per-key form
    (:mod:`nvfp4_dit.masks`). With ``video_grid`` the map indexes 3D tiles (tile order,
    :mod:`nvfp4_dit.token_order`), as the call's own does.
    """
    from .checks import validate_attention_args
    from .masks import combine_kv_lens, reduce_key_mask
    from .planner import resolve_backend
    from .token_order import check_token_order, keys_in_tile_order

    validate_attention_args(q, k, k, layout, causal, scale, attn_mask, kv_lens, False, backend, False)
    qh, kh = fmt.to_hnd(q, layout), fmt.to_hnd(k, layout)
    b, h, sq, d = qh.shape
    sk = kh.shape[2]
    if keep_mass is None:
        raise TypeError("keep_mass must be a float in (0, 1], got None")
    sparsity = check_sparsity(block_mask, keep_mass, always_keep, batch=b, heads=h, seq_q=sq, seq_k=sk,
                              device=q.device) or Sparsity(keep_mass=1.0)   # 1.0: every visible tile
    order = check_token_order(video_grid, video_tokens, seq_q=sq, seq_k=sk, causal=causal)
    if kv_lens is not None:
        kv_lens = kv_lens.to(q.device)
    key_bias = None
    if attn_mask is not None:
        mask = attn_mask[:, None, None, :] if attn_mask.dim() == 2 else attn_mask
        key_mask = reduce_key_mask(mask, b, h, sq, sk)
        kv_lens, key_bias = combine_kv_lens(key_mask, kv_lens), key_mask.bias
    if order is not None:
        kv_lens, key_bias = keys_in_tile_order(order, kv_lens, key_bias, sk)
    grid = TileGrid(b, h, sq, sk, fmt.default_scale(d) if scale is None else float(scale), causal, kv_lens, key_bias)
    resolved = None
    if fmt.padded_head_dim(d) is not None:
        resolved = resolve_backend(backend, q.device, d, fmt.QK_FORMAT_DEFAULT)[0]
    if resolved == "cuda":
        from .cuda import block_lists, launch
        from .cuda import quantize as cuda_quantize

        qq = cuda_quantize.quantize_qkv(q, k, k, layout=layout, kv_lens=kv_lens, balance_qk=False, order=order)
        stats = BlockStatistics.of(qq)
        if block_lists.supported(grid):   # the kernels' own map
            dk = launch.device_kernels(q.device)
            return block_lists.block_map(dk, stats, sparsity, grid, launch.current_stream(dk.index))
    else:
        if order is not None:
            rows = order.source_rows(sq, q.device)
            qh, kh = qh.index_select(2, rows), kh.index_select(2, rows)
        stats = BlockStatistics.of_inputs(qh, kh, kv_lens)
    return block_map(stats, sparsity, grid)
