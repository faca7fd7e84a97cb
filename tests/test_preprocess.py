"""The reference preprocessing (nvfp4_dit.preprocess): layouts and padding of quantize_qkv, the means and
non-finite flags, and the correction's fixed-point arithmetic and error bound."""

import math

import pytest
import torch

from nvfp4_dit import format as fmt
from nvfp4_dit import preprocess


def test_quantize_qkv_layouts_and_padding(gen):
    b, sq, sk, h, hkv, d = 2, 150, 100, 4, 2, 40
    q = torch.randn(b, sq, h, d, generator=gen)
    k = torch.randn(b, sk, hkv, d, generator=gen)
    v = torch.randn(b, sk, hkv, d, generator=gen)
    qq = preprocess.quantize_qkv(q, k, v, layout="NHD")
    assert qq.head_dim_padded == 64
    assert qq.q_data.shape == (b, h, 256, 32) and qq.q_sf.shape == (b, h, 256, 4)
    assert qq.k_data.shape == (b, hkv, 128, 32) and qq.k_sf.shape == (b, hkv, 128, 4)
    assert qq.vt_data.shape == (b, hkv, 64, 64) and qq.vt_sf.shape == (b, hkv, 64, 8)
    assert qq.q_mean.shape == (b, h, 2, 64) and qq.k_mean.shape == (b, hkv, 64)
    assert qq.q_dot_km.shape == (b, h, sq)
    # Padding is exactly zero: rows past S, columns past D, V tokens past Sk.
    assert torch.all(qq.q_data[:, :, sq:] == 0) and torch.all(qq.q_sf[:, :, sq:] == 0)
    assert torch.all(qq.vt_data[:, :, d:] == 0) and torch.all(qq.vt_sf[:, :, :, 7:] == 0)
    k_nat = fmt.permute_k_rows(qq.k_data, dim=2)
    assert torch.all(k_nat[:, :, sk:] == 0)
    # The same data in HND gives the same bytes.
    qq2 = preprocess.quantize_qkv(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), layout="HND")
    assert torch.equal(qq.q_data, qq2.q_data) and torch.equal(qq.k_sf, qq2.k_sf)
    assert torch.equal(qq.vt_data, qq2.vt_data)


