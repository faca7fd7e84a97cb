"""The CUDA attention back-end (nvfp4_dit.cuda.attention, csrc/attention) against the reference
numerics and exact attention.

On sm_80/sm_90 this runs the fp16-emulated MMA back-end, on sm_120/121 the native FP4 MMA; the
rest of the kernel is the same template. The single-MMA probe checks the back-end itself against
a dense product for every legal selector value.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from nvfp4_dit import attention as nvfp4_dit_attention
from nvfp4_dit.cuda import attention as attention_cuda, build, quantize
from nvfp4_dit import format as fmt
from nvfp4_dit import preprocess, smoothing
from nvfp4_dit.reference import attention_exact, attention_reference


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------

def _cos(a, b):
    return F.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


def _device():
    return torch.device("cuda")


def _native():
    return build.is_native(torch.cuda.get_device_capability())


@pytest.fixture(scope="module")
def kernel():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    reason = build.unavailable_reason()
    assert reason is None, reason
    from nvfp4_dit.cuda import launch as kernels

    return kernels


def _qkv(b, sq, h, d, sk=None, hkv=None, dtype=torch.bfloat16, seed=0, layout="NHD"):
    g = torch.Generator(device="cuda").manual_seed(seed)
    sk = sq if sk is None else sk
    hkv = h if hkv is None else hkv
    shape = (lambda s, n: (b, s, n, d)) if layout == "NHD" else (lambda s, n: (b, n, s, d))
    q = torch.randn(shape(sq, h), generator=g, device="cuda").to(dtype)
    k = torch.randn(shape(sk, hkv), generator=g, device="cuda").to(dtype)
    v = torch.randn(shape(sk, hkv), generator=g, device="cuda").to(dtype)
    return q, k, v


def _run(q, k, v, **kw):
    kw.setdefault("layout", "NHD")
    kw.setdefault("causal", False)
    kw.setdefault("scale", None)
    kw.setdefault("kv_lens", None)
    kw.setdefault("return_lse", True)
    kw.setdefault("quantizer", "torch")   # the reference's own quantisation: the same bytes
    return attention_cuda.attention(q, k, v, **kw)


# ---------------------------------------------------------------------------------------------
# the MMA back-end alone
# ---------------------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("tid_a", [0, 1])
@pytest.mark.parametrize("tid_b", [0, 1, 2, 3])
def test_mma_backend_matches_dense_product(kernel, tid_a, tid_b):
    # The registers of the self-test's instruction case (laid out by the PTX tables, subnormal
    # scales included; tests/test_selftest.py checks the layout against the CPU model).
    from nvfp4_dit import selftest

    dev = _device()
    g = torch.Generator(device="cuda").manual_seed(100 + 4 * tid_a + tid_b)
    for _ in range(4):
        (a, b, sfa, sfb, c), (a_val, b_val, c_val) = selftest.nvfp4_probe_registers(g, tid_a, tid_b, dev)
        d_reg = kernel.mma_nvfp4_probe(selftest._as_int32(a), selftest._as_int32(b), selftest._as_int32(sfa),
                                     selftest._as_int32(sfb), c.contiguous(), tid_a, tid_b, _native())
        got = selftest._unpack_d(d_reg)
        dense = a_val @ b_val.T + c_val
        # Products are exact; only the accumulation rounds: fp32 in the emulation. How the native
        # FP4 MMA accumulates is not documented (FP8 MMAs on sm_89/90 keep ~22 bits), so it gets
        # 2^-12 of the magnitude sum; a wrong fragment or scale lane is off by O(1) either way.
        rel = selftest.MMA_ACCUMULATION_BOUND if _native() else 1e-5
        bound = (a_val.abs() @ b_val.abs().T + c_val.abs()) * rel + 1e-30
        assert ((got - dense).abs() <= bound).all(), (got - dense).abs().max().item()


@pytest.mark.cuda
@pytest.mark.parametrize("tid_a", [0, 1])
@pytest.mark.parametrize("tid_b", [0, 3])
@pytest.mark.parametrize("byte_id", [0, 1, 2, 3])
def test_8bit_mma_backend_matches_dense_product(kernel, tid_a, tid_b, byte_id):
    """The MXFP8 Q·Kᵀ MMA (m16n8k32 kind::mxf8f6f4, ue8m0 1X) on registers laid out by the PTX
    tables (tests/test_selftest.py checks the layout on CPU)."""
    from nvfp4_dit import selftest

    dev = _device()
    g = torch.Generator(device="cuda").manual_seed(300 + 16 * tid_a + 4 * tid_b + byte_id)
    for _ in range(4):
        (a, b, sfa, sfb, c), (a_val, b_val, c_val) = selftest.mxfp8_probe_registers(g, tid_a, tid_b, byte_id, dev)
        d_reg = kernel.mma_mxfp8_probe(selftest._as_int32(a), selftest._as_int32(b), selftest._as_int32(sfa),
                                      selftest._as_int32(sfb), c.contiguous(), tid_a, tid_b, byte_id, _native())
        got = selftest._unpack_d(d_reg)
        dense = a_val @ b_val.T + c_val
        rel = selftest.MMA_ACCUMULATION_BOUND if _native() else 1e-5
        bound = (a_val.abs() @ b_val.abs().T + c_val.abs()) * rel + 1e-30
        assert ((got - dense).abs() <= bound).all(), (got - dense).abs().max().item()


# ---------------------------------------------------------------------------------------------
# the whole kernel against the reference numerics
# ---------------------------------------------------------------------------------------------

def _check_vs_reference(q, k, v, *, layout="NHD", causal=False, kv_lens=None, scale=None, min_cos=0.9999,
                        qk_format="nvfp4"):
    out, lse = _run(q, k, v, layout=layout, causal=causal, kv_lens=kv_lens, scale=scale, qk_format=qk_format)
    ref, ref_lse = attention_reference(q, k, v, layout=layout, causal=causal, kv_lens=kv_lens, scale=scale,
                                       return_lse=True, qk_format=qk_format)
    assert out.shape == ref.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all()
    cos = _cos(out, ref)
    assert cos >= min_cos, cos
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    assert (lse[finite] - ref_lse[finite]).abs().max().item() <= 2e-3
    return out, lse


@pytest.mark.cuda
@pytest.mark.parametrize("qk_format", ["nvfp4", "mxfp8"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_matches_reference(kernel, d, causal, qk_format):
    q, k, v = _qkv(2, 384, 4, d, seed=d + causal)
    _check_vs_reference(q, k, v, causal=causal, qk_format=qk_format)


@pytest.mark.cuda
@pytest.mark.parametrize("d", [64, 128])
def test_mxfp8_with_kv_lens_gqa_and_the_cuda_quantiser(kernel, d):
    """MXFP8 Q·Kᵀ with per-batch key lengths and 4:1 GQA; the CUDA quantiser's bytes run the same
    kernel (the reference quantiser's bytes are checked against it in tests/test_quantize.py)."""
    q, k, v = _qkv(2, 700, 8, d, sk=900, hkv=2, seed=d)
    lens = torch.tensor([900, 333], device="cuda")
    _check_vs_reference(q, k, v, kv_lens=lens, causal=False, qk_format="mxfp8")
    out, _ = _run(q, k, v, kv_lens=lens, qk_format="mxfp8", quantizer="cuda")
    ref = attention_reference(q, k, v, kv_lens=lens, qk_format="mxfp8")
    assert _cos(out, ref) >= 0.999


@pytest.mark.cuda
def test_mxfp8_keeps_sharp_attention_accurate(kernel):
    """Q, K ~ N(0, 3^2) at D=128: 4-bit Q/K lose the sharp softmax, 8-bit Q·Kᵀ keeps it."""
    q, k, v = _qkv(1, 2048, 2, 128, seed=5)
    q, k = q * 3, k * 3
    exact, _ = attention_exact(q, k, v)
    out8 = nvfp4_dit_attention(q, k, v, qk_format="mxfp8", backend="cuda")
    out4 = nvfp4_dit_attention(q, k, v, qk_format="nvfp4", backend="cuda")
    assert _cos(out8, exact) >= 0.98 and _cos(out8, exact) > _cos(out4, exact) + 0.02


@pytest.mark.cuda
@pytest.mark.parametrize("sq,sk", [(300, 300), (77, 1000), (1000, 77), (129, 257)])
def test_lengths_not_multiples_of_32_or_128(kernel, sq, sk):
    q, k, v = _qkv(1, sq, 2, 128, sk=sk, seed=sq + sk)
    _check_vs_reference(q, k, v)
    _check_vs_reference(q, k, v, causal=True)


@pytest.mark.cuda
def test_kv_lens_per_batch_and_fully_masked_rows(kernel):
    q, k, v = _qkv(3, 200, 2, 64, sk=333, seed=7)
    lens = torch.tensor([333, 45, 0], dtype=torch.int32, device="cuda")
    out, lse = _check_vs_reference(q, k, v, kv_lens=lens)
    # No key at all: output 0 and LSE -inf, never NaN.
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    assert torch.isneginf(lse[2]).all()
    # Padded keys are never attended: changing them changes nothing.
    k2, v2 = k.clone(), v.clone()
    k2[1, 45:] = 100.0
    v2[1, 45:] = -100.0
    out2, _ = _run(q, k2, v2, kv_lens=lens)
    assert _cos(out2[1], out[1]) >= 0.9999
    _check_vs_reference(q, k, v, kv_lens=lens, causal=True)


@pytest.mark.cuda
def test_gqa_and_layouts(kernel):
    q, k, v = _qkv(2, 256, 8, 128, hkv=2, seed=3, layout="HND")
    out, _ = _check_vs_reference(q, k, v, layout="HND")
    q2, k2, v2 = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    out_nhd, _ = _run(q2, k2, v2, layout="NHD")
    assert torch.equal(out_nhd.transpose(1, 2), out)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_dtypes(kernel, dtype):
    q, k, v = _qkv(1, 256, 2, 128, dtype=dtype, seed=11)
    _check_vs_reference(q, k, v, scale=0.05)


@pytest.mark.cuda
@pytest.mark.parametrize("d", [40, 63, 80])
def test_padded_head_dims(kernel, d):
    q, k, v = _qkv(1, 200, 2, d, seed=d)
    out, _ = _check_vs_reference(q, k, v)
    assert out.shape[-1] == d


@pytest.mark.cuda
def test_projections_from_either_quantiser_give_the_same_output(kernel):
    """The kernel on the reference's operands with the reference's key projections, and on the CUDA
    quantiser's: the same numerics (the projections agree within an fp16 rounding)."""
    q, k, v = _qkv(1, 1000, 2, 128, seed=5)
    qq = preprocess.quantize_qkv(q, k, v)
    outs = []
    for operands, projections in ((qq, smoothing.key_projections(qq.k_smoothed, qq.smoothing_basis())),
                                  (quantize.quantize_qkv(q, k, v), None)):
        out = torch.empty(1, 2, 1000, 128, dtype=torch.bfloat16, device="cuda")
        attention_cuda.run_kernel(operands, projections or operands.key_projections, out, None,
                                  scale=128**-0.5, causal=True, kv_lens=None)
        outs.append(out)
    assert _cos(outs[0], outs[1]) >= 0.9999


# ---------------------------------------------------------------------------------------------
# accuracy against exact attention, seed probes
# ---------------------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("causal", [False, True])
def test_accuracy_floor_vs_exact(kernel, causal):
    q, k, v = _qkv(1, 1024, 4, 128, dtype=torch.float32, seed=21)
    out, lse = _run(q, k, v, causal=causal)
    exact, lse_exact = attention_exact(q, k, v, causal=causal)
    ref = attention_reference(q, k, v, causal=causal)
    # The reference's own floor (tests/test_reference.py) and no worse than it by more than noise.
    assert _cos(out, exact) >= 0.98
    assert _cos(out, exact) >= _cos(ref, exact) - 1e-4
    assert (lse.double() - lse_exact).abs().mean().item() <= 0.02


@pytest.mark.cuda
def test_uniform_score_probe(kernel):
    # All scores equal; V is 0 on 3/4 of the keys and 4 on the rest: the exact output is 1, the FP4
    # one 0.9765625 (V - vm = -1 and 3 through their scales: -1.03125 and 3). A row sum reduced over
    # the wrong lanes (xor 4 mixes two rows) would halve the P.V part and give 0.98828125.
    s = 1024
    q = torch.zeros(1, s, 2, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.zeros(1, s, 2, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.zeros(1, s, 2, 64, device="cuda", dtype=torch.bfloat16)
    v[:, 3 * s // 4:] = 4
    out, lse = _run(q, k, v)
    assert torch.allclose(out.float(), torch.full_like(out.float(), 0.9765625), atol=1e-6)
    assert torch.allclose(lse, torch.full_like(lse, math.log(s)), atol=1e-4)


# ---------------------------------------------------------------------------------------------
# long sequences (the shapes that broke other kernels), sampled rows against the reference
# ---------------------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.parametrize("h,s", [(56, 77000), (40, 75600), (24, 118800 + 256)])
def test_long_sequences_sampled_rows(kernel, h, s):
    q, k, v = _qkv(1, s, h, 128, seed=s)
    qq = preprocess.quantize_qkv(q, k, v)
    out = torch.empty(1, s, h, 128, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(1, h, s, dtype=torch.float32, device="cuda")
    attention_cuda.run_kernel(qq, smoothing.key_projections(qq.k_smoothed, qq.smoothing_basis()), out.transpose(1, 2),
                              lse, scale=128**-0.5, causal=False, kv_lens=None)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    nblk = qq.num_q_blocks
    for blk in (0, nblk // 2, nblk - 1):
        ref, ref_lse = attention_reference(q, k, v, return_lse=True, query_blocks=(blk, blk + 1), quantized=qq)
        rows = slice(blk * 128, min(s, blk * 128 + 128))
        assert _cos(out[:, rows], ref) >= 0.9999
        assert (lse[:, :, rows] - ref_lse).abs().max().item() <= 2e-3
    del out, lse, qq
    torch.cuda.empty_cache()


@pytest.mark.cuda
def test_public_op_runs_the_kernel(kernel):
    import nvfp4_dit

    q, k, v = _qkv(1, 300, 4, 128, hkv=2, seed=9)
    lens = torch.tensor([250], device="cuda")
    out, lse = nvfp4_dit.attention(q, k, v, backend="cuda", causal=True, kv_lens=lens, return_lse=True)
    ref, ref_lse = attention_reference(q, k, v, causal=True, kv_lens=lens, return_lse=True)
    assert _cos(out, ref) >= 0.9999
    assert (lse - ref_lse).abs().max().item() <= 2e-3
    # auto takes the kernel only where the native FP4 MMA exists.
    if _native():
        auto = nvfp4_dit.attention(q, k, v, backend="auto", causal=True, kv_lens=lens)
        assert _cos(auto, ref) >= 0.9999
    else:
        with pytest.warns(nvfp4_dit.ops.FallbackWarning):
            nvfp4_dit.attention(q, k, v, backend="auto", causal=True, kv_lens=lens)


@pytest.mark.cuda
def test_cuda_quantizer_path_matches_reference(kernel):
    q, k, v = _qkv(2, 700, 4, 128, hkv=2, seed=13)
    lens = torch.tensor([700, 333], device="cuda")
    out, lse = _run(q, k, v, causal=True, kv_lens=lens, quantizer="cuda")
    ref, ref_lse = attention_reference(q, k, v, causal=True, kv_lens=lens, return_lse=True)
    assert _cos(out, ref) >= 0.9999
    assert (lse - ref_lse).abs().max().item() <= 2e-3


# ---------------------------------------------------------------------------------------------
# short key sequences (text cross-attention: 16-64 keys in one partial tile), with each quantiser
# ---------------------------------------------------------------------------------------------

def _short_keys(sk, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return tuple(torch.randn(2, s, 2, 64, device="cuda", generator=g).to(torch.bfloat16) for s in (320, sk, sk))


@pytest.mark.cuda
@pytest.mark.parametrize("sk", [16, 32, 48, 64, 100])
@pytest.mark.parametrize("quantizer", ["cuda", "torch"])
def test_short_keys_match_the_reference(kernel, sk, quantizer):
    q, k, v = _short_keys(sk, sk)
    out, lse = _run(q, k, v, quantizer=quantizer)
    ref, ref_lse = attention_reference(q, k, v, return_lse=True)
    assert _cos(out, ref) >= 0.9999
    assert (lse - ref_lse).abs().max().item() <= 2e-3


@pytest.mark.cuda
@pytest.mark.parametrize("sk", [16, 32, 48])
def test_short_keys_quantizer_bytes_equal_format(kernel, sk):
    q, k, v = _short_keys(sk, 100 + sk)
    qq = quantize.quantize_qkv(q, k, v, layout="NHD")
    want = preprocess.quantize_qkv(q, k, v, layout="NHD", q_mean=qq.q_mean, k_mean_override=qq.k_mean)
    for name in ("q_data", "q_sf", "k_data", "k_sf", "vt_data", "vt_sf"):
        got, exp = getattr(qq, name), getattr(want, name)
        assert got.shape == exp.shape, name
        assert int((got != exp).sum()) == 0, name


@pytest.mark.cuda
def test_public_op_short_cross_attention_matches_reference(kernel):
    import nvfp4_dit

    q, k, v = _short_keys(32, 5)
    out = nvfp4_dit.attention(q, k, v, backend="cuda")
    ref = nvfp4_dit.attention(q, k, v, backend="reference")
    assert _cos(out, ref) >= 0.9999


# ---------------------------------------------------------------------------------------------
# The driver-API launcher: CUDA graphs, and no kernels to load


@pytest.mark.cuda
def test_public_op_replays_from_a_cuda_graph(kernel):
    """Every launch goes through cuLaunchKernel on torch's current stream and nothing synchronises,
    so the whole call (quantiser, kernel) captures into a CUDA graph."""
    import nvfp4_dit

    q, k, v = _qkv(1, 384, 4, 128, hkv=2, seed=21)
    eager = nvfp4_dit.attention(q, k, v, backend="cuda", causal=True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            nvfp4_dit.attention(q, k, v, backend="cuda", causal=True)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = nvfp4_dit.attention(q, k, v, backend="cuda", causal=True)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
    q.copy_(torch.randn_like(q))   # new inputs in the same buffers: the replay follows them
    graph.replay()
    assert torch.equal(captured, nvfp4_dit.attention(q, k, v, backend="cuda", causal=True))


@pytest.mark.cuda
def test_no_usable_cubin_and_no_compiler_falls_back_with_one_warning(kernel, monkeypatch, tmp_path):
    """No prebuilt cubins for this GPU, an empty cache, neither NVRTC nor nvcc: backend="cuda"
    raises saying what to install; backend="auto", on a GPU it would run the kernel on (this one
    made to look native), gives the exact result with one FallbackWarning that says the same."""
    import warnings

    import nvfp4_dit
    from nvfp4_dit.cuda import compile as kc
    from nvfp4_dit import fallback

    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(build, "PREBUILT_DIR", tmp_path / "none")
    monkeypatch.setattr(build, "_libraries", {})
    monkeypatch.setattr(build, "_load_failures", {})
    monkeypatch.setattr(fallback, "_reported", set())
    monkeypatch.setattr(kc, "cuda_home", lambda: None)
    monkeypatch.setattr(kc.shutil, "which", lambda name: None)
    monkeypatch.setattr(kc, "nvrtc_version", lambda: (_ for _ in ()).throw(kc.KernelBuildError("NVRTC cannot be loaded")))
    q, k, v = _qkv(1, 256, 2, 64, seed=5)
    with pytest.raises(nvfp4_dit.ops.BackendUnavailableError, match="pip install") as raised:
        nvfp4_dit.attention(q, k, v, backend="cuda")
    assert "NVRTC" in str(raised.value)

    monkeypatch.setattr(build, "mma_kind", lambda capability: "native")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = nvfp4_dit.attention(q, k, v)
        nvfp4_dit.attention(q, k, v)
    notes = [w for w in caught if issubclass(w.category, nvfp4_dit.ops.FallbackWarning)]
    assert len(notes) == 1, [str(w.message) for w in caught]
    assert "pip install" in str(notes[0].message) and "NVRTC" in str(notes[0].message)
    exact = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2).float() for t in (q, k, v)))
    assert _cos(out, exact.transpose(1, 2).to(out.dtype)) >= 0.9999
