"""diffusers integration of NVFP4 attention (installed as ``nvfp4_dit.processors``).

* :func:`apply` -- NVFP4 processors on every attention module of a pipeline or model, following
  an :class:`~nvfp4_dit.policy.AttentionPolicy` (role, steps, length, layers), with ``restore()``.
* The diffusers attention backend ``"nvfp4"`` -- registered when this package is imported and
  diffusers is present: ``model.set_attention_backend("nvfp4")``,
  ``with diffusers.attention_backend("nvfp4"):``; :func:`use_backend` does the former with an
  undo that also resets the global backend diffusers leaks.
* :func:`enable_context_parallel` -- diffusers' Ulysses / ring context parallelism over
  ``torch.distributed`` ranks (GPUs with NCCL, or CPU processes with gloo).
* Per-family processors in :mod:`nvfp4_dit.processors.diffusers_processors`.

Importing this package never fails for lack of diffusers; :func:`apply` then raises ImportError.
"""

from __future__ import annotations

import warnings

from nvfp4_dit.policy import AttentionPolicy

from .apply import NVFP4Handle, apply
from .calibrate import calibrate
from .routing import NVFP4FallbackWarning, configure_default, reset_fallback_warnings
from .steps import StepTracker

BACKEND_NAME = "nvfp4"
backend_registered = False
try:
    import diffusers  # noqa: F401
except ImportError:
    diffusers = None

if diffusers is not None:
    from .backend import register_backend, use_backend
    from .context_parallel import enable_context_parallel

    try:
        register_backend()
        backend_registered = True
    except RuntimeError as e:  # a diffusers version without the private names we need
        warnings.warn(f"nvfp4_dit.processors: {e}; apply() still works for dispatch-free models",
                      UserWarning, stacklevel=2)

__all__ = [
    "AttentionPolicy",
    "BACKEND_NAME",
    "NVFP4FallbackWarning",
    "NVFP4Handle",
    "StepTracker",
    "apply",
    "calibrate",
    "backend_registered",
    "configure_default",
    "enable_context_parallel",
    "reset_fallback_warnings",
    "use_backend",
    "register_backend",
]
