"""The call planner: whether one attention call runs FP4, how, and with which mask.

One decision for every entry point. The op (:func:`nvfp4_dit.attention`) asks
:func:`resolve_backend` and :func:`nvfp4_dit.masks.reduce_key_mask`; the diffusers router
(``nvfp4_dit.processors.routing``) and the ComfyUI override (``nvfp4_dit.comfyui_node``) ask
:func:`plan_call` and keep only their framework glue: how a call reaches them, and how to run the
model's own attention when the plan says exact. A plan holds:

* **eligibility** (:func:`ineligible_reason`): 4-D tensors of one float dtype on one device, no
  dropout, no mask together with ``is_causal``, shapes SDPA would take, GQA only where asked for,
  head dim at most 128;
* **the policy** (:class:`~nvfp4_dit.policy.AttentionPolicy`): role, step, layer allow-list, the
  calibrated precision of the layer at that step, the minimum sequence length;
* **the back-end** (:func:`resolve_backend`): ``auto`` is the CUDA kernel where the FP4 MMA is
  native (sm_120/sm_121) and its first-use self-test passed, exact attention elsewhere; ``cuda``
  the kernel wherever it runs (emulated MMA on sm_80/sm_90); ``reference`` the PyTorch numerics;
  ``sdpa`` exact attention. What the plan records is what runs;
* **the mask** in per-key form, reduced once on the device with no host sync
  (:mod:`nvfp4_dit.masks`), which the op takes as it is.

A reason that is a choice (a policy rule) is reported silently; one that is a limitation (a mask
the FP4 path cannot express, no native FP4 MMA) once per process through
:func:`nvfp4_dit.fallback.warn_once` by the caller. The planner keeps no state between calls
beyond what never changes within a process (a device's capability, the self-test's verdicts).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from . import format as fmt
from . import sparse
from .masks import KeyMask, NotPerKeyMask, reduce_key_mask
from .policy import AttentionPolicy, Precision

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class CallPlan:
    """What one attention call does.

    ``run_op``: run :func:`nvfp4_dit.ops.run_fp4` with ``backend`` ("cuda" or "reference": FP4;
    "sdpa": the op's exact attention, e.g. to compare through the same wrapper), ``balance_qk``,
    ``qk_format``, ``key_mask`` and ``sparsity`` (from ``keep_mass``: block-sparse, None: dense;
    ``always_keep``: the keys its estimate keeps, the text of a joint video sequence; ``video_order``:
    the 3D tile order of a video self-attention, which block-sparse calls run in, :meth:`order_for`);
    else the caller's own exact attention, for ``reason``, worth one warning when ``warn``.
    ``fp4``: whether the call runs in FP4.
    """

    __slots__ = ("run_op", "reason", "warn", "backend", "balance_qk", "qk_format", "key_mask", "keep_mass",
                 "always_keep", "video_order")

    def __init__(self, run_op: bool, reason: Optional[str] = None, warn: bool = False, backend: str = "sdpa",
                 balance_qk: bool = fmt.BALANCE_QK_DEFAULT, qk_format: str = fmt.QK_FORMAT_DEFAULT,
                 key_mask: Optional[KeyMask] = None, keep_mass: Optional[float] = None,
                 always_keep: Optional[tuple[int, int]] = None, video_order=None):
        self.run_op, self.reason, self.warn = run_op, reason, warn
        self.backend, self.balance_qk, self.qk_format, self.key_mask = backend, balance_qk, qk_format, key_mask
        self.keep_mass, self.always_keep, self.video_order = keep_mass, always_keep, video_order

    @property
    def fp4(self) -> bool:
        return self.run_op and self.backend != "sdpa"

    @property
    def sparsity(self) -> Optional[sparse.Sparsity]:
        """The block-sparse call of ``keep_mass`` (estimated per call), or None for dense."""
        return None if self.keep_mass is None else sparse.Sparsity(keep_mass=self.keep_mass,
                                                                     always_keep=self.always_keep)

    def order_for(self, sparsity: Optional[sparse.Sparsity]):
        """The token order a call with ``sparsity`` runs in: a block-sparse call over video tokens
        in 3D tiles (:mod:`nvfp4_dit.token_order`), a dense one in the caller's order (None)."""
        return None if sparsity is None else self.video_order

    def __repr__(self) -> str:
        if self.run_op:
            return (f"CallPlan(op, backend={self.backend}, qk_format={self.qk_format}, balance_qk={self.balance_qk}"
                    + ("" if self.keep_mass is None else f", keep_mass={self.keep_mass}") + ")")
        return f"CallPlan(exact: {self.reason})"


def exact(reason: str, warn: bool = False) -> CallPlan:
    return CallPlan(False, reason, warn)


def ineligible_reason(q, k, v, *, layout: str, attn_mask=None, is_causal: bool = False, dropout_p: float = 0.0,
                      enable_gqa: bool = True, scale: Optional[float] = None) -> Optional[str]:
    """Why valid SDPA arguments cannot run in FP4 (a sentence), or None."""
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)):
        return "q/k/v not 4-D tensors"
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in FLOAT_DTYPES:
        return f"dtypes {q.dtype}/{k.dtype}/{v.dtype}"
    if not (q.device == k.device == v.device):
        return "q/k/v on different devices"
    if dropout_p:
        return "dropout_p > 0"
    if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        return f"softmax scale {scale!r} (not a positive finite number)"
    if attn_mask is not None and is_causal:
        return "attn_mask together with is_causal"
    b, h, _, d = fmt.hnd_shape(q, layout)
    bk, hkv, _, dk = fmt.hnd_shape(k, layout)
    if k.shape != v.shape or bk != b or dk != d:
        return "q/k/v shapes that SDPA would broadcast or reject"
    if h != hkv and (not enable_gqa or hkv == 0 or h % hkv):
        return f"{h} query heads with {hkv} key/value heads without enable_gqa"
    if fmt.padded_head_dim(d) is None:
        return f"head dim {d} > {fmt.SUPPORTED_HEAD_DIMS[-1]}"
    return None


