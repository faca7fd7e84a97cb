"""NVFP4 attention processors for the diffusers video transformers.

Each processor wraps the model's own processor and replaces only its core attention call, so
projections, qk-norm, RoPE, joint text+video concatenation, masks and the output projection are
the original code running unchanged.  A dense call (policy says so) *is* the original processor,
bit for bit.  How the core call is reached depends on the family:

* ``dispatch`` -- the processor calls ``dispatch_attention_fn(..., backend=self._attention_backend)``
  (Wan, HunyuanVideo, LTX-Video, MiniMax-H3, ...): the FP4 call runs a copy of the original
  processor whose ``_attention_backend`` is the registered "nvfp4" backend.
* ``global`` -- the processor dispatches without ``backend=`` (Cosmos 2_0 / 2_5): the FP4 call
  makes "nvfp4" the global active backend for its duration and restores the previous one.
* ``sdpa`` -- the processor calls ``F.scaled_dot_product_attention`` itself (CogVideoX, Mochi,
  plain ``Attention`` with ``AttnProcessor2_0``): the FP4 call runs the original under a
  ``TorchFunctionMode`` that redirects exactly that function.

Every processor advertises the wrapped processor's ``__call__`` signature: ``Attention.forward``
and ``LTXAttention.forward`` drop keywords the processor does not name, which would silently
remove RoPE (``image_rotary_emb``) from a ``*args, **kwargs`` wrapper.

Usable directly, e.g. ``pipe.transformer.set_attn_processor(NVFP4WanAttnProcessor(backend="cuda"))``
(one instance may serve every module: the role is read from each call), or through
:func:`nvfp4_dit.processors.apply.apply`, which maps every module by its original class.
"""

from __future__ import annotations

import copy
import importlib
import inspect
from typing import Optional

import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from nvfp4_dit import planner
from nvfp4_dit.policy import AttentionPolicy

from . import backend as _backend
from . import routing
from .steps import StepTracker

ROUTE_DISPATCH, ROUTE_GLOBAL, ROUTE_SDPA = "dispatch", "global", "sdpa"
# Role of a call: "context" = cross-attention iff encoder_hidden_states is given; "self" = always
# self/joint attention (text and video in one sequence); "cross" = always cross-attention.
ROLE_CONTEXT, ROLE_SELF, ROLE_CROSS = "context", "self", "cross"

_SDPA = F.scaled_dot_product_attention
_SDPA_SIG = inspect.Signature([
    inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=d)
    for n, d in (("query", inspect.Parameter.empty), ("key", inspect.Parameter.empty),
                 ("value", inspect.Parameter.empty), ("attn_mask", None), ("dropout_p", 0.0),
                 ("is_causal", False), ("scale", None), ("enable_gqa", False))
])


def _find(module: str, name: str):
    """A diffusers class by module path and name, or None where this version lacks it."""
    try:
        return getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None


class _SDPARedirect(TorchFunctionMode):
    """Sends ``F.scaled_dot_product_attention`` calls to :func:`routing.routed_attention`.

    Other torch functions pass through untouched; inside the handler the mode is off, so the
    fallback and the op itself run normally.
    """

    def __init__(self, policy: AttentionPolicy, observe: Optional[str] = None):
        super().__init__()
        self.policy = policy
        self.observe = observe

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not _SDPA:
            return func(*args, **kwargs)
        try:
            bound = _SDPA_SIG.bind(*args, **kwargs)
        except TypeError:
            return func(*args, **kwargs)  # let SDPA raise its own error
        a = bound.arguments
        return routing.routed_attention(
            a["query"], a["key"], a["value"], layout="HND", attn_mask=a.get("attn_mask"),
            dropout_p=a.get("dropout_p", 0.0), is_causal=a.get("is_causal", False), scale=a.get("scale"),
            enable_gqa=a.get("enable_gqa", False), return_lse=False, policy=self.policy, observe=self.observe,
            exact=lambda: func(*args, **kwargs),
        )


