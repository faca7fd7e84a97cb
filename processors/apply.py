"""``apply(pipe_or_model, ...)``: NVFP4 attention for every denoiser of a pipeline, with an undo.

Walks each model's modules, wraps every attention processor whose class has an NVFP4
processor (:func:`~nvfp4_dit.processors.diffusers_processors.processor_class_for`), assigns the
wrapper with ``module.set_processor`` where the module has it and by attribute otherwise
(Cosmos' and Mochi's models have no ``set_attn_processor``), and installs one forward pre-hook
per model that reads the denoising step for the ``dense_steps`` policy.  ``restore()`` puts the
very same original processor objects back and removes the hooks.

Example::

    handle = nvfp4_dit.apply(pipe, dense_steps=(2, 2))   # Wan2.2: transformer and transformer_2
    video = pipe(prompt, num_inference_steps=40).frames[0]
    handle.restore()                                     # or: with nvfp4_dit.apply(pipe): ...
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence, Union

import torch

from nvfp4_dit.format import BALANCE_QK_DEFAULT, QK_FORMAT_DEFAULT
from nvfp4_dit.policy import (DEFAULT_DENSE_STEPS, DEFAULT_MIN_SEQ_LEN, DEFAULT_SPARSE_MIN_SEQ_LEN,
                             DEFAULT_SPARSE_OFF_STEPS, AttentionPolicy, LayerSpec)

from .steps import StepTracker
from .video_tokens import video_tokens_of

_DENOISER_PREFIXES = ("transformer", "controlnet")


def _denoisers(pipe) -> list[tuple[str, torch.nn.Module]]:
    """(component name, model) for every transformer / controlnet of a pipeline."""
    comps = getattr(pipe, "components", None)
    items = list(comps.items()) if isinstance(comps, dict) else [
        (n, getattr(pipe, n, None)) for n in ("transformer", "transformer_2", "controlnet")]
    return [(n, m) for n, m in items
            if isinstance(m, torch.nn.Module) and n.startswith(_DENOISER_PREFIXES)]


def models_of(pipe_or_model) -> tuple[list[tuple[str, torch.nn.Module]], object]:
    """(the (component name, model) pairs apply() covers, the pipeline or None for a bare model)."""
    if isinstance(pipe_or_model, torch.nn.Module):
        return [("", pipe_or_model)], None
    models = _denoisers(pipe_or_model)
    if not models:
        raise TypeError("apply() takes a diffusers pipeline with a transformer/controlnet component "
                        f"or an nn.Module, got {type(pipe_or_model).__name__}")
    return models, pipe_or_model


def model_class_of(models: list[tuple[str, torch.nn.Module]]) -> str:
    """The class name a calibrated policy records: the denoisers' classes, joined by "+"."""
    return "+".join(sorted({type(m).__name__ for _, m in models}))


def _left_dense(model: torch.nn.Module, name: str) -> Optional[str]:
    """Why a module stays on its original processor regardless of the policy, or None."""
    if type(model).__name__.startswith("HunyuanVideo") and "token_refiner" in name:
        return "HunyuanVideo token refiner (short text-only attention with a 2-D mask)"
    return None


