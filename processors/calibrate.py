"""``calibrate(pipe_or_model, run)``: a per-layer NVFP4 policy from the model's own attention.

The user's ``run`` (one short generation, or one denoising step) runs with every attention
module routed through NVFP4 processors that compute exactly (``apply(..., observe_only=True)``),
so the generation itself is the exact one.  Each call the policy would run in NVFP4 (its role,
length and layer rules; every step, the ``dense_steps`` rule is left to the returned policy) is
run again in every NVFP4 precision on the same Q, K and V (with a block-sparse base policy, a
``keep_mass``, also at each ``keep_mass`` of :data:`~nvfp4_dit.calibration.KEEP_MASS_LADDER` where
the policy would run the call sparse), and its relative L2 error against the exact output is
accumulated per (module, third of the schedule, precision, keep_mass)
(:class:`~nvfp4_dit.calibration.CalibrationTable`).  The returned policy assigns each module and
third the run with the least modelled time within the budget, exact attention where none is.

Extra cost: one NVFP4 attention per precision per measured call (four per precision with the
sparse ladder, each with its block map estimated once more in PyTorch for its density), one at a
time (one extra output tensor in memory); ``steps=`` limits which denoising steps are measured.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional

from nvfp4_dit import format as fmt
from nvfp4_dit.calibration import DEFAULT_BUDGET, KEEP_MASS_LADDER, CalibrationTable, measurement_policy
from nvfp4_dit.policy import AttentionPolicy
from nvfp4_dit.sparse import Sparsity

from . import routing
from .apply import apply, model_class_of, models_of


def calibrate(
    pipe_or_model,
    run: Callable[[], object],
    *,
    budget: float = DEFAULT_BUDGET,
    steps: Optional[Iterable[int]] = None,
    policy: Optional[AttentionPolicy] = None,
    timesteps=None,
) -> AttentionPolicy:
    """Measure each attention module's NVFP4 error on ``run`` and return a per-layer policy.

    Args:
        pipe_or_model: the diffusers pipeline or model :func:`nvfp4_dit.apply` will be given.
        run: a callable that runs it once, e.g. ``lambda: pipe(prompt, num_inference_steps=8)``
            (its output is the exact, unmodified model's).
        budget: the largest relative L2 error of an attention output that a precision may have
            (default :data:`~nvfp4_dit.calibration.DEFAULT_BUDGET`).
        steps: denoising step indices (0-based) to measure; default every step.
        policy: the base policy (back-end, roles, ``min_seq_len``, ``dense_steps``, layer
            allow-list, ``keep_mass`` and its rules); default ``AttentionPolicy()``.  Its per-layer
            entries are replaced. With a ``keep_mass`` each layer also gets the sparsest
            ``keep_mass`` of the ladder within the budget (or dense).
        timesteps: a bare model's sampling schedule, as for :func:`nvfp4_dit.apply`.

    Returns:
        ``policy`` with ``per_layer`` (each entry keeps its measured errors), ``model_class``
        and ``budget`` set; save it with ``.save(path)``, use it with ``apply(pipe, policy=...)``.

    Raises:
        ValueError for a bad ``budget``/``steps``, or when ``run`` made no call that the policy
        would run in NVFP4 (nothing to calibrate: too short, or every module excluded).
    """
    base = AttentionPolicy() if policy is None else policy
    if not isinstance(base, AttentionPolicy):
        raise TypeError(f"policy must be an AttentionPolicy, got {type(base).__name__}")
    if not callable(run):
        raise TypeError(f"run must be a callable that runs the model once, got {type(run).__name__}")
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget > 0:
        raise ValueError(f"budget must be a positive number, got {budget!r}")
    step_set = None
    if steps is not None:
        step_set = set(steps)
        if not step_set or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in step_set):
            raise ValueError(f"steps must be non-negative step indices, got {steps!r}")
    base = base.replace(per_layer=None, model_class=None, budget=None)
    measuring = measurement_policy(base)
    per_precision = {p: pol.replace(keep_mass=None) for p, pol in measuring.precision_policies().items()}
    per_sparse = {(p, k): pol.replace(keep_mass=k, sparse_off_steps=(0, 0), sparse_min_seq_len=0)
                  for p, pol in per_precision.items() for k in KEEP_MASS_LADDER}
    table = CalibrationTable()

    def observe(info, q, k, v, out):
        if info.reason != routing.OBSERVE_ONLY or info.layer is None:
            return  # dense by role or layer: no entry, the uniform rules keep it exact
        if step_set is not None and (info.step is None or info.step[0] not in step_set):
            return
        return_lse = isinstance(out, tuple)
        sq, sk = fmt.hnd_shape(q, info.layout)[2], fmt.hnd_shape(k, info.layout)[2]
        sparse_here = base.keep_mass_for(info.step, sq, sk) is not None
        video = routing.current_video()

        def run_in(precision, keep_mass):
            # None where the call is short or not expressible in FP4: it runs exact whatever the entry says.
            policy = per_precision[precision] if keep_mass is None else per_sparse[(precision, keep_mass)]
            res, path = routing.rerun(info, q, k, v, policy, lambda: out, return_lse=return_lse)
            if path != "fp4":
                return None
            res = res[0] if return_lse else res
            if keep_mass is None:
                return res, 1.0
            sparsity = Sparsity(keep_mass=keep_mass, always_keep=None if video is None else video.other_keys(sk))
            return res, routing.block_density(info, q, k, sparsity)

        table.measure(info.layer, info.step, out[0] if return_lse else out, run_in,
                      ladder=KEEP_MASS_LADDER if sparse_here else ())

    handle = apply(pipe_or_model, policy=base.replace(dense_steps=(0, 0)), observe_only=True, timesteps=timesteps)
    routing.add_observer(observe)
    try:
        run()
    finally:
        routing.remove_observer(observe)
        handle.restore()
    if not len(table):
        raise ValueError("calibration saw no attention call that the policy would run in NVFP4 (sequences "
                         f"shorter than min_seq_len={base.min_seq_len}, or every module excluded by role/layers)")
    return table.policy(base, budget, model_class_of(models_of(pipe_or_model)[0]))

