"""nvfp4_dit: NVFP4 (FP4 microscaling) attention for video diffusion transformers.

``nvfp4_dit.attention`` is the op; ``nvfp4_dit.apply`` swaps it into a diffusers pipeline or
model, ``nvfp4_dit.calibrate`` measures which of its layers FP4 suits; the ComfyUI node lives in
``nvfp4_dit.comfyui_node``. ComfyUI and diffusers are imported
only when those entry points are used.
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

from . import format
from .fallback import FallbackWarning, reset_fallback_warnings
from .ops import BACKENDS, BackendUnavailableError, attention, available_backends
from .policy import DEFAULT_DENSE_STEPS, DEFAULT_MIN_SEQ_LEN, AttentionPolicy, LayerSpec
from .reference import attention_exact, attention_reference

__version__ = "0.1.0"


def apply(
    pipe_or_model,
    *,
    backend: str = "auto",
    self_attention: bool = True,
    cross_attention: bool = False,
    dense_steps: Optional[Sequence[int]] = DEFAULT_DENSE_STEPS,
    min_seq_len: int = DEFAULT_MIN_SEQ_LEN,
    layers: Optional[Iterable[LayerSpec]] = None,
    timesteps=None,
    observe_only: bool = False,
    balance_qk: bool = format.BALANCE_QK_DEFAULT,
    qk_format: str = format.QK_FORMAT_DEFAULT,
    policy=None,
):
    """Swap NVFP4 attention into a diffusers pipeline or model (:func:`nvfp4_dit.processors.apply`).

    The policy arguments are those of :class:`~nvfp4_dit.policy.AttentionPolicy`; ``timesteps``
    gives a bare model's sampling schedule (for ``dense_steps``) and ``observe_only`` routes every
    call but computes it exactly; ``policy`` (an :class:`AttentionPolicy` or the path of a saved
    one, e.g. from :func:`calibrate`) replaces the policy arguments. Returns a handle whose
    ``restore()`` (or context-manager exit) puts the original processors back.
    """
    from .processors import apply as _apply

    return _apply(pipe_or_model, backend=backend, self_attention=self_attention, cross_attention=cross_attention,
                  dense_steps=dense_steps, min_seq_len=min_seq_len, layers=layers, timesteps=timesteps,
                  observe_only=observe_only, balance_qk=balance_qk, qk_format=qk_format, policy=policy)


def calibrate(pipe_or_model, run, *, budget: Optional[float] = None, steps=None, policy=None, timesteps=None):
    """Measure each attention module's NVFP4 error on ``run()`` and return a per-layer policy
    (:func:`nvfp4_dit.processors.calibrate.calibrate`); use it with ``apply(pipe, policy=...)``."""
    from .calibration import DEFAULT_BUDGET
    from .processors.calibrate import calibrate as _calibrate

    return _calibrate(pipe_or_model, run, budget=DEFAULT_BUDGET if budget is None else budget, steps=steps,
                      policy=policy, timesteps=timesteps)


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
