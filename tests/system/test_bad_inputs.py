"""The bad-input matrix: every case gives a clear Python error or a documented result.

Each case goes through the public op ``nvfp4_dit.attention`` and, where the entry point exists,
through the diffusers backend / processors and the ComfyUI override.  The outcome of every case
is listed in ``docs/reliability.md``; "documented result" means a defined value that a test here
checks (exact attention, the contract's 0 / -inf for rows without keys, NaN for non-finite input),
never "whatever comes out".  ``tests/test_ops.py`` holds the first 22 argument errors; the cases
here are the rest of the matrix.
"""

from __future__ import annotations

import logging
import math
import warnings

import pytest
import torch
import torch.nn.functional as F

import nvfp4_dit
from nvfp4_dit import BackendUnavailableError, FallbackWarning
from nvfp4_dit.reference import attention_exact

B, SQ, SK, H, HKV, D = 2, 150, 140, 4, 2, 64
CPU_BACKENDS = ("sdpa", "reference", "auto")


def _qkv(gen, b=B, sq=SQ, sk=SK, h=H, hkv=HKV, d=D, dtype=torch.float32, device="cpu"):
    q = torch.randn(b, sq, h, d, generator=gen).to(device, dtype)
    k = torch.randn(b, sk, hkv, d, generator=gen).to(device, dtype)
    v = torch.randn(b, sk, hkv, d, generator=gen).to(device, dtype)
    return q, k, v


def _cos(a, b):
    return F.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)
        return fn(*args, **kwargs)


# =============================================================================================
# 1. Clear errors naming the argument (shape logic; the same for every back-end)
# =============================================================================================

def _meta(t):
    return t.to("meta")


