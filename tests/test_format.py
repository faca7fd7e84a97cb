"""The NVFP4 format module: codecs, rounding ties, scales, packing, permutation, layouts."""

import math

import pytest
import torch

from nvfp4_dit import format as fmt


def test_e2m1_table_round_trips():
    codes = torch.arange(16, dtype=torch.uint8)
    vals = fmt.e2m1_decode(codes)
    assert vals[:8].tolist() == list(fmt.E2M1_VALUES)
    assert vals[8:].tolist() == [-x for x in fmt.E2M1_VALUES]
    # Every code but -0 re-encodes to itself; -0.0 keeps its sign bit.
    assert torch.equal(fmt.e2m1_encode(vals), codes)


@pytest.mark.parametrize(
    "x, expected",
    [(0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0), (5.0, 4.0),
     (0.2500001, 0.5), (0.7499999, 0.5), (1.2500001, 1.5), (4.9999, 4.0), (5.0001, 6.0)],
)
def test_e2m1_ties_round_to_even(x, expected):
    for sign in (1.0, -1.0):
        got = fmt.e2m1_decode(fmt.e2m1_encode(torch.tensor([sign * x])))
        assert got.item() == sign * expected


def test_e2m1_saturates_and_nan():
    x = torch.tensor([7.0, 1e30, math.inf, -math.inf, math.nan, -0.1, 0.1])
    codes = fmt.e2m1_encode(x).tolist()
    assert codes[:4] == [7, 7, 7, 15]
    assert codes[4] == 0  # NaN -> +0 (its block's scale is NaN)
    assert codes[5] == 8 and codes[6] == 0  # signed zero keeps the sign


def test_e2m1_is_nearest_on_a_dense_grid():
    x = torch.linspace(-7, 7, 20001)
    got = fmt.e2m1_decode(fmt.e2m1_encode(x))
    table = torch.tensor(sorted(set(fmt.E2M1_VALUES) | {-v for v in fmt.E2M1_VALUES}))
    dist = (x[:, None].clamp(-6, 6) - table[None, :]).abs()
    best = dist.min(1).values
    assert torch.all((got - x.clamp(-6, 6)).abs() <= best + 1e-7)


def test_e4m3_encode_is_rne_satfinite():
    x = torch.tensor([448.0, 460.0, 500.0, 1e9, math.inf, 0.0, 2.0 ** -9, 2.0 ** -10,
                      1.5 * 2.0 ** -10, 1.0625, 1.1875, math.nan])
    bits = fmt.e4m3_encode(x)
    vals = fmt.e4m3_decode(bits)
    assert vals[:5].tolist() == [448.0] * 5
    assert vals[5].item() == 0.0
    assert vals[6].item() == 2.0 ** -9  # smallest subnormal
    assert vals[7].item() == 0.0  # a tie at half the smallest subnormal rounds to even (0)
    assert vals[8].item() == 2.0 ** -9
    assert vals[9].item() == 1.0 and vals[10].item() == 1.25  # mantissa ties to even
    assert bits[11].item() == 0x7F


def test_scale_underflow_and_subnormal_scales():
    # amax16 < 6 * 2^-10 underflows the scale to 0 and the whole block becomes zero.
    tiny = torch.full((16,), 0.005)
    data, sf = fmt.quantize_blocks(tiny)
    assert sf.item() == 0 and torch.all(data == 0)
    assert torch.all(fmt.dequantize_blocks(data, sf) == 0)
    # Subnormal scale (amax16 < 6 * 2^-6): still exact for a block of equal values.
    block = torch.full((16,), 0.05)
    data, sf = fmt.quantize_blocks(block)
    s = fmt.e4m3_decode(sf).item()
    assert s < 2.0 ** -6 and s > 0
    deq = fmt.dequantize_blocks(data, sf)
    assert torch.allclose(deq, block, rtol=0.15)


def test_quantize_divides_by_the_rounded_scale():
    x = torch.tensor([1.0 + 0.01 * i for i in range(16)])
    data, sf = fmt.quantize_blocks(x)
    s = fmt.e4m3_decode(sf).item()
    codes = fmt.unpack_nibbles(data)
    assert torch.equal(codes, fmt.e2m1_encode(x / s))


