"""The public attention op: validation, back-end choice, fallback, and the torch custom op.

:func:`attention` validates its arguments (shape logic only, traceable by torch.compile), reduces
a mask to its per-key form on the device (:mod:`nvfp4_dit.masks`), resolves the back-end
(:func:`nvfp4_dit.planner.resolve_backend`) and runs it: exact SDPA, or :func:`run_fp4`, which the
integrations call directly with the mask their planner already reduced. Eager calls run the FP4
back-ends straight away; under torch.compile (or with fake or autograd-tracked tensors) they go
through the custom op ``torch.ops.nvfp4_dit.attention``. No FP4 path synchronises with the host.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from . import format as fmt
from . import preprocess
from . import sparse
from . import token_order as tok
from .checks import BACKENDS, LAYOUTS, validate_attention_args
from .fallback import FallbackWarning, reset_fallback_warnings, warn_once
from .masks import KeyMask, NotPerKeyMask, combine_kv_lens, reduce_key_mask
from .planner import resolve_backend
from .reference import attention_reference

__all__ = ["BACKENDS", "LAYOUTS", "BackendUnavailableError", "FallbackWarning", "attention", "available_backends",
           "reset_fallback_warnings", "run_fp4"]


class BackendUnavailableError(RuntimeError):
    """An explicitly requested back-end cannot run this call (``backend="auto"`` falls back)."""


def _warn_fallback(reason: str) -> None:
    warn_once(f"nvfp4_dit: using exact SDPA attention instead of NVFP4: {reason}")


def _sdpa_mask(attn_mask, kv_lens, b, h, sq, sk, causal, device):
    """One additive/bool mask for F.scaled_dot_product_attention (None if nothing to mask)."""
    if attn_mask is not None and attn_mask.dim() == 2 and attn_mask.shape == (b, sk):
        attn_mask = attn_mask[:, None, None, :]
    allowed = None
    if kv_lens is not None:
        allowed = fmt.valid_key_mask(kv_lens, b, sk, device)[:, None, None, :]
    if causal:
        tri = torch.ones(sq, sk, dtype=torch.bool, device=device).tril()
        allowed = tri if allowed is None else allowed & tri
    return _restricted(attn_mask, allowed)


def _restricted(attn_mask, allowed):
    """An SDPA mask (None, bool or additive) further restricted to the bool ``allowed`` (or None)."""
    if attn_mask is None:
        return allowed
    if allowed is None:
        return attn_mask
    if attn_mask.dtype == torch.bool:
        return attn_mask & allowed
    return attn_mask.masked_fill(~allowed, -math.inf)


def _attention_sdpa(q, k, v, layout, causal, scale, attn_mask, kv_lens, return_lse, block_map=None):
    """Exact attention through SDPA; with a block map (:mod:`nvfp4_dit.sparse`) in chunks of query
    rows, each with its token-resolution mask, so memory stays O(S*D + chunk)."""
    qh, kh, vh = (fmt.to_hnd(t, layout) for t in (q, k, v))
    b, h, sq, d = qh.shape
    sk = kh.shape[2]
    scale = fmt.default_scale(d) if scale is None else scale
    mask = _sdpa_mask(attn_mask, kv_lens, b, h, sq, sk, causal, q.device)
    if block_map is None:
        out, lse = _sdpa_rows(qh, kh, vh, mask, scale, return_lse)
    else:
        outs, lses = [], []
        for r0, r1 in sparse.exact_row_chunks(b, h, sq, sk):
            rows = mask[..., r0:r1, :] if mask is not None and mask.dim() >= 2 and mask.shape[-2] == sq else mask
            listed = sparse.expand_rows(block_map, r0, r1, sk)
            if rows is None:
                rows = listed
            elif rows.dtype == torch.bool:
                rows = rows & listed
            else:
                rows = rows.masked_fill(~listed, -math.inf)
            o, lse = _sdpa_rows(qh[:, :, r0:r1], kh, vh, rows, scale, return_lse)
            outs.append(o)
            lses.append(lse)
        out = torch.cat(outs, 2) if outs else qh.new_zeros(b, h, 0, vh.shape[-1])
        lse = torch.cat(lses, 2) if return_lse and lses else (qh.new_zeros(b, h, 0, dtype=torch.float32)
                                                               if return_lse else None)
    out = out.transpose(1, 2) if layout == "NHD" else out
    return out.contiguous(), lse


def _sdpa_rows(qh, kh, vh, mask, scale, return_lse):
    """SDPA of the rows of ``qh`` [B, H, r, D] under ``mask`` (None, bool or additive,
    broadcastable to [B, H, r, Sk]): ``(out [B, H, r, D], lse or None)``."""
    b, h, sq = qh.shape[:3]
    hkv = kh.shape[1]
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(qh.dtype)
    gqa = {"enable_gqa": True} if h != hkv else {}
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, **gqa)
    # Rows with no visible key: SDPA gives NaN there; our convention is 0 and LSE -inf. The mask
    # alone says which rows those are, so the exact LSE pass runs only when it is asked for.
    lse, no_key = None, None
    if return_lse:
        lse = _exact_lse(qh, kh.repeat_interleave(h // hkv, 1) if h != hkv else kh, scale, mask)
        no_key = torch.isneginf(lse)
    elif mask is not None:
        allowed = mask if mask.dtype == torch.bool else ~torch.isneginf(mask)
        no_key = torch.broadcast_to(~allowed.any(-1), (b, h, sq))
    if no_key is not None:
        out = torch.where(no_key[..., None], 0.0, out).to(qh.dtype)
    return out, lse


def _exact_lse(qh, kh, scale, mask, chunk_rows: int = 1024):
    """Exact LSE [B, H, Sq] fp32 of the scaled, masked scores, O(chunk_rows * Sk) memory."""
    sq = qh.shape[2]
    k_t = kh.float().transpose(-1, -2)  # converted once, not per chunk of rows
    lses = []
    for r0 in range(0, sq, chunk_rows):
        s = torch.matmul(qh[:, :, r0:r0 + chunk_rows].float(), k_t) * scale
        if mask is not None:
            m = mask[..., r0:r0 + chunk_rows, :] if mask.dim() >= 2 and mask.shape[-2] == sq else mask
            s = s.masked_fill(~m, -math.inf) if m.dtype == torch.bool else s + m.float()
        lses.append(torch.logsumexp(s, dim=-1))
    return torch.cat(lses, 2) if lses else qh.new_zeros(*qh.shape[:3], dtype=torch.float32)


def _poison_non_finite(out, lse, layout, q_blocks_bad, kv_bad):
    """NaN where a non-finite input reached an FP4 result of the reference back-end (in place; the
    CUDA kernel does the same itself).

    FP4 quantisation hides non-finite inputs: scales saturate (+-inf -> 448, so an inf in V
    comes out finite) and a NaN row sum reads as "no visible key" (output 0, LSE -inf).  Exact
    attention gives NaN/inf there, so the FP4 paths must not return a finite value.  Poisoned:
    every row of a 128-row Q block flagged in ``q_blocks_bad [B, H, nblk]`` and every row of the
    query heads of a (batch, kv-head) flagged in ``kv_bad [B, Hkv]`` (see
    :func:`nvfp4_dit.preprocess.nonfinite_blocks`).
    """
    h, sq = fmt.hnd_shape(out, layout)[1:3]
    bad = q_blocks_bad.repeat_interleave(fmt.SEQ_TILE, 2)[:, :, :sq]
    bad = bad | kv_bad.repeat_interleave(h // kv_bad.shape[1], 1)[:, :, None]
    out.masked_fill_((bad.transpose(1, 2) if layout == "NHD" else bad)[..., None], math.nan)
    if lse is not None:
        lse.masked_fill_(bad, math.nan)
    return out, lse


def _seq_dim(layout: str) -> int:
    return 1 if layout == "NHD" else 2


def _in_tile_order(rows: torch.Tensor, layout: str, *tensors):
    """Q, K, V ([B, S, H, D] or [B, H, S, D]) permuted into tile order by ``rows`` (a
    :class:`~nvfp4_dit.token_order.TokenOrder`'s ``source_rows``; the reference and exact paths,
    the kernels read through the order instead)."""
    return tuple(t.index_select(_seq_dim(layout), rows) for t in tensors)


def _to_caller_order(rows: torch.Tensor, layout: str, out: torch.Tensor, lse: Optional[torch.Tensor]):
    """``out`` (layout) and ``lse`` [B, H, S] from tile order back to the caller's."""
    out = torch.empty_like(out).index_copy_(_seq_dim(layout), rows, out)
    if lse is not None:
        lse = torch.empty_like(lse).index_copy_(2, rows, lse)
    return out, lse


