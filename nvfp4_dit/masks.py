"""Attention masks reduced to the per-key form the FP4 paths take.

One reduction for every entry point: the op (:func:`nvfp4_dit.attention`), the diffusers router
and the ComfyUI override. A mask follows SDPA's semantics (bool: True attends; float: added to
the scaled scores) and broadcasts to ``[B, H, Sq, Sk]``. It has a per-key form when it is the same
for every head and query of a batch row; then each row is, in this order of preference:

* kept keys that form a prefix -> ``kv_lens`` (what the CUDA kernel takes);
* kept keys anywhere -> ``keep`` (the reference back-end takes it as a bias);
* genuine per-key biases -> ``bias`` (the reference back-end only).

In an additive row a key counts as masked when it lies at least ``MASKED_GAP`` below the row's
largest value: its softmax weight relative to the largest is exp(-1000), which is 0 in fp32, so
dropping it is exact. (1000 rather than diffusers' 10000 because -10000 in bfloat16 is -9984.)
The largest value itself is a constant added to every kept key (``shift``): softmax ignores it,
the LSE does not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

MASKED_GAP = 1000.0


class NotPerKeyMask(ValueError):
    """The mask is valid but has no per-key form (the message says why)."""


@dataclass
class KeyMask:
    """A mask in per-key form; at most one of ``kv_lens``, ``keep``, ``bias`` is set.

    kv_lens: int32 [B] when the kept keys of every batch row are a prefix (None: all keys, or see keep/bias).
    keep: bool [B, Sk] when they are not a prefix.
    bias: fp32 [B, Sk] genuine per-key biases (not only kept / masked).
    shift: fp32 [B] constant added to every kept key, or None.
    empty_rows: some batch row keeps no key at all (SDPA gives NaN there; the op gives 0 and LSE -inf).
    """

    kv_lens: Optional[torch.Tensor] = None
    keep: Optional[torch.Tensor] = None
    bias: Optional[torch.Tensor] = None
    shift: Optional[torch.Tensor] = None
    empty_rows: bool = False

    def as_key_bias(self) -> Optional[torch.Tensor]:
        """The mask as an additive fp32 bias [B, Sk] (0 / -inf where kept / masked; shift
        excluded), or None when it masks nothing beyond ``kv_lens``."""
        if self.bias is not None:
            return self.bias
        if self.keep is not None:
            return torch.where(self.keep, 0.0, -torch.inf)
        return None


def reduce_key_mask(mask: torch.Tensor, b: int, h: int, sq: int, sk: int) -> KeyMask:
    """The per-key form of ``mask`` (broadcastable to [B, H, Sq, Sk]); raises NotPerKeyMask.

    Host syncs: a few scalar reductions, once per call.
    """
    if mask.dim() > 4:
        raise NotPerKeyMask(f"attn_mask with {mask.dim()} dims")
    try:
        torch.broadcast_shapes(mask.shape, (b, h, sq, sk))
    except RuntimeError:
        raise NotPerKeyMask(f"attn_mask of shape {tuple(mask.shape)} does not broadcast to {(b, h, sq, sk)}") from None
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise NotPerKeyMask(f"attn_mask of dtype {mask.dtype}")
    m = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    first = m[:, :1, :1, :]
    if (m.shape[1] > 1 or m.shape[2] > 1) and not bool((m == first).all()):
        raise NotPerKeyMask("attn_mask differs between heads or queries (not a key-padding mask)")
    row = first[:, 0, 0, :].expand(b, sk)
    shift = None
    if row.dtype == torch.bool:
        keep = row
    else:
        row = row.float()
        top = row.amax(dim=1, keepdim=True)
        if bool((torch.isnan(top) | torch.isposinf(top)).any()):
            raise NotPerKeyMask("an additive attn_mask row holds NaN or +inf")
        empty = torch.isneginf(top)
        keep = (row == top) & ~empty
        if not bool((keep | (row <= top - MASKED_GAP) | empty).all()):
            return KeyMask(bias=row, empty_rows=bool(empty.any()))
        shift = torch.where(empty, 0.0, top)[:, 0]
        if not bool((shift != 0).any()):
            shift = None
    counts = keep.sum(dim=1)
    empty_rows = not bool((counts > 0).all())
    if bool((counts == sk).all()):
        return KeyMask(shift=shift)
    prefix = torch.arange(sk, device=keep.device)[None, :] < counts[:, None]
    if bool((prefix == keep).all()):
        return KeyMask(kv_lens=counts.to(torch.int32), shift=shift, empty_rows=empty_rows)
    return KeyMask(keep=keep.contiguous(), shift=shift, empty_rows=empty_rows)
