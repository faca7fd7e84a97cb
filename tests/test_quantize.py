"""The CUDA quantize kernels (nvfp4_dit.cuda.quantize) against nvfp4_dit.format and nvfp4_dit.smoothing.

Bytes and scales must equal preprocess.quantize_qkv exactly. The means, the smoothing basis and its
coefficients are reductions whose summation order differs, so they are compared with a tolerance,
and the exact comparison feeds the kernel's own into preprocess.quantize_qkv (its q_mean,
k_mean_override, basis_override and coeff_override arguments). The key projections are fp32 sums
in the kernel and fp64 ones in the reference: equal within one fp16 rounding.

CPU tests: the kernel's fast per-element arithmetic (csrc/quantize/quantize_math.cuh) equals the reference
formulation exhaustively on the host.
"""

import subprocess

import pytest
import torch

from nvfp4_dit.cuda import quantize as cq
from nvfp4_dit import format as fmt
from nvfp4_dit import preprocess
from nvfp4_dit import smoothing

try:
    from host_program import compile_host_program
except ImportError:  # tests/ imported as a package
    from tests.host_program import compile_host_program
BYTE_FIELDS = ("q_data", "q_sf", "k_data", "k_sf", "vt_data", "vt_sf")


# ---------------------------------------------------------------------------------------------
# Host checks of quantize_math.cuh
# ---------------------------------------------------------------------------------------------

HOST_PROGRAM = r"""
#include "quantize/quantize_math.cuh"
#include <cmath>
#include <cstdio>
int main() {
  long bad_enc = 0, bad_div = 0, n_div = 0;
  // Every fp32 quotient in [0, 7) through the three-rounding encoder, and the clamped values
  // (min(q, 6)) of the saturating path.
  for (uint32_t u = 0; u < 0x40E00000u; ++u) {
    const float a = nvfp4_dit::bits_float(u);
    if ((nvfp4_dit::float_to_e2m1_sw(a) & 7u) != nvfp4_dit::e2m1_code_biased(a) - nvfp4_dit::kBiasedCodeBits) ++bad_enc;
  }
  const float big[] = {7.0f, 8.5f, 100.0f, 3.0e38f, INFINITY};
  for (float a : big)
    if (nvfp4_dit::e2m1_code_biased(fminf(a, 6.0f)) - nvfp4_dit::kBiasedCodeBits != 7u) ++bad_enc;
  // Every finite positive e4m3 scale, around every e2m1 decision threshold, and a random spread.
  const float th[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
  uint32_t s = 12345u;
  for (uint32_t b = 1; b < 0x7F; ++b) {
    const float sf = nvfp4_dit::e4m3_to_float(b), rcp = 1.0f / sf;
    for (int t = 0; t < 7; ++t) {
      const int64_t center = nvfp4_dit::float_bits(th[t] * sf);
      for (int64_t d = -40000; d <= 40000; ++d) {
        const float a = nvfp4_dit::bits_float(uint32_t(center + d));
        ++n_div;
        if (nvfp4_dit::float_bits(a / sf) != nvfp4_dit::float_bits(nvfp4_dit::divide_by_scale(a, sf, rcp))) ++bad_div;
      }
    }
    for (int i = 0; i < 200000; ++i) {
      s = s * 1664525u + 1013904223u;
      const float a = nvfp4_dit::bits_float(s & 0x7FFFFFFFu);
      const float q = a / sf;
      // Finite quotients above the underflow range (below it both encode to 0).
      if (!std::isfinite(a) || !std::isfinite(q) || q < 1e-30f) continue;
      ++n_div;
      if (nvfp4_dit::float_bits(q) != nvfp4_dit::float_bits(nvfp4_dit::divide_by_scale(a, sf, rcp))) ++bad_div;
    }
  }
  // The scale division by 6 through its e4m3 encoding (below).
  // ... and the fast path's premise: every amax it takes (scale byte above
  // kLastCoarseScaleByte) gives quotients amax / sf below 7; the coarse bytes do not.
  const uint32_t top = nvfp4_dit::float_bits(nvfp4_dit::kUnsaturatedAmax);
  long bad_bound = 0, coarse_over7 = 0;
  for (uint32_t u = 0; u <= top; ++u) {
    const float a = nvfp4_dit::bits_float(u);
    const uint32_t sf_bits = nvfp4_dit::float_to_e4m3_sw(nvfp4_dit::amax_over_6(a));
    if (nvfp4_dit::float_to_e4m3_sw(a / 6.0f) != sf_bits) ++bad_div;
    if (sf_bits == 0) continue;
    const bool over7 = !(a / nvfp4_dit::e4m3_to_float(sf_bits) < 7.0f);
    if (sf_bits > nvfp4_dit::kLastCoarseScaleByte) bad_bound += over7;
    else coarse_over7 += over7;
  }
  printf("%ld %ld ", bad_bound, coarse_over7);
  // Nibble and sign packing against the one-element reference, -0 and tiny negatives included.
  long bad_pack = 0;
  for (int i = 0; i < 2000000; ++i) {
    float v[8];
    uint32_t code[8], want = 0;
    for (int e = 0; e < 8; ++e) {
      s = s * 1664525u + 1013904223u;
      const uint32_t kind = s >> 29;
      v[e] = kind == 0 ? -0.0f : kind == 1 ? 0.0f : kind == 2 ? -1e-30f : nvfp4_dit::bits_float(s & 0xC0FFFFFFu);
      code[e] = nvfp4_dit::e2m1_code_biased(fminf(fabsf(v[e]), 6.0f));
      want |= nvfp4_dit::float_to_e2m1_sw(v[e]) << (4 * e);
    }
    if (nvfp4_dit::pack8_biased_codes_signs(code, v) != want) ++bad_pack;
  }
  bad_enc += bad_pack;
  printf("%ld %ld %ld\n", bad_enc, bad_div, n_div);
  return 0;
}
"""


