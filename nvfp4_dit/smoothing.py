"""Low-rank Q smoothing: each Q block smoothed by its mean's part in a small per-head basis, and the
correction that gives the scores back, formed from per-key projections instead of stored per
(Q block, key).

Per query head (plain PyTorch; the CUDA quantiser repeats the steps, in a fixed order):

1. ``g`` (``q_center``): the mean of the head's finite 128-row block means ``qm_b``.
2. ``basis`` [R, Dp]: R = :data:`Q_BASIS_RANK` orthonormal directions (rows; zero rows where the
   deviations ``qm_b - g`` span fewer) that hold most of the deviations: :data:`BASIS_ITERATIONS`
   steps of subspace iteration on their Gram matrix, from a fixed start (:func:`basis_start`), each
   step orthonormalised by modified Gram-Schmidt (two sweeps; the last step zeroes the directions
   under :data:`_ORTHOGONAL_FLOOR`). Deterministic, finite whatever the means (NaN blocks are left
   out, all-zero means give zero rows), and per head: independent of how many heads share a launch.
3. ``a_b = basis (qm_b - g)``, stored over the basis scale (``q_coeff`` [R] per block: a_b / scale,
   the scale the power of two just above the deviations), and Q block b is smoothed by
   ``m_b = g + basis^T a_b`` instead of ``qm_b``; what the basis misses stays in ``q - m_b`` and is
   quantised with it.
4. The correction ``m_b . (k_j - km)`` = ``u_j0 + sum_i (a_bi / scale) u_ji`` with the key projections
   ``u_j = [g . k'_j, (basis_1 . k'_j) scale, ..., (basis_R . k'_j) scale]`` (k' = k - km, unbalanced:
   the channel balance cancels in the product), R + 1 = :data:`KEY_PROJECTION_COLUMNS` numbers per key
   and query head in q . k units, computed once per call. A per-key mask bias joins ``u_j0``, whose coefficient is 1.
   They are stored in fp16 under one power-of-two factor per 128-key tile
   (:class:`KeyProjections`); the attention kernel forms a tile's corrections from them and the Q
   block's ``a_b``, and multiplies by ``factor / (q_scale_b k_scale)`` into its score units.

Nothing of size (Q blocks) x (keys) exists. Q whose block means lie in R directions around their
mean is smoothed exactly as by its block means; for others the part of ``qm_b - m_b`` left in the
smoothed rows costs accuracy (docs/measurements.md: the classes of 64 blocks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .format import FP16_MAX, SEQ_TILE, _power_of_two, pad_dim

Q_BASIS_RANK = 15
"""Directions of the smoothing basis per query head. 1 + 15 fp16 key projections are 32 bytes per
key and query head, which the attention kernel's shared memory holds beside its pipeline stages."""

KEY_PROJECTION_COLUMNS = Q_BASIS_RANK + 1

BASIS_ITERATIONS = 8
"""Subspace-iteration steps: on the accuracy report's classes of 64 blocks the basis after 4 to 32
steps gives the SVD basis' attention accuracy within 0.0003 cos (tests/test_smoothing.py checks the
subspace against the SVD's on a decaying spectrum)."""

PROJECTION_VALUE_BITS = 15
"""A projection tile's finite values lie below 2^15 in units of its factor (fp16 holds them)."""

_ORTHOGONAL_FLOOR = 2.0 ** -14
"""The last step's Gram-Schmidt zeroes a row left with at most this fraction of the first row's
norm before it. There the rows have converged to the Gram matrix's leading eigenvectors and their
norms before it are its eigenvalues, the squared singular values of the deviations: a direction
zeroed holds under 2^-7 of the leading one's singular value (nothing to smooth), or none at all but
fp32 rounding of the Gram matrix (about 2^-20 of the leading eigenvalue: the deviations span fewer
directions than the rank). Earlier steps keep every nonzero row, so that a direction the start
barely touches can still grow."""


