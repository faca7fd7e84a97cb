"""nvfp4_dit: NVFP4 (FP4 microscaling) attention for video diffusion transformers.

``nvfp4_dit.attention`` is the op; ``nvfp4_dit.apply`` swaps it into a diffusers pipeline or
model, ``nvfp4_dit.calibrate`` measures which of its layers FP4 suits, ``nvfp4_dit.sparse`` holds the
block-sparse estimate (``estimate_block_mask``); the ComfyUI node lives in
``nvfp4_dit.comfyui_node``. ComfyUI and diffusers are imported
only when those entry points are used.
"""

from __future__ import annotations

from . import format, sparse
from .fallback import FallbackWarning, reset_fallback_warnings
from .ops import BACKENDS, BackendUnavailableError, attention, available_backends, run_fp4
from .policy import AttentionPolicy
from .reference import attention_exact, attention_reference

__version__ = "0.1.0"


def __getattr__(name: str):
    # apply() and calibrate() live in the diffusers layer (nvfp4_dit.processors): imported on first
    # use, so that importing nvfp4_dit neither imports diffusers nor registers its backend.
    if name in ("apply", "calibrate"):
        from . import processors

        return getattr(processors, name)
    raise AttributeError(f"module 'nvfp4_dit' has no attribute {name!r}")


__all__ = [
    "BACKENDS",
    "AttentionPolicy",
    "BackendUnavailableError",
    "FallbackWarning",
    "apply",
    "attention",
    "attention_exact",
    "attention_reference",
    "available_backends",
    "calibrate",
    "format",
    "reset_fallback_warnings",
]