def test_fast_element_math_equals_reference_on_host(tmp_path):
    exe = compile_host_program(tmp_path, "qmath", HOST_PROGRAM)
    bad_bound, coarse_over7, bad_enc, bad_div, n_div = map(int, subprocess.run(
        [str(exe)], capture_output=True, text=True, check=True).stdout.split())
    assert bad_bound == 0, f"{bad_bound} amax values take the fast path with quotients >= 7"
    assert coarse_over7 > 0, "the coarse-scale exclusion is not needed (kLastCoarseScaleByte too high)"
    assert bad_enc == 0, f"{bad_enc} fp32 values encode differently from float_to_e2m1_sw"
    assert n_div > 90_000_000
    assert bad_div == 0, f"{bad_div} of {n_div} quotients differ from IEEE division"


# ---------------------------------------------------------------------------------------------
# GPU: bytes equal format.py
# ---------------------------------------------------------------------------------------------

def _make(shape_hnd, layout, dtype, gen, block_structure=True):
    """Random [B, H, S, D] data with per-head offsets and, optionally, per-128-block offsets in
    the layout's memory order; returns the tensor as the caller would pass it."""
    b, h, s, d = shape_hnd
    x = torch.randn(b, h, s, d, device="cuda", generator=gen)
    x += torch.randn(b, h, 1, d, device="cuda", generator=gen) * 2
    if block_structure:
        nb = (s + 127) // 128
        blk = torch.randn(b, h, nb, d, device="cuda", generator=gen)
        x += blk.repeat_interleave(128, dim=2)[:, :, :s]
    x = x.to(dtype)
    return x.transpose(1, 2).contiguous() if layout == "NHD" else x.contiguous()


