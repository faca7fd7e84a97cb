"""The per-model attention override that the ComfyUI node installs.

ComfyUI (>= 0.3.60) routes every attention call of a model through
``transformer_options["optimized_attention_override"]`` when that key is set: ``wrap_attn`` calls
``override(func, q, k, v, heads, mask=..., skip_reshape=..., skip_output_reshape=..., **kwargs)``,
where ``func`` is the undecorated back-end the call site picked and ``kwargs`` carries
``_inside_attn_wrapper=True``. This module is that override. It imports nothing from ComfyUI, so the
decision logic and the layout handling are testable without it.

For every call it either runs ``nvfp4_dit.attention`` or declines. A declined call goes, with its
arguments untouched, to the override that was on the model before ours (so a node earlier in the MODEL
chain keeps working; last writer wins otherwise) or else to ``func``. Passing ``kwargs`` through
unchanged keeps ``_inside_attn_wrapper`` set, which is what stops a decorated back-end from calling the
override again (the recursion trap). Nothing is kept between calls: no tensors, no step state.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Callable, Optional

import torch

from nvfp4_dit import planner
from nvfp4_dit.fallback import warn_once
from nvfp4_dit.policy import AttentionPolicy, Precision
from nvfp4_dit.sparse import Sparsity, VideoTokens

logger = logging.getLogger("nvfp4_dit.comfyui")

# Keyword arguments ComfyUI's attention functions receive that do not change what attention computes
# (or that this override reads itself). Any other keyword is declined: it may carry semantics we
# cannot reproduce, and the function ComfyUI handed us knows what to do with it.
_KNOWN_KWARGS = frozenset({
    "transformer_options", "_inside_attn_wrapper", "low_precision_attention", "scale", "enable_gqa",
    "attn_precision", "preferred_attention",
})


def _bind_arguments(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
                    skip_output_reshape=False, **kwargs) -> dict:
    """The arguments of a call with the signature every ComfyUI attention back-end shares, by name
    (Python binds them: a call that does not fit raises TypeError)."""
    return {"q": q, "k": k, "v": v, "heads": heads, "mask": mask, "attn_precision": attn_precision,
            "skip_reshape": skip_reshape, "skip_output_reshape": skip_output_reshape, "kwargs": kwargs}

def _warn_once(message: str) -> None:
    # One log line per kind of declined call per process, not one per attention call (ComfyUI shows
    # its log, not Python warnings).
    warn_once(f"nvfp4_dit: {message}; using the model's own attention for such calls", logger=logger)


class _StepOfForward:
    """The step of the model forward in progress: every attention call of one forward carries the
    same sigma tensors, so a sigma is read to the host once per forward (a GPU sigma costs a sync),
    not once per call. Held by weak references: a later forward brings new tensors."""

    __slots__ = ("current", "schedule", "step")

    def __init__(self):
        self.current = self.schedule = self.step = None

    def lookup(self, schedule, current):
        if (self.current is not None and self.current() is current and self.schedule() is schedule):
            return self.step
        step = _step_of(schedule, current)
        if isinstance(current, torch.Tensor) and isinstance(schedule, torch.Tensor):
            self.current, self.schedule, self.step = weakref.ref(current), weakref.ref(schedule), step
        return step


_STEP_OF_FORWARD = _StepOfForward()


def sampling_step(transformer_options: dict) -> Optional[tuple[int, int]]:
    """(step index, number of steps) of the current call, or None outside a sampler.

    ComfyUI puts the whole schedule in ``sample_sigmas`` (steps + 1 values, descending) and the sigma
    of the current model call in ``sigmas``. Step i covers sigmas in (s[i+1], s[i]], so samplers that
    evaluate the model between two schedule points (Heun, DPM-2) count those calls to step i.
    """
    schedule = transformer_options.get("sample_sigmas")
    current = transformer_options.get("sigmas")
    if schedule is None or current is None:
        return None
    return _STEP_OF_FORWARD.lookup(schedule, current)


def _step_of(schedule, current) -> Optional[tuple[int, int]]:
    schedule = torch.as_tensor(schedule).detach().flatten().to("cpu", torch.float64)
    current = torch.as_tensor(current).detach().flatten().to("cpu", torch.float64)
    steps = schedule.numel() - 1
    if steps < 1 or current.numel() == 0:
        return None
    sigma = float(current.max())  # one sigma per batch chunk; they agree except in odd custom samplers
    # Relative slack for the dtype round trip of the sigma (the model may see it in fp16/bf16).
    tolerance = 1e-3 * abs(sigma)
    step = int((schedule[1:] >= sigma - tolerance).sum())
    return min(step, steps - 1), steps


def layer_name(transformer_options: dict, cross: bool) -> Optional[str]:
    """The name a calibrated policy gives this call's attention layer, or None where the model does
    not say which block is running.

    ComfyUI's Wan, HunyuanVideo and Cosmos Predict2 put ``block_index`` (and ``block_type``, e.g.
    "double" / "single") in ``transformer_options``; the role comes from the lengths, as for the
    cross-attention rule: ``double_blocks.3.self``, ``double_blocks.3.cross``.
    """
    index = transformer_options.get("block_index")
    if isinstance(index, bool) or not isinstance(index, int):
        return None
    kind = transformer_options.get("block_type")
    prefix = f"{kind}_blocks" if isinstance(kind, str) and kind else "blocks"
    return f"{prefix}.{index}.{'cross' if cross else 'self'}"


PLANNED = object()   # NVFP4AttentionOverride.run: the plan's own sparsity


# Where the apply_model wrapper leaves the forward's video tokens (in that forward's own options).
VIDEO_TOKENS_OPTION = "nvfp4_dit_video_tokens"
# ComfyUI diffusion models whose input is a [B, C, T, H, W] latent: how to read their patch size,
# and where the video sits in their attention's sequence ("first": alone or before other tokens;
# HunyuanVideo puts the text first).
_LATENT_MODELS = {
    "WanModel": (lambda m: tuple(m.patch_size), "first"),
    "HunyuanVideo": (lambda m: tuple(m.patch_size), "last"),
    "MiniTrainDIT": (lambda m: (m.patch_temporal, m.patch_spatial, m.patch_spatial), "first"),
    "LTXVModel": (lambda m: (1, 1, 1), "first"),
}


def latent_video_tokens(diffusion_model, x) -> Optional[VideoTokens]:
    """The video tokens of a forward of ``diffusion_model`` on latent ``x``, or None for a model
    (or an input) this module does not know."""
    known = _LATENT_MODELS.get(type(diffusion_model).__name__)
    if known is None or not isinstance(x, torch.Tensor) or x.dim() != 5:
        return None
    read_patch, position = known
    try:
        patch = read_patch(diffusion_model)
    except (AttributeError, TypeError):
        return None
    return VideoTokens.of_latent(x.shape[2:], patch, position)


def video_tokens(transformer_options: dict) -> Optional[VideoTokens]:
    """The video tokens of the forward in progress: what the apply_model wrapper read off its latent
    (:func:`install_video_tokens`), else the latent token grid the model reports (ComfyUI's Wan:
    ``grid_sizes``), else None. Read from that forward's options in every call: nothing is kept."""
    found = transformer_options.get(VIDEO_TOKENS_OPTION)
    if isinstance(found, VideoTokens):
        return found
    grid = transformer_options.get("grid_sizes")
    try:
        return VideoTokens(tuple(int(n) for n in grid)) if grid is not None else None
    except (TypeError, ValueError):
        return None


