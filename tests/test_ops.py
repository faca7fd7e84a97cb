"""The public op: argument errors, back-end choice and fallback, masks, custom-op plumbing."""

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

import nvfp4_dit
from nvfp4_dit import BackendUnavailableError, FallbackWarning
from nvfp4_dit.reference import attention_exact, attention_reference


def _qkv(gen, b=2, sq=192, sk=160, h=4, hkv=2, d=64, dtype=torch.float32):
    q = torch.randn(b, sq, h, d, generator=gen).to(dtype)
    k = torch.randn(b, sk, hkv, d, generator=gen).to(dtype)
    v = torch.randn(b, sk, hkv, d, generator=gen).to(dtype)
    return q, k, v


def _cos(a, b):
    return F.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


# ------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "mutate, exc, words",
    [
        (lambda q, k, v: dict(q=q[0]), ValueError, "q must be 4-D"),
        (lambda q, k, v: dict(k=k.to(torch.int32)), TypeError, "k must be float16"),
        (lambda q, k, v: dict(v=v.to(torch.float16)), TypeError, "share a dtype"),
        (lambda q, k, v: dict(q=q.to(torch.float64), k=k.double(), v=v.double()), TypeError, "q must be float16"),
        (lambda q, k, v: dict(layout="BSHD"), ValueError, "layout"),
        (lambda q, k, v: dict(backend="triton"), ValueError, "backend"),
        (lambda q, k, v: dict(qk_format="fp8"), ValueError, "qk_format"),
        (lambda q, k, v: dict(qk_format=None), ValueError, "qk_format"),
        (lambda q, k, v: dict(v=v[:, :100]), ValueError, "same shape"),
        (lambda q, k, v: dict(k=k[:1], v=v[:1]), ValueError, "batch"),
        (lambda q, k, v: dict(k=k[..., :32], v=v[..., :32]), ValueError, "head dim"),
        (lambda q, k, v: dict(k=k.repeat(1, 1, 2, 1)[:, :, :3], v=v.repeat(1, 1, 2, 1)[:, :, :3]), ValueError, "multiple"),
        (lambda q, k, v: dict(scale=-1.0), ValueError, "scale"),
        (lambda q, k, v: dict(scale=float("nan")), ValueError, "scale"),
        (lambda q, k, v: dict(scale="0.1"), TypeError, "scale"),
        (lambda q, k, v: dict(causal=1), TypeError, "causal"),
        (lambda q, k, v: dict(kv_lens=torch.tensor([1.0, 2.0])), TypeError, "kv_lens"),
        (lambda q, k, v: dict(kv_lens=torch.tensor([1, 2, 3])), ValueError, "kv_lens"),
        (lambda q, k, v: dict(kv_lens=torch.tensor([5, 161])), ValueError, "kv_lens"),
        (lambda q, k, v: dict(kv_lens=torch.tensor([-1, 3])), ValueError, "kv_lens"),
        (lambda q, k, v: dict(attn_mask=torch.ones(3, 160, dtype=torch.bool)), ValueError, "attn_mask"),
        (lambda q, k, v: dict(attn_mask=torch.ones(2, 1, 5, 160, dtype=torch.bool)), ValueError, "attn_mask"),
        (lambda q, k, v: dict(attn_mask=torch.ones(2, 160, dtype=torch.int64)), TypeError, "attn_mask"),
        (lambda q, k, v: dict(q="q"), TypeError, "q must be a torch.Tensor"),
    ],
)
def test_bad_input_names_the_argument(gen, mutate, exc, words):
    q, k, v = _qkv(gen)
    args = dict(q=q, k=k, v=v)
    args.update(mutate(q, k, v))
    kwargs = {key: val for key, val in args.items() if key not in ("q", "k", "v")}
    kwargs.setdefault("backend", "sdpa")
    with pytest.raises(exc, match=words):
        nvfp4_dit.attention(args["q"], args["k"], args["v"], **kwargs)


