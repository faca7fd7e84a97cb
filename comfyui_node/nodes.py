"""The ComfyUI node "NVFP4 Attention (video DiT)" (V3 schema; imports ComfyUI, so load it lazily)."""

from __future__ import annotations

from comfy_api.latest import io

from nvfp4_dit.calibration import DEFAULT_BUDGET
from nvfp4_dit.checks import BACKENDS
from nvfp4_dit.format import QK_FORMATS
from nvfp4_dit.policy import AttentionPolicy

from .attention_override import patch_model, patch_model_for_calibration

_DEFAULTS = AttentionPolicy()


class NVFP4Attention(io.ComfyNode):
    """MODEL -> MODEL: a clone of the model whose attention calls run in NVFP4 where the policy allows."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        # The node id is saved in every workflow that uses the node: never rename it.
        return io.Schema(
            node_id="NVFP4AttentionVideoDiT",
            display_name="NVFP4 Attention (video DiT)",
            category="nvfp4_dit",
            description=(
                "Runs the model's attention in NVFP4 (FP4 microscaling) through nvfp4_dit. Patches a clone of "
                "the model only; calls it declines (short, masked in ways it cannot express, dense steps, "
                "low-precision-unsafe) keep the attention the model had, including an attention patch placed "
                "before this node. Place it after loaders and LoRAs, before ModelSampling and the sampler."
            ),
            inputs=[
                io.Model.Input("model"),
                io.Boolean.Input(
                    "enabled", default=True,
                    tooltip="Off: the model passes through unchanged.",
                ),
                io.Combo.Input(
                    "backend", options=list(BACKENDS), default=_DEFAULTS.backend,
                    tooltip=(
                        "auto: the FP4 kernel on GPUs with native FP4 MMA (sm_120/121), the model's own attention "
                        "elsewhere. cuda: force the compiled kernel (emulated MMA on sm_80/90). reference: the "
                        "pure-torch FP4 numerics (slow). sdpa: exact attention through the same wrapper."
                    ),
                ),
                # The policy's settings (nvfp4_dit.policy.AttentionPolicy) under the names saved
                # workflows already use.
                io.Boolean.Input(
                    "cross_attention_dense", default=not _DEFAULTS.cross_attention,
                    tooltip="Keep the model's own attention for cross-attention (query and key lengths differ).",
                ),
                io.Int.Input(
                    "dense_first_steps", default=_DEFAULTS.dense_steps[0], min=0, max=10000,
                    tooltip="Keep the model's own attention for this many first steps of the sampler's schedule.",
                ),
                io.Int.Input(
                    "dense_last_steps", default=_DEFAULTS.dense_steps[1], min=0, max=10000,
                    tooltip="Keep the model's own attention for this many last steps of the sampler's schedule.",
                ),
                io.Int.Input(
                    "min_seq_len", default=_DEFAULTS.min_seq_len, min=0, max=1 << 24,
                    tooltip="Keep the model's own attention for calls with fewer query or key tokens than this.",
                ),
                # Appended after the inputs saved workflows already hold (widgets are saved by position).
                io.Boolean.Input(
                    "balance_qk", default=_DEFAULTS.balance_qk, optional=True,
                    tooltip=("Balance Q and K per channel before FP4 quantisation (exact in the attention scores). "
                             "Fixes noise from heads whose Q and K put their energy in different channels; "
                             "costs one more read of Q per call. Leave it on unless you measure otherwise."),
                ),
                io.String.Input(
                    "policy_file", default="", optional=True,
                    tooltip=("A calibrated per-layer policy (JSON). Empty: every block follows the settings above. "
                             "With calibrate off, blocks run in the precision the file assigns them (NVFP4 with or "
                             "without the channel balance, or the model's own attention) within those settings."),
                ),
                io.Boolean.Input(
                    "calibrate", default=False, optional=True,
                    tooltip=("On: sample with the model's own attention and measure, per block and third of the "
                             "schedule, the error of each NVFP4 precision; write the calibrated policy to "
                             "policy_file when sampling ends. Then turn it off to use that file."),
                ),
                io.Float.Input(
                    "calibration_budget", default=DEFAULT_BUDGET, min=0.001, max=10.0, step=0.01, optional=True,
                    tooltip=("Largest relative L2 error of a block's attention output that calibration accepts for "
                             "NVFP4; blocks above it keep the model's own attention."),
                ),
                io.Combo.Input(
                    "qk_format", options=list(QK_FORMATS), default=_DEFAULTS.qk_format, optional=True,
                    tooltip=("Format of Q and K. nvfp4: fastest. mxfp8: 8-bit Q·Kᵀ (P and V stay FP4) for models "
                             "whose attention is sharp (strong QK-norm gains, noisy or washed-out video with "
                             "nvfp4); its Q·Kᵀ runs at half the FP4 rate on RTX 50-series."),
                ),
                io.Float.Input(
                    "keep_mass", default=1.0, min=0.05, max=1.0, step=0.01, optional=True,
                    tooltip=("Block-sparse NVFP4 for long video: each call estimates, per 128-query block, the key "
                             "tiles holding this share of the attention mass and skips the rest (nothing is "
                             "cached between steps). 1.0: dense. 0.9 keeps about a quarter of the tiles on "
                             "video-structured inputs."),
                ),
                io.Int.Input(
                    "sparse_first_steps", default=_DEFAULTS.sparse_off_steps[0], min=0, max=10000, optional=True,
                    tooltip="With keep_mass below 1: this many first steps stay dense NVFP4 (they lay the video out).",
                ),
                io.Int.Input(
                    "sparse_min_seq_len", default=_DEFAULTS.sparse_min_seq_len, min=0, max=1 << 24, optional=True,
                    tooltip="With keep_mass below 1: calls with fewer query or key tokens stay dense NVFP4.",
                ),
            ],
            outputs=[io.Model.Output()],
        )

    @classmethod
    def execute(cls, model, enabled, backend, cross_attention_dense, dense_first_steps, dense_last_steps,
                min_seq_len, balance_qk=_DEFAULTS.balance_qk, policy_file="", calibrate=False,
                calibration_budget=DEFAULT_BUDGET, qk_format=_DEFAULTS.qk_format, keep_mass=1.0,
                sparse_first_steps=_DEFAULTS.sparse_off_steps[0],
                sparse_min_seq_len=_DEFAULTS.sparse_min_seq_len) -> io.NodeOutput:
        if not enabled:
            return io.NodeOutput(model)
        policy = AttentionPolicy(
            backend=backend, cross_attention=not cross_attention_dense,
            dense_steps=(int(dense_first_steps), int(dense_last_steps)), min_seq_len=int(min_seq_len),
            balance_qk=bool(balance_qk), qk_format=qk_format,
            keep_mass=None if float(keep_mass) >= 1.0 else float(keep_mass),
            sparse_off_steps=(int(sparse_first_steps), _DEFAULTS.sparse_off_steps[1]),
            sparse_min_seq_len=int(sparse_min_seq_len),
        )
        path = (policy_file or "").strip()
        if calibrate:
            if not path:
                raise ValueError("NVFP4 Attention: calibrate needs policy_file, the path to write the policy to")
            return io.NodeOutput(patch_model_for_calibration(model, policy, path, float(calibration_budget)))
        if path:
            calibrated = AttentionPolicy.load(path)
            policy = policy.replace(per_layer=calibrated.per_layer, model_class=calibrated.model_class,
                                    budget=calibrated.budget)
        return io.NodeOutput(patch_model(model, policy))


NODE_CLASS_MAPPINGS = {"NVFP4AttentionVideoDiT": NVFP4Attention}
NODE_DISPLAY_NAME_MAPPINGS = {"NVFP4AttentionVideoDiT": "NVFP4 Attention (video DiT)"}