def _order_of(video_grid, video_tokens) -> Optional[tok.TokenOrder]:
    if video_grid is None:
        return None
    return tok.TokenOrder(tuple(video_grid), tuple(video_tokens))


def _sparsity_of(block_mask, keep_mass, always_keep) -> Optional[sparse.Sparsity]:
    if block_mask is None and keep_mass is None:
        return None
    return sparse.Sparsity(block_mask, keep_mass, None if always_keep is None else tuple(always_keep))


def _tile_grid(q, k, layout, causal, scale, kv_lens, key_bias) -> sparse.TileGrid:
    b, h, sq, d = fmt.hnd_shape(q, layout)
    sk = fmt.hnd_shape(k, layout)[2]
    return sparse.TileGrid(b, h, sq, sk, fmt.default_scale(d) if scale is None else scale, causal, kv_lens, key_bias)


def _inputs_block_map(q, k, layout, causal, scale, kv_lens, key_bias, sparsity: sparse.Sparsity) -> torch.Tensor:
    """The block map the exact paths attend (the statistics from the inputs, in PyTorch)."""
    return sparse.inputs_block_map(fmt.to_hnd(q, layout), fmt.to_hnd(k, layout), sparsity,
                                   _tile_grid(q, k, layout, causal, scale, kv_lens, key_bias))


