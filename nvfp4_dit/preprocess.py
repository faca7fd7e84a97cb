"""The reference preprocessing of Q, K and V in plain PyTorch: what ``csrc/quantize/`` computes on the
GPU, step for step (the layouts and codecs: :mod:`nvfp4_dit.format`; the contract: CONTRIBUTING.md).

* statistics: the per-head K and V means and the channel-balance statistics over a head's
  statistics tiles (at most 16 evenly strided 128-row tiles), the per-128-row-block Q means, the
  NaN/inf flags (:func:`k_mean`, :func:`q_block_means`,
  :func:`balance_statistics`, :func:`nonfinite_blocks`);
* :func:`quantize_qkv`: balance, smooth, scale and quantise into the kernel's layouts (the CUDA
  quantiser, :func:`nvfp4_dit.cuda.quantize.quantize_qkv`, writes the same bytes);
* the low-rank Q smoothing and its key projections: :mod:`nvfp4_dit.smoothing`;
* :func:`dequantize_qkv`: the quantised operands back to fp32, for the reference attention.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import smoothing
from .format import (BALANCE_QK_DEFAULT, QK_FORMAT_DEFAULT, QK_FORMATS, SEQ_TILE, SUPPORTED_HEAD_DIMS,
                     channel_balance, dequantize_blocks, dequantize_qk_rows, pad_dim, padded_head_dim,
                     permute_k_rows, quantize_blocks, quantize_qk_rows, QuantizedQKV, round_up, sampled_key_mask,
                     statistics_row_mask, tensor_scale, to_hnd, valid_key_mask)


def nonfinite_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_lens: Optional[torch.Tensor],
                     layout: str = "HND") -> tuple[torch.Tensor, torch.Tensor]:
    """Where a NaN/inf input sits, in the units that quantisation spreads it over.

    Returns ``(q_blocks [B, H, Sqp/128], kv [B, Hkv])`` bool: a 128-row Q block holds a non-finite
    element (its block mean carries it to every row of the block), or a valid key (j < kv_lens[b])
    of K or V does (the K mean carries it to the whole head). Keys past kv_lens are zeroed before
    quantisation and may hold anything. The CUDA quantiser returns the same flags for free
    (from its block maxima); this is the torch twin, one min/max reduction per row and no
    full-size temporary (``torch.isfinite`` would allocate several input-sized tensors).
    """
    def row_finite(t):
        lo, hi = torch.aminmax(t, dim=-1)  # NaN propagates; +-inf shows in one of the two
        return torch.isfinite(lo) & torch.isfinite(hi)

    q_hnd, k_hnd, v_hnd = (to_hnd(t, layout) for t in (q, k, v))
    b, h, sq, _ = q_hnd.shape
    nblk = round_up(max(sq, 1), SEQ_TILE) // SEQ_TILE
    q_bad = pad_dim(~row_finite(q_hnd), 2, nblk * SEQ_TILE).view(b, h, nblk, SEQ_TILE).any(-1)
    valid = valid_key_mask(kv_lens, b, k_hnd.shape[2], k_hnd.device)[:, None, :]
    kv_bad = ((~row_finite(k_hnd) | ~row_finite(v_hnd)) & valid).any(-1)
    return q_bad, kv_bad


def k_mean(k_hnd: torch.Tensor, kv_lens: Optional[torch.Tensor]) -> torch.Tensor:
    """km [B, Hkv, D] fp32: mean over the valid keys of the statistics tiles
    (:func:`~nvfp4_dit.format.sampled_key_mask`; every key up to 2,048), zero when a batch has
    none; also V's vm."""
    b, _, s, _ = k_hnd.shape
    sampled = sampled_key_mask(kv_lens, b, s, k_hnd.device)[:, None, :, None]
    count = sampled.sum(2).clamp_min(1).float()
    # Contiguous first: torch's summation order follows the strides, and the mean must not
    # depend on the caller's memory layout (a channels-last V gives the same bytes).
    return torch.where(sampled, k_hnd.float(), 0.0).contiguous().sum(2) / count


