"""The CUDA back-end of :func:`nvfp4_dit.attention`: quantise, correction in bounded chunks, kernel.

The kernel (``csrc/attention/``) has two MMA back-ends in one template: the native block-scaled
FP4 ``mma.sync`` on sm_120/sm_121 and an fp16-emulated one on sm_80/sm_90 that reproduces it from
the same registers. :func:`attention` picks native where the hardware has it and the emulated
build elsewhere; ``backend="auto"`` in :mod:`nvfp4_dit.ops` asks for native only
(``require_native=True``), since the emulation is slower than exact SDPA.

The correction ``delta = qm . k_s^T`` is ``[B, H, Sq/128, Skp]`` fp32, 6.7 GiB per batch element
at 75k tokens and 40 heads. It is computed for a chunk of Q blocks at a time, within
``NVFP4_DIT_CORRECTION_BUDGET`` bytes (default 1 GiB), and the kernel runs once per chunk,
writing those rows of the output in place.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Optional

import torch

from . import format as fmt

_SOURCES = (
    "attention_binding.cpp",
    "attention_fwd_dispatch.cu",
    "attention_fwd_sm120a_d64.cu",
    "attention_fwd_sm120a_d128.cu",
    "attention_fwd_emulated_d64.cu",
    "attention_fwd_emulated_d128.cu",
)
_NATIVE_CC = ((12, 0), (12, 1))
_DEFAULT_CORRECTION_BUDGET = 1 << 30

_lock = threading.Lock()
_loaded: dict[tuple[int, int], Optional[str]] = {}   # cc -> None (loaded) or the failure


def csrc_dir() -> Path:
    """The kernel sources: ``nvfp4_dit/_csrc`` in a wheel, ``csrc/`` in a checkout."""
    here = Path(__file__).resolve().parent
    for cand in (here / "_csrc", here.parent / "csrc"):
        if (cand / "attention" / "kernel.cuh").is_file():
            return cand
    raise FileNotFoundError("nvfp4_dit kernel sources (csrc/attention) not found")


def gencode_flags(cc: tuple[int, int]) -> list[str]:
    """nvcc target flags for one compute capability (arch-specific 'a' targets where needed)."""
    major, minor = cc
    if cc in _NATIVE_CC:
        # The block-scaled FP4 mma needs the arch-specific target (plain sm_120 rejects it).
        arch = f"{major}{minor}a"
    elif cc == (9, 0):
        arch = "90a"
    else:
        arch = f"{major}{minor}"
    return [f"-gencode=arch=compute_{arch},code=sm_{arch}"]


def is_native(cc: tuple[int, int]) -> bool:
    return tuple(cc) in _NATIVE_CC


def has_emulated(cc: tuple[int, int]) -> bool:
    return (8, 0) <= tuple(cc) < (10, 0)


def _build_standalone(cc: tuple[int, int]) -> None:
    """Build only the attention sources (when the project's extension cannot be built here)."""
    from torch.utils import cpp_extension

    src = csrc_dir()
    cpp_extension.load(
        name=f"nvfp4_dit_attention_sm{cc[0]}{cc[1]}",
        sources=[str(src / s) for s in _SOURCES],
        extra_include_paths=[str(src)],
        extra_cflags=["-O3"],
        extra_cuda_cflags=["-O3", "-lineinfo", *gencode_flags(cc)],
        is_python_module=False,
        verbose=os.environ.get("NVFP4_DIT_VERBOSE_BUILD") == "1",
    )


def load(device: Optional[torch.device] = None) -> Optional[str]:
    """Build (once per compute capability) and load the kernel; None on success, else why not.

    The kernel normally comes with the project's one extension (:mod:`nvfp4_dit.jit` builds every
    ``csrc/*.cu``); if that build fails, the attention sources alone are built so the kernel
    stays usable, and the first error is kept in the reason if that fails too.
    """
    cc = torch.cuda.get_device_capability(device)
    with _lock:
        if cc not in _loaded:
            first_error = None
            try:
                from . import jit

                jit.load_extension()
            except Exception as exc:  # noqa: BLE001 - any build failure is a reason to fall back
                first_error = exc
            if first_error is None and hasattr(torch.ops.nvfp4_dit_cuda, "attention_fwd"):
                _loaded[cc] = None
            else:
                try:
                    _build_standalone(cc)
                    _loaded[cc] = None
                except Exception as exc:  # noqa: BLE001
                    _loaded[cc] = (f"the CUDA kernel failed to build for sm_{cc[0]}{cc[1]}: {exc}"
                                   + (f" (project extension: {first_error})" if first_error else ""))
        return _loaded[cc]


def unsupported_reason(q, k, v, *, layout, causal, kv_lens, attn_mask_kind, require_native) -> Optional[str]:
    """Why the kernel cannot run this call (a sentence), or None if it can."""
    del causal, kv_lens  # both supported in every combination
    if q.device.type != "cuda" or k.device != q.device or v.device != q.device:
        return "tensors are not all on one CUDA device"
    if attn_mask_kind not in (None, "key_padding"):
        return f"attn_mask kind {attn_mask_kind!r} is not supported by the kernel"
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
    cc = torch.cuda.get_device_capability(q.device)
    if require_native and not is_native(cc):
        return (f"sm_{cc[0]}{cc[1]} has no native FP4 MMA (only sm_120/sm_121 do); the emulated "
                f"kernel is slower than exact SDPA, use backend='cuda' to run it anyway")
    if not is_native(cc) and not has_emulated(cc):
        return f"no kernel build for sm_{cc[0]}{cc[1]} (native: sm_120/121, emulated: sm_80..sm_90)"
    return load(q.device)


def correction_budget_bytes() -> int:
    return int(os.environ.get("NVFP4_DIT_CORRECTION_BUDGET", _DEFAULT_CORRECTION_BUDGET))


def torch_corrections(qq: fmt.QuantizedQKV, budget_bytes: Optional[int] = None,
                      block_range: Optional[tuple[int, int]] = None):
    """Yield ``(begin, end, delta)`` chunks of :func:`nvfp4_dit.format.qk_correction` within the budget."""
    b, h = qq.q_data.shape[:2]
    skp = qq.k_data.shape[2]
    first, last = block_range if block_range is not None else (0, qq.num_q_blocks)
    budget = correction_budget_bytes() if budget_bytes is None else budget_bytes
    step = max(1, budget // max(b * h * skp * 4, 1))
    for b0 in range(first, last, step):
        b1 = min(last, b0 + step)
        yield b0, b1, fmt.qk_correction(qq, b0, b1)


def _fused_quantizer():
    try:
        from . import cuda_quantize
    except ImportError:
        return None
    return cuda_quantize if hasattr(cuda_quantize, "quantize_qkv_cuda") else None


def quantize(q, k, v, *, layout, kv_lens, quantizer: str = "auto"):
    """``(QuantizedQKV, correction chunks)``: the fused CUDA quantiser when present (``auto`` or
    ``cuda``), else (or with ``torch``) :func:`nvfp4_dit.format.quantize_qkv` on the GPU."""
    if quantizer not in ("auto", "cuda", "torch"):
        raise ValueError(f"quantizer must be 'auto', 'cuda' or 'torch', got {quantizer!r}")
    fused = None if quantizer == "torch" else _fused_quantizer()
    if fused is None and quantizer == "cuda":
        raise RuntimeError("the fused CUDA quantiser (nvfp4_dit.cuda_quantize) is not available")
    if fused is not None:
        qq = fused.quantize_validated(q, k, v, layout=layout, kv_lens=kv_lens)
        return qq, fused.iter_qk_corrections(qq)
    qq = fmt.quantize_qkv(q, k, v, layout=layout, kv_lens=kv_lens)
    return qq, torch_corrections(qq)


def run_kernel(qq: fmt.QuantizedQKV, corrections, out_hnd: torch.Tensor, lse: Optional[torch.Tensor], *,
               scale: float, causal: bool, kv_lens: Optional[torch.Tensor], native: bool) -> None:
    """Launch the kernel once per ``(begin, end, delta)`` chunk of Q blocks in ``corrections``.

    ``out_hnd`` is a ``[B, H, Sq, D]`` view (any batch/head/row strides) written in place, as is
    ``lse [B, H, Sq]``; each launch writes the rows of its Q blocks.
    """
    lens = None if kv_lens is None else kv_lens.to(device=out_hnd.device, dtype=torch.int32).contiguous()
    op = torch.ops.nvfp4_dit_cuda.attention_fwd
    for b0, b1, delta in corrections:
        if delta.stride(-1) != 1 or delta.data_ptr() % 16 or any(s % 4 for s in delta.stride()[:3]):
            delta = delta.contiguous()
        op(qq.q_data, qq.q_sf, qq.k_data, qq.k_sf, qq.vt_data, qq.vt_sf, delta, qq.q_dot_km, lens,
           out_hnd, lse, qq.seq_q, qq.seq_k, b0, b1, float(scale), bool(causal), bool(native))
        del delta


def attention(q, k, v, *, layout, causal, scale, kv_lens, return_lse, quantizer: str = "auto"):
    """NVFP4 attention on the GPU.

    Returns ``(out [q's layout and dtype], lse [B, H, Sq] or None, nonfinite)``: ``nonfinite`` is
    the ``(q_blocks [B, H, nblk], kv [B, Hkv])`` NaN/inf flags of
    :func:`nvfp4_dit.format.nonfinite_blocks` (the fused quantiser raises them as it goes). The
    output is not poisoned here; :mod:`nvfp4_dit.ops` does that for every FP4 back-end alike.
    The caller has validated the arguments (:func:`nvfp4_dit.attention` does).
    """
    reason = load(q.device)
    if reason is not None:
        raise RuntimeError(reason)
    qh = fmt.to_hnd(q, layout)
    b, h, sq, d = qh.shape
    scale = fmt.default_scale(d) if scale is None else float(scale)
    native = is_native(torch.cuda.get_device_capability(q.device))
    qq, corrections = quantize(q, k, v, layout=layout, kv_lens=kv_lens, quantizer=quantizer)
    out_dtype = q.dtype if q.dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
    if layout == "NHD":
        out = torch.empty(b, sq, h, d, dtype=out_dtype, device=q.device)
        out_hnd = out.transpose(1, 2)
    else:
        out = torch.empty(b, h, sq, d, dtype=out_dtype, device=q.device)
        out_hnd = out
    lse = torch.empty(b, h, sq, dtype=torch.float32, device=q.device) if return_lse else None
    run_kernel(qq, corrections, out_hnd, lse, scale=scale, causal=causal, kv_lens=kv_lens, native=native)
    if out.dtype != q.dtype:
        out = out.to(q.dtype)
    nonfinite = getattr(qq, "nonfinite", None)
    if nonfinite is None:  # format.quantize_qkv keeps no flags
        nonfinite = fmt.nonfinite_blocks(q, k, v, kv_lens, layout)
    return out, lse, nonfinite
