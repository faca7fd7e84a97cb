"""Determinism and concurrency: identical bits run to run, and concurrent calls (two
CUDA streams, or two Python threads) give the same bits as the same calls run one after another.

The CUDA kernel has no atomics in its math (persistent CTAs write disjoint rows; the quantiser's
K-mean adds its chunk sums in a fixed order), so bitwise equality is the requirement, not a
tolerance.  Every test is parametrized over a device: on CPU the same code runs with the
reference back-end (streams become no-ops), which checks the test logic itself.
"""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

import nvfp4_dit

CASES = {
    # name: (B, Sq, Sk, H, Hkv, D, dtype, layout, causal, kv_lens)
    "plain": (1, 1024, 1024, 8, 8, 128, torch.bfloat16, "NHD", False, None),
    "gqa_causal_kv_lens": (2, 777, 777, 6, 2, 64, torch.float16, "HND", True, [777, 300]),
    "cross_odd_d": (3, 300, 77, 4, 4, 72, torch.float32, "NHD", False, [77, 1, 0]),
}


def _devices():
    cuda = pytest.param("cuda", marks=pytest.mark.cuda)
    return ["cpu", cuda]


def _backend(device: str) -> str:
    return "cuda" if device == "cuda" else "reference"


def _skip_without(device: str):
    if device == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA GPU")
        if "cuda" not in nvfp4_dit.available_backends(torch.device("cuda")):
            pytest.fail("the CUDA back-end does not load on this GPU")


def make_inputs(name: str, device: str, scale_down: bool = False):
    b, sq, sk, h, hkv, d, dtype, layout, causal, lens = CASES[name]
    if scale_down and device == "cpu":  # keep the CPU smoke runs fast
        sq, sk = min(sq, 300), min(sk, 300)
        lens = None if lens is None else [min(n, sk) for n in lens]
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    shq, shk = ((b, sq, h, d), (b, sk, hkv, d)) if layout == "NHD" else ((b, h, sq, d), (b, hkv, sk, d))
    q, k, v = (torch.randn(s, generator=g).to(device, dtype) for s in (shq, shk, shk))
    kwargs = dict(layout=layout, causal=causal, return_lse=True, backend=_backend(device))
    if lens is not None:
        kwargs["kv_lens"] = torch.tensor(lens, device=device)
    return (q, k, v), kwargs


def _run(inputs, kwargs):
    return nvfp4_dit.attention(*inputs, **kwargs)


def _equal(a, b):
    return torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("name", sorted(CASES))
def test_run_to_run_bitwise(device, name):
    _skip_without(device)
    inputs, kwargs = make_inputs(name, device, scale_down=True)
    first = _run(inputs, kwargs)
    for _ in range(4 if device == "cuda" else 1):
        # Fresh copies of the inputs at other addresses, too: nothing may depend on the pointer.
        again = _run(tuple(t.clone() for t in inputs), kwargs)
        assert _equal(first, again)


def _streams(device: str):
    if device == "cuda":
        return torch.cuda.Stream(), torch.cuda.Stream()
    return None, None


def _on(stream):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


@pytest.mark.parametrize("device", _devices())
def test_two_streams_equal_serial(device):
    _skip_without(device)
    a_in, a_kw = make_inputs("plain", device, scale_down=True)
    b_in, b_kw = make_inputs("gqa_causal_kv_lens", device, scale_down=True)
    serial_a, serial_b = _run(a_in, a_kw), _run(b_in, b_kw)
    s1, s2 = _streams(device)
    if device == "cuda":
        torch.cuda.synchronize()
        s1.wait_stream(torch.cuda.current_stream())
        s2.wait_stream(torch.cuda.current_stream())
    results = []
    for _ in range(3 if device == "cuda" else 1):
        # Interleave the launches so the two streams' kernels overlap on the device.
        with _on(s1):
            ra = _run(a_in, a_kw)
        with _on(s2):
            rb = _run(b_in, b_kw)
        with _on(s1):
            ra2 = _run(a_in, a_kw)
        results.append((ra, rb, ra2))
    if device == "cuda":
        torch.cuda.synchronize()
    for ra, rb, ra2 in results:
        assert _equal(ra, serial_a) and _equal(ra2, serial_a) and _equal(rb, serial_b)


@pytest.mark.parametrize("device", _devices())
def test_two_threads_equal_serial(device):
    _skip_without(device)
    names = ["plain", "cross_odd_d"]
    inputs = {n: make_inputs(n, device, scale_down=True) for n in names}
    serial = {n: _run(*inputs[n]) for n in names}
    if device == "cuda":
        torch.cuda.synchronize()  # inputs and serial results complete before the threads start
    got, errors = {}, []
    barrier = threading.Barrier(len(names))

    def worker(n):
        try:
            stream = torch.cuda.Stream() if device == "cuda" else None
            if stream is not None:
                stream.wait_stream(torch.cuda.default_stream())
            barrier.wait()
            with _on(stream):
                res = [_run(*inputs[n]) for _ in range(2)]
            if stream is not None:
                stream.synchronize()
            got[n] = res
        except BaseException as e:  # reported below, not lost in the thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(n,)) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not errors, errors
    for n in names:
        assert all(_equal(r, serial[n]) for r in got[n])


def test_sdpa_and_auto_fallback_are_deterministic_on_cpu():
    inputs, kwargs = make_inputs("gqa_causal_kv_lens", "cpu", scale_down=True)
    for backend in ("sdpa", "auto"):
        kw = {**kwargs, "backend": backend}
        with pytest.warns() if backend == "auto" else contextlib.nullcontext():
            a = _run(inputs, kw)
        assert _equal(a, _run(inputs, kw))