def _assert_matches_format(qq, q, k, v, layout, kv_lens):
    """qq's bytes equal preprocess.quantize_qkv's given qq's means and balance; its means, scales and
    balance equal format.py's (means up to summation order, the rest exactly given the means)."""
    balance_qk = qq.balance is not None
    ref = preprocess.quantize_qkv(q, k, v, layout=layout, kv_lens=kv_lens, balance_qk=balance_qk, q_mean=qq.q_mean,
                           k_mean_override=qq.k_mean, v_mean_override=qq.v_mean, balance_override=qq.balance,
                           qk_format=qq.qk_format, basis_override=qq.smoothing_basis(), coeff_override=qq.q_coeff)
    for name in BYTE_FIELDS:
        got, want = getattr(qq, name), getattr(ref, name)
        assert got.shape == want.shape and got.dtype == want.dtype, (name, got.shape, want.shape)
        diff = (got != want).sum().item()
        assert diff == 0, f"{name}: {diff} of {got.numel()} bytes differ"
    for name in ("q_scale", "k_scale", "v_scale"):
        assert torch.equal(getattr(qq, name), getattr(ref, name)), name
    d = qq.head_dim
    qh, kh, vh = (fmt.to_hnd(t, layout) for t in (q, k, v))
    if balance_qk:
        # The kernel's balance is format.py's on the kernel's means (exactly: a tie on a power of two
        # would need an ulp of difference in a statistic, and the statistics here come from the same means).
        unbalanced = preprocess.quantize_qkv(q, k, v, layout=layout, kv_lens=kv_lens, balance_qk=True, q_mean=qq.q_mean,
                                      k_mean_override=qq.k_mean, v_mean_override=qq.v_mean)
        assert torch.equal(qq.balance, unbalanced.balance)
    qm_ref = preprocess.q_block_means(qh)
    km_ref, vm_ref = preprocess.k_mean(kh, kv_lens), preprocess.k_mean(vh, kv_lens)
    for got in (qq.q_mean, qq.k_mean, qq.v_mean):
        assert torch.all(got[..., d:] == 0)
    torch.testing.assert_close(qq.q_mean[..., :d], qm_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(qq.k_mean[..., :d], km_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(qq.v_mean[..., :d], vm_ref, rtol=1e-5, atol=1e-5)
    # q . km with the same km: only the summation order differs.
    scale = (qh.float().abs() * qq.k_mean[..., :d].abs().repeat_interleave(qh.shape[1] // kh.shape[1], 1)[:, :, None]).sum(-1)
    assert torch.all((qq.q_dot_km - ref.q_dot_km).abs() <= 1e-5 * scale + 1e-6)
    return ref


def _assert_smoothing_matches(qq, ref, key_bias=None, scale=None):
    """The kernel's smoothing basis against smoothing.smoothing_basis of its block means (the same
    subspace and scale, the center to fp32 summation order), its coefficients against
    basis_coefficients on its own basis, and its key projections against smoothing.key_projections
    of the reference's k - km on its own basis: within one fp16 rounding of each value."""
    d = qq.head_dim
    basis = qq.smoothing_basis()
    want = smoothing.smoothing_basis(qq.q_mean[..., :d])
    assert torch.equal(basis.scale, want.scale)
    torch.testing.assert_close(basis.center[..., :d], want.center, rtol=1e-5, atol=1e-6)
    assert torch.all(basis.rows[..., d:] == 0) and torch.all(basis.center[..., d:] == 0)
    got_proj = basis.rows[..., :d].double().transpose(-1, -2) @ basis.rows[..., :d].double()
    want_proj = want.rows.double().transpose(-1, -2) @ want.rows.double()
    assert (got_proj - want_proj).abs().max() < 1e-3  # the same subspace (both converge alike)
    coeff = smoothing.basis_coefficients(qq.q_mean, basis)
    torch.testing.assert_close(qq.q_coeff, coeff, rtol=1e-4, atol=1e-5 * float(coeff.abs().max()) + 1e-30)
    proj = smoothing.key_projections(ref.k_smoothed, basis, key_bias=key_bias, scale=scale)
    got = qq.key_projections
    assert torch.equal(got.factors, proj.factors) or (got.factors / proj.factors).log2().abs().max() <= 1
    gv, wv = got.dequantize().double(), proj.dequantize().double()
    unit = proj.factors.double().repeat_interleave(fmt.SEQ_TILE, -1)[..., None]
    finite = torch.isfinite(wv)
    assert torch.equal(finite, torch.isfinite(gv)) and torch.equal(gv[~finite], wv[~finite])
    assert torch.all((gv - wv)[finite].abs() <= (2.0 ** -10 * wv.abs() + unit * 2.0 ** -24)[finite])


def _run_case(b, h, hkv, sq, sk, d, layout, dtype, kv_lens=None, seed=0, balance_qk=False, qk_format="nvfp4"):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = _make((b, h, sq, d), layout, dtype, gen)
    k = _make((b, hkv, sk, d), layout, dtype, gen, block_structure=False)
    v = _make((b, hkv, sk, d), layout, dtype, gen, block_structure=False)
    if balance_qk:  # channels where K is large and Q small, and the reverse: the balance moves them
        kh, qh = fmt.to_hnd(k, layout), fmt.to_hnd(q, layout)
        kh[..., :4] *= 16
        qh[..., :4] /= 16
        qh[..., 4:8] *= 8
    lens = None if kv_lens is None else torch.tensor(kv_lens, device="cuda", dtype=torch.int32)
    qq = cq.quantize_qkv(q, k, v, layout=layout, kv_lens=lens, balance_qk=balance_qk, qk_format=qk_format)
    assert (qq.balance is not None) == balance_qk and qq.qk_format == qk_format
    ref = _assert_matches_format(qq, q, k, v, layout, lens)
    if balance_qk and sq > 1:  # a single query row is its own mean: no Q statistics, s = 1
        assert (qq.balance != 1).any(), "the balance did not move any channel"
    return qq, ref, (q, k, v, lens)


@pytest.mark.cuda
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("balance_qk", [False, True])
def test_bytes_equal_format_4096(layout, dtype, d, balance_qk):
    kv_lens = [4096, 3001] if dtype == torch.float16 else None
    _run_case(2, 4, 2, 4096, 4096, d, layout, dtype, kv_lens=kv_lens, balance_qk=balance_qk)


@pytest.mark.cuda
@pytest.mark.parametrize("b, h, hkv, sq, sk, d, layout, dtype, kv_lens", [
    (2, 4, 2, 4096, 4096, 128, "NHD", torch.bfloat16, [4096, 3001]),
    (2, 4, 2, 2000, 2500, 64, "HND", torch.float16, None),
    (1, 3, 1, 1000, 777, 72, "HND", torch.float32, None),      # D padded to 128: half-empty MX blocks
    (1, 8, 2, 257, 4133, 40, "NHD", torch.bfloat16, [4100]),   # D padded to 64, GQA 4:1
])
@pytest.mark.parametrize("balance_qk", [False, True])
def test_mxfp8_bytes_equal_format(b, h, hkv, sq, sk, d, layout, dtype, kv_lens, balance_qk):
    """MXFP8 Q/K (e4m3, ue8m0 per 32) from the quantiser."""
    qq, _, _ = _run_case(b, h, hkv, sq, sk, d, layout, dtype, kv_lens=kv_lens, seed=3, balance_qk=balance_qk,
                         qk_format="mxfp8")
    dp = fmt.padded_head_dim(d)
    assert qq.q_data.shape[-1] == dp and qq.q_sf.shape[-1] == dp // 32 and qq.k_sf.shape[-1] == dp // 32


@pytest.mark.cuda
@pytest.mark.parametrize("b, h, hkv, sq, sk, d, layout, dtype, kv_lens", [
    (1, 3, 1, 1000, 777, 72, "HND", torch.float32, None),     # D padded to 128, ragged lengths
    (2, 2, 2, 1, 300, 40, "NHD", torch.bfloat16, [0, 45]),     # one query row, D padded to 64, empty batch
    (1, 8, 2, 257, 4133, 128, "NHD", torch.float16, [4100]),  # GQA 4:1, tails inside a 32-key group
])
@pytest.mark.parametrize("balance_qk", [False, True])
def test_bytes_equal_format_ragged(b, h, hkv, sq, sk, d, layout, dtype, kv_lens, balance_qk):
    qq, ref, (q, k, v, lens) = _run_case(b, h, hkv, sq, sk, d, layout, dtype, kv_lens=kv_lens, seed=1,
                                         balance_qk=balance_qk)
    _assert_smoothing_matches(qq, ref)


@pytest.mark.cuda
@pytest.mark.parametrize("d, dtype", [(1, torch.float16), (17, torch.bfloat16), (128, torch.float32)])
def test_bytes_equal_format_on_the_coarsest_scales(d, dtype):
    """Blocks whose amax / 6 rounds to the smallest subnormal scales (2^-9, 2^-8): quotients
    reach 9 there, past the unclamped encoder's range (the GPU fuzz found this with D = 1, 17,
    33: blocks of one valid element and a small |x - mean|)."""
    gen = torch.Generator(device="cuda").manual_seed(d)
    b, h, s = 1, 2, 1000
    # Per-row magnitudes over seven decades: the tensor scale of K and V (one per head) puts
    # the largest at the top of ue4m3, so the smallest rows' blocks land on the subnormal scales.
    mag = torch.logspace(-7, 0, s, device="cuda")[None, None, :, None]
    q, k, v = ((torch.randn(b, h, s, d, device="cuda", generator=gen) * mag).to(dtype) for _ in range(3))
    qq = cq.quantize_qkv(q, k, v, layout="HND")
    coarse = [((sf == 1) | (sf == 2)).any() for sf in (qq.k_sf[..., :(d + 15) // 16], qq.vt_sf[:, :, :d])]
    assert any(coarse), "the data misses the coarse scales"
    _assert_matches_format(qq, q, k, v, "HND", None)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype, d, layout, qk_format", [
    (torch.bfloat16, 128, "NHD", "nvfp4"), (torch.float16, 64, "HND", "mxfp8"), (torch.float32, 128, "HND", "nvfp4"),
])
def test_tiles_under_their_own_scale_end_under_their_heads(dtype, d, layout, qk_format):
    """K and V tiles are quantised under their own tensor scale, then moved to their head's by the
    fix-up pass: by a shift of their scale bytes, or quantised again where a byte would leave its
    normal range. Tiles over 30 binades and rows 2^-12 below their tile's largest take both paths
    (the statistics tiles are zero, so the means are too and smoothing keeps the magnitudes); the
    bytes and the heads' scales must be format.py's."""
    gen = torch.Generator(device="cuda").manual_seed(11)
    b, h, s = 2, 2, 40 * 128 + 77
    lens = torch.tensor([s, s - 300], device="cuda")
    tile_mag = torch.pow(2.0, torch.randint(-24, 6, (b, h, s // 128 + 1), device="cuda", generator=gen).float())
    mag = tile_mag.repeat_interleave(128, -1)[..., :s, None]
    mag[:, :, 7 * 128:7 * 128 + 40] *= 2.0 ** -12
    mag[fmt.sampled_key_mask(lens, b, s, "cuda")[:, None, :, None].expand_as(mag)] = 0.0
    q = torch.randn(b, h, s, d, device="cuda", generator=gen)
    k, v = (torch.randn(b, h, s, d, device="cuda", generator=gen) * mag for _ in range(2))
    q, k, v = ((t.transpose(1, 2) if layout == "NHD" else t).contiguous().to(dtype) for t in (q, k, v))
    qq = cq.quantize_qkv(q, k, v, layout=layout, kv_lens=lens, qk_format=qk_format)
    ref = _assert_matches_format(qq, q, k, v, layout, lens)
    # The premise, from format.py on the same inputs: some tiles shift, some are quantised again.
    vh = torch.where(fmt.valid_key_mask(lens, b, s, "cuda")[:, None, :, None], fmt.to_hnd(v, layout).float(), 0.0)
    v_tiles = fmt.pad_dim(vh, 2, ref.k_smoothed.shape[2]).unflatten(2, (-1, fmt.SEQ_TILE)).transpose(3, 4)
    paths = [_fix_up_paths(ref.k_smoothed.unflatten(2, (-1, fmt.SEQ_TILE)), qk_format), _fix_up_paths(v_tiles, "nvfp4")]
    assert any(shifted for shifted, _ in paths) and any(again for _, again in paths), paths


def _fix_up_paths(tiles, qk_format):
    """(tiles that shift, tiles quantised again) of [..., tiles, rows, cols] smoothed tiles blocked
    along cols, moved from their own tensor scale to their head's."""
    amax = tiles.abs().amax((-2, -1))
    own, head = fmt.tensor_scale(amax), fmt.tensor_scale(amax.amax(-1, keepdim=True))
    data, sf = fmt.quantize_qk_rows(tiles / own[..., None, None], qk_format)
    room = fmt.scale_headroom(sf, data, qk_format).flatten(-2).amin(-1)
    shift = torch.log2(head / own)
    return int(((shift > 0) & (shift <= room) & (amax > 0)).sum()), int(((shift > room) & (amax > 0)).sum())


@pytest.mark.cuda
def test_non_unit_strides_and_specials():
    """Strided views (no copy; D not unit-stride) and NaN, inf, -0, huge values."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    b, s, h, d = 2, 700, 2, 64
    # NHD views whose D axis has stride H (the scalar-load path) and a batch stride with a gap.
    base = torch.randn(b, s, d, h + 1, device="cuda", generator=gen).to(torch.bfloat16)
    q = base[..., :h].transpose(2, 3)
    assert q.stride(-1) != 1
    k = torch.randn(b, s, d, h, device="cuda", generator=gen).to(torch.bfloat16).transpose(2, 3)
    v = (torch.randn(b, s, d, h, device="cuda", generator=gen) * 3).to(torch.bfloat16).transpose(2, 3)
    q[0, 5, 0, 3] = float("nan")
    q[0, 200, 1, 17] = float("inf")
    q[1, 300, 0, :16] = -0.0
    k[0, 17, 1, 40] = -float("inf")
    v[1, 33, 0, 7] = float("nan")
    v[0, 64, 1, :] = 1e4  # saturates the 448 scale: codes clamp to 6
    k[1, 100, 0, 20] = 3e38
    qq = cq.quantize_qkv(q, k, v, layout="NHD")
    ref = preprocess.quantize_qkv(q, k, v, layout="NHD", q_mean=qq.q_mean, k_mean_override=qq.k_mean,
                           v_mean_override=qq.v_mean, balance_override=qq.balance)
    for name in BYTE_FIELDS:
        diff = (getattr(qq, name) != getattr(ref, name)).sum().item()
        assert diff == 0, f"{name}: {diff} bytes differ"
    # The same data as contiguous tensors takes the vector-load path, whose means may differ in the
    # last bit (another summation order): bytes equal format.py's with its own means.
    qc, kc, vc = q.contiguous(), k.contiguous(), v.contiguous()
    qq2 = cq.quantize_qkv(qc, kc, vc, layout="NHD")
    ref2 = preprocess.quantize_qkv(qc, kc, vc, layout="NHD", q_mean=qq2.q_mean, k_mean_override=qq2.k_mean,
                            v_mean_override=qq2.v_mean, balance_override=qq2.balance)
    for name in BYTE_FIELDS:
        assert torch.equal(getattr(qq2, name), getattr(ref2, name)), name
    torch.testing.assert_close(qq2.q_mean, qq.q_mean, rtol=1e-5, atol=1e-6, equal_nan=True)
    torch.testing.assert_close(qq2.k_mean, qq.k_mean, rtol=1e-5, atol=1e-6, equal_nan=True)


@pytest.mark.cuda
@pytest.mark.parametrize("b, h, hkv, sq, sk, d, layout, dtype, kv_lens", [
    (1, 1, 1, 1, 50, 64, "NHD", torch.bfloat16, None),            # one query row, keys < a tile
    (2, 4, 2, 300, 1500, 128, "HND", torch.float16, [0, 1111]),  # a batch without keys, a tail in a chunk
    (1, 8, 2, 257, 4133, 128, "NHD", torch.bfloat16, [4100]),    # GQA 4:1, several K-mean chunks
    (1, 40, 40, 16384, 16384, 128, "NHD", torch.bfloat16, None),
    (2, 16, 8, 4096, 16384, 128, "HND", torch.float16, [16384, 9000]),
])
def test_bytes_equal_format_at_scale(b, h, hkv, sq, sk, d, layout, dtype, kv_lens):
    """format.py's bytes on long and GQA inputs with key lengths."""
    _run_case(b, h, hkv, sq, sk, d, layout, dtype, kv_lens=kv_lens, seed=4)


@pytest.mark.cuda
@pytest.mark.parametrize("layout, dtype, d, kv_lens", [
    ("NHD", torch.bfloat16, 128, None),
    ("HND", torch.float16, 128, [300, 77]),
    ("NHD", torch.float32, 40, [1, 300]),     # scalar loads (D < Dp)
    ("HND", torch.bfloat16, 72, [0, 250]),    # a batch without keys
])
def test_nonfinite_flags_equal_torch(layout, dtype, d, kv_lens):
    """The quantiser's NaN/inf flags (per Q block, per kv head) equal preprocess.nonfinite_blocks:
    values past kv_lens are ignored, huge finite values are not flagged."""
    gen = torch.Generator(device="cuda").manual_seed(11)
    b, h, hkv, sq, sk = 2, 4, 2, 700, 300
    q = _make((b, h, sq, d), layout, dtype, gen)
    k = _make((b, hkv, sk, d), layout, dtype, gen, block_structure=False)
    v = _make((b, hkv, sk, d), layout, dtype, gen, block_structure=False)
    lens = None if kv_lens is None else torch.tensor(kv_lens, device="cuda", dtype=torch.int64)
    big = 6e4 if dtype == torch.float16 else 3e38
    qh, kh, vh = (fmt.to_hnd(t, layout) for t in (q, k, v))
    r = torch.Generator().manual_seed(5)
    pick = lambda n: int(torch.randint(n, (1,), generator=r))  # noqa: E731
    for t, heads, seq in ((qh, h, sq), (kh, hkv, sk), (vh, hkv, sk)):
        for value in (float("nan"), float("inf"), -float("inf"), big):
            t[pick(b), pick(heads), pick(seq), pick(d)] = value
    vh[1, 1, sk - 1, 0] = float("nan")  # past kv_lens[1] where lengths are given
    qq = cq.quantize_qkv(q, k, v, layout=layout, kv_lens=lens)
    want_q, want_kv = preprocess.nonfinite_blocks(qh, kh, vh, lens)
    got_q, got_kv = qq.nonfinite
    assert got_q.shape == want_q.shape and got_kv.shape == want_kv.shape
    assert torch.equal(got_q, want_q), (got_q.nonzero().tolist(), want_q.nonzero().tolist())
    assert torch.equal(got_kv, want_kv), (got_kv.tolist(), want_kv.tolist())
    assert want_q.any() and want_kv.any() and not want_q.all()


@pytest.mark.cuda
@pytest.mark.parametrize("b, s, h, d, layout, dtype, kv_lens", [
    (2, 75_600, 2, 128, "NHD", torch.bfloat16, None),          # Wan 720p length, CFG batch
    (1, 118_800 + 256, 2, 64, "HND", torch.float16, [118_900]),  # HunyuanVideo length + text
])
def test_bytes_equal_format_long(b, s, h, d, layout, dtype, kv_lens):
    _run_case(b, h, h, s, s, d, layout, dtype, kv_lens=kv_lens, seed=2)


@pytest.mark.cuda
def test_beyond_int32_bytes_and_smoothing():
    """H=40 at 118,800+256 tokens: the quantised bytes are exact and the smoothing outputs match the
    reference; nothing of size (Q blocks) x (keys) is allocated (the call's peak stays near its
    operands)."""
    b, h, s, d = 1, 40, 118_800 + 256, 128
    gen = torch.Generator(device="cuda").manual_seed(4)
    q = _make((b, h, s, d), "NHD", torch.bfloat16, gen)
    k = _make((b, h, s, d), "NHD", torch.bfloat16, gen, block_structure=False)
    v = _make((b, h, s, d), "NHD", torch.bfloat16, gen, block_structure=False)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    qq = cq.quantize_qkv(q, k, v)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    assert peak <= qq.workspace.layout.total_bytes + (64 << 20)
    ref = _assert_matches_format(qq, q, k, v, "NHD", None)
    _assert_smoothing_matches(qq, ref)


@pytest.mark.cuda
def test_smoothing_is_deterministic_and_per_head():
    """Two calls give the same bits, and a head's basis, coefficients and projections do not depend
    on the heads quantised with it (context parallelism splits heads)."""
    gen = torch.Generator(device="cuda").manual_seed(6)
    q = _make((1, 4, 3000, 128), "HND", torch.bfloat16, gen)
    k = _make((1, 2, 3000, 128), "HND", torch.bfloat16, gen, block_structure=False)
    v = _make((1, 2, 3000, 128), "HND", torch.bfloat16, gen, block_structure=False)
    first, again = (cq.quantize_qkv(q, k, v, layout="HND") for _ in range(2))
    names = ("q_center", "q_basis", "q_basis_scale", "q_coeff", "q_data", "k_data")
    for name in names:
        assert torch.equal(getattr(first, name), getattr(again, name)), name
    assert torch.equal(first.key_projections.values, again.key_projections.values)
    half = cq.quantize_qkv(q[:, 2:], k[:, 1:], v[:, 1:], layout="HND")
    for name in ("q_center", "q_basis", "q_basis_scale", "q_coeff", "q_data"):
        assert torch.equal(getattr(half, name), getattr(first, name)[:, 2:]), name
    assert torch.equal(half.key_projections.values, first.key_projections.values[:, 2:])


@pytest.mark.cuda
def test_key_bias_joins_the_projections():
    gen = torch.Generator(device="cuda").manual_seed(7)
    q = _make((2, 4, 700, 64), "NHD", torch.float16, gen)
    k = _make((2, 2, 900, 64), "NHD", torch.float16, gen, block_structure=False)
    v = _make((2, 2, 900, 64), "NHD", torch.float16, gen, block_structure=False)
    bias = torch.randn(2, 4, 900, device="cuda", generator=gen)
    bias[:, :, ::7] = float("-inf")
    qq = cq.quantize_qkv(q, k, v, key_bias=bias, scale=0.125)
    ref = _assert_matches_format(qq, q, k, v, "NHD", None)
    _assert_smoothing_matches(qq, ref, key_bias=bias, scale=0.125)
    assert torch.isneginf(qq.key_projections.values[:, :, 0:900:7, 0]).all()


@pytest.mark.cuda
def test_input_errors_name_the_argument():
    x = torch.randn(1, 128, 2, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="head dim 160"):
        y = torch.randn(1, 128, 2, 160, device="cuda", dtype=torch.bfloat16)
        cq.quantize_qkv(y, y, y)
    with pytest.raises(TypeError, match="k must be"):
        cq.quantize_qkv(x, x.to(torch.int32), x)
    with pytest.raises(ValueError, match="multiple of k/v heads"):
        cq.quantize_qkv(torch.randn(1, 128, 3, 64, device="cuda"), torch.randn(1, 128, 2, 64, device="cuda"),
                             torch.randn(1, 128, 2, 64, device="cuda"))
    with pytest.raises(ValueError, match="kv_lens"):
        cq.quantize_qkv(x, x, x, kv_lens=torch.tensor([1, 2], device="cuda"))
    with pytest.raises(ValueError, match="layout"):
        cq.quantize_qkv(x, x, x, layout="BSHD")
    with pytest.raises(ValueError, match="CUDA"):
        cq.quantize_qkv(x.cpu(), x.cpu(), x.cpu())
    with pytest.raises(ValueError, match="key_bias"):
        cq.quantize_qkv(x, x, x, key_bias=torch.zeros(1, 3, 128, device="cuda"), scale=0.1)
    with pytest.raises(ValueError, match="scale"):
        cq.quantize_qkv(x, x, x, key_bias=torch.zeros(1, 1, 128, device="cuda"))