# ------------------------------------------------------------------------------- back-ends
def test_auto_on_cpu_falls_back_with_one_warning(gen):
    q, k, v = _qkv(gen)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = nvfp4_dit.attention(q, k, v)
        nvfp4_dit.attention(q, k, v)
    fallbacks = [w for w in caught if issubclass(w.category, FallbackWarning)]
    assert len(fallbacks) == 1 and "no GPU" in str(fallbacks[0].message)
    exact, _ = attention_exact(q, k, v)
    assert torch.allclose(out.double(), exact, atol=1e-5)


def test_explicit_cuda_on_cpu_raises(gen):
    q, k, v = _qkv(gen)
    with pytest.raises(BackendUnavailableError, match="no GPU"):
        nvfp4_dit.attention(q, k, v, backend="cuda")


def test_reference_backend_is_the_reference(gen):
    q, k, v = _qkv(gen)
    out, lse = nvfp4_dit.attention(q, k, v, backend="reference", return_lse=True)
    ref, ref_lse = attention_reference(q, k, v, return_lse=True)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    exact, exact_lse = attention_exact(q, k, v)
    assert _cos(out, exact) >= 0.98
    assert (lse - exact_lse).abs().mean() <= 0.02


def test_reference_rejects_general_masks(gen):
    q, k, v = _qkv(gen)
    mask = torch.ones(2, 4, 192, 160, dtype=torch.bool)
    mask[:, :, :100, 150:] = False  # differs between queries: no per-key form
    with pytest.raises(BackendUnavailableError, match="per-key"):
        nvfp4_dit.attention(q, k, v, attn_mask=mask, backend="reference")
    # auto runs it exactly instead.
    with pytest.warns(FallbackWarning, match="per-key"):
        out = nvfp4_dit.attention(q, k, v, attn_mask=mask)
    qh, kh, vh = (t.transpose(1, 2).double() for t in (q, k, v))
    want = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, enable_gqa=True)
    assert torch.allclose(out.double(), want.transpose(1, 2), atol=1e-5)


def test_a_mask_with_a_query_dim_is_not_a_key_mask_whatever_its_values(gen):
    # Whether a mask has a per-key form is decided by its shape (no host sync): a full-size mask
    # runs exact, even when it is the same for every query.
    q, k, v = _qkv(gen)
    mask = torch.ones(2, 4, 192, 160, dtype=torch.bool)
    mask[1, :, :, 120:] = False
    with pytest.raises(BackendUnavailableError, match="differs between queries"):
        nvfp4_dit.attention(q, k, v, attn_mask=mask, backend="reference")
    with pytest.warns(nvfp4_dit.FallbackWarning, match="differs between queries"):
        out = nvfp4_dit.attention(q, k, v, attn_mask=mask)
    assert torch.equal(out, nvfp4_dit.attention(q, k, v, attn_mask=mask, backend="sdpa"))
    per_key = mask[:, :1, :1, :]
    assert torch.equal(nvfp4_dit.attention(q, k, v, attn_mask=per_key, backend="reference"),
                       nvfp4_dit.attention(q, k, v, kv_lens=torch.tensor([160, 120]), backend="reference"))


def test_head_dim_above_128_falls_back(gen):
    q, k, v = _qkv(gen, d=160)
    with pytest.raises(BackendUnavailableError, match="head dim"):
        nvfp4_dit.attention(q, k, v, backend="reference")


