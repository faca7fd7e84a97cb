"""nvfp4_dit: NVFP4 (FP4 microscaling) attention for video diffusion transformers.

``nvfp4_dit.attention`` is the op; ``nvfp4_dit.apply`` swaps it into a diffusers pipeline or
model; the ComfyUI node lives in ``nvfp4_dit.comfyui_node``.  ComfyUI and diffusers are
imported only when those entry points are used.
"""

from . import format
from .ops import (
    BACKENDS,
    BackendUnavailableError,
    FallbackWarning,
    attention,
    available_backends,
    reset_fallback_warnings,
)
from .reference import attention_exact, attention_reference

__version__ = "0.1.0"


def apply(pipe_or_model, **kwargs):
    """Swap NVFP4 attention into a diffusers pipeline or model; see :mod:`nvfp4_dit.processors`.

    Returns a handle whose ``restore()`` (or context-manager exit) puts the original
    processors back.
    """
    from .processors import apply as _apply

    return _apply(pipe_or_model, **kwargs)


__all__ = [
    "BACKENDS",
    "BackendUnavailableError",
    "FallbackWarning",
    "apply",
    "attention",
    "attention_exact",
    "attention_reference",
    "available_backends",
    "format",
    "reset_fallback_warnings",
]
