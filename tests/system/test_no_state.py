"""No state across calls: the op, the CUDA back-end, the diffusers backend and
processors and the ComfyUI override keep no tensors between calls, and a long loop of calls
keeps memory flat.

The one exception, by design: the verdict of the CUDA kernel's first-use self-test
(``nvfp4_dit.selftest._verdicts``, one small record per GPU and head dim, no tensors). The GPU
test below shows the first call adds exactly that and a loop of further calls changes no
module-level state at all.

CPU: weak references to every input and output die once the caller drops them; the number of
live ``torch.Tensor`` objects (``gc``) is the same after 1 and after N more calls; Python heap
growth (``tracemalloc``) over N calls is bounded by a few KiB (warning bookkeeping, interned
strings), not by N.  GPU (``cuda`` marker): ``torch.cuda.memory_allocated()`` is exactly the same
after every call of a loop once the caller has dropped the results.
"""

from __future__ import annotations

import gc
import inspect
import sys
import tracemalloc
import warnings
import weakref

import pytest
import torch

import nvfp4_dit

N_LOOP = 25


def _live_tensors() -> int:
    gc.collect()
    with warnings.catch_warnings():  # isinstance() on lazy torch.distributed objects warns
        warnings.simplefilter("ignore", FutureWarning)
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


def _reaches_tensor(root, skip) -> bool:
    """Whether a tensor is reachable from ``root`` through gc referents, not entering objects
    for which ``skip(obj)`` is true."""
    seen, stack = set(), [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or skip(obj):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            return True
        stack.extend(gc.get_referents(obj))
    return False


def _code_object(obj) -> bool:
    return inspect.ismodule(obj) or isinstance(obj, type) or inspect.isfunction(obj)


def _tensors_in_module_state() -> list[str]:
    """Names of module-level objects of nvfp4_dit.* that hold a tensor, however deep."""
    found = []
    for name, mod in list(sys.modules.items()):
        if not name.startswith("nvfp4_dit") or mod is None:
            continue
        for attr, value in vars(mod).items():
            if _code_object(value) or attr.startswith("__"):
                continue
            if _reaches_tensor(value, _code_object):
                found.append(f"{name}.{attr}")
    return found


# Module-level constants that are tensors by design (lookup tables), not per-call state.
_ALLOWED_CONSTANTS = {"nvfp4_dit.format._E2M1_TABLE"}

# Per-process records that a first call may add: the self-test verdict (the FP4 path's one piece
# of state) and the back-end it resolves, the loaded kernels (and the device attributes their
# launches read), and the once-per-reason warning bookkeeping.
_FIRST_CALL_STATE = {"nvfp4_dit.selftest._verdicts", "nvfp4_dit.cuda.build._libraries", "nvfp4_dit.cuda.build._load_failures",
                     "nvfp4_dit.cuda.build._capabilities", "nvfp4_dit.planner._resolved",
                     "nvfp4_dit.cuda.launch._device_kernels",
                     "nvfp4_dit.cuda.driver._device_attributes", "nvfp4_dit.fallback._reported"}


def _module_state() -> dict[str, str]:
    """repr of every module-level data object of nvfp4_dit.* (not modules, classes, functions)."""
    state = {}
    for name, mod in list(sys.modules.items()):
        if not name.startswith("nvfp4_dit") or mod is None:
            continue
        for attr, value in vars(mod).items():
            if _code_object(value) or attr.startswith("__") or isinstance(value, (type(sys), type(_inputs))):
                continue
            try:
                state[f"{name}.{attr}"] = repr(value)
            except Exception:  # noqa: BLE001 - objects without a usable repr are compared by identity
                state[f"{name}.{attr}"] = f"<id {id(value)}>"
    return state


def _changed(before: dict[str, str], after: dict[str, str]) -> set[str]:
    return {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)}


def _inputs(seed=0, b=1, s=300, h=2, d=64, device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, s, h, d, generator=g).to(device, dtype) for _ in range(3))


def _assert_flat(call, n=N_LOOP, python_heap_slack=64 << 10):
    """Run ``call`` once (warm-up), then n times: no new live tensors, bounded Python heap."""
    call()
    before = _live_tensors()
    tracemalloc.start()
    start = tracemalloc.take_snapshot()
    for _ in range(n):
        call()
    gc.collect()
    growth = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(start, "filename"))
    tracemalloc.stop()
    assert _live_tensors() == before, "tensors accumulate across calls"
    assert growth <= python_heap_slack, f"Python heap grew by {growth} bytes over {n} calls"


# ---------------------------------------------------------------------------------------------
# The op
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["reference", "sdpa", "auto"])
def test_op_drops_inputs_and_outputs(backend):
    q, k, v = _inputs()
    lens = torch.tensor([200])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out, lse = nvfp4_dit.attention(q, k, v, kv_lens=lens, backend=backend, return_lse=True)
    refs = [weakref.ref(t) for t in (q, k, v, lens, out, lse)]
    del q, k, v, lens, out, lse
    gc.collect()
    assert all(r() is None for r in refs), "the op keeps a reference to a tensor of the call"
    assert set(_tensors_in_module_state()) <= _ALLOWED_CONSTANTS