def _fp4(q, k, v, key_bias, kv_lens, mask_nonfinite, layout, causal, scale, return_lse, backend, balance_qk,
         qk_format, sparsity: Optional[sparse.Sparsity] = None, order: Optional[tok.TokenOrder] = None):
    """The back-ends on checked arguments with a reduced mask: ``(out, lse or None)``. ``sparsity``: a
    block-sparse call (:func:`nvfp4_dit.sparse.check_sparsity`), None for dense. ``order``: a video
    call's tile order (:mod:`nvfp4_dit.token_order`), the masks in the caller's order."""
    if order is not None and q.numel() and not (backend == "sdpa" and sparsity is None):
        # Exact dense attention is the same in any order; everything else attends in tile order.
        sk = fmt.hnd_shape(k, layout)[2]
        if backend == "cuda":   # the kernels read and write through the order
            kv_lens, key_bias = tok.keys_in_tile_order(order, kv_lens, key_bias, sk)
            from .cuda import attention as cuda_attention

            return cuda_attention.attention(q, k, v, layout=layout, causal=causal, scale=scale, kv_lens=kv_lens,
                                            return_lse=return_lse, balance_qk=balance_qk, qk_format=qk_format,
                                            key_bias=key_bias, mask_nonfinite=mask_nonfinite, sparsity=sparsity,
                                            order=order)
        rows = order.source_rows(sk, q.device)
        kv_lens, key_bias = tok.keys_in_tile_order(order, kv_lens, key_bias, sk, rows)
        out, lse = _fp4(*_in_tile_order(rows, layout, q, k, v), key_bias, kv_lens, mask_nonfinite, layout, causal,
                        scale, return_lse, backend, balance_qk, qk_format, sparsity)
        return _to_caller_order(rows, layout, out, lse)
    if q.numel() == 0 or fmt.hnd_shape(k, layout)[2] == 0:
        # Empty query, or no keys at all: nothing to attend (0 output, -inf LSE).
        b, h, sq, _ = fmt.hnd_shape(q, layout)
        out = q.new_zeros(_out_shape(q, v, layout))
        return out, (q.new_full((b, h, sq), -math.inf, dtype=torch.float32) if return_lse else None)
    if backend == "sdpa":
        mask = None if key_bias is None else key_bias[:, :, None, :]
        block_map = None if sparsity is None else _inputs_block_map(q, k, layout, causal, scale, kv_lens, key_bias,
                                                                   sparsity)
        return _attention_sdpa(q, k, v, layout, causal, scale, mask, kv_lens, return_lse, block_map)
    if backend == "cuda":
        from .cuda import attention as cuda_attention

        return cuda_attention.attention(q, k, v, layout=layout, causal=causal, scale=scale, kv_lens=kv_lens,
                                        return_lse=return_lse, balance_qk=balance_qk, qk_format=qk_format,
                                        key_bias=key_bias, mask_nonfinite=mask_nonfinite, sparsity=sparsity)
    qq, block_map = None, None
    if sparsity is not None:
        qq = preprocess.quantize_qkv(q, k, v, layout=layout, kv_lens=kv_lens, balance_qk=balance_qk,
                                     qk_format=qk_format)
        stats = sparse.BlockStatistics.of(qq) if sparsity.estimated else None
        block_map = sparse.block_map(stats, sparsity, _tile_grid(q, k, layout, causal, scale, kv_lens, key_bias))
    res = attention_reference(q, k, v, layout=layout, causal=causal, scale=scale, key_bias=key_bias, kv_lens=kv_lens,
                              return_lse=return_lse, balance_qk=balance_qk, qk_format=qk_format, quantized=qq,
                              block_mask=block_map)
    out, lse = res if return_lse else (res, None)
    q_bad, kv_bad = preprocess.nonfinite_blocks(q, k, v, kv_lens, layout)
    if mask_nonfinite is not None:
        kv_bad = kv_bad | mask_nonfinite.to(kv_bad.device)[:, None]
    return _poison_non_finite(out, lse, layout, q_bad, kv_bad)


