"""NVFP4 preprocessing on the GPU: quantize Q, K, V, and the correction term in bounded chunks.

:func:`quantize_qkv` is the CUDA twin of :func:`nvfp4_dit.preprocess.quantize_qkv`: the same bytes
and scales (tests compare them exactly), the means equal up to reduction order, read straight
from the strides of NHD or HND inputs, for any input dtype, strides and head dim
(``csrc/quantize/quantize_tiles.cu``): one launch reduces the K and V statistics in chunks, a
second quantises the K, Q and V^T tiles, which need their head's statistics; with ``balance_qk``
one more launch reads Q first for the balance statistics. NaN/inf flags are raised while it
quantises (:attr:`KernelQuantizedQKV.nonfinite`).

The correction ``delta = qm . (k - km)^T`` is ``B*H*Sq/128*Skp`` fp16 values and a power-of-two
factor per 128-key tile (:class:`~nvfp4_dit.format.Correction`; 8.9 GB at 118,800 tokens and 40
heads), so it is produced for a chunk of Q blocks at a time (:func:`iter_corrections`)
within a memory budget: ``budget=`` bytes, else ``NVFP4_DIT_CORRECTION_BUDGET`` (bytes, or with
a K/M/G suffix), else 1 GiB. The kernel quantiser keeps no fp32 copy of ``k - km``: its
correction (:func:`correction`) reads the raw K.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Iterator, Optional, Union

import torch

from . import launch
from .. import format as fmt
from .. import preprocess
from ..checks import validate_attention_args

BUDGET_ENV = "NVFP4_DIT_CORRECTION_BUDGET"
DEFAULT_CORRECTION_BUDGET = 1 << 30
_SUFFIXES = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


@dataclass
class KernelQuantizedQKV(fmt.QuantizedQKV):
    """A :class:`~nvfp4_dit.format.QuantizedQKV` from the CUDA quantiser: views into one
    :class:`~nvfp4_dit.cuda.launch.Workspace`. It has no ``k_smoothed``: the correction is computed
    from the raw K instead (``k_input``: the caller's [B, Hkv, Sk, D] tensor, or its copy padded to
    [B, Hkv, Sk, Dp] where the kernels cannot read it as 16-byte vectors)."""

    k_input: Optional[torch.Tensor] = None
    kv_lens: Optional[torch.Tensor] = None
    # (q_blocks [B, H, nblk], kv [B, Hkv]) bool: NaN/inf met while quantising (preprocess.nonfinite_blocks)
    nonfinite: Optional[tuple[torch.Tensor, torch.Tensor]] = None
    workspace: Optional[launch.Workspace] = None
    order: Optional[object] = None   # the TokenOrder k_input is read through (tile order), or None


def quantize_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, layout: str = "NHD",
                 kv_lens: Optional[torch.Tensor] = None, balance_qk: bool = fmt.BALANCE_QK_DEFAULT,
                 qk_format: str = fmt.QK_FORMAT_DEFAULT, order=None) -> KernelQuantizedQKV:
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

    Returns
    -------
    KernelQuantizedQKV with ``k_smoothed=None``; :func:`iter_corrections` gives the correction.
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
    dk = launch.device_kernels(q.device)
    launch.ensure_current(dk.index)
    ws = launch.Workspace(workspace_layout(qh, kh, balance_qk, qk_format, 0), q.device)
    stream = launch.current_stream(dk.index)
    ws.clear(stream)
    # read as 16-byte vectors by the quantiser and later the correction: one copy where needed
    qr, kr, vr = (launch.vector_readable(t, fmt.padded_head_dim(d)) for t in (qh, kh, vh))
    launch.launch_quantize(dk, ws, qr, kr, vr, None if kv_lens is None else kv_lens.contiguous(), balance_qk,
                           qk_format, stream, order=order)
    qq = quantized_from_workspace(ws, qh, kh, kr, kv_lens, balance_qk, qk_format)
    qq.order = order
    return qq


def workspace_layout(qh: torch.Tensor, kh: torch.Tensor, balance_qk: bool, qk_format: str,
                     correction_rows: int) -> launch.WorkspaceLayout:
    """The workspace of logical [B, H, S, D] inputs (:func:`nvfp4_dit.cuda.launch.workspace_layout`)."""
    b, h, sq, d = qh.shape
    return launch.workspace_layout(b, h, kh.shape[1], sq, kh.shape[2], fmt.padded_head_dim(d), qk_format,
                                   bool(balance_qk), correction_rows)


def quantized_from_workspace(ws: launch.Workspace, qh: torch.Tensor, kh: torch.Tensor, k_input: torch.Tensor,
                             kv_lens: Optional[torch.Tensor], balance_qk: bool, qk_format: str) -> KernelQuantizedQKV:
    """The quantiser's outputs in ``ws`` as a :class:`KernelQuantizedQKV` of views (shapes from the
    inputs ``qh``, ``kh``; ``k_input``: K as the kernels read it)."""
    d = qh.shape[3]
    views = {name: ws.view(name) for name in ("q_data", "q_sf", "k_data", "k_sf", "vt_data", "vt_sf", "q_mean",
                                              "k_mean", "v_mean", "q_scale", "k_scale", "v_scale", "balance",
                                              "q_dot_km", "k_tile_mean", "q_similarity")}
    if not balance_qk:
        views["balance"] = None
    return KernelQuantizedQKV(
        **views, k_smoothed=None, seq_q=qh.shape[2], seq_k=kh.shape[2], head_dim=d,
        head_dim_padded=fmt.padded_head_dim(d), k_input=k_input, kv_lens=kv_lens,
        nonfinite=(ws.view("nonfinite_q") != 0, ws.view("nonfinite_kv") != 0), qk_format=qk_format, workspace=ws)


# ---------------------------------------------------------------------------------------------
# The correction term, in chunks of Q blocks
# ---------------------------------------------------------------------------------------------

def correction_budget_bytes(budget: Union[int, str, None] = None) -> int:
    """The correction memory budget in bytes: ``budget``, else $NVFP4_DIT_CORRECTION_BUDGET, else 1 GiB.

    Strings may carry a binary suffix: ``"512M"``, ``"2G"``, ``"1.5G"``.
    """
    source = "budget"
    if budget is None:
        env = os.environ.get(BUDGET_ENV)
        if env is None or not env.strip():
            return DEFAULT_CORRECTION_BUDGET
        budget, source = env, BUDGET_ENV
    if isinstance(budget, bool):
        raise TypeError(f"{source} must be a byte count, got {budget!r}")
    if isinstance(budget, str):
        text = budget.strip().upper().removesuffix("IB").removesuffix("B")
        unit = text[-1:] if text[-1:] in _SUFFIXES and text[-1:] else ""
        number = text[:-1] if unit else text
        try:
            value = int(float(number) * _SUFFIXES[unit])
        except ValueError:
            raise ValueError(f"{source} must be a byte count like 1073741824, '512M' or '1G', got {budget!r}") from None
    elif isinstance(budget, int):
        value = budget
    else:
        raise TypeError(f"{source} must be an int or a string, got {type(budget).__name__}")
    if value <= 0:
        raise ValueError(f"{source} must be positive, got {budget!r}")
    return value


def correction_bytes_per_block(batch: int, heads: int, seq_k_padded: int) -> int:
    """Bytes of one Q block's correction rows for all batches and heads (fp16 values, fp32 factors)."""
    return batch * heads * (seq_k_padded * 2 + seq_k_padded // fmt.SEQ_TILE * 4)


def correction_chunks(num_q_blocks: int, batch: int, heads: int, seq_k_padded: int,
                      budget: Union[int, str, None] = None) -> tuple[tuple[int, int], ...]:
    """Split Q blocks ``[0, num_q_blocks)`` into ``(begin, end)`` chunks whose correction fits the budget.

    As few chunks as the budget allows (each reads all of K again), of equal length but the last,
    which is no longer. A single block needs :func:`correction_bytes_per_block`; if even that is
    above the budget, chunks are one block.
    """
    return _chunks(num_q_blocks, correction_bytes_per_block(batch, heads, seq_k_padded),
                   correction_budget_bytes(budget))


@functools.lru_cache(maxsize=512)
def _chunks(num_q_blocks: int, per_block: int, budget_bytes: int) -> tuple[tuple[int, int], ...]:
    if num_q_blocks <= 0:
        return ()
    most = max(1, budget_bytes // max(per_block, 1))
    count = -(-num_q_blocks // most)
    step = -(-num_q_blocks // count)
    return tuple((b0, min(b0 + step, num_q_blocks)) for b0 in range(0, num_q_blocks, step))


def _check_kernel_quantized(qq) -> None:
    if not isinstance(qq, KernelQuantizedQKV) or qq.k_input is None:
        raise TypeError("qq must come from nvfp4_dit.cuda.quantize.quantize_qkv (a KernelQuantizedQKV with k_input)")


def correction(qq: KernelQuantizedQKV, block_start: int = 0, block_end: Optional[int] = None, *,
               out: Optional[fmt.Correction] = None, key_bias: Optional[torch.Tensor] = None,
               scale: Optional[float] = None) -> fmt.Correction:
    """The correction qm . (k - km)^T / (q_scale k_scale) of those Q blocks (the attention kernel's
    score units) on the GPU: dense rows of a :class:`~nvfp4_dit.format.Correction`, values
    [B, H, block_end - block_start, Skp] fp16 and factors [B, H, block_end - block_start, Skp/128].

    Keys in natural order; keys past ``kv_lens`` and the padding give 0. Equals
    :func:`nvfp4_dit.preprocess.correction` bit for bit (int8 tensor cores on fixed-point limbs,
    an order-independent integer sum, the same fp16 storage), ``key_bias`` ([B, H or 1, Sk] fp32,
    in units of the scaled scores, e.g. a key mask's) included: it adds
    ``key_bias / (scale q_scale k_scale)``. ``out`` (contiguous) is written in place and returned,
    so one buffer can serve every chunk.
    """
    _check_kernel_quantized(qq)
    n_blocks = qq.num_q_blocks
    block_end = n_blocks if block_end is None else block_end
    if not (0 <= block_start <= block_end <= n_blocks):
        raise ValueError(f"need 0 <= block_start <= block_end <= {n_blocks}, got {block_start}, {block_end}")
    b, h = qq.q_mean.shape[:2]
    skp = qq.k_data.shape[2]
    shape = (b, h, block_end - block_start, skp)
    device = qq.q_mean.device
    if out is None:
        out = fmt.Correction(torch.empty(shape, dtype=torch.float16, device=device),
                             torch.empty(*shape[:3], skp // fmt.SEQ_TILE, dtype=torch.float32, device=device))
    elif (not isinstance(out, fmt.Correction) or tuple(out.values.shape) != shape
          or out.values.dtype != torch.float16 or not out.values.is_contiguous() or out.values.device != device
          or tuple(out.factors.shape) != (*shape[:3], skp // fmt.SEQ_TILE) or out.factors.dtype != torch.float32
          or not out.factors.is_contiguous()):
        raise ValueError(f"out must be a format.Correction of contiguous fp16 values {list(shape)} and fp32 factors "
                         f"{[*shape[:3], skp // fmt.SEQ_TILE]} on {device}")
    key_bias = checked_key_bias(key_bias, b, h, qq.seq_k, device)
    if key_bias is not None and scale is None:
        raise ValueError("scale is needed with key_bias (the bias is in units of the scaled scores)")
    if block_end > block_start:
        dk = launch.device_kernels(device)
        launch.ensure_current(dk.index)
        launch.launch_correction(dk, qq.workspace, qq.k_input, _lens(qq.kv_lens), key_bias,
                                 1.0 if scale is None else scale, block_start, block_end - block_start,
                                 launch.CorrectionAddress.of(out), launch.current_stream(dk.index), k_order=qq.order)
    return out


def checked_key_bias(key_bias: Optional[torch.Tensor], b: int, h: int, sk: int, device) -> Optional[torch.Tensor]:
    """``key_bias`` as the kernels read it: fp32 [B, H or 1, Sk] on ``device`` with a contiguous last dim."""
    if key_bias is None:
        return None
    if (not isinstance(key_bias, torch.Tensor) or key_bias.dtype != torch.float32 or key_bias.dim() != 3
            or key_bias.shape[0] != b or key_bias.shape[1] not in (1, h) or key_bias.shape[2] != sk
            or key_bias.device != device):
        raise ValueError(f"key_bias must be a float32 [{b}, {h} or 1, {sk}] tensor on {device}")
    return key_bias if key_bias.stride(2) == 1 else key_bias.contiguous()


def _lens(kv_lens: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if kv_lens is None else kv_lens.contiguous()


def iter_corrections(qq: fmt.QuantizedQKV, budget: Union[int, str, None] = None,
                     block_range: Optional[tuple[int, int]] = None, *, key_bias: Optional[torch.Tensor] = None,
                     scale: Optional[float] = None) -> Iterator[tuple[int, int, fmt.Correction]]:
    """Yield ``(begin, end, delta)`` over the Q blocks of ``block_range`` (default all), one chunk
    of at most ``budget`` bytes at a time (consume each delta, a :class:`~nvfp4_dit.format.Correction`,
    before asking for the next).

    ``qq`` from :func:`quantize_qkv` gets the CUDA correction, written into one reused buffer; a
    :class:`~nvfp4_dit.format.QuantizedQKV` from :func:`nvfp4_dit.preprocess.quantize_qkv` (it
    carries ``k_smoothed``) gets :func:`nvfp4_dit.preprocess.correction`. ``key_bias`` and
    ``scale``: a per-key mask in the correction (:func:`correction`).
    """
    first, last = (0, qq.num_q_blocks) if block_range is None else block_range
    b, h = qq.q_mean.shape[:2]
    skp = qq.k_data.shape[2]
    chunks = [(b0 + first, b1 + first) for b0, b1 in correction_chunks(last - first, b, h, skp, budget)]
    if not chunks:
        return
    if not isinstance(qq, KernelQuantizedQKV):
        for b0, b1 in chunks:
            yield b0, b1, preprocess.correction(qq, b0, b1, key_bias=key_bias, scale=scale)
        return
    rows = max(b1 - b0 for b0, b1 in chunks)
    device = qq.q_mean.device
    values = torch.empty(b * h * rows * skp, dtype=torch.float16, device=device)
    factors = torch.empty(b * h * rows * skp // fmt.SEQ_TILE, dtype=torch.float32, device=device)
    for b0, b1 in chunks:
        n = b1 - b0   # each chunk's rows contiguous at the start of the one buffer
        out = fmt.Correction(values[: b * h * n * skp].view(b, h, n, skp),
                             factors[: b * h * n * skp // fmt.SEQ_TILE].view(b, h, n, skp // fmt.SEQ_TILE))
        yield b0, b1, correction(qq, b0, b1, out=out, key_bias=key_bias, scale=scale)
