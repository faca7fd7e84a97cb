"""The ComfyUI node: the attention override on its own, then inside a real ComfyUI (CPU).

The first half needs no ComfyUI. The second half (marker ``comfyui``) runs tiny random Wan 2.1,
Cosmos Predict2, HunyuanVideo and LTXV models through ``comfy.sample`` and one prompt through the real
server; ``comfyui_env`` builds that ComfyUI from the pinned sdist and skips when it cannot.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import types
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import nvfp4_dit
from nvfp4_dit.comfyui_node import attention_override as ao
from nvfp4_dit.comfyui_node.attention_override import NVFP4AttentionOverride, patch_model
from nvfp4_dit.policy import AttentionPolicy
from nvfp4_dit.comfyui_node.install import SHIM_FILE_NAME, SHIM_SOURCE, install_shim, main as install_main

try:
    import comfyui_env
except ImportError:  # tests/ imported as a package
    from tests import comfyui_env
TINY_MODELS = comfyui_env.TINY_MODELS
comfyui = comfyui_env.comfyui  # the session fixture

REPO_ROOT = comfyui_env.REPO_ROOT
WORKFLOWS = REPO_ROOT / "examples" / "workflows"
OVERRIDE_KEY = "optimized_attention_override"

# Lets every call through: no length, cross-attention or step gating.
OPEN = dict(cross_attention=True, dense_steps=(0, 0), min_seq_len=0)


class RecordingFunc:
    """Stands in for the back-end ComfyUI hands the override; records its calls."""

    def __init__(self):
        self.calls = []
        self.__name__ = "recording_func"

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return "from-func"


def exact(q, k, v, heads, skip_reshape, skip_output_reshape, mask=None, scale=None):
    """ComfyUI's attention_pytorch semantics, written out: the expected output of an accepted call."""
    if skip_reshape:
        qh, kh, vh = q, k, v
        b, _, lq, d = q.shape
    else:
        b, lq, width = q.shape
        d = width // heads
        qh = q.reshape(b, lq, heads, d).transpose(1, 2)
        kh = k.reshape(b, k.shape[1], -1, d).transpose(1, 2)
        vh = v.reshape(b, v.shape[1], -1, d).transpose(1, 2)
    if kh.shape[1] != qh.shape[1]:
        rep = qh.shape[1] // kh.shape[1]
        kh, vh = kh.repeat_interleave(rep, 1), vh.repeat_interleave(rep, 1)
    if mask is not None:
        mask = mask.reshape((1,) * (4 - mask.ndim) + tuple(mask.shape)) if mask.ndim < 3 else mask
        mask = mask.unsqueeze(1) if mask.ndim == 3 else mask
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
    if skip_output_reshape:
        return out
    return out.transpose(1, 2).reshape(b, lq, -1)


def qkv(gen, skip_reshape, b=2, heads=2, lq=40, lk=40, d=64, kv_heads=None, dtype=torch.float32):
    kv_heads = heads if kv_heads is None else kv_heads
    if skip_reshape:
        shapes = (b, heads, lq, d), (b, kv_heads, lk, d)
    else:
        shapes = (b, lq, heads * d), (b, lk, kv_heads * d)
    q = torch.randn(shapes[0], generator=gen).to(dtype)
    k = torch.randn(shapes[1], generator=gen).to(dtype)
    v = torch.randn(shapes[1], generator=gen).to(dtype)
    return q, k, v


# ---------------------------------------------------------------------------------------------
# The override without ComfyUI
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("skip_reshape", [False, True])
@pytest.mark.parametrize("skip_output_reshape", [False, True])
@pytest.mark.parametrize("lk", [40, 24])
def test_layouts_in_and_out_match_exact_attention(gen, skip_reshape, skip_output_reshape, lk):
    q, k, v = qkv(gen, skip_reshape, lk=lk)
    func = RecordingFunc()
    override = NVFP4AttentionOverride(AttentionPolicy(backend="sdpa", **OPEN))
    out = override(func, q, k, v, 2, skip_reshape=skip_reshape, skip_output_reshape=skip_output_reshape,
                   transformer_options={}, _inside_attn_wrapper=True)
    assert func.calls == []
    expected = exact(q, k, v, 2, skip_reshape, skip_output_reshape)
    assert out.shape == expected.shape and out.is_contiguous()
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_heads_and_mask_may_come_positionally(gen):
    q, k, v = qkv(gen, False)
    mask = torch.zeros(2, 1, 1, 40)
    mask[1, ..., 30:] = -math.inf
    override = NVFP4AttentionOverride(AttentionPolicy(backend="sdpa", **OPEN))
    out = override(RecordingFunc(), q, k, v, 2, mask)
    torch.testing.assert_close(out, exact(q, k, v, 2, False, False, mask=mask), atol=1e-5, rtol=1e-5)


def test_reference_backend_is_the_ops_fp4_reference(gen):
    q, k, v = qkv(gen, True, lq=64, lk=64)
    override = NVFP4AttentionOverride(AttentionPolicy(backend="reference", **OPEN))
    out = override(RecordingFunc(), q, k, v, 2, skip_reshape=True, skip_output_reshape=True)
    expected = nvfp4_dit.attention(q, k, v, layout="HND", scale=64 ** -0.5, backend="reference")
    assert torch.equal(out, expected)
    assert not torch.equal(out, exact(q, k, v, 2, True, True))  # FP4 numerics, not exact attention


@pytest.mark.parametrize("skip_reshape", [False, True])
def test_gqa_with_enable_gqa(gen, skip_reshape):
    q, k, v = qkv(gen, skip_reshape, heads=4, kv_heads=2)
    override = NVFP4AttentionOverride(AttentionPolicy(backend="sdpa", **OPEN))
    func = RecordingFunc()
    out = override(func, q, k, v, 4, skip_reshape=skip_reshape, enable_gqa=True)
    assert func.calls == []
    torch.testing.assert_close(out, exact(q, k, v, 4, skip_reshape, False), atol=1e-5, rtol=1e-5)
    # Without enable_gqa the head counts disagree: ComfyUI's back-end gets the call (and its error).
    assert override(func, q, k, v, 4, skip_reshape=skip_reshape) == "from-func"


def test_explicit_scale_is_used(gen):
    q, k, v = qkv(gen, True)
    override = NVFP4AttentionOverride(AttentionPolicy(backend="sdpa", **OPEN))
    out = override(RecordingFunc(), q, k, v, 2, skip_reshape=True, skip_output_reshape=True, scale=0.3)
    torch.testing.assert_close(out, exact(q, k, v, 2, True, True, scale=0.3), atol=1e-5, rtol=1e-5)


