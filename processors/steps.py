"""Which attention calls run NVFP4 and which stay dense.

Three independent rules (all must allow FP4):

* **Role** -- self-attention (including joint text+video attention) is FP4 by default,
  cross-attention (short text K/V, no speed-up, visible quality cost) is dense by default.
* **Layer allow-list** -- ``layers=None`` means every attention module; otherwise a list of
  module-name patterns (``fnmatch``, e.g. ``"blocks.*.attn1"``) or block indices (``3`` matches
  ``blocks.3.attn1`` and ``transformer_blocks.3.attn``).  Decided once per module by
  :func:`~nvfp4_dit.processors.apply.apply`.
* **Steps** -- ``dense_steps=(first, last)``: the first ``first`` and last ``last`` denoising
  steps run dense (early steps fix the layout, late ones fine detail; SageAttention3 users do
  the same).  The step is read once per transformer forward by a forward pre-hook that apply()
  installs, from (in order):

  1. an explicit step: :meth:`AttentionPolicy.set_step` or the pipeline callback
     :meth:`AttentionPolicy.callback_on_step_end` (``pipe(..., callback_on_step_end=handle.callback_on_step_end)``);
  2. the pipeline's scheduler (``scheduler.step_index`` and ``len(scheduler.timesteps)``, or
     ``pipe._current_timestep`` looked up in ``scheduler.timesteps``) -- automatic when apply()
     is given a pipeline;
  3. the ``timestep`` argument of the transformer's forward looked up in ``timesteps=`` given to
     apply() (for bare models driven by your own loop).

The policy holds no tensors: only Python numbers and the step decision of the current forward.
"""

from __future__ import annotations

import fnmatch
import re
import warnings
from typing import Iterable, Optional, Sequence, Union

import torch

from .routing import DEFAULT_MIN_SEQ_LEN, RouteSettings

LayerSpec = Union[str, int]
_INDEX = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


def _check_dense_steps(dense_steps) -> tuple[int, int]:
    if dense_steps is None:
        return (0, 0)
    if (not isinstance(dense_steps, (tuple, list)) or len(dense_steps) != 2
            or any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in dense_steps)):
        raise ValueError(f"dense_steps must be a pair (first, last) of non-negative ints, got {dense_steps!r}")
    return int(dense_steps[0]), int(dense_steps[1])


def _check_layers(layers) -> Optional[tuple[LayerSpec, ...]]:
    if layers is None:
        return None
    if isinstance(layers, (str, int)):
        layers = [layers]
    out = []
    for spec in layers:
        if isinstance(spec, bool) or not isinstance(spec, (str, int)):
            raise TypeError(f"layers entries must be module-name patterns (str) or block indices (int), got {spec!r}")
        if isinstance(spec, int) and spec < 0:
            raise ValueError(f"layers block index must be >= 0, got {spec}")
        out.append(spec)
    return tuple(out)


