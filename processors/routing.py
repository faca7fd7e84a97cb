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
import nvfp4_dit.ops
from nvfp4_dit import format as fmt

ROUTE_BACKENDS = ("auto", "reference", "sdpa", "cuda")
DEFAULT_MIN_SEQ_LEN = 256

# A key whose additive mask value lies this far below the row's largest value gets weight
# exp(-1000) relative to it: 0 in fp32 (exp underflows below about -104), so treating it as
# masked is exact.  1000 rather than 10000 because diffusers' -10000 in bfloat16 is -9984.
_MASKED_GAP = 1000.0


@dataclass(frozen=True)
class RouteSettings:
    """How one FP4-eligible call is run.

    backend: the ``nvfp4_dit.attention`` back-end ("auto", "reference", "sdpa", "cuda").
    min_seq_len: calls whose query or key sequence is shorter than this run exact attention
        (the FP4 path pads to 128-token tiles and quantises; short calls gain nothing).
    """

    backend: str = "auto"
    min_seq_len: int = DEFAULT_MIN_SEQ_LEN
    # Compute every call exactly as the unmodified model does, still passing it through the
    # router so observers see it (baselines, capture of a dense run).
    observe_only: bool = False
    observe_reason: str = "observe only"  # the CallInfo.reason observers see for those calls

    def __post_init__(self):
        if not isinstance(self.backend, str) or self.backend not in ROUTE_BACKENDS:
            raise ValueError(f"backend must be one of {ROUTE_BACKENDS}, got {self.backend!r}")
        if isinstance(self.min_seq_len, bool) or not isinstance(self.min_seq_len, int) or self.min_seq_len < 0:
            raise ValueError(f"min_seq_len must be a non-negative int, got {self.min_seq_len!r}")


class _RouteState:
    """The settings of the FP4 call in progress, set by a processor around its original call.

    A plain attribute (not a ContextVar) because torch.compile cannot trace ContextVar.set();
    a processor call is synchronous, so save/set/restore around it nests correctly.
    """

    settings: Optional[RouteSettings] = None
    default: RouteSettings = RouteSettings()
    # Who is calling (for observers): the module path and the (step, total) of the forward.
    layer: Optional[str] = None
    step: Optional[tuple] = None


_STATE = _RouteState()


def current_settings() -> RouteSettings:
    """The settings for a call reaching the "nvfp4" backend: the enclosing processor's, else the default."""
    s = _STATE.settings
    return _STATE.default if s is None else s


def configure_default(*, backend: Optional[str] = None, min_seq_len: Optional[int] = None) -> RouteSettings:
    """Change the settings used when the "nvfp4" backend is reached without an NVFP4 processor
    (``model.set_attention_backend("nvfp4")``).  Returns the previous default."""
    prev = _STATE.default
    _STATE.default = RouteSettings(
        backend=prev.backend if backend is None else backend,
        min_seq_len=prev.min_seq_len if min_seq_len is None else min_seq_len,
    )
    return prev


def push_settings(settings: Optional[RouteSettings], layer: Optional[str] = None, step=None) -> tuple:
    """Make ``settings`` (and the caller's layer name and step) current; returns the previous
    values for :func:`pop_settings`.

    Two plain functions (used in try/finally) rather than a context manager, so torch.compile
    traces them as ordinary attribute writes.
    """
    prev = (_STATE.settings, _STATE.layer, _STATE.step)
    _STATE.settings, _STATE.layer, _STATE.step = settings, layer, step
    return prev


def pop_settings(prev: tuple) -> None:
    _STATE.settings, _STATE.layer, _STATE.step = prev


# ---------------------------------------------------------------------------------------------
# Observers (timing, capture): called after every routed call while registered
# ---------------------------------------------------------------------------------------------