def test_means_respect_kv_lens_and_valid_rows(gen):
    k = torch.randn(2, 200, 1, 16, generator=gen)
    lens = torch.tensor([200, 37])
    km = preprocess.k_mean(k.transpose(1, 2), lens)
    assert torch.allclose(km[1, 0], k[1, :37, 0].mean(0), atol=1e-6)
    q = torch.randn(1, 130, 1, 16, generator=gen)
    qm = preprocess.q_block_means(q.transpose(1, 2))
    assert torch.allclose(qm[0, 0, 1], q[0, 128:, 0].mean(0), atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nonfinite_blocks_equal_the_elementwise_definition(gen, dtype):
    b, h, hkv, sq, sk, d = 2, 4, 2, 300, 90, 24
    q, k, v = (torch.randn(b, hh, s, d, generator=gen).to(dtype) for hh, s in ((h, sq), (hkv, sk), (hkv, sk)))
    q[0, 1, 129, 3], q[1, 3, 299, 0], q[1, 0, 5, 5] = math.nan, math.inf, 3e38   # blocks 1, 2 bad; huge ok
    k[0, 1, 10, 2], v[1, 0, 80, 23], v[1, 1, 89, 0] = -math.inf, math.nan, math.nan
    lens = torch.tensor([90, 85])  # v[1, 1, 89] lies past kv_lens[1]: ignored
    q_bad, kv_bad = preprocess.nonfinite_blocks(q, k, v, lens)
    rows_bad = ~torch.isfinite(q).all(-1)
    want_q = fmt.pad_dim(rows_bad, 2, 384).view(b, h, 3, 128).any(-1)
    valid = fmt.valid_key_mask(lens, b, sk, "cpu")[:, None, :]
    want_kv = ((~torch.isfinite(k).all(-1) | ~torch.isfinite(v).all(-1)) & valid).any(-1)
    assert torch.equal(q_bad, want_q) and torch.equal(kv_bad, want_kv)
    assert q_bad.sum() == 2 and kv_bad.tolist() == [[False, True], [True, False]]


def test_quantize_qkv_mxfp8_layouts(gen):
    q, k, v = (torch.randn(2, 200, 2, 80, generator=gen) for _ in range(3))
    qq = preprocess.quantize_qkv(q, k, v, qk_format="mxfp8")
    assert qq.qk_format == "mxfp8"
    assert qq.q_data.shape == (2, 2, 256, 128) and qq.q_sf.shape == (2, 2, 256, 4)
    assert qq.k_data.shape == (2, 2, 256, 128) and qq.k_sf.shape == (2, 2, 256, 4)
    # P and V are NVFP4 whatever the Q/K format.
    ref = preprocess.quantize_qkv(q, k, v)
    assert torch.equal(qq.vt_data, ref.vt_data) and torch.equal(qq.vt_sf, ref.vt_sf)
    q_hat, k_hat, _ = preprocess.dequantize_qkv(qq)
    assert (q_hat[:, :, :200, 80:] == 0).all() and (k_hat[:, :, 200:] == 0).all()
    with pytest.raises(ValueError, match="qk_format"):
        preprocess.quantize_qkv(q, k, v, qk_format="e4m3")


@pytest.mark.parametrize("qk_format", fmt.QK_FORMATS)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_quantized_planes_are_dense_whatever_the_input_strides(gen, qk_format, layout):
    # The attention kernel reads the byte planes as dense rows (kernels._check_plane): an NHD
    # input seen as HND must not leak its strides into the codes.
    q, k, v = (torch.randn(2, 256, 2, 64, generator=gen) for _ in range(3))  # no row padding
    if layout == "HND":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    qq = preprocess.quantize_qkv(q, k, v, layout=layout, qk_format=qk_format)
    for name in ("q_data", "q_sf", "k_data", "k_sf", "vt_data", "vt_sf"):
        plane = getattr(qq, name)
        assert plane.dtype == torch.uint8 and plane.is_contiguous(), name


# ---------------------------------------------------------------------------------------------
# The correction term: 22-bit fixed point, int8 limbs (the arithmetic of csrc/quantize/correction.cu)
# ---------------------------------------------------------------------------------------------

def _correction_case(gen, outlier=1.0, h=4, hkv=2, s=300, d=128):
    q = torch.randn(1, s, h, d, generator=gen) * 2 + 3
    k = torch.randn(1, s, hkv, d, generator=gen) * 5 + 1
    k[..., 5] *= outlier
    return preprocess.quantize_qkv(q, k, torch.randn(1, s, hkv, d, generator=gen)), h // hkv


def test_correction_fixed_point_rows():
    x = torch.tensor([[3.0, -1.5, 0.25, 0.0],         # amax 3 in [2, 4): e = 2
                      [0.0, 0.0, 0.0, 0.0],           # zero row: clamped exponent, zeros
                      [math.nan, math.inf, 1.0, -0.75],  # non-finite counts as 0
                      [1e-35, 1e-40, 0.0, 0.0],       # tiny rows: e clamped to -100
                      [2.0 ** -23, 1.0, 0.0, 0.0]])   # below half a unit of the row: rounds to 0
    fixed, e = preprocess.correction_fixed_point(x)
    assert e.tolist() == [2, -100, 1, -100, 1]
    assert fixed[0].tolist() == [3 << 20, -(3 << 19), 1 << 18, 0]
    assert fixed[1].tolist() == [0] * 4
    assert fixed[3].tolist() == [round(torch.tensor(1e-35).item() * 2.0 ** 122), 0, 0, 0]
    assert fixed[2].tolist() == [0, 0, 1 << 21, -(3 << 19)]
    assert fixed[4].tolist() == [0, 1 << 21, 0, 0]
    # Ties round to even, and the top of the range is reachable without overflow.
    ties = torch.tensor([[1.0, 2.0 ** -21 * 1.5, 2.0 ** -21 * 2.5, -(2.0 ** -21) * 0.5]])  # e = 1: unit 2^-21
    assert preprocess.correction_fixed_point(ties)[0][0].tolist() == [1 << 21, 2, 2, 0]
    top = torch.tensor([[1.0 - 2.0 ** -24]])
    assert preprocess.correction_fixed_point(top)[0].item() == 1 << 22


def test_correction_limbs_are_int8_and_recompose():
    fixed = torch.cat([torch.arange(-(1 << 22), -(1 << 22) + 5000), torch.arange(-70000, 70000, 7),
                       torch.arange((1 << 22) - 5000, (1 << 22) + 1),
                       torch.randint(-(1 << 22), (1 << 22) + 1, (100000,), generator=torch.Generator().manual_seed(0))])
    fixed = fixed.to(torch.int32)
    l0, l1, l2 = preprocess.correction_limbs(fixed)
    assert torch.equal(l0 * 65536 + l1 * 256 + l2, fixed)
    assert l0.abs().max() <= 64 and l1.min() >= -128 and l1.max() <= 127 and l2.min() >= -128 and l2.max() <= 127


@pytest.mark.parametrize("outlier", [1.0, 20.0])
def test_correction_equals_the_kernels_int8_accumulators(gen, outlier):
    """preprocess.correction is the CUDA kernel's arithmetic: eight int8 limb products per element
    summed in four int32 accumulators (weights 2^32 .. 2^8), one int64 -> fp32 rounding, powers of
    two. Modelled here in int64, it must equal preprocess.correction bit for bit."""
    qq, group = _correction_case(gen, outlier)
    qf, eq = preprocess.correction_fixed_point(qq.q_mean)
    kf, ek = preprocess.correction_fixed_point(qq.k_smoothed)
    q_limbs = [x.long() for x in preprocess.correction_limbs(qf)]
    k_limbs = [x.long().repeat_interleave(group, 1) for x in preprocess.correction_limbs(kf)]
    acc = []
    for weight in range(4):
        pairs = [(i, weight - i) for i in range(3) if 0 <= weight - i < 3]
        terms = [torch.einsum("bhnd,bhkd->bhnk", q_limbs[i], k_limbs[j]) for i, j in pairs]
        assert all(t.abs().max() < 2 ** 31 for t in terms)  # int32 in the kernel
        acc.append(sum(terms))
    total = (acc[0] << 32) + (acc[1] << 24) + (acc[2] << 16) + (acc[3] << 8)
    key_factor = fmt._power_of_two(ek.repeat_interleave(group, 1) - 22)[:, :, None, :]
    row_factor = fmt._power_of_two(eq - 22) * (1.0 / qq.score_scale())
    delta = (total.float() * key_factor) * row_factor[..., None]
    # Stored per 128-key tile: fp16 under 2^e, e = eq + max_tile(ek) - u + log2(Dp) - 15.
    ek_tile = ek.repeat_interleave(group, 1).unflatten(-1, (-1, 128)).amax(-1)
    u = torch.frexp(qq.score_scale())[1] - 1
    e = (eq[..., None] + ek_tile[:, :, None, :] - u[..., None] + 7 - 15).clamp(-126, 111)
    factor = fmt._power_of_two(e).repeat_interleave(128, -1)
    assert torch.all((delta / factor).abs() < 2 ** 15)
    want = fmt.Correction((delta / factor).half(), fmt._power_of_two(e))
    got = preprocess.correction(qq)
    assert got.same_bits(want)
    # Chunking the keys does not change a bit.
    assert preprocess.correction(qq, key_chunk=128).same_bits(want)
    assert preprocess.correction(qq, 1, 3).same_bits(want.rows(1, 3))


@pytest.mark.parametrize("outlier", [1.0, 20.0])
def test_correction_error_bound_against_fp64(gen, outlier):
    """|delta - exact| <= Dp 2^(eq + ek - 22) / (q_scale k_scale) + 2^-24 |delta| (the fixed-point
    product) plus the fp16 storage: 2^-11 of the value, or 2^-25 of the tile's factor below fp16's
    normal range (preprocess.correction); the first part is below Dp 2^-20 amax|qm| amax|ks|."""
    qq, group = _correction_case(gen, outlier)
    qm = qq.q_mean.double()
    ks = qq.k_smoothed.double().repeat_interleave(group, 1)
    unit = 1.0 / qq.score_scale().double()[..., None]
    exact = (qm @ ks.transpose(-1, -2)) * unit
    stored = preprocess.correction(qq)
    err = (stored.dequantize().double() - exact).abs()
    _, eq = preprocess.correction_fixed_point(qq.q_mean)
    _, ek = preprocess.correction_fixed_point(qq.k_smoothed)
    dp = qm.shape[-1]
    e = (eq[..., None] + ek.repeat_interleave(group, 1)[:, :, None, :] - 22).double()
    fixed_point = dp * torch.pow(2.0, e) * unit + exact.abs() * 2.0 ** -23
    storage = exact.abs() * 2.0 ** -11 + stored.factors.double().repeat_interleave(128, -1) * 2.0 ** -25
    assert torch.all(err <= fixed_point + storage)
    amax = qm.abs().amax(-1)[..., None] * ks.abs().amax(-1)[:, :, None, :]
    assert torch.all(err <= dp * 2.0 ** -20 * amax * unit + exact.abs() * (2.0 ** -23 + 2.0 ** -11) +
                     stored.factors.double().repeat_interleave(128, -1) * 2.0 ** -25)
    # The fp16 storage dominates and stays far below what the FP4 scores carry: under 2^-10 of the
    # largest entry of each tile's row.
    row_max = exact.abs().unflatten(-1, (-1, 128)).amax(-1, keepdim=True)
    assert torch.all(err.unflatten(-1, (-1, 128)) <= 2.0 ** -10 * row_max + 1e-30)


def test_stored_correction_saturates_finite_values_and_keeps_inf_and_nan():
    """format.store_correction: a large finite key bias stays finite (+-65504 units), -inf (a
    masked key) and NaN pass, and values are exact multiples of the factor's fp16 grid."""
    delta = torch.zeros(1, 1, 1, 256)
    delta[..., 0] = -1e30          # a finite bias far beyond the tile's range
    delta[..., 1] = -math.inf
    delta[..., 2] = math.nan
    delta[..., 3] = 3.0
    delta[..., 128] = 2.0 ** -40   # below fp16's range under factor 2^-10: rounds to 0
    stored = fmt.store_correction(delta, torch.tensor([[[[0, -10]]]], dtype=torch.int32))
    values = stored.dequantize()
    assert values[..., 0].item() == -65504.0 and values[..., 1].item() == -math.inf
    assert math.isnan(values[..., 2].item()) and values[..., 3].item() == 3.0
    assert values[..., 128].item() == 0.0 and stored.factors.flatten().tolist() == [1.0, 2.0 ** -10]