class AttentionPolicy:
    """The FP4/dense decision for each attention call; shared by all processors of one apply().

    Args:
        self_attention: run self-/joint attention in NVFP4.
        cross_attention: run cross-attention (to text/image context) in NVFP4.
        dense_steps: ``(first, last)`` denoising steps that run dense.
        min_seq_len: calls with a query or key sequence shorter than this run dense.
        backend: the ``nvfp4_dit.attention`` back-end for FP4 calls.
        layers: allow-list of module-name patterns / block indices (None = all).
        timesteps: the sampling schedule, to find the step from the forward's ``timestep``.
        observe_only: the calls that would run FP4 run exactly as the unmodified model, but
            still pass the router, so observers (timing, capture) see them.
    """

    def __init__(
        self,
        *,
        self_attention: bool = True,
        cross_attention: bool = False,
        dense_steps: Optional[Sequence[int]] = (0, 0),
        min_seq_len: int = DEFAULT_MIN_SEQ_LEN,
        backend: str = "auto",
        layers: Optional[Iterable[LayerSpec]] = None,
        timesteps=None,
        observe_only: bool = False,
    ):
        for name, val in (("self_attention", self_attention), ("cross_attention", cross_attention)):
            if not isinstance(val, bool):
                raise TypeError(f"{name} must be a bool, got {type(val).__name__}")
        self.self_attention = self_attention
        self.cross_attention = cross_attention
        self.dense_steps = _check_dense_steps(dense_steps)
        if not isinstance(observe_only, bool):
            raise TypeError(f"observe_only must be a bool, got {type(observe_only).__name__}")
        self.settings = RouteSettings(backend=backend, min_seq_len=min_seq_len, observe_only=observe_only)
        self.layers = _check_layers(layers)
        self.timesteps: Optional[tuple[float, ...]] = None
        if timesteps is not None:
            ts = timesteps.detach().flatten().tolist() if isinstance(timesteps, torch.Tensor) else list(timesteps)
            if not ts or not all(isinstance(t, (int, float)) for t in ts):
                raise ValueError("timesteps must be a non-empty sequence of numbers")
            self.timesteps = tuple(float(t) for t in ts)
        self.pipeline = None  # set by apply() for the scheduler step source
        self._explicit: Optional[tuple[int, int]] = None
        self._warned_no_step = False
        # Decision for the forward in progress (a bool, recomputed by every pre-hook call).
        self.step_dense = False
        self.current_step: Optional[tuple[int, int]] = None

    # -- per module -------------------------------------------------------------------------

    def layer_allowed(self, name: Optional[str]) -> bool:
        """Whether the module called ``name`` (path inside its model, or with the pipeline
        component prefix) may run FP4 under the allow-list."""
        if self.layers is None:
            return True
        if name is None:
            return False
        parts = name.split(".")
        for spec in self.layers:
            if isinstance(spec, int):
                m = _INDEX.search(name)
                if m is not None and int(m.group(1)) == spec:
                    return True
            elif fnmatch.fnmatchcase(name, spec) or (len(parts) > 1 and fnmatch.fnmatchcase(".".join(parts[1:]), spec)):
                return True
        return False

    # -- per call ---------------------------------------------------------------------------

    def settings_for(self, cross: bool) -> Optional[RouteSettings]:
        """RouteSettings for an FP4 call of this role, or None when it must run dense."""
        if (self.cross_attention if cross else self.self_attention) and not self.step_dense:
            return self.settings
        return None

    # -- steps ------------------------------------------------------------------------------

    def set_step(self, index: int, total: int) -> None:
        """Declare the denoising step the next forwards belong to (0-based, of ``total``)."""
        if isinstance(index, bool) or not isinstance(index, int) or isinstance(total, bool) or not isinstance(total, int):
            raise TypeError("set_step(index, total) takes two ints")
        if total <= 0 or not 0 <= index:
            raise ValueError(f"set_step needs 0 <= index and total > 0, got {index}, {total}")
        self._explicit = None if index >= total else (index, total)

    def clear_step(self) -> None:
        self._explicit = None

    def callback_on_step_end(self, pipe, step_index, timestep, callback_kwargs):
        """A diffusers ``callback_on_step_end``: after step i, the next forwards are step i+1."""
        total = getattr(pipe, "num_timesteps", None) or getattr(pipe, "_num_timesteps", None)
        if isinstance(total, int) and total > 0:
            self.set_step(int(step_index) + 1, total)
        return callback_kwargs

    def _step_from_pipeline(self) -> Optional[tuple[int, int]]:
        pipe = self.pipeline
        sched = getattr(pipe, "scheduler", None) if pipe is not None else None
        ts = getattr(sched, "timesteps", None)
        if ts is None or len(ts) == 0:
            return None
        n = len(ts)
        if hasattr(type(sched), "step_index") or hasattr(sched, "_step_index"):
            idx = getattr(sched, "step_index", None)
            if idx is None:  # before the first scheduler.step() of a run
                idx = getattr(sched, "begin_index", None) or 0
            return (min(int(idx), n - 1), n)
        t = getattr(pipe, "_current_timestep", None)
        if t is None:
            return None
        return (self._nearest(float(t.flatten()[0]) if isinstance(t, torch.Tensor) else float(t),
                              [float(x) for x in ts.flatten().tolist()]), n)

    @staticmethod
    def _nearest(t: float, schedule: Sequence[float]) -> int:
        return min(range(len(schedule)), key=lambda i: abs(schedule[i] - t))

    def _step_from_timestep(self, timestep) -> Optional[tuple[int, int]]:
        if self.timesteps is None or timestep is None:
            return None
        t = float(timestep.flatten()[0]) if isinstance(timestep, torch.Tensor) else float(timestep)
        return (self._nearest(t, self.timesteps), len(self.timesteps))

    def begin_forward(self, timestep=None) -> None:
        """Decide dense/FP4 for the transformer forward about to run (called by the pre-hook)."""
        info = self._explicit or self._step_from_pipeline() or self._step_from_timestep(timestep)
        self.current_step = info
        first, last = self.dense_steps
        if info is None:
            if (first or last) and not self._warned_no_step:
                self._warned_no_step = True
                warnings.warn("nvfp4_dit.apply: dense_steps is set but the denoising step is unknown "
                              "(apply() got a bare model without timesteps=, and no set_step/"
                              "callback_on_step_end); every step runs NVFP4", UserWarning, stacklevel=3)
            self.step_dense = False
            return
        i, n = info
        self.step_dense = i < first or i >= n - last

    def __repr__(self) -> str:
        return (f"AttentionPolicy(self_attention={self.self_attention}, cross_attention={self.cross_attention}, "
                f"dense_steps={self.dense_steps}, min_seq_len={self.settings.min_seq_len}, "
                f"backend={self.settings.backend!r}, layers={self.layers})")
