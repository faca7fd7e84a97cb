"""NVFP4 processors on tiny random models of every diffusers video family (CPU).

Tolerances (rel-L2 = ||x - x_dense|| / ||x_dense||):

* ``backend="sdpa"`` (every call routed, exact attention): bit-identical here, asserted to 1e-6.
  Anything the processor loses on the way (RoPE, qk-norm, a mask, the image-context branch)
  moves the output by >= 1e-2 (``test_dropped_rope_is_caught`` shows it for RoPE).
* ``backend="reference"`` (FP4 numerics): each routed attention call within 0.25 of exact
  attention on the same q/k/v, the model output within 0.06.  Why: e2m1 keeps one mantissa bit,
  so a block-scaled element carries up to ~1/4 relative rounding error (rms ~ 1/10); attention
  averages that over keys, measured per call 0.02-0.17 on these models (the upper end for
  12-16-key text cross-attention, where little averaging happens).  Through the residual
  stream the model outputs moved by 0.001-0.033 over all 16 family/head-dim cases, so 0.06
  keeps a ~2x margin, while a broken integration (lost RoPE, ignored mask) shows up as >= 1e-2
  even in the exact route.  The tests also require the FP4 output to differ from the dense
  one, so a silently dense route cannot pass.
"""

from __future__ import annotations

import gc
import inspect
import math
import weakref

import pytest
import torch

pytest.importorskip("diffusers")

import nvfp4_dit  # noqa: E402
from nvfp4_dit import format as fmt  # noqa: E402
from nvfp4_dit import ops  # noqa: E402
from nvfp4_dit.processors import apply, routing  # noqa: E402
from nvfp4_dit.processors import diffusers_processors as dp  # noqa: E402
from nvfp4_dit.processors.tiny_models.diffusers_families import FAMILIES, build  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

CASES = [(f, 64) for f in FAMILIES] + [(f, 128) for f in ("cosmos", "cosmos_2_5", "wan", "hunyuan_video", "ltx", "cogvideox",
                                                           "mochi", "minimax_h3")]


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


class OpSpy:
    """Records every FP4 call the router makes (``ops.run_fp4``) and its error vs exact."""

    def __init__(self, compare=False):
        self.calls = []
        self.errors = []
        self.compare = compare
        self._orig = ops.run_fp4

    def __call__(self, q, k, v, **kw):
        out = self._orig(q, k, v, **kw)
        key_mask = kw.get("key_mask")
        lens = kw.get("kv_lens") if key_mask is None else key_mask.kv_lens
        self.calls.append((tuple(q.shape), tuple(k.shape), kw.get("layout"), lens, key_mask))
        if self.compare:
            mask = None if key_mask is None else key_mask.bias[:, :, None, :]
            exact = nvfp4_dit.attention(q, k, v, layout=kw["layout"], causal=kw["causal"], scale=kw["scale"],
                                        attn_mask=mask, return_lse=kw["return_lse"], backend="sdpa")
            self.errors.append(_rel(out if not kw.get("return_lse") else out[0],
                                    exact if not kw.get("return_lse") else exact[0]))
        return out


@pytest.fixture
def spy(monkeypatch):
    s = OpSpy()
    monkeypatch.setattr(ops, "run_fp4", s)
    return s


@pytest.fixture(scope="module")
def dense_outputs():
    """Dense reference outputs per case (built once; models are rebuilt from the same seed)."""
    return {}


def _case_and_dense(family, head_dim, cache):
    case = build(family, head_dim=head_dim)
    key = (family, head_dim)
    if key not in cache:
        cache[key] = case.run()
    return case, cache[key]