def q_block_means(q_hnd: torch.Tensor, per_block_mean: bool = True) -> torch.Tensor:
    """qm [B, H, Sqp/128, D] fp32: mean of each 128-row block over its valid rows.

    With ``per_block_mean=False`` every block gets the single per-(b, h) mean instead (less
    accurate on block-structured Q, see the reference tests).
    """
    b, h, s, d = q_hnd.shape
    nblk = round_up(max(s, 1), SEQ_TILE) // SEQ_TILE
    qf = q_hnd.float()
    if not per_block_mean:
        mean = qf.mean(2, keepdim=True) if s else qf.new_zeros(b, h, 1, d)
        return mean.expand(b, h, nblk, d).contiguous()
    padded = pad_dim(qf, 2, nblk * SEQ_TILE).unflatten(2, (nblk, SEQ_TILE))
    rows = torch.arange(nblk * SEQ_TILE, device=q_hnd.device).view(nblk, SEQ_TILE)
    count = (rows < s).sum(1).clamp_min(1).float()
    return padded.sum(3) / count[:, None]


def k_tile_means(k_hnd: torch.Tensor, kv_lens: Optional[torch.Tensor]) -> torch.Tensor:
    """[B, Hkv, Skp/128, D] fp32: each 128-key tile's mean of the raw K over its valid keys (0 for a
    tile without one), for the block-sparse estimate."""
    b, h, s, d = k_hnd.shape
    nk = round_up(max(s, 1), SEQ_TILE) // SEQ_TILE
    valid = valid_key_mask(kv_lens, b, s, k_hnd.device)
    kf = torch.where(valid[:, None, :, None], k_hnd.float(), 0.0)
    sums = pad_dim(kf, 2, nk * SEQ_TILE).unflatten(2, (nk, SEQ_TILE)).sum(3)
    count = pad_dim(valid, 1, nk * SEQ_TILE).view(b, nk, SEQ_TILE).sum(-1).float()
    return torch.where(count[:, None, :, None] > 0, sums / count.clamp_min(1)[:, None, :, None], 0.0)


def q_block_similarity(q_hnd: torch.Tensor) -> torch.Tensor:
    """[B, H, Sqp/128] fp32: each 128-row Q block's mean pairwise cosine of its raw rows, from the
    unit rows x_i (0 for a zero row) and the n nonzero rows: (|sum x_i|^2 - n) / (n (n - 1)); 1 for
    n < 2. Low values say the block's mean is a poor stand-in for its rows."""
    b, h, s, d = q_hnd.shape
    nq = round_up(max(s, 1), SEQ_TILE) // SEQ_TILE
    qf = q_hnd.float()
    norm = qf.norm(dim=-1, keepdim=True)
    unit = torch.where(norm > 0, qf / norm.clamp_min(1e-30), 0.0)
    sums = pad_dim(unit, 2, nq * SEQ_TILE).unflatten(2, (nq, SEQ_TILE)).sum(3)
    n = pad_dim((norm[..., 0] > 0).float(), 2, nq * SEQ_TILE).view(b, h, nq, SEQ_TILE).sum(-1)
    s2 = (sums * sums).sum(-1)
    return torch.where(n >= 2, (s2 - n) / (n * (n - 1)).clamp_min(1), 1.0)


