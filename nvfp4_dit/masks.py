"""Attention masks reduced to the per-key form the FP4 paths take, on the device, with no host sync.

One reduction for every entry point: the op (:func:`nvfp4_dit.attention`) and, through the call
planner (:mod:`nvfp4_dit.planner`), the diffusers router and the ComfyUI override. A mask follows
SDPA's semantics (bool: True attends; float: added to the scaled scores) and broadcasts to
``[B, H, Sq, Sk]``. It has a per-key form when it is the same for every query: its query dim is 1
(or there is one query). That is decided from the shape alone; the values never choose the path,
so a masked call never waits for the GPU.

The per-key form (:class:`KeyMask`) is

* ``bias``: fp32 ``[B, H or 1, Sk]`` added to the scaled scores (0 keeps a key, -inf masks it, other
  values are biases). The FP4 paths add it to the correction term, so any per-key mask runs in FP4;
* ``kv_lens``: int32 ``[B]``, one past the last key that some head keeps: keys at or past it are
  zero padding for the quantiser (kept out of every mean and scale) and masked by the kernel. In an
  additive row a key counts as kept unless it lies ``MASKED_GAP`` or more below the row's largest
  value: its softmax weight relative to the largest is then exp(-1000), which is 0 in fp32;
* ``nonfinite``: bool ``[B]``, a NaN or +inf in that batch's mask. Exact attention gives NaN rows
  there, so the FP4 paths poison that batch's output (as they do for NaN inputs).

A batch row that keeps no key gives output 0 and LSE -inf (SDPA gives NaN there).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

MASKED_GAP = 1000.0


class NotPerKeyMask(ValueError):
    """The mask is valid but has no per-key form (the message says why)."""


@dataclass(frozen=True)
class KeyMask:
    """A mask in per-key form (see the module docstring): ``bias`` fp32 [B, H or 1, Sk] (a view that
    may have zero strides), ``kv_lens`` int32 [B], ``nonfinite`` bool [B] or None."""

    bias: torch.Tensor
    kv_lens: torch.Tensor
    nonfinite: Optional[torch.Tensor] = None


def check_per_key_shape(shape: torch.Size, b: int, h: int, sq: int, sk: int) -> Optional[str]:
    """Why a mask of ``shape`` (SDPA broadcasting against [B, H, Sq, Sk]) has no per-key form, or None."""
    if len(shape) > 4:
        return f"attn_mask with {len(shape)} dims"
    # SDPA's broadcasting, checked by hand: torch.broadcast_shapes costs more than the whole check.
    if any(m != 1 and m != t for m, t in zip(reversed(shape), (sk, sq, h, b))):
        return f"attn_mask of shape {tuple(shape)} does not broadcast to {(b, h, sq, sk)}"
    if sq > 1 and len(shape) >= 2 and shape[-2] != 1:
        return f"attn_mask of shape {tuple(shape)} differs between queries (not a key mask)"
    return None


def reduce_key_mask(mask: torch.Tensor, b: int, h: int, sq: int, sk: int) -> KeyMask:
    """The per-key form of ``mask`` (SDPA semantics, broadcastable to [B, H, Sq, Sk]); raises
    :class:`NotPerKeyMask` for a mask that varies over queries, decided from its shape.

    A handful of elementwise device ops on a [B, H or 1, Sk] row, none synchronising."""
    reason = check_per_key_shape(mask.shape, b, h, sq, sk)
    if reason is not None:
        raise NotPerKeyMask(reason)
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise NotPerKeyMask(f"attn_mask of dtype {mask.dtype}")
    m = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))[:, :, 0, :]   # [B|1, H|1, Sk|1]
    m = m.expand(b, m.shape[1], sk)
    nonfinite = None
    if m.dtype == torch.bool:
        keep = m
        bias = torch.where(m, 0.0, -math.inf)
    else:
        bias = m.float()
        top = bias.amax(-1, keepdim=True)
        keep = bias > top - MASKED_GAP
        # A row holds NaN or +inf exactly when its maximum is one (amax propagates NaN).
        nonfinite = (top < math.inf).logical_not_().flatten(1).any(1)
    if sk:
        keys = torch.arange(1, sk + 1, dtype=torch.int32, device=mask.device)
        kv_lens = torch.where(keep.any(1), keys, 0).amax(1)
    else:
        kv_lens = torch.zeros(b, dtype=torch.int32, device=mask.device)
    return KeyMask(bias=bias, kv_lens=kv_lens, nonfinite=nonfinite)


def combine_kv_lens(key_mask: Optional[KeyMask], kv_lens: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The key lengths of a call given both a mask and ``kv_lens`` (the smaller of the two)."""
    if key_mask is None:
        return kv_lens
    if kv_lens is None:
        return key_mask.kv_lens
    return torch.minimum(key_mask.kv_lens, kv_lens.to(torch.int32))