def _padding_masks():
    bool_mask = torch.ones(2, 1, 1, 40, dtype=torch.bool)
    bool_mask[0, ..., 33:] = False
    additive = torch.zeros(2, 1, 40)  # 3-D: ComfyUI adds the head dimension
    additive[1, :, 20:] = -torch.finfo(torch.float32).max
    shared = torch.zeros(1, 40)  # 2-D: [Lq|1, Lk], broadcast over the batch
    shared[:, 35:] = -math.inf
    interior = torch.ones(2, 1, 1, 40, dtype=torch.bool)
    interior[:, ..., 5:9] = False  # not a suffix: fine for the reference and sdpa back-ends
    constant = torch.full((2, 1, 1, 40), -0.5)  # the same bias on every key: softmax ignores it
    per_head = torch.ones(2, 2, 1, 40, dtype=torch.bool)
    per_head[:, 1, :, 30:] = False  # each head its own keys
    bias = torch.linspace(-0.5, 0.0, 40).expand(2, 1, 1, 40)  # a genuine per-key bias
    return {"bool": bool_mask, "additive_3d": additive, "shared_2d": shared, "interior": interior,
            "constant": constant, "per_head": per_head, "bias": bias}


@pytest.mark.parametrize("name", list(_padding_masks()))
def test_key_padding_masks_run_in_the_op(gen, name):
    mask = _padding_masks()[name]
    q, k, v = qkv(gen, False)
    func = RecordingFunc()
    override = NVFP4AttentionOverride(AttentionPolicy(backend="sdpa", **OPEN))
    out = override(func, q, k, v, 2, mask=mask)
    assert func.calls == []
    torch.testing.assert_close(out, exact(q, k, v, 2, False, False, mask=mask), atol=1e-5, rtol=1e-5)


def _unexpressible_masks():
    per_query = torch.zeros(2, 1, 40, 40)
    per_query[:, :, :20, 30:] = -math.inf
    wrong_keys = torch.zeros(2, 1, 1, 12)
    return {"per_query": per_query, "int_mask": torch.ones(2, 1, 1, 40, dtype=torch.int64), "wrong_keys": wrong_keys}


