"""The diffusers attention backend "nvfp4".

diffusers' ``AttentionBackendName`` is a closed enum and the registry is private, so the name is
added by inserting a pseudo-member into the enum's maps and calling the registry's ``register``
decorator.  Every private name used is feature-detected first; if one is
missing, :func:`register_backend` raises ``RuntimeError`` naming it and the processors
(:mod:`nvfp4_dit.processors.apply`) still work through the routes that need no backend.

The backend function takes every argument ``dispatch_attention_fn`` can pass (the dispatcher
silently drops undeclared ones, and constraint checks only run with ``DIFFUSERS_ATTN_CHECKS``),
checks them inline in :func:`~nvfp4_dit.processors.routing.routed_attention`, and runs diffusers'
own native SDPA backend for anything NVFP4 cannot express, so those calls are bit-identical to
the default backend.  It is registered as context-parallel capable: its forward op returns
``(out, lse)`` with LSE ``(B, S, H)`` as ring attention requires.

``model.set_attention_backend(...)`` also sets the process-global active backend and
``reset_attention_backend()`` does not undo that (diffusers issue #14249); :func:`use_backend`
records and restores both the per-processor attributes and the global.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

from . import routing

BACKEND_NAME = "nvfp4"

try:
    from diffusers.models import attention_dispatch as _dispatch
except ImportError as e:  # pragma: no cover - exercised only without diffusers
    raise ImportError("nvfp4_dit.processors.backend needs diffusers (pip install diffusers==0.42.1)") from e

_REQUIRED = (
    "AttentionBackendName",
    "_AttentionBackendRegistry",
    "dispatch_attention_fn",
    "_templated_context_parallel_attention",
)
_REQUIRED_REGISTRY = ("register", "_backends", "_supported_arg_names", "_supports_context_parallel",
                      "_active_backend", "set_active_backend")
_REQUIRED_ENUM = ("_member_map_", "_value2member_map_", "_member_names_")

_member = None  # the AttentionBackendName pseudo-member, once registered


def _missing_features() -> list[str]:
    missing = [n for n in _REQUIRED if not hasattr(_dispatch, n)]
    if not missing:
        reg = _dispatch._AttentionBackendRegistry
        enum = _dispatch.AttentionBackendName
        missing += [f"_AttentionBackendRegistry.{n}" for n in _REQUIRED_REGISTRY if not hasattr(reg, n)]
        missing += [f"AttentionBackendName.{n}" for n in _REQUIRED_ENUM if not hasattr(enum, n)]
        if "native" not in enum._value2member_map_:
            missing.append("AttentionBackendName.NATIVE")
    return missing


def _native_fn():
    return _dispatch._AttentionBackendRegistry._backends[_dispatch.AttentionBackendName.NATIVE]


def _nvfp4_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    _parallel_config=None,
):
    """The registered backend: (B, S, H, D) in and out, like every diffusers backend."""
    if _parallel_config is not None:
        return _dispatch._templated_context_parallel_attention(
            query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse,
            forward_op=nvfp4_forward_op, backward_op=nvfp4_backward_op, _parallel_config=_parallel_config,
        )
    return nvfp4_forward_op(None, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse)


def _ring_sharded(parallel_config) -> bool:
    """Whether a context-parallel call attends one ring shard of the keys (ring degree > 1)."""
    cp = getattr(parallel_config, "context_parallel_config", None)
    return (getattr(cp, "ring_degree", None) or 1) > 1


def _route_nhd(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse, dense=False):
    sdpa_mask = attn_mask
    if (attn_mask is not None and attn_mask.dim() == 2 and attn_mask.shape[0] == query.shape[0]
            and attn_mask.shape[1] == key.shape[1]):
        # diffusers' native backend reads a 2-D mask as [B, Sk] key padding (SDPA would read it
        # as [Sq, Sk]); do the same so masks mean what they mean under the default backend.
        sdpa_mask = attn_mask[:, None, None, :]

    def exact():
        return _native_fn()(query=query, key=key, value=value, attn_mask=attn_mask, dropout_p=dropout_p,
                            is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)

    policy = routing.current_policy()
    if dense:
        policy = policy.without_sparsity

    return routing.routed_attention(
        query, key, value, layout="NHD", attn_mask=sdpa_mask, dropout_p=dropout_p, is_causal=is_causal,
        scale=scale, enable_gqa=enable_gqa, return_lse=return_lse, policy=policy,
        observe=routing.current_observe(), exact=exact,
    )


def nvfp4_forward_op(
    ctx,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    _save_ctx: bool = True,
    _parallel_config=None,
):
    """Context-parallel forward op: ``out`` (B, S, H, D), or ``(out, lse)`` with LSE (B, S, H) fp32.

    Ring attention calls this once per K/V chunk with ``return_lse=True`` and merges the chunks by
    their LSEs; the FP4 LSE is the true log-sum-exp of the chunk's scaled scores (the K-mean
    smoothing term is given back), so the merge is the same as for exact attention. A ring chunk is
    no 3D box of the video and its estimate would see a part of each row's mass, so block-sparse
    policies run ring calls dense (Ulysses calls see the whole sequence and stay sparse).
    Inference only: nothing is saved for backward.
    """
    res = _route_nhd(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse,
                     dense=_ring_sharded(_parallel_config))
    if return_lse:
        out, lse = res
        return out, lse.permute(0, 2, 1)
    return res


def nvfp4_backward_op(ctx, grad_out, *args, **kwargs):
    raise NotImplementedError("the nvfp4 attention backend is inference-only (no backward)")


def register_backend():
    """Register "nvfp4" with diffusers (idempotent); returns the ``AttentionBackendName`` member."""
    global _member
    if _member is not None:
        return _member
    missing = _missing_features()
    if missing:
        raise RuntimeError("cannot register the 'nvfp4' diffusers attention backend: this diffusers "
                           f"version lacks {', '.join(missing)} (tested with diffusers 0.42.1)")
    enum = _dispatch.AttentionBackendName
    member = enum._value2member_map_.get(BACKEND_NAME)
    if member is None:
        member = str.__new__(enum, BACKEND_NAME)
        member._name_ = "NVFP4"
        member._value_ = BACKEND_NAME
        member.__objclass__ = enum
        enum._member_map_["NVFP4"] = member
        enum._value2member_map_[BACKEND_NAME] = member
        enum._member_names_.append("NVFP4")
    _dispatch._AttentionBackendRegistry.register(member, constraints=[], supports_context_parallel=True)(
        _nvfp4_attention)
    _member = member
    return member


def backend_member():
    """The registered ``AttentionBackendName`` member for "nvfp4" (registers on first use)."""
    return register_backend()


def get_active_backend():
    """The process-global active diffusers backend (an ``AttentionBackendName``)."""
    return _dispatch._AttentionBackendRegistry._active_backend


def set_active_backend(backend) -> None:
    _dispatch._AttentionBackendRegistry.set_active_backend(backend)


@contextlib.contextmanager
def global_backend(backend):
    """Make ``backend`` the process-global active backend inside the block, then restore the previous one."""
    prev = get_active_backend()
    set_active_backend(backend)
    try:
        yield
    finally:
        set_active_backend(prev)


class BackendHandle:
    """Undo for :func:`use_backend`: restores every processor's ``_attention_backend`` and the global."""

    def __init__(self, saved: list, prev_global):
        self._saved = saved
        self._prev_global = prev_global
        self.restored = False

    def restore(self) -> None:
        if self.restored:
            return
        for proc, value in self._saved:
            proc._attention_backend = value
        set_active_backend(self._prev_global)
        self._saved = []
        self.restored = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.restore()
        return False


def use_backend(model: torch.nn.Module, name: str = BACKEND_NAME) -> BackendHandle:
    """``model.set_attention_backend(name)`` with an undo that also resets the global it leaks.

    Usable as ``with use_backend(pipe.transformer): pipe(...)``.
    """
    register_backend()
    saved = []
    for module in model.modules():
        proc = getattr(module, "processor", None)
        if proc is not None and hasattr(proc, "_attention_backend"):
            saved.append((proc, proc._attention_backend))
    handle = BackendHandle(saved, get_active_backend())
    try:
        model.set_attention_backend(name)
    except BaseException:
        handle.restore()
        raise
    return handle