ERRORS = {
    # rank
    "q_3d": (lambda q, k, v: dict(q=q[0]), ValueError, "q must be 4-D"),
    "k_5d": (lambda q, k, v: dict(k=k[None]), ValueError, "k must be 4-D"),
    "v_0d": (lambda q, k, v: dict(v=v.sum()), ValueError, "v must be 4-D"),
    # dtype
    "fp8_e4m3": (lambda q, k, v: dict(q=q.to(torch.float8_e4m3fn), k=k.to(torch.float8_e4m3fn),
                                      v=v.to(torch.float8_e4m3fn)), TypeError, "q must be float16"),
    "fp8_e5m2_k": (lambda q, k, v: dict(k=k.to(torch.float8_e5m2)), TypeError, "k must be float16"),
    "int8": (lambda q, k, v: dict(q=q.to(torch.int8), k=k.to(torch.int8), v=v.to(torch.int8)), TypeError,
             "q must be float16"),
    "int64_v": (lambda q, k, v: dict(v=v.long()), TypeError, "v must be float16"),
    "bool_q": (lambda q, k, v: dict(q=q > 0), TypeError, "q must be float16"),
    "complex": (lambda q, k, v: dict(q=q.to(torch.complex64), k=k.to(torch.complex64), v=v.to(torch.complex64)),
                TypeError, "q must be float16"),
    "bf16_q_fp16_kv": (lambda q, k, v: dict(q=q.bfloat16(), k=k.half(), v=v.half()), TypeError, "share a dtype"),
    # device mix (meta stands in for a second device on a CPU-only machine)
    "k_other_device": (lambda q, k, v: dict(k=_meta(k)), ValueError, "one device"),
    "v_other_device": (lambda q, k, v: dict(v=_meta(v)), ValueError, "one device"),
    "kv_lens_other_device": (lambda q, k, v: dict(kv_lens=_meta(torch.tensor([3, 4]))), ValueError, "kv_lens is on"),
    "mask_other_device": (lambda q, k, v: dict(attn_mask=_meta(torch.ones(B, SK, dtype=torch.bool))), ValueError,
                          "attn_mask is on"),
    # layout
    "layout_lowercase": (lambda q, k, v: dict(layout="nhd"), ValueError, "layout"),
    "layout_none": (lambda q, k, v: dict(layout=None), ValueError, "layout"),
    # NHD tensors declared HND: 150 "heads" against 140 "kv heads"
    "layout_mismatch": (lambda q, k, v: dict(layout="HND"), ValueError, "multiple of k/v heads"),
    "backend_none": (lambda q, k, v: dict(backend=None), ValueError, "backend"),
    "backend_uppercase": (lambda q, k, v: dict(backend="CUDA"), ValueError, "backend"),
    # heads / head dims
    "zero_kv_heads": (lambda q, k, v: dict(k=k[:, :, :0], v=v[:, :, :0]), ValueError, "multiple of k/v heads"),
    "more_kv_heads_than_q": (lambda q, k, v: dict(k=k.repeat(1, 1, 4, 1), v=v.repeat(1, 1, 4, 1)), ValueError,
                             "multiple of k/v heads"),
    "head_dim_0": (lambda q, k, v: dict(q=q[..., :0], k=k[..., :0], v=v[..., :0]), ValueError, "head dim"),
    "v_head_dim_differs": (lambda q, k, v: dict(v=torch.cat([v, v], -1)), ValueError, "same shape"),
    "qk_head_dim_128_vs_64": (lambda q, k, v: dict(q=torch.cat([q, q], -1)), ValueError, "head dim"),
    # kv_lens
    "kv_lens_2d": (lambda q, k, v: dict(kv_lens=torch.tensor([[3, 4]])), ValueError, "kv_lens must have shape"),
    "kv_lens_0d": (lambda q, k, v: dict(kv_lens=torch.tensor(3)), ValueError, "kv_lens must have shape"),
    "kv_lens_bool": (lambda q, k, v: dict(kv_lens=torch.tensor([True, False])), TypeError, "kv_lens"),
    "kv_lens_int16": (lambda q, k, v: dict(kv_lens=torch.tensor([3, 4], dtype=torch.int16)), TypeError, "kv_lens"),
    "kv_lens_list": (lambda q, k, v: dict(kv_lens=[3, 4]), TypeError, "kv_lens must be a torch.Tensor"),
    "kv_lens_too_long_int32": (lambda q, k, v: dict(kv_lens=torch.tensor([SK, SK + 1], dtype=torch.int32)),
                               ValueError, "kv_lens values"),
    "kv_lens_very_negative": (lambda q, k, v: dict(kv_lens=torch.tensor([-2**40, 3])), ValueError, "kv_lens values"),
    # masks of every unsupported shape / dtype
    "mask_1d": (lambda q, k, v: dict(attn_mask=torch.ones(SK, dtype=torch.bool)), ValueError, "attn_mask"),
    "mask_5d": (lambda q, k, v: dict(attn_mask=torch.ones(1, B, 1, 1, SK, dtype=torch.bool)), ValueError, "attn_mask"),
    "mask_3d_bad": (lambda q, k, v: dict(attn_mask=torch.ones(3, SQ, SK, dtype=torch.bool)), ValueError, "attn_mask"),
    "mask_4d_sk_plus_1": (lambda q, k, v: dict(attn_mask=torch.ones(B, 1, 1, SK + 1)), ValueError, "attn_mask"),
    "mask_2d_sq_sk": (lambda q, k, v: dict(attn_mask=torch.ones(SQ, SK, dtype=torch.bool)), ValueError,
                      "key-padding mask"),
    "mask_uint8": (lambda q, k, v: dict(attn_mask=torch.ones(B, SK, dtype=torch.uint8)), TypeError, "attn_mask"),
    "mask_list": (lambda q, k, v: dict(attn_mask=[[True] * SK] * B), TypeError, "attn_mask must be a torch.Tensor"),
    "mask_nan": (lambda q, k, v: dict(attn_mask=torch.zeros(B, 1, 1, SK).index_fill_(3, torch.tensor([7]), math.nan)),
                 ValueError, "NaN or \\+inf"),
    "mask_plus_inf": (lambda q, k, v: dict(attn_mask=torch.zeros(B, SK).index_fill_(1, torch.tensor([0]), math.inf)),
                      ValueError, "NaN or \\+inf"),
    # scalars
    "scale_zero": (lambda q, k, v: dict(scale=0.0), ValueError, "scale"),
    "scale_inf": (lambda q, k, v: dict(scale=math.inf), ValueError, "scale"),
    "scale_bool": (lambda q, k, v: dict(scale=True), TypeError, "scale"),
    "scale_tensor": (lambda q, k, v: dict(scale=torch.tensor(0.1)), TypeError, "scale"),
    "scale_complex": (lambda q, k, v: dict(scale=1j), TypeError, "scale"),
    "return_lse_str": (lambda q, k, v: dict(return_lse="yes"), TypeError, "return_lse"),
    "causal_none": (lambda q, k, v: dict(causal=None), TypeError, "causal"),
    "k_numpy": (lambda q, k, v: dict(k=k.numpy()), TypeError, "k must be a torch.Tensor"),
}


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("case", sorted(ERRORS))
def test_bad_argument_raises_a_clear_error(gen, case, backend):
    mutate, exc, words = ERRORS[case]
    q, k, v = _qkv(gen)
    args = dict(q=q, k=k, v=v, backend=backend)
    args.update(mutate(q, k, v))
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)  # an error case must not "fall back"
        with pytest.raises(exc, match=words):
            nvfp4_dit.attention(q, k, v, **args)


def test_negative_strides_cannot_reach_the_op(gen):
    # torch has no negative strides (flip copies), so the matrix row "negative stride" is
    # unreachable; this fails if a torch release starts allowing them.
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError):
        torch.as_strided(x, (4, 8), (-8, 1), 31)
    assert torch.flip(x, (0,)).stride() == (8, 1)


def test_requires_grad_inputs_run_forward_and_refuse_backward(gen):
    q, k, v = _qkv(gen)
    q.requires_grad_(True)
    out = nvfp4_dit.attention(q, k, v, backend="reference")
    assert out.shape == q.shape and torch.isfinite(out).all()
    with pytest.raises(RuntimeError, match="nvfp4_dit.attention"):
        out.sum().backward()


# =============================================================================================
# 2. Strides, views, odd shapes: the same answer as the contiguous call
# =============================================================================================

VIEWS = {
    # q from a wider tensor (row stride > H*D, data pointer offset by 4 bytes: unaligned for 16 B loads)
    "q_unaligned_slice": lambda q, k, v: (torch.cat([q, q], -1)[..., 1:D + 1].copy_(q), k, v),
    "kv_expanded_zero_stride_batch": lambda q, k, v: (q, k[:1].expand(B, -1, -1, -1), v[:1].expand(B, -1, -1, -1)),
    "q_transposed_memory": lambda q, k, v: (q.transpose(1, 2).contiguous().transpose(1, 2), k, v),
    "k_every_other_token": lambda q, k, v: (q, torch.stack([k, k], 2).flatten(1, 2)[:, ::2], v),
    "v_channels_last": lambda q, k, v: (q, k, v.contiguous(memory_format=torch.channels_last)),
    "q_head_dim_reversed_view": lambda q, k, v: (q.flip(-1).flip(-1), k, v),
}