class NVFP4AttnProcessorBase:
    """Common machinery; subclasses name ``original_class``, ``route`` and ``role``.

    Args:
        original: the processor instance to wrap (default: a fresh ``original_class()``).
        policy: an :class:`~nvfp4_dit.policy.AttentionPolicy` (shared by apply()).
        steps: the :class:`~nvfp4_dit.processors.steps.StepTracker` for ``dense_steps`` (apply()
            installs one per pipeline; without it the step is unknown and no step is dense).
        observe_only: route every call but compute it exactly (observers still see it).
        backend, min_seq_len, self_attention, cross_attention: build a policy when none is given.
        name: the module path, for the layer allow-list and reports.
    """

    original_class: Optional[type] = None
    route: str = ROUTE_DISPATCH
    role: str = ROLE_CONTEXT

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.original_class is None:
            return
        sig = inspect.signature(cls.original_class.__call__)

        def __call__(self, attn, *args, **kwargs):
            return self._forward(attn, args, kwargs)

        # Keep the wrapped signature (self included: inspect drops it for the bound method).
        __call__.__signature__ = sig
        __call__.__doc__ = f"NVFP4 wrapper of {cls.original_class.__qualname__}.__call__{sig}"
        cls.__call__ = __call__
        params = list(sig.parameters)[2:]  # after (self, attn)
        cls._ehs_pos = params.index("encoder_hidden_states") if "encoder_hidden_states" in params else None

    def __init__(self, original=None, *, policy: Optional[AttentionPolicy] = None,
                 steps: Optional[StepTracker] = None, observe_only: bool = False, name: Optional[str] = None,
                 backend: str = "auto", min_seq_len: Optional[int] = None, self_attention: bool = True,
                 cross_attention: bool = False):
        cls = type(self)
        if cls.original_class is None:
            raise TypeError(f"{cls.__name__} is not available with this diffusers version")
        if original is None:
            original = cls.original_class()
        if type(original) is not cls.original_class:
            raise TypeError(f"{cls.__name__} wraps {cls.original_class.__name__}, got {type(original).__name__}")
        if policy is None:
            kw = {} if min_seq_len is None else {"min_seq_len": min_seq_len}
            policy = AttentionPolicy(self_attention=self_attention, cross_attention=cross_attention,
                                     backend=backend, **kw)
        elif not isinstance(policy, AttentionPolicy):
            raise TypeError(f"policy must be an AttentionPolicy, got {type(policy).__name__}")
        self.original = original
        self.policy = policy
        self.steps = steps
        self.observe_only = observe_only
        self.name = name
        self.enabled = policy.layer_allowed(name)  # no name + an allow-list: stays exact
        # A calibrated policy: the uniform policy of each NVFP4 precision (and calibrated keep_mass)
        # this layer may run in, made once per pair.
        self._precision_policies = policy.precision_policies() if policy.per_layer else {}
        self._entry_policies: dict = {}
        if cls.route == ROUTE_DISPATCH:
            self._fp4 = copy.copy(original)
            self._fp4._attention_backend = _backend.backend_member()
        else:
            _backend.backend_member()  # the global route needs the name registered
            self._fp4 = original

    # ``set_attention_backend`` / ``enable_parallelism`` write these on every processor that has
    # them; forward them so the dense path follows the user's backend and CP reaches both paths.
    @property
    def _attention_backend(self):
        if not hasattr(self.original, "_attention_backend"):
            raise AttributeError("_attention_backend")
        return self.original._attention_backend

    @_attention_backend.setter
    def _attention_backend(self, value):
        self.original._attention_backend = value

    @property
    def _parallel_config(self):
        if not hasattr(self.original, "_parallel_config"):
            raise AttributeError("_parallel_config")
        return self.original._parallel_config

    @_parallel_config.setter
    def _parallel_config(self, value):
        self.original._parallel_config = value
        if self._fp4 is not self.original:
            self._fp4._parallel_config = value

    def _is_cross(self, args, kwargs) -> bool:
        if self.role != ROLE_CONTEXT:
            return self.role == ROLE_CROSS
        if "encoder_hidden_states" in kwargs:
            return kwargs["encoder_hidden_states"] is not None
        pos = self._ehs_pos
        return pos is not None and len(args) > pos and args[pos] is not None

    def _entry_policy(self, precision, step) -> AttentionPolicy:
        """The uniform policy of this layer's calibrated ``precision`` and keep_mass at ``step``."""
        keep_mass = self.policy.layer_entry(self.name, step).keep_mass
        key = (precision, keep_mass)
        found = self._entry_policies.get(key)
        if found is None:
            found = self._precision_policies[precision]
            if keep_mass is not None:
                found = found.replace(keep_mass=keep_mass)
            self._entry_policies[key] = found
        return found

    def _forward(self, attn, args, kwargs):
        step = self.steps.current_step if self.steps is not None else None
        # The tensor-free rules of the call planner (role, step, layer, calibrated precision); the
        # router applies the rest (lengths, eligibility, back-end, mask) to the tensors.
        reason, precision = planner.policy_reason(self.policy, cross=self._is_cross(args, kwargs), step=step,
                                                  layer=self.name)
        if reason is not None:
            if not routing._OBSERVERS:
                return self.original(attn, *args, **kwargs)
            observe = reason  # observed, still exact
        else:
            observe = routing.OBSERVE_ONLY if self.observe_only else None
        policy = self.policy if precision is None else self._entry_policy(precision, step)
        video = self.steps.current_video if self.steps is not None else None
        prev = routing.push_route(policy, observe, self.name, step, video)
        try:
            if self.route == ROUTE_DISPATCH:
                return self._fp4(attn, *args, **kwargs)
            if self.route == ROUTE_GLOBAL:
                with _backend.global_backend(_backend.backend_member()):
                    return self.original(attn, *args, **kwargs)
            with _SDPARedirect(policy, observe):
                return self.original(attn, *args, **kwargs)
        finally:
            routing.pop_route(prev)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, enabled={self.enabled}, policy={self.policy!r})"


