"""Seeded CPU fuzz of the NVFP4 format module and the reference attention against exact math.

Two independent oracles, written from the contract in CONTRIBUTING.md without calling
``nvfp4_dit.format`` (except the layout helpers ``to_hnd``):

* codecs by brute force: the nearest e2m1 / e4m3 value by distance over the whole code table,
  ties to the even code, so the threshold formulation in ``format.py`` is checked value by value;
* FP4 attention written as the kernel runs it: a sequential loop over 128-key tiles with the
  running max, P' quantised per 16 keys, in float64 on operands quantised by the brute-force
  codecs.  The reference (closed-form tile weights, fp32) must agree with it to
  rel-L2 <= 2e-3 and LSE <= 1e-4 (only fp32 rounding differs; a P code can flip at a rounding
  boundary, which is what the 2e-3 allows), and both must be close to exact float64 attention.

Cases are drawn from one seed per test id, so a failure is reproducible by its id.  Failures
found while writing this file are kept as explicit cases in ``REGRESSIONS`` at the end.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Optional

import pytest
import torch

import nvfp4_dit
from nvfp4_dit import format as fmt
from nvfp4_dit import preprocess, smoothing
from nvfp4_dit.reference import attention_reference

N_ATTENTION_CASES = 240
N_CODEC_CASES = 40
TILE = 128

# ---------------------------------------------------------------------------------------------
# Brute-force codecs (the oracle)
# ---------------------------------------------------------------------------------------------

E2M1_MAGS = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def _e4m3_table() -> torch.Tensor:
    """Magnitudes of e4m3fn bytes 0..126 from the bit layout (1-4-3, bias 7, no inf, 127 = NaN)."""
    vals = []
    for byte in range(127):
        e, m = byte >> 3, byte & 7
        vals.append(m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return torch.tensor(vals, dtype=torch.float64)


E4M3_MAGS = _e4m3_table()


def _nearest_even(a: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Index of the nearest table value to a (>= 0, float64); ties go to the even index."""
    d = (a[..., None] - table).abs()
    best = d.amin(-1, keepdim=True)
    cand = d == best
    odd = torch.arange(table.numel()) % 2
    return torch.where(cand, odd, 2).argmin(-1)


def oracle_e2m1(x: torch.Tensor) -> torch.Tensor:
    x = x.float()
    a = x.abs().double()
    code = _nearest_even(a.nan_to_num(0.0, 0.0, 0.0), E2M1_MAGS)
    code = torch.where(a > 6, 7, code)  # saturate (inf included)
    code = torch.where(torch.isnan(x), 0, code)
    sign = torch.signbit(x) & ~torch.isnan(x)
    return (code | (sign.long() << 3)).to(torch.uint8)


def oracle_e4m3(x: torch.Tensor) -> torch.Tensor:
    x = x.float()
    a = x.abs().double()
    byte = _nearest_even(a.nan_to_num(0.0, 0.0, 0.0), E4M3_MAGS)
    byte = torch.where(a > 448, 126, byte)  # satfinite
    byte = byte | (torch.signbit(x).long() << 7)
    byte = torch.where(torch.isnan(x), 0x7F, byte)
    return byte.to(torch.uint8)


def oracle_e4m3_value(byte: torch.Tensor) -> torch.Tensor:
    mag = E4M3_MAGS[(byte & 0x7F).long().clamp_max(126)]
    mag = torch.where((byte & 0x7F) == 0x7F, math.nan, mag)
    return torch.where((byte & 0x80) != 0, -mag, mag)


def oracle_quantize(x: torch.Tensor):
    """fp32 [..., N] -> (codes [..., N] uint8, scale bytes [..., N/16], dequantised float64)."""
    xb = x.float().unflatten(-1, (-1, 16))
    amax = xb.abs().amax(-1)
    sf = oracle_e4m3(amax / 6.0)  # fp32 division, as the contract says
    sfv = oracle_e4m3_value(sf).float()[..., None]
    scaled = torch.where(sfv == 0, 0.0, xb / torch.where(sfv == 0, 1.0, sfv))
    codes = oracle_e2m1(scaled)
    vals = E2M1_MAGS[(codes & 7).long()] * torch.where((codes & 8) != 0, -1.0, 1.0)
    deq = (vals * sfv.double()).flatten(-2)
    return codes.flatten(-2), sf, deq


# ---------------------------------------------------------------------------------------------
# Codec fuzz
# ---------------------------------------------------------------------------------------------

