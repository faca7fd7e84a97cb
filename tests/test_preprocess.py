"""The reference preprocessing (nvfp4_dit.preprocess): layouts and padding of quantize_qkv, the means and
non-finite flags."""

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

