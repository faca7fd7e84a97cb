"""The 3D token order of video calls (nvfp4_dit.token_order): the rule, its C++ twin, the op's
arguments, and every CPU back-end computing "permute, attend, un-permute"."""

import math
import subprocess

import pytest
import torch

import nvfp4_dit
from nvfp4_dit import sparse
from nvfp4_dit.token_order import TokenOrder, check_token_order, keys_in_tile_order

from host_program import compile_host_program

GRIDS = [(21, 30, 52), (1, 5, 7), (3, 9, 17), (2, 8, 8), (5, 1, 3), (4, 16, 24), (33, 45, 80)]


def _by_sort_key(grid, tile):
    """The tile order by its definition: sort by (t-block, h-block, w, t in block, h in block)."""
    t, h, w = grid
    tt, th = tile
    pos = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"), -1).reshape(-1, 3)
    key = ((((pos[:, 0] // tt) * -(-h // th) + pos[:, 1] // th) * w + pos[:, 2]) * (tt * th)
           + (pos[:, 0] % tt) * th + pos[:, 1] % th)
    return torch.argsort(key)


@pytest.mark.parametrize("grid", GRIDS)
def test_source_rows_follow_the_definition_and_keep_other_tokens_in_place(grid):
    n = math.prod(grid)
    for start, extra in ((0, 0), (7, 0), (0, 9), (130, 61)):
        order = TokenOrder(grid, (start, start + n))
        rows = order.source_rows(start + n + extra)
        assert torch.equal(rows[start:start + n], _by_sort_key(grid, order.tile) + start)
        assert torch.equal(rows[:start], torch.arange(start))
        assert torch.equal(rows[start + n:], torch.arange(start + n, start + n + extra))
        assert torch.equal(rows.sort().values, torch.arange(start + n + extra))


def test_full_strips_make_2x8x8_boxes():
    grid = (4, 16, 24)
    order = TokenOrder(grid, (0, math.prod(grid)))
    for tile in order.source_rows(math.prod(grid)).view(-1, 128):
        coords = (tile // (16 * 24), tile // 24 % 16, tile % 24)
        assert [int(x.max() - x.min()) + 1 for x in coords] == [2, 8, 8]
    assert TokenOrder((1, 20, 30), (0, 600)).tile == (1, 8)
    assert TokenOrder((9, 3, 30), (0, 810)).tile == (2, 3)


SOURCE_ROW_PROGRAM = r"""
#include <cstdio>
#include "common/token_order.h"
using namespace nvfp4_dit;
int main() {
  long long begin, end, seq;
  int t, h, w, tt, th;
  while (std::scanf("%lld %lld %d %d %d %d %d %lld", &begin, &end, &t, &h, &w, &tt, &th, &seq) == 8) {
    TokenOrder o{begin, end, t, h, w, tt, th, 0};
    for (long long s = 0; s < seq; ++s) std::printf("%lld ", (long long)source_row(o, s));
    std::printf("\n");
  }
  return 0;
}
"""


def test_the_kernels_source_row_equals_the_python_rule(tmp_path):
    exe = compile_host_program(tmp_path, "source_row", SOURCE_ROW_PROGRAM)
    cases = [(TokenOrder(g, (s, s + math.prod(g))), s + math.prod(g) + e)
             for g in GRIDS[:6] for s, e in ((0, 0), (5, 11))]
    text = "".join(f"{o.span[0]} {o.span[1]} {o.grid[0]} {o.grid[1]} {o.grid[2]} {o.tile[0]} {o.tile[1]} {n}\n"
                   for o, n in cases)
    out = subprocess.run([str(exe)], input=text, capture_output=True, text=True, check=True).stdout.splitlines()
    for (order, n), line in zip(cases, out):
        assert [int(x) for x in line.split()] == order.source_rows(n).tolist()


def test_check_token_order_names_the_argument():
    assert check_token_order(None, None, seq_q=10, seq_k=10, causal=False) is None
    assert check_token_order((2, 3, 4), None, seq_q=24, seq_k=24, causal=False) == TokenOrder((2, 3, 4), (0, 24))
    assert check_token_order([2, 3, 4], [5, 29], seq_q=40, seq_k=40, causal=False).span == (5, 29)
    with pytest.raises(TypeError, match="video_grid"):
        check_token_order((2, 3), None, seq_q=6, seq_k=6, causal=False)
    with pytest.raises(TypeError, match="video_grid"):
        check_token_order((2, 3, 4.0), None, seq_q=24, seq_k=24, causal=False)
    with pytest.raises(ValueError, match="video_grid"):
        check_token_order((2, 0, 4), None, seq_q=24, seq_k=24, causal=False)
    with pytest.raises(ValueError, match="video_tokens"):
        check_token_order((2, 3, 4), None, seq_q=30, seq_k=30, causal=False)
    with pytest.raises(ValueError, match="video_tokens"):
        check_token_order((2, 3, 4), (0, 23), seq_q=30, seq_k=30, causal=False)
    with pytest.raises(ValueError, match="video_tokens"):
        check_token_order((2, 3, 4), (10, 34), seq_q=30, seq_k=30, causal=False)
    with pytest.raises(TypeError, match="video_tokens"):
        check_token_order((2, 3, 4), 24, seq_q=30, seq_k=30, causal=False)
    with pytest.raises(ValueError, match="video_grid"):
        check_token_order(None, (0, 24), seq_q=30, seq_k=30, causal=False)
    with pytest.raises(ValueError, match="same length"):
        check_token_order((2, 3, 4), None, seq_q=24, seq_k=30, causal=False)
    with pytest.raises(ValueError, match="causal"):
        check_token_order((2, 3, 4), None, seq_q=24, seq_k=24, causal=True)


def _video(grid, extra=0, h=2, d=64, seed=0):
    """Smooth content over the grid (neighbours alike) plus noise; ``extra`` text tokens after it."""
    g = torch.Generator().manual_seed(seed)
    t, hh, w = grid
    coords = torch.stack(torch.meshgrid(*(torch.linspace(0, 1, n) for n in grid), indexing="ij"), -1).reshape(-1, 3)
    freq = torch.randn(3, d, generator=g) * 4.0

    def field():
        x = torch.sin(coords @ freq + torch.rand(d, generator=g) * 6.28)
        x = torch.cat([x, torch.randn(extra, d, generator=g)], 0)
        return (x[None, :, None, :] * 2.0 + 0.3 * torch.randn(1, x.shape[0], h, d, generator=g)).float()

    return field(), field(), torch.randn(1, math.prod(grid) + extra, h, d, generator=g)


def _cos(a, b):
    return torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


def _permuted_call(q, k, v, order, **kwargs):
    """The same call on inputs permuted into tile order, its result put back in the caller's order."""
    rows = order.source_rows(q.shape[1])
    out, lse = nvfp4_dit.attention(q[:, rows], k[:, rows], v[:, rows], return_lse=True, **kwargs)
    return (torch.empty_like(out).index_copy_(1, rows, out), torch.empty_like(lse).index_copy_(2, rows, lse))


@pytest.mark.parametrize("backend", ["reference", "sdpa"])
@pytest.mark.parametrize("sparse_call", [False, True])
def test_a_video_call_is_the_permuted_call_put_back(backend, sparse_call):
    grid = (3, 9, 17)   # neither 8 rows nor 2 frames divide: edge strips and straddling tiles
    q, k, v = _video(grid, extra=40)
    order = TokenOrder(grid, (0, math.prod(grid)))
    extra = dict(keep_mass=0.8, always_keep=(math.prod(grid), q.shape[1])) if sparse_call else {}
    out, lse = nvfp4_dit.attention(q, k, v, backend=backend, return_lse=True, video_grid=grid,
                                   video_tokens=order.span, **extra)
    ref_out, ref_lse = _permuted_call(q, k, v, order, backend=backend, **extra)
    if backend == "sdpa" and not sparse_call:   # exact dense attention is the same in any order
        torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


def test_the_map_indexes_tiles_in_tile_order():
    grid = (4, 16, 24)
    q, k, _ = _video(grid, seed=1)
    order = TokenOrder(grid, (0, math.prod(grid)))
    rows = order.source_rows(q.shape[1])
    in_tiles = sparse.estimate_block_mask(q, k, 0.9, backend="reference", video_grid=grid)
    permuted = sparse.estimate_block_mask(q[:, rows], k[:, rows], 0.9, backend="reference")
    raster = sparse.estimate_block_mask(q, k, 0.9, backend="reference")
    assert torch.equal(in_tiles, permuted)
    assert not torch.equal(in_tiles, raster)
    given = torch.rand(1, 2, 12, 12, generator=torch.Generator().manual_seed(2)) < 0.5
    out = nvfp4_dit.attention(q, k, q, backend="reference", block_mask=given, video_grid=grid)
    ref, _ = _permuted_call(q, k, q, order, backend="reference", block_mask=given)
    assert torch.equal(out, ref)


def test_key_lengths_and_masks_stay_in_the_callers_order():
    """A length inside the video span hides exactly the keys at or past it in the caller's order,
    whatever their tile positions: changing them changes nothing in exact attention, and the FP4
    result is as close to the exact one as in raster order (the hidden keys still enter the
    quantiser's statistics, as the keys of a per-key mask do)."""
    grid = (3, 9, 17)
    n = math.prod(grid)
    q, k, v = _video(grid, extra=20, seed=3)
    q, k, v = (torch.cat([x, x]) for x in (q, k, v))
    lens = torch.tensor([n + 20, 200])
    bias_mask = torch.ones(2, n + 20, dtype=torch.bool)
    bias_mask[0, 100:150] = False
    for kwargs in (dict(kv_lens=lens), dict(attn_mask=bias_mask)):
        hidden = ~(torch.arange(n + 20)[None] < lens[:, None]) if "kv_lens" in kwargs else ~bias_mask
        k2, v2 = k.clone(), v.clone()
        k2[hidden] += 5.0
        v2[hidden] -= 7.0
        video = dict(video_grid=grid, video_tokens=(0, n), **kwargs)
        given = torch.rand(2, 1, 4, 4, generator=torch.Generator().manual_seed(4)) < 0.7
        a = nvfp4_dit.attention(q, k, v, backend="sdpa", block_mask=given, **video)
        b = nvfp4_dit.attention(q, k2, v2, backend="sdpa", block_mask=given, **video)
        assert torch.equal(a, b), kwargs.keys()
        exact = nvfp4_dit.attention(q, k, v, backend="sdpa", **kwargs)
        raster = _cos(nvfp4_dit.attention(q, k, v, backend="reference", **kwargs), exact)
        assert _cos(nvfp4_dit.attention(q, k, v, backend="reference", **video), exact) > raster - 0.005


def test_keys_in_tile_order_cut_the_span_by_bias():
    order = TokenOrder((2, 8, 8), (10, 138))
    lens = torch.tensor([140, 5, 60, 138])
    new_lens, bias = keys_in_tile_order(order, lens, None, 140)
    assert new_lens.tolist() == [140, 5, 138, 138]
    rows = order.source_rows(140)
    assert torch.equal(torch.isneginf(bias[2, 0]), rows >= 60)
    assert not torch.isneginf(bias[[0, 1, 3]]).any()
    assert keys_in_tile_order(order, None, None, 140) == (None, None)


def test_the_op_checks_video_arguments():
    q = torch.randn(1, 24, 2, 64)
    with pytest.raises(ValueError, match="video_tokens"):
        nvfp4_dit.attention(q, q, q, backend="reference", video_grid=(2, 3, 5))
    with pytest.raises(ValueError, match="causal"):
        nvfp4_dit.attention(q, q, q, backend="reference", video_grid=(2, 3, 4), causal=True)
    with pytest.raises(ValueError, match="same length"):
        nvfp4_dit.attention(q, q[:, :12], q[:, :12], backend="reference", video_grid=(2, 3, 4))
    with pytest.raises(TypeError, match="video_grid"):
        sparse.estimate_block_mask(q, q, 0.9, backend="reference", video_grid="2x3x4")


# ---------------------------------------------------------------------------------------------
# GPU: the kernels read and write through the order

QUANTISED = ("q_data", "q_sf", "k_data", "k_sf", "vt_data", "vt_sf", "q_mean", "k_mean", "v_mean", "q_scale",
             "k_scale", "v_scale", "balance", "q_dot_km", "k_tile_mean", "q_similarity", "q_center", "q_basis",
             "q_basis_scale", "q_coeff")


def _gpu_video(grid, extra, h=4, hkv=2, d=128, dtype=torch.bfloat16, seed=0):
    q, k, v = _video(grid, extra=extra, h=h, d=d, seed=seed)
    return q.cuda().to(dtype), k[:, :, :hkv].cuda().to(dtype), v[:, :, :hkv].cuda().to(dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("qk_format", ["nvfp4", "mxfp8"])
@pytest.mark.parametrize("d", [64, 128])
def test_the_quantiser_reads_in_tile_order(cuda_device, d, qk_format):
    """Byte for byte the quantiser's outputs (statistics included) on a permuted copy."""
    from nvfp4_dit.cuda import quantize as cuda_quantize

    grid = (3, 9, 17)
    n = math.prod(grid)
    q, k, v = (torch.cat([x, x.flip(1)]) for x in _gpu_video(grid, extra=40, d=d))
    order = TokenOrder(grid, (20, 20 + n))
    rows = order.source_rows(q.shape[1], q.device)
    lens = torch.tensor([n + 40, n + 25], device="cuda")
    got = cuda_quantize.quantize_qkv(q, k, v, kv_lens=lens, balance_qk=True, qk_format=qk_format, order=order)
    want = cuda_quantize.quantize_qkv(q[:, rows], k[:, rows], v[:, rows], kv_lens=lens, balance_qk=True,
                                      qk_format=qk_format)
    for name in QUANTISED:
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert all(torch.equal(a, b) for a, b in zip(got.nonfinite, want.nonfinite))
    assert torch.equal(got.key_projections.values, want.key_projections.values)
    assert torch.equal(got.key_projections.factors, want.key_projections.factors)


@pytest.mark.cuda
@pytest.mark.parametrize("case", ["dense", "sparse", "lengths", "strided", "nan"])
def test_a_video_call_on_the_gpu_is_the_permuted_call_put_back(cuda_device, case):
    grid = (3, 9, 17)
    n = math.prod(grid)
    q, k, v = _gpu_video(grid, extra=40, seed=5)
    kwargs = dict(backend="cuda")
    if case == "sparse":
        kwargs.update(keep_mass=0.8, always_keep=(n, n + 40))
    elif case == "lengths":
        q, k, v = (torch.cat([x, x]) for x in (q, k, v))
        kwargs.update(kv_lens=torch.tensor([n + 40, n + 10], device="cuda"))
    elif case == "strided":   # a head dim the quantiser cannot read in place: a padded copy, read through the order
        q, k, v = (x.float()[..., :80] for x in (q, k, v))
    elif case == "nan":
        q[0, 37, 1, 3] = math.nan
    order = TokenOrder(grid, (0, n))
    out, lse = nvfp4_dit.attention(q, k, v, return_lse=True, video_grid=grid, video_tokens=(0, n), **kwargs)
    if case == "lengths":   # a length outside the span is a prefix in both orders; the op adds a zero bias
        kwargs["attn_mask"] = torch.arange(q.shape[1], device="cuda")[None] < kwargs.pop("kv_lens")[:, None]
    rows = order.source_rows(q.shape[1], q.device)
    ref_out, ref_lse = nvfp4_dit.attention(q[:, rows], k[:, rows], v[:, rows], return_lse=True, **kwargs)
    ref_out = torch.empty_like(ref_out).index_copy_(1, rows, ref_out)
    ref_lse = torch.empty_like(ref_lse).index_copy_(2, rows, ref_lse)
    if case == "lengths":
        exact = nvfp4_dit.attention(q, k, v, backend="sdpa", attn_mask=kwargs["attn_mask"])
        # FP4 on this smooth, peaked content is at cos 0.964 to exact (the reference too): the video
        # call must be as accurate as the permuted one, and nearly the same
        assert _cos(out, ref_out) > 0.9999
        assert _cos(out, exact) > max(0.95, _cos(ref_out, exact) - 1e-3)
        return
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=0, equal_nan=True)
    if case == "nan":
        assert torch.isnan(out[0, rows[:128], 1]).all() and not torch.isnan(out[0, rows[128:], 1]).any()


def test_a_video_call_goes_through_the_custom_op():
    """Under torch.compile the order travels as the custom op's video_grid / video_tokens."""
    grid = (2, 8, 8)
    q, k, v = _video(grid, extra=16, seed=6)
    kwargs = dict(backend="reference", keep_mass=0.9, video_grid=grid, video_tokens=(0, 128))
    eager = nvfp4_dit.attention(q, k, v, **kwargs)
    compiled = torch.compile(lambda a, b, c: nvfp4_dit.attention(a, b, c, **kwargs), backend="eager", fullgraph=True)
    assert torch.equal(compiled(q, k, v), eager)
