"""Per-layer precision (and sparsity) from measured error: what the diffusers and ComfyUI calibrations share.

A calibration observes a model's attention calls, computed exactly, and for each call runs every
candidate precision on the same Q, K, V, dense and, when the base policy is block-sparse (has a
``keep_mass``), at each ``keep_mass`` of :data:`KEEP_MASS_LADDER` (where the policy would run that
call sparse: its length and step). :class:`CalibrationTable` accumulates, per (layer, third of
the schedule, precision, keep_mass), the squared error of the attention output against the exact
one, the squared norm of the exact output and the share of key tiles the block map kept;
:meth:`CalibrationTable.policy` turns that into an :class:`~nvfp4_dit.policy.AttentionPolicy`
whose ``per_layer`` entries give each layer and third the run with the least modelled attention
time (:data:`PRECISION_TIME` x density) whose relative L2 error is within the budget, and exact
attention where none is.

The table holds Python floats only: a few sums per entry, never a tensor.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Callable, Optional

import torch

from .defaults import DEFAULT_BUDGET  # noqa: F401 (re-exported)
from .policy import EXACT, FP4_PRECISIONS, PRECISION_COST, AttentionPolicy, LayerPrecision, Precision, step_bucket


def measurement_policy(policy: AttentionPolicy) -> AttentionPolicy:
    """The policy that measures ``policy``'s FP4 numerics. Its ``backend="auto"`` runs exact SDPA
    wherever the FP4 MMA is not native (sm_80/sm_90, CPU), which would measure no error at all; the
    measurement takes the kernel wherever it runs (emulated on sm_80/sm_90: the same numerics as
    sm_120) and the reference numerics elsewhere. Other back-ends are kept as asked."""
    if policy.backend != "auto":
        return policy
    from .ops import available_backends

    return policy.replace(backend="cuda" if "cuda" in available_backends() else "reference")


def relative_error_terms(out: torch.Tensor, exact: torch.Tensor) -> tuple[float, float]:
    """(||out - exact||^2, ||exact||^2) in float64, as Python floats."""
    o, e = out.double(), exact.double()
    return float((o - e).pow(2).sum()), float(e.pow(2).sum())


# The block-sparse keep_mass values a calibration measures when the base policy has a keep_mass.
# 0.99 because a video call's 3D tiles make the pooled estimate confident: there 0.99 keeps about
# the accuracy that 0.9 keeps in raster order (docs/measurements.md, block-sparse attention).
KEEP_MASS_LADDER = (0.99, 0.95, 0.9, 0.8)
# Modelled attention time of each FP4 precision against NVFP4, for the choice of the cheapest:
# MXFP8 Q·Kᵀ runs at about 0.7x the NVFP4 speed (scripts/model_sm120.py); the channel balance costs
# the quantiser a second read of Q and K, not the kernel. A block-sparse call costs its density.
PRECISION_TIME = {FP4_PRECISIONS[0]: 1.0, FP4_PRECISIONS[1]: 1.0, FP4_PRECISIONS[2]: 1.43}


class CalibrationTable:
    """Accumulated error (and, for block-sparse runs, density) per (layer, step bucket, precision,
    keep_mass); see the module docstring."""

    def __init__(self):
        # (layer, bucket) -> (precision, keep_mass or None for dense) -> [sum of squared error,
        # sum of squared exact norm, sum of densities, calls]
        self._sums: dict = defaultdict(lambda: defaultdict(lambda: [0.0, 0.0, 0.0, 0]))

    def add(self, layer: str, step: Optional[tuple[int, int]], precision: Precision, err2: float, ref2: float,
            keep_mass: Optional[float] = None, density: float = 1.0) -> None:
        if precision not in FP4_PRECISIONS:
            raise ValueError(f"precision must be one of {FP4_PRECISIONS}, got {precision!r}")
        s = self._sums[(layer, step_bucket(step))][(precision, keep_mass)]
        s[0] += err2
        s[1] += ref2
        s[2] += float(density)
        s[3] += 1

    def measure(self, layer: str, step: Optional[tuple[int, int]], exact: torch.Tensor,
                run: Callable[[Precision, Optional[float]], Optional[tuple[torch.Tensor, float]]],
                ladder: tuple = ()) -> bool:
        """Run one observed call in every NVFP4 precision, dense and at each ``keep_mass`` of
        ``ladder`` (``run(precision, keep_mass)``: the output and the share of key tiles its block
        map kept (1.0 dense), or None where that run cannot take the call) and add each error
        against ``exact``. Adds nothing (returns False) unless every dense precision ran."""
        terms = {}
        for precision in FP4_PRECISIONS:
            for keep_mass in (None, *ladder):
                res = run(precision, keep_mass)
                if res is None:
                    if keep_mass is None:
                        return False
                    continue
                out, density = res
                terms[(precision, keep_mass)] = (*relative_error_terms(out, exact), density)
                del out, res   # one extra output in memory at a time
        for (precision, keep_mass), (err2, ref2, density) in terms.items():
            self.add(layer, step, precision, err2, ref2, keep_mass, density)
        return True

    def _measured(self) -> dict:
        """(layer, bucket) -> {(precision, keep_mass): (relative L2 error, mean density)}."""
        out = {}
        for key, per in self._sums.items():
            out[key] = {pk: ((math.sqrt(e / r) if r > 0 else (0.0 if e == 0 else math.inf)), d / max(n, 1))
                        for pk, (e, r, d, n) in per.items()}
        return out

    def errors(self) -> dict:
        """(layer, bucket) -> {precision: relative L2 error} of the dense runs."""
        return {key: {p: e for (p, k), (e, _) in per.items() if k is None} for key, per in self._measured().items()}

    def __len__(self) -> int:
        return len(self._sums)

    def policy(self, base: AttentionPolicy, budget: float, model_class: Optional[str]) -> AttentionPolicy:
        """``base`` with ``per_layer`` chosen from the measured errors under ``budget``: per layer
        and third the cheapest (:data:`PRECISION_TIME` x density) precision and ``keep_mass``."""
        if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget > 0:
            raise ValueError(f"budget must be a positive number, got {budget!r}")
        entries = []
        for (layer, bucket), measured in sorted(self._measured().items()):
            dense = {p: e for (p, k), (e, _) in measured.items() if k is None}
            sparse = tuple(sorted(((p, k, e, d) for (p, k), (e, d) in measured.items() if k is not None),
                                  key=lambda r: (PRECISION_COST[r[0]], -r[1])))
            precision, keep_mass, density = choose_layer(measured, budget)
            if not sparse or precision.exact:   # no ladder measured, or no FP4 run within the budget
                keep_mass = density = None
            elif keep_mass is None:
                keep_mass = 1.0   # measured, and dense is the cheapest within the budget
            entries.append(LayerPrecision(layer, bucket, precision,
                                          tuple(sorted(dense.items(), key=lambda pe: PRECISION_COST[pe[0]])),
                                          keep_mass=keep_mass, density=density, sparse_errors=sparse))
        return base.replace(per_layer=tuple(entries), model_class=model_class, budget=float(budget))


def choose_precision(errors: dict, budget: float) -> Precision:
    """The cheapest precision of ``errors`` ({Precision: relative L2 error}) within ``budget``;
    :data:`~nvfp4_dit.policy.EXACT` when none is within it."""
    ok = [p for p, e in errors.items() if e <= budget]
    return min(ok, key=PRECISION_COST.__getitem__) if ok else EXACT


def choose_layer(measured: dict, budget: float) -> tuple[Precision, Optional[float], float]:
    """``(precision, keep_mass or None for dense, density)``: of ``measured`` ({(precision,
    keep_mass): (relative L2 error, density)}) the run within ``budget`` with the least modelled
    time (:data:`PRECISION_TIME` x density; then the cheaper precision, then the smaller error);
    ``(EXACT, None, 1.0)`` when none is within it."""
    ok = [(PRECISION_TIME[p] * d, PRECISION_COST[p], e, p, k, d) for (p, k), (e, d) in measured.items() if e <= budget]
    if not ok:
        return EXACT, None, 1.0
    *_, p, k, d = min(ok, key=lambda r: r[:3])
    return p, k, d


def format_table(policy: AttentionPolicy) -> str:
    """The per-layer entries of a calibrated policy as a Markdown table."""
    if not policy.per_layer:
        return "(no per-layer entries)"
    head = ("| layer | steps | precision | keep_mass | density | "
            + " | ".join(f"rel-L2 {p.label}" for p in FP4_PRECISIONS) + " |")
    rows = [head, "|" + "---|" * (5 + len(FP4_PRECISIONS))]
    for e in policy.per_layer:
        errs = dict(e.errors)
        cells = [f"{errs[p]:.4f}" if p in errs else "-" for p in FP4_PRECISIONS]
        keep = "-" if e.keep_mass is None else f"{e.keep_mass:g}"
        density = "-" if e.density is None else f"{e.density:.3f}"
        rows.append(f"| {e.layer} | {e.bucket} | {e.precision.label} | {keep} | {density} | " + " | ".join(cells) + " |")
    return "\n".join(rows)