_T = "diffusers.models.transformers."
_AP = "diffusers.models.attention_processor"


class NVFP4CosmosAttnProcessor2_0(NVFP4AttnProcessorBase):
    """Cosmos Predict2/2.5 self- and text cross-attention (global-backend route)."""
    original_class = _find(_T + "transformer_cosmos", "CosmosAttnProcessor2_0")
    route, role = ROUTE_GLOBAL, ROLE_CONTEXT


class NVFP4CosmosAttnProcessor2_5(NVFP4AttnProcessorBase):
    """Cosmos Transfer/Predict2.5 cross-attention with the extra image context (two dispatches)."""
    original_class = _find(_T + "transformer_cosmos", "CosmosAttnProcessor2_5")
    route, role = ROUTE_GLOBAL, ROLE_CROSS


class NVFP4WanAttnProcessor(NVFP4AttnProcessorBase):
    """Wan T2V self/cross attention and I2V's extra image-context dispatch (per-module backend)."""
    original_class = _find(_T + "transformer_wan", "WanAttnProcessor")
    route, role = ROUTE_DISPATCH, ROLE_CONTEXT


class NVFP4HunyuanVideoAttnProcessor2_0(NVFP4AttnProcessorBase):
    """HunyuanVideo joint video+text attention with its bool key mask (dual and single stream)."""
    original_class = _find(_T + "transformer_hunyuan_video", "HunyuanVideoAttnProcessor2_0")
    route, role = ROUTE_DISPATCH, ROLE_SELF


