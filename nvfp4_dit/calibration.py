"""Per-layer precision from measured error: what the diffusers and ComfyUI calibrations share.

A calibration observes a model's attention calls, computed exactly, and for each call runs every
candidate precision on the same Q, K, V.  :class:`CalibrationTable` accumulates, per (layer,
third of the schedule, precision), the squared error of the attention output against the exact
one and the squared norm of the exact output; :meth:`CalibrationTable.policy` turns that into an
:class:`~nvfp4_dit.policy.AttentionPolicy` whose ``per_layer`` entries give each layer and third
the cheapest precision whose relative L2 error is within the budget (the more accurate one among
equally cheap precisions), and exact attention where none is.

The table holds Python floats only: one pair of sums per entry, never a tensor.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Callable, Optional

import torch

from .policy import EXACT, FP4_PRECISIONS, PRECISION_COST, AttentionPolicy, LayerPrecision, Precision, step_bucket

# Relative L2 error of a layer's attention output that calibration accepts by default.  Measured
# with the FP4 path against exact attention on bf16 inputs (docs/report): iid 0.19, RoPE'd Q/K
# 0.10, the tiny Wan's self-attention 0.07, K outlier channels with the channel balance 0.22-0.27,
# logits twice as sharp as iid 0.33, three times 0.43.  0.25 keeps the first group in FP4 and
# sends the sharp heads to exact attention.
DEFAULT_BUDGET = 0.25

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


class CalibrationTable:
    """Accumulated error per (layer, step bucket, precision); see the module docstring."""

    def __init__(self):
        # (layer, bucket) -> precision -> [sum of squared error, sum of squared exact norm]
        self._sums: dict = defaultdict(lambda: defaultdict(lambda: [0.0, 0.0]))

    def add(self, layer: str, step: Optional[tuple[int, int]], precision: Precision, err2: float, ref2: float) -> None:
        if precision not in FP4_PRECISIONS:
            raise ValueError(f"precision must be one of {FP4_PRECISIONS}, got {precision!r}")
        s = self._sums[(layer, step_bucket(step))][precision]
        s[0] += err2
        s[1] += ref2

    def measure(self, layer: str, step: Optional[tuple[int, int]], exact: torch.Tensor,
                run: Callable[[Precision], Optional[torch.Tensor]]) -> bool:
        """Run one observed call in every NVFP4 precision (``run(precision)``: its output, or None
        where that precision cannot take the call) and add each error against ``exact``. Adds
        nothing (returns False) unless every precision ran."""
        terms = {}
        for precision in FP4_PRECISIONS:
            out = run(precision)
            if out is None:
                return False
            terms[precision] = relative_error_terms(out, exact)
            del out   # one extra output in memory at a time
        for precision, (err2, ref2) in terms.items():
            self.add(layer, step, precision, err2, ref2)
        return True

    def errors(self) -> dict:
        """(layer, bucket) -> {precision: relative L2 error}."""
        out = {}
        for key, per in self._sums.items():
            out[key] = {p: (math.sqrt(e / r) if r > 0 else (0.0 if e == 0 else math.inf)) for p, (e, r) in per.items()}
        return out

    def __len__(self) -> int:
        return len(self._sums)

    def policy(self, base: AttentionPolicy, budget: float, model_class: Optional[str]) -> AttentionPolicy:
        """``base`` with ``per_layer`` chosen from the measured errors under ``budget``."""
        if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget > 0:
            raise ValueError(f"budget must be a positive number, got {budget!r}")
        entries = []
        for (layer, bucket), errs in sorted(self.errors().items()):
            entries.append(LayerPrecision(layer, bucket, choose_precision(errs, budget),
                                          tuple(sorted(errs.items(), key=lambda pe: PRECISION_COST[pe[0]]))))
        return base.replace(per_layer=tuple(entries), model_class=model_class, budget=float(budget))


def choose_precision(errors: dict, budget: float) -> Precision:
    """The cheapest precision of ``errors`` ({Precision: relative L2 error}) within ``budget``;
    :data:`~nvfp4_dit.policy.EXACT` when none is within it."""
    ok = [p for p, e in errors.items() if e <= budget]
    return min(ok, key=PRECISION_COST.__getitem__) if ok else EXACT


def format_table(policy: AttentionPolicy) -> str:
    """The per-layer entries of a calibrated policy as a Markdown table."""
    if not policy.per_layer:
        return "(no per-layer entries)"
    head = "| layer | steps | precision | " + " | ".join(f"rel-L2 {p.label}" for p in FP4_PRECISIONS) + " |"
    rows = [head, "|" + "---|" * (3 + len(FP4_PRECISIONS))]
    for e in policy.per_layer:
        errs = dict(e.errors)
        cells = [f"{errs[p]:.4f}" if p in errs else "-" for p in FP4_PRECISIONS]
        rows.append(f"| {e.layer} | {e.bucket} | {e.precision.label} | " + " | ".join(cells) + " |")
    return "\n".join(rows)