@pytest.mark.parametrize("family,head_dim", CASES)
def test_fp4_close_to_dense_and_restore_bit_identical(family, head_dim, dense_outputs, monkeypatch):
    case, dense = _case_and_dense(family, head_dim, dense_outputs)
    originals = {n: m.processor for n, m in case.model.named_modules() if getattr(m, "processor", None) is not None}
    s = OpSpy(compare=True)
    monkeypatch.setattr(ops, "run_fp4", s)
    handle = apply(case.model, backend="reference", cross_attention=True, min_seq_len=0)
    assert handle.processors, "no processor was wrapped"
    fp4 = case.run()
    handle.restore()
    after = case.run()

    assert s.calls, "no call reached the FP4 op"
    assert max(s.errors) < 0.25, s.errors
    for o, d in zip(fp4, dense):
        assert 0 < _rel(o, d) < 0.06
    for a, d in zip(after, dense):
        assert torch.equal(a, d)
    now = {n: m.processor for n, m in case.model.named_modules() if getattr(m, "processor", None) is not None}
    assert all(now[n] is p for n, p in originals.items())


@pytest.mark.parametrize("family", FAMILIES)
def test_exact_route_keeps_every_kwarg(family, dense_outputs, spy):
    """All calls go through the processors and the op (sdpa back-end): same output as the model.

    Fails if a keyword (RoPE, masks, image context) were dropped between module and processor."""
    case, dense = _case_and_dense(family, 64, dense_outputs)
    with apply(case.model, backend="sdpa", cross_attention=True, min_seq_len=0):
        out = case.run()
    assert spy.calls
    for o, d in zip(out, dense):
        torch.testing.assert_close(o, d, rtol=1e-6, atol=1e-6)


def test_dropped_rope_is_caught(dense_outputs, monkeypatch):
    """Negative control for the test above: Cosmos' ``Attention.forward`` passes RoPE as a keyword
    and drops keywords the processor's signature does not name.  A wrapper without the original
    signature therefore loses RoPE, and the output moves far beyond the 1e-6 asserted above."""
    case, dense = _case_and_dense("cosmos", 64, dense_outputs)
    seen = []
    with apply(case.model, backend="sdpa", cross_attention=True, min_seq_len=0) as handle:
        w = handle.processors["transformer_blocks.0.attn1"]
        orig_call = type(w.original).__call__

        def recording(self, attn, *args, **kwargs):
            bound = inspect.signature(orig_call).bind(self, attn, *args, **kwargs)
            seen.append(bound.arguments.get("image_rotary_emb") is not None)
            return orig_call(self, attn, *args, **kwargs)

        monkeypatch.setattr(type(w.original), "__call__", recording)
        case.run()
        assert seen == [True, False]  # self-attention gets RoPE, cross-attention none
        monkeypatch.setattr(type(w), "__call__", lambda self, attn, *args, **kwargs: self._forward(attn, args, kwargs))
        seen.clear()
        out = case.run()
    assert seen == [False, False]
    assert _rel(out[0], dense[0]) > 1e-2


@pytest.mark.parametrize("cls", dp.FAMILY_PROCESSORS, ids=lambda c: c.__name__)
def test_processors_advertise_the_original_signature(cls):
    wrapped = inspect.signature(cls().__call__)
    original = inspect.signature(cls.original_class().__call__)
    assert wrapped == original


@pytest.mark.parametrize("family", ["wan", "cosmos", "mochi", "hunyuan_video"])
def test_policy_dense_is_bit_identical(family, dense_outputs, spy):
    case, dense = _case_and_dense(family, 64, dense_outputs)
    with apply(case.model, backend="reference", self_attention=False, cross_attention=False, min_seq_len=0):
        out = case.run()
    with apply(case.model, backend="reference", layers=["no_such_layer"], min_seq_len=0):
        out2 = case.run()
    with apply(case.model, backend="reference", min_seq_len=10**6):
        out3 = case.run()
    for o in (out, out2, out3):
        assert torch.equal(o[0], dense[0])
    assert not spy.calls


