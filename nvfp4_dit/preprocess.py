"""The reference preprocessing of Q, K and V in plain PyTorch: what ``csrc/quantize/`` computes on the
GPU, step for step (the layouts and codecs: :mod:`nvfp4_dit.format`; the contract: CONTRIBUTING.md).

* statistics: the per-head K and V means and the channel-balance statistics over a head's
  statistics tiles (at most 16 evenly strided 128-row tiles), the per-128-row-block Q means, the
  NaN/inf flags (:func:`k_mean`, :func:`q_block_means`,
  :func:`balance_statistics`, :func:`nonfinite_blocks`);
* :func:`quantize_qkv`: balance, smooth, scale and quantise into the kernel's layouts (the CUDA
  quantiser, :func:`nvfp4_dit.cuda.quantize.quantize_qkv`, writes the same bytes);
* :func:`correction`: the per-Q-block correction ``qm . (k - km)^T`` in the kernel's score units
  and storage format (fp16 under a power of two per 128-key tile), bit for bit what
  ``csrc/quantize/correction.cu`` writes;
* :func:`dequantize_qkv`: the quantised operands back to fp32, for the reference attention.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import smoothing
from .format import (BALANCE_QK_DEFAULT, CORRECTION_VALUE_BITS, QK_FORMAT_DEFAULT, QK_FORMATS, SEQ_TILE,
                     SUPPORTED_HEAD_DIMS, _power_of_two, channel_balance, Correction, dequantize_blocks,
                     dequantize_qk_rows, pad_dim, padded_head_dim, permute_k_rows, quantize_blocks,
                     quantize_qk_rows, QuantizedQKV, round_up, sampled_key_mask, statistics_row_mask,
                     store_correction, tensor_scale, to_hnd, valid_key_mask)


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
    q_smoothing: str = "block",
    basis_override: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
) -> QuantizedQKV:
    """Balance, smooth, scale and quantise Q, K, V into the kernel's layouts (pure torch, the
    reference path; the module docstring has the steps and the layouts).

    ``q_smoothing``: "block" smooths each Q block by its mean ``qm_b`` (the stored correction,
    :func:`correction`); "low_rank" by ``m_b``, its part in the head's basis
    (:mod:`nvfp4_dit.smoothing`; the result carries ``q_center``, ``q_basis`` and ``q_coeff``, and its
    correction comes from key projections). ``basis_override`` ``(center [B, H, D], basis
    [B, H, R, D])`` replaces the computed basis. The channel balance's statistics are those of
    ``q - qm_b`` either way.

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
    q_s = qh.float() - qm.repeat_interleave(SEQ_TILE, dim=2)[:, :, :sq]
    if balance_override is not None:
        balance = balance_override.float()[..., :d]
    else:
        balance = channel_balance(*balance_statistics(q_s, k_s, kv_lens)) if balance_qk else None
    low_rank = None
    if q_smoothing == "low_rank":
        if basis_override is not None:
            center, basis = (t.float()[..., :d] for t in basis_override)
        else:
            center, basis = smoothing.smoothing_basis(qm)
        coeff = smoothing.basis_coefficients(qm, center, basis)
        q_s = qh.float() - smoothing.smoothed_means(center, basis, coeff).repeat_interleave(SEQ_TILE, dim=2)[:, :, :sq]
        low_rank = (pad_dim(center, 2, dp), pad_dim(basis, 3, dp), coeff)
    elif q_smoothing != "block":
        raise ValueError(f"q_smoothing must be 'block' or 'low_rank', got {q_smoothing!r}")
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
        q_center=None if low_rank is None else low_rank[0], q_basis=None if low_rank is None else low_rank[1],
        q_coeff=None if low_rank is None else low_rank[2],
    )


CORRECTION_FIXED_BITS = 22
"""The correction's operands are integers of at most this many bits (plus sign) per row."""
_CORRECTION_EXPONENT_LIMIT = 100  # fixed-point row exponents are clamped to [-100, 100]


