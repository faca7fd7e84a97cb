"""The one place where a model's core attention call becomes an ``nvfp4_dit.attention`` call.

Every route into NVFP4 (the registered diffusers backend, the processors that redirect a
direct ``F.scaled_dot_product_attention`` call, the Cosmos processors reached through the
global backend) ends in :func:`routed_attention`.  It takes SDPA's arguments with SDPA's mask
semantics, decides whether the FP4 path can express the call, and otherwise runs the caller's
own exact computation, so a call we cannot serve gives the same bits as the unmodified model.

This module does not import diffusers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

import nvfp4_dit
from nvfp4_dit import format as fmt
from nvfp4_dit import ops, planner
from nvfp4_dit.masks import reduce_key_mask
from nvfp4_dit.fallback import FallbackWarning, reset_fallback_warnings, warn_once
from nvfp4_dit.policy import AttentionPolicy
from nvfp4_dit.sparse import Sparsity, VideoTokens

# Compute every call exactly as the unmodified model does, still passing it through the router so
# observers see it (baselines, capture of a dense run); the reason observers are given.
OBSERVE_ONLY = "observe only"


class _RouteState:
    """The policy of the NVFP4 call in progress, set by a processor around its original call.

    A plain attribute (not a ContextVar) because torch.compile cannot trace ContextVar.set();
    a processor call is synchronous, so save/set/restore around it nests correctly.
    """

    policy: Optional[AttentionPolicy] = None
    observe: Optional[str] = None  # compute exactly, report this reason (OBSERVE_ONLY or a policy rule)
    default: AttentionPolicy = AttentionPolicy()
    # Who is calling (for observers): the module path and the (step, total) of the forward; and
    # the forward's video tokens (nvfp4_dit.sparse.VideoTokens) for a block-sparse call's estimate.
    layer: Optional[str] = None
    step: Optional[tuple] = None
    video: Optional[VideoTokens] = None


_STATE = _RouteState()


def current_policy() -> AttentionPolicy:
    """The policy for a call reaching the "nvfp4" backend: the enclosing processor's, else the default."""
    p = _STATE.policy
    return _STATE.default if p is None else p


def current_video() -> Optional[VideoTokens]:
    """The video tokens of the forward whose processor is calling, or None."""
    return _STATE.video


def current_observe() -> Optional[str]:
    """The observe reason set by the enclosing processor (the call is computed exactly), or None."""
    return _STATE.observe


def configure_default(policy: Optional[AttentionPolicy] = None, **changes) -> AttentionPolicy:
    """Set the policy of calls that reach the "nvfp4" backend without an NVFP4 processor
    (``model.set_attention_backend("nvfp4")``): ``policy``, or the current default with
    ``changes`` (fields of :class:`~nvfp4_dit.policy.AttentionPolicy`). Returns the previous
    default. There the router sees only tensors: the role, step and layer rules do not apply."""
    prev = _STATE.default
    _STATE.default = (prev if policy is None else policy).replace(**changes)
    return prev


def push_route(policy: Optional[AttentionPolicy], observe: Optional[str] = None, layer: Optional[str] = None,
               step=None, video: Optional[VideoTokens] = None) -> tuple:
    """Make ``policy`` (and an observe reason, the caller's layer name, step and video tokens)
    current; returns the previous values for :func:`pop_route`.

    Two plain functions (used in try/finally) rather than a context manager, so torch.compile
    traces them as ordinary attribute writes.
    """
    prev = (_STATE.policy, _STATE.observe, _STATE.layer, _STATE.step, _STATE.video)
    _STATE.policy, _STATE.observe, _STATE.layer, _STATE.step, _STATE.video = policy, observe, layer, step, video
    return prev


def pop_route(prev: tuple) -> None:
    _STATE.policy, _STATE.observe, _STATE.layer, _STATE.step, _STATE.video = prev