def test_roles_cross_attention_dense_by_default(spy):
    case = build("wan", head_dim=64)
    with apply(case.model, backend="reference", min_seq_len=0):
        case.run()
    # 2 blocks: only the self-attention calls (K length = video tokens) went FP4.
    assert [c[1][1] for c in spy.calls] == [128, 128]
    spy.calls.clear()
    with apply(case.model, backend="reference", min_seq_len=0, self_attention=False, cross_attention=True):
        case.run()
    assert [c[1][1] for c in spy.calls] == [12, 12]


def test_layer_allow_list(spy):
    case = build("wan", head_dim=64)
    with apply(case.model, backend="reference", min_seq_len=0, layers=[1]) as h:
        case.run()
        assert [n for n, p in h.processors.items() if p.enabled] == ["blocks.1.attn1", "blocks.1.attn2"]
    assert len(spy.calls) == 1
    spy.calls.clear()
    with apply(case.model, backend="reference", min_seq_len=0, cross_attention=True, layers=["blocks.0.attn*"]):
        case.run()
    assert len(spy.calls) == 2


def test_min_seq_len_keeps_short_calls_dense(spy):
    case = build("wan", head_dim=64)
    with apply(case.model, backend="reference", cross_attention=True, min_seq_len=64):
        case.run()
    assert [c[1][1] for c in spy.calls] == [128, 128]  # the 12-token text cross-attention stayed dense


def test_hunyuan_mask_becomes_kv_lens_and_refiner_stays_dense(spy):
    case = build("hunyuan_video", head_dim=64, valid_text=8, text_len=12)
    with apply(case.model, backend="reference", min_seq_len=0) as h:
        case.run()
    assert any("token_refiner" in n for n in h.skipped)
    # Joint sequence = 256 video + 12 text tokens; the last 4 text tokens are padding.
    assert spy.calls and all(c[3] is not None and c[3].tolist() == [264] for c in spy.calls)


def test_ltx_additive_cross_mask_becomes_kv_lens(spy):
    case = build("ltx", head_dim=64, text_len=16, valid_text=10)
    with apply(case.model, backend="reference", min_seq_len=0, cross_attention=True):
        case.run()
    cross = [c for c in spy.calls if c[1][1] == 16]
    assert len(cross) == 1 and cross[0][3].tolist() == [10, 16]


def test_mochi_and_cogvideox_direct_sdpa_are_redirected(spy):
    for family, n_calls in (("mochi", 2), ("cogvideox", 1)):
        spy.calls.clear()
        case = build(family, head_dim=64)
        with apply(case.model, backend="reference", min_seq_len=0):
            case.run()
        assert len(spy.calls) == n_calls and all(c[2] == "HND" for c in spy.calls)


def test_set_attn_processor_with_one_instance(spy, dense_outputs):
    case, dense = _case_and_dense("wan", 64, dense_outputs)
    proc = dp.NVFP4WanAttnProcessor(backend="reference", min_seq_len=0)
    saved = case.model.attn_processors
    case.model.set_attn_processor(proc)
    try:
        out = case.run()
    finally:
        case.model.set_attn_processor(saved)
    assert len(spy.calls) == 2  # self-attention only: the role is read per call
    assert 0 < _rel(out[0], dense[0]) < 0.06
    assert torch.equal(case.run()[0], dense[0])


def test_processor_class_mapping():
    from diffusers.models.attention_processor import AttnProcessor
    from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15AttnProcessor2_0
    from diffusers.models.transformers.transformer_ltx2 import LTX2AudioVideoAttnProcessor

    assert dp.processor_class_for(HunyuanVideo15AttnProcessor2_0) is dp.NVFP4HunyuanVideo15AttnProcessor2_0
    assert dp.NVFP4HunyuanVideo15AttnProcessor2_0.role == dp.ROLE_SELF
    generic = dp.processor_class_for(LTX2AudioVideoAttnProcessor)  # any other dispatching processor
    assert generic.route == dp.ROUTE_DISPATCH and generic.original_class is LTX2AudioVideoAttnProcessor
    assert dp.processor_class_for(LTX2AudioVideoAttnProcessor) is generic
    assert inspect.signature(generic().__call__) == inspect.signature(LTX2AudioVideoAttnProcessor().__call__)
    assert dp.processor_class_for(AttnProcessor) is None  # the matmul processor: left alone
    assert dp.processor_class_for(dp.NVFP4WanAttnProcessor) is None


