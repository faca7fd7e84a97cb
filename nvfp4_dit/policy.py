"""Which attention calls run NVFP4 and which stay exact: one policy for diffusers and ComfyUI.

A call runs NVFP4 only if every rule allows it:

* **role** -- self-attention (joint text+video included) runs NVFP4 (``self_attention``);
  cross-attention to text or image context stays exact (``cross_attention=False``): its keys are
  short, so there is nothing to gain and a visible quality cost;
* **steps** -- the first and last ``dense_steps = (first, last)`` denoising steps stay exact: early
  steps fix the layout, late ones the fine detail;
* **length** -- calls whose query or key sequence is shorter than ``min_seq_len`` stay exact (the
  FP4 path pads to 128-token tiles and quantises; short calls gain nothing);
* **layers** -- an optional allow-list of module-name patterns or block indices (diffusers);
* **per layer** -- a calibrated policy (:func:`nvfp4_dit.calibrate`) also names, for each
  attention module and each third of the denoising schedule (first / middle / last), the
  precision it runs in: NVFP4 with or without the Q/K channel balance, MXFP8 Q·Kᵀ, or exact.  Saved as JSON
  with the model's class name; only integrations that know the module (``apply()``) use it.

The integrations feed it what they know: the diffusers processors their role, the denoising step
(:mod:`nvfp4_dit.processors.steps`) and their module name, the router the sequence lengths; the
ComfyUI override all of it from one call (the step from the sampler's sigmas). The policy holds
only these settings: no tensors, no state between calls.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import json
import os
import re
from typing import Iterable, Optional, Union

from .checks import BACKENDS, check_keep_mass
from .format import BALANCE_QK_DEFAULT, QK_FORMAT_DEFAULT, QK_FORMATS

from .defaults import (DEFAULT_DENSE_STEPS, DEFAULT_MIN_SEQ_LEN, DEFAULT_SPARSE_MIN_SEQ_LEN,  # noqa: F401
                       DEFAULT_SPARSE_OFF_STEPS)

LayerSpec = Union[str, int]
_BLOCK_INDEX = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")

STEP_BUCKETS = ("first", "middle", "last")
POLICY_FILE_VERSION = 3   # 3: per-layer keep_mass, density and sparse_errors


def _check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


@dataclasses.dataclass(frozen=True)
class Precision:
    """How one attention call runs: exact attention (``qk_format=None``), or FP4 attention with Q
    and K in ``qk_format`` (:data:`~nvfp4_dit.format.QK_FORMATS`) and, with ``balance_qk``, the
    per-channel Q/K balance (:func:`nvfp4_dit.attention`)."""

    qk_format: Optional[str] = None
    balance_qk: bool = False

    def __post_init__(self):
        if self.qk_format is not None and self.qk_format not in QK_FORMATS:
            raise ValueError(f"qk_format must be one of {QK_FORMATS} or None (exact), got {self.qk_format!r}")
        _check_bool("balance_qk", self.balance_qk)
        if self.qk_format is None and self.balance_qk:
            raise ValueError("exact attention (qk_format None) has no channel balance")

    @property
    def exact(self) -> bool:
        return self.qk_format is None

    @property
    def label(self) -> str:
        """A short name for tables: "exact", "nvfp4", "nvfp4+balance", "mxfp8+balance"."""
        return "exact" if self.exact else self.qk_format + ("+balance" if self.balance_qk else "")

    def to_dict(self) -> dict:
        return {"qk_format": self.qk_format, "balance_qk": self.balance_qk}

    @classmethod
    def from_dict(cls, d: dict) -> "Precision":
        return cls(d.get("qk_format"), bool(d.get("balance_qk", False)))


EXACT = Precision()
# The FP4 precisions a calibration measures, cheapest first: without the channel balance the
# quantiser reads Q and K once instead of twice (same attention kernel time); MXFP8 Q·Kᵀ runs its
# MMAs at half the FP4 rate; exact attention costs several times more.
FP4_PRECISIONS = (Precision("nvfp4", False), Precision("nvfp4", True), Precision("mxfp8", True))
PRECISIONS = FP4_PRECISIONS + (EXACT,)
PRECISION_COST = {p: i for i, p in enumerate(PRECISIONS)}
# Policy files of version 1 named the precisions by these strings.
_VERSION1_PRECISIONS = {"nvfp4-unbalanced": FP4_PRECISIONS[0], "nvfp4": FP4_PRECISIONS[1],
                        "mxfp8": FP4_PRECISIONS[2], "dense": EXACT}


def step_bucket(step: Optional[tuple[int, int]]) -> str:
    """The third of the schedule that step ``(index, total)`` falls in; "middle" when unknown."""
    if step is None:
        return "middle"
    index, total = step
    return STEP_BUCKETS[min(2, max(0, index) * 3 // max(1, total))]


@dataclasses.dataclass(frozen=True)
class LayerPrecision:
    """The precision of one attention module in one third of the schedule, with what it measured.

    Args:
        layer: the module path as :func:`nvfp4_dit.apply` names it (``transformer.blocks.3.attn1``).
        bucket: "first", "middle" or "last" (:func:`step_bucket`).
        precision: a :class:`Precision` (one of :data:`PRECISIONS`).
        errors: ``((precision, relative L2 error of the attention output), ...)`` measured by
            :func:`nvfp4_dit.calibrate` (empty when written by hand).
        keep_mass: the block-sparse ``keep_mass`` this layer runs at (1.0: dense NVFP4), or None
            where the calibration measured no sparsity (the policy's ``keep_mass`` applies).
        density: the share of key tiles the estimate kept at ``keep_mass`` when measured.
        sparse_errors: ``((precision, keep_mass, relative L2 error, density), ...)``: the
            calibration's ladder of block-sparse runs.
    """

    layer: str
    bucket: str
    precision: Precision
    errors: tuple[tuple[Precision, float], ...] = ()
    keep_mass: Optional[float] = None
    density: Optional[float] = None
    sparse_errors: tuple[tuple[Precision, float, float, float], ...] = ()

    def __post_init__(self):
        if not isinstance(self.layer, str) or not self.layer:
            raise ValueError(f"layer must be a module path, got {self.layer!r}")
        if self.bucket not in STEP_BUCKETS:
            raise ValueError(f"bucket must be one of {STEP_BUCKETS}, got {self.bucket!r}")
        if not isinstance(self.precision, Precision):
            raise TypeError(f"precision must be a Precision, got {type(self.precision).__name__}")
        errors = tuple((p, float(e)) for p, e in self.errors)
        if any(not isinstance(p, Precision) for p, _ in errors):
            raise TypeError(f"errors must pair a Precision with an error, got {self.errors!r}")
        object.__setattr__(self, "errors", errors)
        object.__setattr__(self, "keep_mass", check_keep_mass(self.keep_mass))
        if self.keep_mass is not None and self.precision.exact:
            raise ValueError("an exact layer has no keep_mass")
        if self.density is not None:
            object.__setattr__(self, "density", float(self.density))
            if not 0.0 <= self.density <= 1.0:
                raise ValueError(f"density must be in [0, 1], got {self.density}")
        sparse_errors = tuple((p, float(k), float(e), float(d)) for p, k, e, d in self.sparse_errors)
        if any(not isinstance(p, Precision) for p, *_ in sparse_errors):
            raise TypeError(f"sparse_errors must start each entry with a Precision, got {self.sparse_errors!r}")
        object.__setattr__(self, "sparse_errors", sparse_errors)

    def to_dict(self) -> dict:
        return {"layer": self.layer, "bucket": self.bucket, **self.precision.to_dict(),
                "errors": [{**p.to_dict(), "error": e} for p, e in self.errors],
                "keep_mass": self.keep_mass, "density": self.density,
                "sparse_errors": [{**p.to_dict(), "keep_mass": k, "error": e, "density": d}
                                  for p, k, e, d in self.sparse_errors]}

    @classmethod
    def from_dict(cls, d: dict, version: int) -> "LayerPrecision":
        if version == 1:   # {"precision": "nvfp4-unbalanced", "errors": {"nvfp4": 0.07, ...}}
            def old(name):
                if name not in _VERSION1_PRECISIONS:
                    raise ValueError(f"unknown precision {name!r}")
                return _VERSION1_PRECISIONS[name]
            return cls(d["layer"], d["bucket"], old(d["precision"]),
                       tuple((old(p), e) for p, e in d.get("errors", {}).items()))
        return cls(d["layer"], d["bucket"], Precision.from_dict(d),
                   tuple((Precision.from_dict(e), e["error"]) for e in d.get("errors", [])),
                   keep_mass=d.get("keep_mass"), density=d.get("density"),
                   sparse_errors=tuple((Precision.from_dict(e), e["keep_mass"], e["error"], e["density"])
                                       for e in d.get("sparse_errors", [])))


def _check_per_layer(entries) -> Optional[tuple[LayerPrecision, ...]]:
    if entries is None:
        return None
    out = tuple(entries)
    if not all(isinstance(e, LayerPrecision) for e in out):
        raise TypeError("per_layer must be a sequence of LayerPrecision")
    seen = set()
    for e in out:
        if (e.layer, e.bucket) in seen:
            raise ValueError(f"per_layer names {e.layer} ({e.bucket}) twice")
        seen.add((e.layer, e.bucket))
    return out


def _in_edge_steps(step: Optional[tuple[int, int]], edges: tuple[int, int]) -> bool:
    """Whether step ``(index, total)`` (0-based) is one of the ``(first, last)`` steps; an unknown
    step (None) is not."""
    if step is None:
        return False
    index, total = step
    first, last = edges
    return index < first or index >= total - last


def _check_dense_steps(dense_steps, name: str = "dense_steps") -> tuple[int, int]:
    if dense_steps is None:
        return (0, 0)
    if (not isinstance(dense_steps, (tuple, list)) or len(dense_steps) != 2
            or any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in dense_steps)):
        raise ValueError(f"{name} must be a pair (first, last) of non-negative ints, got {dense_steps!r}")
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
        qk_format: "nvfp4" or "mxfp8", the format of Q and K (:func:`nvfp4_dit.attention`).
        per_layer: calibrated precisions per (module, third of the schedule), see
            :class:`LayerPrecision`; a module or third not listed follows the rules above.
            Applied by :func:`nvfp4_dit.apply`, which checks they name the model's modules.
        model_class: the class name of the model ``per_layer`` was calibrated on.
        budget: the error budget ``per_layer`` was chosen for (informational).
        keep_mass: block-sparse NVFP4 (:func:`nvfp4_dit.attention`'s ``keep_mass``: each call
            estimates its own block map and keeps, per 128-query block, the key tiles holding this
            share of the estimated attention mass); None (the default) = dense.
        sparse_off_steps: ``(first, last)`` denoising steps that run dense NVFP4 even with
            ``keep_mass`` (the first steps lay the video out; default (2, 0)).
        sparse_min_seq_len: calls whose query or key sequence is shorter run dense NVFP4 even
            with ``keep_mass`` (default 16384: shorter calls have few tiles to skip).
    """

    backend: str = "auto"
    self_attention: bool = True
    cross_attention: bool = False
    dense_steps: tuple[int, int] = DEFAULT_DENSE_STEPS
    min_seq_len: int = DEFAULT_MIN_SEQ_LEN
    layers: Optional[tuple[LayerSpec, ...]] = None
    balance_qk: bool = BALANCE_QK_DEFAULT
    qk_format: str = QK_FORMAT_DEFAULT
    per_layer: Optional[tuple[LayerPrecision, ...]] = None
    model_class: Optional[str] = None
    budget: Optional[float] = None
    keep_mass: Optional[float] = None
    sparse_off_steps: tuple[int, int] = DEFAULT_SPARSE_OFF_STEPS
    sparse_min_seq_len: int = DEFAULT_SPARSE_MIN_SEQ_LEN

    def __post_init__(self):
        if not isinstance(self.backend, str) or self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        _check_bool("self_attention", self.self_attention)
        _check_bool("cross_attention", self.cross_attention)
        _check_bool("balance_qk", self.balance_qk)
        if not isinstance(self.qk_format, str) or self.qk_format not in QK_FORMATS:
            raise ValueError(f"qk_format must be one of {QK_FORMATS}, got {self.qk_format!r}")
        object.__setattr__(self, "dense_steps", _check_dense_steps(self.dense_steps))
        if isinstance(self.min_seq_len, bool) or not isinstance(self.min_seq_len, int) or self.min_seq_len < 0:
            raise ValueError(f"min_seq_len must be a non-negative int, got {self.min_seq_len!r}")
        object.__setattr__(self, "layers", _check_layers(self.layers))
        object.__setattr__(self, "per_layer", _check_per_layer(self.per_layer))
        if self.model_class is not None and not isinstance(self.model_class, str):
            raise TypeError(f"model_class must be a str, got {type(self.model_class).__name__}")
        if self.budget is not None and (isinstance(self.budget, bool) or not isinstance(self.budget, (int, float))
                                        or not self.budget > 0):
            raise ValueError(f"budget must be a positive number, got {self.budget!r}")
        object.__setattr__(self, "keep_mass", check_keep_mass(self.keep_mass))
        object.__setattr__(self, "sparse_off_steps", _check_dense_steps(self.sparse_off_steps, "sparse_off_steps"))
        if (isinstance(self.sparse_min_seq_len, bool) or not isinstance(self.sparse_min_seq_len, int)
                or self.sparse_min_seq_len < 0):
            raise ValueError(f"sparse_min_seq_len must be a non-negative int, got {self.sparse_min_seq_len!r}")

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
        return _in_edge_steps(step, self.dense_steps)

    # Derived once per policy (it is frozen), read per call. functools.cached_property writes the
    # instance __dict__ directly, which a frozen dataclass allows; equality compares fields only.

    @functools.cached_property
    def may_run_sparse(self) -> bool:
        """Whether a call may run block-sparse: a ``keep_mass`` below 1, the policy's or a layer's."""
        return any(k is not None and k < 1.0 for k in (self.keep_mass, *(e.keep_mass for e in self.per_layer or ())))

    @functools.cached_property
    def without_sparsity(self) -> "AttentionPolicy":
        """This policy with no ``keep_mass`` (calls it cannot run block-sparse: ring shards)."""
        return self if self.keep_mass is None else dataclasses.replace(self, keep_mass=None)

    @functools.cached_property
    def _entries(self) -> dict:
        """``per_layer`` by (layer, bucket)."""
        return {(e.layer, e.bucket): e for e in self.per_layer or ()}

    def keep_mass_for(self, step: Optional[tuple[int, int]], seq_q: int, seq_k: int,
                      layer: Optional[str] = None) -> Optional[float]:
        """The ``keep_mass`` of an NVFP4 call at ``step`` (None: unknown) with these lengths, in
        module ``layer``: the layer's calibrated one where ``per_layer`` has it, else the policy's;
        None (dense) without one, on the ``sparse_off_steps`` and below ``sparse_min_seq_len``
        (:meth:`sparse_off_reason` says which)."""
        if self.sparse_off_reason(step, seq_q, seq_k, layer) is not None:
            return None
        return self._layer_keep_mass(layer, step)

    def sparse_off_reason(self, step: Optional[tuple[int, int]], seq_q: int, seq_k: int,
                          layer: Optional[str] = None) -> Optional[str]:
        """Why an NVFP4 call at ``step`` with these lengths, in module ``layer``, runs dense under
        this policy (a line naming the rule and its threshold), or None if it runs block-sparse."""
        keep_mass = self._layer_keep_mass(layer, step)
        if keep_mass is None:
            return "no keep_mass"
        if keep_mass == 1.0:
            return "keep_mass 1.0"
        if min(seq_q, seq_k) < self.sparse_min_seq_len:
            return f"shorter than sparse_min_seq_len {self.sparse_min_seq_len}"
        if _in_edge_steps(step, self.sparse_off_steps):
            return f"on sparse_off_steps {self.sparse_off_steps[0]},{self.sparse_off_steps[1]}"
        return None

    def _layer_keep_mass(self, layer: Optional[str], step: Optional[tuple[int, int]]) -> Optional[float]:
        entry = self.layer_entry(layer, step)
        return self.keep_mass if entry is None or entry.keep_mass is None else entry.keep_mass

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

    def layer_entry(self, layer: Optional[str], step: Optional[tuple[int, int]]) -> Optional["LayerPrecision"]:
        """The ``per_layer`` entry of module ``layer`` at ``step``, or None."""
        if self.per_layer is None or layer is None:
            return None
        return self._entries.get((layer, step_bucket(step)))

    def precision_for(self, layer: Optional[str], step: Optional[tuple[int, int]]) -> Optional[Precision]:
        """The calibrated precision of module ``layer`` at ``step``, or None where ``per_layer``
        says nothing (the uniform rules apply)."""
        entry = self.layer_entry(layer, step)
        return None if entry is None else entry.precision

    def for_precision(self, precision: Precision) -> "AttentionPolicy":
        """The uniform policy of an FP4 call that runs in ``precision`` (not :data:`EXACT`)."""
        if not isinstance(precision, Precision) or precision.exact:
            raise ValueError(f"precision must be one of the FP4 precisions {FP4_PRECISIONS}, got {precision!r}")
        if (self.per_layer is None and self.balance_qk == precision.balance_qk
                and self.qk_format == precision.qk_format):
            return self
        return dataclasses.replace(self, balance_qk=precision.balance_qk, qk_format=precision.qk_format,
                                   per_layer=None)

    def precision_policies(self) -> dict:
        """{precision: :meth:`for_precision`} for every FP4 precision, built once by a caller that
        looks precisions up per call."""
        return {p: self.for_precision(p) for p in FP4_PRECISIONS}

    def check_layers(self, model_class: str, layers: Iterable[str]) -> None:
        """Raise ValueError unless ``per_layer`` was calibrated on ``model_class`` and names only
        modules in ``layers`` (a policy calibrated on another model must not be applied)."""
        if self.per_layer is None:
            return
        if self.model_class is not None and self.model_class != model_class:
            raise ValueError(f"policy was calibrated on {self.model_class}, not on {model_class}: calibrate this "
                             "model (nvfp4_dit.calibrate) or use a uniform policy")
        known = set(layers)
        unknown = sorted({e.layer for e in self.per_layer} - known)
        if unknown:
            raise ValueError(f"policy names attention modules this model does not have: {unknown[:5]}"
                             + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
                             + f"; this model's are {sorted(known)[:5]}"
                             + (" ..." if len(known) > 5 else "") + " (calibrated on another model or a "
                             "pipeline rather than a bare model?)")

    def describe(self) -> str:
        first, last = self.dense_steps
        text = (f"backend {self.backend}, self-attention {'NVFP4' if self.self_attention else 'exact'}, "
                f"cross-attention {'NVFP4' if self.cross_attention else 'exact'}, dense steps {first},{last}, "
                f"min_seq_len {self.min_seq_len}, balance_qk {self.balance_qk}, Q·Kᵀ {self.qk_format}"
                + ("" if self.layers is None else f", layers {list(self.layers)}"))
        if self.keep_mass is not None:
            text += (f", block-sparse keep_mass {self.keep_mass} (dense NVFP4 on steps "
                     f"{self.sparse_off_steps[0]},{self.sparse_off_steps[1]} and below {self.sparse_min_seq_len} tokens)")
        if self.per_layer is not None:
            counts = {p: sum(e.precision == p for e in self.per_layer) for p in PRECISIONS}
            text += (f", calibrated on {self.model_class} (budget {self.budget}): "
                     + ", ".join(f"{n} {p.label}" for p, n in counts.items() if n))
            sparse = [e for e in self.per_layer if e.keep_mass is not None and e.keep_mass < 1.0]
            if sparse:
                mean = sum(e.density for e in sparse if e.density is not None) / max(
                    1, sum(e.density is not None for e in sparse))
                text += f"; {len(sparse)} block-sparse (mean density {mean:.3f})"
        return text

    # -- JSON -------------------------------------------------------------------------------------

    def to_dict(self) -> dict:
        d = {"version": POLICY_FILE_VERSION}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "per_layer" and value is not None:
                value = [e.to_dict() for e in value]
            elif isinstance(value, tuple):
                value = list(value)
            d[f.name] = value
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "AttentionPolicy":
        if not isinstance(d, dict):
            raise ValueError(f"a policy must be a JSON object, got {type(d).__name__}")
        version = d.get("version")
        if version not in (1, 2, POLICY_FILE_VERSION):
            raise ValueError(f"policy file version {version!r} is not one of 1, 2, {POLICY_FILE_VERSION}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names - {"version"})
        if unknown:
            raise ValueError(f"policy has unknown fields {unknown}")
        kw = {k: v for k, v in d.items() if k in names}
        for pair in ("dense_steps", "sparse_off_steps"):
            if kw.get(pair) is not None:
                kw[pair] = tuple(kw[pair])
        if kw.get("per_layer") is not None:
            kw["per_layer"] = tuple(LayerPrecision.from_dict(e, version) for e in kw["per_layer"])
        return cls(**kw)

    def save(self, path: Union[str, os.PathLike]) -> None:
        """Write the policy as JSON (readable by :meth:`load`, the ComfyUI node and the scripts)."""
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)
            f.write("\n")

    @classmethod
    def load(cls, path: Union[str, os.PathLike]) -> "AttentionPolicy":
        """Read a policy written by :meth:`save`; ValueError naming the file if it is not one."""
        try:
            with open(path) as f:
                d = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not a policy JSON file: {e}") from None
        try:
            return cls.from_dict(d)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path} is not a valid nvfp4_dit policy: {e}") from None

