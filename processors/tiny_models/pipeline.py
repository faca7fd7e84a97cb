"""A tiny random text-to-video pipeline that runs end to end on a CPU in seconds.

Same structure as diffusers' ``WanPipeline`` (prompt encoder -> flow-matching denoising loop with
classifier-free guidance over a ``WanTransformer3DModel`` -> ``AutoencoderKLWan`` decode), but
every component is built from a JSON config with random weights, and the text encoder is a
byte-level embedding so no tokenizer or text model is needed.  The output is noise-like video;
the point is a real DiT attention workload (self-attention over a few hundred video tokens,
cross-attention to the prompt) that exercises NVFP4 attention, the step policy and the tools.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Union

import numpy as np
import torch

from diffusers import AutoencoderKLWan, DiffusionPipeline, WanTransformer3DModel
from diffusers import schedulers as _schedulers
from diffusers.utils import BaseOutput
from diffusers.video_processor import VideoProcessor

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
DEFAULT_CONFIG = CONFIG_DIR / "tiny_wan_t2v.json"


class ByteTextEncoder(torch.nn.Module):
    """Prompt -> [B, max_length, dim] embeddings from its UTF-8 bytes (random, fixed by the seed).

    Stands in for T5/UMT5: deterministic per prompt, different prompts give different context,
    and padding is zero as in Wan's pipeline (which zero-pads text to a fixed length).
    """

    def __init__(self, dim: int = 32, max_length: int = 32):
        super().__init__()
        self.max_length = max_length
        self.embed = torch.nn.Embedding(256, dim)
        self.mix = torch.nn.Sequential(torch.nn.Linear(dim, dim), torch.nn.GELU(), torch.nn.Linear(dim, dim))

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def forward(self, prompts: list[str]) -> torch.Tensor:
        ids = torch.zeros(len(prompts), self.max_length, dtype=torch.long, device=self.device)
        mask = torch.zeros(len(prompts), self.max_length, dtype=torch.bool, device=self.device)
        for i, p in enumerate(prompts):
            b = list(p.encode("utf-8"))[: self.max_length]
            if b:
                ids[i, : len(b)] = torch.tensor(b, device=self.device)
                mask[i, : len(b)] = True
        x = self.embed(ids)
        x = x + self.mix(x)
        return x * mask[..., None].to(x.dtype)


@dataclass
class TinyVideoPipelineOutput(BaseOutput):
    frames: Union[np.ndarray, torch.Tensor]
    latents: Optional[torch.Tensor] = None


class TinyVideoPipeline(DiffusionPipeline):
    """Text-to-video with the Wan pipeline's loop; see the module docstring."""

    model_cpu_offload_seq = "text_encoder->transformer->vae"
    _callback_tensor_inputs = ["latents"]

    def __init__(self, transformer, vae, scheduler, text_encoder):
        super().__init__()
        self.register_modules(transformer=transformer, vae=vae, scheduler=scheduler, text_encoder=text_encoder)
        self.vae_scale_factor_temporal = 2 ** sum(vae.temperal_downsample)
        self.vae_scale_factor_spatial = 2 ** len(vae.temperal_downsample)
        self.video_processor = VideoProcessor(vae_scale_factor=self.vae_scale_factor_spatial)

    @property
    def num_timesteps(self) -> int:
        return self._num_timesteps

    def check_inputs(self, height: int, width: int, num_frames: int) -> None:
        """ValueError unless the VAE and the transformer's 2x2 patches tile the video exactly."""
        s, t = self.vae_scale_factor_spatial, self.vae_scale_factor_temporal
        if height < 1 or width < 1 or height % (2 * s) or width % (2 * s):
            raise ValueError(f"height and width must be positive multiples of {2 * s}, got {height}x{width}")
        if num_frames < 1 or (num_frames - 1) % t:
            raise ValueError(f"num_frames must be {t}k + 1 (1, {t + 1}, {2 * t + 1}, ...), got {num_frames}")

    @torch.no_grad()
    def __call__(
        self,
        prompt: Union[str, list[str]] = "",
        negative_prompt: Optional[Union[str, list[str]]] = None,
        height: int = 128,
        width: int = 128,
        num_frames: int = 17,
        num_inference_steps: int = 8,
        guidance_scale: float = 3.0,
        generator: Optional[torch.Generator] = None,
        latents: Optional[torch.Tensor] = None,
        output_type: str = "np",
        return_dict: bool = True,
        callback_on_step_end: Optional[Callable] = None,
        callback_on_step_end_tensor_inputs: tuple = ("latents",),
    ):
        self.check_inputs(height, width, num_frames)
        s, t = self.vae_scale_factor_spatial, self.vae_scale_factor_temporal
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        device = self._execution_device
        dtype = self.transformer.dtype
        cond = self.text_encoder(prompts).to(dtype)
        do_cfg = guidance_scale > 1.0
        if do_cfg:
            neg = negative_prompt if negative_prompt is not None else ""
            negs = [neg] * len(prompts) if isinstance(neg, str) else list(neg)
            uncond = self.text_encoder(negs).to(dtype)

        shape = (len(prompts), self.vae.config.z_dim, (num_frames - 1) // t + 1, height // s, width // s)
        if latents is None:
            latents = torch.randn(shape, generator=generator, dtype=torch.float32).to(device)
        self.scheduler.set_timesteps(num_inference_steps, device=device)
        timesteps = self.scheduler.timesteps
        self._num_timesteps = len(timesteps)
        with self.progress_bar(total=len(timesteps)) as bar:
            for i, ts in enumerate(timesteps):
                x = latents.to(dtype)
                tt = ts.expand(x.shape[0])
                noise = self.transformer(hidden_states=x, timestep=tt, encoder_hidden_states=cond, return_dict=False)[0]
                if do_cfg:
                    noise_u = self.transformer(hidden_states=x, timestep=tt, encoder_hidden_states=uncond,
                                               return_dict=False)[0]
                    noise = noise_u + guidance_scale * (noise - noise_u)
                latents = self.scheduler.step(noise.float(), ts, latents, return_dict=False)[0]
                if callback_on_step_end is not None:
                    local = {"latents": latents}
                    out = callback_on_step_end(self, i, ts, {k: local[k] for k in callback_on_step_end_tensor_inputs})
                    latents = out.pop("latents", latents)
                bar.update()

        if output_type == "latent":
            video = latents
        else:
            mean = torch.tensor(self.vae.config.latents_mean, device=device).view(1, -1, 1, 1, 1)
            std = torch.tensor(self.vae.config.latents_std, device=device).view(1, -1, 1, 1, 1)
            z = (latents * std + mean).to(self.vae.dtype)
            video = self.vae.decode(z, return_dict=False)[0]
            video = self.video_processor.postprocess_video(video.float(), output_type=output_type)
        self.maybe_free_model_hooks()
        if not return_dict:
            return (video,)
        return TinyVideoPipelineOutput(frames=video, latents=latents)


def load_config(path: Optional[Union[str, Path]] = None) -> dict:
    with open(path or DEFAULT_CONFIG) as f:
        return json.load(f)


def cast_like_from_pretrained(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """``model`` in ``dtype`` as ``from_pretrained(torch_dtype=dtype)`` loads it: the modules the model
    keeps in float32 (``_keep_in_fp32_modules``: Wan's rope, time embedder, norms) stay there, as
    on a real Wan checkpoint (``model.to(dtype)`` would cast them too, and diffusers warns)."""
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or ())
    for prefix, module in model.named_modules():
        for key, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            if not tensor.is_floating_point() or keep & set(f"{prefix}.{key}".split(".")):
                continue   # diffusers matches any component of the tensor's name, as here
            if key in module._parameters:
                tensor.data = tensor.data.to(dtype)
            else:
                module._buffers[key] = tensor.to(dtype)
    return model


def build_tiny_pipeline(config: Optional[Union[str, Path, dict]] = None, *, dtype: torch.dtype = torch.float32,
                        seed: Optional[int] = None) -> TinyVideoPipeline:
    """The tiny pipeline from a config (path or dict; default: the shipped ``tiny_wan_t2v.json``)."""
    cfg = config if isinstance(config, dict) else load_config(config)
    torch.manual_seed(cfg.get("seed", 0) if seed is None else seed)
    tcfg = dict(cfg["transformer"])
    tcfg["patch_size"] = tuple(tcfg["patch_size"])
    transformer = cast_like_from_pretrained(WanTransformer3DModel(**tcfg), dtype).eval()
    vae = AutoencoderKLWan(**cfg["vae"]).eval()  # the VAE stays fp32, as in Wan's examples
    text_encoder = ByteTextEncoder(**cfg["text_encoder"]).eval()
    scfg = dict(cfg["scheduler"])
    scheduler = getattr(_schedulers, scfg.pop("class"))(**scfg)
    pipe = TinyVideoPipeline(transformer=transformer, vae=vae, scheduler=scheduler, text_encoder=text_encoder)
    pipe.tiny_config = cfg
    return pipe