def test_processor_rejects_wrong_original():
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor

    with pytest.raises(TypeError, match="wraps"):
        dp.NVFP4CosmosAttnProcessor2_0(WanAttnProcessor())


def test_apply_twice_raises_and_bad_arguments():
    case = build("wan", head_dim=64)
    with apply(case.model):
        with pytest.raises(ValueError, match="already has an NVFP4 processor"):
            apply(case.model)
    with pytest.raises(ValueError, match="backend"):
        apply(case.model, backend="fp4")
    with pytest.raises(ValueError, match="dense_steps"):
        apply(case.model, dense_steps=(1,))
    with pytest.raises(ValueError, match="min_seq_len"):
        apply(case.model, min_seq_len=-1)
    with pytest.raises(TypeError, match="self_attention"):
        apply(case.model, self_attention="yes")
    with pytest.raises(TypeError, match="pipeline"):
        apply(object())


def test_import_paths():
    from nvfp4_dit.processors import apply as a
    from nvfp4_dit.processors.apply import apply as b

    assert a is b and callable(nvfp4_dit.apply)


# -- steps ---------------------------------------------------------------------------------------

def _tiny_pipeline(case):
    from diffusers import DiffusionPipeline, FlowMatchEulerDiscreteScheduler

    class TinyLoopPipeline(DiffusionPipeline):
        """A minimal denoising loop over a bare transformer (no text encoder, no VAE)."""

        def __init__(self, transformer, scheduler):
            super().__init__()
            self.register_modules(transformer=transformer, scheduler=scheduler)

        @torch.no_grad()
        def __call__(self, inputs, num_inference_steps, callback_on_step_end=None):
            self.scheduler.set_timesteps(num_inference_steps, device=inputs["hidden_states"].device)
            self._num_timesteps = len(self.scheduler.timesteps)
            latents = inputs["hidden_states"]
            for i, t in enumerate(self.scheduler.timesteps):
                noise = self.transformer(**{**inputs, "hidden_states": latents, "timestep": t[None]},
                                         return_dict=False)[0]
                latents = self.scheduler.step(noise, t, latents, return_dict=False)[0]
                if callback_on_step_end is not None:
                    callback_on_step_end(self, i, t, {})
            return latents

        @property
        def num_timesteps(self):
            return self._num_timesteps

    pipe = TinyLoopPipeline(case.model, FlowMatchEulerDiscreteScheduler())
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _fp4_steps(spy, calls_per_step):
    assert len(spy.calls) % calls_per_step == 0
    return len(spy.calls) // calls_per_step


def test_dense_steps_from_pipeline_scheduler(spy):
    case = build("wan", head_dim=64)
    pipe = _tiny_pipeline(case)
    steps_seen = []
    with apply(pipe, backend="reference", min_seq_len=0, dense_steps=(1, 2)) as h:
        orig = h.steps.begin_forward

        def record(t=None, video=None):
            orig(t, video=video)
            steps_seen.append((h.steps.current_step, h.policy.step_is_dense(h.steps.current_step)))

        h.steps.begin_forward = record
        pipe(case.inputs, num_inference_steps=5)
    assert [s for s, _ in steps_seen] == [(i, 5) for i in range(5)]
    assert [d for _, d in steps_seen] == [True, False, False, True, True]
    assert _fp4_steps(spy, 2) == 2  # steps 1 and 2, two self-attention calls each