def _timestep_position(model: torch.nn.Module) -> Optional[int]:
    try:
        params = list(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return None
    return params.index("timestep") if "timestep" in params else None


@dataclass
class _Swap:
    module: torch.nn.Module
    original: object
    wrapper: object


@dataclass
class NVFP4Handle:
    """What :func:`apply` changed. ``restore()`` (or leaving a ``with`` block) undoes it.

    Attributes:
        policy: the :class:`~nvfp4_dit.policy.AttentionPolicy` every installed processor follows.
        steps: the :class:`~nvfp4_dit.processors.steps.StepTracker` of the denoising step.
        processors: module path -> NVFP4 processor that was installed.
        skipped: module path -> why its processor was left as is.
    """

    policy: AttentionPolicy
    steps: StepTracker
    processors: dict = field(default_factory=dict)
    skipped: dict = field(default_factory=dict)
    _swaps: list = field(default_factory=list, repr=False)
    _hooks: list = field(default_factory=list, repr=False)
    restored: bool = False

    def restore(self) -> None:
        """Put the original processors back and remove the step hooks (idempotent)."""
        if self.restored:
            return
        for swap in reversed(self._swaps):
            _assign(swap.module, swap.original)
        for h in self._hooks:
            h.remove()
        self._swaps.clear()
        self._hooks.clear()
        self.restored = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.restore()
        return False

    # Step control, forwarded to the step tracker (see nvfp4_dit.processors.steps).
    def callback_on_step_end(self, pipe, step_index, timestep, callback_kwargs):
        return self.steps.callback_on_step_end(pipe, step_index, timestep, callback_kwargs)

    def set_step(self, index: int, total: int) -> None:
        self.steps.set_step(index, total)


def _assign(module: torch.nn.Module, processor) -> None:
    if hasattr(module, "set_processor"):
        module.set_processor(processor)
    else:  # MochiAttention has neither set_processor nor get_processor
        module.processor = processor


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
    balance_qk: bool = BALANCE_QK_DEFAULT,
    qk_format: str = QK_FORMAT_DEFAULT,
    policy: Union[AttentionPolicy, str, os.PathLike, None] = None,
    keep_mass: Optional[float] = None,
    sparse_off_steps: Optional[Sequence[int]] = DEFAULT_SPARSE_OFF_STEPS,
    sparse_min_seq_len: int = DEFAULT_SPARSE_MIN_SEQ_LEN,
) -> NVFP4Handle:
    """Swap NVFP4 attention into a diffusers pipeline or model.

    Args:
        pipe_or_model: a ``DiffusionPipeline`` (every ``transformer*`` / ``controlnet*``
            component is covered, e.g. Wan2.2's ``transformer_2``) or a single ``nn.Module``.
        backend: ``nvfp4_dit.attention`` back-end: "auto" (the CUDA kernel where the native FP4
            MMA exists, else exact SDPA), "cuda", "reference" (pure-torch FP4 numerics), "sdpa".
        self_attention: NVFP4 for self-/joint attention (default True).
        cross_attention: NVFP4 for cross-attention to text/image context (default False: short
            K/V, no speed-up, visible quality cost).
        dense_steps: ``(first, last)`` denoising steps that run exact (default (1, 1)); the step
            comes from the pipeline's scheduler, ``handle.callback_on_step_end``,
            ``handle.set_step``, or, for a bare model, ``timesteps=`` (:mod:`nvfp4_dit.processors.steps`).
        min_seq_len: calls whose query or key sequence is shorter run exact (default 1024).
        layers: allow-list of module-name patterns (fnmatch) or block indices; None = all.
        timesteps: the sampling schedule, for ``dense_steps`` with a bare model.
        balance_qk: balance Q and K per channel before quantising (:func:`nvfp4_dit.attention`).
        qk_format: "nvfp4" (default) or "mxfp8": the format of Q and K (:func:`nvfp4_dit.attention`).
        keep_mass: block-sparse NVFP4 (``nvfp4_dit.attention``'s ``keep_mass``, estimated in every
            call); None (default) = dense. ``sparse_off_steps`` ``(first, last)`` steps (default
            (2, 0)) and calls shorter than ``sparse_min_seq_len`` tokens (default 16384) stay dense
            NVFP4 (:class:`~nvfp4_dit.policy.AttentionPolicy`).
        observe_only: compute every selected call exactly as the unmodified model but route it
            through the processors, so :func:`~nvfp4_dit.processors.routing.add_observer`
            observers see it (dense baselines for timing and attention capture).
        policy: an :class:`~nvfp4_dit.policy.AttentionPolicy`, or the path of one saved as JSON
            (a calibrated policy from :func:`nvfp4_dit.calibrate`), instead of the policy
            arguments above (giving both is a TypeError).  Its per-layer entries must name this
            model's class and modules (ValueError otherwise).

    Returns:
        An :class:`NVFP4Handle`; ``handle.restore()`` or ``with apply(...):`` undoes the swap.

    Raises:
        TypeError / ValueError for bad arguments; ValueError if NVFP4 processors are already
        installed on the model (restore the earlier handle first); ImportError without diffusers.
    """
    try:
        from . import diffusers_processors as dp
    except ImportError as e:
        raise ImportError("nvfp4_dit.apply needs diffusers (pip install diffusers==0.42.1)") from e

    settings = dict(backend=backend, self_attention=self_attention, cross_attention=cross_attention,
                    dense_steps=dense_steps, min_seq_len=min_seq_len, layers=layers, balance_qk=balance_qk,
                    qk_format=qk_format, keep_mass=keep_mass, sparse_off_steps=sparse_off_steps,
                    sparse_min_seq_len=sparse_min_seq_len)
    if policy is None:
        policy = AttentionPolicy(**settings)
    else:
        params = inspect.signature(apply).parameters
        changed = [k for k, v in settings.items() if v != params[k].default]
        if changed:
            raise TypeError(f"apply() takes either policy= or the policy arguments, got both (policy and {changed})")
        if isinstance(policy, (str, os.PathLike)):
            policy = AttentionPolicy.load(policy)
        elif not isinstance(policy, AttentionPolicy):
            raise TypeError(f"policy must be an AttentionPolicy or the path of a saved one, got {type(policy).__name__}")
    if not isinstance(observe_only, bool):
        raise TypeError(f"observe_only must be a bool, got {type(observe_only).__name__}")
    models, pipeline = models_of(pipe_or_model)
    steps = StepTracker(policy, timesteps=timesteps, pipeline=pipeline)

    handle = NVFP4Handle(policy=policy, steps=steps)
    plans = []
    for prefix, model in models:
        for name, module in model.named_modules():
            proc = getattr(module, "processor", None)
            if proc is None:
                continue
            full = f"{prefix}.{name}" if prefix else name
            if isinstance(proc, dp.NVFP4AttnProcessorBase):
                raise ValueError(f"{full} already has an NVFP4 processor: restore() the earlier apply() first")
            why = _left_dense(model, name)
            cls = None if why else dp.processor_class_for(type(proc))
            if cls is None:
                handle.skipped[full] = why or f"no NVFP4 processor for {type(proc).__name__}"
                continue
            plans.append((module, proc, cls, full))
    policy.check_layers(model_class_of(models), [full for *_, full in plans])
    for module, proc, cls, full in plans:
        wrapper = cls(proc, policy=policy, steps=steps, observe_only=observe_only, name=full)
        _assign(module, wrapper)
        handle._swaps.append(_Swap(module, proc, wrapper))
        handle.processors[full] = wrapper

    sparse = policy.may_run_sparse   # the video tokens serve block-sparse calls only
    for _, model in models:
        pos = _timestep_position(model)

        def pre_hook(module, args, kwargs, _pos=pos):
            t = kwargs.get("timestep")
            if t is None and _pos is not None and len(args) > _pos:
                t = args[_pos]
            steps.begin_forward(t, video=video_tokens_of(module, args, kwargs) if sparse else None)

        handle._hooks.append(model.register_forward_pre_hook(pre_hook, with_kwargs=True))
    return handle
