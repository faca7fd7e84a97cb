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


def _spatial(config, temporal) -> Optional[tuple[int, int, int]]:
    """(temporal, *the config's spatial patch size), None if unreadable."""
    spatial = _patch(getattr(config, "patch_size", None), 2)
    return None if spatial is None else (temporal, *spatial)


# Per model class: where the latent dims come from ("BCTHW" / "BFCHW": hidden_states' shape;
# "args": the forward's num_frames, height, width), its (pt, ph, pw) patch size, and the video's
# place in the attention's sequence ("first" also where it is alone).
_FAMILIES = {
    "WanTransformer3DModel": ("BCTHW", lambda c: _patch(getattr(c, "patch_size", None), 3), "first"),
    "CosmosTransformer3DModel": ("BCTHW", lambda c: _patch(getattr(c, "patch_size", None), 3), "first"),
    "HunyuanVideoTransformer3DModel": ("BCTHW", lambda c: _spatial(c, getattr(c, "patch_size_t", 1)), "first"),
    "MochiTransformer3DModel": ("BCTHW", lambda c: _spatial(c, 1), "first"),
    "CogVideoXTransformer3DModel": ("BFCHW", lambda c: _spatial(c, getattr(c, "patch_size_t", None) or 1), "last"),
    "LTXVideoTransformer3DModel": ("args", lambda c: _spatial(c, getattr(c, "patch_size_t", 1)), "first"),
}


def video_tokens_of(model: torch.nn.Module, args: tuple, kwargs: dict) -> Optional[VideoTokens]:
    """The video tokens of ``model``'s forward called with ``args`` / ``kwargs`` (the pre-hook's
    view of the call), or None for a model (or an input) this module does not know."""
    family = _FAMILIES.get(type(model).__name__)
    config = getattr(model, "config", None)
    if family is None or config is None:
        return None
    source, read_patch, position = family
    arguments = _arguments(model, args, kwargs)
    if source == "args":
        dims = [arguments.get(k) for k in ("num_frames", "height", "width")]
        if not all(isinstance(n, int) for n in dims):
            return None
    else:
        x = arguments.get("hidden_states")
        if not isinstance(x, torch.Tensor) or x.dim() != 5:
            return None
        dims = x.shape[2:] if source == "BCTHW" else (x.shape[1], *x.shape[3:])
    patch = read_patch(config)
    return None if patch is None else VideoTokens.of_latent(dims, patch, position)
