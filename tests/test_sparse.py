"""Block-sparse attention on the CPU (nvfp4_dit.sparse): argument checks, the block map's meaning on
every back-end, the estimate and its safeguards, and the lists the kernels read."""

import math

import pytest
import torch
import torch.nn.functional as F

import nvfp4_dit
from nvfp4_dit import format as fmt
from nvfp4_dit import preprocess, sparse
from nvfp4_dit.reference import attention_exact, attention_reference


def _cos(a, b):
    return F.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


def _qkv(b=1, s=700, h=2, d=64, hkv=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    hkv = hkv or h
    return (torch.randn(b, s, h, d, generator=g), torch.randn(b, s, hkv, d, generator=g),
            torch.randn(b, s, hkv, d, generator=g))


def _random_map(b, h, nq, nk, density, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(b, h, nq, nk, generator=g) < density


def _block_structured(s=1024, h=2, d=64, noise=0.3, seed=0):
    """Q and K whose 128-token blocks share a direction per block: block i attends tile i."""
    g = torch.Generator().manual_seed(seed)
    n = s // 128
    dirs = F.normalize(torch.randn(h, n, d, generator=g), dim=-1) * 8.0
    base = dirs.repeat_interleave(128, dim=1).transpose(0, 1)[None]     # [1, S, H, D]
    q = base + noise * torch.randn(1, s, h, d, generator=g)
    k = base + noise * torch.randn(1, s, h, d, generator=g)
    return q, k, torch.randn(1, s, h, d, generator=g)


# ---------------------------------------------------------------------------------------------
# arguments
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, error, words", [
    ({"keep_mass": 0.0}, ValueError, "keep_mass"),
    ({"keep_mass": 1.5}, ValueError, "keep_mass"),
    ({"keep_mass": "0.9"}, TypeError, "keep_mass"),
    ({"keep_mass": True}, TypeError, "keep_mass"),
    ({"block_mask": torch.ones(1, 1, 6, 6)}, TypeError, "block_mask"),
    ({"block_mask": [[True]]}, TypeError, "block_mask"),
    ({"block_mask": torch.ones(1, 1, 5, 6, dtype=torch.bool)}, ValueError, "block_mask"),
    ({"block_mask": torch.ones(1, 3, 6, 6, dtype=torch.bool)}, ValueError, "block_mask"),
    ({"block_mask": torch.ones(6, 6, dtype=torch.bool)}, ValueError, "block_mask"),
    ({"always_keep": (0, 10)}, ValueError, "always_keep"),
    ({"keep_mass": 0.9, "always_keep": (0, 10, 20)}, TypeError, "always_keep"),
    ({"keep_mass": 0.9, "always_keep": (0.0, 10)}, TypeError, "always_keep"),
    ({"keep_mass": 0.9, "always_keep": (10, 10)}, ValueError, "always_keep"),
    ({"keep_mass": 0.9, "always_keep": (0, 701)}, ValueError, "always_keep"),
])
@pytest.mark.parametrize("backend", ["reference", "sdpa"])
def test_bad_sparsity_arguments_raise_naming_the_argument(kwargs, error, words, backend):
    q, k, v = _qkv()
    with pytest.raises(error, match=words):
        nvfp4_dit.attention(q, k, v, backend=backend, **kwargs)


def test_block_mask_on_another_device_is_a_value_error():
    q, k, v = _qkv()
    mask = torch.ones(1, 1, 6, 6, dtype=torch.bool, device="meta")
    with pytest.raises(ValueError, match="block_mask"):
        nvfp4_dit.attention(q, k, v, backend="reference", block_mask=mask)