def test_packing_low_nibble_first():
    codes = torch.tensor([1, 2, 3, 4, 15, 0], dtype=torch.uint8)
    packed = fmt.pack_nibbles(codes)
    assert packed.tolist() == [0x21, 0x43, 0x0F]
    assert torch.equal(fmt.unpack_nibbles(packed), codes)


def test_k_row_permutation():
    assert fmt.K_ROW_PERM[:8] == (0, 1, 8, 9, 16, 17, 24, 25)
    assert fmt.K_ROW_PERM[8:16] == (2, 3, 10, 11, 18, 19, 26, 27)
    assert fmt.K_ROW_PERM[24:] == (6, 7, 14, 15, 22, 23, 30, 31)
    perm = torch.tensor(fmt.K_ROW_PERM)
    assert torch.equal(perm[perm], torch.arange(32))  # an involution
    x = torch.arange(64.0)[:, None]
    once = fmt.permute_k_rows(x, dim=0)
    assert once[2, 0].item() == 8 and once[32 + 2, 0].item() == 40
    assert torch.equal(fmt.permute_k_rows(once, dim=0), x)
    # Lane t of the accumulator owns stored columns 2t, 2t+1 of each n8 tile j; after the
    # permutation those are tokens 8t .. 8t+7 of the 32-key group.
    for t in range(4):
        owned = sorted(fmt.K_ROW_PERM[8 * j + 2 * t + c] for j in range(4) for c in range(2))
        assert owned == list(range(8 * t, 8 * t + 8))


def test_dequantize_error_is_bounded(gen):
    x = torch.randn(64, 128, generator=gen)
    deq = fmt.dequantize_blocks(*fmt.quantize_blocks(x))
    rel = (deq - x).norm() / x.norm()
    assert 0.05 < rel < 0.12  # e2m1 with per-16 ue4m3 scales on Gaussian data


def test_quantize_p_blocks_probe():
    # All-equal probabilities at the top of the range quantise exactly.
    p = torch.full((4, 128), fmt.P_RANGE)
    assert torch.equal(fmt.quantize_p_blocks(p), p)
    # A block below the smallest scale vanishes instead of turning into NaN.
    assert torch.all(fmt.quantize_p_blocks(torch.full((16,), 1e-4)) == 0)


def test_padded_head_dim():
    assert [fmt.padded_head_dim(d) for d in (1, 40, 64, 65, 80, 128, 129, 256)] == \
        [64, 64, 64, 128, 128, 128, None, None]


# ---------------------------------------------------------------------------------------------
# MXFP8 Q/K
# ---------------------------------------------------------------------------------------------

def test_ue8m0_scale_puts_the_block_max_in_the_top_octave_of_e4m3():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4000, fmt.MX_BLOCK, generator=g) * torch.exp2(torch.randint(-60, 60, (4000, 1), generator=g).float())
    sf = fmt.ue8m0_block_scales(x)
    ratio = x.abs().amax(-1) / fmt.ue8m0_decode(sf[:, 0])
    assert ((ratio > 224) & (ratio <= 448)).all()
    # Exact edges: 448 * 2^e maps to e; just above it to e + 1; zero and non-finite to byte 0.
    edge = torch.zeros(5, fmt.MX_BLOCK)
    edge[:, 0] = torch.tensor([448.0, torch.nextafter(torch.tensor(448.0), torch.tensor(1e9)).item(), 1.0, 0.0,
                               float("inf")])
    assert fmt.ue8m0_block_scales(edge)[:, 0].tolist() == [127, 128, 127 - 8, 0, 0]
    assert fmt.ue8m0_decode(torch.tensor([0, 127, 254], dtype=torch.uint8)).tolist() == [2.0 ** -127, 1.0, 2.0 ** 127]


