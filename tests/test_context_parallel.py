"""diffusers context parallelism (Ulysses and ring) through the NVFP4 processors and backend.

Two ranks run the tiny Wan and MiniMax-H3 transformers with the model's own ``_cp_plan``: on
CPU in two processes with the gloo backend and the reference FP4 numerics, and (marked ``cuda``,
skipped without two GPUs) on two GPUs with NCCL and the CUDA kernel.  Each rank's output is
compared with the single-process output of the same model, numerics and policy.

* Ulysses gives every rank the whole sequence for half the heads, and FP4 quantisation is per
  head: Wan on CPU is bit for bit; MiniMax-H3's sharded projections round differently in the
  last bit (its Ulysses run with exact attention shows the same difference), and GPU GEMMs may
  pick other kernels for a sharded sequence, so those get fp32 round-off.
* Ring attends each query shard to one K/V shard at a time, and each shard is quantised with
  its own statistics (K and V means, tensor scales, channel balance): the output differs from
  the single-process FP4 one by about the FP4 error itself, so the test bounds its error against
  exact attention by the single-process FP4 error (x1.5), and checks the LSE merge exactly with
  the exact back-end, where ring must give the single-process output up to fp32 round-off.

``min_seq_len`` is lowered to 64 so the sharded calls (160 tokens per rank and shard) run FP4.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

pytest.importorskip("diffusers")

import torch.multiprocessing as mp  # noqa: E402

import nvfp4_dit  # noqa: E402
from nvfp4_dit.processors import enable_context_parallel, routing  # noqa: E402
from nvfp4_dit.processors.tiny_models.diffusers_families import build  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

WORLD = 2
MIN_SEQ_LEN = 64
SIZES = {"wan": dict(frames=5), "minimax_h3": dict(video_len=288)}
SELF_ATTENTION_TOKENS = {"wan": 320, "minimax_h3": 312}
# (family, mode, FP4 back-end, order): "apply" = nvfp4.apply() before enable_context_parallel.
CONFIGS = [
    ("wan", "ulysses", "reference", "apply"),
    ("wan", "ring", "reference", "apply"),
    ("wan", "ring", "sdpa", "cp"),
    ("minimax_h3", "ulysses", "reference", "cp"),
    ("minimax_h3", "ulysses", "sdpa", "apply"),
    ("minimax_h3", "ring", "reference", "apply"),
    ("wan", "ulysses", "reference", "sparse"),
    ("wan", "ring", "reference", "sparse"),
]
# "sparse": apply(keep_mass=0.9) before enable_context_parallel: Ulysses calls run block-sparse, ring
# calls (one K/V shard each) dense.
SPARSE = dict(keep_mass=0.9, sparse_off_steps=(0, 0), sparse_min_seq_len=0)


def _run_single(family, backend, device="cpu", **policy):
    case = build(family, **SIZES[family]).to(device)
    with nvfp4_dit.apply(case.model, backend=backend, min_seq_len=MIN_SEQ_LEN, dense_steps=None, **policy):
        return [t.cpu() for t in case.run()]


def _run_rank(family, mode, backend, order, device):
    case = build(family, **SIZES[family]).to(device)
    calls = []

    def observe(info, q, k, v, out):
        calls.append((info.path, int(q.shape[1]), int(k.shape[1]), int(q.shape[2]), info.sparsity is not None))  # NHD

    if order == "cp":
        enable_context_parallel(case.model, mode)
    handle = nvfp4_dit.apply(case.model, backend=backend, min_seq_len=MIN_SEQ_LEN, dense_steps=None,
                             **(SPARSE if order == "sparse" else {}))
    if order in ("apply", "sparse"):
        enable_context_parallel(case.model, mode)
    routing.add_observer(observe)
    try:
        out = [t.cpu() for t in case.run()]
    finally:
        routing.remove_observer(observe)
        handle.restore()
    return {"outputs": out, "calls": calls}


def _worker(rank, world, tmp, configs, device_type):
    dist_backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    torch.distributed.init_process_group(dist_backend, init_method=f"file://{tmp}/rendezvous", rank=rank,
                                         world_size=world)
    try:
        device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
        results = {cfg: _run_rank(*cfg, device) for cfg in configs}
        torch.save(results, os.path.join(tmp, f"rank{rank}.pt"))
    finally:
        torch.distributed.destroy_process_group()


def _spawn(configs, device_type):
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(WORLD, tmp, configs, device_type), nprocs=WORLD, join=True)
        return [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(WORLD)]


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _check(ranks, cfg, single, exact, bitwise_ulysses, tol=1e-5):
    family, mode, backend, order = cfg
    seq = SELF_ATTENTION_TOKENS[family]
    for rank, res in enumerate(ranks):
        got = res[cfg]
        fp4 = [c for c in got["calls"] if c[0] == "fp4"]
        if backend != "sdpa":
            assert fp4, f"rank {rank}: no call took the FP4 path"
            # Ulysses: the whole sequence, half the heads; ring: this rank's shard against one K/V shard.
            if mode == "ulysses":
                assert all(c[1] == c[2] == seq and c[3] == 1 for c in fp4), got["calls"]
            else:
                assert all(c[1] == c[2] == seq // WORLD for c in fp4), got["calls"]
            # Block-sparse under Ulysses (the whole sequence), dense on ring shards.
            assert all(c[4] == (order == "sparse" and mode == "ulysses") for c in fp4), got["calls"]
        for out, ref, ex in zip(got["outputs"], single, exact):
            assert out.shape == ref.shape
            if backend == "sdpa" or (mode == "ulysses" and not bitwise_ulysses):
                torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
            elif mode == "ulysses":
                assert torch.equal(out, ref), f"rank {rank}: Ulysses is not bit for bit ({(out - ref).abs().max()})"
            else:
                assert _rel(out, ex) <= 1.5 * _rel(ref, ex), (rank, _rel(out, ex), _rel(ref, ex))
                assert _rel(out, ref) < 0.05
    for a, b in zip(ranks[0][cfg]["outputs"], ranks[1][cfg]["outputs"]):
        assert torch.equal(a, b), "the ranks disagree"


@pytest.fixture(scope="module")
def cpu_ranks():
    return _spawn(CONFIGS, "cpu")


def _single_policy(cfg) -> dict:
    """The one-process policy a config compares with: a sparse config's is block-sparse under
    Ulysses, dense as the ring runs it."""
    _, mode, _, order = cfg
    return SPARSE if order == "sparse" and mode == "ulysses" else {}


@pytest.mark.parametrize("cfg", CONFIGS, ids=["-".join(c) for c in CONFIGS])
def test_context_parallel_on_cpu_matches_one_process(cpu_ranks, cfg):
    family, _, backend, _ = cfg
    single = _run_single(family, backend, **_single_policy(cfg))
    exact = _run_single(family, "sdpa")
    _check(cpu_ranks, cfg, single, exact, bitwise_ulysses=family == "wan")


@pytest.mark.cuda
def test_context_parallel_on_two_gpus_matches_one_gpu():
    if torch.cuda.device_count() < WORLD:
        pytest.skip(f"needs {WORLD} GPUs")
    configs = [(f, m, "cuda" if b == "reference" else b, o) for f, m, b, o in CONFIGS]
    ranks = _spawn(configs, "cuda")
    for cfg in configs:
        family, _, backend, _ = cfg
        # GEMMs of a sharded sequence may pick other kernels on a GPU: no bitwise claim there.
        _check(ranks, cfg, _run_single(family, backend, "cuda", **_single_policy(cfg)), _run_single(family, "sdpa", "cuda"),
               bitwise_ulysses=False, tol=1e-4)


def test_enable_context_parallel_errors():
    model = build("wan", **SIZES["wan"]).model
    with pytest.raises(RuntimeError, match="init_process_group"):
        enable_context_parallel(model, "ulysses")
    with pytest.raises(ValueError, match="mode must be one of"):
        enable_context_parallel(model, "tensor")
    with pytest.raises(TypeError, match="model must be"):
        enable_context_parallel("wan", "ring")
