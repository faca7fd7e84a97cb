"""No FP4 path synchronises with the host: the op (with key lengths and key masks on the device),
the diffusers route a processor calls (with and without a key-padding mask) and the ComfyUI
override, each under ``torch.cuda.set_sync_debug_mode("error")`` (a synchronising torch call then
raises). The driver launches do not go through torch and never synchronise."""

import contextlib

import pytest
import torch

import nvfp4_dit
from nvfp4_dit.policy import AttentionPolicy

POLICY = AttentionPolicy(backend="cuda", min_seq_len=0, dense_steps=(0, 0), cross_attention=True)


@contextlib.contextmanager
def _sync_is_an_error():
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def _inputs(b=2, s=300, h=4, hkv=2, d=128):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, s, h, d, device="cuda", generator=g).to(torch.bfloat16)
    k = torch.randn(b, s, hkv, d, device="cuda", generator=g).to(torch.bfloat16)
    v = torch.randn(b, s, hkv, d, device="cuda", generator=g).to(torch.bfloat16)
    keep = torch.ones(b, 1, 1, s, dtype=torch.bool, device="cuda")
    keep[1, ..., 200:] = False
    return q, k, v, keep


def _op_calls(q, k, v, keep):
    lens = torch.tensor([300, 200], device="cuda", dtype=torch.int32)
    additive = torch.where(keep, 0.0, -torch.inf).to(torch.bfloat16)
    return [lambda: nvfp4_dit.attention(q, k, v, backend="cuda"),
            lambda: nvfp4_dit.attention(q, k, v, backend="cuda", kv_lens=lens, return_lse=True),
            lambda: nvfp4_dit.attention(q, k, v, backend="cuda", attn_mask=keep, causal=False),
            lambda: nvfp4_dit.attention(q, k, v, backend="cuda", attn_mask=additive, qk_format="mxfp8"),
            lambda: nvfp4_dit.attention(q, k, v, backend="cuda", causal=True, balance_qk=False)]


@pytest.mark.cuda
def test_the_op_does_not_synchronise(cuda_device):
    calls = _op_calls(*_inputs())
    for call in calls:   # first use: the self-test, kernel loading
        call()
    torch.cuda.synchronize()
    with _sync_is_an_error():
        for call in calls:
            call()
    torch.cuda.synchronize()


@pytest.mark.cuda
def test_the_diffusers_route_does_not_synchronise(cuda_device):
    pytest.importorskip("diffusers")
    from nvfp4_dit.processors import backend, routing

    q, k, v, keep = _inputs()

    def route(mask):
        prev = routing.push_route(POLICY, None, "blocks.0.attn1", (2, 4))
        try:
            return backend._nvfp4_attention(q, k, v, attn_mask=mask, enable_gqa=True)   # as diffusers passes GQA
        finally:
            routing.pop_route(prev)

    for mask in (None, keep):
        route(mask)
    torch.cuda.synchronize()
    with _sync_is_an_error():
        for mask in (None, keep, keep[:, 0, 0, :]):
            route(mask)
    torch.cuda.synchronize()


@pytest.mark.cuda
def test_the_diffusers_processors_do_not_synchronise(cuda_device):
    pytest.importorskip("diffusers")
    from nvfp4_dit.processors import apply
    from nvfp4_dit.processors.tiny_models.diffusers_families import build

    case = build("wan", head_dim=64, dtype=torch.bfloat16).to("cuda")
    with apply(case.model, policy=POLICY) as handle, torch.no_grad():
        handle.set_step(2, 4)
        case.run()
        torch.cuda.synchronize()
        with _sync_is_an_error():
            case.run()
    torch.cuda.synchronize()


@pytest.mark.cuda
def test_the_comfyui_override_does_not_synchronise(cuda_device):
    from nvfp4_dit.comfyui_node.attention_override import NVFP4AttentionOverride

    q, k, v, keep = _inputs(h=2, hkv=2)
    b, s, h, d = q.shape
    flat = [t.reshape(b, s, h * d) for t in (q, k, v)]
    additive = torch.where(keep[:, 0], 0.0, -torch.inf)   # [B, 1, S]
    override = NVFP4AttentionOverride(POLICY)

    def exact(*args, **kwargs):
        raise AssertionError("the override declined a call it should run")

    # The sigmas on the host (ComfyUI's schedule may also live on the GPU: then the step is read
    # once per model forward, where the sampler synchronises anyway).
    options = {"sample_sigmas": torch.tensor([14.6, 6.0, 2.5, 0.0]), "sigmas": torch.tensor([6.0])}
    stepped = NVFP4AttentionOverride(POLICY.replace(dense_steps=(1, 1)))
    for ov, kw in ((override, {}), (override, dict(mask=additive)), (stepped, dict(transformer_options=options))):
        ov(exact, *flat, h, **kw)
    torch.cuda.synchronize()
    with _sync_is_an_error():
        for ov, kw in ((override, {}), (override, dict(mask=additive)),
                       (stepped, dict(transformer_options=options))):
            ov(exact, *flat, h, **kw)
    torch.cuda.synchronize()