@pytest.mark.parametrize("backend", ["sdpa", "reference"])
@pytest.mark.parametrize("mask_kind", ["bool_2d", "bool_4d", "float_4d", "kv_lens"])
def test_key_padding_masks(gen, backend, mask_kind):
    q, k, v = _qkv(gen)
    lens = torch.tensor([160, 71])
    keep = torch.arange(160)[None, :] < lens[:, None]
    kwargs = {
        "bool_2d": dict(attn_mask=keep),
        "bool_4d": dict(attn_mask=keep[:, None, None, :]),
        "float_4d": dict(attn_mask=torch.where(keep, 0.0, -math.inf)[:, None, None, :]),
        "kv_lens": dict(kv_lens=lens),
    }[mask_kind]
    out, lse = nvfp4_dit.attention(q, k, v, backend=backend, return_lse=True, **kwargs)
    exact, exact_lse = attention_exact(q, k, v, kv_lens=lens)
    tol = 1e-5 if backend == "sdpa" else None
    if tol:
        assert torch.allclose(out.double(), exact, atol=tol)
        assert torch.allclose(lse.double(), exact_lse, atol=1e-4)
    else:
        assert _cos(out, exact) >= 0.98
        # A suffix mask runs exactly like kv_lens on the FP4 path.
        ref = nvfp4_dit.attention(q, k, v, backend=backend, kv_lens=lens.to(torch.int32))
        assert torch.equal(out, ref)


def test_sdpa_causal_gqa_and_fully_masked_rows(gen):
    q, k, v = _qkv(gen, sq=160)
    out, lse = nvfp4_dit.attention(q, k, v, causal=True, kv_lens=torch.tensor([160, 0]),
                                   backend="sdpa", return_lse=True)
    exact, exact_lse = attention_exact(q, k, v, causal=True, kv_lens=torch.tensor([160, 0]))
    assert torch.allclose(out.double(), exact, atol=1e-5)
    assert torch.all(out[1] == 0) and torch.all(torch.isneginf(lse[1]))
    assert torch.isfinite(out).all()


def test_hnd_layout_and_half_dtypes(gen):
    q, k, v = _qkv(gen, dtype=torch.bfloat16)
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    out = nvfp4_dit.attention(qh, kh, vh, layout="HND", backend="reference")
    assert out.shape == qh.shape and out.dtype == torch.bfloat16
    nhd = nvfp4_dit.attention(q, k, v, backend="reference")
    assert torch.equal(out.transpose(1, 2), nhd)


@pytest.mark.parametrize("shape", [(0, 16, 2, 64), (2, 0, 2, 64)])
def test_empty_queries(gen, shape):
    q = torch.randn(*shape)
    k = torch.randn(shape[0], 16, 2, 64)
    out, lse = nvfp4_dit.attention(q, k, k, backend="reference", return_lse=True)
    assert out.shape == q.shape and lse.shape == (shape[0], 2, shape[1])


def test_no_keys_gives_zero_and_neg_inf():
    q = torch.randn(1, 8, 2, 64)
    k = torch.randn(1, 0, 2, 64)
    out, lse = nvfp4_dit.attention(q, k, k, backend="sdpa", return_lse=True)
    assert torch.all(out == 0) and torch.all(torch.isneginf(lse))


def test_custom_scale(gen):
    q, k, v = _qkv(gen)
    out = nvfp4_dit.attention(q, k, v, scale=0.05, backend="sdpa")
    exact, _ = attention_exact(q, k, v, scale=0.05)
    assert torch.allclose(out.double(), exact, atol=1e-5)


# ------------------------------------------------------------------------------- custom op
def test_opcheck(gen):
    q, k, v = _qkv(gen, b=1, sq=128, sk=128)
    lens = torch.tensor([100])
    for backend in ("sdpa", "reference"):
        for qk_format in ("nvfp4", "mxfp8"):
            torch.library.opcheck(torch.ops.nvfp4_dit.attention.default,
                                  (q, k, v, None, lens, None, "NHD", False, None, True, backend, True, qk_format))
    bias = torch.zeros(1, 4, 128)
    bias[:, :, 90:] = -math.inf
    torch.library.opcheck(torch.ops.nvfp4_dit.attention.default,
                          (q, k, v, bias, lens, torch.tensor([False]), "NHD", False, None, True, "reference", True,
                           "nvfp4"))


def test_torch_compile_fullgraph(gen):
    q, k, v = _qkv(gen, b=1, sq=128, sk=128)

    def block(x, k, v):
        y = nvfp4_dit.attention(x * 2.0, k, v, backend="reference")
        return y + 1.0

    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(q, k, v), block(q, k, v))
