"""Reference NVFP4 attention against exact fp64 attention: the accuracy floor of the algorithm."""

import math

import pytest
import torch
import torch.nn.functional as F

from nvfp4_dit import format as fmt
from nvfp4_dit import preprocess
from nvfp4_dit.reference import attention_exact, attention_reference


def _cos(a, b):
    return F.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


def _alpha(out, exact):
    """Least-squares scale a minimising |a*out - exact|: 1 means no systematic shrink/growth."""
    out, exact = out.double(), exact.double()
    return ((out * exact).sum() / (out * out).sum()).item()


def _qkv(gen, b=1, sq=1024, sk=None, h=4, hkv=None, d=128):
    sk = sq if sk is None else sk
    hkv = h if hkv is None else hkv
    q = torch.randn(b, sq, h, d, generator=gen)
    k = torch.randn(b, sk, hkv, d, generator=gen)
    v = torch.randn(b, sk, hkv, d, generator=gen)
    return q, k, v


@pytest.mark.parametrize("d", [64, 128])
def test_iid_inputs(gen, d):
    q, k, v = _qkv(gen, d=d)
    out, lse = attention_reference(q, k, v, return_lse=True)
    exact, lse_exact = attention_exact(q, k, v)
    assert _cos(out, exact) >= 0.98
    assert (lse - lse_exact).abs().mean().item() <= 0.02


def test_block_structured_q(gen):
    # DiT queries carry large per-region offsets; per-128-block Q means absorb them.
    q, k, v = _qkv(gen, sq=1024)
    offsets = 3.0 * torch.randn(1, 8, 4, 128, generator=gen).repeat_interleave(128, dim=1)
    q = q + offsets
    out = attention_reference(q, k, v)
    exact, _ = attention_exact(q, k, v)
    assert _cos(out, exact) >= 0.98
    assert 0.97 <= _alpha(out, exact) <= 1.03
    # The single-mean variant is measurably worse on this input.
    single = attention_reference(q, k, v, per_block_mean=False)
    assert _cos(single, exact) < _cos(out, exact)


def test_uniform_score_probe():
    # All-equal scores and V = ones: V smoothing takes the constant out of quantisation, so the
    # output is exactly 1 (never a halved 0.5), and the LSE is ln(S).
    s = 1000
    q = torch.zeros(1, s, 2, 64)
    k = torch.zeros(1, s, 2, 64)
    v = torch.ones(1, s, 2, 64)
    out, lse = attention_reference(q, k, v, return_lse=True)
    assert torch.equal(out, torch.ones_like(out))
    assert torch.allclose(lse, torch.full_like(lse, math.log(s)), atol=1e-5)


def test_lse_matches_logsumexp_with_scale(gen):
    q, k, v = _qkv(gen, sq=500, sk=700, d=64)
    scale = 0.1
    _, lse = attention_reference(q, k, v, scale=scale, return_lse=True)
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) * scale
    assert (lse - torch.logsumexp(s, -1)).abs().mean().item() <= 0.02


def test_causal_matches_sdpa_semantics(gen):
    q, k, v = _qkv(gen, sq=384, sk=384, d=64)
    out = attention_reference(q, k, v, causal=True)
    exact = F.scaled_dot_product_attention(*(t.transpose(1, 2).double() for t in (q, k, v)),
                                           is_causal=True).transpose(1, 2)
    assert _cos(out, exact) >= 0.98
    # Row 0 sees only key 0: its output is v[0] through FP4 (P quantises exactly for a single key).
    qq = preprocess.quantize_qkv(q, k, v)
    vq = preprocess.dequantize_qkv(qq)[2][0, :, 0] * qq.v_scale[0, :, None] + qq.v_mean[0]
    assert torch.allclose(out[0, 0], vq, atol=1e-6)