def basis_start(rank: int, dp: int, device=None) -> torch.Tensor:
    """The fixed start of the subspace iteration, [rank, dp] fp32: entry (i, c) is the 32-bit hash
    (:func:`hash32`) of i * dp + c as a value in [-1, 1), the same for every head: integers and one
    exact conversion, so device code gets the same start bit for bit."""
    index = torch.arange(rank * dp, dtype=torch.int64, device=device).view(rank, dp)
    return (hash32(index) >> 8).float() / float(1 << 23) - 1.0


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix (xor-shift-multiply, the constants of Wellons' lowbias32) of int64 ``x``
    holding unsigned 32-bit values: neighbouring inputs give unrelated outputs."""
    mask = 0xFFFFFFFF
    x = x & mask
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & mask
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & mask
    return x ^ (x >> 16)


def _orthonormalise(rows: torch.Tensor, floor: float) -> torch.Tensor:
    """Modified Gram-Schmidt over the rows of [..., R, Dp] (fp32), in row order, two sweeps over
    the earlier rows (one leaves a row that was mostly along them with rounding error along them of
    the size of what remains); a row left with ``floor`` of the first row's norm or less becomes
    zero."""
    out = rows.clone()
    first = out[..., 0, :].norm(dim=-1, keepdim=True)
    for i in range(out.shape[-2]):
        x = out[..., i, :]
        for j in [*range(i), *range(i)]:
            y = out[..., j, :]
            x = x - (x * y).sum(-1, keepdim=True) * y
        after = x.norm(dim=-1, keepdim=True)
        keep = (after > floor * first) & (after > 0)
        out[..., i, :] = torch.where(keep, x / torch.where(keep, after, 1.0), 0.0)
    return out


@dataclass
class Basis:
    """One call's smoothing basis per query head: ``center`` g [B, H, Dp], ``rows`` [B, H, R, Dp]
    (orthonormal or zero) and ``scale`` [B, H], the power of two just above the deviations' largest
    magnitude. The coefficients and the projections carry it (a_b / scale, (row . k') * scale), so
    every projection column is in q . k units and scaling Q by a power of two c and K by 1/c leaves
    every stored byte of the correction as it was."""

    center: torch.Tensor
    rows: torch.Tensor
    scale: torch.Tensor


def smoothing_basis(q_mean: torch.Tensor, rank: int = Q_BASIS_RANK, iterations: int = BASIS_ITERATIONS) -> Basis:
    """The :class:`Basis` of the block means ``q_mean`` [B, H, n, Dp] (steps 1-2 of the module
    docstring)."""
    qm = q_mean.float()
    finite = torch.isfinite(qm).all(-1, keepdim=True)           # [B, H, n, 1]
    count = finite.sum(-2).clamp_min(1).float()                    # [B, H, 1]
    center = torch.where(finite, qm, 0.0).sum(-2) / count
    dev = torch.where(finite, qm - center[:, :, None, :], 0.0)
    # A power of two puts the deviations at most 1 (exact): the Gram matrix stays finite.
    amax = dev.abs().amax((-2, -1)) if dev.shape[-2] else dev.new_zeros(dev.shape[:2])
    _, e = torch.frexp(torch.where(amax > 0, amax, 1.0))
    e = e.to(torch.int32).clamp(-126, 127)
    dev = dev * _power_of_two(-e)[..., None, None]
    gram = dev.transpose(-1, -2) @ dev                              # [B, H, Dp, Dp]
    rows = basis_start(rank, qm.shape[-1], qm.device).expand(*qm.shape[:2], rank, qm.shape[-1])
    for it in range(iterations):
        rows = _orthonormalise(rows @ gram, _ORTHOGONAL_FLOOR if it == iterations - 1 else 0.0)
    return Basis(center, rows.contiguous(), _power_of_two(e))


def basis_coefficients(q_mean: torch.Tensor, basis: Basis) -> torch.Tensor:
    """The stored coefficients [B, H, n, R] fp32: each block mean's coordinates in the basis rows
    over the basis scale, ``rows (qm_b - g) / scale``, computed in fp64 and rounded once."""
    dev = q_mean.double() - basis.center.double()[:, :, None, :]
    a = dev @ basis.rows.double().transpose(-1, -2) / basis.scale.double()[..., None, None]
    return a.float().contiguous()


def smoothed_means(basis: Basis, coeff: torch.Tensor) -> torch.Tensor:
    """``m_b = g + rows^T (coeff_b * scale)`` [B, H, n, Dp] fp32: what Q block b is smoothed by, as
    the kernel forms it: from g, one fp32 fused multiply-add per row in row order (each computed
    exactly in fp64, then rounded to fp32)."""
    a = (coeff * basis.scale[..., None, None]).double()                       # exact: a power of two
    rows = basis.rows.double()
    m = basis.center[:, :, None, :].expand(*coeff.shape[:3], basis.center.shape[-1]).float()
    for i in range(rows.shape[2]):
        m = (m.double() + a[..., i:i + 1] * rows[:, :, None, i, :]).float()
    return m


@dataclass
class KeyProjections:
    """The key projections ``u`` of every query head (step 4 of the module docstring), as the
    attention kernel reads them: ``values`` fp16 [B, H, Skp, KEY_PROJECTION_COLUMNS], natural key
    order, and ``factors`` fp32 [B, H, Skp/128], one power of two per 128-key tile: the tile's
    projections are ``values * factor`` (q . k units)."""

    values: torch.Tensor
    factors: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        """fp32 [B, H, Skp, KEY_PROJECTION_COLUMNS]."""
        per_key = self.factors.repeat_interleave(SEQ_TILE, -1)
        return self.values.float() * per_key[..., None]


def projection_exponents(u: torch.Tensor) -> torch.Tensor:
    """int32 [B, H, Skp/128]: the factor exponent e of each 128-key tile of ``u`` [B, H, Skp, C]:
    its largest finite |u| lies below 2^(e + 15); clamped to [-126, 111] (2^e and 2^-e are normal)."""
    tiles = u.unflatten(2, (-1, SEQ_TILE))
    amax = torch.where(torch.isfinite(tiles), tiles.abs(), 0.0).amax((-2, -1))
    _, e = torch.frexp(torch.where(amax > 0, amax, 1.0))
    e = torch.where(amax > 0, e.to(torch.int32) - PROJECTION_VALUE_BITS, -126)
    return e.clamp(-126, 111).to(torch.int32)


def key_projections(k_smoothed: torch.Tensor, basis: Basis, *, key_bias: Optional[torch.Tensor] = None,
                    scale: Optional[float] = None) -> KeyProjections:
    """The stored key projections of ``k_smoothed`` [B, Hkv, Skp, Dp] (k - km, zero past kv_lens and
    in the padding) for the query heads' ``basis``: ``[g . k', (row_i . k') * basis.scale]``.

    Each projection is an fp32 dot product over Dp, then ``values = fp16(u 2^-e)`` (nearest even,
    finite values saturated at +-65504, +-inf and NaN kept) with the tile's exponent
    (:func:`projection_exponents`). ``key_bias`` ([B, H or 1, Sk], in units of the scaled scores, -inf
    masks a key) adds ``key_bias / scale`` to ``u_j0`` before the rounding.

    Error of a correction ``u_j0 + sum_i a_bi u_ji`` formed from the stored values, against the
    same sum of exact projections: at most 2^-11 sum_i |a_bi u_ji| (fp16's rounding of each value,
    a_b0 = 1) plus (R + 1) 2^-25 |a|_max 2^e (fp16's subnormal step under the tile's factor), plus
    the fp32 dot products (Dp 2^-24 |w| |k'|) and the kernel's fp32 sum; ``tests/test_smoothing.py``
    checks it against fp64.
    """
    b, hkv, skp, dp = k_smoothed.shape
    h = basis.center.shape[1]
    group = h // hkv
    weights = torch.cat([basis.center[:, :, None, :], basis.rows], 2).float()   # [B, H, C, Dp]
    keys = k_smoothed.float().repeat_interleave(group, dim=1)                 # [B, H, Skp, Dp]
    u = (keys.double() @ weights.double().transpose(-1, -2)).float()         # [B, H, Skp, C]
    u[..., 1:] = u[..., 1:] * basis.scale[:, :, None, None]                  # a power of two: exact
    if key_bias is not None:
        if scale is None:
            raise ValueError("scale is needed with key_bias (the bias is in units of the scaled scores)")
        bias = key_bias.to(u.device, torch.float32)
        bias = bias[:, None, :] if bias.dim() == 2 else bias
        bias = pad_dim(bias, 2, skp).expand(b, h, skp)
        u[..., 0] = u[..., 0] + bias / torch.tensor(scale, dtype=torch.float32)
    e = projection_exponents(u)
    scaled = u * _power_of_two(-e).repeat_interleave(SEQ_TILE, -1)[..., None]
    scaled = torch.where(torch.isfinite(u), scaled.clamp(-FP16_MAX, FP16_MAX), scaled)
    return KeyProjections(scaled.half().contiguous(), _power_of_two(e))


def correction_from_projections(proj: KeyProjections, coeff: torch.Tensor, score_scale: torch.Tensor) -> torch.Tensor:
    """The correction in the kernel's score units, fp32 [B, H, n, Skp], of the Q blocks of ``coeff``
    [B, H, n, R] with their ``score_scale`` (q_scale * k_scale) [B, H, n]:
    ``(u_j0 + sum_i a_bi u_ji) * (factor / score_scale)``, the sum of the fp16 values in fp64
    (exact products; the kernel's fp32 sum differs by its rounding), then fp32."""
    vals = proj.values.double()                                               # [B, H, Skp, C]
    a = torch.cat([torch.ones_like(coeff[..., :1]), coeff], -1).double()      # [B, H, n, C]
    total = (a @ vals.transpose(-1, -2)).float()                              # [B, H, n, Skp]
    unit = proj.factors.repeat_interleave(SEQ_TILE, -1)[:, :, None, :] / score_scale[..., None]
    return total * unit


def residual_norm(q_mean: torch.Tensor, basis: Basis) -> torch.Tensor:
    """|qm_b - m_b| per block [B, H, n]: how much of each block mean the basis leaves in the rows."""
    return (q_mean.float() - smoothed_means(basis, basis_coefficients(q_mean, basis))).norm(dim=-1)


__all__ = ["Q_BASIS_RANK", "KEY_PROJECTION_COLUMNS", "BASIS_ITERATIONS", "Basis", "KeyProjections", "basis_start",
           "smoothing_basis", "basis_coefficients", "smoothed_means", "key_projections",
           "projection_exponents", "correction_from_projections", "residual_norm"]
