"""Argument checks of the public entry points: shape logic only, so torch.compile can trace them.

A leaf module (it imports nothing of nvfp4_dit but the format), shared by the op
(:mod:`nvfp4_dit.ops`) and the quantiser (:mod:`nvfp4_dit.cuda.quantize`).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from . import format as fmt
from .defaults import BACKENDS  # noqa: F401 (re-exported)

LAYOUTS = ("NHD", "HND")
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def check_keep_mass(keep_mass) -> Optional[float]:
    """``keep_mass`` as a float in (0, 1], or None; TypeError / ValueError naming it."""
    if keep_mass is None:
        return None
    if isinstance(keep_mass, bool) or not isinstance(keep_mass, (int, float)):
        raise TypeError(f"keep_mass must be a float in (0, 1] or None, got {type(keep_mass).__name__}")
    if not (0.0 < keep_mass <= 1.0):
        raise ValueError(f"keep_mass must lie in (0, 1], got {keep_mass}")
    return float(keep_mass)


def validate_attention_args(q, k, v, layout, causal, scale, attn_mask, kv_lens, return_lse, backend, balance_qk,
                            qk_format="nvfp4"):
    """The checks of :func:`nvfp4_dit.attention`; raises TypeError / ValueError naming the argument."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t)
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    if not isinstance(balance_qk, bool):
        raise TypeError(f"balance_qk must be a bool, got {type(balance_qk).__name__}")
    if not isinstance(qk_format, str) or qk_format not in fmt.QK_FORMATS:
        raise ValueError(f"qk_format must be one of {fmt.QK_FORMATS}, got {qk_format!r}")
    dims = "[B, S, H, D]" if layout == "NHD" else "[B, H, S, D]"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D {dims} for layout={layout!r}, got shape {tuple(t.shape)}")
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    qh, kh, vh = (fmt.hnd_shape(t, layout) for t in (q, k, v))
    b, h, _, d = qh
    if kh != vh:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if kh[0] != b:
        raise ValueError(f"k has batch {kh[0]} but q has batch {b}")
    if kh[3] != d:
        raise ValueError(f"k/v head dim {kh[3]} differs from q head dim {d}")
    if d == 0:
        raise ValueError(f"q/k/v head dim must be at least 1, got shape {tuple(q.shape)}")
    hkv = kh[1]
    if hkv == 0 or h % hkv:
        raise ValueError(f"q heads ({h}) must be a multiple of k/v heads ({hkv})")
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"scale must be a positive finite number, got {scale}")
    sk = kh[2]
    if kv_lens is not None:
        check_tensor("kv_lens", kv_lens)
        if kv_lens.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"kv_lens must be int32 or int64, got {kv_lens.dtype}")
        if kv_lens.shape != (b,):
            raise ValueError(f"kv_lens must have shape ({b},), got {tuple(kv_lens.shape)}")
        if kv_lens.device != q.device and kv_lens.device.type != "cpu":
            raise ValueError(f"kv_lens is on {kv_lens.device} but q is on {q.device} (give it there or on the CPU)")
    if attn_mask is not None:
        check_tensor("attn_mask", attn_mask)
        if attn_mask.dtype != torch.bool and attn_mask.dtype not in FLOAT_DTYPES:
            raise TypeError(f"attn_mask must be bool or floating point, got {attn_mask.dtype}")
        if attn_mask.device != q.device:
            raise ValueError(f"attn_mask is on {attn_mask.device} but q is on {q.device}")
        sq = qh[2]
        if not 2 <= attn_mask.dim() <= 4:
            # SDPA itself fails on 1-D masks, and a 5-D mask would broadcast the output to 5-D.
            raise ValueError(f"attn_mask must be 2-D [B, Sk] or 3-/4-D broadcastable to [B, H, Sq, Sk], "
                             f"got {attn_mask.dim()}-D shape {tuple(attn_mask.shape)}")
        if attn_mask.dim() == 2:
            # 2-D masks are key-padding masks [B, Sk] (the diffusers / transformers convention).
            if tuple(attn_mask.shape) != (b, sk):
                raise ValueError(f"a 2-D attn_mask must be a key-padding mask [B, Sk] = {(b, sk)}, "
                                 f"got {tuple(attn_mask.shape)}")
        else:
            try:
                torch.broadcast_shapes(attn_mask.shape, (b, h, sq, sk))
            except RuntimeError:
                raise ValueError(
                    f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to "
                    f"[B, H, Sq, Sk] = {(b, h, sq, sk)}") from None
        if attn_mask.device.type == "cpu" and attn_mask.is_floating_point() and attn_mask.numel() \
                and bool((torch.isnan(attn_mask) | torch.isposinf(attn_mask)).any()):
            # Checked where it costs no GPU sync; on a GPU such a mask gives NaN rows, as in SDPA.
            raise ValueError("attn_mask holds NaN or +inf (an additive mask masks with -inf, never +inf/NaN)")