def _codec_values(rng: torch.Generator, n: int) -> torch.Tensor:
    """Random values with heavy tails, exact ties, boundaries and specials."""
    parts = [
        torch.randn(n, generator=rng) * torch.exp2(torch.randint(-12, 12, (n,), generator=rng).float()),
        (torch.randint(-28, 29, (n,), generator=rng).float() * 0.25),  # e2m1 midpoints and grid points
        torch.tensor([0.0, -0.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, 1e30, -1e30, math.inf,
                      -math.inf, math.nan]),
    ]
    return torch.cat(parts)


@pytest.mark.parametrize("seed", range(N_CODEC_CASES))
def test_e2m1_matches_brute_force(seed):
    rng = torch.Generator().manual_seed(seed)
    x = _codec_values(rng, 4096)
    assert torch.equal(fmt.e2m1_encode(x), oracle_e2m1(x))


@pytest.mark.parametrize("seed", range(N_CODEC_CASES))
def test_e4m3_matches_brute_force(seed):
    rng = torch.Generator().manual_seed(1000 + seed)
    x = torch.randn(4096, generator=rng) * torch.exp2(torch.randint(-14, 12, (4096,), generator=rng).float())
    # exact midpoints between neighbouring e4m3 values (ties) and values around the 448 edge
    mids = (E4M3_MAGS[1:] + E4M3_MAGS[:-1]) / 2
    x = torch.cat([x, mids.float(), -mids.float(), torch.tensor([447.0, 448.0, 463.0, 464.0, 465.0, 1e9, math.inf,
                                                                  -math.inf, math.nan, 2.0 ** -10, 2.0 ** -9.5])])
    got = fmt.e4m3_encode(x)
    want = oracle_e4m3(x)
    assert torch.equal(got, want), x[got != want][:8]