def _video_tokens_wrapper(executor, x, t, c_concat=None, c_crossattn=None, control=None, transformer_options=None,
                          **kwargs):
    """An ``apply_model`` wrapper: the forward's video tokens into its own transformer_options."""
    if transformer_options is not None:
        model = getattr(executor.class_obj, "diffusion_model", None)
        video = latent_video_tokens(model, x)
        if video is not None:
            transformer_options[VIDEO_TOKENS_OPTION] = video
    return executor(x, t, c_concat, c_crossattn, control, transformer_options, **kwargs)


def install_video_tokens(patched) -> None:
    """Have every forward of the ``ModelPatcher`` ``patched`` read its video tokens (for a
    block-sparse call's estimate, which always keeps the keys that are not video)."""
    import comfy.patcher_extension

    patched.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.APPLY_MODEL, "nvfp4_dit", _video_tokens_wrapper)


def diffusion_model_class(model) -> str:
    """The class name a calibrated policy records for a ComfyUI ``ModelPatcher``'s diffusion model."""
    inner = getattr(getattr(model, "model", None), "diffusion_model", None)
    return type(inner).__name__ if inner is not None else type(model).__name__


def sdpa_mask(mask) -> tuple[Optional[torch.Tensor], Optional[str]]:
    """A ComfyUI attention mask as SDPA reads it: 4-D, broadcastable to ``[B, H, Lq, Lk]``.

    ComfyUI masks are bool or additive float; a 2-D mask gains a batch dimension and a 3-D one a
    head dimension. Returns (the mask or None, None) or (None, the reason it cannot be used).
    """
    if mask is None:
        return None, None
    if not isinstance(mask, torch.Tensor):
        return None, f"attention mask of type {type(mask).__name__}"
    m = mask
    if m.ndim == 2:
        m = m.unsqueeze(0)
    if m.ndim == 3:
        m = m.unsqueeze(1)
    if m.ndim != 4:
        return None, f"attention mask with {mask.ndim} dimensions"
    return m, None