# ---------------------------------------------------------------------------------------------
# Observers (timing, capture): called after every routed call while registered
# ---------------------------------------------------------------------------------------------

@dataclass
class CallInfo:
    """What an observer learns about one routed attention call.

    ``path`` is "fp4" (the FP4 op ran on ``backend``, "cuda" or "reference": what ran, ``auto``
    resolved) or "exact" (the model's own computation ran, ``backend`` "sdpa"; ``reason`` says why:
    a policy rule such as "cross-attention", "dense step", "short sequence", "observe only", or
    what NVFP4 cannot express).  ``attn_mask`` is the mask with SDPA semantics.  ``sparsity``:
    the block-sparse call that ran (:class:`nvfp4_dit.sparse.Sparsity`), None for dense; ``order``
    the 3D tile order it ran in (:class:`nvfp4_dit.token_order.TokenOrder`), None for the model's.
    """

    layer: Optional[str]
    step: Optional[tuple]
    layout: str
    is_causal: bool
    scale: Optional[float]
    enable_gqa: bool
    attn_mask: Optional[torch.Tensor]
    path: str
    reason: Optional[str]
    backend: str
    seconds: float
    sparsity: Optional[Sparsity] = None
    order: Optional[object] = None


_OBSERVERS: list = []


def add_observer(fn: Callable) -> None:
    """Call ``fn(info: CallInfo, query, key, value, out)`` after every routed call (``out`` is the
    output, or ``(out, lse)`` when the caller asked for the LSE).  Observers add a device sync
    per call (for the timing); nothing is kept unless the observer keeps it.

    While an observer is registered, NVFP4 processors also route the calls their policy keeps
    exact (the reason names the rule), computed exactly; for dispatch-based models that exact path is
    diffusers' native SDPA backend, i.e. what they run by default.
    """
    _OBSERVERS.append(fn)


def remove_observer(fn: Callable) -> None:
    _OBSERVERS.remove(fn)


# ---------------------------------------------------------------------------------------------
# Fallback reporting
# ---------------------------------------------------------------------------------------------

class NVFP4FallbackWarning(FallbackWarning):
    """Issued once per reason when an attention call runs exact attention instead of NVFP4
    (a subclass of the op's ``nvfp4_dit.FallbackWarning``, so one filter covers both)."""


def _warn_once(reason: str) -> None:
    warn_once(f"nvfp4_dit.processors: exact attention instead of NVFP4: {reason}", NVFP4FallbackWarning)


# ---------------------------------------------------------------------------------------------
# The routed call
# ---------------------------------------------------------------------------------------------

def routed_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    layout: str,
    attn_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    policy: AttentionPolicy,
    observe: Optional[str] = None,
    exact: Callable[[], torch.Tensor],
):
    """SDPA semantics in, NVFP4 attention out when the call allows it.

    ``layout`` is "NHD" ([B, S, H, D], diffusers' dispatcher) or "HND" ([B, H, S, D], direct
    SDPA callers); ``attn_mask`` follows SDPA (broadcast to [B, H, Sq, Sk]).  ``exact()`` must
    compute the call exactly as the unmodified model would; it runs for every call the FP4 path
    cannot express (with one warning per reason), for calls the policy keeps exact (silently), and
    for every call when ``observe`` gives the reason to report (observers still see the call).
    Returns ``out`` in ``layout``, or ``(out, lse [B, H, Sq] fp32)`` with ``return_lse``.
    """
    args = (query, key, value, layout, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse,
            policy, observe, exact)
    if not _OBSERVERS:
        return _route(*args)[0]
    sync = query.is_cuda and torch.cuda.is_available()
    if sync:
        torch.cuda.synchronize(query.device)
    t0 = time.perf_counter()
    res, path, reason, backend, sparsity, order = _route(*args)
    if sync:
        torch.cuda.synchronize(query.device)
    info = CallInfo(layer=_STATE.layer, step=_STATE.step, layout=layout, is_causal=bool(is_causal), scale=scale,
                    enable_gqa=bool(enable_gqa), attn_mask=attn_mask, path=path, reason=reason,
                    backend=backend, seconds=time.perf_counter() - t0, sparsity=sparsity, order=order)
    for fn in list(_OBSERVERS):
        fn(info, query, key, value, res)
    return res


