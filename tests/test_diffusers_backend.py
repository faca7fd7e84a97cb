"""The diffusers attention backend "nvfp4": registration, global-backend hygiene, inline checks
with exact fallback, mask reduction, torch.compile, and the context-parallel (ring) contract."""

from __future__ import annotations

import math
import types
import warnings

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("diffusers")

import nvfp4_dit  # noqa: E402
from nvfp4_dit import ops  # noqa: E402
from diffusers.models import attention_dispatch as ad  # noqa: E402
from nvfp4_dit.processors import apply, backend, routing  # noqa: E402
from nvfp4_dit.processors.tiny_models.diffusers_families import build  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


@pytest.fixture(autouse=True)
def _clean_state():
    """Every test starts and ends with the native global backend and default route settings."""
    prev_default = routing.configure_default()
    prev_global = backend.get_active_backend()
    routing.reset_fallback_warnings()
    yield
    routing._STATE.default = prev_default
    backend.set_active_backend(prev_global)


@pytest.fixture
def spy(monkeypatch):
    calls = []
    orig = ops.run_fp4

    def counting(q, k, v, **kw):
        calls.append((tuple(q.shape), tuple(k.shape), kw))
        return orig(q, k, v, **kw)

    monkeypatch.setattr(ops, "run_fp4", counting)
    return calls


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _qkv(b=2, s=256, h=2, d=64, sk=None, hkv=None, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    sk = s if sk is None else sk
    hkv = h if hkv is None else hkv
    q = torch.randn(b, s, h, d, generator=g).to(dtype)
    k = torch.randn(b, sk, hkv, d, generator=g).to(dtype)
    v = torch.randn(b, sk, hkv, d, generator=g).to(dtype)
    return q, k, v


def _native(**kw):
    return ad._AttentionBackendRegistry._backends[ad.AttentionBackendName.NATIVE](**kw)


# -- registration ---------------------------------------------------------------------------------

def test_registered_with_every_kwarg_and_cp():
    member = ad.AttentionBackendName("nvfp4")
    assert member is backend.backend_member() and member.value == "nvfp4"
    assert "nvfp4" in {m.value for m in ad.AttentionBackendName.__members__.values()}
    assert ad._AttentionBackendRegistry._backends[member] is backend._nvfp4_attention
    assert ad._AttentionBackendRegistry._supported_arg_names[member] >= {
        "query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa", "return_lse",
        "_parallel_config"}
    assert "nvfp4" in ad._AttentionBackendRegistry._supports_context_parallel
    assert backend.register_backend() is member  # idempotent


def test_set_attention_backend_routes_all_calls(spy):
    case = build("wan", head_dim=64)
    dense = case.run()
    routing.configure_default(backend="reference", min_seq_len=0)
    with backend.use_backend(case.model):
        fp4 = case.run()
    assert len(spy) == 4  # 2 blocks x (self + cross)
    assert 0 < _rel(fp4[0], dense[0]) < 0.06
    assert torch.equal(case.run()[0], dense[0])


def test_global_backend_leak_is_restored():
    case = build("wan", head_dim=64)
    native = ad.AttentionBackendName.NATIVE
    assert backend.get_active_backend() == native
    # diffusers' own reset leaves the global set (diffusers issue #14249) ...
    case.model.set_attention_backend("nvfp4")
    case.model.reset_attention_backend()
    assert backend.get_active_backend() == ad.AttentionBackendName("nvfp4")
    backend.set_active_backend(native)
    # ... use_backend restores it and every processor attribute.
    procs = [m.processor for m in case.model.modules() if hasattr(m, "processor")]
    with backend.use_backend(case.model):
        assert backend.get_active_backend() == ad.AttentionBackendName("nvfp4")
        assert all(p._attention_backend == ad.AttentionBackendName("nvfp4") for p in procs)
    assert backend.get_active_backend() == native
    assert all(p._attention_backend is None for p in procs)


def test_attention_backend_context_manager_reaches_cosmos(spy):
    case = build("cosmos", head_dim=64)
    dense = case.run()
    routing.configure_default(backend="reference", min_seq_len=0)
    with ad.attention_backend("nvfp4"):
        fp4 = case.run()
    assert backend.get_active_backend() == ad.AttentionBackendName.NATIVE
    assert len(spy) == 2 and 0 < _rel(fp4[0], dense[0]) < 0.06


def test_apply_restores_global_after_cosmos_calls(spy):
    case = build("cosmos", head_dim=64)
    with apply(case.model, backend="reference", min_seq_len=0):
        case.run()
        assert backend.get_active_backend() == ad.AttentionBackendName.NATIVE
    assert len(spy) == 1


# -- inline checks and exact fallback -------------------------------------------------------------

def _call(**kw):
    return backend._nvfp4_attention(**kw)


@pytest.mark.parametrize("case_name", ["per_query_mask", "head_dim_256", "short_sequence", "dropout"])
def test_inexpressible_calls_are_bit_identical_to_native(case_name, spy):
    routing.configure_default(backend="reference", min_seq_len=16)
    q, k, v = _qkv(d=256 if case_name == "head_dim_256" else 64, s=8 if case_name == "short_sequence" else 256)
    kw = dict(query=q, key=k, value=v)
    if case_name == "per_query_mask":
        kw["attn_mask"] = torch.rand(2, 1, 256, 256, generator=torch.Generator().manual_seed(1)) > 0.3
    if case_name == "dropout":
        kw["dropout_p"] = 0.3
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        torch.manual_seed(0)
        out = _call(**kw)
        torch.manual_seed(0)
        out2 = _call(**kw)
    torch.manual_seed(0)
    ref = _native(**kw)
    assert torch.equal(out, ref) and torch.equal(out2, ref)
    assert not spy
    ours = [w for w in rec if issubclass(w.category, routing.NVFP4FallbackWarning)]
    assert len(ours) == (0 if case_name == "short_sequence" else 1)  # one warning per reason, none for policy


def test_invalid_calls_raise_like_native():
    q, k, v = _qkv(h=4, hkv=2)
    with pytest.raises(RuntimeError):
        _native(query=q, key=k, value=v)  # GQA heads without enable_gqa
    with pytest.raises(RuntimeError):
        _call(query=q, key=k, value=v)
    # An explicit mask with is_causal: recent torch raises, older releases (2.11) accept it. Either
    # way the backend does what native does: the same exception type, or the same output.
    mask = torch.ones(2, 256, dtype=torch.bool)
    q, k, v = _qkv()
    outcomes = []
    for fn in (_native, _call):
        try:
            outcomes.append(fn(query=q, key=k, value=v, attn_mask=mask, is_causal=True))
        except RuntimeError as e:
            outcomes.append(type(e))
    if isinstance(outcomes[0], type):
        assert outcomes[1] is outcomes[0]
    else:
        assert torch.is_tensor(outcomes[1]) and torch.equal(outcomes[1], outcomes[0])


def test_gqa_causal_scale_reach_the_op(spy):
    routing.configure_default(backend="reference", min_seq_len=0)
    q, k, v = _qkv(h=4, hkv=2)
    out = _call(query=q, key=k, value=v, enable_gqa=True, is_causal=True, scale=0.1)
    exact = nvfp4_dit.attention(q, k, v, causal=True, scale=0.1, backend="sdpa")
    assert spy and spy[0][2]["causal"] is True and spy[0][2]["scale"] == 0.1
    assert _rel(out, exact) < 0.25


def test_explicit_cuda_backend_without_gpu_falls_back(spy):
    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    routing.configure_default(backend="cuda", min_seq_len=0)
    q, k, v = _qkv()
    with pytest.warns(routing.NVFP4FallbackWarning, match="no GPU"):
        out = _call(query=q, key=k, value=v)
    assert torch.equal(out, _native(query=q, key=k, value=v))


# -- masks ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("mask_kind", ["bool_prefix", "additive_ltx", "bool_holes", "ones"])
def test_masked_calls_match_exact(mask_kind, spy):
    """Key masks reach the FP4 op through the router as the op itself would take them (the same
    bits as a direct call), and its LSE is the masked one."""
    routing.configure_default(backend="reference", min_seq_len=0)
    q, k, v = _qkv(sk=200)
    keep = torch.ones(2, 200, dtype=torch.bool)
    keep[0, 150:] = False
    if mask_kind == "bool_holes":
        keep[1, 10:20] = False
    mask = {"bool_prefix": keep[:, None, None, :], "bool_holes": keep[:, None, None, :],
            "additive_ltx": ((1.0 - keep.float()) * -10000.0)[:, None, None, :].expand(2, 2, 1, 200),
            "ones": torch.ones(2, 1, 1, 200)}[mask_kind]
    out = _call(query=q, key=k, value=v, attn_mask=mask)
    assert spy, "masked call fell back instead of reaching the op"
    assert torch.equal(out, nvfp4_dit.attention(q, k, v, attn_mask=mask, backend="reference"))
    assert _rel(out, _native(query=q, key=k, value=v, attn_mask=mask)) < 0.2
    out, lse = _call(query=q, key=k, value=v, attn_mask=mask, return_lse=True)
    qh, kh = q.transpose(1, 2), k.transpose(1, 2)
    s = qh @ kh.transpose(-1, -2) / 8.0
    s = s.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else s + mask
    assert (lse - torch.logsumexp(s, -1).transpose(1, 2)).abs().max() < 0.15


# -- torch.compile --------------------------------------------------------------------------------

def _compiled_vs_eager(monkeypatch, context):
    """Wan's blocks under ``context(model)``: eager output, then compile_repeated_blocks(fullgraph=True);
    returns (eager, compiled, back-ends the op ran during the compiled forward)."""
    runs = []
    orig_run = ops._fp4
    monkeypatch.setattr(ops, "_fp4", lambda *a: runs.append(a[10]) or orig_run(*a))  # the back-end argument
    torch._dynamo.reset()
    case = build("wan", head_dim=64)
    try:
        with context(case.model):
            eager = case.run()
            runs.clear()
            case.model.compile_repeated_blocks(fullgraph=True, backend="aot_eager")
            compiled = case.run()
    finally:
        torch._dynamo.reset()
    return eager, compiled, runs


def test_compiled_wan_blocks_fullgraph_with_backend(monkeypatch):
    routing.configure_default(backend="reference", min_seq_len=0)
    eager, compiled, runs = _compiled_vs_eager(monkeypatch, backend.use_backend)
    assert runs == ["reference"] * 4
    torch.testing.assert_close(compiled[0], eager[0], rtol=1e-5, atol=1e-5)


def test_compiled_wan_block_fullgraph_with_apply(monkeypatch):
    eager, compiled, runs = _compiled_vs_eager(
        monkeypatch, lambda model: apply(model, backend="reference", min_seq_len=0))
    assert runs == ["reference"] * 2  # self-attention of both blocks; cross stays dense
    torch.testing.assert_close(compiled[0], eager[0], rtol=1e-5, atol=1e-5)


# -- context parallelism (ring) -------------------------------------------------------------------

def _fake_ring(monkeypatch, remote_kv):
    """A 2-rank ring seen from rank 0: all_gather returns [our K/V, rank 1's K/V]."""
    k1, v1 = remote_kv
    monkeypatch.setattr(ad.funcol, "all_gather_tensor",
                        lambda t, gather_dim, group: torch.cat([t, torch.cat([k1.flatten(), v1.flatten()])]))
    cp = types.SimpleNamespace(_ring_mesh=types.SimpleNamespace(get_group=lambda: None), _ring_local_rank=0,
                               ring_degree=2, ulysses_degree=1, ring_anything=False, convert_to_fp32=True)
    return types.SimpleNamespace(context_parallel_config=cp)


# FP4 tolerances: out as for one FP4 call (see test_processors.py); LSE = the softmax-weighted
# mean of the score errors, which e2m1's ~10% rms element error puts at a few 1e-2 for unit
# scores (measured max 0.053, mean 0.01 here), so max 0.1 / mean 0.02.
@pytest.mark.parametrize("op_backend,tol_out,tol_lse,tol_lse_mean",
                         [("sdpa", 1e-5, 1e-4, 1e-5), ("reference", 0.25, 0.1, 0.02)])
def test_ring_merge_with_our_lse_matches_exact(op_backend, tol_out, tol_lse, tol_lse_mean, monkeypatch):
    """diffusers' TemplatedRingAttention merges per-chunk (out, lse) from our forward op; the
    result must equal exact attention over the concatenated K/V (FP4: within its tolerance)."""
    routing.configure_default(backend=op_backend, min_seq_len=0)
    q, k, v = _qkv(b=1, s=256, sk=512, seed=3)
    k0, k1 = k[:, :256], k[:, 256:]
    v0, v1 = v[:, :256], v[:, 256:]
    pc = _fake_ring(monkeypatch, (k1, v1))

    out, lse = backend._nvfp4_attention(query=q, key=k0, value=v0, return_lse=True, _parallel_config=pc)
    exact, exact_lse = nvfp4_dit.attention(q, k, v, return_lse=True, backend="sdpa")
    assert out.shape == q.shape and lse.shape == (1, 256, 2)  # LSE (B, S, H)
    assert _rel(out, exact) < tol_out
    lse_err = (lse - exact_lse.transpose(1, 2)).abs()
    assert lse_err.max().item() < tol_lse and lse_err.mean().item() < tol_lse_mean

    # The forward op on its own: (out, lse) with LSE (B, S, H), and plain out without return_lse.
    o, l_ = backend.nvfp4_forward_op(None, q, k0, v0, return_lse=True)
    assert l_.shape == (1, 256, 2) and l_.dtype == torch.float32
    assert backend.nvfp4_forward_op(None, q, k0, v0).shape == q.shape


def test_backend_return_lse_layout():
    routing.configure_default(backend="reference", min_seq_len=0)
    q, k, v = _qkv()
    out, lse = _call(query=q, key=k, value=v, return_lse=True)
    ref_out, ref_lse = nvfp4_dit.attention(q, k, v, return_lse=True, backend="reference")
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse.permute(0, 2, 1))
    with pytest.raises(NotImplementedError):
        backend.nvfp4_backward_op(None, out)


def test_direct_sdpa_redirect_passes_other_functions_through():
    from nvfp4_dit.processors.diffusers_processors import _SDPARedirect

    q, k, v = (t.transpose(1, 2) for t in _qkv())
    with _SDPARedirect(nvfp4_dit.AttentionPolicy(backend="sdpa", min_seq_len=0)):
        x = torch.ones(3) + 1
        out = F.scaled_dot_product_attention(q, k, v)
    assert torch.equal(x, torch.full((3,), 2.0))
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v), rtol=1e-6, atol=1e-6)