# (device index, padded head dim, Q·Kᵀ format, backend) -> (resolved back-end or None, reason, hard)
_resolved: dict = {}


def resolve_backend(backend: str, device: torch.device, head_dim: int,
                    qk_format: str) -> tuple[Optional[str], Optional[str], bool]:
    """The back-end that runs an FP4 call: ``(backend, None, False)``, or ``(None, reason, hard)``
    where exact attention must run instead. ``hard``: an explicitly requested back-end cannot run
    here at all (the op raises :class:`~nvfp4_dit.ops.BackendUnavailableError`); otherwise the
    reason is a fallback (no native MMA for ``auto``, or the kernel failed its self-test)."""
    if backend in ("reference", "sdpa"):
        return backend, None, False
    if device.type != "cuda":
        return None, f"no GPU: tensors are on {device.type}", backend == "cuda"
    from . import selftest

    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, fmt.padded_head_dim(head_dim), qk_format, backend, selftest.skipped())
    found = _resolved.get(key)
    if found is not None:
        return found
    from .cuda import attention as cuda_attention

    reason = cuda_attention.device_unsupported_reason(torch.device("cuda", index), require_native=backend == "auto")
    if reason is not None:
        found = (None, reason, backend == "cuda")
    else:
        # A kernel that failed its first-use self-test never answers, whichever back-end was asked
        # for. A verdict still pending (the test cannot run during CUDA-graph capture) is not kept.
        reason = selftest.fallback_reason(torch.device("cuda", index), head_dim, qk_format)
        found = ("cuda", None, False) if reason is None else (None, reason, False)
        if reason is not None and torch.cuda.is_current_stream_capturing():
            return found
    _resolved[key] = found
    return found


def forget_resolved() -> None:
    """Forget the resolved back-ends (after :func:`nvfp4_dit.selftest.reset`)."""
    _resolved.clear()


def policy_reason(policy: AttentionPolicy, *, cross: Optional[bool] = None, step: Optional[tuple[int, int]] = None,
                  layer: Optional[str] = None, check_layer: bool = True) -> tuple[Optional[str], Optional[Precision]]:
    """The tensor-free part of a plan: ``(why the policy keeps the call exact, or None; the layer's
    calibrated precision at ``step``, or None)``. Arguments left None are not checked."""
    if check_layer and not policy.layer_allowed(layer):
        return "layer not selected", None
    reason = policy.dense_reason(cross=cross, step=step)
    if reason is not None:
        return reason, None
    precision = policy.precision_for(layer, step)
    if precision is not None and precision.exact:
        return "exact by calibration", precision
    return None, precision


def plan_call(q, k, v, *, layout: str, policy: AttentionPolicy, attn_mask: Optional[torch.Tensor] = None,
              is_causal: bool = False, dropout_p: float = 0.0, enable_gqa: bool = True,
              scale: Optional[float] = None, cross: Optional[bool] = None, step: Optional[tuple[int, int]] = None,
              layer: Optional[str] = None, check_layer: bool = True, check_step: bool = True,
              video: Optional[sparse.VideoTokens] = None) -> CallPlan:
    """The plan of one attention call given SDPA's arguments (``attn_mask`` with SDPA's semantics,
    broadcastable to [B, H, Sq, Sk]; ``layout`` "NHD" or "HND") and what the caller knows of it:
    its ``cross``-attention role, denoising ``step`` ``(index, total)``, ``layer`` name and the
    forward's ``video`` tokens (a block-sparse call keeps every key that is not video). A caller
    that applied the layer and step rules itself passes ``check_layer`` / ``check_step`` False (the
    step still chooses between sparse and dense NVFP4)."""
    reason, precision = policy_reason(policy, cross=cross, step=step if check_step else None, layer=layer,
                                      check_layer=check_layer)
    if reason is not None:
        return exact(reason)
    reason = ineligible_reason(q, k, v, layout=layout, attn_mask=attn_mask, is_causal=is_causal, dropout_p=dropout_p,
                               enable_gqa=enable_gqa, scale=scale)
    if reason is not None:
        return exact(reason, warn=True)
    b, h, sq, d = fmt.hnd_shape(q, layout)
    sk = fmt.hnd_shape(k, layout)[2]
    reason = policy.dense_reason(seq_q=sq, seq_k=sk)
    if reason is not None:
        return exact(reason)
    balance_qk = policy.balance_qk if precision is None else precision.balance_qk
    qk_format = policy.qk_format if precision is None else precision.qk_format
    backend, reason, _ = resolve_backend(policy.backend, q.device, d, qk_format)
    if backend is None:
        return exact(reason, warn=True)
    key_mask = None
    if attn_mask is not None:
        try:
            key_mask = reduce_key_mask(attn_mask, b, h, sq, sk)
        except NotPerKeyMask as e:
            return exact(str(e), warn=True)
    keep_mass = policy.keep_mass_for(step, sq, sk, layer)
    always_keep = None if keep_mass is None or video is None else video.other_keys(sk)
    video_order = None if video is None else video.order(sq, sk, is_causal)
    return CallPlan(True, backend=backend, balance_qk=balance_qk, qk_format=qk_format, key_mask=key_mask,
                    keep_mass=keep_mass, always_keep=always_keep, video_order=video_order)