class NVFP4AttentionOverride:
    """``transformer_options["optimized_attention_override"]`` value running ``nvfp4_dit.attention``.

    ``previous`` is the override that was on the model when the node patched it (or None); declined
    calls go there, else to the function ComfyUI passes in.
    """

    def __init__(self, policy: AttentionPolicy, previous: Optional[Callable] = None):
        if previous is not None and not callable(previous):
            raise TypeError(f"previous must be callable or None, got {type(previous).__name__}")
        self.policy = policy
        self.previous = previous

    def __repr__(self) -> str:
        return f"NVFP4AttentionOverride({self.policy}, previous={self.previous!r})"

    def __call__(self, func: Callable, *args: Any, **kwargs: Any):
        try:
            arguments = _bind_arguments(*args, **kwargs)
        except TypeError as error:
            _warn_once(f"attention call with unexpected arguments ({error})")
            return self.decline(func, args, kwargs)
        plan = self.plan(arguments)
        if plan is None:
            return self.decline(func, args, kwargs)
        import nvfp4_dit

        try:
            return self.run(plan)
        except (nvfp4_dit.BackendUnavailableError, ValueError, TypeError) as error:
            # An explicitly chosen back-end that cannot run this call (e.g. "cuda" on a CPU tensor, or a
            # padding mask the kernel cannot take), or inputs the op rejects: keep the pipeline running.
            _warn_once(f"nvfp4_dit.attention declined the call ({error})")
            return self.decline(func, args, kwargs)

    def decline(self, func: Callable, args: tuple, kwargs: dict):
        if self.previous is not None:
            return self.previous(func, *args, **kwargs)
        return func(*args, **kwargs)

    def plan(self, arguments: dict) -> Optional[dict]:
        """The call in NVFP4's terms (4-D tensors, layout, the call planner's plan) if it runs in NVFP4,
        else None: ComfyUI's layouts here, every decision in :func:`nvfp4_dit.planner.plan_call`."""
        policy = self.policy
        extra = arguments.get("kwargs", {})
        if extra.get("low_precision_attention", True) is False:
            return None
        unknown = sorted(set(extra) - _KNOWN_KWARGS)
        if unknown:
            _warn_once(f"attention call with keyword arguments {unknown}")
            return None

        q, k, v, heads = arguments["q"], arguments["k"], arguments["v"], arguments["heads"]
        if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
            return None
        if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1:
            return None
        if q.ndim < 3 or k.ndim != q.ndim or v.ndim != q.ndim or not (q.shape[0] == k.shape[0] == v.shape[0]):
            return None
        skip_reshape = bool(arguments.get("skip_reshape", False))
        enable_gqa = bool(extra.get("enable_gqa", False))
        if skip_reshape:
            if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
                return None
            batch, _, queries, head_dim = q.shape
            kv_heads, keys = k.shape[1], k.shape[2]
            if (q.shape[1] != heads or kv_heads == 0 or head_dim == 0 or v.shape[:3] != k.shape[:3]
                    or k.shape[3] != head_dim or v.shape[3] != head_dim):
                return None
            q4, k4, v4, layout = q, k, v, "HND"
        else:
            if q.ndim != 3 or k.ndim != 3 or v.ndim != 3:
                return None
            batch, queries, width = q.shape
            if width % heads or width == 0:
                return None
            head_dim = width // heads
            keys = k.shape[1]
            if k.shape[-1] == 0 or k.shape[-1] % head_dim or v.shape[:2] != k.shape[:2] or v.shape[-1] != k.shape[-1]:
                return None
            kv_heads = k.shape[-1] // head_dim
            q4 = q.reshape(batch, queries, heads, head_dim)
            k4 = k.reshape(batch, keys, kv_heads, head_dim)
            v4 = v.reshape(batch, keys, kv_heads, head_dim)
            layout = "NHD"
        if kv_heads != heads and not (enable_gqa and heads % kv_heads == 0):
            return None  # ComfyUI's own back-ends reject this too; let them raise their error.

        mask, reason = sdpa_mask(arguments.get("mask"))
        if reason is not None:
            _warn_once(reason)
            return None
        # Cross-attention (to text or image tokens) is the call whose query and key lengths differ.
        options = extra.get("transformer_options") or {}
        cross = queries != keys
        step = sampling_step(options) if (any(policy.dense_steps) or policy.per_layer or (
            policy.keep_mass is not None and any(policy.sparse_off_steps))) else None
        scale = extra.get("scale")
        call = planner.plan_call(q4, k4, v4, layout=layout, policy=policy, attn_mask=mask, enable_gqa=True,
                                 scale=scale, cross=cross, step=step, layer=layer_name(options, cross),
                                 video=video_tokens(options) if policy.may_run_sparse else None)
        if not call.run_op:
            if call.warn:
                _warn_once(call.reason)
            return None
        return dict(
            q=q4, k=k4, v=v4, layout=layout, batch=batch, heads=heads, queries=queries, keys=keys, head_dim=head_dim,
            scale=float(head_dim ** -0.5) if scale is None else float(scale), plan=call,
            skip_output_reshape=bool(arguments.get("skip_output_reshape", False)),
        )

    @staticmethod
    def run(plan: dict, precision: Optional[Precision] = None, sparsity=PLANNED) -> torch.Tensor:
        """Run a plan of :meth:`plan` (in ``precision`` and with ``sparsity`` (a
        :class:`nvfp4_dit.sparse.Sparsity` or None for dense) instead of the planned ones, for
        calibration)."""
        from nvfp4_dit import ops

        call = plan["plan"]
        sparsity = call.sparsity if sparsity is PLANNED else sparsity
        out = ops.run_fp4(plan["q"], plan["k"], plan["v"], layout=plan["layout"], causal=False, scale=plan["scale"],
                          key_mask=call.key_mask, kv_lens=None, return_lse=False, backend=call.backend,
                          balance_qk=call.balance_qk if precision is None else precision.balance_qk,
                          qk_format=call.qk_format if precision is None else precision.qk_format,
                          sparsity=sparsity, order=call.order_for(sparsity))
        batch, heads, queries, head_dim = plan["batch"], plan["heads"], plan["queries"], plan["head_dim"]
        if plan["layout"] == "NHD":  # out [B, Lq, H, D]
            if plan["skip_output_reshape"]:
                return out.permute(0, 2, 1, 3).contiguous()  # what ComfyUI's back-ends return
            return out.reshape(batch, queries, heads * head_dim)
        # out [B, H, Lq, D]
        if plan["skip_output_reshape"]:
            return out
        return out.transpose(1, 2).reshape(batch, queries, heads * head_dim)