@pytest.mark.parametrize("backend", ["sdpa", "reference"])
@pytest.mark.parametrize("view", sorted(VIEWS))
def test_non_contiguous_inputs_equal_the_contiguous_call(gen, view, backend):
    q, k, v = _qkv(gen)
    if view == "kv_expanded_zero_stride_batch":
        k, v = k[:1].repeat(B, 1, 1, 1), v[:1].repeat(B, 1, 1, 1)
    qv, kv_, vv = VIEWS[view](q, k, v)
    assert torch.equal(qv, q) and torch.equal(kv_, k) and torch.equal(vv, v)
    lens = torch.tensor([SK, 77])
    got = nvfp4_dit.attention(qv, kv_, vv, kv_lens=lens, backend=backend, return_lse=True)
    want = nvfp4_dit.attention(q.contiguous(), k.contiguous(), v.contiguous(), kv_lens=lens, backend=backend,
                               return_lse=True)
    if backend == "reference":
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    else:  # torch's CPU SDPA picks its kernel by stride: last-bit differences only
        assert torch.allclose(got[0], want[0], atol=1e-6) and torch.allclose(got[1], want[1], atol=1e-5)


@pytest.mark.parametrize("d", [1, 17, 72, 100, 128])
def test_unpadded_head_dims_are_exactly_zero_padded(gen, d):
    q, k, v = _qkv(gen, d=d)
    out = nvfp4_dit.attention(q, k, v, backend="reference")
    exact, _ = attention_exact(q, k, v)
    assert out.shape == q.shape
    assert _cos(out, exact) >= 0.97


@pytest.mark.parametrize("d", [160, 256])
def test_head_dims_above_128_fall_back_exactly_with_one_warning(gen, d):
    q, k, v = _qkv(gen, d=d)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = nvfp4_dit.attention(q, k, v, causal=True)
        nvfp4_dit.attention(q, k, v, causal=True)
    assert sum(issubclass(w.category, FallbackWarning) for w in caught) == 1
    exact, _ = attention_exact(q, k, v, causal=True)
    assert torch.allclose(out.double(), exact, atol=1e-5)