def correction_fixed_point(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows (last dim) of fp32 ``x`` in fixed point: ``(X int32 [..., D], e int32 [...])`` with
    ``x ~ X 2^(e - 22)``, ``|X| <= 2^22``. ``e`` is the row's power-of-two exponent (its largest
    |x| is below 2^e; clamped to [-100, 100]); non-finite values count as 0."""
    x = torch.where(torch.isfinite(x), x, torch.zeros_like(x))
    amax = x.abs().amax(-1) if x.shape[-1] else x.new_zeros(x.shape[:-1])
    e = (((amax.view(torch.int32) >> 23) & 0xFF) - 126).clamp(-_CORRECTION_EXPONENT_LIMIT, _CORRECTION_EXPONENT_LIMIT)
    top = float(1 << CORRECTION_FIXED_BITS)
    fixed = torch.round(x * _power_of_two(CORRECTION_FIXED_BITS - e)[..., None]).clamp(-top, top)
    return fixed.to(torch.int32), e.to(torch.int32)


def correction_limbs(fixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """int32 fixed point -> its signed 8-bit limbs ``(l0, l1, l2)``: fixed = l0 2^16 + l1 2^8 + l2,
    l1 and l2 in [-128, 127] and |l0| <= 64 (the int8 MMA operands of the CUDA correction)."""
    l2 = ((fixed + 128) & 255) - 128
    x1 = (fixed - l2) >> 8
    l1 = ((x1 + 128) & 255) - 128
    return (x1 - l1) >> 8, l1, l2


def correction_exponents(q_row_exponents: torch.Tensor, k_row_exponents: torch.Tensor,
                         score_exponents: torch.Tensor, head_dim_padded: int) -> torch.Tensor:
    """The power-of-two exponent of each stored correction tile (:class:`~nvfp4_dit.format.Correction`)
    from the fixed-point row exponents of the Q block means ``[B, H, n]`` and of the smoothed keys
    ``[B, H, Skp]`` (:func:`correction_fixed_point`) and the exponents of ``q_scale * k_scale``
    ``[B, H, n]``: int32 ``[B, H, n, Skp/128]``.

    |delta| < Dp 2^(eq + ek - u) (the fixed-point operands lie below 2^22 in units of 2^(e - 22)),
    so with e = eq + max_tile(ek) - u + log2(Dp) - 15 every value of the tile lies below 2^15 in
    units of 2^e: fp16 holds it with 11 significant bits (down to 2^-14 of the unit: 29 binades).
    Clamped to [-126, 111], so 2^e and 2^-e are normal fp32 numbers.
    """
    tile_max = k_row_exponents.unflatten(-1, (-1, SEQ_TILE)).amax(-1)   # [B, H, nk]
    e = (q_row_exponents[..., None] + tile_max[:, :, None, :] - score_exponents[..., None]
         + (head_dim_padded.bit_length() - 1) - CORRECTION_VALUE_BITS)
    return e.clamp(-126, 111).to(torch.int32)


def power_of_two_exponent(x: torch.Tensor) -> torch.Tensor:
    """The exponent of fp32 powers of two ``x`` (normal numbers): int32."""
    return ((x.float().view(torch.int32) >> 23) & 0xFF) - 127


def correction(qq: QuantizedQKV, block_start: int = 0, block_end: Optional[int] = None, *,
               key_chunk: Optional[int] = None, key_bias: Optional[torch.Tensor] = None,
               scale: Optional[float] = None) -> Correction:
    """The correction of Q blocks [block_start, block_end) as the kernel reads it (dense rows of a
    :class:`~nvfp4_dit.format.Correction`): delta = qm . k_smoothed^T / (q_scale * k_scale), the
    kernel's score units, per 128-key tile in fp16 under a power-of-two factor.

    Keys are in natural order. Added to the FP4 scores, it restores q . (k - km) up to the FP4
    error of (q - qm) and (k - km): q.(k-km) = (q-qm).(k-km) + qm.(k-km). The channel balance
    cancels in it exactly (qm s . ks / s), so it is computed without it.

    The arithmetic is that of the CUDA kernel (csrc/quantize/correction.cu), so the two agree bit
    for bit: each row of qm and of ks in 22-bit fixed point (:func:`correction_fixed_point`), split
    into three 8-bit limbs (:func:`correction_limbs`); every limb product but the lowest one,
    T = Xq . Xk - lq2 . lk2, summed exactly (integers below 2^53, so fp64 products are exact in any
    order); then one rounding to fp32 and exact power-of-two factors:
    delta = (fp32(T) 2^(ek - 22)) (2^(eq - 22) / (q_scale k_scale)); then stored
    (:func:`~nvfp4_dit.format.store_correction`, exponents :func:`correction_exponents`).

    Error against the exact product, per entry: at most Dp 2^(eq + ek - 22) / (q_scale k_scale)
    plus 2^-24 of the fp32 result (the 22-bit operands, the left-out limb pair, the fp32 rounding),
    plus the fp16 rounding: 2^-11 of the value, or 2^-25 of the tile's factor below fp16's normal
    range. The first part is below Dp 2^-20 amax|qm| amax|ks|; the fp16 rounding dominates, far
    below the FP4 error of the scores (the accuracy report shows no input class moves).
    ``key_chunk`` (keys per fp64 matmul; by default about 2 GB of temporaries) does not change the result.

    ``key_bias`` ([B, H or 1, Sk], in units of the scaled scores: a per-key mask, :mod:`nvfp4_dit.masks`)
    adds ``key_bias / (scale * q_scale * k_scale)`` to every row (-inf masks the key), rounded as the
    CUDA correction rounds it.
    """
    if qq.k_smoothed is None:
        raise ValueError("this QuantizedQKV carries no fp32 k_smoothed (it comes from the CUDA quantiser: "
                         "use nvfp4_dit.cuda.quantize.correction)")
    block_end = qq.num_q_blocks if block_end is None else block_end
    qm = qq.q_mean[:, :, block_start:block_end]
    b, h, n, dp = qm.shape
    hkv, skp = qq.k_smoothed.shape[1], qq.k_smoothed.shape[2]
    group = h // hkv
    q_fixed, eq = correction_fixed_point(qm)
    lhs = torch.cat([q_fixed, correction_limbs(q_fixed)[2]], -1).double().reshape(b, hkv, group * n, 2 * dp)
    k_fixed, ek = correction_fixed_point(qq.k_smoothed)
    ek = ek.repeat_interleave(group, dim=1)   # [B, H, Skp]
    bits = CORRECTION_FIXED_BITS
    key_factor = _power_of_two(ek - bits)[:, :, None, :]  # [B, H, 1, Skp]
    score_scale = qq.score_scale()[:, :, block_start:block_end]
    row_factor = _power_of_two(eq - bits) * (1.0 / score_scale)  # [B, H, n]
    delta = torch.empty(b, h, n, skp, dtype=torch.float32, device=qm.device)
    key_chunk = key_chunk or max(SEQ_TILE, (1 << 28) // max(1, b * h * n) // SEQ_TILE * SEQ_TILE)
    for k0 in range(0, skp, key_chunk):
        kf = k_fixed[:, :, k0:k0 + key_chunk]
        rhs = torch.cat([kf, -correction_limbs(kf)[2]], -1).double()  # Xq . Xk - lq2 . lk2
        t = torch.matmul(lhs, rhs.transpose(-1, -2)).view(b, h, n, -1)
        delta[..., k0:k0 + key_chunk] = (t.float() * key_factor[..., k0:k0 + key_chunk]) * row_factor[..., None]
    if key_bias is not None:
        if scale is None:
            raise ValueError("scale is needed with key_bias (the bias is in units of the scaled scores)")
        bias = pad_dim(key_bias.to(delta.device, torch.float32), 2, skp)[:, :, None, :]
        divisor = torch.tensor(scale, dtype=torch.float32) * score_scale
        delta += bias / divisor[..., None]
    group_q = qq.q_scale.shape[1] // qq.k_scale.shape[1]
    score_exponents = (power_of_two_exponent(qq.q_scale[:, :, block_start:block_end])
                       + power_of_two_exponent(qq.k_scale).repeat_interleave(group_q, dim=1)[:, :, None])
    return store_correction(delta, correction_exponents(eq, ek, score_exponents, dp))


def dequantize_qkv(qq: QuantizedQKV) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 (q_hat [B,H,Sqp,Dp], k_hat [B,Hkv,Skp,Dp] natural order, v_hat [B,Hkv,Skp,Dp])."""
    q_hat = dequantize_qk_rows(qq.q_data, qq.q_sf, qq.qk_format)
    k_hat = permute_k_rows(dequantize_qk_rows(qq.k_data, qq.k_sf, qq.qk_format), dim=2)
    v_hat = dequantize_blocks(qq.vt_data, qq.vt_sf).transpose(2, 3)
    return q_hat, k_hat, v_hat


