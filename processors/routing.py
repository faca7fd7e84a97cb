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
from nvfp4_dit.fallback import FallbackWarning, reset_fallback_warnings, warn_once
from nvfp4_dit.masks import KeyMask, NotPerKeyMask, reduce_key_mask
from nvfp4_dit.policy import AttentionPolicy

# Compute every call exactly as the unmodified model does, still passing it through the router so
# observers see it (baselines, capture of a dense run); the reason observers are given.
OBSERVE_ONLY = "observe only"
DENSE_BY_POLICY = "dense by policy"


class _RouteState:
    """The policy of the NVFP4 call in progress, set by a processor around its original call.

    A plain attribute (not a ContextVar) because torch.compile cannot trace ContextVar.set();
    a processor call is synchronous, so save/set/restore around it nests correctly.
    """

    policy: Optional[AttentionPolicy] = None
    observe: Optional[str] = None  # compute exactly, report this reason (OBSERVE_ONLY, DENSE_BY_POLICY)
    default: AttentionPolicy = AttentionPolicy()
    # Who is calling (for observers): the module path and the (step, total) of the forward.
    layer: Optional[str] = None
    step: Optional[tuple] = None


_STATE = _RouteState()


def current_policy() -> AttentionPolicy:
    """The policy for a call reaching the "nvfp4" backend: the enclosing processor's, else the default."""
    p = _STATE.policy
    return _STATE.default if p is None else p


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
               step=None) -> tuple:
    """Make ``policy`` (and an observe reason, the caller's layer name and step) current; returns
    the previous values for :func:`pop_route`.

    Two plain functions (used in try/finally) rather than a context manager, so torch.compile
    traces them as ordinary attribute writes.
    """
    prev = (_STATE.policy, _STATE.observe, _STATE.layer, _STATE.step)
    _STATE.policy, _STATE.observe, _STATE.layer, _STATE.step = policy, observe, layer, step
    return prev


def pop_route(prev: tuple) -> None:
    _STATE.policy, _STATE.observe, _STATE.layer, _STATE.step = prev


# ---------------------------------------------------------------------------------------------
# Observers (timing, capture): called after every routed call while registered
# ---------------------------------------------------------------------------------------------

@dataclass
class CallInfo:
    """What an observer learns about one routed attention call.

    ``path`` is "fp4" (nvfp4_dit.attention ran with ``backend``) or "exact" (the model's own
    computation ran, ``backend`` "sdpa"; ``reason`` says why: a policy such as "short sequence" /
    "observe only", or what NVFP4 cannot express).  ``attn_mask`` is the mask with SDPA semantics.
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


_OBSERVERS: list = []


def add_observer(fn: Callable) -> None:
    """Call ``fn(info: CallInfo, query, key, value, out)`` after every routed call (``out`` is the
    output, or ``(out, lse)`` when the caller asked for the LSE).  Observers add a device sync
    per call (for the timing); nothing is kept unless the observer keeps it.

    While an observer is registered, NVFP4 processors also route their dense-by-policy calls
    (reason "dense by policy"), computed exactly; for dispatch-based models that exact path is
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


class _NotExpressible(Exception):
    """The call is valid attention but the FP4 path cannot express it (carries the reason)."""


def key_mask_from_sdpa_mask(mask: torch.Tensor, b: int, h: int, sq: int, sk: int) -> KeyMask:
    """The per-key form of an SDPA ``attn_mask`` (:func:`nvfp4_dit.masks.reduce_key_mask`), or
    ``_NotExpressible`` for masks without one and for rows that keep no key (SDPA gives NaN there,
    which only the model's own computation reproduces)."""
    try:
        km = reduce_key_mask(mask, b, h, sq, sk)
    except NotPerKeyMask as e:
        raise _NotExpressible(str(e)) from None
    if km.empty_rows:
        raise _NotExpressible("a batch row with every key masked (SDPA gives NaN there)")
    return km


# ---------------------------------------------------------------------------------------------
# The routed call
# ---------------------------------------------------------------------------------------------

def _dims(t: torch.Tensor, layout: str) -> tuple[int, int, int, int]:
    """(B, H, S, D) of a 4-D tensor in ``layout``."""
    if layout == "NHD":
        b, s, h, d = t.shape
    else:
        b, h, s, d = t.shape
    return b, h, s, d