def rerun(info: CallInfo, query, key, value, policy: AttentionPolicy, exact: Callable[[], torch.Tensor],
          return_lse: bool = False) -> tuple:
    """Route an observed call again under another ``policy``, without observers: ``(result, path)``.

    For calibration: the same tensors and call arguments, computed the way ``policy`` would.
    """
    res, path, *_ = _route(query, key, value, info.layout, info.attn_mask, 0.0, info.is_causal, info.scale,
                             info.enable_gqa, return_lse, policy, None, exact)
    return res, path


def _route(query, key, value, layout, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse,
           policy, observe, exact):
    """(result, path, reason, back-end that ran, its block sparsity, its token order) -- see :func:`routed_attention`. The decision is the call planner's
    (:func:`nvfp4_dit.planner.plan_call`); the processor around the call has already applied the
    role, step and layer rules, so only the tensors' rules are checked here."""
    if observe is not None:
        plan = planner.exact(observe)
    else:
        plan = planner.plan_call(query, key, value, layout=layout, policy=policy, attn_mask=attn_mask,
                                 is_causal=is_causal, dropout_p=dropout_p, enable_gqa=enable_gqa, scale=scale,
                                 step=_STATE.step, check_layer=False, check_step=False, video=_STATE.video)
    if not plan.run_op:
        if plan.warn:
            _warn_once(plan.reason)
        res = _exact_with_lse(query, key, value, layout, attn_mask, is_causal, scale) if return_lse else exact()
        return res, "exact", plan.reason, "sdpa", None, None
    order = plan.order_for(plan.sparsity)
    res = ops.run_fp4(query, key, value, layout=layout, causal=bool(is_causal), scale=scale,
                            key_mask=plan.key_mask, kv_lens=None, return_lse=return_lse, backend=plan.backend,
                            balance_qk=plan.balance_qk, qk_format=plan.qk_format, sparsity=plan.sparsity,
                            order=order)
    return res, ("fp4" if plan.fp4 else "exact"), None, plan.backend, plan.sparsity, order


def block_density(info: CallInfo, query, key, sparsity: Sparsity) -> float:
    """The share of key tiles the block map of an observed call with ``sparsity`` keeps (its
    statistics in PyTorch; reads the result on the host): for calibration and reports."""
    b, h, sq, _ = fmt.hnd_shape(query, info.layout)
    sk = fmt.hnd_shape(key, info.layout)[2]
    mask = _sdpa_mask_4d(info.attn_mask)
    key_mask = None if mask is None else reduce_key_mask(mask, b, h, sq, sk)
    order = None if _STATE.video is None else _STATE.video.order(sq, sk, info.is_causal)
    return ops.block_density(query, key, layout=info.layout, causal=info.is_causal, scale=info.scale,
                             key_mask=key_mask, sparsity=sparsity, order=order)


def _sdpa_mask_4d(attn_mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """An SDPA mask in 4-D: SDPA reads a 2-D mask as [Sq, Sk], the op (and the mask reduction) as [B, Sk]."""
    return attn_mask[None, None] if attn_mask is not None and attn_mask.dim() == 2 else attn_mask


def _exact_with_lse(query, key, value, layout, attn_mask, is_causal, scale):
    """Exact attention and its LSE [B, H, Sq] (fp32) for calls that must return an LSE."""
    return nvfp4_dit.attention(query, key, value, layout=layout, causal=bool(is_causal), scale=scale,
                               attn_mask=_sdpa_mask_4d(attn_mask), return_lse=True, backend="sdpa")