def test_dense_steps_from_callback(spy):
    """A bare model driven by the pipeline callback: declare step 0, the callback sets the rest."""
    case = build("wan", head_dim=64)
    pipe = _tiny_pipeline(case)
    with apply(case.model, backend="reference", min_seq_len=0, dense_steps=(2, 1)) as h:
        h.set_step(0, 5)
        pipe(case.inputs, num_inference_steps=5, callback_on_step_end=h.callback_on_step_end)
        assert h.steps._explicit is None  # cleared after the last step: the next run starts clean
    assert _fp4_steps(spy, 2) == 2  # steps 2 and 3


def test_dense_steps_explicit_set_step_and_timesteps(spy):
    case = build("wan", head_dim=64)
    with apply(case.model, backend="reference", min_seq_len=0, dense_steps=(1, 1)) as h:
        for i in range(4):
            h.set_step(i, 4)
            case.run()
    assert _fp4_steps(spy, 2) == 2
    spy.calls.clear()
    schedule = [999.0, 750.0, 500.0, 250.0]
    with apply(case.model, backend="reference", min_seq_len=0, dense_steps=(1, 1), timesteps=schedule) as h:
        for t in schedule:
            case.model(**{**case.inputs, "timestep": torch.tensor([t])}, return_dict=False)
        assert h.steps.current_step == (3, 4)
    assert _fp4_steps(spy, 2) == 2


def test_dense_steps_without_step_source_warns():
    case = build("wan", head_dim=64)
    with apply(case.model, backend="sdpa", min_seq_len=0, dense_steps=(1, 1)):
        with pytest.warns(UserWarning, match="step is unknown"):
            case.run()


def test_pipeline_covers_every_transformer(spy):
    from diffusers import DiffusionPipeline, FlowMatchEulerDiscreteScheduler

    class TwoExpertPipeline(DiffusionPipeline):
        """Wan2.2's two experts plus a Cosmos-Transfer-style controlnet (a stand-in model)."""

        def __init__(self, transformer, transformer_2, controlnet, scheduler):
            super().__init__()
            self.register_modules(transformer=transformer, transformer_2=transformer_2, controlnet=controlnet,
                                  scheduler=scheduler)

    a, b, c = build("wan", head_dim=64), build("wan", head_dim=64, seed=1), build("cosmos", head_dim=64)
    pipe = TwoExpertPipeline(a.model, b.model, c.model, FlowMatchEulerDiscreteScheduler())
    with apply(pipe, backend="reference", min_seq_len=0, dense_steps=(0, 0)) as h:
        assert {n.split(".")[0] for n in h.processors} == {"transformer", "transformer_2", "controlnet"}
        for case in (a, b, c):
            case.run()
    assert len(spy.calls) == 5
    assert not any(isinstance(m.processor, dp.NVFP4AttnProcessorBase)
                   for case in (a, b, c) for m in case.model.modules() if hasattr(m, "processor"))


# -- nothing held between calls ------------------------------------------------------------------

def _tensors_reachable(roots, skip_types):
    seen, stack, found = set(), list(roots), []
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (type, skip_types)) or inspect.ismodule(obj):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.append(obj)
            continue
        stack.extend(gc.get_referents(obj))
    return found


def test_no_tensors_held_after_a_step(monkeypatch):
    from diffusers import DiffusionPipeline
    from diffusers.schedulers.scheduling_utils import SchedulerMixin

    case = build("wan", head_dim=64)
    pipe = _tiny_pipeline(case)
    refs = []
    orig = ops.run_fp4

    def tracking(q, k, v, **kw):
        refs.extend(weakref.ref(t) for t in (q, k, v))
        out = orig(q, k, v, **kw)
        refs.append(weakref.ref(out))
        return out

    monkeypatch.setattr(ops, "run_fp4", tracking)
    with apply(pipe, backend="reference", min_seq_len=0, cross_attention=True, dense_steps=(0, 0)) as h:
        latents = pipe(case.inputs, num_inference_steps=2)
        del latents
        gc.collect()
        assert refs and all(r() is None for r in refs), "an attention tensor outlived its step"
        roots = [h.policy, h.steps, *h.processors.values(), routing._STATE]
        held = _tensors_reachable(roots, (torch.nn.Module, DiffusionPipeline, SchedulerMixin))
        assert held == [], [tuple(t.shape) for t in held]