# ---------------------------------------------------------------------------------------------
# what a map means, on every back-end
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["reference", "sdpa"])
@pytest.mark.parametrize("causal", [False, True])
def test_all_tiles_and_keep_mass_one_equal_dense_byte_for_byte(backend, causal):
    q, k, v = _qkv()
    lens = torch.tensor([650])
    dense = nvfp4_dit.attention(q, k, v, backend=backend, causal=causal, kv_lens=lens, return_lse=True)
    full = torch.ones(1, 1, 6, 6, dtype=torch.bool)
    for kw in ({"block_mask": full}, {"keep_mass": 1.0}, {"block_mask": full, "keep_mass": 1.0}):
        got = nvfp4_dit.attention(q, k, v, backend=backend, causal=causal, kv_lens=lens, return_lse=True, **kw)
        assert torch.equal(got[0], dense[0]) and torch.equal(got[1], dense[1]), kw


@pytest.mark.parametrize("causal", [False, True])
def test_a_map_attends_exactly_its_tiles(causal):
    q, k, v = _qkv(b=2, h=4, hkv=2)
    lens = torch.tensor([700, 333])
    bmap = _random_map(2, 4, 6, 6, 0.4)
    bmap[0, 1, 3] = False           # an empty Q block
    bmap[1, 2, 0] = False
    bmap[1, 2, 0, 0] = True         # a single tile
    exact_out, exact_lse = attention_exact(q, k, v, causal=causal, kv_lens=lens, block_mask=bmap)
    out, lse = nvfp4_dit.attention(q, k, v, backend="sdpa", causal=causal, kv_lens=lens, block_mask=bmap,
                                   return_lse=True)
    assert torch.allclose(out.double(), exact_out, atol=1e-5)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(exact_lse))
    assert torch.allclose(lse[torch.isfinite(lse)].double(), exact_lse[torch.isfinite(exact_lse)], atol=1e-4)
    ref_out, ref_lse = nvfp4_dit.attention(q, k, v, backend="reference", causal=causal, kv_lens=lens,
                                           block_mask=bmap, return_lse=True)
    assert torch.equal(torch.isneginf(ref_lse), torch.isneginf(exact_lse))
    assert _cos(ref_out, exact_out) > 0.97
    # The empty Q block: output 0, LSE -inf, on both back-ends.
    for o, l in ((out, lse), (ref_out, ref_lse)):
        assert (o[0, 384:512, 1] == 0).all() and torch.isneginf(l[0, 1, 384:512]).all()


def test_a_map_that_repeats_over_q_blocks_equals_the_same_key_mask_in_the_reference():
    q, k, v = _qkv()
    tiles = torch.tensor([True, False, True, True, False, True])
    bmap = tiles[None, None, None, :].expand(1, 1, 6, 6)
    bias = torch.where(tiles.repeat_interleave(128)[:700], 0.0, -math.inf)[None, None, :]
    a = attention_reference(q, k, v, block_mask=bmap, return_lse=True)
    b = attention_reference(q, k, v, key_bias=bias, return_lse=True)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_the_custom_op_takes_the_sparse_arguments():
    q, k, v = _qkv()
    bmap = _random_map(1, 2, 6, 6, 0.5)
    eager = nvfp4_dit.attention(q, k, v, backend="reference", block_mask=bmap)
    traced = nvfp4_dit.attention(q.requires_grad_(), k, v, backend="reference", block_mask=bmap)
    assert torch.equal(eager, traced.detach())
    q2, k2, v2 = _block_structured()
    eager = nvfp4_dit.attention(q2, k2, v2, backend="reference", keep_mass=0.9, always_keep=(0, 5))
    traced = nvfp4_dit.attention(q2.requires_grad_(), k2, v2, backend="reference", keep_mass=0.9,
                                 always_keep=(0, 5))
    assert torch.equal(eager, traced.detach())


def test_the_exact_path_works_in_row_chunks(monkeypatch):
    q, k, v = _qkv(s=1000)
    bmap = _random_map(1, 2, 8, 8, 0.5)
    whole = nvfp4_dit.attention(q, k, v, backend="sdpa", block_mask=bmap, return_lse=True)
    chunks = []
    real = sparse.exact_row_chunks

    def small(*args, **kw):
        chunks.append(real(*args, budget=1))
        return chunks[-1]

    monkeypatch.setattr(sparse, "exact_row_chunks", small)
    split = nvfp4_dit.attention(q, k, v, backend="sdpa", block_mask=bmap, return_lse=True)
    assert len(chunks[0]) == 8
    assert torch.allclose(split[0], whole[0], atol=1e-6) and torch.allclose(split[1], whole[1], atol=1e-6)


