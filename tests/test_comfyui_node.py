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
import urllib.request
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import nvfp4_dit
from nvfp4_dit.comfyui_node import attention_override as ao
from nvfp4_dit.comfyui_node.attention_override import AttentionPolicy, NVFP4AttentionOverride, patch_model
from nvfp4_dit.comfyui_node.install import SHIM_FILE_NAME, SHIM_SOURCE, install_shim, main as install_main

try:
    import comfyui_env
except ImportError:  # tests/ imported as a package
    from tests import comfyui_env
from comfyui_env import TINY_MODELS, comfyui  # noqa: F401  (the session fixture)

REPO_ROOT = comfyui_env.REPO_ROOT
WORKFLOWS = REPO_ROOT / "examples" / "workflows"
OVERRIDE_KEY = "optimized_attention_override"

# Lets every call through: no length, cross-attention or step gating.
OPEN = dict(cross_attention_dense=False, min_seq_len=0)


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
    assert out.shape == expected.shape
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
    return {"bool": bool_mask, "additive_3d": additive, "shared_2d": shared, "interior": interior}


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
    per_head = torch.ones(2, 2, 1, 40, dtype=torch.bool)
    per_head[:, 1, :, 30:] = False
    bias = torch.full((2, 1, 1, 40), -0.5)
    nothing_left = torch.ones(2, 1, 1, 40, dtype=torch.bool)
    nothing_left[1] = False
    wrong_keys = torch.zeros(2, 1, 1, 12)
    return {"per_query": per_query, "per_head": per_head, "bias": bias, "nothing_left": nothing_left,
            "int_mask": torch.ones(2, 1, 1, 40, dtype=torch.int64), "wrong_keys": wrong_keys}


@pytest.mark.parametrize("name", list(_unexpressible_masks()))
def test_masks_it_cannot_express_go_to_comfyuis_function(gen, name, caplog):
    mask = _unexpressible_masks()[name]
    q, k, v = qkv(gen, False)
    func = RecordingFunc()
    override = NVFP4AttentionOverride(AttentionPolicy(backend="sdpa", **OPEN))
    ao._warned.clear()
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


@pytest.mark.parametrize("kwargs, accepted", [
    (dict(min_seq_len=41), False), (dict(min_seq_len=40), True),
    (dict(cross_attention_dense=True), True),
])
def test_min_seq_len_counts_query_tokens(gen, kwargs, accepted):
    q, k, v = qkv(gen, False)
    func = RecordingFunc()
    policy = AttentionPolicy(backend="sdpa", **{**OPEN, **kwargs})
    NVFP4AttentionOverride(policy)(func, q, k, v, 2)
    assert (func.calls == []) == accepted


def test_cross_attention_dense(gen):
    q, k, v = qkv(gen, False, lk=24)
    for dense, expect_func in ((True, 1), (False, 0)):
        func = RecordingFunc()
        NVFP4AttentionOverride(AttentionPolicy(backend="sdpa", min_seq_len=0, cross_attention_dense=dense))(
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
    policy = AttentionPolicy(backend="sdpa", dense_first_steps=first, dense_last_steps=last, **OPEN)
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
    assert len(func.calls) == 5


def test_an_unavailable_explicit_backend_falls_back(gen, caplog):
    q, k, v = qkv(gen, False)  # CPU tensors: backend "cuda" cannot run them
    func = RecordingFunc()
    override = NVFP4AttentionOverride(AttentionPolicy(backend="cuda", **OPEN))
    ao._warned.clear()
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


@pytest.mark.parametrize("field, value", [("backend", "fp4"), ("dense_first_steps", -1), ("min_seq_len", 1.5),
                                          ("dense_last_steps", True)])
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
