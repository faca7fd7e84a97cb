"""Block-sparse attention on the GPU: the kernel's block map against the reference's, the list
kernels against their PyTorch twin, the estimate from the quantiser's statistics, and a sparse call
without host syncs."""

import math

import pytest
import torch
import torch.nn.functional as F

import nvfp4_dit
from nvfp4_dit import format as fmt
from nvfp4_dit import preprocess, sparse
from nvfp4_dit.cuda import attention as attention_cuda
from nvfp4_dit.cuda import quantize as cuda_quantize
from nvfp4_dit.reference import attention_exact, attention_reference


def _cos(a, b):
    return F.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


def _qkv(b, sq, h, d, sk=None, hkv=None, seed=0, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    sk = sq if sk is None else sk
    hkv = hkv or h
    return (torch.randn(b, sq, h, d, generator=g, device="cuda").to(dtype),
            torch.randn(b, sk, hkv, d, generator=g, device="cuda").to(dtype),
            torch.randn(b, sk, hkv, d, generator=g, device="cuda").to(dtype))


def _random_map(b, h, nq, nk, density, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    bmap = torch.rand(b, h, nq, nk, generator=g, device="cuda") < density
    bmap[0, 0, 1] = False                  # an empty Q block
    bmap[-1, -1, 0] = False
    bmap[-1, -1, 0, 0] = True              # a single tile
    return bmap


def _structured(s, h, d, seed=0, noise=0.5):
    """Q and K whose 128-token blocks share a direction: block i attends mostly tile i."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    dirs = F.normalize(torch.randn(h, -(-s // 128), d, generator=g, device="cuda"), dim=-1) * 8.0
    base = dirs.repeat_interleave(128, dim=1)[:, :s].transpose(0, 1)[None]
    q = base + noise * torch.randn(1, s, h, d, generator=g, device="cuda")
    k = base + noise * torch.randn(1, s, h, d, generator=g, device="cuda")
    v = torch.randn(1, s, h, d, generator=g, device="cuda")
    return q.bfloat16(), k.bfloat16(), v.bfloat16()


@pytest.mark.cuda
@pytest.mark.parametrize("qk_format", ["nvfp4", "mxfp8"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_random_maps_match_the_reference(cuda_device, d, causal, qk_format):
    q, k, v = _qkv(2, 700, 4, d, sk=900, hkv=2, seed=d + causal)
    lens = torch.tensor([900, 333], device="cuda")
    bmap = _random_map(2, 4, 6, 8, 0.4, seed=d)
    out, lse = attention_cuda.attention(q, k, v, layout="NHD", causal=causal, scale=None, kv_lens=lens,
                                        return_lse=True, qk_format=qk_format, quantizer="torch",
                                        sparsity=sparse.Sparsity(block_mask=bmap))
    ref, ref_lse = attention_reference(q, k, v, causal=causal, kv_lens=lens, return_lse=True, qk_format=qk_format,
                                       block_mask=bmap)
    assert _cos(out, ref) >= 0.9999
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    assert (lse[finite] - ref_lse[finite]).abs().max().item() <= 2e-3
    assert (out[0, 128:256, 0] == 0).all() and torch.isneginf(lse[0, 0, 128:256]).all()
    # The CUDA quantiser, through the public op.
    op_out = nvfp4_dit.attention(q, k, v, backend="cuda", causal=causal, kv_lens=lens, qk_format=qk_format,
                                 block_mask=bmap)
    assert _cos(op_out, ref) >= 0.999
    assert (op_out[0, 128:256, 0] == 0).all()


@pytest.mark.cuda
@pytest.mark.parametrize("causal", [False, True])
def test_an_all_tiles_map_equals_dense_byte_for_byte(cuda_device, causal):
    q, k, v = _qkv(2, 1000, 4, 128, hkv=2, seed=3)
    lens = torch.tensor([1000, 517], device="cuda")
    full = torch.ones(1, 1, 8, 8, dtype=torch.bool, device="cuda")
    dense = nvfp4_dit.attention(q, k, v, backend="cuda", causal=causal, kv_lens=lens, return_lse=True)
    for kw in ({"block_mask": full}, {"keep_mass": 1.0}):
        got = nvfp4_dit.attention(q, k, v, backend="cuda", causal=causal, kv_lens=lens, return_lse=True, **kw)
        assert torch.equal(got[0], dense[0]) and torch.equal(got[1], dense[1]), kw


@pytest.mark.cuda
def test_groups_of_q_blocks_do_not_change_the_result(cuda_device, monkeypatch):
    q, k, v = _qkv(1, 2000, 2, 128, seed=9)
    bmap = _random_map(1, 2, 16, 16, 0.5, seed=2)
    whole = nvfp4_dit.attention(q, k, v, backend="cuda", block_mask=bmap, return_lse=True)
    monkeypatch.setattr(sparse, "WORK_ELEMENTS", 3 * 2 * 16)     # 3 Q blocks per group
    split = nvfp4_dit.attention(q, k, v, backend="cuda", block_mask=bmap, return_lse=True)
    assert torch.equal(whole[0], split[0]) and torch.equal(whole[1], split[1])


@pytest.fixture(params=["warp", "cta"])
def map_row_threads(request, monkeypatch):
    """The threads block_map_rows gives a row: a warp (rows of at most BLOCK_MAP_WARP_MAX_TILES
    tiles) or, forced here for any row, the CTA."""
    from nvfp4_dit.cuda import abi

    if request.param == "cta":
        monkeypatch.setattr(abi, "BLOCK_MAP_WARP_MAX_TILES", 0)
    return request.param


def _kernel_lists(stats, sparsity, grid):
    from nvfp4_dit.cuda import block_lists, launch

    dk = launch.device_kernels(torch.device("cuda"))
    return list(block_lists.lists_by_group(dk, stats, sparsity, grid, launch.current_stream(dk.index),
                                           with_map=True))


def _assert_lists_equal(got: sparse.BlockLists, want: sparse.BlockLists):
    """Equal offsets and order, and equal lists up to the group's entries (the kernels leave the
    rest of the worst-case region unwritten)."""
    assert torch.equal(got.offsets, want.offsets) and torch.equal(got.order, want.order)
    n = int(want.offsets[-1])
    assert torch.equal(got.tiles[:n], want.tiles[:n])


@pytest.mark.cuda
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("broadcast", [(1, 3), (2, 1)])
def test_the_list_kernels_list_a_given_map_exactly(cuda_device, map_row_threads, causal, broadcast, monkeypatch):
    b, h, sq, sk = 2, 3, 1900, 5000   # 15 Q blocks, 40 key tiles: two bit words per row
    bmap = _random_map(*broadcast, 15, 40, 0.3, seed=7)
    grid = sparse.TileGrid(b, h, sq, sk, 0.1, causal, torch.tensor([5000, 2100], device="cuda"))
    spec = sparse.Sparsity(block_mask=bmap)
    monkeypatch.setattr(sparse, "WORK_ELEMENTS", 4 * b * h * 40)     # groups of 4 Q blocks, the last of 3
    groups = _kernel_lists(None, spec, grid)
    assert [g for g, _, _ in groups] == [(0, 4), (4, 8), (8, 12), (12, 15)]
    for (g0, g1), rows_map, lists in groups:
        want_map = sparse.map_rows(None, spec, grid, g0, g1)
        assert torch.equal(rows_map, want_map)
        _assert_lists_equal(lists, sparse.build_lists(want_map))


@pytest.mark.cuda
@pytest.mark.parametrize("case", ["plain", "masked", "restricted"])
def test_the_list_kernels_estimate_as_the_reference_does(cuda_device, map_row_threads, case, monkeypatch):
    q, k, _ = _structured(6000, 4, 128, seed=3)
    kv = k[:, :, ::2]                                      # GQA: two query heads per kv head
    qh, kh = fmt.to_hnd(q, "NHD"), fmt.to_hnd(kv, "NHD")
    lens = torch.tensor([5500], device="cuda")
    stats = sparse.BlockStatistics.of_inputs(qh, kh, lens)
    bias = None
    if case == "masked":
        bias = torch.zeros(1, 1, 6000, device="cuda")
        bias[..., 1000:1400] = -math.inf                    # a key mask hides most of two tiles
        bias[..., 3000:3100] = -2.0
    grid = sparse.TileGrid(1, 4, 6000, 6000, fmt.default_scale(128), case == "restricted", lens, bias)
    bmap = _random_map(1, 4, 47, 47, 0.7, seed=1) if case == "restricted" else None
    spec = sparse.Sparsity(block_mask=bmap, keep_mass=0.8, always_keep=(5900, 6000) if case != "plain" else None)
    monkeypatch.setattr(sparse, "WORK_ELEMENTS", 20 * 4 * 47)     # groups of 20 Q blocks
    agree = []
    for (g0, g1), rows_map, lists in _kernel_lists(stats, spec, grid):
        want = sparse.map_rows(stats, spec, grid, g0, g1)
        agree.append((rows_map == want).float().mean().item())
        given = torch.ones(1, 1, 47, 47, dtype=torch.bool, device="cuda") if bmap is None else bmap
        assert not (rows_map & ~sparse.map_rows(None, sparse.Sparsity(block_mask=given), grid, g0, g1)).any()
        _assert_lists_equal(lists, sparse.build_lists(rows_map))
    assert len(agree) == 3 and min(agree) >= 0.995, agree


@pytest.mark.cuda
@pytest.mark.parametrize("seq_k, keep_mass, kept", [(5120, 0.51, 21), (76800, 0.5042, 303), (131072, 0.5042, 517),
                                                    (140800, 0.5042, 555)])
def test_the_list_kernels_break_ties_to_the_lower_tile(cuda_device, map_row_threads, seq_k, keep_mass, kept):
    """Equal pooled scores give every tile the same mass: the fewest tiles reaching keep_mass are
    the lowest ones (plus the diagonal), in the kernels as in PyTorch (1024 tiles fill a warp's
    registers; 1100 take the CTA)."""
    nk = seq_k // 128
    ones = torch.ones(1, 1, 2, 128, device="cuda")
    stats = sparse.BlockStatistics(ones, torch.ones(1, 1, nk, 128, device="cuda"), torch.ones(1, 1, 2, device="cuda"))
    grid = sparse.TileGrid(1, 1, 256, seq_k, 0.1)
    spec = sparse.Sparsity(keep_mass=keep_mass)
    (_, rows_map, _), = _kernel_lists(stats, spec, grid)
    want = torch.zeros(1, 1, 2, nk, dtype=torch.bool, device="cuda")
    want[..., :kept] = True
    assert torch.equal(sparse.map_rows(stats, spec, grid, 0, 2), want)
    assert torch.equal(rows_map, want)


@pytest.mark.cuda
def test_the_quantiser_writes_the_block_statistics(cuda_device):
    q, k, v = _qkv(2, 700, 4, 128, sk=900, hkv=2, seed=4)
    lens = torch.tensor([900, 333], device="cuda")
    qq = cuda_quantize.quantize_qkv(q, k, v, kv_lens=lens)
    qh, kh = fmt.to_hnd(q, "NHD"), fmt.to_hnd(k, "NHD")
    assert torch.allclose(qq.k_tile_mean, preprocess.k_tile_means(kh, lens), atol=1e-5)
    assert torch.allclose(qq.q_similarity, preprocess.q_block_similarity(qh), atol=1e-4)


@pytest.mark.cuda
def test_the_estimate_on_the_gpu(cuda_device):
    q, k, v = _structured(3000, 4, 128)
    on_gpu = sparse.estimate_block_mask(q, k, 0.9, backend="cuda")
    in_torch = sparse.estimate_block_mask(q, k, 0.9, backend="reference")
    assert (on_gpu == in_torch).float().mean() >= 0.99
    assert on_gpu.float().mean() < 0.5
    assert on_gpu[..., torch.eye(24, dtype=torch.bool, device="cuda")].all()
    out = nvfp4_dit.attention(q, k, v, backend="cuda", keep_mass=0.9)
    exact, _ = attention_exact(q, k, v, block_mask=on_gpu)
    dense_exact, _ = attention_exact(q, k, v)
    # FP4's own error on these sharp inputs is the yardstick: on its map the sparse call is as
    # accurate as the dense call is on every key, and the dropped tiles cost at most 0.01 more.
    dense_cos = _cos(nvfp4_dit.attention(q, k, v, backend="cuda"), dense_exact)
    assert _cos(out, exact) >= dense_cos - 0.002 and _cos(out, dense_exact) >= dense_cos - 0.01
    # iid inputs trip the similarity safeguard: every tile is kept.
    qi, ki, _ = _qkv(1, 3000, 4, 128, seed=1)
    assert sparse.estimate_block_mask(qi, ki, 0.5, backend="cuda").all()


@pytest.mark.cuda
def test_a_sparse_call_does_not_synchronise_and_replays_from_a_graph(cuda_device):
    q, k, v = _structured(1500, 4, 128)
    lens = torch.tensor([1400], device="cuda", dtype=torch.int32)
    bmap = _random_map(1, 4, 12, 12, 0.5, seed=5)

    def calls():
        return (nvfp4_dit.attention(q, k, v, backend="cuda", keep_mass=0.8, kv_lens=lens),
                nvfp4_dit.attention(q, k, v, backend="cuda", block_mask=bmap, keep_mass=0.9, causal=True),
                nvfp4_dit.attention(q, k, v, backend="cuda", keep_mass=0.8, always_keep=(0, 100)))

    eager = calls()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        calls()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        calls()   # warm the allocator on the capture stream
        with torch.cuda.graph(graph, stream=side):
            captured = calls()
    torch.cuda.current_stream().wait_stream(side)
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(eager, captured):
        assert torch.equal(a, b)
