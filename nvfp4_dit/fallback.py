"""Reporting that a call ran exact attention instead of NVFP4: one warning per reason per process.

The op (:mod:`nvfp4_dit.ops`), the diffusers router and the ComfyUI override all report through
:func:`warn_once`, so one :func:`reset_fallback_warnings` covers all of them and one warnings
filter on :class:`FallbackWarning` silences all of them.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from typing import Optional


class FallbackWarning(UserWarning):
    """Issued once per reason when an attention call runs exact attention instead of NVFP4."""


_reported: set[tuple[type, str]] = set()

# Packages whose frames stand between the user's code and the report: ours (the processors and the
# ComfyUI node live in their own source folders in a checkout), torch's dispatch of the custom op,
# and diffusers' model code around a processor.
_INTERNAL_MODULES = ("nvfp4_dit", "nvfp4_dit.processors", "nvfp4_dit.comfyui_node", "torch", "diffusers")


def _internal_dirs() -> tuple[str, ...]:
    dirs = []
    for name in _INTERNAL_MODULES:
        module = sys.modules.get(name)
        path = getattr(module, "__file__", None)
        if path:
            dirs.append(os.path.dirname(os.path.abspath(path)) + os.sep)
    return tuple(dirs)


def caller_stacklevel() -> int:
    """The ``stacklevel`` that makes ``warnings.warn``, called by the caller of this function,
    point at the first frame outside nvfp4_dit, torch and diffusers: the user's line."""
    internal = _internal_dirs()
    frame = sys._getframe(2)  # the caller of our caller: stacklevel 2 for its warnings.warn
    level = 2
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(internal):
        frame = frame.f_back
        level += 1
    return level if frame is not None else 2


def warn_once(message: str, category: type = FallbackWarning, *, logger: Optional[logging.Logger] = None) -> None:
    """Report ``message`` the first time this (category, message) pair comes up in this process.

    It goes to ``warnings.warn`` pointing at the user's line, or, with ``logger``, to
    ``logger.warning`` (ComfyUI shows its log, not Python warnings).
    """
    key = (category, message)
    if key in _reported:
        return
    _reported.add(key)
    if logger is not None:
        logger.warning("%s", message)
    else:
        warnings.warn(message, category, stacklevel=caller_stacklevel())


def reset_fallback_warnings() -> None:
    """Forget which reasons were reported (for tests and long-lived servers)."""
    _reported.clear()