def _out_shape(q, v, layout):
    b, h, sq, _ = fmt.hnd_shape(q, layout)
    dv = v.shape[-1]
    return (b, sq, h, dv) if layout == "NHD" else (b, h, sq, dv)


@torch.library.custom_op("nvfp4_dit::attention", mutates_args=())
def _attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_bias: Optional[torch.Tensor],
    kv_lens: Optional[torch.Tensor],
    mask_nonfinite: Optional[torch.Tensor],
    layout: str,
    causal: bool,
    scale: Optional[float],
    return_lse: bool,
    backend: str,
    balance_qk: bool,
    qk_format: str,
    block_mask: Optional[torch.Tensor] = None,
    keep_mass: Optional[float] = None,
    always_keep: Optional[list[int]] = None,
    video_grid: Optional[list[int]] = None,
    video_tokens: Optional[list[int]] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = _fp4(q, k, v, key_bias, kv_lens, mask_nonfinite, layout, causal, scale, return_lse, backend,
                    balance_qk, qk_format, _sparsity_of(block_mask, keep_mass, always_keep),
                    _order_of(video_grid, video_tokens))
    return out, (lse.float().contiguous() if return_lse else q.new_empty(0, dtype=torch.float32))


@_attention_op.register_fake
def _attention_fake(q, k, v, key_bias, kv_lens, mask_nonfinite, layout, causal, scale, return_lse, backend, balance_qk,
                    qk_format, block_mask=None, keep_mass=None, always_keep=None, video_grid=None, video_tokens=None):
    b, h, sq, _ = fmt.hnd_shape(q, layout)
    out = q.new_empty(_out_shape(q, v, layout))
    lse = q.new_empty((b, h, sq) if return_lse else (0,), dtype=torch.float32)
    return out, lse


def _through_custom_op(q, k, v) -> bool:
    """Whether a call goes through the custom op: under torch.compile, with tensor subclasses
    (fake, functional) or with tensors that track gradients (the op has no backward)."""
    return (torch.compiler.is_compiling() or type(q) is not torch.Tensor or type(k) is not torch.Tensor
            or type(v) is not torch.Tensor or q.requires_grad or k.requires_grad or v.requires_grad)


def block_density(q, k, *, layout: str, causal: bool, scale: Optional[float], key_mask: Optional[KeyMask],
                  sparsity: sparse.Sparsity, order: Optional[tok.TokenOrder] = None) -> float:
    """The share of key tiles the block map of a :func:`run_fp4` call with these arguments keeps
    (its statistics in PyTorch, as the exact paths take them): for calibration and reports (it
    reads the result on the host)."""
    lens, bias = combine_kv_lens(key_mask, None), None if key_mask is None else key_mask.bias
    if order is not None:
        rows = order.source_rows(fmt.hnd_shape(k, layout)[2], q.device)
        lens, bias = tok.keys_in_tile_order(order, lens, bias, rows.numel(), rows)
        q, k = _in_tile_order(rows, layout, q, k)
    block_map = _inputs_block_map(q, k, layout, causal, scale, lens, bias, sparsity)
    return float(block_map.float().mean())