@pytest.mark.parametrize("backend", ["reference", "sdpa"])
def test_op_loop_is_flat(backend):
    q, k, v = _inputs(s=200)
    _assert_flat(lambda: nvfp4_dit.attention(q, k, v, causal=True, backend=backend, return_lse=True))


def test_op_loop_changes_no_module_state():
    q, k, v = _inputs(s=200)
    nvfp4_dit.attention(q, k, v, backend="reference")
    before = _module_state()
    for _ in range(5):
        nvfp4_dit.attention(q, k, v, backend="reference", causal=True)
        nvfp4_dit.attention(q, k, v, backend="sdpa", return_lse=True)
    assert _changed(before, _module_state()) == set()


def test_op_fallback_warnings_do_not_grow_with_calls():
    q, k, v = _inputs(s=64)
    mask = torch.rand(1, 1, 64, 64, generator=torch.Generator().manual_seed(0)) > 0.5
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _assert_flat(lambda: nvfp4_dit.attention(q, k, v, attn_mask=mask))
    from nvfp4_dit import fallback

    assert len(fallback._reported) <= 2  # one per reason, not one per call


# ---------------------------------------------------------------------------------------------
# diffusers: the registered backend and the processors in a denoising loop
# ---------------------------------------------------------------------------------------------

def test_diffusers_backend_loop_is_flat():
    pytest.importorskip("diffusers")
    from diffusers.models import attention_dispatch as dispatch

    from nvfp4_dit.processors import backend, routing

    q, k, v = _inputs(s=300)
    prev = routing.configure_default(backend="reference")
    try:
        member = backend.backend_member()
        _assert_flat(lambda: dispatch.dispatch_attention_fn(q, k, v, backend=member), n=10)
        out = dispatch.dispatch_attention_fn(q, k, v, backend=member)
    finally:
        routing.configure_default(backend=prev.backend)
    refs = [weakref.ref(t) for t in (q, k, v, out)]
    del q, k, v, out
    gc.collect()
    assert all(r() is None for r in refs)


def _processor_state_tensors(handle) -> list[str]:
    bad = []
    for name, proc in handle.processors.items():
        for attr, value in vars(proc).items():
            if attr in ("original", "_fp4"):  # the wrapped diffusers processors: checked below
                value = vars(value)
            if _reaches_tensor(value, lambda o: isinstance(o, (type, torch.nn.Module)) or inspect.ismodule(o)):
                bad.append(f"{name}.{attr}")
    return bad


def test_processors_denoising_loop_is_flat_and_stateless():
    pytest.importorskip("diffusers")
    from nvfp4_dit.processors.tiny_models.diffusers_families import build

    case = build("wan", head_dim=64)
    steps = 12
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nvfp4_dit.apply(case.model, backend="reference", min_seq_len=0, dense_steps=(1, 1)) as handle:
            state = {"i": 0}

            def step():
                handle.set_step(state["i"] % steps, steps)
                state["i"] += 1
                with torch.no_grad():
                    case.model(**case.inputs, return_dict=False)

            _assert_flat(step, n=steps)
            assert _processor_state_tensors(handle) == []
            assert not any(isinstance(v, torch.Tensor) for v in vars(handle.policy).values())
    assert set(_tensors_in_module_state()) <= _ALLOWED_CONSTANTS


# ---------------------------------------------------------------------------------------------
# ComfyUI override
# ---------------------------------------------------------------------------------------------

def test_comfyui_override_loop_is_flat_and_stateless():
    from nvfp4_dit.comfyui_node.attention_override import NVFP4AttentionOverride
    from nvfp4_dit.policy import AttentionPolicy

    override = NVFP4AttentionOverride(AttentionPolicy(backend="reference", min_seq_len=0))
    q, k, v = (t.flatten(2) for t in _inputs(s=256))
    mask = torch.zeros(1, 1, 256)
    mask[..., 200:] = -torch.inf
    func = lambda *a, **kw: pytest.fail("the call should not be declined")  # noqa: E731
    options = {"sample_sigmas": torch.linspace(1, 0, 11), "sigmas": torch.tensor([0.5])}
    _assert_flat(lambda: override(func, q, k, v, 2, mask=mask, transformer_options=options))
    out = override(func, q, k, v, 2, mask=mask, transformer_options=options)
    refs = [weakref.ref(t) for t in (q, k, v, mask, out, options["sigmas"])]
    del q, k, v, mask, out, options
    gc.collect()
    assert all(r() is None for r in refs)
    assert not any(isinstance(x, torch.Tensor) for x in gc.get_referents(override))
    assert set(_tensors_in_module_state()) <= _ALLOWED_CONSTANTS


