"""The call planner (nvfp4_dit.planner): one decision for the op, the diffusers router and the
ComfyUI override."""

import math

import pytest
import torch

from nvfp4_dit import planner, sparse
from nvfp4_dit.policy import EXACT, AttentionPolicy, LayerPrecision, Precision
from nvfp4_dit.token_order import TokenOrder

OPEN = AttentionPolicy(backend="reference", min_seq_len=0, dense_steps=(0, 0), cross_attention=True)


def _qkv(b=2, s=160, h=4, hkv=2, d=64, sk=None):
    g = torch.Generator().manual_seed(0)
    sk = s if sk is None else sk
    return (torch.randn(b, s, h, d, generator=g), torch.randn(b, sk, hkv, d, generator=g),
            torch.randn(b, sk, hkv, d, generator=g))


def test_an_open_policy_runs_fp4_with_its_settings():
    q, k, v = _qkv()
    plan = planner.plan_call(q, k, v, layout="NHD", policy=OPEN.replace(qk_format="mxfp8", balance_qk=False))
    assert plan.run_op and plan.fp4 and plan.backend == "reference" and plan.reason is None
    assert plan.qk_format == "mxfp8" and plan.balance_qk is False and plan.key_mask is None


@pytest.mark.parametrize("policy, kwargs, reason", [
    (AttentionPolicy(backend="reference"), dict(cross=True), "cross-attention"),
    (AttentionPolicy(backend="reference", self_attention=False), dict(cross=False), "self-attention"),
    (AttentionPolicy(backend="reference"), dict(step=(0, 10)), "dense step"),
    (AttentionPolicy(backend="reference"), dict(step=(9, 10)), "dense step"),
    (AttentionPolicy(backend="reference"), dict(), "short sequence"),   # 160 tokens < 1024
    (OPEN.replace(layers=("blocks.1.*",)), dict(layer="blocks.0.attn1"), "layer not selected"),
    (OPEN.replace(per_layer=(LayerPrecision("blocks.0.attn1", "middle", EXACT),)), dict(layer="blocks.0.attn1"),
     "exact by calibration"),
])
def test_policy_rules_keep_calls_exact_silently(policy, kwargs, reason):
    q, k, v = _qkv()
    plan = planner.plan_call(q, k, v, layout="NHD", policy=policy, **kwargs)
    assert not plan.run_op and plan.reason == reason and not plan.warn


def test_the_calibrated_precision_of_the_layer_and_step_is_what_runs():
    q, k, v = _qkv()
    entries = (LayerPrecision("blocks.0.attn1", "first", Precision("mxfp8", True)),
               LayerPrecision("blocks.0.attn1", "last", Precision("nvfp4", False)))
    policy = OPEN.replace(per_layer=entries)
    first = planner.plan_call(q, k, v, layout="NHD", policy=policy, layer="blocks.0.attn1", step=(0, 9))
    last = planner.plan_call(q, k, v, layout="NHD", policy=policy, layer="blocks.0.attn1", step=(8, 9))
    middle = planner.plan_call(q, k, v, layout="NHD", policy=policy, layer="blocks.0.attn1", step=(4, 9))
    assert (first.qk_format, first.balance_qk) == ("mxfp8", True)
    assert (last.qk_format, last.balance_qk) == ("nvfp4", False)
    assert (middle.qk_format, middle.balance_qk) == (policy.qk_format, policy.balance_qk)   # no entry


@pytest.mark.parametrize("mutate, words", [
    (lambda q, k, v: dict(dropout_p=0.1), "dropout"),
    (lambda q, k, v: dict(attn_mask=torch.ones(2, 1, 1, 160, dtype=torch.bool), is_causal=True), "is_causal"),
    (lambda q, k, v: dict(enable_gqa=False), "without enable_gqa"),
    (lambda q, k, v: dict(scale=-1.0), "scale"),
    (lambda q, k, v: dict(q=q.double()), "dtypes"),
    (lambda q, k, v: dict(v=v[:, :100]), "shapes"),
    (lambda q, k, v: dict(q=q.repeat(1, 1, 1, 3), k=k.repeat(1, 1, 1, 3), v=v.repeat(1, 1, 1, 3)), "head dim 192"),
    (lambda q, k, v: dict(attn_mask=torch.zeros(2, 1, 160, 160)), "differs between queries"),
])
def test_calls_fp4_cannot_express_run_exact_with_a_warning(mutate, words):
    q, k, v = _qkv()
    args = dict(q=q, k=k, v=v)
    args.update(mutate(q, k, v))
    tensors = {n: args.pop(n) for n in ("q", "k", "v")}
    plan = planner.plan_call(tensors["q"], tensors["k"], tensors["v"], layout="NHD", policy=OPEN, **args)
    assert not plan.run_op and plan.warn and words in plan.reason