def run_fp4(q, k, v, *, layout: str, causal: bool, scale: Optional[float], key_mask: Optional[KeyMask],
            kv_lens: Optional[torch.Tensor], return_lse: bool, backend: str, balance_qk: bool, qk_format: str,
            sparsity: Optional[sparse.Sparsity] = None, order: Optional[tok.TokenOrder] = None):
    """The op on arguments already checked (:func:`attention`, or a planner's
    :class:`~nvfp4_dit.planner.CallPlan`): ``backend`` "cuda" or "reference" (FP4) or "sdpa"
    (exact), ``key_mask`` reduced on the device, ``kv_lens`` on the device, ``sparsity`` from
    :func:`nvfp4_dit.sparse.check_sparsity` (None: dense), ``order`` from
    :func:`nvfp4_dit.token_order.check_token_order` (None: the caller's order). Returns ``out``, or
    ``(out, lse)``."""
    lens = combine_kv_lens(key_mask, kv_lens)
    key_bias = None if key_mask is None else key_mask.bias
    nonfinite = None if key_mask is None else key_mask.nonfinite
    if _through_custom_op(q, k, v):
        block_mask, keep_mass, always_keep = (None, None, None) if sparsity is None else (
            sparsity.block_mask, sparsity.keep_mass,
            None if sparsity.always_keep is None else list(sparsity.always_keep))
        video_grid, video_tokens = (None, None) if order is None else (list(order.grid), list(order.span))
        out, lse = torch.ops.nvfp4_dit.attention(q, k, v, key_bias, lens, nonfinite, layout, causal, scale,
                                                  return_lse, backend, balance_qk, qk_format, block_mask, keep_mass,
                                                  always_keep, video_grid, video_tokens)
    else:
        out, lse = _fp4(q, k, v, key_bias, lens, nonfinite, layout, causal, scale, return_lse, backend, balance_qk,
                        qk_format, sparsity, order)
    return (out, lse) if return_lse else out