# ---------------------------------------------------------------------------------------------
# GPU: device memory stays flat
# ---------------------------------------------------------------------------------------------


def _assert_device_memory_flat(call, n=30):
    """``call`` n times: allocated device memory after each equals that after the first.

    Garbage left by earlier tests is collected first (a cycle freed mid-loop reads as a change),
    and the cyclic collector is off during the loop, so a reference cycle made by ``call``
    itself (tensors freed only by a later gc pass) shows up as growth."""
    call()
    torch.cuda.synchronize()
    gc.collect()
    before = torch.cuda.memory_allocated()
    gc.disable()
    try:
        for i in range(n):
            call()
            torch.cuda.synchronize()
            assert torch.cuda.memory_allocated() == before, f"device memory changed at call {i}"
    finally:
        gc.enable()


@pytest.mark.cuda
@pytest.mark.parametrize("kv_lens", [None, [3000, 1234]])
def test_cuda_backend_device_memory_is_flat(cuda_device, kv_lens):
    q, k, v = _inputs(b=2, s=3000, h=8, d=128, device="cuda", dtype=torch.bfloat16)
    lens = None if kv_lens is None else torch.tensor(kv_lens, device="cuda")
    _assert_device_memory_flat(lambda: nvfp4_dit.attention(q, k, v, kv_lens=lens, causal=True, backend="cuda",
                                                           return_lse=True))
    out = nvfp4_dit.attention(q, k, v, backend="cuda")
    refs = [weakref.ref(t) for t in (q, k, v, out)]
    del q, k, v, out
    gc.collect()
    assert all(r() is None for r in refs)
    assert set(_tensors_in_module_state()) <= _ALLOWED_CONSTANTS


@pytest.mark.cuda
def test_cuda_path_keeps_only_the_selftest_verdict(cuda_device):
    from nvfp4_dit import selftest

    q, k, v = _inputs(s=1000, h=4, d=64, device="cuda", dtype=torch.bfloat16)
    selftest.reset()
    before = _module_state()
    nvfp4_dit.attention(q, k, v, backend="cuda")
    first = _module_state()
    assert _changed(before, first) <= _FIRST_CALL_STATE
    assert "nvfp4_dit.selftest._verdicts" in _changed(before, first)
    assert len(selftest.verdicts()) == 1
    for _ in range(N_LOOP):
        nvfp4_dit.attention(q, k, v, backend="cuda", causal=True)
    assert _changed(first, _module_state()) == set(), "module-level state changed across calls"
    assert set(_tensors_in_module_state()) <= _ALLOWED_CONSTANTS


@pytest.mark.cuda
def test_cuda_override_and_processors_device_memory_is_flat(cuda_device):
    from nvfp4_dit.comfyui_node.attention_override import NVFP4AttentionOverride
    from nvfp4_dit.policy import AttentionPolicy

    override = NVFP4AttentionOverride(AttentionPolicy(backend="cuda", min_seq_len=0))
    q, k, v = (t.flatten(2) for t in _inputs(s=2048, h=4, d=128, device="cuda", dtype=torch.float16))
    _assert_device_memory_flat(lambda: override(lambda *a, **kw: pytest.fail("declined"), q, k, v, 4))

    pytest.importorskip("diffusers")
    from nvfp4_dit.processors.tiny_models.diffusers_families import build

    case = build("wan", head_dim=64)
    case.model.to("cuda", torch.bfloat16)
    inputs = {n: (t.to("cuda", torch.bfloat16) if isinstance(t, torch.Tensor) and t.is_floating_point() else
                  t.to("cuda") if isinstance(t, torch.Tensor) else t) for n, t in case.inputs.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nvfp4_dit.apply(case.model, backend="cuda", min_seq_len=0):
            def forward():
                with torch.no_grad():
                    case.model(**inputs, return_dict=False)
            _assert_device_memory_flat(forward, n=10)


def test_the_checks_catch_a_cache(monkeypatch):
    """A back-end that keeps its last output (the bug class) fails both checks."""
    from nvfp4_dit import ops

    real = ops._attention_sdpa
    monkeypatch.setattr(ops, "_leak", [], raising=False)

    def caching(*args):
        res = real(*args)
        ops._leak.append(res[0])
        return res

    monkeypatch.setattr(ops, "_attention_sdpa", caching)
    q, k, v = _inputs(s=64)
    with pytest.raises(AssertionError, match="accumulate"):
        _assert_flat(lambda: nvfp4_dit.attention(q, k, v, backend="sdpa"), n=3)
    assert "nvfp4_dit.ops._leak" in _tensors_in_module_state()


def test_module_state_check_sees_a_new_record(monkeypatch):
    from nvfp4_dit import ops

    before = _module_state()
    monkeypatch.setattr(ops, "_last_call", {"shape": (1, 2)}, raising=False)
    assert _changed(before, _module_state()) == {"nvfp4_dit.ops._last_call"}
