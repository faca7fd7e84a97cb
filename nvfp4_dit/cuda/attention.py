"""The ``cuda`` back-end of :func:`nvfp4_dit.attention`: quantise, correction chunks, kernel launches.

The kernel (``csrc/attention/``) is one template with two MMA kinds: the native block-scaled FP4
``mma.sync`` on sm_120/sm_121 and an emulated one on sm_80/sm_90 that reproduces it with fp16
``mma.sync`` from the same registers (:func:`nvfp4_dit.cuda.build.mma_kind`). ``backend="auto"`` in
:mod:`nvfp4_dit.ops` takes this back-end only where the MMA is native, since the emulation is
slower than exact SDPA.

The correction ``delta = qm . k_s^T`` is ``[B, H, Sq/128, Skp]`` fp32, 6.7 GiB per batch element
at 75k tokens and 40 heads, so it comes in chunks of Q blocks within a memory budget
(:func:`nvfp4_dit.cuda.quantize.iter_corrections`) and the kernel runs once per chunk, writing those
rows of the output in place.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import build
from .. import format as fmt
from .. import preprocess
from . import launch as kernels
from . import quantize


def unsupported_reason(q, k, v, *, layout: str, require_native: bool) -> Optional[str]:
    """Why the kernel cannot run this call (a sentence), or None if it can. Causal attention and
    key lengths are supported in every combination."""
    if q.device.type != "cuda" or k.device != q.device or v.device != q.device:
        return "tensors are not all on one CUDA device"
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
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
    cc = build.device_capability(q.device)
    kind = build.mma_kind(cc)
    if kind is None:
        return f"no kernel for sm_{cc[0]}{cc[1]} (native MMA: sm_120/121, emulated: sm_80..sm_90)"
    if require_native and kind != "native":
        return (f"sm_{cc[0]}{cc[1]} has no native FP4 MMA (only sm_120/sm_121 do); the emulated kernel is "
                f"slower than exact SDPA, use backend='cuda' to run it anyway")
    return build.unavailable_reason(q.device)


def run_kernel(qq: fmt.QuantizedQKV, corrections, out_hnd: torch.Tensor, lse: Optional[torch.Tensor], *,
               scale: float, causal: bool, kv_lens: Optional[torch.Tensor], native: bool) -> None:
    """Launch the kernel once per ``(begin, end, delta)`` chunk of Q blocks in ``corrections``.

    ``out_hnd`` is a ``[B, H, Sq, D]`` view (any batch/head/row strides) written in place, as is
    ``lse [B, H, Sq]``; each launch writes the rows of its Q blocks. ``native`` picks the MMA kind.
    """
    lens = None if kv_lens is None else kv_lens.to(device=out_hnd.device, dtype=torch.int32).contiguous()
    scales = (qq.q_scale.contiguous(), qq.k_scale.contiguous(), qq.v_scale.contiguous(), qq.v_mean.contiguous())
    for b0, b1, delta in corrections:
        if delta.stride(-1) != 1 or delta.data_ptr() % 16 or any(s % 4 for s in delta.stride()[:3]):
            delta = delta.contiguous()
        kernels.attention_fwd(qq.q_data, qq.q_sf, qq.k_data, qq.k_sf, qq.vt_data, qq.vt_sf, delta, qq.q_dot_km, *scales,
                              lens, out_hnd, lse, qq.seq_q, qq.seq_k, b0, b1, float(scale), bool(causal), bool(native),
                              qq.qk_format)
        del delta


def attention(q, k, v, *, layout, causal, scale, kv_lens, return_lse, balance_qk: bool = fmt.BALANCE_QK_DEFAULT,
              qk_format: str = fmt.QK_FORMAT_DEFAULT, quantizer: str = "cuda"):
    """NVFP4 attention on the GPU; the caller has validated the arguments (:func:`nvfp4_dit.attention`).

    ``quantizer``: "cuda" (:func:`nvfp4_dit.cuda.quantize.quantize_qkv`) or "torch"
    (:func:`nvfp4_dit.preprocess.quantize_qkv` on the GPU: the reference's own bytes, for tests).

    Returns ``(out [q's layout and dtype], lse [B, H, Sq] or None, nonfinite)``: ``nonfinite`` is
    the ``(q_blocks [B, H, nblk], kv [B, Hkv])`` NaN/inf flags of
    :func:`nvfp4_dit.preprocess.nonfinite_blocks`. The output is not poisoned here;
    :mod:`nvfp4_dit.ops` does that for every FP4 back-end alike.
    """
    reason = build.unavailable_reason(q.device)
    if reason is not None:
        raise RuntimeError(reason)
    if quantizer not in ("cuda", "torch"):
        raise ValueError(f"quantizer must be 'cuda' or 'torch', got {quantizer!r}")
    qh = fmt.to_hnd(q, layout)
    b, h, sq, d = qh.shape
    scale = fmt.default_scale(d) if scale is None else float(scale)
    native = build.is_native(build.device_capability(q.device))
    if quantizer == "cuda":
        qq = quantize.launch_quantize_qkv(q, k, v, layout=layout, kv_lens=kv_lens, balance_qk=balance_qk,
                                          qk_format=qk_format)
        nonfinite = qq.nonfinite
    else:
        qq = preprocess.quantize_qkv(q, k, v, layout=layout, kv_lens=kv_lens, balance_qk=balance_qk, qk_format=qk_format)
        nonfinite = preprocess.nonfinite_blocks(q, k, v, kv_lens, layout)
    out_dtype = q.dtype if q.dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
    if layout == "NHD":
        out = torch.empty(b, sq, h, d, dtype=out_dtype, device=q.device)
        out_hnd = out.transpose(1, 2)
    else:
        out = torch.empty(b, h, sq, d, dtype=out_dtype, device=q.device)
        out_hnd = out
    lse = torch.empty(b, h, sq, dtype=torch.float32, device=q.device) if return_lse else None
    run_kernel(qq, quantize.iter_corrections(qq), out_hnd, lse, scale=scale, causal=causal, kv_lens=kv_lens,
               native=native)
    if out.dtype != q.dtype:
        out = out.to(q.dtype)
    return out, lse, nonfinite
