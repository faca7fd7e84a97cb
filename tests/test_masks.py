"""nvfp4_dit.masks: one reduction of SDPA masks to the per-key form the FP4 paths take, decided by
the mask's shape and computed with elementwise ops only (no host sync)."""

import math

import pytest
import torch

from nvfp4_dit.masks import MASKED_GAP, NotPerKeyMask, combine_kv_lens, reduce_key_mask

B, H, SQ, SK = 2, 3, 5, 8


def test_bool_masks_become_a_bias_and_key_lengths():
    keep = torch.ones(B, 1, 1, SK, dtype=torch.bool)
    keep[1, ..., 6:] = False
    keep[0, ..., 2] = False          # an interior hole: a bias of -inf, the length stays 8
    km = reduce_key_mask(keep, B, H, SQ, SK)
    assert km.kv_lens.tolist() == [8, 6] and km.kv_lens.dtype == torch.int32 and km.nonfinite is None
    assert km.bias.shape == (B, 1, SK)
    assert torch.equal(km.bias, torch.where(keep[:, :, 0, :], 0.0, -math.inf))


def test_per_head_masks_keep_their_heads_and_the_longest_length():
    keep = torch.ones(B, H, 1, SK, dtype=torch.bool)
    keep[0, 0, 0, 4:] = False        # head 0 of batch 0 stops at 4, the others at 8
    keep[1, :, 0, 5:] = False
    km = reduce_key_mask(keep, B, H, SQ, SK)
    assert km.bias.shape == (B, H, SK) and km.kv_lens.tolist() == [8, 5]
    assert torch.isneginf(km.bias[0, 0, 4:]).all() and (km.bias[0, 1] == 0).all()


def test_additive_masks_keep_their_values_and_drop_keys_far_below_the_row_max():
    row = torch.zeros(B, SK)
    row[:, 6:] = -MASKED_GAP         # padding: exp(-1000) is 0 in fp32, so out of the statistics
    row[0, 1] = -3.0                 # a genuine bias stays a bias
    row[1] += 5.0                    # a constant shift stays in the scores (and the LSE)
    km = reduce_key_mask(row[:, None, None, :], B, H, SQ, SK)
    assert km.kv_lens.tolist() == [6, 6]
    assert torch.equal(km.bias, row[:, None, :]) and km.nonfinite.tolist() == [False, False]
    full = row[:, None, None, :].expand(B, H, 1, SK)   # the same row for every head
    assert reduce_key_mask(full, B, H, SQ, SK).kv_lens.tolist() == [6, 6]


def test_rows_without_keys_and_non_finite_masks():
    nothing = torch.ones(B, 1, 1, SK, dtype=torch.bool)
    nothing[0] = False
    assert reduce_key_mask(nothing, B, H, SQ, SK).kv_lens.tolist() == [0, 8]
    all_inf = torch.zeros(B, SK)
    all_inf[1] = -math.inf
    km = reduce_key_mask(all_inf[:, None, None, :], B, H, SQ, SK)
    assert km.kv_lens.tolist() == [8, 0] and km.nonfinite.tolist() == [False, False]
    bad = torch.zeros(B, SK)
    bad[0, 3] = math.nan
    bad[1, 1] = math.inf
    assert reduce_key_mask(bad[:, None, None, :], B, H, SQ, SK).nonfinite.tolist() == [True, True]


def test_one_query_takes_any_query_dim_and_lengths_combine():
    mask = torch.ones(B, 1, 1, SK, dtype=torch.bool)
    mask[0, ..., 3:] = False
    km = reduce_key_mask(mask, B, H, 1, SK)
    assert km.kv_lens.tolist() == [3, 8]
    assert combine_kv_lens(km, torch.tensor([8, 2])).tolist() == [3, 2]
    assert combine_kv_lens(None, None) is None and combine_kv_lens(km, None) is km.kv_lens


@pytest.mark.parametrize("mask, match", [
    (torch.zeros(B, H, SQ, SK), "differs between queries"),        # decided by the shape alone
    (torch.zeros(SQ, SK), "differs between queries"),              # SDPA's 2-D mask is [Sq, Sk]
    (torch.zeros(1, 1, B, 1, SK), "dims"),
    (torch.zeros(B, 1, 1, SK + 1), "does not broadcast"),
    (torch.ones(B, 1, 1, SK, dtype=torch.int64), "dtype"),
])
def test_masks_without_a_per_key_form(mask, match):
    with pytest.raises(NotPerKeyMask, match=match):
        reduce_key_mask(mask, B, H, SQ, SK)
