"""The denoising step of the transformer forward in progress, for the ``dense_steps`` rule.

:class:`StepTracker` is read once per forward by a pre-hook that :func:`~nvfp4_dit.processors.apply`
installs. The step comes from, in order:

1. an explicit step: :meth:`StepTracker.set_step` or the pipeline callback
   :meth:`StepTracker.callback_on_step_end` (``pipe(..., callback_on_step_end=handle.callback_on_step_end)``);
2. the pipeline's scheduler (``scheduler.step_index`` and ``len(scheduler.timesteps)``, or
   ``pipe._current_timestep`` looked up in ``scheduler.timesteps``) -- automatic when apply() is
   given a pipeline;
3. the ``timestep`` argument of the transformer's forward looked up in ``timesteps=`` given to
   apply() (for bare models driven by your own loop).

It holds Python numbers only: the schedule and the step of the current forward, and the forward's
video tokens (:func:`~nvfp4_dit.processors.video_tokens.video_tokens_of`, for a block-sparse
call's estimate), both found again in every forward.
"""

from __future__ import annotations

import warnings
from typing import Optional, Sequence

import torch

from nvfp4_dit.policy import AttentionPolicy
from nvfp4_dit.sparse import VideoTokens


class StepTracker:
    """Where in the sampling schedule the transformer forward in progress is."""

    def __init__(self, policy: AttentionPolicy, *, timesteps=None, pipeline=None):
        self.policy = policy
        self.timesteps: Optional[tuple[float, ...]] = None
        if timesteps is not None:
            ts = timesteps.detach().flatten().tolist() if isinstance(timesteps, torch.Tensor) else list(timesteps)
            if not ts or not all(isinstance(t, (int, float)) for t in ts):
                raise ValueError("timesteps must be a non-empty sequence of numbers")
            self.timesteps = tuple(float(t) for t in ts)
        self.pipeline = pipeline
        self._explicit: Optional[tuple[int, int]] = None
        self._warned_no_step = False
        # The forward in progress: its (index, total) or None, and whether the policy keeps it dense.
        self.current_step: Optional[tuple[int, int]] = None
        self.step_dense = False
        self.current_video: Optional[VideoTokens] = None

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

    def begin_forward(self, timestep=None, video: Optional[VideoTokens] = None) -> None:
        """Find the step of the transformer forward about to run and take its video tokens (called by
        the pre-hook)."""
        info = self._explicit or self._step_from_pipeline() or self._step_from_timestep(timestep)
        self.current_step, self.current_video = info, video
        if info is None and any(self.policy.dense_steps) and not self._warned_no_step:
            self._warned_no_step = True
            warnings.warn("nvfp4_dit.apply: dense_steps is set but the denoising step is unknown (a bare model "
                          "without timesteps=, and no set_step/callback_on_step_end); every step runs NVFP4",
                          UserWarning, stacklevel=3)
        self.step_dense = self.policy.step_is_dense(info)