# -- GPU -----------------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("family,head_dim", CASES)
def test_cuda_backend_close_to_dense(family, head_dim):
    case = build(family, head_dim=head_dim, dtype=torch.bfloat16).to("cuda")
    dense = case.run()
    with apply(case.model, backend="cuda", cross_attention=True, min_seq_len=0):
        fp4 = case.run()
    restored = case.run()
    for o, d, r in zip(fp4, dense, restored):
        assert _rel(o, d) < 0.06
        assert torch.equal(r, d)


# -- observers and observe-only --------------------------------------------------------------------

def test_observe_only_is_bit_identical_and_observed(dense_outputs, spy):
    case, dense = _case_and_dense("hunyuan_video", 64, dense_outputs)
    seen = []

    def observer(info, q, k, v, out):
        seen.append((info.layer, info.path, info.reason, tuple(q.shape), info.attn_mask is not None))

    routing.add_observer(observer)
    try:
        with apply(case.model, observe_only=True, cross_attention=True, min_seq_len=0) as h:
            h.set_step(3, 10)
            out = case.run()
    finally:
        routing.remove_observer(observer)
    assert torch.equal(out[0], dense[0]) and not spy.calls
    assert [s[0] for s in seen] == ["transformer_blocks.0.attn", "single_transformer_blocks.0.attn"]
    assert all(s[1] == "exact" and s[2] == "observe only" and s[4] for s in seen)


def test_observer_sees_fp4_calls_with_step(spy):
    case = build("wan", head_dim=64)
    seen = []
    routing.add_observer(lambda info, q, k, v, out: seen.append((info.layer, info.step, info.path, info.backend)))
    try:
        with apply(case.model, backend="reference", min_seq_len=0) as h:
            h.set_step(1, 4)
            case.run()
    finally:
        routing._OBSERVERS.clear()
    # Dense-by-policy calls (cross-attention) are observed too, computed exactly.
    assert seen == [("blocks.0.attn1", (1, 4), "fp4", "reference"), ("blocks.0.attn2", (1, 4), "exact", "sdpa"),
                    ("blocks.1.attn1", (1, 4), "fp4", "reference"), ("blocks.1.attn2", (1, 4), "exact", "sdpa")]