@pytest.mark.parametrize("seed", range(N_CODEC_CASES))
def test_quantize_blocks_matches_the_contract(seed):
    rng = torch.Generator().manual_seed(2000 + seed)
    rows, n = int(torch.randint(1, 40, (1,), generator=rng)), 16 * int(torch.randint(1, 9, (1,), generator=rng))
    mag = torch.exp2(torch.randint(-20, 14, (rows, n // 16, 1), generator=rng).float())
    x = (torch.randn(rows, n // 16, 16, generator=rng) * mag).flatten(-2)
    x[torch.rand(rows, n, generator=rng) < 0.05] = 0.0
    if seed % 4 == 0:
        x[0, :16] = 0.0  # an all-zero block: scale 0, codes 0
    packed, sf = fmt.quantize_blocks(x)
    codes, sf_want, deq = oracle_quantize(x)
    assert torch.equal(sf, sf_want)
    assert torch.equal(fmt.unpack_nibbles(packed), codes)
    assert torch.equal(fmt.pack_nibbles(codes), packed)
    assert torch.equal(fmt.dequantize_blocks(packed, sf).double(), deq)
    # Error bound: half the e2m1 step at the top (1 scale unit), plus saturation of a rounded-down
    # scale (amax/sf <= 6 * 17/16); scales that underflow to 0 or lose precision in the subnormals
    # are excluded (their blocks are below 2^-9 * 6), as are saturated scales (amax > 6 * 448).
    sfv = oracle_e4m3_value(sf).double().repeat_interleave(16, -1)
    amax = x.abs().unflatten(-1, (-1, 16)).amax(-1).repeat_interleave(16, -1)
    ok = (sfv >= 2.0 ** -6) & (amax <= 6 * 448)
    err = (deq - x.double()).abs()
    assert torch.all(err[ok] <= sfv[ok] * 1.0 + 1e-30)


@pytest.mark.parametrize("seed", range(N_CODEC_CASES // 2))
def test_quantize_p_blocks_matches_the_contract(seed):
    rng = torch.Generator().manual_seed(3000 + seed)
    p = fmt.P_RANGE * torch.exp(-torch.rand(8, 256, generator=rng) * float(torch.randint(1, 30, (1,), generator=rng)))
    p[torch.rand(8, 256, generator=rng) < 0.2] = 0.0
    _, _, deq = oracle_quantize(p)
    assert torch.equal(fmt.quantize_p_blocks(p).double(), deq)


@pytest.mark.parametrize("seed", range(N_CODEC_CASES // 2))
def test_k_row_permutation_is_the_contract_involution(seed):
    rng = torch.Generator().manual_seed(4000 + seed)
    n = 32 * int(torch.randint(1, 9, (1,), generator=rng))
    x = torch.randn(2, n, 3, generator=rng)
    y = fmt.permute_k_rows(x, dim=1)
    for r in range(n):
        g, w = divmod(r, 32)
        a, b, c = w // 8, (w // 2) % 4, w % 2
        assert torch.equal(y[:, r], x[:, 32 * g + 8 * b + 2 * a + c])
    assert torch.equal(fmt.permute_k_rows(y, dim=1), x)


# ---------------------------------------------------------------------------------------------
# The attention oracle
# ---------------------------------------------------------------------------------------------

def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def oracle_tensor_scale(absmax: float) -> float:
    """The contract's tensor scale, by search: the smallest power of two t with absmax / t <= 2688."""
    if not (math.isfinite(absmax) and absmax > 0):
        return 1.0
    e = math.frexp(absmax)[1] - 13
    while absmax / 2.0 ** e > 2688:
        e += 1
    return 2.0 ** max(-126, min(127, e))


def oracle_balance(amax_q: list, amax_k: list) -> list:
    """The contract's channel balance of one head, by search: per channel the power of two 2^e with
    2^(2e-1) <= r < 2^(2e+1), r = (amax_k / amax_q) / (max amax_k / max amax_q) (exact rationals)."""
    from fractions import Fraction

    top_q, top_k = max(amax_q), max(amax_k)
    out = []
    for aq, ak in zip(amax_q, amax_k):
        if not all(math.isfinite(x) and x > 0 for x in (aq, ak, top_q, top_k)):
            out.append(1.0)
            continue
        r = Fraction(ak) * Fraction(top_q) / (Fraction(aq) * Fraction(top_k))
        e = 0
        while r >= Fraction(2) ** (2 * e + 1):
            e += 1
        while r < Fraction(2) ** (2 * e - 1):
            e -= 1
        out.append(2.0 ** max(-64, min(64, e)))
    return out


RANK, ITERATIONS = 15, 8


def oracle_hash32(x: int) -> int:
    """The contract's 32-bit mix of the basis start (lowbias32)."""
    x &= 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def oracle_basis(qm: torch.Tensor):
    """One head's smoothing basis from its block means [n, D] (float64 throughout): the center
    (mean of the finite means), RANK rows by ITERATIONS steps of subspace iteration on the Gram
    matrix of the deviations (scaled below 1 by a power of two) from the hashed start, modified
    Gram-Schmidt (two sweeps) zeroing a row left with 2^-14 of the first row's norm or less in the last step; and the scale, that power of
    two. Returns (center [D], rows [RANK, D], scale)."""
    n, d = qm.shape
    finite = torch.isfinite(qm).all(-1)
    center = qm[finite].double().sum(0) / max(int(finite.sum()), 1) if finite.any() else torch.zeros(d, dtype=torch.float64)
    dev = torch.where(finite[:, None], qm.double() - center, 0.0)
    amax = dev.abs().max().item() if n else 0.0
    e = math.frexp(amax)[1] if amax > 0 else 1
    dev = dev * 2.0 ** -e
    gram = dev.T @ dev
    rows = torch.tensor([[(oracle_hash32(i * d + c) >> 8) / 2.0 ** 23 - 1.0 for c in range(d)] for i in range(RANK)],
                        dtype=torch.float64)
    for it in range(ITERATIONS):
        floor = 2.0 ** -14 if it == ITERATIONS - 1 else 0.0
        rows = rows @ gram
        first = rows[0].norm()
        for i in range(RANK):
            x = rows[i].clone()
            for j in [*range(i), *range(i)]:
                x = x - (x @ rows[j]) * rows[j]
            after = x.norm()
            rows[i] = x / after if after > floor * first and after > 0 else 0.0
    return center, rows, 2.0 ** e


def oracle_stored_projections(u: torch.Tensor) -> torch.Tensor:
    """The contract's fp16 storage of one head's key projections [Skp, RANK + 1] (q.k units, float64
    in and out): per 128-key tile e = frexp(max finite |u|) - 15 in [-126, 111] (-126 for a zero
    tile), fp16(u / 2^e) with finite values saturated at 65504, times 2^e."""
    tiles = u.view(-1, TILE, u.shape[-1])
    amax = torch.where(torch.isfinite(tiles), tiles.abs(), 0.0).amax((1, 2))
    e = torch.tensor([math.frexp(a)[1] - 15 if a > 0 else -126 for a in amax.tolist()]).clamp(-126, 111)
    unit = torch.pow(2.0, e.double())[:, None, None]
    x = tiles / unit
    x = torch.where(torch.isfinite(x), x.clamp(-65504.0, 65504.0), x)
    return (x.float().half().double() * unit).view_as(u)


def oracle_fp4_attention(q, k, v, *, causal, scale, kv_lens, key_bias, layout, balance_qk=False, means=None,
                         basis=None):
    """The contract, step by step, with a sequential tile loop (float64 after quantisation).

    ``means=(qm, km, vm)`` replaces the oracle's own fp32 means (float64 sums rounded once), which
    may differ from a torch fp32 reduction by an ulp and so flip a code at a rounding boundary;
    :func:`check_case` checks the means separately and then compares everything else exactly.
    ``basis`` (a :class:`nvfp4_dit.smoothing.Basis`) replaces the oracle's own float64 basis likewise.
    Returns ``(out, lse, (qm, km, vm), own_basis)``, own_basis per batch and head ``(center, rows, scale)``.
    """
    qh, kh, vh = (fmt.to_hnd(t, layout).float() for t in (q, k, v))
    b, h, sq, d = qh.shape
    hkv, sk = kh.shape[1], kh.shape[2]
    g = h // hkv
    dp = 64 if d <= 64 else 128
    sqp, skp = _round_up(max(sq, 1), TILE), _round_up(max(sk, 1), TILE)
    scale = 1 / math.sqrt(d) if scale is None else scale
    lens = torch.full((b,), sk) if kv_lens is None else kv_lens.long()
    valid = torch.arange(sk)[None, :] < lens[:, None]                      # [B, Sk]

    # Smoothing (means in float64, then fp32 as the contract stores them).
    vmask = valid[:, None, :, None]
    cnt = vmask.sum(2).clamp_min(1)
    km = (torch.where(vmask, kh.double(), 0.0).sum(2) / cnt).float()       # [B, Hkv, D]
    vm = (torch.where(vmask, vh.double(), 0.0).sum(2) / cnt).float()
    nblk = sqp // TILE
    qpad = torch.zeros(b, h, sqp, d)
    qpad[:, :, :sq] = qh
    rows_valid = (torch.arange(sqp) < sq).view(nblk, TILE)
    qm = (qpad.double().view(b, h, nblk, TILE, d).sum(3) / rows_valid.sum(1).clamp_min(1)[:, None]).float()
    own_means = (qm, km, vm)
    if means is not None:
        qm, km, vm = means

    def pad(x, s_to, d_to):
        out = torch.zeros(*x.shape[:2], s_to, d_to, dtype=x.dtype)
        out[:, :, :x.shape[2], :x.shape[3]] = x
        return out

    k_dev = torch.where(vmask, kh - km[:, :, None], 0.0)
    v_dev = torch.where(vmask, vh - vm[:, :, None], 0.0)
    # Low-rank Q smoothing: each block by m_b = center + rows^T a_b, the coefficients a_b / s stored
    # in fp32 and m_b formed by one fp32 fused multiply-add per row; the balance statistics take
    # q - qm_b. ``basis`` replaces the oracle's own (float64) basis as ``means`` do the means.
    own_basis = [[oracle_basis(qm[bi, hh]) for hh in range(h)] for bi in range(b)]
    smoothing_of = own_basis if basis is None else [
        [(basis.center[bi, hh, :d].double(), basis.rows[bi, hh, :, :d].double(), float(basis.scale[bi, hh]))
         for hh in range(h)] for bi in range(b)]

    def coefficients(bi, hh):   # a_b / s, fp32
        center, rows, sc = smoothing_of[bi][hh]
        return (((qm[bi, hh].double() - center) @ rows.T) / sc).float()

    def smoothed(bi, hh):
        center, rows, sc = smoothing_of[bi][hh]
        a = coefficients(bi, hh).double() * sc
        m = center.float().expand(nblk, d)
        for i in range(RANK):
            m = (m.double() + a[:, i:i + 1] * rows[i]).float()
        return m

    m_blk = torch.stack([torch.stack([smoothed(bi, hh) for hh in range(h)]) for bi in range(b)])
    q_dev_stats = qh - qm.repeat_interleave(TILE, 2)[:, :, :sq]
    q_dev = qh - m_blk.repeat_interleave(TILE, 2)[:, :, :sq]
    # Channel balance from the smoothed Q rows (every head of a kv group) and K's valid keys.
    bal = torch.ones(b, hkv, d)
    if balance_qk:
        for bi in range(b):
            for kv in range(hkv):
                aq = [q_dev_stats[bi, kv * g:(kv + 1) * g, :, c].abs().max().item() if sq else 0.0 for c in range(d)]
                ak = [k_dev[bi, kv, :, c].abs().max().item() if sk else 0.0 for c in range(d)]
                bal[bi, kv] = torch.tensor(oracle_balance(aq, ak))
    k_bal = k_dev / bal[:, :, None]
    q_bal = q_dev * bal.repeat_interleave(g, 1)[:, :, None]
    ts_k = torch.tensor([[oracle_tensor_scale(k_bal[bi, kv].abs().max().item() if sk else 0.0) for kv in range(hkv)]
                         for bi in range(b)])
    ts_v = torch.tensor([[oracle_tensor_scale(v_dev[bi, kv].abs().max().item() if sk else 0.0) for kv in range(hkv)]
                         for bi in range(b)])
    q_bal_pad = pad(q_bal, sqp, d)
    ts_q = torch.tensor([[[oracle_tensor_scale(q_bal_pad[bi, hh, i * TILE:(i + 1) * TILE].abs().max().item())
                           for i in range(nblk)] for hh in range(h)] for bi in range(b)])

    q_hat = oracle_quantize(pad(q_bal / ts_q.repeat_interleave(TILE, 2)[:, :, :sq, None], sqp, dp))[2]
    k_hat = oracle_quantize(pad(k_bal / ts_k[:, :, None, None], skp, dp))[2]   # row permutation: storage only
    v_hat = oracle_quantize(pad(v_dev / ts_v[:, :, None, None], skp, dp).transpose(2, 3))[2].transpose(2, 3)

    # Scores in q.k units: FP4 products times the tensor scales, plus the correction m_b . k' (with a
    # key bias) formed from the stored key projections and the block's coefficients.
    k_hat, v_hat, k_s = (x.repeat_interleave(g, 1) for x in (k_hat, v_hat, pad(k_dev, skp, dp)))
    f_blk = (ts_q * ts_k.repeat_interleave(g, 1)[:, :, None]).double()      # [B, H, nblk]
    delta = torch.zeros(b, h, nblk, skp, dtype=torch.float64)
    for bi in range(b):
        for hh in range(h):
            center, rows, sc = smoothing_of[bi][hh]
            w = torch.zeros(RANK + 1, dp, dtype=torch.float64)   # [g; rows * s], zero past D
            w[0, :d], w[1:, :d] = center, rows * sc
            u = k_s[bi, hh].double() @ w.T                                     # [Skp, RANK + 1]
            if key_bias is not None:
                u[:sk, 0] += key_bias[bi].double() / scale
            u = oracle_stored_projections(u)
            a = torch.cat([torch.ones(nblk, 1, dtype=torch.float64), coefficients(bi, hh).double()], 1)
            delta[bi, hh] = a @ u.T
    s = (q_hat @ k_hat.transpose(-1, -2)) * f_blk.repeat_interleave(TILE, 2)[..., None] \
        + delta.repeat_interleave(TILE, 2)
    hidden = torch.full((b, skp), -math.inf, dtype=torch.float64)
    hidden[:, :sk] = torch.where(valid, 0.0, -math.inf)
    s = s + hidden[:, None, None, :]
    if causal:
        s = s.masked_fill(torch.arange(skp)[None, :] > torch.arange(sqp)[:, None], -math.inf)

    c = scale * math.log2(math.e)
    m = torch.full((b, h, sqp), -math.inf, dtype=torch.float64)
    lsum = torch.zeros(b, h, sqp, dtype=torch.float64)
    o = torch.zeros(b, h, sqp, dp, dtype=torch.float64)
    for t0 in range(0, skp, TILE):
        st = s[..., t0:t0 + TILE]
        m_new = torch.maximum(m, st.amax(-1))
        m_use = torch.where(torch.isneginf(m_new), 0.0, m_new)
        alpha = torch.exp2((m - m_use) * c)
        p = torch.exp2((st - m_use[..., None]) * c + math.log2(fmt.P_RANGE)).float()
        p_q = oracle_quantize(p)[2]
        lsum = lsum * alpha + p.double().sum(-1)
        o = o * alpha[..., None] + p_q @ v_hat[:, :, t0:t0 + TILE]
        m = m_new
    has = lsum > 0
    v_scale = ts_v.repeat_interleave(g, 1).double()[:, :, None, None]
    v_mean = pad(vm[:, :, None], 1, dp).repeat_interleave(g, 1).double()
    out = torch.where(has[..., None], o / lsum.clamp_min(1e-300)[..., None] * v_scale + v_mean, 0.0)[:, :, :sq, :d]
    q_dot_km = (qh.double() * km.repeat_interleave(g, 1)[:, :, None, :].double()).sum(-1)
    lse = torch.where(has, m * scale + torch.log(lsum.clamp_min(1e-300)) - math.log(fmt.P_RANGE), -math.inf)
    lse = lse[:, :, :sq] + scale * q_dot_km
    return out, lse, own_means, own_basis


def exact_attention(q, k, v, *, causal, scale, kv_lens, key_bias, layout):
    qh, kh, vh = (fmt.to_hnd(t, layout).double() for t in (q, k, v))
    b, h, sq, d = qh.shape
    g = h // kh.shape[1]
    sk = kh.shape[2]
    scale = 1 / math.sqrt(d) if scale is None else scale
    kh, vh = kh.repeat_interleave(g, 1), vh.repeat_interleave(g, 1)
    s = qh @ kh.transpose(-1, -2) * scale
    lens = torch.full((b,), sk) if kv_lens is None else kv_lens.long()
    s = s.masked_fill(~(torch.arange(sk)[None, :] < lens[:, None])[:, None, None, :], -math.inf)
    if key_bias is not None:
        s = s + key_bias.double()[:, None, None, :]
    if causal:
        s = s.masked_fill(torch.arange(sk)[None, :] > torch.arange(sq)[:, None], -math.inf)
    lse = torch.logsumexp(s, -1)
    fin = torch.isfinite(lse)
    out = torch.where(fin[..., None], torch.exp(s - torch.where(fin, lse, 0.0)[..., None]) @ vh, 0.0)
    return out, lse


# ---------------------------------------------------------------------------------------------
# Random cases
# ---------------------------------------------------------------------------------------------

@dataclass
class Case:
    seed: int
    b: int
    sq: int
    sk: int
    h: int
    hkv: int
    d: int
    dtype: torch.dtype
    layout: str
    causal: bool
    scale: Optional[float]
    lens: Optional[list]
    mask: str          # none | suffix_bool | suffix_float | nonsuffix_bool | bias
    offset: float      # DiT-like per-128-row offsets in Q and a common offset in K
    balance_qk: bool = True

    def tensors(self):
        g = torch.Generator().manual_seed(self.seed)
        shape_q = (self.b, self.sq, self.h, self.d)
        shape_k = (self.b, self.sk, self.hkv, self.d)
        q = torch.randn(shape_q, generator=g)
        nblk = _round_up(max(self.sq, 1), TILE) // TILE
        q = q + self.offset * torch.randn(self.b, nblk, self.h, self.d, generator=g).repeat_interleave(
            TILE, 1)[:, :self.sq]
        k = torch.randn(shape_k, generator=g) + self.offset * torch.randn(self.b, 1, self.hkv, self.d, generator=g)
        v = torch.randn(shape_k, generator=g) * (1 + 3 * torch.rand(1, 1, self.hkv, self.d, generator=g))
        q, k, v = (x.to(self.dtype) for x in (q, k, v))
        if self.layout == "HND":
            q, k, v = (x.transpose(1, 2).contiguous() for x in (q, k, v))
        return q, k, v

    def masks(self):
        """(kwargs for nvfp4_dit.attention, kv_lens and key_bias the oracles see)."""
        lens = None if self.lens is None else torch.tensor(self.lens)
        kw_lens = {} if lens is None else {"kv_lens": lens}
        if self.mask == "none":
            return kw_lens, lens, None
        g = torch.Generator().manual_seed(self.seed + 7)
        mlen = torch.randint(0, self.sk + 1, (self.b,), generator=g)
        keep = torch.arange(self.sk)[None, :] < mlen[:, None]
        eff = mlen if lens is None else torch.minimum(mlen, lens)
        if self.mask == "suffix_bool":
            return {"attn_mask": keep, **kw_lens}, eff, None
        if self.mask == "suffix_float":
            m = torch.where(keep, 0.0, -math.inf)[:, None, None, :]
            return {"attn_mask": m, **kw_lens}, eff, None
        if self.mask == "nonsuffix_bool":
            keep = torch.rand(self.b, self.sk, generator=g) > 0.3
            keep[:, 0] = False  # never a prefix
            bias = torch.where(keep, 0.0, -math.inf)
            # Keys past the last kept one are padding (masks.reduce_key_mask): out of the statistics.
            last = (keep * torch.arange(1, self.sk + 1)).amax(1)
            eff = last if lens is None else torch.minimum(last, lens)
            return {"attn_mask": keep, **kw_lens}, eff, bias
        bias = 2 * torch.randn(self.b, self.sk, generator=g)
        return {"attn_mask": bias, **kw_lens}, lens, bias


def make_case(seed: int) -> Case:
    r = random.Random(seed)
    b = r.choice([1, 1, 2, 3])
    hkv = r.choice([1, 2])
    h = hkv * r.choice([1, 2, 3])
    d = r.choice([64, 128, 64, 128, r.randint(1, 128)])
    short = r.random() < 0.25
    sq = r.randint(1, 40) if short else r.randint(1, 300)
    sk = r.randint(1, 40) if short and r.random() < 0.5 else r.randint(1, 300)
    lens = None
    if r.random() < 0.35:
        lens = [r.choice([0, sk, r.randint(0, sk), r.randint(max(0, sk - 5), sk)]) for _ in range(b)]
    return Case(
        seed=seed, b=b, sq=sq, sk=sk, h=h, hkv=hkv, d=d,
        dtype=r.choice([torch.float32, torch.float16, torch.bfloat16]),
        layout=r.choice(["NHD", "HND"]), causal=r.random() < 0.3,
        scale=None if r.random() < 0.7 else r.uniform(0.02, 0.3),
        lens=lens, mask=r.choice(["none"] * 4 + ["suffix_bool", "suffix_float", "nonsuffix_bool", "bias"]),
        offset=r.choice([0.0, 0.0, 1.0, 4.0]), balance_qk=r.random() < 0.5,
    )


def _rel_l2(a, b):
    a, b = a.double(), b.double()
    den = b.norm()
    return 0.0 if den == 0 and a.norm() == 0 else ((a - b).norm() / den.clamp_min(1e-300)).item()


def check_case(case: Case):
    q, k, v = case.tensors()
    kwargs, lens, bias = case.masks()
    out, lse = nvfp4_dit.attention(q, k, v, layout=case.layout, causal=case.causal, scale=case.scale,
                                   backend="reference", return_lse=True, balance_qk=case.balance_qk, **kwargs)
    okw = dict(causal=case.causal, scale=case.scale, kv_lens=lens, key_bias=bias, layout=case.layout)
    # The reference's fp32 means (what the op uses: suffix masks become kv_lens).
    qh, kh = (fmt.to_hnd(t, case.layout) for t in (q, k))
    ref_means = (preprocess.q_block_means(qh), preprocess.k_mean(kh, lens), preprocess.k_mean(fmt.to_hnd(v, case.layout), lens))
    ref_basis = smoothing.smoothing_basis(ref_means[0])
    want, want_lse, own_means, own_basis = oracle_fp4_attention(q, k, v, means=ref_means, basis=ref_basis,
                                                                balance_qk=case.balance_qk, **okw)
    for mine, theirs in zip(own_means, ref_means):
        assert torch.allclose(theirs, mine, rtol=1e-5, atol=1e-5 * max(1.0, mine.abs().max().item()))
    # The same center and scale, and the same smoothed block means (float64 against fp32). The rows
    # themselves may differ where a subspace direction holds next to no deviation: a row that falls
    # to the Gram-Schmidt floor in one precision survives in the other, and smooths nothing.
    for bi, heads in enumerate(own_basis):
        for hh, (center, rows, sc) in enumerate(heads):
            assert sc == float(ref_basis.scale[bi, hh])
            assert torch.allclose(ref_basis.center[bi, hh].double(), center, rtol=1e-5, atol=1e-6 * sc)
            qm = ref_means[0][bi, hh].double()
            finite = torch.isfinite(qm).all(-1)
            theirs = ref_basis.rows[bi, hh].double()
            dev = (qm - center)[finite]
            mine_smoothed, their_smoothed = dev @ rows.T @ rows, dev @ theirs.T @ theirs
            assert dev.numel() == 0 or (mine_smoothed - their_smoothed).abs().max() <= 1e-4 * sc
    exact, exact_lse = exact_attention(q, k, v, **okw)
    out_h = fmt.to_hnd(out, case.layout)

    # Rows without visible keys: exactly 0 and -inf in all three.
    empty = torch.isneginf(exact_lse)
    assert torch.equal(torch.isneginf(lse), empty) and torch.equal(torch.isneginf(want_lse), empty)
    assert torch.all(out_h[empty] == 0)
    assert torch.isfinite(out).all() and not torch.isnan(lse).any()

    # The reference is the contract (fp32 vs float64 rounding only).
    tol = {torch.float32: 2e-3, torch.float16: 4e-3, torch.bfloat16: 8e-3}[case.dtype]  # output rounding
    assert _rel_l2(out_h, want) <= tol, f"rel-L2 to the contract oracle {_rel_l2(out_h, want):.2e}"
    live = ~empty
    if live.any():
        assert (lse[live].double() - want_lse[live]).abs().max().item() <= 1e-4 * max(1.0, want_lse[live].abs().max())

        # ... and close to exact attention: FP4 error averaged over keys.
        err_lse = (lse[live].double() - exact_lse[live]).abs().mean().item()
        assert err_lse <= 0.4, f"LSE error vs exact {err_lse:.3f}"
        rel = _rel_l2(out_h[live], exact[live])
        assert rel <= 0.4, f"rel-L2 vs exact {rel:.3f}"
    return out, lse


@pytest.mark.parametrize("seed", range(N_ATTENTION_CASES))
def test_reference_matches_the_contract_and_exact_math(seed):
    check_case(make_case(seed))


@pytest.mark.parametrize("seed", range(0, N_ATTENTION_CASES, 12))
def test_invariances(seed):
    """HND == NHD (fp32 rounding: the matmuls see other strides); kv_lens == truncated K/V; GQA == repeated K/V (fp32 rounding).

    Without the channel balance: GQA balances over the query heads of a group, repeated K/V over
    each head alone."""
    case = make_case(seed)
    case.mask, case.scale = "none", None
    q, k, v = case.tensors()
    kwargs, lens, _ = case.masks()
    run = lambda q, k, v, **kw: nvfp4_dit.attention(q, k, v, layout=case.layout, causal=case.causal,  # noqa: E731
                                                     backend="reference", return_lse=True, balance_qk=False, **kw)
    out, lse = run(q, k, v, **kwargs)
    other = "HND" if case.layout == "NHD" else "NHD"
    flip = lambda x: x.transpose(1, 2).contiguous()  # noqa: E731
    out2, lse2 = nvfp4_dit.attention(flip(q), flip(k), flip(v), layout=other, causal=case.causal,
                                     backend="reference", return_lse=True, balance_qk=False, **kwargs)
    assert _rel_l2(flip(out2), out) <= 1e-5 and torch.allclose(lse2, lse, atol=1e-5)

    g = case.h // case.hkv
    if g > 1:
        head_dim = 2 if case.layout == "NHD" else 1
        rep = run(q, k.repeat_interleave(g, head_dim), v.repeat_interleave(g, head_dim), **kwargs)
        assert _rel_l2(rep[0], out) <= 1e-5 and torch.allclose(rep[1], lse, atol=1e-5, equal_nan=True)

    if lens is not None:
        seq_dim = 1 if case.layout == "NHD" else 2
        for bi, n in enumerate(lens.tolist()):
            if n == 0:
                continue
            sl = lambda x: x[bi:bi + 1].narrow(seq_dim, 0, n)  # noqa: E731
            o1, l1 = run(q[bi:bi + 1], sl(k), sl(v))
            assert _rel_l2(o1, out[bi:bi + 1]) <= 1e-5
            assert torch.allclose(l1, lse[bi:bi + 1], atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Regression cases (minimised failures and the corners the random draw rarely hits)
# ---------------------------------------------------------------------------------------------

REGRESSIONS = {
    # One query, one key, odd head dim, bf16.
    "s1_d1_bf16": Case(1, 1, 1, 1, 1, 1, 1, torch.bfloat16, "NHD", False, None, None, "none", 0.0),
    # Causal with more queries than keys: rows past the last key see every key.
    "causal_sq_gt_sk": Case(2, 1, 257, 3, 2, 1, 64, torch.float32, "HND", True, None, None, "none", 4.0),
    # kv_lens exactly at a 16-token V-scale boundary and one past a 128-key tile.
    "kv_lens_block_edges": Case(3, 3, 130, 257, 2, 2, 128, torch.float16, "NHD", False, None, [16, 129, 0],
                                "none", 1.0),
    # A suffix mask shorter than kv_lens (the op takes the minimum).
    "mask_and_kv_lens": Case(4, 2, 64, 200, 3, 1, 72, torch.float32, "NHD", True, 0.05, [150, 7], "suffix_bool",
                             0.0),
    # Large common K offset: smoothing must keep the scores exact up to FP4 error.
    "big_k_offset": Case(5, 1, 256, 256, 2, 2, 128, torch.float32, "NHD", False, None, None, "none", 40.0),
}


@pytest.mark.parametrize("name", sorted(REGRESSIONS))
def test_regressions(name):
    check_case(REGRESSIONS[name])


def test_the_oracle_detects_a_halved_output():
    """The checks above would catch the production bug class (halved outputs, stale LSE)."""
    case = make_case(3)
    q, k, v = case.tensors()
    kwargs, lens, bias = case.masks()
    okw = dict(causal=case.causal, scale=case.scale, kv_lens=lens, key_bias=bias, layout=case.layout)
    want, want_lse, _, _ = oracle_fp4_attention(q, k, v, **okw)
    out, lse = nvfp4_dit.attention(q, k, v, layout=case.layout, causal=case.causal, scale=case.scale,
                                   backend="reference", return_lse=True, **kwargs)
    assert _rel_l2(fmt.to_hnd(out, case.layout) * 0.5, want) > 0.4
    assert (lse - math.log(2) - want_lse).abs().max() > 0.5