def test_auto_means_the_native_kernel_else_exact_and_is_recorded_as_such():
    q, k, v = _qkv()
    plan = planner.plan_call(q, k, v, layout="NHD", policy=OPEN.replace(backend="auto"))
    assert not plan.run_op and plan.warn and "no GPU" in plan.reason   # a CPU: no kernel
    assert planner.resolve_backend("cuda", torch.device("cpu"), 64, "nvfp4") == (None, "no GPU: tensors are on cpu",
                                                                                True)
    assert planner.resolve_backend("auto", torch.device("cpu"), 64, "nvfp4")[2] is False   # a fallback
    sdpa = planner.plan_call(q, k, v, layout="NHD", policy=OPEN.replace(backend="sdpa"))
    assert sdpa.run_op and not sdpa.fp4 and sdpa.backend == "sdpa"


def test_a_key_mask_is_reduced_once_on_its_device():
    q, k, v = _qkv()
    keep = torch.ones(2, 1, 1, 160, dtype=torch.bool)
    keep[1, ..., 100:] = False
    plan = planner.plan_call(q, k, v, layout="NHD", policy=OPEN, attn_mask=keep)
    assert plan.run_op and plan.key_mask.kv_lens.tolist() == [160, 100]
    assert torch.isneginf(plan.key_mask.bias[1, 0, 100:]).all()
    additive = torch.where(keep, 0.0, -math.inf)
    same = planner.plan_call(q, k, v, layout="NHD", policy=OPEN, attn_mask=additive)
    assert torch.equal(same.key_mask.kv_lens, plan.key_mask.kv_lens)


def test_a_sparse_call_keeps_the_keys_that_are_not_video():
    q, k, v = _qkv()   # 160 tokens
    policy = OPEN.replace(keep_mass=0.9, sparse_off_steps=(0, 0), sparse_min_seq_len=0)
    cases = {sparse.VideoTokens((2, 8, 8)): (128, 160), sparse.VideoTokens((2, 8, 8), "last"): (0, 32),
             sparse.VideoTokens((1, 10, 16)): None, sparse.VideoTokens((3, 8, 8)): None}   # all video; no video
    for video, text in cases.items():
        plan = planner.plan_call(q, k, v, layout="NHD", policy=policy, video=video)
        assert plan.sparsity.always_keep == text, video
        span = video.span(160)   # a sparse self-attention over the video runs in 3D tiles
        want = None if span is None else TokenOrder(video.grid, span)
        assert plan.video_order == want and plan.order_for(plan.sparsity) == want
    cross = planner.plan_call(q, k[:, :128], v[:, :128], layout="NHD", policy=policy, video=sparse.VideoTokens((2, 8, 8)))
    assert cross.video_order is None
    dense = planner.plan_call(q, k, v, layout="NHD", policy=OPEN, video=sparse.VideoTokens((2, 8, 8)))
    assert dense.sparsity is None and dense.always_keep is None and dense.order_for(dense.sparsity) is None


def test_video_tokens_are_checked():
    with pytest.raises(ValueError, match="grid"):
        sparse.VideoTokens((2, 0, 8))
    with pytest.raises(ValueError, match="position"):
        sparse.VideoTokens((2, 8, 8), "middle")
    video = sparse.VideoTokens((2, 3, 4), "last")
    assert video.count == 24 and video.span(30) == (6, 30) and video.span(20) is None
    assert video.other_keys(24) is None and video.other_keys(30) == (0, 6)


def test_keep_mass_makes_long_calls_sparse_outside_the_sparse_off_steps():
    q, k, v = _qkv()
    policy = OPEN.replace(keep_mass=0.9, sparse_off_steps=(2, 1), sparse_min_seq_len=128)
    middle = planner.plan_call(q, k, v, layout="NHD", policy=policy, step=(4, 10))
    assert middle.keep_mass == 0.9 and middle.sparsity.keep_mass == 0.9 and middle.sparsity.block_mask is None
    for step in ((0, 10), (1, 10), (9, 10)):   # the first two and the last step stay dense NVFP4
        plan = planner.plan_call(q, k, v, layout="NHD", policy=policy, step=step)
        assert plan.fp4 and plan.keep_mass is None and plan.sparsity is None
    short = planner.plan_call(q, k, v, layout="NHD", policy=policy.replace(sparse_min_seq_len=161), step=(4, 10))
    assert short.fp4 and short.sparsity is None
    dense = planner.plan_call(q, k, v, layout="NHD", policy=OPEN, step=(4, 10))
    assert dense.sparsity is None
    # A caller that applied the step rules itself (the diffusers router) still gets the sparse choice.
    routed = planner.plan_call(q, k, v, layout="NHD", policy=policy.replace(dense_steps=(5, 0)), step=(1, 10),
                               check_step=False)
    assert routed.fp4 and routed.sparsity is None
    routed = planner.plan_call(q, k, v, layout="NHD", policy=policy.replace(dense_steps=(5, 0)), step=(4, 10),
                               check_step=False)
    assert routed.fp4 and routed.keep_mass == 0.9