def _expressible_reason(query, key, value, layout, attn_mask, dropout_p, is_causal, enable_gqa,
                        policy: AttentionPolicy) -> tuple[Optional[str], bool]:
    """(reason the FP4 path cannot take this call or None, whether to warn about it)."""
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (query, key, value)):
        return "q/k/v not 4-D tensors", True
    if not (query.dtype == key.dtype == value.dtype) or query.dtype not in (
            torch.float16, torch.bfloat16, torch.float32):
        return f"dtypes {query.dtype}/{key.dtype}/{value.dtype}", True
    if not (query.device == key.device == value.device):
        return "q/k/v on different devices", True
    if dropout_p:
        return "dropout_p > 0", True
    if attn_mask is not None and is_causal:
        return "attn_mask together with is_causal", True
    b, h, sq, d = _dims(query, layout)
    bk, hkv, sk, dk = _dims(key, layout)
    if tuple(key.shape) != tuple(value.shape) or bk != b or dk != d:
        return "q/k/v shapes that SDPA would broadcast or reject", True
    if h != hkv and (not enable_gqa or hkv == 0 or h % hkv):
        return f"{h} query heads with {hkv} key/value heads without enable_gqa", True
    if fmt.padded_head_dim(d) is None:
        return f"head dim {d} > {fmt.SUPPORTED_HEAD_DIMS[-1]}", True
    return policy.dense_reason(seq_q=sq, seq_k=sk), False


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
    res, path, reason = _route(*args)
    if sync:
        torch.cuda.synchronize(query.device)
    info = CallInfo(layer=_STATE.layer, step=_STATE.step, layout=layout, is_causal=bool(is_causal), scale=scale,
                    enable_gqa=bool(enable_gqa), attn_mask=attn_mask, path=path, reason=reason,
                    backend=policy.backend if path == "fp4" else "sdpa", seconds=time.perf_counter() - t0)
    for fn in list(_OBSERVERS):
        fn(info, query, key, value, res)
    return res


def rerun(info: CallInfo, query, key, value, policy: AttentionPolicy, exact: Callable[[], torch.Tensor],
          return_lse: bool = False) -> tuple:
    """Route an observed call again under another ``policy``, without observers: ``(result, path)``.

    For calibration: the same tensors and call arguments, computed the way ``policy`` would.
    """
    res, path, _ = _route(query, key, value, info.layout, info.attn_mask, 0.0, info.is_causal, info.scale,
                          info.enable_gqa, return_lse, policy, None, exact)
    return res, path


def _route(query, key, value, layout, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse,
           policy, observe, exact):
    """(result, path, reason) -- see :func:`routed_attention`."""
    if observe is not None:
        reason, warn = observe, False
    else:
        reason, warn = _expressible_reason(query, key, value, layout, attn_mask, dropout_p, is_causal,
                                           enable_gqa, policy)
    km = KeyMask()
    if reason is None and attn_mask is not None:
        b, h, sq, _ = _dims(query, layout)
        sk = _dims(key, layout)[2]
        try:
            km = key_mask_from_sdpa_mask(attn_mask, b, h, sq, sk)
        except _NotExpressible as e:
            reason, warn = str(e), True
    if reason is not None:
        if warn:
            _warn_once(reason)
        res = _exact_with_lse(query, key, value, layout, attn_mask, is_causal, scale) if return_lse else exact()
        return res, "exact", reason

    op_backend = policy.backend
    try:
        res = nvfp4_dit.attention(query, key, value, layout=layout, causal=bool(is_causal), scale=scale,
                                  attn_mask=km.as_key_bias(), kv_lens=km.kv_lens, return_lse=return_lse,
                                  backend=op_backend, balance_qk=policy.balance_qk, qk_format=policy.qk_format)
    except nvfp4_dit.BackendUnavailableError as e:
        # An explicitly requested back-end (cuda / reference) cannot run this call: never break
        # the pipeline, run it exactly.
        reason = f"backend={op_backend!r} unavailable: {e}"
        _warn_once(reason)
        res = _exact_with_lse(query, key, value, layout, attn_mask, is_causal, scale) if return_lse else exact()
        return res, "exact", reason
    if return_lse and km.shift is not None:
        out, lse = res
        res = (out, lse + km.shift[:, None, None])
    return res, "fp4", None


def _exact_with_lse(query, key, value, layout, attn_mask, is_causal, scale):
    """Exact attention and its LSE [B, H, Sq] (fp32) for calls that must return an LSE."""
    b, h, sq, _ = _dims(query, layout)
    sk = _dims(key, layout)[2]
    kwargs = {}
    if attn_mask is not None:
        try:
            km = key_mask_from_sdpa_mask(attn_mask, b, h, sq, sk)
        except _NotExpressible as e:
            raise ValueError(f"return_lse with attn_mask of shape {tuple(attn_mask.shape)}: {e}") from None
        kwargs = {"attn_mask": km.as_key_bias(), "kv_lens": km.kv_lens}
    out, lse = nvfp4_dit.attention(query, key, value, layout=layout, causal=bool(is_causal), scale=scale,
                                   return_lse=True, backend="sdpa", **kwargs)
    if attn_mask is not None and km.shift is not None:
        lse = lse + km.shift[:, None, None]
    return out, lse