def test_mx_blocks_round_trip_within_half_an_e4m3_ulp():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 256, generator=g) * torch.exp2(torch.randint(-20, 20, (64, 1), generator=g).float())
    codes, sf = fmt.quantize_mx_blocks(x)
    assert codes.shape == x.shape and sf.shape == (64, 256 // fmt.MX_BLOCK)
    back = fmt.dequantize_mx_blocks(codes, sf)
    scale = fmt.ue8m0_decode(sf).repeat_interleave(fmt.MX_BLOCK, -1)
    # e4m3 normals carry 3 mantissa bits: |error| <= 2^-4 |x|, or half the subnormal step 2^-10 * scale.
    assert ((back - x).abs() <= torch.maximum(x.abs() * 2.0**-4, scale * 2.0**-10)).all()
    with pytest.raises(ValueError, match="multiple of 32"):
        fmt.quantize_mx_blocks(torch.zeros(2, 48))


def test_statistics_rows_are_at_most_16_strided_tiles_of_the_valid_rows():
    n_valid = torch.tensor([0, 1, 128, 2048, 2049, 118_800, 5000])
    mask = fmt.statistics_row_mask(n_valid, 118_784 + 128)
    assert mask[0].sum() == 0 and mask[1].tolist()[:2] == [True, False]
    assert mask[2].sum() == 128 and mask[3].sum() == 2048  # up to 16 tiles: every valid row
    for i, n in enumerate(n_valid.tolist()):
        tiles = (n + 127) // 128
        stride = max(1, -(-tiles // fmt.STATISTICS_TILES))
        chosen = mask[i].view(-1, 128).any(1).nonzero().flatten().tolist()
        assert chosen == list(range(0, tiles, stride)), n
        assert len(chosen) <= fmt.STATISTICS_TILES
        assert not mask[i, n:].any()  # padding rows are never read
    # 2049 rows: 17 tiles, stride 2, the partial last tile (one row) is tile 16, which is read.
    assert mask[4, 2048] and mask[4].sum() == 8 * 128 + 1


@pytest.mark.parametrize("qk_format", ["nvfp4", "mxfp8"])
def test_a_larger_power_of_two_tensor_scale_is_a_shift_of_the_scale_bytes(gen, qk_format):
    # What the CUDA quantiser relies on to read its inputs once: each 128-row tile is quantised
    # under its own tensor scale t(amax_tile), then moved to the head's t(amax) = max over tiles by
    # shifting its scale bytes; blocks whose headroom is too small are quantised again. Every
    # block within its headroom must give the bytes of quantising under the head's scale directly.
    tiles, rows, d = 24, 32, 128
    x = torch.randn(tiles, rows, d, generator=gen)
    # Magnitudes over 60 binades per tile and per block, exact zeros, one tile of zeros, and values
    # far below the block maxima (fp32 subnormals once divided by the head's scale).
    x *= torch.pow(2.0, torch.randint(-50, 10, (tiles, 1, 1), generator=gen).float())
    x *= torch.pow(2.0, torch.randint(-12, 1, (tiles, rows, d // 16, 1), generator=gen).float()).repeat_interleave(16, -1).flatten(-2)[..., :d]
    x[torch.rand(x.shape, generator=gen) < 0.05] = 0.0
    x[3] = 0.0
    x[5, :, :32] *= 2.0 ** -110
    amax = x.abs().amax((1, 2))
    tile_scale = fmt.tensor_scale(amax)
    head_scale = fmt.tensor_scale(amax.max())
    assert head_scale == tile_scale[amax > 0].max()  # t() is monotone: the head's is the tiles' max
    direct_data, direct_sf = fmt.quantize_qk_rows(x / head_scale, qk_format)
    data, sf = fmt.quantize_qk_rows(x / tile_scale[:, None, None], qk_format)
    block = fmt.MX_BLOCK if qk_format == "mxfp8" else fmt.BLOCK
    data_bytes = block if qk_format == "mxfp8" else block // 2
    headroom = fmt.scale_headroom(sf, data, qk_format)
    shifted = exact = 0
    for t in range(tiles):
        k = int(torch.log2(head_scale / tile_scale[t]))
        if amax[t] == 0:
            k = 0  # an all-zero tile has no scale of its own and nothing to move
        ok = headroom[t] >= k
        got = fmt.shift_scales(sf[t], k, qk_format)
        assert torch.equal(got[ok], direct_sf[t][ok]), t
        assert torch.equal(data[t].unflatten(-1, (-1, data_bytes))[ok], direct_data[t].unflatten(-1, (-1, data_bytes))[ok]), t
        shifted += int(ok.sum()) if k else 0
        exact += int((~ok).sum())
    assert shifted > 1000 and exact > 10  # both paths taken