class NVFP4HunyuanVideo15AttnProcessor2_0(NVFP4AttnProcessorBase):
    """HunyuanVideo 1.5 joint video+text attention (the generic wrapper would count it as cross)."""
    original_class = _find(_T + "transformer_hunyuan_video15", "HunyuanVideo15AttnProcessor2_0")
    route, role = ROUTE_DISPATCH, ROLE_SELF


class NVFP4LTXVideoAttnProcessor(NVFP4AttnProcessorBase):
    """LTX-Video self-attention and cross-attention with its additive 0/-10000 text mask."""
    original_class = _find(_T + "transformer_ltx", "LTXVideoAttnProcessor")
    route, role = ROUTE_DISPATCH, ROLE_CONTEXT


class NVFP4MiniMaxH3AttnProcessor(NVFP4AttnProcessorBase):
    """MiniMax-H3's packed [text | conditioning | audio | video] self-attention."""
    original_class = _find(_T + "transformer_minimax_h3", "MiniMaxH3AttnProcessor")
    route, role = ROUTE_DISPATCH, ROLE_SELF


class NVFP4CogVideoXAttnProcessor2_0(NVFP4AttnProcessorBase):
    """CogVideoX joint [text ; video] attention (calls SDPA directly)."""
    original_class = _find(_AP, "CogVideoXAttnProcessor2_0")
    route, role = ROUTE_SDPA, ROLE_SELF


class NVFP4MochiAttnProcessor2_0(NVFP4AttnProcessorBase):
    """Mochi joint attention, one direct SDPA call per sample over [video ; valid text]."""
    original_class = _find(_AP, "MochiAttnProcessor2_0")
    route, role = ROUTE_SDPA, ROLE_SELF


class NVFP4AttnProcessor2_0(NVFP4AttnProcessorBase):
    """Plain ``Attention`` modules with the default ``AttnProcessor2_0`` (direct SDPA)."""
    original_class = _find(_AP, "AttnProcessor2_0")
    route, role = ROUTE_SDPA, ROLE_CONTEXT


FAMILY_PROCESSORS = tuple(
    c for c in (NVFP4CosmosAttnProcessor2_0, NVFP4CosmosAttnProcessor2_5, NVFP4WanAttnProcessor,
                NVFP4HunyuanVideoAttnProcessor2_0, NVFP4HunyuanVideo15AttnProcessor2_0, NVFP4LTXVideoAttnProcessor, NVFP4MiniMaxH3AttnProcessor,
                NVFP4CogVideoXAttnProcessor2_0, NVFP4MochiAttnProcessor2_0, NVFP4AttnProcessor2_0)
    if c.original_class is not None
)
_BY_ORIGINAL = {c.original_class: c for c in FAMILY_PROCESSORS}
_GENERIC_DISPATCH: dict[type, type] = {}


def processor_class_for(original_cls: type) -> Optional[type]:
    """The NVFP4 processor class for an original processor class, or None.

    Known families map to their named class.  Any other processor class that dispatches with a
    per-module backend (has ``_attention_backend``) gets a generic dispatch wrapper, role read
    from ``encoder_hidden_states`` (so joint processors of unknown models count as cross and stay
    dense by default).
    """
    cls = _BY_ORIGINAL.get(original_cls)
    if cls is not None:
        return cls
    if issubclass(original_cls, NVFP4AttnProcessorBase):
        return None
    if hasattr(original_cls, "_attention_backend") and callable(getattr(original_cls, "__call__", None)):
        cls = _GENERIC_DISPATCH.get(original_cls)
        if cls is None:
            cls = type(f"NVFP4Generic_{original_cls.__name__}", (NVFP4AttnProcessorBase,),
                       {"original_class": original_cls, "route": ROUTE_DISPATCH, "role": ROLE_CONTEXT,
                        "__doc__": f"Generic NVFP4 wrapper of {original_cls.__qualname__} (dispatch route)."})
            _GENERIC_DISPATCH[original_cls] = cls
        return cls
    return None