class CalibratingOverride(NVFP4AttentionOverride):
    """Calibration inside a graph: every call runs the model's own attention (the sampled result is
    the exact one), and each call the policy would run in NVFP4, in a named block, is also run in
    every NVFP4 precision to measure its error (:class:`~nvfp4_dit.calibration.CalibrationTable`);
    with a ``keep_mass`` in ``policy``, also at each ``keep_mass`` of the ladder
    (:data:`~nvfp4_dit.calibration.KEEP_MASS_LADDER`) where the policy runs the call sparse.

    The calibrated policy (the uniform rules of ``policy`` plus per-layer entries) is written to
    ``path`` as the sampler moves to the next step and on every call of the last step, so the file
    is complete when sampling ends. The table (two floats per layer, third and precision) lives as
    long as the patched model: sampling it again adds to the same measurements.
    """

    def __init__(self, policy: AttentionPolicy, previous: Optional[Callable] = None, *, path, budget: float,
                 model_class: str):
        from nvfp4_dit.calibration import CalibrationTable, measurement_policy

        base = policy.replace(per_layer=None, model_class=None, budget=None)
        measure = measurement_policy(base.replace(dense_steps=(0, 0)))
        super().__init__(measure, previous)
        self.base, self.path, self.budget, self.model_class = base, path, budget, model_class
        self.table = CalibrationTable()
        self._saved_step = None

    def __call__(self, func: Callable, *args: Any, **kwargs: Any):
        exact = self.decline(func, args, kwargs)
        try:
            arguments = _bind_arguments(*args, **kwargs)
        except TypeError:
            return exact
        plan = self.plan(arguments)
        options = arguments.get("kwargs", {}).get("transformer_options") or {}
        layer = layer_name(options, plan is not None and plan["queries"] != plan["keys"])
        if plan is None or layer is None:
            return exact
        import nvfp4_dit

        from nvfp4_dit import ops
        from nvfp4_dit.calibration import KEEP_MASS_LADDER

        step = sampling_step(options)
        call = plan["plan"]

        def run_in(precision, keep_mass):
            if keep_mass is None:
                return self.run(plan, precision, None), 1.0
            sparsity = Sparsity(keep_mass=keep_mass, always_keep=call.always_keep)
            density = ops.block_density(plan["q"], plan["k"], layout=plan["layout"], causal=False,
                                        scale=plan["scale"], key_mask=call.key_mask, sparsity=sparsity,
                                        order=call.order_for(sparsity))
            return self.run(plan, precision, sparsity), density

        try:
            self.table.measure(layer, step, exact, run_in, ladder=KEEP_MASS_LADDER if call.keep_mass is not None else ())
        except (nvfp4_dit.BackendUnavailableError, ValueError, TypeError) as error:
            _warn_once(f"calibration could not run nvfp4_dit.attention ({error})")
            return exact
        if step is None or step != self._saved_step or step[0] == step[1] - 1:
            self.calibrated_policy().save(self.path)
            self._saved_step = step
        return exact

    def calibrated_policy(self) -> AttentionPolicy:
        return self.table.policy(self.base, self.budget, self.model_class)