def test_a_row_with_no_key_left_gives_zeros(gen):
    # Whether a row keeps a key is in the mask's values, which the call never waits for: the op
    # gives 0 there (SDPA gives NaN).
    nothing_left = torch.ones(2, 1, 1, 40, dtype=torch.bool)
    nothing_left[1] = False
    q, k, v = qkv(gen, False)
    func = RecordingFunc()
    out = NVFP4AttentionOverride(AttentionPolicy(backend="sdpa", **OPEN))(func, q, k, v, 2, mask=nothing_left)
    assert func.calls == [] and (out[1] == 0).all()
    torch.testing.assert_close(out[:1], exact(q[:1], k[:1], v[:1], 2, False, False), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", list(_unexpressible_masks()))
def test_masks_it_cannot_express_go_to_comfyuis_function(gen, name, caplog):
    mask = _unexpressible_masks()[name]
    q, k, v = qkv(gen, False)
    func = RecordingFunc()
    override = NVFP4AttentionOverride(AttentionPolicy(backend="sdpa", **OPEN))
    nvfp4_dit.reset_fallback_warnings()
    with caplog.at_level(logging.WARNING, logger="nvfp4_dit.comfyui"):
        for _ in range(3):
            assert override(func, q, k, v, 2, mask=mask, transformer_options={}) == "from-func"
    assert len(func.calls) == 3
    args, kwargs = func.calls[0]
    assert args[0] is q and args[3] == 2 and kwargs["mask"] is mask
    assert len([r for r in caplog.records if "nvfp4_dit" in r.getMessage()]) == 1  # warned once


def test_low_precision_attention_false_passes_the_call_through_untouched(gen):
    q, k, v = qkv(gen, True)
    func = RecordingFunc()
    override = NVFP4AttentionOverride(AttentionPolicy(backend="sdpa", **OPEN))
    options = {"block_index": 3}
    result = override(func, q, k, v, 2, skip_reshape=True, low_precision_attention=False,
                      transformer_options=options, _inside_attn_wrapper=True)
    assert result == "from-func"
    (args, kwargs), = func.calls
    assert args == (q, k, v, 2)
    assert kwargs == {"skip_reshape": True, "low_precision_attention": False, "transformer_options": options,
                      "_inside_attn_wrapper": True}
    # low_precision_attention=True (what most call sites mean by leaving it out) runs in the op.
    override(func, q, k, v, 2, skip_reshape=True, low_precision_attention=True)
    assert len(func.calls) == 1


def test_declined_calls_go_to_the_previous_override_not_func(gen):
    q, k, v = qkv(gen, False, lk=24)  # cross-attention: declined by default
    previous_calls = []

    def previous(func, *args, **kwargs):
        previous_calls.append((func, args, kwargs))
        return "from-previous"

    func = RecordingFunc()
    override = NVFP4AttentionOverride(AttentionPolicy(backend="sdpa", min_seq_len=0), previous)
    assert override(func, q, k, v, 2, transformer_options={}, _inside_attn_wrapper=True) == "from-previous"
    assert func.calls == []
    (got_func, args, kwargs), = previous_calls
    assert got_func is func and args == (q, k, v, 2) and kwargs["_inside_attn_wrapper"] is True
    # Accepted calls never reach the previous override.
    q, k, v = qkv(gen, False)
    assert isinstance(override(func, q, k, v, 2), torch.Tensor)
    assert len(previous_calls) == 1


@pytest.mark.parametrize("kwargs, lk, accepted", [
    (dict(min_seq_len=41), 40, False), (dict(min_seq_len=40), 40, True),
    (dict(cross_attention=False), 40, True),
    (dict(min_seq_len=25), 24, False), (dict(min_seq_len=24), 24, True),
])
def test_min_seq_len_counts_the_shorter_sequence(gen, kwargs, lk, accepted):
    q, k, v = qkv(gen, False, lk=lk)
    func = RecordingFunc()
    policy = AttentionPolicy(backend="sdpa", **{**OPEN, **kwargs})
    NVFP4AttentionOverride(policy)(func, q, k, v, 2)
    assert (func.calls == []) == accepted


def test_cross_attention_dense(gen):
    q, k, v = qkv(gen, False, lk=24)
    for dense, expect_func in ((True, 1), (False, 0)):
        func = RecordingFunc()
        NVFP4AttentionOverride(AttentionPolicy(backend="sdpa", min_seq_len=0, cross_attention=not dense))(
            func, q, k, v, 2)
        assert len(func.calls) == expect_func


def test_sampling_step_from_the_schedule():
    schedule = torch.tensor([14.6, 6.0, 2.5, 0.9, 0.0])
    step = ao.sampling_step
    assert step({}) is None
    assert step({"sample_sigmas": schedule}) is None
    assert [step({"sample_sigmas": schedule, "sigmas": torch.tensor([s, s])}) for s in schedule[:-1].tolist()] == [
        (0, 4), (1, 4), (2, 4), (3, 4)]
    # Between schedule points (second-order samplers) the call belongs to the step it is inside.
    assert step({"sample_sigmas": schedule, "sigmas": torch.tensor([4.0])}) == (1, 4)
    assert step({"sample_sigmas": schedule, "sigmas": torch.tensor([0.3])}) == (3, 4)
    # bf16 round trip of a sigma still finds its step.
    assert step({"sample_sigmas": schedule, "sigmas": torch.tensor([6.0]).bfloat16()}) == (1, 4)


@pytest.mark.parametrize("first, last, dense_steps", [(0, 0, []), (1, 0, [0]), (0, 2, [2, 3]), (1, 1, [0, 3]),
                                                      (3, 3, [0, 1, 2, 3])])
def test_dense_first_and_last_steps(gen, first, last, dense_steps):
    q, k, v = qkv(gen, False)
    schedule = torch.tensor([14.6, 6.0, 2.5, 0.9, 0.0])
    policy = AttentionPolicy(backend="sdpa", **{**OPEN, "dense_steps": (first, last)})
    declined = []
    for i, sigma in enumerate(schedule[:-1]):
        func = RecordingFunc()
        options = {"sample_sigmas": schedule, "sigmas": sigma.reshape(1)}
        NVFP4AttentionOverride(policy)(func, q, k, v, 2, transformer_options=options)
        if func.calls:
            declined.append(i)
    assert declined == dense_steps
    # Outside a sampler (no schedule) no step is dense.
    func = RecordingFunc()
    NVFP4AttentionOverride(policy)(func, q, k, v, 2, transformer_options={})
    assert func.calls == []


def test_video_tokens_from_the_grid_comfyui_reports():
    from nvfp4_dit.sparse import VideoTokens

    assert ao.video_tokens({"grid_sizes": torch.Size([2, 4, 6])}) == VideoTokens((2, 4, 6))
    assert ao.video_tokens({}) is None
    assert ao.video_tokens({"grid_sizes": (2, 0, 6)}) is None


def test_layer_names_from_the_block_comfyui_reports():
    assert ao.layer_name({}, cross=False) is None
    assert ao.layer_name({"block_index": 3}, cross=False) == "blocks.3.self"
    assert ao.layer_name({"block_index": 3, "block_type": "double"}, cross=True) == "double_blocks.3.cross"
    assert ao.layer_name({"block_index": True}, cross=False) is None


SCHEDULE = torch.tensor([14.6, 6.0, 2.5, 0.0])  # 3 steps: one per third


def _options(block, step):
    return {"block_index": block, "block_type": "double", "sample_sigmas": SCHEDULE,
            "sigmas": SCHEDULE[step].reshape(1)}


def test_a_calibrated_policy_picks_each_blocks_precision(gen, op_calls):
    from nvfp4_dit.policy import EXACT, LayerPrecision, Precision

    q, k, v = qkv(gen, False)
    entries = [LayerPrecision("double_blocks.0.self", "middle", Precision("nvfp4", True)),
               LayerPrecision("double_blocks.1.self", "middle", Precision("nvfp4", False)),
               LayerPrecision("double_blocks.2.self", "middle", EXACT)]
    override = NVFP4AttentionOverride(AttentionPolicy(backend="sdpa", **OPEN, per_layer=entries))
    for block in range(4):
        func = RecordingFunc()
        override(func, q, k, v, 2, transformer_options=_options(block, 1))
        assert bool(func.calls) == (block == 2)
    # Blocks 0, 1 as assigned; block 3 (no entry) follows the uniform balance_qk (on).
    assert [c["balance_qk"] for c in op_calls] == [True, False, True]
    op_calls.clear()
    override(RecordingFunc(), q, k, v, 2, transformer_options=_options(2, 0))  # first third: no entry
    assert len(op_calls) == 1


def test_calibrating_override_with_keep_mass_measures_the_sparse_ladder(gen, tmp_path):
    from nvfp4_dit.calibration import KEEP_MASS_LADDER
    from nvfp4_dit.policy import FP4_PRECISIONS

    path = tmp_path / "policy.json"
    q, k, v = qkv(gen, False, lq=256, lk=256)
    policy = AttentionPolicy(backend="reference", min_seq_len=0, dense_steps=(0, 0), keep_mass=0.9,
                             sparse_off_steps=(0, 0), sparse_min_seq_len=0)
    override = ao.CalibratingOverride(policy, path=path, budget=0.25, model_class="WanModel")
    func = exact_func = lambda *a, **kw: exact(*a, skip_reshape=False, skip_output_reshape=False,  # noqa: E731
                                              **{k_: v_ for k_, v_ in kw.items() if k_ in ("mask", "scale")})
    out = override(func, q, k, v, 2, transformer_options=_options(0, 1))
    assert torch.equal(out, exact_func(q, k, v, 2))
    (entry,) = AttentionPolicy.load(path).per_layer
    assert {(p, m) for p, m, _, _ in entry.sparse_errors} == {(p, m) for p in FP4_PRECISIONS for m in KEEP_MASS_LADDER}
    assert entry.keep_mass is not None and 0.0 < entry.density <= 1.0


def test_calibrating_override_samples_exactly_and_writes_the_policy(gen, tmp_path):
    path = tmp_path / "policy.json"
    q, k, v = qkv(gen, False, lq=256, lk=256)
    sharp = (q * 4, k * 4, v)
    override = ao.CalibratingOverride(AttentionPolicy(backend="reference", min_seq_len=0, dense_steps=(1, 1)),
                                      path=path, budget=0.25, model_class="WanModel")
    func = exact_func = lambda *a, **kw: exact(*a, skip_reshape=False, skip_output_reshape=False,  # noqa: E731
                                              **{k_: v_ for k_, v_ in kw.items() if k_ in ("mask", "scale")})
    for step in range(3):
        for block, tensors in ((0, (q, k, v)), (1, sharp)):
            out = override(func, *tensors, 2, transformer_options=_options(block, step))
            assert torch.equal(out, exact_func(*tensors, 2))  # the sampled result is the exact one
        # Cross-attention to a short context stays exact and unmeasured (the policy keeps it so).
        override(func, q, k[:, :40], v[:, :40], 2, transformer_options=_options(0, step))
    saved = AttentionPolicy.load(path)
    assert saved == override.calibrated_policy()
    assert saved.model_class == "WanModel" and saved.dense_steps == (1, 1) and saved.budget == 0.25
    got = {(e.layer, e.bucket): e.precision for e in saved.per_layer}
    assert set(got) == {(f"double_blocks.{b}.self", t) for b in (0, 1) for t in ("first", "middle", "last")}
    assert {got[("double_blocks.0.self", t)].label for t in ("first", "middle", "last")} == {"nvfp4"}
    # Logits 4x sharper: 4-bit Q/K miss the budget, 8-bit Q·Kᵀ meets it.
    assert {got[("double_blocks.1.self", t)].label for t in ("first", "middle", "last")} == {"mxfp8+balance"}


def test_unknown_keywords_and_odd_inputs_are_declined(gen):
    q, k, v = qkv(gen, False)
    override = NVFP4AttentionOverride(AttentionPolicy(backend="sdpa", **OPEN))
    func = RecordingFunc()
    assert override(func, q, k, v, 2, window_size=(4, 4)) == "from-func"
    assert override(func, q, k, v) == "from-func"  # no heads: not ComfyUI's signature
    assert override(func, q.double(), k.double(), v.double(), 2) == "from-func"
    q3, k3, v3 = qkv(gen, True, d=160)
    assert override(func, q3, k3, v3, 2, skip_reshape=True) == "from-func"  # head_dim > 128
    assert override(func, q, k, v, 3) == "from-func"  # 128 channels do not split into 3 heads
    assert override(func, q, k[..., :0], v[..., :0], 2, enable_gqa=True) == "from-func"  # no key channels
    q0, k0, v0 = qkv(gen, True, d=0)
    assert override(func, q0, k0, v0, 2, skip_reshape=True) == "from-func"
    assert override(func, q0[..., :0], k0[:, :0], v0[:, :0], 2, skip_reshape=True, enable_gqa=True) == "from-func"
    assert len(func.calls) == 8


def test_an_unavailable_explicit_backend_falls_back(gen, caplog):
    q, k, v = qkv(gen, False)  # CPU tensors: backend "cuda" cannot run them
    func = RecordingFunc()
    override = NVFP4AttentionOverride(AttentionPolicy(backend="cuda", **OPEN))
    nvfp4_dit.reset_fallback_warnings()
    with caplog.at_level(logging.WARNING, logger="nvfp4_dit.comfyui"):
        assert override(func, q, k, v, 2) == "from-func"
        assert override(func, q, k, v, 2) == "from-func"
    assert len(caplog.records) == 1


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 12,
                    reason="native FP4 device: auto runs the kernel")