def test_causal_with_more_keys_than_queries(gen):
    q, k, v = _qkv(gen, sq=100, sk=300, d=64)
    out = attention_reference(q, k, v, causal=True)
    mask = torch.ones(100, 300, dtype=torch.bool).tril()
    exact = F.scaled_dot_product_attention(*(t.transpose(1, 2).double() for t in (q, k, v)),
                                           attn_mask=mask).transpose(1, 2)
    assert _cos(out, exact) >= 0.98


def test_kv_lens_and_padding_masks(gen):
    q, k, v = _qkv(gen, b=2, sq=200, sk=333, d=64)
    lens = torch.tensor([333, 97])
    out = attention_reference(q, k, v, kv_lens=lens)
    keep = torch.arange(333)[None, :] < lens[:, None]
    exact = F.scaled_dot_product_attention(*(t.transpose(1, 2).double() for t in (q, k, v)),
                                           attn_mask=keep[:, None, None, :]).transpose(1, 2)
    assert _cos(out, exact) >= 0.98
    # Keys past kv_lens are never attended: changing them changes nothing.
    k2, v2 = k.clone(), v.clone()
    k2[1, 97:] = 100.0
    v2[1, 97:] = -50.0
    assert torch.equal(attention_reference(q, k2, v2, kv_lens=lens)[1], out[1])
    # An additive -inf bias at the same places masks the same keys; only the quantisation
    # differs (masked V values then share 16-token scales with valid ones).
    bias = torch.where(keep, 0.0, -math.inf)
    assert _cos(attention_reference(q, k, v, key_bias=bias), exact) >= 0.98


def test_additive_float_bias(gen):
    q, k, v = _qkv(gen, b=1, sq=128, sk=256, d=64)
    bias = torch.randn(1, 256, generator=gen)
    out = attention_reference(q, k, v, key_bias=bias)
    exact = F.scaled_dot_product_attention(*(t.transpose(1, 2).double() for t in (q, k, v)),
                                           attn_mask=bias.double()[:, None, None, :]).transpose(1, 2)
    assert _cos(out, exact) >= 0.98


def test_fully_masked_row_is_zero_not_nan(gen):
    q, k, v = _qkv(gen, b=2, sq=64, sk=64, d=64)
    out, lse = attention_reference(q, k, v, kv_lens=torch.tensor([64, 0]), return_lse=True)
    assert torch.all(out[1] == 0) and torch.all(torch.isneginf(lse[1]))
    assert torch.isfinite(out).all()


def test_gqa(gen):
    q, k, v = _qkv(gen, sq=256, h=8, hkv=2, d=64)
    out = attention_reference(q, k, v)
    exact, _ = attention_exact(q, k, v)
    assert _cos(out, exact) >= 0.98
    # Same as running each query head against its KV head explicitly.
    rep = attention_reference(q, k.repeat_interleave(4, 2), v.repeat_interleave(4, 2))
    assert torch.allclose(out, rep, atol=1e-5)


@pytest.mark.parametrize("d", [40, 80, 96])
def test_odd_head_dims_are_zero_padded_exactly(gen, d):
    q, k, v = _qkv(gen, sq=256, d=d)
    out = attention_reference(q, k, v)
    assert out.shape == q.shape
    padded = attention_reference(*(fmt.pad_dim(t, 3, fmt.padded_head_dim(d)) for t in (q, k, v)),
                                 scale=1 / math.sqrt(d))
    assert torch.allclose(out, padded[..., :d], atol=1e-6)


def test_chunking_does_not_change_results(gen):
    q, k, v = _qkv(gen, sq=640, d=64)
    whole = attention_reference(q, k, v, return_lse=True)
    chunked = attention_reference(q, k, v, return_lse=True, chunk_elems=1)
    assert torch.allclose(whole[0], chunked[0], atol=1e-6)
    assert torch.allclose(whole[1], chunked[1], atol=1e-5)
    # A sub-range of Q blocks gives those rows of the full result.
    part = attention_reference(q, k, v, return_lse=True, query_blocks=(2, 4))
    assert torch.allclose(part[0], whole[0][:, 256:512], atol=1e-6)
    assert torch.allclose(part[1], whole[1][:, :, 256:512], atol=1e-5)