# ---------------------------------------------------------------------------------------------
# the estimate
# ---------------------------------------------------------------------------------------------

def test_block_statistics_of_the_reference_quantiser_match_the_inputs():
    q, k, v = _qkv(s=300)
    lens = torch.tensor([200])
    qq = preprocess.quantize_qkv(q, k, v, kv_lens=lens)
    qh, kh = fmt.to_hnd(q, "NHD"), fmt.to_hnd(k, "NHD")
    assert torch.allclose(qq.k_tile_mean[:, :, :, :64], preprocess.k_tile_means(kh, lens))
    km = kh[:, :, 128:200].float().mean(2)
    assert torch.allclose(qq.k_tile_mean[:, :, 1, :64], km, atol=1e-6)
    assert (qq.k_tile_mean[:, :, 2] == 0).all()        # no valid key in the last tile
    unit = F.normalize(qh[:, :, :128].float(), dim=-1)
    gram = unit @ unit.transpose(-1, -2)
    pairwise = (gram.sum((-1, -2)) - 128) / (128 * 127)
    assert torch.allclose(qq.q_similarity[:, :, 0], pairwise, atol=1e-5)


def test_iid_blocks_trip_the_similarity_safeguard_and_keep_every_tile():
    q, k, v = _qkv(s=1024, d=128)
    sim = preprocess.q_block_similarity(fmt.to_hnd(q, "NHD"))
    assert sim.abs().max() < sparse.SIMILARITY_THRESHOLD
    bmap = sparse.estimate_block_mask(q, k, 0.5, backend="reference")
    assert bmap.all()


def test_the_estimate_keeps_the_tiles_that_carry_the_mass():
    q, k, v = _block_structured()
    bmap = sparse.estimate_block_mask(q, k, 0.9, backend="reference")
    assert bmap.shape == (1, 2, 8, 8) and bmap.dtype == torch.bool
    assert torch.equal(bmap, torch.eye(8, dtype=torch.bool).expand(1, 2, 8, 8))
    out = nvfp4_dit.attention(q, k, v, backend="sdpa", keep_mass=0.9)
    exact, _ = attention_exact(q, k, v)
    assert _cos(out, exact) > 0.99
    # keep_mass decides how much: the full mass keeps every tile.
    assert sparse.estimate_block_mask(q, k, 1.0, backend="reference").all()


