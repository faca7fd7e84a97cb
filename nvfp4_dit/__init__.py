"""nvfp4_dit: NVFP4 (FP4 microscaling) attention for video diffusion transformers.

``nvfp4_dit.attention`` is the op; ``nvfp4_dit.apply`` swaps it into a diffusers pipeline or
model, ``nvfp4_dit.calibrate`` measures which of its layers FP4 suits, ``nvfp4_dit.sparse`` holds the
block-sparse estimate (``estimate_block_mask``); the ComfyUI node lives in
``nvfp4_dit.comfyui_node``. ComfyUI and diffusers are imported
only when those entry points are used.
"""

from __future__ import annotations

__version__ = "0.1.0"

# Every name is imported on first use, so that importing nvfp4_dit (or a torch-free module of it,
# such as nvfp4_dit.defaults or nvfp4_dit.cli) imports neither torch nor diffusers. apply() and
# calibrate() live in the diffusers layer (nvfp4_dit.processors): importing them registers the
# diffusers backend.
_LAZY = {
    "format": (".format", None), "sparse": (".sparse", None),
    "FallbackWarning": (".fallback", "FallbackWarning"),
    "reset_fallback_warnings": (".fallback", "reset_fallback_warnings"),
    "BACKENDS": (".ops", "BACKENDS"), "BackendUnavailableError": (".ops", "BackendUnavailableError"),
    "attention": (".ops", "attention"), "available_backends": (".ops", "available_backends"),
    "run_fp4": (".ops", "run_fp4"), "AttentionPolicy": (".policy", "AttentionPolicy"),
    "attention_exact": (".reference", "attention_exact"),
    "attention_reference": (".reference", "attention_reference"),
    "apply": (".processors", "apply"), "calibrate": (".processors", "calibrate"),
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'nvfp4_dit' has no attribute {name!r}")
    import importlib

    module_name, attribute = _LAZY[name]
    module = importlib.import_module(module_name, __name__)
    value = module if attribute is None else getattr(module, attribute)
    if name not in ("apply", "calibrate"):   # cached; apply/calibrate stay looked up in processors
        globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


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