def test_auto_keeps_comfyuis_attention_without_native_fp4(gen):
    q, k, v = qkv(gen, False)
    func = RecordingFunc()
    assert NVFP4AttentionOverride(AttentionPolicy(backend="auto", **OPEN))(func, q, k, v, 2) == "from-func"


@pytest.mark.parametrize("field, value", [("backend", "fp4"), ("dense_steps", (-1, 0)), ("min_seq_len", 1.5),
                                          ("dense_steps", (True, 0))])
def test_policy_rejects_bad_values(field, value):
    with pytest.raises(ValueError, match=field):
        AttentionPolicy(**{field: value})


def test_previous_must_be_callable():
    with pytest.raises(TypeError, match="previous"):
        NVFP4AttentionOverride(AttentionPolicy(), previous=42)


class FakePatcher:
    """The two things patch_model uses of ComfyUI's ModelPatcher: clone() and model_options."""

    def __init__(self, model_options):
        self.model_options = model_options

    def clone(self):
        import copy

        return FakePatcher(copy.deepcopy(self.model_options))


def test_patch_model_patches_only_the_clone_and_chains():
    def earlier(func, *args, **kwargs):
        return func(*args, **kwargs)

    original = FakePatcher({"transformer_options": {OVERRIDE_KEY: earlier, "other": 1}})
    patched = patch_model(original, AttentionPolicy())
    assert original.model_options["transformer_options"][OVERRIDE_KEY] is earlier
    installed = patched.model_options["transformer_options"][OVERRIDE_KEY]
    assert isinstance(installed, NVFP4AttentionOverride) and installed.previous is not None
    bare = patch_model(FakePatcher({}), AttentionPolicy())
    assert bare.model_options["transformer_options"][OVERRIDE_KEY].previous is None


def test_importing_the_package_needs_no_comfyui():
    code = ("import sys, nvfp4_dit, nvfp4_dit.comfyui_node, nvfp4_dit.comfyui_node.attention_override;"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('comfy', 'comfy_api', 'nodes', 'folder_paths')];"
            "assert not bad, bad;"
            "import importlib.util as u;"
            f"s = u.spec_from_file_location('nvfp4_repo_root', {str(REPO_ROOT / '__init__.py')!r});"
            "m = u.module_from_spec(s); s.loader.exec_module(m);"
            "assert 'nvfp4_dit.comfyui_node.nodes' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_install_shim(tmp_path, capsys):
    path = install_shim(str(tmp_path))
    assert Path(path).read_text() == SHIM_SOURCE and Path(path).name == SHIM_FILE_NAME
    assert install_shim(str(tmp_path)) == path  # idempotent
    Path(path).write_text("something else\n")
    with pytest.raises(FileExistsError):
        install_shim(str(tmp_path))
    assert install_main([str(tmp_path)]) == 2
    assert install_main([str(tmp_path), "--force"]) == 0 and Path(path).read_text() == SHIM_SOURCE
    assert install_main([str(tmp_path / "missing")]) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_install_console_script(tmp_path):
    script = shutil.which("nvfp4-dit-comfyui-install")
    if script is None:
        pytest.skip("the package was installed before the console script existed; reinstall it")
    subprocess.run([script, str(tmp_path)], check=True, timeout=120, capture_output=True)
    assert (tmp_path / SHIM_FILE_NAME).read_text() == SHIM_SOURCE


# ---------------------------------------------------------------------------------------------
# Inside a real ComfyUI (CPU)
# ---------------------------------------------------------------------------------------------

def _node_class(comfyui):
    from nvfp4_dit.comfyui_node import nodes as node_module

    return node_module.NVFP4Attention


def _patch_with_node(comfyui, patcher, **inputs):
    values = dict(enabled=True, backend="sdpa", cross_attention_dense=True, dense_first_steps=0,
                  dense_last_steps=0, min_seq_len=0)
    values.update(inputs)
    return _node_class(comfyui).execute(model=patcher, **values).result[0]


class AttentionLog:
    """Wraps whatever override sits on a patcher and records every attention call ComfyUI makes."""

    def __init__(self, patcher):
        options = patcher.model_options.setdefault("transformer_options", {})
        self.inner = options.get(OVERRIDE_KEY)
        self.calls = []
        options[OVERRIDE_KEY] = self

    def __call__(self, func, q, k, v, *args, **kwargs):
        lq = q.shape[2] if kwargs.get("skip_reshape") else q.shape[1]
        lk = k.shape[2] if kwargs.get("skip_reshape") else k.shape[1]
        self.calls.append(dict(func=func.__name__, lq=lq, lk=lk, mask=kwargs.get("mask") is not None))
        if self.inner is None:
            return func(q, k, v, *args, **kwargs)
        return self.inner(func, q, k, v, *args, **kwargs)


@pytest.fixture
def op_calls(monkeypatch):
    """Every call the override makes into the op (ops.run_fp4, looked up at call time)."""
    from nvfp4_dit import ops

    calls = []
    real = ops.run_fp4

    def counting(q, k, v, **kwargs):
        calls.append(kwargs)
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(ops, "run_fp4", counting)
    return calls


@pytest.fixture(scope="module")
def tiny_cases(comfyui):
    return {name: comfyui_env.tiny_case(comfyui, name) for name in TINY_MODELS}


class UnpatchedRuns:
    """Each tiny model's unpatched output and the attention calls it makes, sampled once per module."""

    def __init__(self, comfyui, cases):
        self.comfyui, self.cases, self.runs = comfyui, cases, {}

    def __getitem__(self, name):
        if name not in self.runs:
            spy = self.cases[name].patcher.clone()
            log = AttentionLog(spy)
            self.runs[name] = (comfyui_env.sample(self.comfyui, spy, self.cases[name]), log.calls)
        return self.runs[name]


@pytest.fixture(scope="module")
def unpatched(comfyui, tiny_cases):
    return UnpatchedRuns(comfyui, tiny_cases)