@dataclass
class CallInfo:
    """What an observer learns about one routed attention call.

    ``path`` is "fp4" (nvfp4_dit.attention ran with ``backend``) or "exact" (the model's own
    computation ran; ``reason`` says why: a policy such as "short sequence" / "observe only",
    or what NVFP4 cannot express).  ``attn_mask`` is the mask with SDPA semantics.
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
# What an NVFP4 processor routes a dense-by-policy call through while observers are registered.
POLICY_DENSE = RouteSettings(backend="sdpa", min_seq_len=0, observe_only=True, observe_reason="dense by policy")


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

class NVFP4FallbackWarning(nvfp4_dit.FallbackWarning):
    """Issued once per reason when an attention call runs exact attention instead of NVFP4
    (a subclass of the op's ``nvfp4_dit.FallbackWarning``, so one filter covers both)."""


def _warn_once(reason: str) -> None:
    nvfp4_dit.ops.warn_once(f"nvfp4_dit.processors: exact attention instead of NVFP4: {reason}",
                            NVFP4FallbackWarning, stacklevel=3)


def reset_fallback_warnings() -> None:
    """Forget which fallback reasons were reported (ours and the op's: one shared record)."""
    nvfp4_dit.reset_fallback_warnings()


class _NotExpressible(Exception):
    """The call is valid attention but the FP4 path cannot express it (carries the reason)."""


# ---------------------------------------------------------------------------------------------
# Masks: SDPA semantics in, per-key form out
# ---------------------------------------------------------------------------------------------

@dataclass
class KeyMask:
    """A mask reduced to per-key form.

    kv_lens: int32 [B] when the kept keys of every batch row are a prefix; else None.
    keep: bool [B, Sk] when they are not a prefix; else None.
    bias: fp32 [B, Sk] when the mask carries genuine per-key biases (not just keep/drop); else None.
    shift: fp32 [B] constant added to every kept key (softmax ignores it; the LSE does not).
    """

    kv_lens: Optional[torch.Tensor] = None
    keep: Optional[torch.Tensor] = None
    bias: Optional[torch.Tensor] = None
    shift: Optional[torch.Tensor] = None


def key_mask_from_sdpa_mask(mask: torch.Tensor, b: int, h: int, sq: int, sk: int) -> KeyMask:
    """Reduce an SDPA ``attn_mask`` (bool = keep, float = additive; broadcast to [B, H, Sq, Sk])
    to per-key form, or raise ``_NotExpressible``.

    Accepted: every mask that is the same for all heads and queries of a batch row (HunyuanVideo's
    bool [B,1,1,N], LTX's additive 0/-10000 [B,H,1,S], Cosmos' all-ones [B,1,1,S]).  Host syncs:
    a few scalar reductions, once per call.
    """
    if mask.dim() > 4:
        raise _NotExpressible(f"attn_mask with {mask.dim()} dims")
    try:
        torch.broadcast_shapes(mask.shape, (b, h, sq, sk))
    except RuntimeError:
        raise _NotExpressible(f"attn_mask of shape {tuple(mask.shape)} does not broadcast to "
                              f"{(b, h, sq, sk)}") from None
    m = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    first = m[:, :1, :1, :]
    if (m.shape[1] > 1 or m.shape[2] > 1) and not bool((m == first).all()):
        raise _NotExpressible("attn_mask differs between heads or queries (not a key-padding mask)")
    row = first[:, 0, 0, :].expand(b, sk)
    if row.dtype == torch.bool:
        keep, shift = row, None
    else:
        row = row.float()
        top = row.amax(dim=1, keepdim=True)
        if not bool(torch.isfinite(top).all()):
            raise _NotExpressible("an additive attn_mask row with no finite value")
        keep = row == top
        masked = row <= top - _MASKED_GAP
        if bool((keep | masked).all()):
            shift = top[:, 0]
        else:
            # Genuine biases: only the reference back-end takes them (the op falls back for the rest).
            return KeyMask(bias=row)
    counts = keep.sum(dim=1)
    if not bool((counts > 0).all()):
        raise _NotExpressible("a batch row with every key masked (SDPA gives NaN there)")
    if shift is not None and not bool((shift != 0).any()):
        shift = None
    if bool((counts == sk).all()):
        return KeyMask(shift=shift)
    prefix = torch.arange(sk, device=keep.device)[None, :] < counts[:, None]
    if bool((prefix == keep).all()):
        return KeyMask(kv_lens=counts.to(torch.int32), shift=shift)
    return KeyMask(keep=keep, shift=shift)


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
                        settings: RouteSettings) -> tuple[Optional[str], bool]:
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
    if min(sq, sk) < settings.min_seq_len:
        return "short sequence", False
    return None, False


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
    settings: RouteSettings,
    exact: Callable[[], torch.Tensor],
):
    """SDPA semantics in, NVFP4 attention out when the call allows it.

    ``layout`` is "NHD" ([B, S, H, D], diffusers' dispatcher) or "HND" ([B, H, S, D], direct
    SDPA callers); ``attn_mask`` follows SDPA (broadcast to [B, H, Sq, Sk]).  ``exact()`` must
    compute the call exactly as the unmodified model would; it runs for every call the FP4 path
    cannot express (with one warning per reason) and for short sequences (silently).
    Returns ``out`` in ``layout``, or ``(out, lse [B, H, Sq] fp32)`` with ``return_lse``.
    """
    args = (query, key, value, layout, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse,
            settings, exact)
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
                    backend=settings.backend, seconds=time.perf_counter() - t0)
    for fn in list(_OBSERVERS):
        fn(info, query, key, value, res)
    return res


def _route(query, key, value, layout, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse,
           settings, exact):
    """(result, path, reason) -- see :func:`routed_attention`."""
    if settings.observe_only:
        reason, warn = settings.observe_reason, False
    else:
        reason, warn = _expressible_reason(query, key, value, layout, attn_mask, dropout_p, is_causal,
                                           enable_gqa, settings)
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

    mask_arg = km.keep if km.keep is not None else km.bias
    op_backend = settings.backend
    try:
        res = nvfp4_dit.attention(query, key, value, layout=layout, causal=bool(is_causal), scale=scale,
                                  attn_mask=mask_arg, kv_lens=km.kv_lens, return_lse=return_lse,
                                  backend=op_backend)
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
        kwargs = {"attn_mask": km.keep if km.keep is not None else km.bias, "kv_lens": km.kv_lens}
    out, lse = nvfp4_dit.attention(query, key, value, layout=layout, causal=bool(is_causal), scale=scale,
                                   return_lse=True, backend="sdpa", **kwargs)
    if attn_mask is not None and km.shift is not None:
        lse = lse + km.shift[:, None, None]
    return out, lse