@pytest.mark.cuda
def test_cuda_memory_returns_to_baseline_after_steps():
    """Nothing is cached between steps: device memory after a denoising run (outputs dropped)
    equals the memory before it, with NVFP4 processors installed."""
    case = build("wan", head_dim=128, dtype=torch.bfloat16).to("cuda")
    pipe = _tiny_pipeline(case)
    with apply(pipe, backend="cuda", cross_attention=True, min_seq_len=0):
        # Warm-up with the same step count: kernels, workspaces, and the scheduler's own
        # per-run state (sigmas moved to the device) reach their steady size.
        latents = pipe(case.inputs, num_inference_steps=3)
        del latents
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        latents = pipe(case.inputs, num_inference_steps=3)
        del latents
        gc.collect()
        torch.cuda.synchronize()
        after = torch.cuda.memory_allocated()
    assert after == before, (before, after)


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["cuda_graph", "compile_reduce_overhead"])
def test_a_denoising_step_is_captured_and_replays_bit_equal(mode, monkeypatch):
    """One denoising step of the tiny Wan model under apply(pipe, backend="cuda") is captured in a
    CUDA graph by hand and replays the eager bits, and by torch.compile(mode="reduce-overhead"),
    whose replays are bit-equal: no host sync and nothing host-side on the FP4 path. The self-test
    runs before the capture."""
    from nvfp4_dit import selftest
    from nvfp4_dit.processors.tiny_models.pipeline import build_tiny_pipeline

    pipe = build_tiny_pipeline(dtype=torch.bfloat16).to("cuda")
    model = pipe.transformer
    selftest.verify(head_dims=(64,))
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, 4, 5, 16, 16, device="cuda", generator=gen).to(torch.bfloat16)
    t = torch.full((1,), 500.0, device="cuda")
    with torch.no_grad():
        cond = pipe.text_encoder(["a red fox"]).to(torch.bfloat16)
    fp4 = []
    real = ops.run_fp4
    monkeypatch.setattr(ops, "run_fp4", lambda *a, **kw: fp4.append(kw["backend"]) or real(*a, **kw))
    with apply(pipe, backend="cuda", min_seq_len=256) as handle, torch.no_grad():
        handle.set_step(2, 4)   # a middle step: FP4 by the policy

        def step():
            return model(hidden_states=x, timestep=t, encoder_hidden_states=cond, return_dict=False)[0]

        eager = step()
        assert fp4 == ["cuda", "cuda"]   # both self-attention layers; cross-attention stays exact
        if mode == "cuda_graph":
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    step()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static = step()
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(static, eager)
        else:
            # Inductor fuses the model's own bf16 ops (norms, modulation) and rounds them differently
            # from eager, so the compiled step matches eager to bf16 noise; its CUDA-graph replays
            # (the third call on) reproduce each other bit for bit.
            compiled = torch.compile(step, mode="reduce-overhead")
            outs = [compiled().clone() for _ in range(4)]
            torch.cuda.synchronize()
            assert torch.equal(outs[2], outs[3]) and torch.equal(outs[1], outs[3])
            cos = torch.nn.functional.cosine_similarity(outs[3].double().flatten(), eager.double().flatten(), dim=0)
            assert cos >= 0.9999, cos


def test_keep_mass_reaches_the_op_outside_the_sparse_off_steps(monkeypatch):
    """apply(keep_mass=...) runs block-sparse NVFP4 (the estimate in each call) on the steps and
    lengths the policy allows, dense NVFP4 on the others."""
    case = build("wan", head_dim=64)
    seen = []
    real = ops.run_fp4

    def recording(q, k, v, **kw):
        seen.append(kw.get("sparsity"))
        return real(q, k, v, **kw)

    monkeypatch.setattr(ops, "run_fp4", recording)
    with apply(case.model, backend="reference", min_seq_len=0, dense_steps=(0, 0), keep_mass=0.9,
               sparse_off_steps=(1, 0), sparse_min_seq_len=0) as handle, torch.no_grad():
        handle.set_step(0, 4)
        first = case.run()
        on_first = list(seen)
        seen.clear()
        handle.set_step(2, 4)
        middle = case.run()
    assert on_first and all(s is None for s in on_first)
    assert seen and all(s is not None and s.keep_mass == 0.9 for s in seen)
    assert all(torch.isfinite(t).all() for t in (*first, *middle))


@pytest.mark.parametrize("family, grid, position", [
    ("cosmos", (2, 8, 8), "first"), ("wan", (2, 8, 8), "first"), ("wan_i2v", (2, 8, 8), "first"),
    ("hunyuan_video", (1, 16, 16), "first"), ("ltx", (2, 8, 8), "first"), ("cogvideox", (2, 8, 8), "last"),
    ("mochi", (2, 8, 8), "first"), ("minimax_h3", None, None)])