@pytest.mark.comfyui
@pytest.mark.parametrize("name", TINY_MODELS)
def test_forced_dense_is_bit_identical_and_leaves_the_original_alone(comfyui, tiny_cases, unpatched, op_calls,
                                                                    name):
    case = tiny_cases[name]
    expected, reference_calls = unpatched[name]
    before = comfyui_env.sample(comfyui, case.patcher, case)
    assert torch.equal(before, expected)
    # Every step dense: the node's override sees every call and hands each to ComfyUI's function.
    patched = _patch_with_node(comfyui, case.patcher, dense_first_steps=3)
    assert patched is not case.patcher
    installed = patched.model_options["transformer_options"][OVERRIDE_KEY]
    assert isinstance(installed, NVFP4AttentionOverride)
    log = AttentionLog(patched)
    out = comfyui_env.sample(comfyui, patched, case)
    assert torch.equal(out, expected)
    assert len(log.calls) == len(reference_calls) > 0
    assert op_calls == []
    # The input model never carried the override and still samples exactly as before.
    assert OVERRIDE_KEY not in case.patcher.model_options.get("transformer_options", {})
    assert torch.equal(comfyui_env.sample(comfyui, case.patcher, case), before)


@pytest.mark.comfyui
@pytest.mark.parametrize("name", TINY_MODELS)
def test_every_eligible_call_runs_in_the_op(comfyui, tiny_cases, unpatched, op_calls, name):
    case = tiny_cases[name]
    expected, reference_calls = unpatched[case.name]
    self_attention = [c for c in reference_calls if c["lq"] == c["lk"]]
    cross_attention = [c for c in reference_calls if c["lq"] != c["lk"]]
    assert self_attention and (cross_attention or name == "hunyuan_video")  # Hunyuan attends jointly

    # Defaults: cross-attention stays dense, so exactly the self-attention calls reach the op.
    patched = _patch_with_node(comfyui, case.patcher)
    out = comfyui_env.sample(comfyui, patched, case)
    assert len(op_calls) == len(self_attention)
    assert all(c["backend"] == "sdpa" for c in op_calls)
    torch.testing.assert_close(out, expected, atol=2e-4, rtol=2e-4)

    # Everything open: every call ComfyUI makes goes to the op, LTXV's masked cross-attention included.
    op_calls.clear()
    patched = _patch_with_node(comfyui, case.patcher, cross_attention_dense=False)
    out = comfyui_env.sample(comfyui, patched, case)
    assert len(op_calls) == len(reference_calls)
    if name == "ltxv":
        assert any(c["key_mask"] is not None for c in op_calls)
    torch.testing.assert_close(out, expected, atol=2e-4, rtol=2e-4)


@pytest.mark.comfyui
@pytest.mark.parametrize("name", TINY_MODELS)
def test_fp4_reference_numerics_inside_the_model(comfyui, tiny_cases, unpatched, op_calls, name):
    case = tiny_cases[name]
    expected, _ = unpatched[case.name]
    patched = _patch_with_node(comfyui, case.patcher, backend="reference")
    out = comfyui_env.sample(comfyui, patched, case)
    assert op_calls and all(c["backend"] == "reference" for c in op_calls)
    assert torch.isfinite(out).all()
    assert not torch.equal(out, expected)
    # FP4 attention perturbs the denoiser a little; the sampled latent stays close to the exact one
    # (measured 4e-5 .. 3e-4 for these tiny models, whose attention is a small part of each block).
    error = (out - expected).norm() / expected.norm()
    assert error < 1e-2, float(error)


@pytest.mark.comfyui
def test_dense_steps_follow_the_schedule_comfyui_passes(comfyui, tiny_cases, unpatched, op_calls):
    case = tiny_cases["wan"]
    _, reference_calls = unpatched[case.name]
    per_step = len([c for c in reference_calls if c["lq"] == c["lk"]]) // 3
    for first, last, fp4_steps in ((1, 0, 2), (0, 1, 2), (1, 1, 1), (2, 1, 0)):
        op_calls.clear()
        patched = _patch_with_node(comfyui, case.patcher, dense_first_steps=first, dense_last_steps=last)
        comfyui_env.sample(comfyui, patched, case)
        assert len(op_calls) == fp4_steps * per_step, (first, last)
    # A second-order sampler calls the model between schedule points; those calls count to their step.
    op_calls.clear()
    patched = _patch_with_node(comfyui, case.patcher, dense_first_steps=1, dense_last_steps=1)
    spy = AttentionLog(patched)
    comfyui_env.sample(comfyui, patched, case, sampler="heun")
    # heun: 2 model calls per step except the last; steps 0 and 2 dense -> only step 1 (2 calls) in FP4.
    assert len(op_calls) == 2 * per_step and len(spy.calls) > len(op_calls)


@pytest.mark.comfyui
def test_keep_mass_runs_block_sparse_after_the_sparse_first_steps(comfyui, tiny_cases, unpatched, op_calls,
                                                                   monkeypatch):
    case = tiny_cases["wan"]
    _, reference_calls = unpatched[case.name]
    per_step = len([c for c in reference_calls if c["lq"] == c["lk"]]) // 3
    patched = _patch_with_node(comfyui, case.patcher, backend="reference", keep_mass=0.9, sparse_first_steps=1,
                               sparse_min_seq_len=0)
    from nvfp4_dit import planner

    videos, real_plan = [], planner.plan_call

    def recording_plan(*args, **kwargs):
        videos.append(kwargs.get("video"))
        return real_plan(*args, **kwargs)

    monkeypatch.setattr(planner, "plan_call", recording_plan)
    out = comfyui_env.sample(comfyui, patched, case)
    # Wan reports its patched latent grid: 2 frames of 8x8 latents at patch 1x2x2.
    assert videos and all(v is not None and v.grid == (2, 4, 4) for v in videos)
    assert torch.isfinite(out).all() and len(op_calls) == 3 * per_step
    sparsity = [c["sparsity"] for c in op_calls]
    assert all(s is None for s in sparsity[:per_step])                        # step 0: dense NVFP4
    assert all(s is not None and s.keep_mass == 0.9 for s in sparsity[per_step:])
    op_calls.clear()
    comfyui_env.sample(comfyui, _patch_with_node(comfyui, case.patcher, backend="reference"), case)
    assert op_calls and all(c["sparsity"] is None for c in op_calls)        # keep_mass 1.0 (default): dense


@pytest.mark.comfyui
@pytest.mark.parametrize("name, position", [("wan", "first"), ("cosmos_predict2", "first"),
                                            ("hunyuan_video", "last"), ("ltxv", "first")])
def test_each_forward_reads_its_video_tokens_off_the_latent(comfyui, tiny_cases, op_calls, monkeypatch, name,
                                                            position):
    """The apply_model wrapper reads each forward's latent grid (2 latent frames of 8x8 at patch
    1x2x2, LTXV's 4x4 at patch 1: 2 x 4 x 4 tokens); a block-sparse joint call keeps the prompt
    (ComfyUI's HunyuanVideo puts its 8 text tokens first)."""
    from nvfp4_dit import planner

    case = tiny_cases[name]
    videos, real_plan = [], planner.plan_call

    def recording_plan(*args, **kwargs):
        videos.append(kwargs.get("video"))
        return real_plan(*args, **kwargs)

    monkeypatch.setattr(planner, "plan_call", recording_plan)
    patched = _patch_with_node(comfyui, case.patcher, backend="reference", keep_mass=0.9, sparse_first_steps=0,
                               sparse_min_seq_len=0, min_seq_len=0, dense_first_steps=0, dense_last_steps=0)
    out = comfyui_env.sample(comfyui, patched, case)
    assert torch.isfinite(out).all()
    assert videos and all(v is not None and v.grid == (2, 4, 4) and v.position == position for v in videos)
    joint = [c["sparsity"] for c in op_calls if c["sparsity"] is not None and c["sparsity"].always_keep is not None]
    assert bool(joint) == (name == "hunyuan_video")
    assert all(s.always_keep == (0, 8) for s in joint)
    # block-sparse self-attention over the video runs in its 3D tiles, with the text in place
    ordered = [c["order"] for c in op_calls if c.get("order") is not None]
    assert ordered and all(o.grid == (2, 4, 4) for o in ordered)
    assert all(o.span == ((8, 40) if name == "hunyuan_video" else (0, 32)) for o in ordered)
    # Without keep_mass nothing reads the latent.
    videos.clear()
    comfyui_env.sample(comfyui, _patch_with_node(comfyui, case.patcher, backend="reference"), case)
    assert all(v is None for v in videos)