def _key_lengths_on(kv_lens: Optional[torch.Tensor], device: torch.device, sk: int) -> Optional[torch.Tensor]:
    """``kv_lens`` on the inputs' device. Lengths given on the host are checked there ([0, Sk]) and
    copied without waiting; lengths on the device are clamped by the kernels (no host sync)."""
    if kv_lens is None or kv_lens.device.type != "cpu":
        return kv_lens
    if kv_lens.numel():
        lo, hi = int(kv_lens.min()), int(kv_lens.max())
        if lo < 0 or hi > sk:
            raise ValueError(f"kv_lens values must lie in [0, {sk}], got min {lo} max {hi}")
    return kv_lens if kv_lens.device == device else kv_lens.to(device, non_blocking=True)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    layout: str = "NHD",
    causal: bool = False,
    scale: Optional[float] = None,
    attn_mask: Optional[torch.Tensor] = None,
    kv_lens: Optional[torch.Tensor] = None,
    return_lse: bool = False,
    backend: str = "auto",
    balance_qk: bool = fmt.BALANCE_QK_DEFAULT,
    qk_format: str = fmt.QK_FORMAT_DEFAULT,
    block_mask: Optional[torch.Tensor] = None,
    keep_mass: Optional[float] = None,
    always_keep: Optional[tuple[int, int]] = None,
    video_grid: Optional[tuple[int, int, int]] = None,
    video_tokens: Optional[tuple[int, int]] = None,
):
    """Scaled dot-product attention with NVFP4 (FP4 microscaling) Q, K, P and V.

    Args:
        q: ``[B, Sq, H, D]`` for ``layout="NHD"`` (diffusers' layout) or ``[B, H, Sq, D]`` for
            ``"HND"``; float16, bfloat16 or float32.
        k, v: ``[B, Sk, Hkv, D]`` (or HND), same dtype and device; ``H % Hkv == 0`` (GQA).
        causal: query i attends keys j <= i (SDPA's ``is_causal``).
        scale: softmax scale, default ``1/sqrt(D)``.
        attn_mask: optional bool (True = attend) or additive float mask: ``[B, Sk]`` (key padding)
            or broadcastable to ``[B, H, Sq, Sk]``. The FP4 back-ends take every mask that is the
            same for all queries (its query dim is 1), per batch and head; others run on exact
            SDPA (``auto``) or raise. A batch row that keeps no key gives 0 (SDPA: NaN); NaN or
            +inf in a mask gives NaN rows, as in SDPA (on the host: a ValueError).
        kv_lens: optional int32/int64 ``[B]``: only the first ``kv_lens[b]`` keys are attended. On
            the inputs' device it is clamped to [0, Sk] without a host sync; on the CPU, values
            outside that range raise.
        return_lse: also return the log-sum-exp ``[B, H, Sq]`` (fp32, natural log) of the
            scaled scores, e.g. to merge partial attentions (ring attention).
        backend: ``"auto"`` (the CUDA kernel where the native FP4 MMA exists, sm_120/sm_121;
            otherwise exact SDPA with one warning per reason), ``"cuda"`` (the kernel; emulated
            FP4 MMA on sm_80/sm_90), ``"reference"`` (pure-torch FP4 numerics, any device) or
            ``"sdpa"`` (exact). The kernel's first call per GPU and head dim in a process runs
            a known-answer self-test (:mod:`nvfp4_dit.selftest`, a few ms); if it fails, ``auto``
            and ``cuda`` run exact SDPA for the rest of the process, with one warning.
        balance_qk: balance Q and K per channel before quantising them (Q times a power of two
            per channel, K divided by it: the logits are unchanged exactly). Helps when Q and K put
            their energy in different channels; costs the quantiser one more read of Q.
        qk_format: the format of Q and K: ``"nvfp4"`` (default) or ``"mxfp8"`` (e4m3 with one
            power-of-two scale per 32 elements; P and V stay NVFP4). MXFP8 keeps sharp attention
            (heads whose logits spread far, e.g. strong QK-norm gains) accurate where 4-bit Q/K
            cannot; on sm_120 its Q·Kᵀ runs at half the FP4 rate.
        block_mask: block-sparse attention (:mod:`nvfp4_dit.sparse`): bool ``[B or 1, H or 1,
            ceil(Sq/128), ceil(Sk/128)]``, True = the 128-query block attends that 128-key tile;
            skipped tiles contribute nothing. Every back-end, the exact fallback included,
            attends exactly the listed keys.
        keep_mass: a float in (0, 1]: the call estimates its own block map (in every call, from
            pooled block means), keeping per Q block the fewest key tiles whose estimated
            attention mass reaches ``keep_mass``; with ``block_mask``, within that map. ``1.0``
            alone is dense attention. :func:`nvfp4_dit.sparse.estimate_block_mask` returns the map.
        always_keep: with ``keep_mass``, a key range ``(start, end)`` whose tiles every Q block
            keeps (text tokens, attention sinks).
        video_grid: ``(T, H, W)``, the latent token grid of a video's self-attention: the call
            quantises and attends the video tokens in 3D tiles (compact boxes of the grid, 2 x 8 x 8
            where it divides; :mod:`nvfp4_dit.token_order`), so a block-sparse call keeps fewer
            tiles for the same accuracy. The output and LSE come back in the caller's order;
            ``block_mask`` and the estimated map index tiles in tile order; masks, ``kv_lens`` and
            ``always_keep`` stay in the caller's order (positions outside the video are the same
            in both). Needs Sq == Sk and no ``causal``. The CUDA kernels read and write through the
            order (no permuted copy); the reference and the exact fallback permute in PyTorch.
        video_tokens: ``(start, end)``, the video's span in a joint sequence (text, audio tokens
            elsewhere keep their places); default the whole sequence, which then must hold
            ``T * H * W`` tokens.

    Returns:
        ``out`` in q's layout and dtype, or ``(out, lse)`` with ``return_lse=True``.
        Rows with no visible key give 0 (and LSE ``-inf``).

    Raises:
        TypeError / ValueError naming the bad argument; :class:`BackendUnavailableError` when
        an explicitly requested back-end cannot run the call.
    """
    validate_attention_args(q, k, v, layout, causal, scale, attn_mask, kv_lens, return_lse, backend, balance_qk,
                            qk_format)
    scale = None if scale is None else float(scale)
    b, h, sq, d = fmt.hnd_shape(q, layout)
    sk = fmt.hnd_shape(k, layout)[2]
    kv_lens = _key_lengths_on(kv_lens, q.device, sk)
    sparsity = sparse.check_sparsity(block_mask, keep_mass, always_keep, batch=b, heads=h, seq_q=sq, seq_k=sk,
                                     device=q.device)
    order = tok.check_token_order(video_grid, video_tokens, seq_q=sq, seq_k=sk, causal=causal)
    if backend == "sdpa":
        return _exact(q, k, v, layout, causal, scale, attn_mask, kv_lens, return_lse, sparsity, order=order)

    reason, key_mask = None, None
    if attn_mask is not None:
        mask = attn_mask[:, None, None, :] if attn_mask.dim() == 2 else attn_mask  # [B, Sk] is key padding
        try:
            key_mask = reduce_key_mask(mask, b, h, sq, sk)
        except NotPerKeyMask as e:
            reason = f"attn_mask of shape {tuple(attn_mask.shape)} has no per-key form ({e})"
    if reason is None and fmt.padded_head_dim(d) is None:
        reason = f"head dim {d} > {fmt.SUPPORTED_HEAD_DIMS[-1]}"
    resolved, hard = None, True
    if reason is None:
        resolved, reason, hard = resolve_backend(backend, q.device, d, qk_format)
    if resolved is None:
        if backend != "auto" and hard:
            raise BackendUnavailableError(f"backend={backend!r} cannot run this call: {reason}")
        _warn_fallback(reason)
        return _exact(q, k, v, layout, causal, scale, attn_mask, kv_lens, return_lse, sparsity, key_mask, order)
    return run_fp4(q, k, v, layout=layout, causal=causal, scale=scale, key_mask=key_mask, kv_lens=kv_lens,
                   return_lse=return_lse, backend=resolved, balance_qk=balance_qk, qk_format=qk_format,
                   sparsity=sparsity, order=order)