def test_hnd_layout_equals_nhd(gen):
    q, k, v = _qkv(gen, sq=200, d=64)
    a = attention_reference(q, k, v)
    b = attention_reference(*(t.transpose(1, 2) for t in (q, k, v)), layout="HND")
    assert torch.allclose(a, b.transpose(1, 2), atol=1e-6)


def test_half_precision_inputs(gen):
    q, k, v = (t.to(torch.bfloat16) for t in _qkv(gen, sq=256, d=64))
    out = attention_reference(q, k, v)
    assert out.dtype == torch.bfloat16
    exact, _ = attention_exact(q, k, v)
    assert _cos(out, exact) >= 0.98


# ---------------------------------------------------------------------------------------------
# Two-level scales, channel balance, V smoothing
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("qk_format", fmt.QK_FORMATS)
@pytest.mark.parametrize("balance_qk", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_power_of_two_scaling_is_exact(dtype, balance_qk, qk_format):
    """attention(c q, k / c, d v) == d attention(q, k, v) bit for bit, with the same LSE: the tensor
    scales and the balance are powers of two chosen from exponents."""
    g = torch.Generator().manual_seed(11)
    # Magnitudes kept off zero, so that no scaled value becomes subnormal (inexact) in fp16.
    q, k, v = (x.sign() * x.abs().clamp_min(0.05) for x in (torch.randn(2, 300, 4, 64, generator=g) for _ in range(3)))
    k = k[:, :, :2]
    v = v[:, :, :2]
    lens = torch.tensor([300, 177])
    # fp16 has 5 exponent bits: keep every scaled value normal there.
    factors = [(2.0 ** 5, 2.0 ** -7), (2.0 ** -3, 2.0 ** 4)] if dtype == torch.float16 else \
        [(2.0 ** 40, 2.0 ** -60), (2.0 ** -20, 2.0 ** 50)]
    q, k, v = (t.to(dtype) for t in (q, k, v))
    kw = dict(kv_lens=lens, causal=True, return_lse=True, balance_qk=balance_qk, qk_format=qk_format)
    out, lse = attention_reference(q, k, v, **kw)
    for c, d in factors:
        qc, kc, vd = (q.float() * c).to(dtype), (k.float() / c).to(dtype), (v.float() * d).to(dtype)
        assert torch.equal(qc.float() / c, q.float()) and torch.equal(vd.float() / d, v.float())
        out2, lse2 = attention_reference(qc, kc, vd, **kw)
        # Outputs that are (or would be) subnormal in the dtype round differently: compare the rest.
        tiny = torch.finfo(dtype).tiny
        normal = (out.float().abs() >= tiny) & ((out.float() * d).abs() >= tiny) | (out == 0)
        assert normal.float().mean() > 0.95
        assert torch.equal(out2.float()[normal], (out.float() * d)[normal])
        assert torch.equal(lse2, lse)


@pytest.mark.parametrize("magnitude", [1e-4, 1e-2, 1e2, 1e4])
@pytest.mark.parametrize("which", ["v", "qk"])
def test_any_head_magnitude_keeps_the_accuracy(which, magnitude):
    """A head whose absmax lies anywhere in [1e-4, 1e4] (V, or Q times c with K over c): no block
    scale underflows or saturates (cos >= 0.975, never an all-zero output)."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 512, 2, 128, generator=g) for _ in range(3))
    if which == "v":
        v = v * (magnitude / v.abs().amax())
    else:
        c = magnitude / q.abs().amax()
        q, k = q * c, k / c
    q, k, v = (t.bfloat16() for t in (q, k, v))
    out = attention_reference(q, k, v, balance_qk=False)
    exact, _ = attention_exact(q, k, v)
    assert out.abs().amax() > 0
    assert _cos(out, exact) >= 0.975


@pytest.mark.parametrize("factor", [30.0, 100.0])
def test_balance_restores_channels_where_q_and_k_disagree(factor):
    """K large and Q small in a few channels (the same logits): balancing brings cos back to iid's."""
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 512, 2, 128, generator=g) for _ in range(3))
    ch = torch.randperm(128, generator=g)[:4]
    k[..., ch] *= factor
    q[..., ch] /= factor
    exact, exact_lse = attention_exact(q, k, v)
    plain = attention_reference(q, k, v, balance_qk=False)
    out, lse = attention_reference(q, k, v, balance_qk=True, return_lse=True)
    assert _cos(out, exact) >= 0.975 > _cos(plain, exact)
    assert (lse.double() - exact_lse).abs().mean() <= 0.03