def test_each_forward_learns_its_video_tokens(family, grid, position):
    """The grid each tiny model's latent input and patch size give (frames x size x size latents,
    spatial patch 2 but HunyuanVideo's 1), read in the forward's pre-hook."""
    case = build(family, head_dim=64)
    with apply(case.model, backend="reference", keep_mass=0.9) as handle, torch.no_grad():
        case.run()
        video = handle.steps.current_video
    if grid is None:
        assert video is None
    else:
        assert (video.grid, video.position) == (grid, position)
    other = build("wan", head_dim=64, frames=3, size=12)   # recomputed in every forward
    with apply(other.model, backend="reference", keep_mass=0.9) as handle, torch.no_grad():
        other.run()
        assert handle.steps.current_video.grid == (3, 6, 6)
    dense = build("wan", head_dim=64)
    with apply(dense.model, backend="reference") as handle, torch.no_grad():
        dense.run()
        assert handle.steps.current_video is None   # a dense policy does not read them


@pytest.mark.parametrize("family, video_count, first", [("hunyuan_video", 256, True), ("cogvideox", 128, False),
                                                       ("mochi", 128, True), ("wan", 128, True)])
def test_a_sparse_joint_call_always_keeps_the_text(family, video_count, first, monkeypatch):
    """A block-sparse call's estimate keeps every key that is not video: the prompt of a joint
    attention (HunyuanVideo and Mochi after the video, CogVideoX before it); video-only calls keep
    none by rule."""
    case = build(family, head_dim=64)
    seen, orders = [], []
    real = ops.run_fp4

    def recording(q, k, v, **kw):
        seen.append((fmt.hnd_shape(k, kw["layout"])[2], kw.get("sparsity")))
        orders.append((fmt.hnd_shape(k, kw["layout"])[2], kw.get("order")))
        return real(q, k, v, **kw)

    monkeypatch.setattr(ops, "run_fp4", recording)
    with apply(case.model, backend="reference", min_seq_len=0, dense_steps=(0, 0), keep_mass=0.9,
               sparse_off_steps=(0, 0), sparse_min_seq_len=0), torch.no_grad():
        case.run()
    video_calls = [(sk, s) for sk, s in seen if sk >= video_count]
    assert video_calls and all(s is not None and s.keep_mass == 0.9 for _, s in video_calls)
    for sk, s in video_calls:
        text = None if sk == video_count else ((video_count, sk) if first else (0, sk - video_count))
        assert s.always_keep == text, (sk, s)
    assert (family == "wan") == all(sk == video_count for sk, _ in video_calls)
    # ... and runs its video tokens in 3D tiles (self-attention only; cross-attention keys are text)
    for sk, order in orders:
        if sk >= video_count:
            assert order is not None and math.prod(order.grid) == video_count, (sk, order)
            assert order.span == ((0, video_count) if first else (sk - video_count, sk))
        else:
            assert order is None


def test_a_layers_calibrated_keep_mass_reaches_the_op(monkeypatch):
    """A calibrated policy runs each layer at its own keep_mass (1.0: dense), others at the policy's."""
    from nvfp4_dit.policy import FP4_PRECISIONS, AttentionPolicy, LayerPrecision

    case = build("wan", head_dim=64)
    layers = sorted(n for n, m in case.model.named_modules() if n.endswith("attn1"))
    nv = FP4_PRECISIONS[0]
    entries = (LayerPrecision(layers[0], "middle", nv, keep_mass=0.8), LayerPrecision(layers[1], "middle", nv, keep_mass=1.0))
    policy = AttentionPolicy(backend="reference", min_seq_len=0, dense_steps=(0, 0), keep_mass=0.9,
                             sparse_off_steps=(0, 0), sparse_min_seq_len=0, per_layer=entries,
                             model_class=type(case.model).__name__)
    seen = []
    real = ops.run_fp4

    def recording(q, k, v, **kw):
        seen.append((routing._STATE.layer, kw.get("sparsity")))
        return real(q, k, v, **kw)

    monkeypatch.setattr(ops, "run_fp4", recording)
    with apply(case.model, policy=policy) as handle, torch.no_grad():
        handle.set_step(2, 4)
        case.run()
    by_layer = {layer: s for layer, s in seen}
    assert by_layer[layers[0]].keep_mass == 0.8 and by_layer[layers[1]] is None