def _mask_in_tile_order(rows: torch.Tensor, attn_mask, kv_lens, sq: int, sk: int):
    """``attn_mask`` (any SDPA form) and ``kv_lens`` of a call as one mask in tile order (``rows``:
    the order's ``source_rows``)."""
    if attn_mask is None and kv_lens is None:
        return None
    if attn_mask is not None:
        if attn_mask.dim() == 2:   # [B, Sk] key padding
            attn_mask = attn_mask[:, None, None, :]
        if attn_mask.dim() >= 2 and attn_mask.shape[-2] == sq:
            attn_mask = attn_mask.index_select(-2, rows)
        if attn_mask.shape[-1] == sk:
            attn_mask = attn_mask.index_select(-1, rows)
    valid = None if kv_lens is None else (rows[None, :] < kv_lens.to(rows.device)[:, None])[:, None, None, :]
    return _restricted(attn_mask, valid)


def _exact(q, k, v, layout, causal, scale, attn_mask, kv_lens, return_lse, sparsity=None, key_mask=None, order=None):
    """Exact attention; with ``sparsity``, of the block map the FP4 paths would use (in tile order
    with ``order``). ``key_mask``: ``attn_mask`` reduced already (the op's fallback), else reduced
    here when a map needs it."""
    if order is not None and sparsity is not None and q.numel():
        b, h, sq, _ = fmt.hnd_shape(q, layout)
        rows = order.source_rows(sq, q.device)
        mask = _mask_in_tile_order(rows, attn_mask, kv_lens, sq, fmt.hnd_shape(k, layout)[2])
        res = _exact(*_in_tile_order(rows, layout, q, k, v), layout, causal, scale, mask, None, return_lse, sparsity)
        out, lse = _to_caller_order(rows, layout, *(res if return_lse else (res, None)))
        return (out, lse) if return_lse else out
    block_map = None
    if sparsity is not None:
        if key_mask is None and attn_mask is not None:
            b, h, sq, _ = fmt.hnd_shape(q, layout)
            try:
                key_mask = reduce_key_mask(attn_mask[:, None, None, :] if attn_mask.dim() == 2 else attn_mask,
                                           b, h, sq, fmt.hnd_shape(k, layout)[2])
            except NotPerKeyMask:
                pass   # the estimate weighs tiles by their unmasked keys; the mask still applies in SDPA
        lens, key_bias = combine_kv_lens(key_mask, kv_lens), None if key_mask is None else key_mask.bias
        block_map = _inputs_block_map(q, k, layout, causal, scale, lens, key_bias, sparsity)
    out, lse = _attention_sdpa(q, k, v, layout, causal, scale, attn_mask, kv_lens, return_lse, block_map)
    return (out, lse) if return_lse else out


def available_backends(device: Optional[torch.device] = None) -> list[str]:
    """Back-ends that can run on ``device`` (default: the current CUDA device if any, else CPU)."""
    names = ["reference", "sdpa"]
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda":
        from .cuda import attention as cuda_attention

        if cuda_attention.device_unsupported_reason(device, require_native=False) is None:
            names.append("cuda")
    return names
