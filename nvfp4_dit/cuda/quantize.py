"""NVFP4 preprocessing on the GPU: quantize Q, K, V with low-rank Q smoothing and the key projections.

:func:`quantize_qkv` is the CUDA twin of :func:`nvfp4_dit.preprocess.quantize_qkv`: the same bytes
and scales given the same means and basis (tests compare them exactly with the reference given the
kernel's own; reductions run in another order), read straight from the strides of NHD or HND
inputs, for any input dtype, strides and head dim (``csrc/quantize/quantize_tiles.cu``,
``csrc/quantize/smoothing.cuh``): the K and V statistics, the Q block means, each query head's
smoothing basis, then the K (with their key projections), Q and V^T tiles; with ``balance_qk`` one more launch reads Q first for the balance statistics.
NaN/inf flags are raised while it quantises (:attr:`KernelQuantizedQKV.nonfinite`). Nothing of size
(Q blocks) x (keys) is written: the attention kernel forms the correction from the key
projections (:mod:`nvfp4_dit.smoothing`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from . import launch
from .. import format as fmt
from .. import smoothing
from ..checks import validate_attention_args


@dataclass
class KernelQuantizedQKV(fmt.QuantizedQKV):
    """A :class:`~nvfp4_dit.format.QuantizedQKV` from the CUDA quantiser: views into one
    :class:`~nvfp4_dit.cuda.launch.Workspace`, with low-rank smoothing (``q_center``, ``q_basis``,
    ``q_coeff``) and its ``key_projections``. It has no ``k_smoothed`` (no fp32 copy of K)."""

    key_projections: Optional[smoothing.KeyProjections] = None
    kv_lens: Optional[torch.Tensor] = None
    # (q_blocks [B, H, nblk], kv [B, Hkv]) bool: NaN/inf met while quantising (preprocess.nonfinite_blocks)
    nonfinite: Optional[tuple[torch.Tensor, torch.Tensor]] = None
    workspace: Optional[launch.Workspace] = None
    order: Optional[object] = None   # the TokenOrder the inputs were read through (tile order), or None


def quantize_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, layout: str = "NHD",
                 kv_lens: Optional[torch.Tensor] = None, balance_qk: bool = fmt.BALANCE_QK_DEFAULT,
                 qk_format: str = fmt.QK_FORMAT_DEFAULT, order=None, key_bias: Optional[torch.Tensor] = None,
                 scale: Optional[float] = None) -> KernelQuantizedQKV:
    """Smooth and quantise Q, K, V on the GPU into the attention kernel's layouts.

    Parameters
    ----------
    q, k, v : [B, S, H, D] (``layout="NHD"``) or [B, H, S, D] (``"HND"``), bf16/fp16/fp32 CUDA
        tensors with any strides (an input the kernels cannot read as 16-byte vectors is copied,
        zero-padded to Dp: :func:`nvfp4_dit.cuda.launch.vector_readable`). K and V may have fewer
        heads (GQA).
    kv_lens : optional int [B]; keys at or past ``kv_lens[b]`` are excluded from the K and V
        statistics and quantised as zero padding, as in :func:`nvfp4_dit.preprocess.quantize_qkv`.
    balance_qk : balance Q and K per channel (one more read of Q, by a statistics kernel).
    qk_format : "nvfp4" or "mxfp8" (Q and K as e4m3 with ue8m0 scales per 32).
    order : a video call's :class:`~nvfp4_dit.token_order.TokenOrder`: the outputs are those of the
        inputs in tile order (read through the order); ``kv_lens`` counts positions in tile order.
    key_bias, scale : a per-key mask (fp32 [B, H or 1, Sk] on the device, in units of the scaled
        scores, in tile order) joins the key projections' first column as ``key_bias / scale``.

    Returns
    -------
    KernelQuantizedQKV with ``k_smoothed=None`` and its ``key_projections``.
    """
    if isinstance(kv_lens, torch.Tensor) and isinstance(q, torch.Tensor):
        kv_lens = kv_lens.to(q.device)  # a direct caller may keep lengths on the host
    validate_attention_args(q, k, v, layout, False, None, None, kv_lens, False, "cuda", balance_qk, qk_format)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.device.type != "cuda":
            raise ValueError(f"{name} must be a CUDA tensor, got device {t.device}")
    d = fmt.to_hnd(q, layout).shape[-1]
    if fmt.padded_head_dim(d) is None:
        raise ValueError(f"head dim {d} is not supported (at most {fmt.SUPPORTED_HEAD_DIMS[-1]})")
    qh, kh, vh, order = launch.inputs_in_order(order, *(fmt.to_hnd(t, layout) for t in (q, k, v)))
    b, h, sq, _ = qh.shape
    key_bias = checked_key_bias(key_bias, b, h, kh.shape[2], q.device)
    if key_bias is not None and scale is None:
        raise ValueError("scale is needed with key_bias (the bias is in units of the scaled scores)")
    dk = launch.device_kernels(q.device)
    launch.ensure_current(dk.index)
    ws = launch.Workspace(workspace_layout(qh, kh, balance_qk, qk_format), q.device)
    stream = launch.current_stream(dk.index)
    ws.clear(stream)
    qr, kr, vr = (launch.vector_readable(t, fmt.padded_head_dim(d)) for t in (qh, kh, vh))
    launch.launch_quantize(dk, ws, qr, kr, vr, None if kv_lens is None else kv_lens.contiguous(), balance_qk,
                           qk_format, stream, order=order, key_bias=key_bias, scale=1.0 if scale is None else scale)
    qq = quantized_from_workspace(ws, qh, kh, kv_lens, balance_qk, qk_format)
    qq.order = order
    return qq


def workspace_layout(qh: torch.Tensor, kh: torch.Tensor, balance_qk: bool, qk_format: str) -> launch.WorkspaceLayout:
    """The workspace of logical [B, H, S, D] inputs (:func:`nvfp4_dit.cuda.launch.workspace_layout`)."""
    b, h, sq, d = qh.shape
    return launch.workspace_layout(b, h, kh.shape[1], sq, kh.shape[2], fmt.padded_head_dim(d), qk_format,
                                   bool(balance_qk))


def quantized_from_workspace(ws: launch.Workspace, qh: torch.Tensor, kh: torch.Tensor,
                             kv_lens: Optional[torch.Tensor], balance_qk: bool, qk_format: str) -> KernelQuantizedQKV:
    """The quantiser's outputs in ``ws`` as a :class:`KernelQuantizedQKV` of views (shapes from the
    inputs ``qh``, ``kh``)."""
    d = qh.shape[3]
    views = {name: ws.view(name) for name in ("q_data", "q_sf", "k_data", "k_sf", "vt_data", "vt_sf", "q_mean",
                                              "k_mean", "v_mean", "q_scale", "k_scale", "v_scale", "balance",
                                              "q_dot_km", "k_tile_mean", "q_similarity", "q_center", "q_basis",
                                              "q_basis_scale", "q_coeff")}
    if not balance_qk:
        views["balance"] = None
    return KernelQuantizedQKV(
        **views, k_smoothed=None, seq_q=qh.shape[2], seq_k=kh.shape[2], head_dim=d,
        head_dim_padded=fmt.padded_head_dim(d),
        key_projections=smoothing.KeyProjections(ws.view("key_proj"), ws.view("key_proj_factor")), kv_lens=kv_lens,
        nonfinite=(ws.view("nonfinite_q") != 0, ws.view("nonfinite_kv") != 0), qk_format=qk_format, workspace=ws)


def checked_key_bias(key_bias: Optional[torch.Tensor], b: int, h: int, sk: int, device) -> Optional[torch.Tensor]:
    """``key_bias`` as the kernels read it: fp32 [B, H or 1, Sk] on ``device`` with a contiguous last dim."""
    if key_bias is None:
        return None
    if (not isinstance(key_bias, torch.Tensor) or key_bias.dtype != torch.float32 or key_bias.dim() != 3
            or key_bias.shape[0] != b or key_bias.shape[1] not in (1, h) or key_bias.shape[2] != sk
            or key_bias.device != device):
        raise ValueError(f"key_bias must be a float32 [{b}, {h} or 1, {sk}] tensor on {device}")
    return key_bias if key_bias.stride(2) == 1 else key_bias.contiguous()