def _install(model, make_override: Callable[[Optional[Callable]], Callable], policy: AttentionPolicy):
    patched = model.clone()
    transformer_options = patched.model_options.setdefault("transformer_options", {})
    previous = transformer_options.get("optimized_attention_override")
    transformer_options["optimized_attention_override"] = make_override(previous)
    if policy.may_run_sparse:
        install_video_tokens(patched)
    return patched


def patch_model(model, policy: AttentionPolicy):
    """A clone of the ComfyUI ``ModelPatcher`` whose attention runs through NVFP4AttentionOverride.

    ``clone()`` deep-copies ``model_options`` (dicts and lists), so writing the key on the clone leaves
    the input model as it was; bypassing or deleting the node therefore undoes the patch. An override
    already on the model is kept as the fallback of ours. A calibrated policy must have been
    calibrated on this model's class (ValueError otherwise).
    """
    if policy.per_layer is not None and policy.model_class not in (None, diffusion_model_class(model)):
        raise ValueError(f"the policy was calibrated on {policy.model_class}, this model is "
                         f"{diffusion_model_class(model)}: calibrate this model (the node's calibrate option)")
    return _install(model, lambda previous: NVFP4AttentionOverride(policy, previous), policy)


def patch_model_for_calibration(model, policy: AttentionPolicy, path, budget: float):
    """A clone of the ``ModelPatcher`` that samples exactly and writes a calibrated policy to ``path``."""
    return _install(model, lambda previous: CalibratingOverride(policy, previous, path=path, budget=budget,
                                                                model_class=diffusion_model_class(model)), policy)