def test_video_tokens_pass_the_safeguard_and_most_tiles_go():
    """RoPE'd video tokens in raster order (scripts/video_inputs.py): blocks similar enough for
    their means to stand in, and at keep_mass 0.9 well under 0.6 of the tiles carry the output."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import video_inputs

    q, k, v = video_inputs.video_qkv((8, 24, 32), heads=2, dim=128, dtype=torch.float32)
    sim = preprocess.q_block_similarity(fmt.to_hnd(q, "NHD"))
    assert sim.min() > sparse.SIMILARITY_THRESHOLD
    bmap = sparse.estimate_block_mask(q, k, 0.9, backend="reference")
    out, _ = attention_exact(q, k, v, block_mask=bmap)
    exact, _ = attention_exact(q, k, v)
    assert bmap.float().mean() < 0.5 and _cos(out, exact) >= 0.97
    # RoPE is a rotation: token norms are kept.
    x = torch.randn(1, 8 * 24 * 32, 1, 128)
    assert torch.allclose(video_inputs.rope_3d(x, (8, 24, 32)).norm(dim=-1), x.norm(dim=-1), rtol=1e-5)


def test_the_diagonal_and_the_always_kept_keys_stay():
    q, k, v = _block_structured()
    # Shift K so that Q block i points at tile i + 1: the diagonal tile carries no mass.
    k = torch.roll(k, shifts=128, dims=1)
    bmap = sparse.estimate_block_mask(q, k, 0.5, backend="reference")
    diag = torch.eye(8, dtype=torch.bool)
    assert bmap[..., diag].all()
    assert bmap.float().mean() < 0.3
    kept = sparse.estimate_block_mask(q, k, 0.5, always_keep=(300, 400), backend="reference")
    assert kept[..., 2].all() and kept[..., 3].all()
    assert torch.equal(kept & ~bmap, kept & ~bmap & (torch.arange(8) >= 2) & (torch.arange(8) <= 3))


def test_the_estimate_stays_inside_the_given_map_causality_and_key_lengths():
    q, k, v = _block_structured()
    given = _random_map(1, 2, 8, 8, 0.5)
    bmap = sparse.estimate_block_mask(q, k, 0.9, block_mask=given, causal=True, kv_lens=torch.tensor([600]),
                                      backend="reference")
    allowed = given & torch.ones(8, 8, dtype=torch.bool).tril() & (torch.arange(8) * 128 < 600)
    assert not (bmap & ~allowed).any()
    assert bmap.any()


def test_a_tile_hidden_by_a_key_mask_weighs_nothing():
    q, k, v = _block_structured()
    mask = torch.ones(1, 1024, dtype=torch.bool)
    mask[:, 256:384] = False
    bmap = sparse.estimate_block_mask(q, k, 0.9, attn_mask=mask, backend="reference")
    assert not bmap[..., 2].any()


def test_the_estimate_is_deterministic_and_computed_per_call():
    q, k, v = _block_structured(noise=1.0)
    a = sparse.estimate_block_mask(q, k, 0.8, backend="reference")
    b = sparse.estimate_block_mask(q, k, 0.8, backend="reference")
    assert torch.equal(a, b)
    k2 = torch.roll(k, shifts=256, dims=1)
    assert not torch.equal(sparse.estimate_block_mask(q, k2, 0.8, backend="reference"), a)


def test_ties_go_to_the_lower_tile():
    scores = torch.zeros(1, 4)
    assert sparse._kept_by_mass(scores, 0.5).tolist() == [[True, True, False, False]]
    assert sparse._kept_by_mass(scores, 0.51).tolist() == [[True, True, True, False]]
    none = torch.full((1, 3), -math.inf)
    assert not sparse._kept_by_mass(none, 0.9).any()


# ---------------------------------------------------------------------------------------------
# the lists
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("rows", [1, 5])
def test_build_lists_matches_a_loop(rows):
    b, h, nk = 2, 3, 5
    rows_map = _random_map(b, h, rows, nk, 0.45, seed=rows)
    rows_map[0, 1, 0] = False
    lists = sparse.build_lists(rows_map)
    offsets, tiles = lists.offsets.tolist(), lists.tiles.tolist()
    assert len(offsets) == b * h * rows + 1 and len(tiles) == b * h * rows * nk
    for bh in range(b * h):
        for g in range(rows):
            r = bh * rows + g
            want = rows_map.view(b * h, rows, nk)[bh, g].nonzero().flatten().tolist()
            assert tiles[offsets[r]:offsets[r + 1]] == want, (bh, g)
    assert tiles[offsets[-1]:] == [0] * (len(tiles) - offsets[-1])
    # The visiting order: every row once, grouped by head, each head's longest first (ties by block).
    order = lists.order.tolist()
    assert sorted(order) == list(range(b * h * rows))
    assert [r // rows for r in order] == sorted(r // rows for r in order)
    key = [(r // rows, -(offsets[r + 1] - offsets[r]), r) for r in order]
    assert key == sorted(key)


def test_groups_bound_the_estimate_memory(monkeypatch):
    assert sparse.row_groups(10, 100, budget=300) == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert sparse.row_groups(3, 1000, budget=1) == [(0, 1), (1, 2), (2, 3)]
    monkeypatch.setattr(sparse, "WORK_ELEMENTS", 200)
    assert sparse.row_groups(5, 100) == [(0, 2), (2, 4), (4, 5)]
