"""The ``cuda`` back-end of :func:`nvfp4_dit.attention`: quantise, then the attention kernel.

The kernel (``csrc/attention/``) is one template with two MMA kinds: the native block-scaled FP4
``mma.sync`` on sm_120/sm_121 and an emulated one on sm_80/sm_90 that reproduces it with fp16
``mma.sync`` from the same registers (:func:`nvfp4_dit.cuda.build.mma_kind`). ``backend="auto"``
takes this back-end only where the MMA is native (:mod:`nvfp4_dit.planner`), since the emulation
is slower than exact SDPA.

One call: one workspace allocation (the quantised operands, their statistics, the smoothing basis
and the key projections; :class:`~nvfp4_dit.cuda.launch.Workspace`), one memset, the output (and
LSE) allocations, and the launches: the quantiser's, then one attention launch over every Q block
(dense), or per group of Q blocks the block map, its lists and an attention launch (block-sparse).
The kernel forms the Q-smoothing correction of each key tile from the key projections and the Q
block's coefficients (:mod:`nvfp4_dit.smoothing`): nothing of size (Q blocks) x (keys) exists. A
NaN/inf input poisons its rows inside the kernel. Nothing synchronises with the host.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import format as fmt
from .. import preprocess
from .. import smoothing
from .. import sparse as sp
from . import block_lists, build, launch, quantize


def unsupported_reason(q, k, v, *, layout: str, require_native: bool) -> Optional[str]:
    """Why the kernel cannot run this call (a sentence), or None if it can. Causal attention, key
    lengths and per-key masks are supported in every combination."""
    if q.device.type != "cuda" or k.device != q.device or v.device != q.device:
        return "tensors are not all on one CUDA device"
    if q.dtype not in launch.DTYPE_NAMES:
        return f"dtype {q.dtype} is not supported"
    qh, kh, vh = (fmt.to_hnd(t, layout) for t in (q, k, v))
    d = qh.shape[-1]
    if fmt.padded_head_dim(d) is None:
        return f"head dim {d} > {fmt.SUPPORTED_HEAD_DIMS[-1]}"
    if vh.shape[-1] != d or kh.shape[-1] != d:
        return "q, k and v head dims differ"
    if kh.shape[1] == 0 or qh.shape[1] % kh.shape[1]:
        return f"{qh.shape[1]} query heads are not a multiple of {kh.shape[1]} kv heads"
    if max(qh.shape[2], kh.shape[2]) >= 2**31 - 256:
        return "sequence too long for 32-bit token indices"
    return device_unsupported_reason(q.device, require_native)


def device_unsupported_reason(device: torch.device, require_native: bool) -> Optional[str]:
    """Why the kernel cannot run on this CUDA device (no kernel for its architecture, not native
    where ``require_native``, the kernels not loadable), or None."""
    cc = build.device_capability(device)
    kind = build.mma_kind(cc)
    if kind is None:
        return f"no kernel for sm_{cc[0]}{cc[1]} (native MMA: sm_120/121, emulated: sm_80..sm_90)"
    if require_native and kind != "native":
        return (f"sm_{cc[0]}{cc[1]} has no native FP4 MMA (only sm_120/sm_121 do); the emulated kernel is "
                f"slower than exact SDPA, use backend='cuda' to run it anyway")
    return build.unavailable_reason(device)


_PLANES = ("q_data", "q_sf", "k_data", "k_sf", "vt_data", "vt_sf", "q_dot_km", "q_scale", "k_scale", "v_scale",
           "v_mean", "q_coeff", "key_proj", "key_proj_factor", "nonfinite_q", "nonfinite_kv")


def _workspace_planes(ws: launch.Workspace) -> dict:
    regions = ws.layout.regions
    return {name: (ws.base + regions[name].offset, regions[name].shape) for name in _PLANES}


def _tensor_planes(qq: fmt.QuantizedQKV, projections: smoothing.KeyProjections, nonfinite: tuple) -> tuple[dict, list]:
    """The planes of a QuantizedQKV of tensors with low-rank smoothing and its key projections
    (dense, as the kernel reads them), and the tensors that must outlive the launches."""
    if qq.q_coeff is None:
        raise ValueError("the attention kernel reads the low-rank smoothing's coefficients (q_coeff): quantise with "
                         "nvfp4_dit.preprocess.quantize_qkv or nvfp4_dit.cuda.quantize.quantize_qkv")
    keep = []

    def plane(t):
        t = t.contiguous()
        keep.append(t)
        return t.data_ptr(), tuple(t.shape)

    planes = {name: plane(getattr(qq, name)) for name in _PLANES[:12]}
    planes["key_proj"] = plane(projections.values)
    planes["key_proj_factor"] = plane(projections.factors)
    planes["nonfinite_q"] = plane(nonfinite[0].to(torch.int32))
    planes["nonfinite_kv"] = plane(nonfinite[1].to(torch.int32))
    return planes, keep


def _output(q: torch.Tensor, layout: str, b: int, h: int, sq: int, d: int):
    out_dtype = q.dtype if q.dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
    if layout == "NHD":
        out = torch.empty(b, sq, h, d, dtype=out_dtype, device=q.device)
        return out, out.transpose(1, 2)
    out = torch.empty(b, h, sq, d, dtype=out_dtype, device=q.device)
    return out, out


def attention(q, k, v, *, layout: str, causal: bool, scale: Optional[float], kv_lens: Optional[torch.Tensor],
              return_lse: bool, balance_qk: bool = fmt.BALANCE_QK_DEFAULT, qk_format: str = fmt.QK_FORMAT_DEFAULT,
              key_bias: Optional[torch.Tensor] = None, mask_nonfinite: Optional[torch.Tensor] = None,
              quantizer: str = "cuda", sparsity: Optional[sp.Sparsity] = None, order=None):
    """NVFP4 attention on the GPU; the caller has validated the arguments (:func:`nvfp4_dit.attention`)
    and made the device's kernels loadable (:func:`unsupported_reason`).

    ``kv_lens``: int32/int64 [B] on the device (values are clamped to [0, Sk] by the kernels);
    ``key_bias``: fp32 [B, H or 1, Sk] per-key mask in units of the scaled scores and
    ``mask_nonfinite``: bool [B], a NaN/+inf in that batch's mask (:class:`nvfp4_dit.masks.KeyMask`).
    ``quantizer``: "cuda" (the CUDA quantiser) or "torch" (:func:`nvfp4_dit.preprocess.quantize_qkv`
    on the GPU: the reference's own bytes, for tests). ``sparsity``: a block-sparse call
    (:mod:`nvfp4_dit.sparse`): per group of Q blocks the block map is estimated from the
    quantiser's statistics and listed on the device, and the kernel visits only the listed tiles.
    ``order``: a video call's :class:`~nvfp4_dit.token_order.TokenOrder`: the quantiser reads the
    inputs in tile order and the kernel writes the output
    rows back to the caller's (``kv_lens``, ``key_bias`` and the map are in tile order already).
    Inputs the quantiser cannot read as 16-byte vectors are copied first, their head dim zero-padded
    to 64 or 128 (:func:`~nvfp4_dit.cuda.launch.vector_readable`).

    Returns ``(out [q's layout and dtype], lse [B, H, Sq] fp32 or None)``. Rows whose Q block or
    kv head met a NaN/inf input (or whose batch's mask holds NaN/+inf) are NaN.
    """
    qh, kh, vh, read_order = launch.inputs_in_order(order, *(fmt.to_hnd(t, layout) for t in (q, k, v)),
                                                    copy=quantizer == "torch")
    b, h, sq, d = qh.shape
    sk = kh.shape[2]
    scale = fmt.default_scale(d) if scale is None else float(scale)
    dk = launch.device_kernels(q.device)
    launch.ensure_current(dk.index)
    stream = launch.current_stream(dk.index)
    lens = None if kv_lens is None else (kv_lens if kv_lens.dtype == torch.int32 else kv_lens.to(torch.int32))
    nq = fmt.round_up(max(sq, 1), fmt.SEQ_TILE) // fmt.SEQ_TILE
    bias = quantize.checked_key_bias(key_bias, b, h, sk, q.device)
    if quantizer == "cuda":
        ws = launch.Workspace(quantize.workspace_layout(qh, kh, balance_qk, qk_format), q.device)
        ws.clear(stream)
        qr, kr, vr = (launch.vector_readable(t, fmt.padded_head_dim(d)) for t in (qh, kh, vh))
        launch.launch_quantize(dk, ws, qr, kr, vr, lens, balance_qk, qk_format, stream, order=read_order,
                               key_bias=bias, scale=scale)
        planes = _workspace_planes(ws)
        if mask_nonfinite is not None:
            ws.view("nonfinite_kv").bitwise_or_(mask_nonfinite[:, None].to(torch.int32))
    elif quantizer == "torch":
        qq = preprocess.quantize_qkv(qh, kh, vh, layout="HND", kv_lens=kv_lens, balance_qk=balance_qk,
                                     qk_format=qk_format)
        projections = smoothing.key_projections(qq.k_smoothed, qq.smoothing_basis(), key_bias=bias, scale=scale)
        q_bad, kv_bad = preprocess.nonfinite_blocks(qh, kh, vh, kv_lens, "HND")
        if mask_nonfinite is not None:
            kv_bad = kv_bad | mask_nonfinite[:, None]
        planes, keep = _tensor_planes(qq, projections, (q_bad, kv_bad))
    else:
        raise ValueError(f"quantizer must be 'cuda' or 'torch', got {quantizer!r}")
    out, out_hnd = _output(q, layout, b, h, sq, d)
    lse = torch.empty(b, h, sq, dtype=torch.float32, device=q.device) if return_lse else None
    if sparsity is None:
        launch.launch_attention(dk, planes, sq, sk, 0, nq, out_hnd, lse, lens, scale, causal, qk_format, stream,
                                out_order=order)
    else:
        # the block map and its lists in groups of Q blocks of bounded size, a launch per group
        tile_grid = sp.TileGrid(b, h, sq, sk, scale, causal, lens, bias)
        if quantizer == "cuda":
            stats = sp.BlockStatistics(ws.view("q_mean"), ws.view("k_tile_mean"), ws.view("q_similarity"))
            by_group = block_lists.lists_by_group(dk, stats, sparsity, tile_grid, stream) \
                if block_lists.supported(tile_grid) else sp.lists_by_group(stats, sparsity, tile_grid)
        else:
            by_group = sp.lists_by_group(sp.BlockStatistics.of(qq), sparsity, tile_grid)
        for (b0, b1), _, lists in by_group:
            launch.launch_attention(dk, planes, sq, sk, b0, b1, out_hnd, lse, lens, scale, causal, qk_format,
                                    stream, lists=lists, out_order=order)
    if out.dtype != q.dtype:
        out = out.to(q.dtype)
    return out, lse


def run_kernel(qq: fmt.QuantizedQKV, projections: smoothing.KeyProjections, out_hnd: torch.Tensor,
               lse: Optional[torch.Tensor], *, scale: float, causal: bool, kv_lens: Optional[torch.Tensor],
               nonfinite: Optional[tuple] = None) -> None:
    """The attention kernel alone on quantised operands (tests, benchmarks), one launch over every Q
    block.

    ``qq``: from :func:`nvfp4_dit.cuda.quantize.quantize_qkv` or
    :func:`nvfp4_dit.preprocess.quantize_qkv` on the GPU;
    ``projections`` its key projections (``qq.key_projections`` of the CUDA quantiser, or
    :func:`nvfp4_dit.smoothing.key_projections`); ``out_hnd`` a ``[B, H, Sq, D]`` view (any
    batch/head/row strides, last dim contiguous) written in place, as is ``lse [B, H, Sq]``;
    ``nonfinite`` the ``(q_blocks, kv)`` flags that poison rows (default: those of ``qq``, else none).
    """
    device = qq.q_data.device
    b, h = qq.q_scale.shape[:2]
    if nonfinite is None:
        nonfinite = getattr(qq, "nonfinite", None) or (
            torch.zeros(qq.q_scale.shape, dtype=torch.bool, device=device),
            torch.zeros(qq.k_scale.shape, dtype=torch.bool, device=device))
    skp = qq.k_data.shape[2]
    if (not isinstance(projections, smoothing.KeyProjections)
            or tuple(projections.values.shape) != (b, h, skp, smoothing.KEY_PROJECTION_COLUMNS)
            or projections.values.dtype != torch.float16
            or tuple(projections.factors.shape) != (b, h, skp // fmt.SEQ_TILE)):
        raise ValueError(f"projections must be smoothing.KeyProjections of fp16 [{b}, {h}, {skp}, "
                         f"{smoothing.KEY_PROJECTION_COLUMNS}] values and [{b}, {h}, {skp // fmt.SEQ_TILE}] factors")
    planes, keep = _tensor_planes(qq, projections, nonfinite)
    if out_hnd.dim() != 4 or tuple(out_hnd.shape[:3]) != (b, h, qq.seq_q) or out_hnd.stride(3) != 1 \
            or out_hnd.dtype not in (torch.bfloat16, torch.float16) or out_hnd.shape[3] > qq.head_dim_padded:
        raise ValueError(f"out must be a bf16/fp16 [{b}, {h}, {qq.seq_q}, <= {qq.head_dim_padded}] view with a "
                         f"contiguous last dim, got {out_hnd.dtype} {tuple(out_hnd.shape)}")
    if lse is not None and (lse.dtype != torch.float32 or tuple(lse.shape) != (b, h, qq.seq_q) or lse.stride(2) != 1):
        raise ValueError(f"lse must be float32 [{b}, {h}, {qq.seq_q}] with a contiguous last dim")
    lens = None if kv_lens is None else kv_lens.to(device=device, dtype=torch.int32).contiguous()
    dk = launch.device_kernels(device)
    launch.ensure_current(dk.index)
    stream = launch.current_stream(dk.index)
    launch.launch_attention(dk, planes, qq.seq_q, qq.seq_k, 0, qq.num_q_blocks, out_hnd, lse, lens, scale, causal,
                            qq.qk_format, stream)
    del keep
