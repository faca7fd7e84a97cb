"""The video tokens of a diffusers transformer forward: the latent token grid and where the video
sits in a joint sequence, read off the forward's arguments and the model's patch size in every
forward (nothing is kept across forwards).

A block-sparse call (``keep_mass``) keeps every key that is not video (the text of HunyuanVideo,
CogVideoX and Mochi's joint attention), so its estimate never drops the prompt. Per family:

============================  ========================  ==============================  ==========
model class                   latent input              grid                            video
============================  ========================  ==============================  ==========
Wan, Cosmos (Predict2/2.5)    [B, C, F, H, W]           F/pt, H/ph, W/pw (patch_size)   alone
HunyuanVideo                  [B, C, F, H, W]           F/patch_size_t, H/p, W/p        first
Mochi                         [B, C, F, H, W]           F, H/p, W/p                     first
CogVideoX                     [B, F, C, H, W]           F/patch_size_t (or F), H/p, W/p  last
LTX-Video                     packed tokens             num_frames, height, width        alone
============================  ========================  ==============================  ==========

Other models (MiniMax-H3's tagged token sets among them) get no video tokens: their sparse calls
estimate every key, text included.
"""

from __future__ import annotations

import inspect
from typing import Optional

import torch

from nvfp4_dit.sparse import VideoTokens

_BCTHW = {"WanTransformer3DModel": "alone", "CosmosTransformer3DModel": "alone",
          "HunyuanVideoTransformer3DModel": "first", "MochiTransformer3DModel": "first"}
_SIGNATURES: dict[type, inspect.Signature] = {}


def _arguments(model: torch.nn.Module, args: tuple, kwargs: dict) -> dict:
    cls = type(model)
    if cls not in _SIGNATURES:
        _SIGNATURES[cls] = inspect.signature(cls.forward)
    try:
        return _SIGNATURES[cls].bind_partial(model, *args, **kwargs).arguments
    except TypeError:
        return {}


def _patch(value, dims: int) -> Optional[tuple[int, ...]]:
    """A model's patch size as ``dims`` ints (an int applies to every dim), None if unreadable."""
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,) * dims
    if isinstance(value, (tuple, list)) and len(value) == dims and all(isinstance(v, int) and v > 0 for v in value):
        return tuple(value)
    return None


def _tokens(frames: int, height: int, width: int, patch: Optional[tuple[int, int, int]],
            position: str) -> Optional[VideoTokens]:
    if patch is None or min(frames, height, width) <= 0:
        return None
    grid = (frames // patch[0], height // patch[1], width // patch[2])
    if min(grid) <= 0:
        return None
    return VideoTokens(grid, "first" if position == "alone" else position)


def video_tokens_of(model: torch.nn.Module, args: tuple, kwargs: dict) -> Optional[VideoTokens]:
    """The video tokens of ``model``'s forward called with ``args`` / ``kwargs`` (the pre-hook's
    view of the call), or None for a model (or an input) this module does not know."""
    name = type(model).__name__
    config = getattr(model, "config", None)
    if config is None or name not in (*_BCTHW, "CogVideoXTransformer3DModel", "LTXVideoTransformer3DModel"):
        return None
    arguments = _arguments(model, args, kwargs)
    x = arguments.get("hidden_states")
    if name == "LTXVideoTransformer3DModel":
        dims = [arguments.get(k) for k in ("num_frames", "height", "width")]
        if not all(isinstance(n, int) for n in dims):
            return None
        patch = _patch(getattr(config, "patch_size", None), 2)
        pt = getattr(config, "patch_size_t", 1)
        return _tokens(*dims, None if patch is None else (pt, *patch), "alone")
    if not isinstance(x, torch.Tensor) or x.dim() != 5:
        return None
    if name == "CogVideoXTransformer3DModel":
        _, frames, _, height, width = x.shape
        patch = _patch(getattr(config, "patch_size", None), 2)
        pt = getattr(config, "patch_size_t", None) or 1
        return _tokens(frames, height, width, None if patch is None else (pt, *patch), "last")
    _, _, frames, height, width = x.shape
    if name in ("HunyuanVideoTransformer3DModel", "MochiTransformer3DModel"):
        patch = _patch(getattr(config, "patch_size", None), 2)
        pt = getattr(config, "patch_size_t", 1) if name == "HunyuanVideoTransformer3DModel" else 1
        patch = None if patch is None else (pt, *patch)
    else:
        patch = _patch(getattr(config, "patch_size", None), 3)
    return _tokens(frames, height, width, patch, _BCTHW[name])
