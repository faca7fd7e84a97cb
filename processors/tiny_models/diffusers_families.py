"""Tiny random diffusers video transformers of the seven families NVFP4 targets.

Each builder returns a :class:`TinyCase`: a randomly initialised model (fixed seed, ``eval()``)
and matching forward inputs.  Head dims are FP4-shaped (64 or 128) while everything else is
small, so a forward runs in well under a second on CPU and the self-attention sequences span a
few 128-token tiles.  No weights are downloaded; the configs are the arguments below.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

FAMILIES = ("cosmos", "cosmos_2_5", "wan", "wan_i2v", "hunyuan_video", "ltx", "cogvideox", "mochi", "minimax_h3")


@dataclass
class TinyCase:
    family: str
    model: torch.nn.Module
    inputs: dict
    # Tensors of the output to compare (some models return several).
    outputs: Callable = field(default=lambda res: [res[0]])

    def to(self, device) -> "TinyCase":
        """Move the model and every tensor input (tuples included) to ``device``."""
        def move(x):
            if isinstance(x, torch.Tensor):
                return x.to(device)
            if isinstance(x, tuple):
                return tuple(move(y) for y in x)
            return x

        self.model.to(device)
        self.inputs = {k: move(v) for k, v in self.inputs.items()}
        return self

    def run(self) -> list[torch.Tensor]:
        with torch.no_grad():
            return self.outputs(self.model(**self.inputs, return_dict=False))


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(g, *shape, dtype):
    return torch.randn(*shape, generator=g).to(dtype)


def cosmos(head_dim=64, heads=2, dtype=torch.float32, seed=0, text_len=12, frames=2, size=16, image_context=0):
    """Cosmos Predict2; ``image_context=N`` adds Transfer/Predict2.5's N image-context tokens
    (cross-attention then runs ``CosmosAttnProcessor2_5``)."""
    from diffusers import CosmosTransformer3DModel

    torch.manual_seed(seed)
    extra = dict(img_context_dim_in=8, img_context_num_tokens=image_context,
                 img_context_dim_out=heads * head_dim) if image_context else {}
    model = CosmosTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=heads, attention_head_dim=head_dim, num_layers=1,
        mlp_ratio=2.0, text_embed_dim=16, adaln_lora_dim=4, max_size=(4, 32, 32), patch_size=(1, 2, 2),
        rope_scale=(2.0, 1.0, 1.0), concat_padding_mask=False, extra_pos_embed_type="learnable", **extra,
    ).to(dtype).eval()
    g = _gen(seed + 1)
    text = _randn(g, 1, text_len, 16, dtype=dtype)
    inputs = dict(
        hidden_states=_randn(g, 1, 4, frames, size, size, dtype=dtype),
        timestep=torch.tensor([500]),
        encoder_hidden_states=(text, _randn(g, 1, image_context, 8, dtype=dtype)) if image_context else text,
        fps=30,
        padding_mask=torch.zeros(1, 1, size, size, dtype=dtype),
    )
    return TinyCase("cosmos_2_5" if image_context else "cosmos", model, inputs)


def cosmos_2_5(**kw):
    return cosmos(image_context=32, **kw)


def wan(head_dim=64, heads=2, dtype=torch.float32, seed=0, text_len=12, frames=2, size=16, i2v=False):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    extra = dict(image_dim=8, added_kv_proj_dim=heads * head_dim) if i2v else {}
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=head_dim,
        in_channels=8 if i2v else 4, out_channels=4, text_dim=16, freq_dim=32, ffn_dim=64, num_layers=2,
        cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32, **extra,
    ).to(dtype).eval()
    g = _gen(seed + 1)
    # Wan I2V hard-codes the last 512 context tokens as text (WanAttnProcessor splits them off).
    inputs = dict(
        hidden_states=_randn(g, 1, 8 if i2v else 4, frames, size, size, dtype=dtype),
        timestep=torch.tensor([500]),
        encoder_hidden_states=_randn(g, 1, 512 if i2v else text_len, 16, dtype=dtype),
    )
    if i2v:
        inputs["encoder_hidden_states_image"] = _randn(g, 1, 16, 8, dtype=dtype)
    return TinyCase("wan_i2v" if i2v else "wan", model, inputs)


def wan_i2v(**kw):
    return wan(i2v=True, **kw)


def hunyuan_video(head_dim=64, heads=2, dtype=torch.float32, seed=0, text_len=12, valid_text=8, frames=1, size=16):
    from diffusers import HunyuanVideoTransformer3DModel

    torch.manual_seed(seed)
    t_axis = head_dim // 4
    s_axis = (head_dim - t_axis) // 2
    model = HunyuanVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=heads, attention_head_dim=head_dim, num_layers=1,
        num_single_layers=1, num_refiner_layers=1, patch_size=1, patch_size_t=1, guidance_embeds=True,
        text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=(t_axis, s_axis, head_dim - t_axis - s_axis),
    ).to(dtype).eval()
    g = _gen(seed + 1)
    mask = torch.zeros(1, text_len, dtype=torch.long)
    mask[:, :valid_text] = 1  # padded text at the end, as the pipeline pads the prompt
    inputs = dict(
        hidden_states=_randn(g, 1, 4, frames, size, size, dtype=dtype),
        timestep=torch.tensor([500.0]),
        encoder_hidden_states=_randn(g, 1, text_len, 16, dtype=dtype),
        encoder_attention_mask=mask,
        pooled_projections=_randn(g, 1, 8, dtype=dtype),
        guidance=torch.tensor([3500.0]),
    )
    return TinyCase("hunyuan_video", model, inputs)


def ltx(head_dim=64, heads=2, dtype=torch.float32, seed=0, text_len=16, valid_text=10, frames=2, size=8, batch=2):
    from diffusers import LTXVideoTransformer3DModel

    torch.manual_seed(seed)
    model = LTXVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=heads, attention_head_dim=head_dim,
        cross_attention_dim=heads * head_dim, num_layers=1, qk_norm="rms_norm_across_heads", caption_channels=16,
    ).to(dtype).eval()
    g = _gen(seed + 1)
    mask = torch.ones(batch, text_len, dtype=torch.bool)
    mask[0, valid_text:] = False  # the first prompt is shorter: LTX turns this into -10000 biases
    inputs = dict(
        hidden_states=_randn(g, batch, frames * size * size, 4, dtype=dtype),  # already patchified
        encoder_hidden_states=_randn(g, batch, text_len, 16, dtype=dtype),
        timestep=torch.tensor([500] * batch),
        encoder_attention_mask=mask,
        num_frames=frames, height=size, width=size,
    )
    return TinyCase("ltx", model, inputs)


def cogvideox(head_dim=64, heads=2, dtype=torch.float32, seed=0, text_len=8, frames=2, size=16):
    from diffusers import CogVideoXTransformer3DModel

    torch.manual_seed(seed)
    model = CogVideoXTransformer3DModel(
        num_attention_heads=heads, attention_head_dim=head_dim, in_channels=4, out_channels=4, time_embed_dim=4,
        text_embed_dim=8, num_layers=1, sample_width=size, sample_height=size, sample_frames=frames,
        patch_size=2, temporal_compression_ratio=4, max_text_seq_length=text_len,
    ).to(dtype).eval()
    g = _gen(seed + 1)
    inputs = dict(
        hidden_states=_randn(g, 1, frames, 4, size, size, dtype=dtype),  # (B, F, C, H, W)
        encoder_hidden_states=_randn(g, 1, text_len, 8, dtype=dtype),
        timestep=torch.tensor([500]),
    )
    return TinyCase("cogvideox", model, inputs)


def mochi(head_dim=64, heads=2, dtype=torch.float32, seed=0, text_len=16, valid_text=(16, 9), frames=2, size=16):
    from diffusers import MochiTransformer3DModel

    torch.manual_seed(seed)
    model = MochiTransformer3DModel(
        patch_size=2, num_attention_heads=heads, attention_head_dim=head_dim, num_layers=1,
        pooled_projection_dim=16, in_channels=4, out_channels=None, qk_norm="rms_norm", text_embed_dim=16,
        time_embed_dim=4, activation_fn="swiglu", max_sequence_length=text_len,
    ).to(dtype).eval()
    g = _gen(seed + 1)
    b = len(valid_text)
    mask = torch.zeros(b, text_len, dtype=torch.bool)
    for i, n in enumerate(valid_text):
        mask[i, :n] = True
    inputs = dict(
        hidden_states=_randn(g, b, 4, frames, size, size, dtype=dtype),
        encoder_hidden_states=_randn(g, b, text_len, 16, dtype=dtype),
        timestep=torch.tensor([500] * b),
        encoder_attention_mask=mask,
    )
    return TinyCase("mochi", model, inputs)


def minimax_h3(head_dim=64, heads=2, dtype=torch.float32, seed=0, text_len=8, audio_len=16, video_len=128, batch=1):
    from diffusers import MiniMaxH3Transformer3DModel

    torch.manual_seed(seed)
    rope_freq_dim = head_dim // 8  # partial rotary: 2*3*rope_freq_dim = 3/4 of the head dim
    model = MiniMaxH3Transformer3DModel(
        num_attention_heads=heads, attention_head_dim=head_dim, hidden_size=96, num_layers=1,
        num_refiner_layers=1, ffn_dim=64, in_channels=4, audio_in_channels=6, patch_size=(1, 2, 2), text_dim=8,
        freq_dim=8, time_embed_hidden_dim=32, time_embed_dim=16, rope_freq_dim=rope_freq_dim,
    ).to(dtype).eval()
    g = _gen(seed + 1)
    s = text_len + audio_len + video_len
    text_idx = torch.arange(text_len)
    audio_idx = torch.arange(text_len, text_len + audio_len)
    video_idx = torch.arange(text_len + audio_len, s)
    tags = torch.empty(s, dtype=torch.long)
    tags[text_idx], tags[audio_idx], tags[video_idx] = 1, 2, 0  # 0 video, 1 text, 2 audio
    t_idx = torch.zeros(s, dtype=torch.long)
    t_idx[audio_idx] = 1
    pos = torch.zeros(s, 3)
    pos[:, 0] = torch.arange(s, dtype=torch.float32)
    pos[video_idx, 1] = (torch.arange(video_len) // 8).float()
    pos[video_idx, 2] = (torch.arange(video_len) % 8).float()
    inputs = dict(
        hidden_states=_randn(g, batch, video_len, 16, dtype=dtype),
        audio_hidden_states=_randn(g, batch, audio_len, 6, dtype=dtype),
        encoder_hidden_states=_randn(g, batch, text_len, 8, dtype=dtype),
        timestep=torch.tensor([0.7, 0.3]),
        timestep_indices=t_idx, token_tags=tags, position_ids=pos,
        video_indices=video_idx, audio_indices=audio_idx, text_indices=text_idx,
    )
    return TinyCase("minimax_h3", model, inputs, outputs=lambda res: [res[0], res[1]])


BUILDERS = {
    "cosmos": cosmos, "cosmos_2_5": cosmos_2_5, "wan": wan, "wan_i2v": wan_i2v, "hunyuan_video": hunyuan_video, "ltx": ltx,
    "cogvideox": cogvideox, "mochi": mochi, "minimax_h3": minimax_h3,
}


def build(family: str, **kwargs) -> TinyCase:
    """The tiny case of ``family`` (one of :data:`FAMILIES`); kwargs go to its builder."""
    if family not in BUILDERS:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    return BUILDERS[family](**kwargs)