def balance_statistics(q_smoothed: torch.Tensor, k_smoothed: torch.Tensor,
                       kv_lens: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(amax|Q_c - qm_c|, amax|K_c - km_c|) [B, Hkv, D] fp32: the statistics of
    :func:`channel_balance`, taken on what is quantised, over the statistics tiles
    (:func:`~nvfp4_dit.format.statistics_row_mask`): Q's over those rows of every query head that
    shares a kv head, K's over its sampled valid keys (``k_smoothed`` holds zeros past kv_lens)."""
    b, h, sq, d = q_smoothed.shape
    hkv, sk = k_smoothed.shape[1], k_smoothed.shape[2]
    q_rows = statistics_row_mask(torch.full((1,), sq), sq)[0].to(q_smoothed.device)
    k_rows = sampled_key_mask(kv_lens, b, sk, k_smoothed.device)[:, None, :, None]
    q_dev = q_smoothed[:, :, q_rows].abs()
    amax_q = q_dev.reshape(b, hkv, -1, d).amax(2) if q_dev.shape[2] else q_smoothed.new_zeros(b, hkv, d)
    amax_k = torch.where(k_rows, k_smoothed.abs(), 0.0).amax(2) if sk else k_smoothed.new_zeros(b, hkv, d)
    return amax_q.float(), amax_k.float()


def quantize_qkv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    layout: str = "NHD",
    kv_lens: Optional[torch.Tensor] = None,
    balance_qk: bool = BALANCE_QK_DEFAULT,
    per_block_mean: bool = True,
    q_mean: Optional[torch.Tensor] = None,
    k_mean_override: Optional[torch.Tensor] = None,
    v_mean_override: Optional[torch.Tensor] = None,
    balance_override: Optional[torch.Tensor] = None,
    qk_format: str = QK_FORMAT_DEFAULT,
    basis_override: Optional[smoothing.Basis] = None,
    coeff_override: Optional[torch.Tensor] = None,
) -> QuantizedQKV:
    """Balance, smooth, scale and quantise Q, K, V into the kernel's layouts (pure torch, the
    reference path; the module docstring has the steps and the layouts).

    Q block b is smoothed by ``m_b``, its mean's part in the head's basis (:mod:`nvfp4_dit.smoothing`;
    the result carries ``q_center``, ``q_basis``, ``q_basis_scale`` and ``q_coeff``); ``basis_override``
    (a :class:`~nvfp4_dit.smoothing.Basis`, e.g. a kernel's, its vectors with D or Dp columns)
    replaces the computed one, ``coeff_override`` [B, H, Sqp/128, R] the coefficients (a kernel's
    dot products run in another order): given both, the bytes are the kernel's. The channel balance's statistics are
    those of ``q - qm_b`` (the block means, known before the basis).

    ``q_mean`` [B, H, Sqp/128, D], ``k_mean_override`` and ``v_mean_override`` [B, Hkv, D] replace
    the computed means, ``balance_override`` [B, Hkv, D] the balance (implies ``balance_qk``); tests
    use them to compare a kernel's bytes exactly given the kernel's own (reduction-order dependent)
    means, from which the balance can differ where a channel's ratio sits on a power of two.
    Everything else follows from the means and the balance exactly.
    """
    qh, kh, vh = (to_hnd(t, layout) for t in (q, k, v))
    b, h, sq, d = qh.shape
    hkv, sk = kh.shape[1], kh.shape[2]
    dp = padded_head_dim(d)
    if dp is None:
        raise ValueError(f"head dim {d} is above the largest supported ({SUPPORTED_HEAD_DIMS[-1]})")
    sqp, skp = round_up(max(sq, 1), SEQ_TILE), round_up(max(sk, 1), SEQ_TILE)
    nblk = sqp // SEQ_TILE
    group = h // hkv

    # Overrides may come with the padded head dim (as a kernel writes them); slice to D.
    km = k_mean(kh, kv_lens) if k_mean_override is None else k_mean_override.float()[..., :d]
    vm = k_mean(vh, kv_lens) if v_mean_override is None else v_mean_override.float()[..., :d]
    qm = q_block_means(qh, per_block_mean) if q_mean is None else q_mean.float()[..., :d]
    # Smooth before padding so padded rows stay exactly zero. Keys past kv_lens are padding
    # too: zeroing them keeps their values out of the 16-token V scales of valid keys.
    valid = valid_key_mask(kv_lens, b, sk, kh.device)[:, None, :, None]
    k_s = torch.where(valid, kh.float() - km[:, :, None, :], 0.0)
    v_s = torch.where(valid, vh.float() - vm[:, :, None, :], 0.0)
    if balance_override is not None:
        balance = balance_override.float()[..., :d]
    elif balance_qk:   # its statistics are those of q - qm_b (the block means, known before the basis)
        q_dev = qh.float() - qm.repeat_interleave(SEQ_TILE, dim=2)[:, :, :sq]
        balance = channel_balance(*balance_statistics(q_dev, k_s, kv_lens))
    else:
        balance = None
    if basis_override is not None:
        basis = smoothing.Basis(basis_override.center.float()[..., :d], basis_override.rows.float()[..., :d],
                                basis_override.scale.float())
    else:
        basis = smoothing.smoothing_basis(qm)
    coeff = smoothing.basis_coefficients(qm, basis) if coeff_override is None else coeff_override.float()
    q_s = qh.float() - smoothing.smoothed_means(basis, coeff).repeat_interleave(SEQ_TILE, dim=2)[:, :, :sq]
    k_b, q_b = k_s, q_s
    if balance is not None:  # powers of two: exact
        k_b = k_s / balance[:, :, None, :]
        q_b = q_s * balance.repeat_interleave(group, dim=1)[:, :, None, :]

    def absmax(x, dims):
        return x.abs().amax(dims) if x.numel() else x.new_zeros([n for i, n in enumerate(x.shape) if i not in dims])

    k_scale = tensor_scale(absmax(k_b, (2, 3)))
    v_scale = tensor_scale(absmax(v_s, (2, 3)))
    q_rows = pad_dim(pad_dim(q_b, 3, dp), 2, sqp)
    q_scale = tensor_scale(absmax(q_rows.unflatten(2, (nblk, SEQ_TILE)), (3, 4)))

    if qk_format not in QK_FORMATS:
        raise ValueError(f"qk_format must be one of {QK_FORMATS}, got {qk_format!r}")
    q_data, q_sf = quantize_qk_rows(q_rows / q_scale.repeat_interleave(SEQ_TILE, dim=2)[..., None], qk_format)
    k_rows = pad_dim(pad_dim(k_b / k_scale[:, :, None, None], 3, dp), 2, skp)
    k_data, k_sf = quantize_qk_rows(permute_k_rows(k_rows, dim=2), qk_format)
    vt = pad_dim(pad_dim(v_s / v_scale[:, :, None, None], 3, dp), 2, skp).transpose(2, 3)
    vt_data, vt_sf = quantize_blocks(vt)
    km_q = km.repeat_interleave(group, dim=1)
    q_dot_km = (qh.float() * km_q[:, :, None, :]).sum(-1)
    return QuantizedQKV(
        q_data=q_data, q_sf=q_sf, k_data=k_data, k_sf=k_sf, vt_data=vt_data, vt_sf=vt_sf,
        q_mean=pad_dim(qm, 3, dp), k_mean=pad_dim(km, 2, dp), v_mean=pad_dim(vm, 2, dp),
        q_scale=q_scale, k_scale=k_scale, v_scale=v_scale,
        balance=None if balance is None else pad_dim(balance, 2, dp, 1.0),
        q_dot_km=q_dot_km, k_smoothed=pad_dim(pad_dim(k_s, 3, dp), 2, skp), seq_q=sq, seq_k=sk, head_dim=d,
        head_dim_padded=dp, qk_format=qk_format, k_tile_mean=pad_dim(k_tile_means(kh, kv_lens), 3, dp),
        q_similarity=q_block_similarity(qh),
        q_center=pad_dim(basis.center, 2, dp), q_basis=pad_dim(basis.rows, 3, dp), q_basis_scale=basis.scale,
        q_coeff=coeff,
    )


def dequantize_qkv(qq: QuantizedQKV) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 (q_hat [B,H,Sqp,Dp], k_hat [B,Hkv,Skp,Dp] natural order, v_hat [B,Hkv,Skp,Dp])."""
    q_hat = dequantize_qk_rows(qq.q_data, qq.q_sf, qq.qk_format)
    k_hat = permute_k_rows(dequantize_qk_rows(qq.k_data, qq.k_sf, qq.qk_format), dim=2)
    v_hat = dequantize_blocks(qq.vt_data, qq.vt_sf).transpose(2, 3)
    return q_hat, k_hat, v_hat


