"""The NVFP4 attention algorithm in plain PyTorch: the exact numerics the CUDA kernel runs.

Step for step (the format: :mod:`nvfp4_dit.format`; the contract: CONTRIBUTING.md):

1. Q and K are optionally balanced per channel; K is smoothed by its per-head mean, Q block b by
   ``m_b``, its mean's part in the head's low-rank basis (:mod:`nvfp4_dit.smoothing`), V by its
   per-head mean; each is divided by its power-of-two tensor scale and FP4-quantised
   (:func:`nvfp4_dit.preprocess.quantize_qkv`), V along tokens.
2. Scores in the kernel's units ``s = FP4(q') . FP4(k')^T + delta`` with ``delta = m_b . (k - km)^T
   / f`` formed from the key projections and the block's coefficients
   (:func:`nvfp4_dit.smoothing.correction_from_projections`) and ``f = q_scale * k_scale`` per
   (batch, head, Q block); q . k = s * f.
3. Online softmax over 128-key tiles in ascending key order: the running max ``m_t`` after tile
   t sets the unnormalised ``P' = 2688 * exp(scale * f * (s - m_t))``, which is quantised per 16
   keys (:func:`nvfp4_dit.format.quantize_p_blocks`) and multiplied with FP4(V') in fp32; earlier
   tiles are rescaled by ``exp(scale * f * (m_t - m_T))``. The row sum uses the unquantised P'.
4. ``out = O / rowsum * v_scale + vm`` (0 for a row with no visible key);
   ``lse = m * scale * f + ln(rowsum) - ln(2688) + scale * q.km`` (the true LSE of the scaled
   scores, the K-mean term given back).

The tile loop is written in closed form (a cumulative max over tile maxima) so it vectorises;
it is the same arithmetic as the kernel's sequential rescaling up to fp32 rounding. Q is
processed in chunks of 128-row blocks, so memory is O(S*D + chunk*S), never S x S.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from . import format as fmt
from . import preprocess
from . import smoothing
from . import sparse

LOG2E = math.log2(math.e)
_DEFAULT_CHUNK_ELEMS = 1 << 25


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    layout: str = "NHD",
    causal: bool = False,
    scale: Optional[float] = None,
    key_bias: Optional[torch.Tensor] = None,
    kv_lens: Optional[torch.Tensor] = None,
    return_lse: bool = False,
    balance_qk: bool = fmt.BALANCE_QK_DEFAULT,
    per_block_mean: bool = True,
    query_blocks: Optional[tuple[int, int]] = None,
    chunk_elems: int = _DEFAULT_CHUNK_ELEMS,
    quantized: Optional[fmt.QuantizedQKV] = None,
    qk_format: str = fmt.QK_FORMAT_DEFAULT,
    block_mask: Optional[torch.Tensor] = None,
):
    """NVFP4 attention, reference numerics.

    Args:
        q, k, v: ``[B, S, H, D]`` (``layout="NHD"``) or ``[B, H, S, D]`` (``"HND"``); k and v
            may have fewer heads than q (GQA).  Inputs are assumed validated by the caller
            (:func:`nvfp4_dit.attention` does that).
        causal: SDPA's ``is_causal`` convention: query i sees keys j <= i.
        scale: softmax scale, default ``1/sqrt(D)``.
        key_bias: optional additive float bias per key ``[B, Sk]`` or ``[B, H or 1, Sk]`` (in units
            of the *scaled* score; ``-inf`` masks a key), added through the correction term.
        kv_lens: optional int ``[B]``: keys j >= kv_lens[b] are masked.
        balance_qk: balance Q and K per channel before quantising (exact in the logits).
        query_blocks: optional ``(first, last)`` range of 128-row Q blocks to compute; the
            output then holds only those rows (for sampled checks on long sequences).
        quantized: a precomputed :class:`~nvfp4_dit.format.QuantizedQKV` (from
            :func:`nvfp4_dit.preprocess.quantize_qkv`, e.g. with the CUDA quantiser's means) to run
            the rest of the algorithm on; it must carry ``k_smoothed``.
        block_mask: optional bool ``[B or 1, H or 1, ceil(Sq/128), ceil(Sk/128)]`` block map
            (:mod:`nvfp4_dit.sparse`): each Q block attends only the keys of its True tiles.

    Returns:
        ``out`` in q's layout and dtype, and ``lse [B, H, Sq]`` fp32 when ``return_lse``.
    """
    qh = fmt.to_hnd(q, layout)
    b, h, sq, d = qh.shape
    hkv, sk = fmt.to_hnd(k, layout).shape[1:3]
    scale = fmt.default_scale(d) if scale is None else float(scale)
    qq = quantized if quantized is not None else preprocess.quantize_qkv(
        q, k, v, layout=layout, kv_lens=kv_lens, balance_qk=balance_qk, per_block_mean=per_block_mean,
        qk_format=qk_format,
    )
    q_hat, k_hat, v_hat = preprocess.dequantize_qkv(qq)
    dp, skp = qq.head_dim_padded, k_hat.shape[2]
    group = h // hkv
    dev = q_hat.device

    # Key masks: -inf for keys past kv_lens and the padding; a key bias (in units of the scaled
    # score) enters the key projections' first column (smoothing.key_projections).
    valid = fmt.valid_key_mask(kv_lens, b, sk, dev)
    mask = fmt.pad_dim(torch.where(valid, 0.0, -math.inf), 1, skp, -math.inf)[:, None, None, None, :]
    if key_bias is not None:
        key_bias = key_bias.to(dev, torch.float32)
        key_bias = key_bias[:, None, :] if key_bias.dim() == 2 else key_bias
    f_all = qq.score_scale().to(dev)  # [B, H, nblk]: kernel score units -> q.k units
    v_scale = qq.v_scale.to(dev).repeat_interleave(group, 1)[:, :, None, None]
    v_mean = qq.v_mean.to(dev).repeat_interleave(group, 1)[:, :, None, :]

    projections = smoothing.key_projections(qq.k_smoothed, qq.smoothing_basis(), key_bias=key_bias, scale=scale)
    nblk = qq.num_q_blocks
    first, last = (0, nblk) if query_blocks is None else query_blocks
    if not (0 <= first < last <= nblk):
        raise ValueError(f"query_blocks {query_blocks} out of range for {nblk} blocks")
    per_block = b * h * fmt.SEQ_TILE * skp
    blocks_per_chunk = max(1, chunk_elems // per_block)
    c = scale * LOG2E
    log2_range = math.log2(fmt.P_RANGE)
    key_idx = torch.arange(skp, device=dev)

    outs, lses = [], []
    for b0 in range(first, last, blocks_per_chunk):
        b1 = min(last, b0 + blocks_per_chunk)
        r0, r1 = b0 * fmt.SEQ_TILE, b1 * fmt.SEQ_TILE
        rows = r1 - r0
        qc = q_hat[:, :, r0:r1].reshape(b, hkv, group * rows, dp)
        s = torch.matmul(qc, k_hat.transpose(-1, -2)).view(b, h, b1 - b0, fmt.SEQ_TILE, skp)
        delta = smoothing.correction_from_projections(projections, qq.q_coeff[:, :, b0:b1].to(dev),
                                                      f_all[:, :, b0:b1])
        s = s + delta[:, :, :, None, :] + mask
        if block_mask is not None:   # unlisted tiles hold no key (adding 0 leaves listed scores exact)
            listed = block_mask[:, :, b0:b1].to(dev).repeat_interleave(fmt.SEQ_TILE, dim=-1)
            s = s + torch.where(listed, 0.0, -math.inf)[:, :, :, None, :]
        f = f_all[:, :, b0:b1, None, None]
        s = s.view(b, h, rows, skp)
        f_rows = f.view(b, h, b1 - b0, 1, 1).expand(b, h, b1 - b0, fmt.SEQ_TILE, 1).reshape(b, h, rows, 1)
        cf = c * f_rows  # the softmax scale in kernel units, log2 based
        if causal:
            q_idx = torch.arange(r0, r1, device=dev)
            s = s.masked_fill(key_idx[None, :] > q_idx[:, None], -math.inf)

        tiles = s.view(b, h, rows, skp // fmt.SEQ_TILE, fmt.SEQ_TILE)
        m_run = torch.cummax(tiles.amax(-1), dim=-1).values
        m_safe = torch.where(torch.isneginf(m_run), 0.0, m_run)
        p = torch.exp2((tiles - m_safe[..., None]) * cf[..., None] + log2_range)
        m_last = m_safe[..., -1:]
        # Tiles before the first unmasked key carry p = 0; weight them 0 too (no inf * 0).
        weight = torch.where(torch.isneginf(m_run), 0.0, torch.exp2((m_safe - m_last) * cf))
        row_sum = (p.sum(-1) * weight).sum(-1)
        p_q = fmt.quantize_p_blocks(p) * weight[..., None]
        o = torch.matmul(p_q.reshape(b, hkv, group * rows, skp), v_hat).view(b, h, rows, dp)
        has_keys = row_sum > 0
        o = o / row_sum.clamp_min(1e-30)[..., None] * v_scale + v_mean
        outs.append(torch.where(has_keys[..., None], o, 0.0))
        if return_lse:
            lse = (m_last[..., 0] * (scale * f_rows[..., 0]) + torch.log(row_sum.clamp_min(1e-30))
                   - math.log(fmt.P_RANGE))
            lses.append(torch.where(has_keys, lse, -math.inf))

    row_end = min(last * fmt.SEQ_TILE, sq)
    n_rows = row_end - first * fmt.SEQ_TILE
    out = torch.cat(outs, dim=2)[:, :, :n_rows, :d].to(q.dtype)
    out = out.transpose(1, 2) if layout == "NHD" else out
    out = out.contiguous()
    if not return_lse:
        return out
    lse = torch.cat(lses, dim=2)[:, :, :n_rows]
    lse = lse + scale * qq.q_dot_km[:, :, first * fmt.SEQ_TILE: row_end]
    return out, lse.contiguous()


def attention_exact(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    layout: str = "NHD",
    causal: bool = False,
    scale: Optional[float] = None,
    key_bias: Optional[torch.Tensor] = None,
    kv_lens: Optional[torch.Tensor] = None,
    dtype: torch.dtype = torch.float64,
    chunk_rows: int = 1024,
    block_mask: Optional[torch.Tensor] = None,
):
    """Exact attention in ``dtype`` (default fp64) with the same masking conventions, and the
    same block map as :func:`attention_reference` (``chunk_rows`` a multiple of 128 then).

    Returns ``(out [q's layout, dtype], lse [B, H, Sq])``; fully masked rows give 0 / -inf.
    For tests and accuracy reports; memory O(chunk_rows * Sk).
    """
    qh, kh, vh = (fmt.to_hnd(t, layout).to(dtype) for t in (q, k, v))
    b, h, sq, d = qh.shape
    hkv, sk = kh.shape[1:3]
    group = h // hkv
    scale = fmt.default_scale(d) if scale is None else float(scale)
    valid = fmt.valid_key_mask(kv_lens, b, sk, qh.device)
    bias = torch.where(valid, 0.0, -math.inf).to(dtype)[:, None, None, :]
    if key_bias is not None:
        kb = key_bias.to(qh.device, dtype)
        bias = bias + (kb[:, None, None, :] if kb.dim() == 2 else kb[:, :, None, :])
    kh = kh.repeat_interleave(group, 1)
    vh = vh.repeat_interleave(group, 1)
    outs, lses = [], []
    for r0 in range(0, sq, chunk_rows):
        r1 = min(sq, r0 + chunk_rows)
        s = torch.matmul(qh[:, :, r0:r1], kh.transpose(-1, -2)) * scale + bias
        if causal:
            q_idx = torch.arange(r0, r1, device=qh.device)
            s = s.masked_fill(torch.arange(sk, device=qh.device)[None, :] > q_idx[:, None], -math.inf)
        if block_mask is not None:
            s = s.masked_fill(~sparse.expand_rows(block_mask.to(qh.device), r0, r1, sk), -math.inf)
        lse = torch.logsumexp(s, dim=-1)
        finite = torch.isfinite(lse)
        p = torch.exp(s - torch.where(finite, lse, 0.0)[..., None])
        outs.append(torch.where(finite[..., None], torch.matmul(p, vh), 0.0))
        lses.append(lse)
    out = torch.cat(outs, 2) if outs else qh.new_zeros(b, h, 0, vh.shape[-1])
    lse = torch.cat(lses, 2) if lses else qh.new_zeros(b, h, 0)
    return (out.transpose(1, 2) if layout == "NHD" else out), lse