def test_balance_leaves_balanced_heads_alone():
    """Channels whose K/Q ratio is within a factor 2 of the head's keep s = 1 (iid data), and a
    factor common to every channel is only a tensor scale: the bytes do not change."""
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 512, 2, 128, generator=g) for _ in range(3))
    qq = preprocess.quantize_qkv(q, k, v, balance_qk=True)
    assert torch.all(qq.balance == 1)
    plain = preprocess.quantize_qkv(q * 3.7, k / 3.7, v, balance_qk=False)
    balanced = preprocess.quantize_qkv(q * 3.7, k / 3.7, v, balance_qk=True)
    assert torch.equal(plain.q_data, balanced.q_data) and torch.equal(plain.k_data, balanced.k_data)


def test_v_smoothing_keeps_empty_rows_zero_and_a_constant_v_exact(gen):
    q, k, v = _qkv(gen, sq=300, sk=300, d=64)
    v = v + 50.0
    lens = torch.tensor([0, 300])[: q.shape[0]] if q.shape[0] == 2 else torch.tensor([0])
    out, lse = attention_reference(q, k, v, kv_lens=lens, return_lse=True)
    assert torch.all(out[0] == 0) and torch.isneginf(lse[0]).all()  # no key: 0, not the V mean
    const = torch.full_like(v, 3.25)
    assert torch.equal(attention_reference(q, k, const), torch.full_like(q, 3.25))


# ---------------------------------------------------------------------------------------------
# MXFP8 Q/K (P and V stay NVFP4)
# ---------------------------------------------------------------------------------------------

def _sharp(gen, sigma, s=2048, h=2, d=128):
    q, k, v = (torch.randn(1, s, h, d, generator=gen) for _ in range(3))
    return (q * sigma).to(torch.bfloat16), (k * sigma).to(torch.bfloat16), v.to(torch.bfloat16)


@pytest.mark.parametrize("sigma, nvfp4_below, mxfp8_min", [(1.0, 0.985, 0.988), (3.0, 0.93, 0.98), (10.0, 0.82, 0.94)])
def test_mxfp8_qk_resolves_sharper_softmax(sigma, nvfp4_below, mxfp8_min):
    """Q, K ~ N(0, sigma^2) at S2048 D128: 8-bit Q.K^T keeps sharp heads that FP4 Q.K^T loses."""
    q, k, v = _sharp(torch.Generator().manual_seed(int(sigma)), sigma)
    exact, lse_exact = attention_exact(q, k, v)
    fp4 = attention_reference(q, k, v)
    mx, lse = attention_reference(q, k, v, qk_format="mxfp8", return_lse=True)
    assert _cos(fp4, exact) < nvfp4_below
    assert _cos(mx, exact) >= mxfp8_min
    if sigma == 1.0:
        assert (lse - lse_exact).abs().mean().item() <= 0.01


def test_mxfp8_qk_handles_masks_gqa_and_padding(gen):
    q, k, v = _qkv(gen, b=2, sq=300, sk=260, h=4, hkv=2, d=80)
    lens = torch.tensor([260, 111])
    exact, _ = attention_exact(q, k, v, kv_lens=lens, causal=True)
    out = attention_reference(q, k, v, kv_lens=lens, causal=True, qk_format="mxfp8")
    assert _cos(out, exact) >= 0.985
    with pytest.raises(ValueError, match="qk_format"):
        attention_reference(q, k, v, qk_format="fp8")