@pytest.mark.comfyui
def test_chains_an_override_already_on_the_model(comfyui, tiny_cases, unpatched, op_calls):
    case = tiny_cases["wan"]
    expected, reference_calls = unpatched[case.name]
    earlier = case.patcher.clone()
    earlier_log = AttentionLog(earlier)  # stands in for another attention patch node (sage, flash)
    patched = _patch_with_node(comfyui, earlier)
    assert patched.model_options["transformer_options"][OVERRIDE_KEY].previous is earlier_log
    out = comfyui_env.sample(comfyui, patched, case)
    cross = [c for c in reference_calls if c["lq"] != c["lk"]]
    assert len(earlier_log.calls) == len(cross) > 0  # what ours declined went to the earlier patch
    assert len(op_calls) == len(reference_calls) - len(cross)
    torch.testing.assert_close(out, expected, atol=2e-4, rtol=2e-4)
    # Applying the node twice chains too (no recursion: each override calls a different one).
    twice = _patch_with_node(comfyui, _patch_with_node(comfyui, case.patcher, backend="reference"),
                             dense_first_steps=3)
    op_calls.clear()
    comfyui_env.sample(comfyui, twice, case)
    assert op_calls and all(c["backend"] == "reference" for c in op_calls)


@pytest.mark.comfyui
def test_declined_calls_do_not_recurse_through_wrap_attn(comfyui, gen):
    attention = comfyui.modules.comfy.ldm.modules.attention
    q, k, v = qkv(gen, False, lk=24)
    override = NVFP4AttentionOverride(AttentionPolicy(backend="sdpa", min_seq_len=0))  # declines cross-attn
    for backend in (attention.attention_pytorch, attention.attention_basic, attention.attention_sub_quad):
        out = backend(q, k, v, 2, transformer_options={OVERRIDE_KEY: override})
        torch.testing.assert_close(out, backend(q, k, v, 2), atol=1e-5, rtol=1e-5)
    # low_precision_attention=False reaches ComfyUI's function the same way.
    q, k, v = qkv(gen, True)
    out = attention.attention_pytorch(q, k, v, 2, skip_reshape=True, low_precision_attention=False,
                                      transformer_options={OVERRIDE_KEY: override})
    torch.testing.assert_close(out, attention.attention_pytorch(q, k, v, 2, skip_reshape=True))


@pytest.mark.comfyui
def test_node_calibrates_in_a_graph_then_runs_the_saved_policy(comfyui, tiny_cases, unpatched, op_calls, tmp_path):
    case = tiny_cases["wan"]
    expected, _ = unpatched[case.name]
    path = tmp_path / "wan.policy.json"
    with pytest.raises(ValueError, match="calibrate needs policy_file"):
        _patch_with_node(comfyui, case.patcher, calibrate=True)
    calibrating = _patch_with_node(comfyui, case.patcher, backend="reference", calibrate=True, policy_file=str(path))
    assert torch.equal(comfyui_env.sample(comfyui, calibrating, case), expected)  # exact while measuring
    policy = AttentionPolicy.load(path)
    assert policy.model_class == "WanModel"
    assert {e.layer for e in policy.per_layer} == {"double_blocks.0.self", "double_blocks.1.self"}
    assert {e.bucket for e in policy.per_layer} == {"first", "middle", "last"}
    # The saved policy, with the node's own settings (every step, FP4 reference numerics).
    op_calls.clear()
    patched = _patch_with_node(comfyui, case.patcher, backend="reference", policy_file=str(path))
    comfyui_env.sample(comfyui, patched, case)
    fp4 = {(e.layer, e.bucket): e.precision for e in policy.per_layer if not e.precision.exact}
    assert len(op_calls) == len(fp4)  # 3 steps, one per third; cond and uncond in one call per block
    assert all(c["balance_qk"] == fp4[k].balance_qk for c, k in zip(op_calls, sorted(fp4, key=lambda x: (
        ("first", "middle", "last").index(x[1]), x[0]))))
    # A policy calibrated on another model is refused.
    with pytest.raises(ValueError, match="calibrated on WanModel"):
        _patch_with_node(comfyui, tiny_cases["hunyuan_video"].patcher, policy_file=str(path))


@pytest.mark.comfyui
def test_node_schema_and_disabled_passthrough(comfyui, tiny_cases):
    node = _node_class(comfyui)
    schema = node.GET_SCHEMA()
    assert schema.node_id == "NVFP4AttentionVideoDiT" and schema.display_name == "NVFP4 Attention (video DiT)"
    inputs = node.INPUT_TYPES()["required"]
    assert list(inputs) == ["model", "enabled", "backend", "cross_attention_dense", "dense_first_steps",
                            "dense_last_steps", "min_seq_len"]
    # Inputs added later are optional and come last, so saved workflows (widget values by position,
    # API graphs by name) keep loading.
    assert list(node.INPUT_TYPES().get("optional", {})) == ["balance_qk", "policy_file", "calibrate",
                                                            "calibration_budget", "qk_format", "keep_mass",
                                                            "sparse_first_steps", "sparse_min_seq_len"]
    assert inputs["backend"][0] == list(nvfp4_dit.BACKENDS) or inputs["backend"][1]["options"] == list(nvfp4_dit.BACKENDS)
    assert all(spec[1].get("tooltip") for name, spec in inputs.items() if name != "model")
    patcher = tiny_cases["wan"].patcher
    assert _patch_with_node(comfyui, patcher, enabled=False) is patcher


@pytest.mark.comfyui
def test_loads_as_a_custom_node_folder_and_through_the_shim(comfyui, tmp_path):
    nodes = comfyui.modules.nodes
    nodes.NODE_CLASS_MAPPINGS.pop("NVFP4AttentionVideoDiT", None)
    assert asyncio.run(nodes.load_custom_node(str(REPO_ROOT)))
    assert nodes.NODE_CLASS_MAPPINGS["NVFP4AttentionVideoDiT"] is _node_class(comfyui)
    assert nodes.NODE_DISPLAY_NAME_MAPPINGS["NVFP4AttentionVideoDiT"] == "NVFP4 Attention (video DiT)"
    nodes.NODE_CLASS_MAPPINGS.pop("NVFP4AttentionVideoDiT")
    shim = install_shim(str(tmp_path))
    assert asyncio.run(nodes.load_custom_node(shim))
    assert nodes.NODE_CLASS_MAPPINGS["NVFP4AttentionVideoDiT"] is _node_class(comfyui)


