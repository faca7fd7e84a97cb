"""Video-structured attention inputs without a model: tokens on a T x H x W latent grid in raster
order, smooth content plus noise, and the 3D rotary embedding Wan and HunyuanVideo apply.

Video DiT attention is local because neighbouring tokens carry similar content and 3D RoPE turns
the query-key product into a function of their offset; iid Gaussian inputs have neither, so they
make every key tile equally likely. These inputs have both, for the sparse benchmarks and the
accuracy report:

* content: per head, ``modes`` random low-frequency Fourier modes over (t, y, x) (32 by default; a
  handful makes content periodic, with far echoes of each token, and harder to sparsify), normalised per token
  (DiT queries and keys pass through RMS/QK-norm), shared by Q and K up to independent noise;
* ``gain``: the logit scale (QK-norm's learned gain squared, in effect): q . k / sqrt(D) of one
  token with itself is about ``gain**2 * sqrt(D)``;
* 3D RoPE as Wan 2.1 splits it: the head dim in pairs, ``D - 4 (D // 6)`` channels for time and
  ``2 (D // 6)`` each for height and width, frequencies ``10000 ** (-2i / n)`` within each part.
"""

from __future__ import annotations

import math

import torch


def rope_3d(x: torch.Tensor, grid: tuple[int, int, int], theta: float = 10000.0) -> torch.Tensor:
    """x [B, S, H, D] (S = T * Hh * Ww in raster order) rotated by Wan's 3D RoPE."""
    t, hh, ww = grid
    d = x.shape[-1]
    parts = (d - 4 * (d // 6), 2 * (d // 6), 2 * (d // 6))
    pos = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(hh), torch.arange(ww), indexing="ij"), -1)
    pos = pos.reshape(-1, 3).to(x.device, torch.float64)
    angles = []
    for axis, n in enumerate(parts):
        freqs = theta ** (-torch.arange(0, n, 2, dtype=torch.float64, device=x.device) / n)
        angles.append(pos[:, axis:axis + 1] * freqs)
    angle = torch.cat(angles, -1)                        # [S, D/2]
    cos, sin = angle.cos().float()[None, :, None, :], angle.sin().float()[None, :, None, :]
    pairs = x.float().unflatten(-1, (d // 2, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    return torch.stack((a * cos - b * sin, a * sin + b * cos), -1).flatten(-2).to(x.dtype)


def smooth_field(grid: tuple[int, int, int], heads: int, dim: int, *, modes: int = 32, scale: float = 0.15,
                 generator: torch.Generator, device="cpu") -> torch.Tensor:
    """[S, heads, dim] fp32: per head and channel a sum of ``modes`` random plane waves over the grid
    with wave numbers of about ``scale`` radians per token (smooth over a few tokens)."""
    t, hh, ww = grid
    pos = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(hh), torch.arange(ww), indexing="ij"), -1)
    pos = pos.reshape(-1, 3).float().to(device)
    k = torch.randn(heads, modes, 3, generator=generator, device=device) * scale
    amp = torch.randn(heads, modes, dim, generator=generator, device=device)
    phase = torch.rand(heads, modes, 1, generator=generator, device=device) * 2 * math.pi
    waves = torch.cos(torch.einsum("sc,hmc->hms", pos, k)[..., None] + phase[..., None, :].transpose(-1, -2))
    return torch.einsum("hmsd,hmd->shd", waves.expand(heads, modes, pos.shape[0], 1), amp) / math.sqrt(modes)


def video_qkv(grid: tuple[int, int, int], heads: int = 4, dim: int = 128, *, gain: float = 1.2, noise: float = 0.5,
              modes: int = 32, seed: int = 0, channel_bias: float = 0.0, dtype=torch.bfloat16,
              device="cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v [1, S, heads, dim] (NHD) on a ``grid`` = (T, H, W) of latent tokens (module docstring).

    ``channel_bias``: Q and K each get a constant per-head channel bias before RoPE, of RMS
    ``channel_bias`` times the tokens' (a projection's bias, or a channel the norm's gain lifts).
    RoPE turns it into a position-dependent offset, so the 128-token blocks' means drift smoothly
    along the sequence: what per-block Q smoothing absorbs."""
    g = torch.Generator(device=device).manual_seed(seed)
    content = smooth_field(grid, heads, dim, modes=modes, generator=g, device=device)
    # drawn from a generator of their own, so inputs without a bias keep their values
    bias_gen = torch.Generator(device=device).manual_seed(seed + 1)
    q_bias, k_bias = (channel_bias * gain * torch.randn(heads, dim, generator=bias_gen, device=device) for _ in range(2))

    def token(x):   # RMS-normalised per token, as a QK-norm leaves it, then the gain
        x = x + noise * torch.randn(x.shape, generator=g, device=device)
        return x / x.pow(2).mean(-1, keepdim=True).sqrt() * gain

    q = rope_3d((token(content) + q_bias)[None], grid)
    k = rope_3d((token(content) + k_bias)[None], grid)
    v = smooth_field(grid, heads, dim, modes=modes, generator=g, device=device)[None] + noise * torch.randn(
        1, content.shape[0], heads, dim, generator=g, device=device)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def grid_for(seq: int, frames: int = 21, aspect: float = 16 / 9) -> tuple[int, int, int]:
    """A (T, H, W) latent grid of about ``seq`` tokens: ``frames`` latent frames at ``aspect``."""
    per_frame = seq / frames
    hh = max(1, round(math.sqrt(per_frame / aspect)))
    ww = max(1, round(per_frame / hh))
    return frames, hh, ww