def test_single_token(gen):
    q, k, v = _qkv(gen, sq=1, sk=1)
    for backend in ("sdpa", "reference"):
        out, lse = nvfp4_dit.attention(q, k, v, backend=backend, return_lse=True)
        # One key: softmax weight 1, out = v (FP4 rounds v), LSE = the one scaled score.
        tol = 1e-5 if backend == "sdpa" else 0.3
        assert torch.allclose(out, v.repeat_interleave(H // HKV, 2), atol=tol, rtol=tol)
        score = (q * k.repeat_interleave(H // HKV, 2)).sum(-1).transpose(1, 2) / math.sqrt(D)
        assert torch.allclose(lse, score, atol=1e-4 if backend == "sdpa" else 0.35 * score.abs().max().item())


def test_huge_batch_tiny_sequence(gen):
    b = 512
    q, k, v = _qkv(gen, b=b, sq=1, sk=3, h=1, hkv=1)
    out = nvfp4_dit.attention(q, k, v, backend="reference")
    exact, _ = attention_exact(q, k, v)
    assert out.shape == (b, 1, 1, D)
    assert _cos(out, exact) >= 0.97


# =============================================================================================
# 3. Empty tensors and rows without keys: zeros and LSE -inf (the contract)
# =============================================================================================

@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("shape", ["B0", "Sq0", "Sk0", "Sk0_kv_lens", "B0_kv_lens_and_mask"])
def test_empty_tensors(gen, shape, backend):
    b, sq, sk = {"B0": (0, SQ, SK), "Sq0": (B, 0, SK), "Sk0": (B, SQ, 0), "Sk0_kv_lens": (B, SQ, 0),
                 "B0_kv_lens_and_mask": (0, SQ, SK)}[shape]
    q, k, v = _qkv(gen, b=b, sq=sq, sk=sk)
    kwargs = {}
    if shape == "Sk0_kv_lens":
        kwargs["kv_lens"] = torch.zeros(B, dtype=torch.int32)
    if shape == "B0_kv_lens_and_mask":
        kwargs = dict(kv_lens=torch.zeros(0, dtype=torch.int64), attn_mask=torch.ones(0, SK, dtype=torch.bool))
    out, lse = _quiet(nvfp4_dit.attention, q, k, v, backend=backend, return_lse=True, **kwargs)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (b, H, sq) and lse.dtype == torch.float32
    assert torch.all(out == 0) and torch.all(torch.isneginf(lse))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("how", ["kv_lens_zero", "bool_mask_all_false", "float_mask_all_neg_inf", "causal_and_kv_lens"])
def test_rows_without_visible_keys_are_zero_with_neg_inf_lse(gen, how, backend):
    q, k, v = _qkv(gen)
    kwargs = {
        "kv_lens_zero": dict(kv_lens=torch.tensor([0, 50])),
        "bool_mask_all_false": dict(attn_mask=torch.arange(SK)[None, :] < torch.tensor([0, 50])[:, None]),
        "float_mask_all_neg_inf": dict(attn_mask=torch.where(
            torch.arange(SK)[None, :] < torch.tensor([0, 50])[:, None], 0.0, -math.inf)[:, None, None, :]),
        "causal_and_kv_lens": dict(kv_lens=torch.tensor([0, 50]), causal=True),
    }[how]
    out, lse = _quiet(nvfp4_dit.attention, q, k, v, backend=backend, return_lse=True, **kwargs)
    assert torch.isfinite(out).all()
    assert torch.all(out[0] == 0) and torch.all(torch.isneginf(lse[0]))
    exact, exact_lse = attention_exact(q, k, v, kv_lens=torch.tensor([0, 50]), causal=kwargs.get("causal", False))
    assert torch.isfinite(lse[1]).all() and _cos(out[1], exact[1]) >= 0.97


# =============================================================================================
# 4. NaN / Inf in Q, K, V: never a finite value where exact attention gives a non-finite one
# =============================================================================================

NON_FINITE = {
    # (tensor, index [b, s, h, d], value, keys valid?)
    "nan_q": ("q", (1, 9, 3, 5), math.nan),
    "inf_q": ("q", (0, 140, 0, 0), math.inf),
    "nan_k": ("k", (1, 3, 1, 63), math.nan),
    "neg_inf_k": ("k", (0, 0, 0, 0), -math.inf),
    "inf_v": ("v", (1, 100, 0, 7), math.inf),
    "nan_v": ("v", (0, 5, 1, 0), math.nan),
}


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("case", sorted(NON_FINITE))
def test_non_finite_inputs_propagate(gen, case, backend):
    name, idx, value = NON_FINITE[case]
    q, k, v = _qkv(gen)
    t = {"q": q, "k": k, "v": v}[name]
    t[idx] = value
    out, lse = _quiet(nvfp4_dit.attention, q, k, v, backend=backend, return_lse=True)
    exact, exact_lse = attention_exact(q, k, v)
    exact_bad = ~torch.isfinite(exact)
    # Wherever exact attention is non-finite, so is ours (FP4 may poison more: the whole 128-row
    # Q block, or the whole kv-head group; see docs/reliability.md).
    assert (~torch.isfinite(out))[exact_bad].all(), "a non-finite input came out finite"
    assert (~torch.isfinite(lse))[~torch.isfinite(exact_lse)].all()
    # ... and the damage stays in its batch element: the other one is untouched and finite.
    other = 1 - idx[0]
    assert torch.isfinite(out[other]).all() and torch.isfinite(lse[other]).all()
    clean = _quiet(nvfp4_dit.attention, *(x[other:other + 1] for x in (q, k, v)), backend=backend)
    assert torch.equal(out[other:other + 1], clean)


@pytest.mark.cuda
@pytest.mark.parametrize("qk_format", ["nvfp4", "mxfp8"])
@pytest.mark.parametrize("case", sorted(NON_FINITE))
def test_non_finite_inputs_propagate_through_the_kernel(gen, case, qk_format):
    # The CUDA quantiser raises the flags, the op poisons the rows they cover: the same contract
    # as the CPU back-ends above, end to end on the GPU.
    _cuda_or_skip()
    name, idx, value = NON_FINITE[case]
    q, k, v = _qkv(gen, device="cuda")
    {"q": q, "k": k, "v": v}[name][idx] = value
    out, lse = nvfp4_dit.attention(q, k, v, backend="cuda", return_lse=True, qk_format=qk_format)
    exact, exact_lse = attention_exact(q, k, v)
    assert (~torch.isfinite(out))[~torch.isfinite(exact)].all(), "a non-finite input came out finite"
    assert (~torch.isfinite(lse))[~torch.isfinite(exact_lse)].all()
    other = 1 - idx[0]
    assert torch.isfinite(out[other]).all() and torch.isfinite(lse[other]).all()
    clean = nvfp4_dit.attention(*(x[other:other + 1] for x in (q, k, v)), backend="cuda", qk_format=qk_format)
    assert torch.equal(out[other:other + 1], clean)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_garbage_past_kv_lens_does_not_leak(gen, backend):
    # Padding keys may hold anything (an uninitialised buffer): they are masked, and on the FP4
    # path zeroed before the K mean and the V scales.
    q, k, v = _qkv(gen)
    lens = torch.tensor([SK, 90])
    kg, vg = k.clone(), v.clone()
    kg[1, 90:] = math.nan
    vg[1, 90:] = math.inf
    vg[1, 95, 0, 0] = math.nan
    got, got_lse = _quiet(nvfp4_dit.attention, q, kg, vg, kv_lens=lens, backend=backend, return_lse=True)
    want, want_lse = _quiet(nvfp4_dit.attention, q, k, v, kv_lens=lens, backend=backend, return_lse=True)
    if backend == "reference":
        assert torch.equal(got, want) and torch.equal(got_lse, want_lse)
    else:
        # SDPA multiplies masked V rows by weight 0: inf * 0 = NaN, which _attention_sdpa cannot
        # undo. Document it: exact attention needs finite padding, like torch's SDPA itself.
        assert torch.isfinite(got[0]).all()


def test_large_finite_values_stay_finite(gen):
    q, k, v = _qkv(gen)
    for backend in ("sdpa", "reference"):
        out = nvfp4_dit.attention(q * 1e3, k * 1e3, v * 1e30, backend=backend)
        assert torch.isfinite(out).all()
    # fp16 at its edge: 65504 is finite; scores overflow only in exact fp16, not in our fp32 path.
    qh, kh, vh = (x.half() for x in (q, k, v))
    vh[0, 0, 0, 0] = 65504.0
    out = nvfp4_dit.attention(qh, kh, vh, backend="reference")
    assert torch.isfinite(out).all() and out.dtype == torch.float16


# =============================================================================================
# 5. Masks the FP4 path cannot express: exact fallback (auto) or BackendUnavailableError
# =============================================================================================

GENERAL_MASKS = {
    "per_query_bool_4d": lambda: torch.rand(B, 1, SQ, SK, generator=torch.Generator().manual_seed(1)) > 0.3,
    "per_head_float_4d": lambda: torch.randn(1, H, 1, SK, generator=torch.Generator().manual_seed(2)),
    "bool_3d_sq_sk": lambda: (torch.rand(1, SQ, SK, generator=torch.Generator().manual_seed(3)) > 0.5) | torch.eye(
        SQ, SK, dtype=torch.bool),
    "non_suffix_key_padding": lambda: (torch.arange(SK) % 3 != 0)[None, :].expand(B, SK),
    "additive_bias_key_padding": lambda: torch.randn(B, SK, generator=torch.Generator().manual_seed(4)),
}


@pytest.mark.parametrize("case", sorted(GENERAL_MASKS))
def test_general_masks(gen, case):
    q, k, v = _qkv(gen)
    mask = GENERAL_MASKS[case]()
    exact_mask = mask
    if mask.dim() == 2:
        exact_mask = mask[:, None, None, :]
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))
    want = F.scaled_dot_product_attention(qh.double(), kh.double().repeat_interleave(2, 1),
                                          vh.double().repeat_interleave(2, 1),
                                          attn_mask=exact_mask if exact_mask.dtype == torch.bool else
                                          exact_mask.double()).transpose(1, 2)
    per_key = ("non_suffix_key_padding", "additive_bias_key_padding", "per_head_float_4d")
    with pytest.warns(FallbackWarning) if case not in per_key else warnings.catch_warnings():
        out = nvfp4_dit.attention(q, k, v, attn_mask=mask)
    # auto on CPU: exact SDPA either way.
    assert torch.allclose(out.double(), want, atol=1e-5)
    if case in per_key:
        # per-key masks (per head too): the FP4 reference takes them as a key bias
        ref = nvfp4_dit.attention(q, k, v, attn_mask=mask, backend="reference")
        assert _cos(ref, want) >= 0.97
    else:
        with pytest.raises(BackendUnavailableError, match="per-key"):
            nvfp4_dit.attention(q, k, v, attn_mask=mask, backend="reference")


# =============================================================================================
# 6. The GPU back-end: no abort, clear errors, out-of-memory is a Python exception
# =============================================================================================

def _cuda_or_skip():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if "cuda" not in nvfp4_dit.available_backends(torch.device("cuda")):
        pytest.fail("the CUDA back-end does not load on this GPU")


@pytest.mark.cuda
@pytest.mark.parametrize("case", ["per_query_bool_4d", "bool_3d_sq_sk", "head_dim_160"])
def test_cuda_backend_refuses_what_it_cannot_run(gen, case):
    _cuda_or_skip()
    q, k, v = _qkv(gen, device="cuda", dtype=torch.bfloat16, d=160 if case == "head_dim_160" else D)
    kwargs = {}
    if case in GENERAL_MASKS:
        kwargs["attn_mask"] = GENERAL_MASKS[case]().cuda()
    with pytest.raises(BackendUnavailableError):
        nvfp4_dit.attention(q, k, v, backend="cuda", **kwargs)
    torch.cuda.synchronize()


@pytest.mark.cuda
@pytest.mark.parametrize("case", ["non_suffix_key_padding", "additive_bias_key_padding", "per_head_float_4d"])
def test_cuda_backend_runs_per_key_masks(gen, case):
    """Per-key masks (holes, biases, per head) are a key bias of the correction: FP4 on the GPU."""
    _cuda_or_skip()
    q, k, v = _qkv(gen, device="cuda", dtype=torch.bfloat16)
    mask = GENERAL_MASKS[case]().cuda()
    out = nvfp4_dit.attention(q, k, v, backend="cuda", attn_mask=mask)
    ref = nvfp4_dit.attention(q, k, v, backend="reference", attn_mask=mask)
    assert _cos(out.float(), ref.float()) >= 0.995


@pytest.mark.cuda
def test_cuda_backend_takes_kv_lens_from_the_host(gen):
    """kv_lens on the CPU is checked there and moved; out of range it is a ValueError naming it."""
    _cuda_or_skip()
    q, k, v = _qkv(gen, device="cuda", dtype=torch.bfloat16)
    lens = torch.tensor([3, SK])
    out = nvfp4_dit.attention(q, k, v, backend="cuda", kv_lens=lens)
    same = nvfp4_dit.attention(q, k, v, backend="cuda", kv_lens=lens.cuda())
    assert torch.equal(out, same)
    with pytest.raises(ValueError, match="kv_lens"):
        nvfp4_dit.attention(q, k, v, backend="cuda", kv_lens=torch.tensor([3, SK + 1]))


@pytest.mark.cuda
@pytest.mark.parametrize("case", sorted(NON_FINITE))
def test_cuda_non_finite_inputs_propagate(gen, case):
    _cuda_or_skip()
    name, idx, value = NON_FINITE[case]
    q, k, v = _qkv(gen, device="cuda", dtype=torch.bfloat16)
    {"q": q, "k": k, "v": v}[name][idx] = value
    out, lse = nvfp4_dit.attention(q, k, v, backend="cuda", return_lse=True)
    torch.cuda.synchronize()
    exact, exact_lse = attention_exact(q.cpu(), k.cpu(), v.cpu())
    assert (~torch.isfinite(out.cpu()))[~torch.isfinite(exact)].all()
    assert (~torch.isfinite(lse.cpu()))[~torch.isfinite(exact_lse)].all()
    other = 1 - idx[0]
    assert torch.isfinite(out[other]).all()


@pytest.mark.cuda
@pytest.mark.parametrize("shape", ["B0", "Sq0", "Sk0", "Sq1_Sk1", "B2048_S1"])
def test_cuda_empty_and_tiny(gen, shape):
    _cuda_or_skip()
    b, sq, sk = {"B0": (0, 256, 256), "Sq0": (1, 0, 256), "Sk0": (1, 256, 0), "Sq1_Sk1": (1, 1, 1),
                 "B2048_S1": (2048, 1, 1)}[shape]
    q, k, v = _qkv(gen, b=b, sq=sq, sk=sk, device="cuda", dtype=torch.float16)
    out, lse = nvfp4_dit.attention(q, k, v, backend="cuda", return_lse=True)
    torch.cuda.synchronize()
    assert out.shape == q.shape and lse.shape == (b, H, sq)
    if q.numel() and sk:
        ref, ref_lse = nvfp4_dit.attention(q, k, v, backend="reference", return_lse=True)
        assert _cos(out, ref) >= 0.999
        assert torch.allclose(lse, ref_lse, atol=2e-3, rtol=1e-4)
    else:
        assert torch.all(out == 0) and torch.all(torch.isneginf(lse))


@pytest.mark.cuda
def test_cuda_out_of_memory_is_a_python_exception_and_recoverable(gen):
    _cuda_or_skip()
    small = _qkv(gen, device="cuda", dtype=torch.bfloat16)
    before = nvfp4_dit.attention(*small, backend="cuda")
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    # Inputs of ~1 GiB, then a cap that leaves room for the inputs but not for the quantisation.
    s = 1 << 20
    q = torch.randn(1, s, 4, 128, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    cap = (torch.cuda.memory_allocated() + (256 << 20)) / total
    torch.cuda.set_per_process_memory_fraction(cap)
    try:
        with pytest.raises(torch.OutOfMemoryError):
            nvfp4_dit.attention(q, q, q, backend="cuda")
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    del q
    torch.cuda.empty_cache()
    torch.cuda.synchronize()  # the context survived: no sticky error
    after = nvfp4_dit.attention(*small, backend="cuda")
    assert torch.equal(before, after)


# =============================================================================================
# 7. The diffusers entry points: the "nvfp4" backend and the processors
# =============================================================================================

def _diffusers():
    pytest.importorskip("diffusers")
    from diffusers.models import attention_dispatch

    from nvfp4_dit.processors import backend, routing

    return attention_dispatch, backend, routing


def _dispatch_pair(dispatch, backend, q, k, v, **kw):
    native = dispatch.dispatch_attention_fn(q, k, v, backend=dispatch.AttentionBackendName.NATIVE, **kw)
    ours = dispatch.dispatch_attention_fn(q, k, v, backend=backend.backend_member(), **kw)
    return native, ours


DIFFUSERS_EXACT_ROUTE = {
    # (mutate q, k, v, extra kwargs) -> the call runs diffusers' native backend, bit for bit
    "fp64": lambda q, k, v: ((q.double(), k.double(), v.double()), {}),
    "head_dim_256": lambda q, k, v: ((torch.cat([q] * 4, -1), torch.cat([k] * 4, -1), torch.cat([v] * 4, -1)), {}),
    "per_query_mask": lambda q, k, v: ((q, k, v), dict(attn_mask=torch.rand(B, 1, q.shape[1], k.shape[1],
                                                                          generator=torch.Generator().manual_seed(0))
                                                         > 0.2)),
    "row_fully_masked": lambda q, k, v: ((q, k, v), dict(attn_mask=torch.arange(k.shape[1])[None, :]
                                                         < torch.tensor([0, 300])[:, None])),
    "nan_additive_mask": lambda q, k, v: ((q, k, v), dict(attn_mask=torch.zeros(B, 1, 1, k.shape[1]).index_fill_(
        3, torch.tensor([3]), math.nan))),
    "short_sequence": lambda q, k, v: ((q[:, :17], k[:, :17], v[:, :17]), {}),
    "non_contiguous_short": lambda q, k, v: ((q[:, :40:2], k[:, :40:2], v[:, :40:2]), {}),
}


@pytest.mark.parametrize("case", sorted(DIFFUSERS_EXACT_ROUTE))
def test_diffusers_backend_runs_native_exactly_for_what_fp4_cannot_take(gen, case, monkeypatch):
    dispatch, backend, routing = _diffusers()
    q, k, v = _qkv(gen, sq=300, sk=300, h=2, hkv=2)
    (q, k, v), kw = DIFFUSERS_EXACT_ROUTE[case](q, k, v)
    calls = []
    orig = nvfp4_dit.attention
    monkeypatch.setattr(nvfp4_dit, "attention", lambda *a, **kw_: calls.append(kw_) or orig(*a, **kw_))
    prev = routing.configure_default(backend="reference")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            native, ours = _dispatch_pair(dispatch, backend, q, k, v, **kw)
    finally:
        routing.configure_default(backend=prev.backend)
    assert calls == [] and torch.equal(native, ours) if not native.isnan().any() else \
        torch.equal(native.isnan(), ours.isnan())


@pytest.mark.parametrize("case", ["gqa_without_enable_gqa", "batch_mismatch", "rank_3", "mask_with_causal"])
def test_diffusers_backend_passes_sdpa_errors_through(gen, case):
    dispatch, backend, _ = _diffusers()
    q, k, v = _qkv(gen, sq=300, sk=300)
    kw = {}
    if case == "mask_with_causal":  # recent SDPA refuses an explicit mask with is_causal
        q, k, v = q, k.repeat_interleave(2, 2), v.repeat_interleave(2, 2)
        kw = dict(attn_mask=torch.ones(B, 300, dtype=torch.bool), is_causal=True)
    if case == "batch_mismatch":
        k, v = k[:1], v[:1]
        q, k, v = q, k.expand(3, -1, -1, -1), v.expand(3, -1, -1, -1)
    if case == "rank_3":
        q, k, v = q[0], k[0], v[0]
    errors = []
    for member in (dispatch.AttentionBackendName.NATIVE, backend.backend_member()):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                dispatch.dispatch_attention_fn(q, k, v, backend=member, **kw)
                errors.append(None)
            except Exception as e:  # the same exception type as the native backend, never an abort
                errors.append(type(e))
    # Recent torch refuses a mask with is_causal, older releases (2.11) accept it: then ours must too.
    assert errors[0] == errors[1] and (errors[0] is not None or case == "mask_with_causal")


def test_diffusers_backend_nan_input_is_not_hidden(gen):
    dispatch, backend, routing = _diffusers()
    q, k, v = _qkv(gen, sq=300, sk=300, h=2, hkv=2)
    v[1, 17, 0, 3] = math.inf
    prev = routing.configure_default(backend="reference")
    try:
        native, ours = _dispatch_pair(dispatch, backend, q, k, v)
    finally:
        routing.configure_default(backend=prev.backend)
    assert (~torch.isfinite(ours))[~torch.isfinite(native)].all()
    assert torch.isfinite(ours[0]).all()


def test_diffusers_return_lse_with_an_inexpressible_mask_is_exact(gen):
    # A mask without a per-key form runs exact, LSE included (what ring attention merges by).
    _, backend, _ = _diffusers()
    q, k, v = _qkv(gen, sq=300, sk=300, h=2, hkv=2)
    mask = torch.rand(B, 1, 300, 300, generator=torch.Generator().manual_seed(0)) > 0.5
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out, lse = backend.nvfp4_forward_op(None, q, k, v, attn_mask=mask, return_lse=True)
    s = (q.transpose(1, 2) @ k.transpose(1, 2).transpose(-1, -2)) / math.sqrt(q.shape[-1])
    want = torch.logsumexp(s.masked_fill(~mask, -math.inf), -1).transpose(1, 2)   # (B, S, H)
    torch.testing.assert_close(lse, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kwargs, exc", [
    (dict(backend="fp4"), ValueError),
    (dict(min_seq_len=-1), ValueError),
    (dict(dense_steps=(-1, 0)), ValueError),
    (dict(self_attention="yes"), TypeError),
    (dict(layers=[-3]), ValueError),
    (dict(qk_format="int8"), ValueError),
])
def test_apply_rejects_bad_arguments(kwargs, exc):
    pytest.importorskip("diffusers")
    model = torch.nn.Linear(2, 2)
    with pytest.raises(exc):
        nvfp4_dit.apply(model, **kwargs)


def test_apply_rejects_a_non_pipeline():
    pytest.importorskip("diffusers")
    with pytest.raises(TypeError, match="pipeline"):
        nvfp4_dit.apply(object())


def test_processors_nan_hidden_states_give_nan_not_a_finite_output():
    pytest.importorskip("diffusers")
    from nvfp4_dit.processors.tiny_models.diffusers_families import build

    case = build("wan")
    case.inputs["hidden_states"] = case.inputs["hidden_states"].clone()
    case.inputs["hidden_states"][0, 0, 0, 0, 0] = math.nan
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dense = case.run()[0]
        with nvfp4_dit.apply(case.model, backend="reference", min_seq_len=0):
            fp4 = case.run()[0]
    assert (~torch.isfinite(fp4))[~torch.isfinite(dense)].all()


# =============================================================================================
# 8. The ComfyUI override (no ComfyUI needed): decline to ComfyUI's own function, never crash
# =============================================================================================

class _Func:
    """Stands in for the ComfyUI attention function the override receives."""

    def __init__(self):
        self.calls = []

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return "from-func"


def _comfy_qkv(gen, b=B, lq=64, lk=64, heads=2, d=D, dtype=torch.float32):
    q = torch.randn(b, lq, heads * d, generator=gen).to(dtype)
    k = torch.randn(b, lk, heads * d, generator=gen).to(dtype)
    v = torch.randn(b, lk, heads * d, generator=gen).to(dtype)
    return q, k, v


COMFY_DECLINED = {
    "fp8": lambda q, k, v: ((q.to(torch.float8_e4m3fn), k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn), 2), {}),
    "int": lambda q, k, v: ((q.long(), k.long(), v.long(), 2), {}),
    "mixed_dtypes": lambda q, k, v: ((q.half(), k, v, 2), {}),
    "device_mix": lambda q, k, v: ((q, k.to("meta"), v, 2), {}),
    "rank_2": lambda q, k, v: ((q[0], k[0], v[0], 2), {}),
    "rank_4_without_skip_reshape": lambda q, k, v: ((q[None], k[None], v[None], 2), {}),
    "heads_zero": lambda q, k, v: ((q, k, v, 0), {}),
    "heads_not_int": lambda q, k, v: ((q, k, v, 2.0), {}),
    "heads_do_not_divide": lambda q, k, v: ((q, k, v, 3), {}),
    "batch_mismatch": lambda q, k, v: ((q, k[:1], v[:1], 2), {}),
    "gqa_without_enable_gqa": lambda q, k, v: ((q, k[..., :D], v[..., :D], 2), {}),
    "head_dim_256": lambda q, k, v: ((q, k, v, 1), dict(skip_reshape=False)) if False else (
        (torch.cat([q, q], -1), torch.cat([k, k], -1), torch.cat([v, v], -1), 1), {}),
    "mask_per_query": lambda q, k, v: ((q, k, v, 2), dict(mask=torch.full((B, 64, 64), -math.inf).triu(1))),
    "mask_int": lambda q, k, v: ((q, k, v, 2), dict(mask=torch.ones(B, 1, 64, dtype=torch.int64))),
    "mask_not_a_tensor": lambda q, k, v: ((q, k, v, 2), dict(mask=[1.0] * 64)),
    "mask_5d": lambda q, k, v: ((q, k, v, 2), dict(mask=torch.zeros(1, B, 1, 1, 64))),
    "mask_wrong_keys": lambda q, k, v: ((q, k, v, 2), dict(mask=torch.zeros(B, 1, 63))),
    "unknown_kwarg": lambda q, k, v: ((q, k, v, 2), dict(sliding_window=16)),
    "missing_heads": lambda q, k, v: ((q, k, v), {}),
}


@pytest.mark.parametrize("case", sorted(COMFY_DECLINED))
def test_comfyui_override_declines_to_comfyuis_function(gen, case):
    from nvfp4_dit.comfyui_node.attention_override import NVFP4AttentionOverride
    from nvfp4_dit.policy import AttentionPolicy

    override = NVFP4AttentionOverride(AttentionPolicy(backend="reference", min_seq_len=0))
    args, kwargs = COMFY_DECLINED[case](*_comfy_qkv(gen))
    func = _Func()
    logging.getLogger("nvfp4_dit.comfyui").setLevel(logging.ERROR)
    assert override(func, *args, **kwargs) == "from-func"
    (got_args, got_kwargs), = func.calls
    # passed through untouched: the very same objects
    assert len(got_args) == len(args) and all(a is b for a, b in zip(got_args, args))
    assert got_kwargs.keys() == kwargs.keys() and all(got_kwargs[n] is kwargs[n] for n in kwargs)


def test_comfyui_override_masks_whose_values_break_rows(gen):
    # Rows a mask leaves without a key give 0, and a NaN in a batch's mask gives NaN rows for that
    # batch: values the call never waits for (no host sync), so never a reason to decline.
    from nvfp4_dit.comfyui_node.attention_override import NVFP4AttentionOverride
    from nvfp4_dit.policy import AttentionPolicy

    override = NVFP4AttentionOverride(AttentionPolicy(backend="reference", min_seq_len=0))
    q, k, v = _comfy_qkv(gen)
    every_key = torch.ones(B, 1, 64, dtype=torch.bool)
    every_key[0] = False
    out = override(_Func(), q, k, v, 2, mask=every_key)
    assert (out[0] == 0).all() and torch.isfinite(out[1]).all()
    nan = torch.zeros(B, 1, 64)
    nan[1, :, 1] = math.nan
    out = override(_Func(), q, k, v, 2, mask=nan)
    assert torch.isnan(out[1]).all() and torch.isfinite(out[0]).all()


@pytest.mark.parametrize("case", sorted(NON_FINITE))
def test_comfyui_override_non_finite_inputs_propagate(gen, case):
    from nvfp4_dit.comfyui_node.attention_override import NVFP4AttentionOverride
    from nvfp4_dit.policy import AttentionPolicy

    name, idx, value = NON_FINITE[case]
    q, k, v = _qkv(gen, sq=SK, sk=SK, h=2, hkv=2)
    {"q": q, "k": k, "v": v}[name][idx[0], min(idx[1], SK - 1), idx[2] % 2, idx[3]] = value
    override = NVFP4AttentionOverride(AttentionPolicy(backend="reference", min_seq_len=0))
    func = _Func()
    out = override(func, *(x.flatten(2) for x in (q, k, v)), 2)
    assert func.calls == [], "the call should run in NVFP4"
    exact, _ = attention_exact(q, k, v)
    assert (~torch.isfinite(out))[~torch.isfinite(exact.flatten(2))].all()


def test_comfyui_override_empty_batch_and_single_token(gen):
    from nvfp4_dit.comfyui_node.attention_override import NVFP4AttentionOverride
    from nvfp4_dit.policy import AttentionPolicy

    override = NVFP4AttentionOverride(AttentionPolicy(backend="reference", min_seq_len=0))
    func = _Func()
    q, k, v = _comfy_qkv(gen, b=0)
    out = override(func, q, k, v, 2)
    assert func.calls == [] and out.shape == q.shape
    q, k, v = _comfy_qkv(gen, lq=1, lk=1)
    out = override(func, q, k, v, 2)
    assert func.calls == [] and torch.allclose(out, v, rtol=0.3, atol=0.3)