@pytest.mark.comfyui
def test_comfyui_reads_the_registry_fields(comfyui):
    from comfy_config import config_parser

    config = config_parser.extract_node_configuration(str(REPO_ROOT))
    assert config.project.name == "nvfp4_dit"
    assert config.tool_comfy.display_name == "NVFP4 Attention (video DiT)"
    assert config.tool_comfy.publisher_id
    assert config.project.supported_comfyui_version == ">=0.3.60"


def test_repo_root_works_as_a_custom_node_without_an_installed_package(tmp_path):
    """A clone in custom_nodes/ that was never pip-installed finds its own packages."""
    code = f"""
import importlib.abc, importlib.util, sys
class HideInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        # The names an installation provides (pyproject's package-dir); plain submodules such as
        # nvfp4_dit.format are then found through the package's own __path__.
        if name in ("nvfp4_dit", "nvfp4_dit.comfyui_node", "nvfp4_dit.processors", "nvfp4_dit._csrc"):
            raise ModuleNotFoundError(name)
sys.meta_path.insert(0, HideInstalled())
for m in [m for m in sys.modules if m.startswith("nvfp4_dit")]:
    del sys.modules[m]
sys.modules["comfy_api"] = type(sys)("comfy_api")  # the node module's import, satisfied below
spec = importlib.util.spec_from_file_location("clone", {str(REPO_ROOT / '__init__.py')!r})
clone = importlib.util.module_from_spec(spec); spec.loader.exec_module(clone)
node_module = clone._node_module()
import nvfp4_dit, nvfp4_dit.comfyui_node.attention_override as ao
assert nvfp4_dit.__file__ == {str(REPO_ROOT / 'nvfp4_dit' / '__init__.py')!r}, nvfp4_dit.__file__
assert node_module.__file__ == {str(REPO_ROOT / 'comfyui_node' / '__init__.py')!r}
print("ok")
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr


def _server_graph(seed=3):
    return {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": "tiny_wan.safetensors", "weight_dtype": "default"}},
        "2": {"class_type": "NVFP4AttentionVideoDiT", "inputs": {
            "model": ["1", 0], "enabled": True, "backend": "reference", "cross_attention_dense": True,
            "dense_first_steps": 1, "dense_last_steps": 0, "min_seq_len": 0}},
        "3": {"class_type": "RandomConditioningForTest", "inputs": {"seed": 1, "tokens": 8, "width": 4096}},
        "4": {"class_type": "RandomConditioningForTest", "inputs": {"seed": 2, "tokens": 8, "width": 4096}},
        "5": {"class_type": "EmptyHunyuanLatentVideo", "inputs": {"width": 32, "height": 32, "length": 5, "batch_size": 1}},
        "6": {"class_type": "KSampler", "inputs": {
            "model": ["2", 0], "seed": seed, "steps": 2, "cfg": 3.0, "sampler_name": "euler", "scheduler": "simple",
            "positive": ["3", 0], "negative": ["4", 0], "latent_image": ["5", 0], "denoise": 1.0}},
        "7": {"class_type": "SaveLatent", "inputs": {"samples": ["6", 0], "filename_prefix": "nvfp4_dit_test"}},
    }


@pytest.fixture(scope="module")
def server(comfyui, tmp_path_factory):
    """The real ComfyUI server (CPU, 127.0.0.1), with this repository cloned into custom_nodes/."""
    comfy = comfyui.modules.comfy
    base = tmp_path_factory.mktemp("comfy_base")
    (base / "models" / "diffusion_models").mkdir(parents=True)
    comfy.utils.save_torch_file(comfyui_env.tiny_wan_state_dict(),
                                str(base / "models" / "diffusion_models" / "tiny_wan.safetensors"))
    custom_nodes = base / "custom_nodes"
    custom_nodes.mkdir()
    (custom_nodes / "nvfp4_dit").symlink_to(REPO_ROOT, target_is_directory=True)  # the git-clone install
    shutil.copy(comfyui_env.TESTS_DIR / "comfyui_fixture_nodes.py", custom_nodes / "comfyui_fixture_nodes.py")
    with comfyui_env.comfyui_server(comfyui, base) as (url, log_path):
        object_info = comfyui_env.http_json(f"{url}/object_info", timeout=60)
        yield types.SimpleNamespace(url=url, base=base, log_path=log_path, object_info=object_info)


@pytest.mark.comfyui
def test_real_server_runs_a_prompt_through_the_node(server):
    info = comfyui_env.http_json(f"{server.url}/object_info/NVFP4AttentionVideoDiT")["NVFP4AttentionVideoDiT"]
    assert info["display_name"] == "NVFP4 Attention (video DiT)"
    queued = comfyui_env.http_json(f"{server.url}/prompt", {"prompt": _server_graph(), "client_id": "nvfp4-dit-test"})
    assert not queued.get("node_errors"), queued
    entry = comfyui_env.wait_for_prompt(server.url, queued["prompt_id"])
    log = server.log_path.read_text()
    assert entry["status"]["status_str"] == "success", log[-4000:]
    saved = list((server.base / "output").rglob("nvfp4_dit_test*.latent"))
    assert len(saved) == 1, log[-4000:]
    from safetensors.torch import load_file

    latent = load_file(str(saved[0]))["latent_tensor"]
    assert latent.shape == (1, 16, 2, 4, 4) and torch.isfinite(latent).all()


_FILE_INPUTS = {"unet_name", "clip_name", "vae_name", "lora_name", "image"}
_EXAMPLES = ("wan2.1_t2v", "wan2.1_t2v_sparse", "wan2.2_14b_i2v", "cosmos_predict2_video2world")


@pytest.mark.comfyui
@pytest.mark.parametrize("name", _EXAMPLES)
def test_example_api_workflow_passes_comfyuis_validation_but_for_model_files(server, name):
    graph = json.loads((WORKFLOWS / f"{name}.api.json").read_text())
    check_api_workflow(graph, server.object_info, name)
    patch_ids = [k for k, n in graph.items() if n["class_type"] == "NVFP4AttentionVideoDiT"]
    assert len(patch_ids) == (2 if name.startswith("wan2.2") else 1)  # Wan 2.2: both experts
    for patch_id in patch_ids:  # after the loader / LoRA, before ModelSampling or the sampler
        source = graph[graph[patch_id]["inputs"]["model"][0]]["class_type"]
        assert source in ("UNETLoader", "LoraLoaderModelOnly"), source
        users = [n["class_type"] for n in graph.values() if [patch_id, 0] in n["inputs"].values()]
        assert users and all(u in ("ModelSamplingSD3", "KSampler", "KSamplerAdvanced") for u in users), users
    # ComfyUI's own validation: the model files and the input image are not here, nothing else may fail.
    with pytest.raises(urllib.error.HTTPError) as failure:
        comfyui_env.http_json(f"{server.url}/prompt", {"prompt": graph})
    body = json.loads(failure.value.read().decode())
    errors = [(graph[node_id]["class_type"], e["type"], e.get("extra_info", {}).get("input_name"))
              for node_id, node_errors in body["node_errors"].items() for e in node_errors["errors"]]
    assert errors and all(input_name in _FILE_INPUTS for _, _, input_name in errors), errors
    file_nodes = {k for k, n in graph.items() if _FILE_INPUTS & set(n["inputs"])}
    assert set(body["node_errors"]) == file_nodes


@pytest.mark.comfyui
@pytest.mark.parametrize("name", _EXAMPLES)
def test_example_ui_workflow_is_its_api_twin(server, name):
    ui = json.loads((WORKFLOWS / f"{name}.json").read_text())
    api = json.loads((WORKFLOWS / f"{name}.api.json").read_text())
    assert ui_to_api(ui, server.object_info) == api


def ui_to_api(ui: dict, object_info: dict) -> dict:
    """The API-format graph a UI-format (litegraph 0.4) workflow stands for."""
    links = {link[0]: link for link in ui["links"]}
    graph = {}
    for node in ui["nodes"]:
        info = object_info[node["type"]]
        inputs = {}
        widgets = list(node.get("widgets_values", []))
        for section in ("required", "optional"):
            for input_name in info["input_order"].get(section, []):
                spec = info["input"][section][input_name]
                options = spec[1] if len(spec) > 1 else {}
                linked = [i for i in node["inputs"] if i["name"] == input_name and i.get("link") is not None]
                if linked:
                    link = links[linked[0]["link"]]
                    assert link[3] == node["id"], link
                    inputs[input_name] = [str(link[1]), link[2]]
                    continue
                if isinstance(spec[0], list) or spec[0] in ("INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"):
                    if not widgets and section == "optional":
                        continue  # an input added after the workflow was saved: it keeps its default
                    assert widgets, f"{node['type']} has no widget value for {input_name}"
                    inputs[input_name] = widgets.pop(0)
                    if options.get("control_after_generate") or options.get("image_upload"):
                        widgets.pop(0)  # the companion widget ("fixed" / the upload button)
        assert not widgets, f"{node['type']} has extra widget values {widgets}"
        graph[str(node["id"])] = {"class_type": node["type"], "inputs": inputs}
    return graph


def check_api_workflow(graph: dict, object_info: dict, name: str) -> None:
    """Every node of an API-format graph exists on the server, with known inputs and valid links."""
    for node_id, node in graph.items():
        class_type = node["class_type"]
        assert class_type in object_info, f"{name}: node {node_id} has unknown class {class_type}"
        spec = object_info[class_type]["input"]
        known = {**spec.get("required", {}), **spec.get("optional", {})}
        for input_name, value in node["inputs"].items():
            assert input_name in known, f"{name}: {class_type}.{input_name} is not an input"
            if isinstance(value, list) and len(value) == 2 and isinstance(value[0], str):
                source, slot = value
                assert source in graph, f"{name}: {class_type}.{input_name} links to missing node {source}"
                outputs = object_info[graph[source]["class_type"]]["output"]
                assert slot < len(outputs), f"{name}: {class_type}.{input_name} links to slot {slot}"
                wanted = known[input_name][0]
                if isinstance(wanted, str):
                    assert outputs[slot] == wanted or wanted == "*", (
                        f"{name}: {class_type}.{input_name} wants {wanted}, gets {outputs[slot]}")
        missing = set(spec.get("required", {})) - set(node["inputs"])
        assert not missing, f"{name}: {class_type} node {node_id} lacks required inputs {sorted(missing)}"


def test_heads_must_be_a_positive_int_in_both_layouts(gen):
    override = NVFP4AttentionOverride(AttentionPolicy(backend="sdpa", **OPEN))
    for skip_reshape in (False, True):
        q, k, v = qkv(gen, skip_reshape)
        for heads in (2.0, True, 0):
            func = RecordingFunc()
            assert override(func, q, k, v, heads, skip_reshape=skip_reshape) == "from-func"


def test_inputs_the_op_rejects_are_declined(gen, caplog):
    q, k, v = qkv(gen, False)
    func = RecordingFunc()
    override = NVFP4AttentionOverride(AttentionPolicy(backend="sdpa", **OPEN))
    nvfp4_dit.reset_fallback_warnings()
    with caplog.at_level(logging.WARNING, logger="nvfp4_dit.comfyui"):
        # A negative softmax scale passes ComfyUI's back-ends; nvfp4_dit.attention rejects it (ValueError).
        assert override(func, q, k, v, 2, scale=-0.5) == "from-func"
        assert override(func, q, k, v, 2, scale=-0.5) == "from-func"
    assert len(func.calls) == 2 and func.calls[0][1]["scale"] == -0.5
    assert len(caplog.records) == 1 and "scale" in caplog.records[0].getMessage()


@pytest.mark.cuda
@pytest.mark.parametrize("skip_reshape", [False, True])
@pytest.mark.parametrize("lk", [300, 77])
def test_override_runs_the_kernel_on_gpu(skip_reshape, lk):
    from nvfp4_dit.cuda import build

    reason = build.unavailable_reason()
    assert reason is None, reason
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape_q = (2, 2, 300, 128) if skip_reshape else (2, 300, 256)
    shape_k = (2, 2, lk, 128) if skip_reshape else (2, lk, 256)
    q = torch.randn(shape_q, generator=gen, device="cuda").bfloat16()
    k = torch.randn(shape_k, generator=gen, device="cuda").bfloat16()
    v = torch.randn(shape_k, generator=gen, device="cuda").bfloat16()
    mask = torch.zeros(2, 1, 1, lk, device="cuda")
    mask[1, ..., lk - 20:] = -math.inf  # suffix padding: the kernel takes it as kv_lens
    func = RecordingFunc()
    override = NVFP4AttentionOverride(AttentionPolicy(backend="cuda", **OPEN))
    out = override(func, q, k, v, 2, mask=mask, skip_reshape=skip_reshape, skip_output_reshape=skip_reshape)
    assert func.calls == [], "the call should run in the kernel"
    layout = "HND" if skip_reshape else "NHD"
    q4, k4, v4 = (t if skip_reshape else t.reshape(2, t.shape[1], 2, 128) for t in (q, k, v))
    direct = nvfp4_dit.attention(q4, k4, v4, layout=layout, scale=128 ** -0.5, attn_mask=mask[:, 0, 0] == 0,
                                 backend="cuda")
    assert torch.equal(out, direct if skip_reshape else direct.reshape(2, 300, 256))
    expected = exact(q.float(), k.float(), v.float(), 2, skip_reshape, skip_reshape, mask=mask)
    cos = F.cosine_similarity(out.double().flatten(), expected.double().flatten(), dim=0).item()
    assert cos >= 0.98, cos
    # "auto" runs the kernel only where the FP4 MMA is native; elsewhere ComfyUI's function.
    auto = NVFP4AttentionOverride(AttentionPolicy(backend="auto", **OPEN))
    result = auto(func, q, k, v, 2, mask=mask, skip_reshape=skip_reshape, skip_output_reshape=skip_reshape)
    if build.is_native(torch.cuda.get_device_capability()):
        assert torch.equal(result, out) and func.calls == []
    else:
        assert result == "from-func"
