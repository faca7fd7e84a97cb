"""Which attention calls run NVFP4 and which stay exact: one policy for diffusers and ComfyUI.

A call runs NVFP4 only if every rule allows it:

* **role** -- self-attention (joint text+video included) runs NVFP4 (``self_attention``);
  cross-attention to text or image context stays exact (``cross_attention=False``): its keys are
  short, so there is nothing to gain and a visible quality cost;
* **steps** -- the first and last ``dense_steps = (first, last)`` denoising steps stay exact: early
  steps fix the layout, late ones the fine detail;
* **length** -- calls whose query or key sequence is shorter than ``min_seq_len`` stay exact (the
  FP4 path pads to 128-token tiles and quantises; short calls gain nothing);
* **layers** -- an optional allow-list of module-name patterns or block indices (diffusers).

The integrations feed it what they know: the diffusers processors their role, the denoising step
(:mod:`nvfp4_dit.processors.steps`) and their module name, the router the sequence lengths; the
ComfyUI override all of it from one call (the step from the sampler's sigmas). The policy holds
only these settings: no tensors, no state between calls.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from typing import Optional, Union

from .checks import BACKENDS
from .format import BALANCE_QK_DEFAULT

DEFAULT_DENSE_STEPS = (1, 1)
DEFAULT_MIN_SEQ_LEN = 1024

LayerSpec = Union[str, int]
_BLOCK_INDEX = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


def _check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


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


@dataclasses.dataclass(frozen=True)
class AttentionPolicy:
    """The NVFP4 / exact decision for each attention call.

    Args:
        backend: the :func:`nvfp4_dit.attention` back-end of NVFP4 calls: "auto" (the kernel
            where the native FP4 MMA exists, exact attention elsewhere), "cuda", "reference", "sdpa".
        self_attention: run self-attention (and joint text+video attention) in NVFP4.
        cross_attention: run cross-attention (to text / image context) in NVFP4.
        dense_steps: ``(first, last)``: that many first and last denoising steps stay exact.
        min_seq_len: calls whose query or key sequence is shorter stay exact.
        layers: allow-list of module-name patterns (fnmatch, e.g. ``"blocks.*.attn1"``) or block
            indices (``3`` matches ``blocks.3.attn1``); None allows every layer.
        balance_qk: balance Q and K per channel before quantising them (:func:`nvfp4_dit.attention`).
    """

    backend: str = "auto"
    self_attention: bool = True
    cross_attention: bool = False
    dense_steps: tuple[int, int] = DEFAULT_DENSE_STEPS
    min_seq_len: int = DEFAULT_MIN_SEQ_LEN
    layers: Optional[tuple[LayerSpec, ...]] = None
    balance_qk: bool = BALANCE_QK_DEFAULT

    def __post_init__(self):
        if not isinstance(self.backend, str) or self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        _check_bool("self_attention", self.self_attention)
        _check_bool("cross_attention", self.cross_attention)
        _check_bool("balance_qk", self.balance_qk)
        object.__setattr__(self, "dense_steps", _check_dense_steps(self.dense_steps))
        if isinstance(self.min_seq_len, bool) or not isinstance(self.min_seq_len, int) or self.min_seq_len < 0:
            raise ValueError(f"min_seq_len must be a non-negative int, got {self.min_seq_len!r}")
        object.__setattr__(self, "layers", _check_layers(self.layers))

    def replace(self, **changes) -> "AttentionPolicy":
        """A copy with some settings changed (checked like the constructor's)."""
        return dataclasses.replace(self, **changes)

    # -- the rules ------------------------------------------------------------------------------

    def layer_allowed(self, name: Optional[str]) -> bool:
        """Whether the module called ``name`` (its path in the model, optionally with a pipeline
        component prefix such as ``transformer.``) may run NVFP4 under ``layers``."""
        if self.layers is None:
            return True
        if name is None:
            return False
        parts = name.split(".")
        for spec in self.layers:
            if isinstance(spec, int):
                m = _BLOCK_INDEX.search(name)
                if m is not None and int(m.group(1)) == spec:
                    return True
            elif fnmatch.fnmatchcase(name, spec) or (len(parts) > 1 and fnmatch.fnmatchcase(".".join(parts[1:]), spec)):
                return True
        return False

    def step_is_dense(self, step: Optional[tuple[int, int]]) -> bool:
        """Whether step ``(index, total)`` (0-based) is one of the dense first/last steps; an
        unknown step (None) is not."""
        if step is None:
            return False
        index, total = step
        first, last = self.dense_steps
        return index < first or index >= total - last

    def dense_reason(self, *, cross: Optional[bool] = None, step: Optional[tuple[int, int]] = None,
                     seq_q: Optional[int] = None, seq_k: Optional[int] = None) -> Optional[str]:
        """Why a call stays exact under this policy, or None if it may run NVFP4.

        Each rule is checked for what the caller knows (an argument left None is not checked):
        ``cross`` the role, ``step`` the denoising step ``(index, total)``, ``seq_q``/``seq_k``
        the lengths. Callers that learn these at different places ask at each place.
        """
        if cross is not None and not (self.cross_attention if cross else self.self_attention):
            return "cross-attention" if cross else "self-attention"
        if self.step_is_dense(step):
            return "dense step"
        if seq_q is not None and seq_k is not None and min(seq_q, seq_k) < self.min_seq_len:
            return "short sequence"
        return None

    def describe(self) -> str:
        first, last = self.dense_steps
        return (f"backend {self.backend}, self-attention {'NVFP4' if self.self_attention else 'exact'}, "
                f"cross-attention {'NVFP4' if self.cross_attention else 'exact'}, dense steps {first},{last}, "
                f"min_seq_len {self.min_seq_len}, balance_qk {self.balance_qk}"
                + ("" if self.layers is None else f", layers {list(self.layers)}"))

