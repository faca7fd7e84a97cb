"""The NVFP4 attention format: the one Python definition the CUDA kernels must match byte for byte.

NVFP4 here is two-level: e2m1 data in blocks of 16 elements, each block scaled by one ue4m3 (e4m3,
sign 0) byte, under an fp32 power-of-two tensor scale. Everything below is plain PyTorch, runs on
CPU and on any GPU, and is deliberately written as simple elementwise arithmetic so the device code
in ``csrc/common/format.cuh`` can mirror it operation for operation.

Before quantisation, Q and K may be balanced per channel (``balance_qk``): Q times ``s_c``, K
divided by it, ``s_c`` a power of two near sqrt(amax|K_c| / amax|Q_c|), so q . k is unchanged
exactly. Then every tensor is smoothed by its mean (K per head, Q per 128-row block, V per head)
and divided by its tensor scale (Q per 128-row block, K and V per head): the power of two that puts
the largest |x| in (1344, 2688], so the largest block scale lands in the top octave of ue4m3.
Power-of-two factors are exact, so quantisation is equivariant under power-of-two scaling of the
inputs, and the scales fold into the softmax scale (Q, K) and the output (V).

Layouts (``Sqp``/``Skp`` are the sequence lengths padded to 128, ``Dp`` the padded head dim):

============  =============================  ===============================================
tensor        shape (uint8 unless noted)     meaning
============  =============================  ===============================================
q_data        [B, H, Sqp, Dp/2]              (Q - qm) s / q_scale, two e2m1 per byte, low nibble first
q_sf          [B, H, Sqp, Dp/16]             its ue4m3 scales, row-major
k_data        [B, Hkv, Skp, Dp/2]            (K - km) / s / k_scale, rows permuted inside 32-key groups
k_sf          [B, Hkv, Skp, Dp/16]           its scales, rows permuted the same way
vt_data       [B, Hkv, Dp, Skp/2]            ((V - vm) / v_scale) transposed, packed along tokens
vt_sf         [B, Hkv, Dp, Skp/16]           its scales, one per 16 tokens
q_mean        [B, H, Sqp/128, Dp] float32    per-128-row-block Q means (qm), before balancing
q_center      [B, H, Dp] float32             low-rank Q smoothing (nvfp4_dit.smoothing): the center g
q_basis       [B, H, 15, Dp] float32         its basis rows
q_basis_scale [B, H] float32                 the basis scale s (a power of two)
q_coeff       [B, H, Sqp/128, 15] float32    each block's coefficients a_b / s (smoothed by g + a_b basis)
k_mean        [B, Hkv, Dp] float32           per-head K mean over the valid keys (km), before balancing
v_mean        [B, Hkv, Dp] float32           per-head V mean over the valid keys (vm)
q_scale       [B, H, Sqp/128] float32        tensor scale of each 128-row Q block (a power of two)
k_scale       [B, Hkv] float32               tensor scale of K per head
v_scale       [B, Hkv] float32               tensor scale of V per head
balance       [B, Hkv, Dp] float32 or None   the channel balance s (None: not balanced, s = 1)
q_dot_km      [B, H, Sq] float32             q . km, to give back the true LSE
k_tile_mean   [B, Hkv, Skp/128, Dp] float32  per-128-key-tile mean of the raw K (valid keys)
q_similarity  [B, H, Sqp/128] float32        per-Q-block mean pairwise cosine of the raw rows
============  =============================  ===============================================

Row-major scales put the four scale bytes of one row's 64-wide K chunk into one aligned 32-bit
word, which is exactly one scale register of ``mma ... block_scale.scale_vec::4X`` (byte j scales
k in [16j, 16j + 16)).

With ``qk_format="mxfp8"`` Q and K are e4m3 bytes instead, ``q_data [B, H, Sqp, Dp]`` and
``k_data [B, Hkv, Skp, Dp]`` (K rows permuted the same way), with one ue8m0 scale byte per 32
elements, ``q_sf [B, H, Sqp, Dp/32]`` and ``k_sf``; everything else is as above.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from .defaults import BALANCE_QK_DEFAULT, QK_FORMAT_DEFAULT, QK_FORMATS  # noqa: F401 (re-exported)

BLOCK = 16
"""Elements per scale block."""

SEQ_TILE = 128
"""Sequences are zero padded to a multiple of this (the kernel's Q and K tile)."""

K_PERM_GROUP = 32
"""The K row permutation acts inside groups of this many keys."""

E2M1_MAX = 6.0
E4M3_MAX = 448.0

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""Magnitudes of e2m1 codes 0..7; bit 3 is the sign."""

P_RANGE = E4M3_MAX * E2M1_MAX
"""2688: unnormalised softmax probabilities are scaled into [0, P_RANGE] before P quantisation,
so the per-16-key scale max(P)/6 uses the whole ue4m3 range."""

TENSOR_SCALE_RANGE = E4M3_MAX * E2M1_MAX
"""2688: a tensor scale t puts the largest |x| / t of a tensor in (1344, 2688], so its largest
block scale e4m3(amax / 6) lands in the top octave of ue4m3."""

BALANCE_MAX_EXPONENT = 64
"""The channel balance s_c lies in [2^-64, 2^64]."""

SUPPORTED_HEAD_DIMS = (64, 128)

MX_BLOCK = 32
UE8M0_BIAS = 127

STATISTICS_TILES = 16
"""The per-head statistics (the K and V means, the channel balance's maxima) are taken over at most
this many 128-row tiles of a head, evenly strided (:func:`statistics_row_mask`): they are exact
transforms whatever their value, and a sample keeps the quantiser to one read of its inputs."""


def _k_row_perm() -> tuple[int, ...]:
    # Stored row r = 8a + 2b + c holds token 8b + 2a + c: the two 2-bit fields a and b swap.
    # After this, lane 4g+t of the QK^T accumulator owns tokens 8t..8t+7 of each 32-key group,
    # which is exactly the k range of the PV A-fragment it must feed (no register shuffles).
    perm = []
    for r in range(K_PERM_GROUP):
        a, b, c = r // 8, (r // 2) % 4, r % 2
        perm.append(8 * b + 2 * a + c)
    return tuple(perm)


K_ROW_PERM = _k_row_perm()
"""``K_ROW_PERM[r]`` is the token stored at row r of a 32-key group. The map is an involution."""


# ---------------------------------------------------------------------------------------------
# Scalar codecs
# ---------------------------------------------------------------------------------------------

def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """Round ``x`` to e2m1 codes (uint8, 0..15): nearest, ties to even code, saturating at 6.

    The sign bit follows the sign of ``x`` (small negatives give -0, code 8); NaN gives code 0.
    """
    x = x.float()
    a = x.abs()
    # Thresholds between neighbouring magnitudes; at a tie the even code wins, hence the
    # alternation of <= (round down to even) and < (round up to even).
    code = torch.zeros_like(a, dtype=torch.uint8)
    code = torch.where(a > 0.25, 1, code)
    code = torch.where(a >= 0.75, 2, code)
    code = torch.where(a > 1.25, 3, code)
    code = torch.where(a >= 1.75, 4, code)
    code = torch.where(a > 2.5, 5, code)
    code = torch.where(a >= 3.5, 6, code)
    code = torch.where(a > 5.0, 7, code).to(torch.uint8)
    sign = (torch.signbit(x) & ~torch.isnan(x)).to(torch.uint8) << 3
    return code | sign


_E2M1_TABLE = torch.tensor(
    list(E2M1_VALUES) + [-v for v in E2M1_VALUES], dtype=torch.float32
)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (uint8, low 4 bits) to float32."""
    table = _E2M1_TABLE.to(codes.device)
    return table[(codes & 0xF).long()]


def e4m3_encode(x: torch.Tensor) -> torch.Tensor:
    """float -> e4m3fn bits (uint8), round to nearest even, satfinite (|x| > 448 and inf -> 448).

    NaN stays NaN (0x7F). torch's own cast turns out-of-range values into NaN, hence the clamp.
    """
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def e4m3_decode(bits: torch.Tensor) -> torch.Tensor:
    """e4m3fn bits (uint8) -> float32."""
    return bits.view(torch.float8_e4m3fn).float()


# ---------------------------------------------------------------------------------------------
# Tensor scales and the channel balance (powers of two from exponents: exact, scale-equivariant)
# ---------------------------------------------------------------------------------------------

def _frexp(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(m, e) with x = m * 2^e, m in [0.5, 1) (fp32; x > 0 finite)."""
    m, e = torch.frexp(x.float())
    return m, e.to(torch.int32)


def _power_of_two(exponent: torch.Tensor) -> torch.Tensor:
    return torch.ldexp(torch.ones(exponent.shape, dtype=torch.float32, device=exponent.device), exponent)


def tensor_scale(absmax: torch.Tensor) -> torch.Tensor:
    """The tensor scale of a tensor whose largest magnitude is ``absmax``: the smallest power of
    two t with absmax / t <= 2688 (so absmax / t lies in (1344, 2688]), kept in [2^-126, 2^127].
    1 where absmax is 0 or not finite (a NaN / inf input: the op reports those rows as NaN).

    2688 = 0.65625 * 2^12, so with absmax = m * 2^e (m in [0.5, 1)) the exponent is
    e - 12 + (m > 0.65625): integers only, which the CUDA code (``tensor_scale`` in
    ``csrc/common/format.cuh``) repeats bit for bit.
    """
    a = absmax.float()
    ok = torch.isfinite(a) & (a > 0)
    m, e = _frexp(torch.where(ok, a, 1.0))
    exponent = (e - 12 + (m > 0.65625).to(torch.int32)).clamp(-126, 127)
    return torch.where(ok, _power_of_two(exponent), 1.0)


def channel_balance(amax_q: torch.Tensor, amax_k: torch.Tensor) -> torch.Tensor:
    """The channel balance s [..., D] of one head from its per-channel statistics [..., D]: Q is
    multiplied by s_c and K divided by it, which leaves q . k unchanged exactly.

    s_c = 2^e with 2^(2e-1) <= r_c < 2^(2e+1): the power of two nearest sqrt(r_c) on a log scale,
    where r_c = (amax_k[c] / amax_q[c]) / (max amax_k / max amax_q) is channel c's ratio relative to
    the head's. Channels whose ratio lies within a factor 2 of the head's keep s_c = 1 (a factor
    common to all channels would only move the tensor scales); the others, where Q and K put their
    energy in different channels, are brought to the same magnitude, so neither side's block scales
    are set by the other side's large channels.

    Exact: the numerator and denominator of r_c are products of two fp32 values, exact in fp64, and
    floor(log2 r_c) comes from their exponents and one mantissa compare. A power-of-two factor c on
    Q and 1/c on K leaves s unchanged. s_c = 1 where a statistic is 0 or not finite; e in [-64, 64].
    """
    aq, ak = amax_q.double(), amax_k.double()
    top_q, top_k = aq.amax(-1, keepdim=True), ak.amax(-1, keepdim=True)
    num, den = ak * top_q, aq * top_k
    ok = torch.isfinite(num) & torch.isfinite(den) & (num > 0) & (den > 0)
    mn, en = torch.frexp(torch.where(ok, num, 1.0))
    md, ed = torch.frexp(torch.where(ok, den, 1.0))
    floor_log2 = (en - ed).to(torch.int32) - (mn < md).to(torch.int32)
    exponent = torch.div(floor_log2 + 1, 2, rounding_mode="floor").clamp(-BALANCE_MAX_EXPONENT,
                                                                          BALANCE_MAX_EXPONENT)
    return torch.where(ok, _power_of_two(exponent), 1.0)


# ---------------------------------------------------------------------------------------------
# Blocks and packing
# ---------------------------------------------------------------------------------------------

def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., N] codes -> [..., N/2] bytes; element 2i in the low nibble, 2i+1 in the high one."""
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., N/2] bytes -> [..., N] codes."""
    lo = packed & 0xF
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def block_scales(x: torch.Tensor) -> torch.Tensor:
    """ue4m3 scale bytes [..., N/16] of float32 ``x`` [..., N]: e4m3(amax16 / 6)."""
    amax = x.float().unflatten(-1, (-1, BLOCK)).abs().amax(-1)
    # Divide by a tensor: torch turns division by a Python scalar into a multiply by its
    # reciprocal on CUDA, which rounds differently from the IEEE division the kernels use.
    return e4m3_encode(amax / amax.new_tensor(E2M1_MAX))


def quantize_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4-quantise ``x`` [..., N] (N % 16 == 0) along its last dim.

    Returns ``(packed [..., N/2] uint8, scales [..., N/16] uint8)``. The data is divided by the
    *rounded* scale, in fp32; a zero scale gives an all-zero block.
    """
    if x.shape[-1] % BLOCK:
        raise ValueError(f"last dim {x.shape[-1]} is not a multiple of {BLOCK}")
    x = x.float()
    sf = block_scales(x)
    sf_val = e4m3_decode(sf).unsqueeze(-1)
    xb = x.unflatten(-1, (-1, BLOCK))
    zero = sf_val == 0
    scaled = torch.where(zero, 0.0, xb / torch.where(zero, 1.0, sf_val))
    return pack_nibbles(e2m1_encode(scaled).flatten(-2)), sf


def dequantize_blocks(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`quantize_blocks` up to rounding: float32 [..., N]."""
    vals = e2m1_decode(unpack_nibbles(packed)).unflatten(-1, (-1, BLOCK))
    return (vals * e4m3_decode(scales).unsqueeze(-1)).flatten(-2)


def quantize_p_blocks(p: torch.Tensor) -> torch.Tensor:
    """Second-level P quantisation along the last dim, returned dequantised (float32).

    ``p`` holds unnormalised probabilities in [0, P_RANGE]. Same rule as :func:`quantize_blocks`:
    the scale is rounded to ue4m3 *before* dividing. SageAttention3 divides by the unrounded
    max/6 while the MMA multiplies by the rounded scale, so each 16-key block of its P carries a
    common relative error of up to 1/16; rounding first leaves only the e2m1 rounding error.
    """
    sf = e4m3_decode(block_scales(p)).unsqueeze(-1)
    pb = p.float().unflatten(-1, (-1, BLOCK))
    zero = sf == 0
    scaled = torch.where(zero, 0.0, pb / torch.where(zero, 1.0, sf))
    return (e2m1_decode(e2m1_encode(scaled)) * sf).flatten(-2)


def ue8m0_block_scales(x: torch.Tensor) -> torch.Tensor:
    """ue8m0 scale bytes [..., N/32] of float32 ``x`` [..., N]: 2^e with e the smallest integer
    such that amax32 / 2^e <= 448 (the largest e4m3), so no element saturates and the largest
    lands in (224, 448]. Byte = e + 127, e in [-127, 127]; a zero or non-finite block gives 0.

    448 = 0.875 * 2^9, so with amax = m * 2^E (m in [0.5, 1)) e = E - 9 + (m > 0.875): integers
    and one compare, no division (the CUDA code repeats it bit for bit).
    """
    amax = x.float().unflatten(-1, (-1, MX_BLOCK)).abs().amax(-1)
    ok = torch.isfinite(amax) & (amax > 0)
    m, e = _frexp(torch.where(ok, amax, 1.0))
    exponent = (e - 9 + (m > 0.875).to(torch.int32)).clamp(-UE8M0_BIAS, UE8M0_BIAS)
    return torch.where(ok, exponent + UE8M0_BIAS, 0).to(torch.uint8)


def ue8m0_decode(bits: torch.Tensor) -> torch.Tensor:
    """ue8m0 bytes -> float32 2^(b - 127) (byte 255, NaN in the MX spec, is never written)."""
    return _power_of_two(bits.to(torch.int32) - UE8M0_BIAS)


def quantize_mx_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8-quantise ``x`` [..., N] (N % 32 == 0) along its last dim: ``(e4m3 codes [..., N],
    ue8m0 scales [..., N/32])``. Dividing by a power of two is exact, so the codes are e4m3 of
    x / 2^e rounded once (nearest, ties to even)."""
    if x.shape[-1] % MX_BLOCK:
        raise ValueError(f"last dim {x.shape[-1]} is not a multiple of {MX_BLOCK}")
    x = x.float().contiguous()  # the codes keep x's strides: the kernels read dense rows
    sf = ue8m0_block_scales(x)
    scaled = x.unflatten(-1, (-1, MX_BLOCK)) / ue8m0_decode(sf).unsqueeze(-1)
    return e4m3_encode(scaled.flatten(-2)), sf


def dequantize_mx_blocks(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`quantize_mx_blocks` up to rounding: float32 [..., N]."""
    vals = e4m3_decode(codes).unflatten(-1, (-1, MX_BLOCK))
    return (vals * ue8m0_decode(scales).unsqueeze(-1)).flatten(-2)


def quantize_qk_rows(x: torch.Tensor, qk_format: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Q or K rows in ``qk_format``: ``(data, scales)`` (:func:`quantize_blocks` or
    :func:`quantize_mx_blocks`)."""
    return quantize_mx_blocks(x) if qk_format == "mxfp8" else quantize_blocks(x)


def dequantize_qk_rows(data: torch.Tensor, scales: torch.Tensor, qk_format: str) -> torch.Tensor:
    return dequantize_mx_blocks(data, scales) if qk_format == "mxfp8" else dequantize_blocks(data, scales)


# ---------------------------------------------------------------------------------------------
# Sequence-level layout helpers
# ---------------------------------------------------------------------------------------------

def round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def padded_head_dim(d: int) -> Optional[int]:
    """The kernel head dim a head dim ``d`` is zero-padded to, or None if unsupported (> 128)."""
    for dp in SUPPORTED_HEAD_DIMS:
        if 0 < d <= dp:
            return dp
    return None


def pad_dim(x: torch.Tensor, dim: int, size: int, value: float = 0.0) -> torch.Tensor:
    """Pad ``x`` along ``dim`` up to ``size`` with ``value`` (zeros by default)."""
    extra = size - x.shape[dim]
    if extra < 0:
        raise ValueError(f"cannot pad dim {dim} of size {x.shape[dim]} down to {size}")
    if extra == 0:
        return x
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat((x, x.new_full(shape, value)), dim=dim)


def permute_k_rows(x: torch.Tensor, dim: int = -2) -> torch.Tensor:
    """Apply the 32-key row permutation along ``dim`` (its size a multiple of 32).

    Stored row r of each group takes token K_ROW_PERM[r]. The permutation is an involution, so
    the same call also undoes it.
    """
    dim = dim % x.ndim
    n = x.shape[dim]
    if n % K_PERM_GROUP:
        raise ValueError(f"dim of size {n} is not a multiple of {K_PERM_GROUP}")
    perm = torch.tensor(K_ROW_PERM, device=x.device)
    index = (torch.arange(n // K_PERM_GROUP, device=x.device)[:, None] * K_PERM_GROUP + perm).flatten()
    return x.index_select(dim, index)


def hnd_shape(x: torch.Tensor, layout: str) -> tuple[int, int, int, int]:
    """``(B, H, S, D)`` of a [B, S, H, D] (NHD) or [B, H, S, D] (HND) tensor, without a view (the
    call's host path reads shapes many times)."""
    b, x1, x2, d = x.shape
    return (b, x2, x1, d) if layout == "NHD" else (b, x1, x2, d)


def to_hnd(x: torch.Tensor, layout: str) -> torch.Tensor:
    """View a [B, S, H, D] (NHD) or [B, H, S, D] (HND) tensor as [B, H, S, D]."""
    if layout == "NHD":
        return x.transpose(1, 2)
    if layout == "HND":
        return x
    raise ValueError(f"layout must be 'NHD' or 'HND', got {layout!r}")


# ---------------------------------------------------------------------------------------------
# What the attention kernel reads (nvfp4_dit.preprocess and nvfp4_dit.cuda.quantize produce it)
# ---------------------------------------------------------------------------------------------

@dataclass
class QuantizedQKV:
    """What the attention kernel reads. Shapes are in the module docstring."""

    q_data: torch.Tensor
    q_sf: torch.Tensor
    k_data: torch.Tensor
    k_sf: torch.Tensor
    vt_data: torch.Tensor
    vt_sf: torch.Tensor
    q_mean: torch.Tensor
    k_mean: torch.Tensor
    v_mean: torch.Tensor
    q_scale: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    balance: Optional[torch.Tensor]
    q_dot_km: torch.Tensor
    k_smoothed: Optional[torch.Tensor]
    """fp32 [B, Hkv, Skp, Dp] natural order, K - km (unbalanced, unscaled, 0 past kv_lens), for the
    key projections (None from the CUDA quantiser, which writes them)."""
    seq_q: int
    seq_k: int
    head_dim: int
    head_dim_padded: int
    qk_format: str = QK_FORMAT_DEFAULT
    k_tile_mean: Optional[torch.Tensor] = None
    """[B, Hkv, Skp/128, Dp] fp32: each 128-key tile's mean of the raw K over its valid keys (the
    block-sparse estimate, nvfp4_dit/sparse.py)."""
    q_similarity: Optional[torch.Tensor] = None
    """[B, H, Sqp/128] fp32: each 128-row Q block's mean pairwise cosine of its raw rows."""
    q_center: Optional[torch.Tensor] = None
    """[B, H, Dp] fp32, low-rank Q smoothing (:mod:`nvfp4_dit.smoothing`): the mean of the block means."""
    q_basis: Optional[torch.Tensor] = None
    """[B, H, R, Dp] fp32: the smoothing basis (orthonormal or zero rows)."""
    q_basis_scale: Optional[torch.Tensor] = None
    """[B, H] fp32: the basis scale (a power of two, :class:`nvfp4_dit.smoothing.Basis`)."""
    q_coeff: Optional[torch.Tensor] = None
    """[B, H, Sqp/128, R] fp32: each Q block's coefficients over the basis scale; the block is
    smoothed by q_center + (q_coeff * q_basis_scale) @ q_basis."""

    def smoothing_basis(self):
        """The :class:`nvfp4_dit.smoothing.Basis` of these operands."""
        from .smoothing import Basis
        return Basis(self.q_center, self.q_basis, self.q_basis_scale)

    @property
    def num_q_blocks(self) -> int:
        return self.q_data.shape[2] // SEQ_TILE

    def score_scale(self) -> torch.Tensor:
        """[B, H, Sqp/128] fp32: q_scale * k_scale, the factor from the kernel's score units
        (products of the quantised, tensor-scaled Q and K) to q . k units. A power of two."""
        group = self.q_scale.shape[1] // self.k_scale.shape[1]
        return self.q_scale * self.k_scale.repeat_interleave(group, dim=1)[:, :, None]


FP16_MAX = 65504.0


def valid_key_mask(kv_lens: Optional[torch.Tensor], batch: int, seq_k: int, device) -> torch.Tensor:
    """bool [B, Sk]: key j of batch b is valid iff j < kv_lens[b] (all valid without kv_lens)."""
    if kv_lens is None:
        return torch.ones(batch, seq_k, dtype=torch.bool, device=device)
    return torch.arange(seq_k, device=device)[None, :] < kv_lens.to(device).long()[:, None]


def statistics_row_mask(n_valid: torch.Tensor, seq: int) -> torch.Tensor:
    """bool [B, seq]: the rows of each batch that its per-head statistics read. Of the valid rows
    (``n_valid`` [B], rows past it are padding), the 128-row tiles t with t % stride == 0, where
    stride = ceil(tiles / STATISTICS_TILES) and tiles = ceil(n_valid / 128): every tile of a head of
    at most 16 tiles (2,048 rows), about 16 evenly spread tiles of a longer one
    (``csrc/quantize/params.h``, ``statistics_stride``, repeats the integers)."""
    n = n_valid.long().clamp(0, seq)
    tiles = (n + SEQ_TILE - 1) // SEQ_TILE
    stride = ((tiles + STATISTICS_TILES - 1) // STATISTICS_TILES).clamp_min(1)
    rows = torch.arange(seq, device=n.device)
    return (rows[None, :] < n[:, None]) & ((rows[None, :] // SEQ_TILE) % stride[:, None] == 0)


def sampled_key_mask(kv_lens: Optional[torch.Tensor], batch: int, seq_k: int, device) -> torch.Tensor:
    """bool [B, Sk]: the valid keys that a head's K and V statistics read (:func:`statistics_row_mask`)."""
    n = torch.full((batch,), seq_k, device=device) if kv_lens is None else kv_lens.to(device)
    return statistics_row_mask(n, seq_k)


# ---------------------------------------------------------------------------------------------
# A power-of-two change of a tensor scale, on quantised bytes
# ---------------------------------------------------------------------------------------------

MX_SHIFT_FLOOR = 25
"""An MXFP8 scale byte may move down to 25 (2^-102): below it an element the codes can still show
could be an fp32 subnormal of the tensor-scaled value (2^-126), which the shift would not reproduce."""


def scale_headroom(sf: torch.Tensor, data: torch.Tensor, qk_format: str = "nvfp4") -> torch.Tensor:
    """int32 per block: how many binades its scale byte can move down while re-quantising the
    block under a tensor scale 2^n times larger gives the same bytes, the data unchanged and the
    byte moved by n binades (:func:`shift_scales`); a large number (255) where any shift is exact.

    NVFP4: a zero byte stays zero (an all-zero block); a nonzero byte of exponent field E can move
    E - 1 binades and stay a normal e4m3 (rounding to 3 mantissa bits commutes with powers of two in
    the normal range, and elements below fp32's normal range quantise to +-0 under a normal scale).
    MXFP8: byte b (2^(b-127)) can move b - MX_SHIFT_FLOOR; a zero byte whose codes are all +-0
    stays so; one with nonzero codes cannot move (its exponent was clamped at 2^-127).
    ``data`` is the block's codes (NVFP4: packed bytes, ignored; MXFP8: e4m3 bytes).
    """
    b = sf.to(torch.int32)
    if qk_format == "mxfp8":
        codes_zero = ((data.unflatten(-1, (-1, MX_BLOCK)) & 0x7F) == 0).all(-1)
        zero_byte = torch.where(codes_zero, 255, 0)
        return torch.where(b == 0, zero_byte, (b - MX_SHIFT_FLOOR).clamp_min(0)).to(torch.int32)
    return torch.where(b == 0, 255, ((b >> 3) - 1).clamp_min(0)).to(torch.int32)


def shift_scales(sf: torch.Tensor, binades: int, qk_format: str = "nvfp4") -> torch.Tensor:
    """Scale bytes moved down by ``binades`` (within :func:`scale_headroom`): the bytes of the same
    data under a tensor scale 2^binades larger. Zero bytes stay zero."""
    step = binades if qk_format == "mxfp8" else binades << 3
    b = sf.to(torch.int32)
    return torch.where(b == 0, 0, b - step).to(torch.uint8)


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
