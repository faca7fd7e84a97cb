"""nvfp4_dit.masks: one reduction of SDPA masks to the per-key form the FP4 paths take."""

import math

import pytest
import torch

from nvfp4_dit.masks import MASKED_GAP, NotPerKeyMask, reduce_key_mask

B, H, SQ, SK = 2, 3, 5, 8


def test_prefix_masks_become_key_lengths():
    keep = torch.ones(B, 1, 1, SK, dtype=torch.bool)
    keep[1, ..., 6:] = False
    km = reduce_key_mask(keep, B, H, SQ, SK)
    assert km.kv_lens.tolist() == [8, 6] and km.keep is None and km.bias is None and km.shift is None
    additive = torch.where(keep, 0.0, -math.inf).expand(B, H, SQ, SK)  # full size, the same for every query
    assert reduce_key_mask(additive, B, H, SQ, SK).kv_lens.tolist() == [8, 6]


def test_gaps_shifts_and_interior_masks():
    row = torch.zeros(B, SK)
    row[:, 2] = -MASKED_GAP  # masked: exp(-1000) is 0 in fp32
    row[0] += 5.0            # batch 0: every kept key +5, a shift
    km = reduce_key_mask(row[:, None, None, :], B, H, SQ, SK)
    assert km.kv_lens is None and km.keep[:, 2].tolist() == [False, False] and km.keep.sum().item() == 2 * (SK - 1)
    assert km.shift.tolist() == [5.0, 0.0]
    assert torch.equal(km.as_key_bias(), torch.where(km.keep, 0.0, -math.inf))
    assert reduce_key_mask(torch.zeros(1, SK), B, H, SQ, SK).shift is None  # all zero: no shift


def test_genuine_biases_and_empty_rows():
    bias = torch.linspace(-1.0, 0.0, SK).expand(B, 1, 1, SK)
    km = reduce_key_mask(bias, B, H, SQ, SK)
    assert km.bias is not None and torch.equal(km.as_key_bias(), km.bias)
    nothing = torch.ones(B, 1, 1, SK, dtype=torch.bool)
    nothing[0] = False
    km = reduce_key_mask(nothing, B, H, SQ, SK)
    assert km.empty_rows and km.kv_lens.tolist() == [0, 8]
    all_inf = torch.zeros(B, SK)
    all_inf[1] = -math.inf
    km = reduce_key_mask(all_inf[:, None, None, :], B, H, SQ, SK)
    assert km.empty_rows and km.kv_lens.tolist() == [8, 0]


@pytest.mark.parametrize("mask, match", [
    (torch.zeros(B, H, SQ, SK).index_fill_(2, torch.tensor([0]), -math.inf), "differs between heads or queries"),
    (torch.zeros(1, 1, B, 1, SK), "dims"),
    (torch.zeros(B, 1, 1, SK + 1), "does not broadcast"),
    (torch.ones(B, 1, 1, SK, dtype=torch.int64), "dtype"),
    (torch.zeros(B, 1, 1, SK).index_fill_(3, torch.tensor([1]), math.nan), "NaN"),
])
def test_masks_without_a_per_key_form(mask, match):
    with pytest.raises(NotPerKeyMask, match=match):
        reduce_key_mask(mask, B, H, SQ, SK)
