"""The CUDA kernels as Python functions on torch tensors: checks, parameter structs, launches.

The host side of ``csrc/``: each function checks its tensors (ValueError naming the argument),
fills the kernel's parameter structure (:mod:`nvfp4_dit.cuda.abi`), picks the instantiation
(input dtype, padded head dim, vector or scalar loads, Q·Kᵀ format, MMA kind), sizes the grid and
launches on torch's current stream through the driver (:mod:`nvfp4_dit.cuda.driver`). Nothing here
synchronises or copies to the host, so every call can be captured into a CUDA graph. The kernels
must be loaded for the tensors' device first (:func:`nvfp4_dit.cuda.build.unavailable_reason`).

These are building blocks for :mod:`nvfp4_dit.cuda.quantize` and :mod:`nvfp4_dit.cuda.attention`; the
public op is :func:`nvfp4_dit.attention`.
"""

from __future__ import annotations

import ctypes
from typing import Optional

import torch

from . import build
from . import driver
from .. import format as fmt
from . import abi

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
_MAX_GRID_X = 0x7FFFFFFF
_MAX_GRID_YZ = 65535


def _kernel(device: torch.device, name: str) -> driver.Kernel:
    return build.library_for(device).kernel(name, build.device_index(device))


# torch's current stream as a raw handle (what torch.compile's generated code reads); the public
# torch.cuda.current_stream builds a Stream object on every call.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _stream(device: torch.device) -> int:
    index = build.device_index(device)
    return _raw_stream(index) if _raw_stream is not None else torch.cuda.current_stream(index).cuda_stream


def _sms(device: torch.device) -> int:
    return driver.device_attribute(build.device_index(device), "MULTIPROCESSOR_COUNT")


def _ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


def _check(condition: bool, message: str, *args) -> None:
    """ValueError(message.format(*args)) unless ``condition``. The message is formatted only on
    failure: a call passes some fifty checks, and formatting shapes and dtypes every time would
    cost more host time than the launches."""
    if not condition:
        raise ValueError(message.format(*(list(a) if isinstance(a, torch.Size) else a for a in args)))


def _strided(t: torch.Tensor) -> abi.StridedInput:
    return abi.StridedInput(t.data_ptr(), *t.stride())


def _vector_loads(t: torch.Tensor, head_dim_padded: int) -> bool:
    """Whether ``t`` [B, H, S, D] can be read as 16-byte vectors: D == Dp, unit stride along D and
    16-byte aligned rows (csrc/common/launch.h, the "vec" instantiations)."""
    per16 = 16 // t.element_size()
    b, h, s, _ = t.stride()
    return (t.shape[3] == head_dim_padded and t.stride(3) == 1 and t.data_ptr() % 16 == 0
            and b % per16 == 0 and h % per16 == 0 and s % per16 == 0)


def _round_up_128(n: int) -> int:
    return (max(n, 1) + 127) // 128 * 128


# ---------------------------------------------------------------------------------------------
# Quantisation of Q, K, V
# ---------------------------------------------------------------------------------------------

def quantize_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_lens: Optional[torch.Tensor],
                 balance_qk: bool, qk_format: str) -> list[torch.Tensor]:
    """Quantise logical [B, H, S, D] views (any strides; NHD callers pass a transposed view) in the
    kernel's layouts. Returns q_data, q_sf, k_data, k_sf, vt_data, vt_sf, q_mean, k_mean, v_mean,
    q_scale, k_scale, v_scale, balance, q_dot_km, nonfinite_q [B, H, Sqp/128], nonfinite_kv [B, Hkv]."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check(t.is_cuda and t.dim() == 4, "{} must be a 4-D [B, H, S, D] CUDA tensor", name)
        _check(t.dtype == q.dtype and t.device == q.device, "{} must share q's dtype and device", name)
    _check(q.dtype in _DTYPES, "inputs must be bfloat16, float16 or float32, got {}", q.dtype)
    b, h, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    _check(k.shape[0] == b and tuple(v.shape) == (b, hkv, sk, d) and k.shape[3] == d,
           "shape mismatch between q {}, k {}, v {}", q.shape, k.shape, v.shape)
    _check(hkv > 0 and h % hkv == 0, "q's {} heads are not a multiple of k's {}", h, hkv)
    dp = fmt.padded_head_dim(d)
    _check(dp is not None, "head dim must be in [1, {}], got {}", fmt.SUPPORTED_HEAD_DIMS[-1], d)
    if kv_lens is not None:
        _check(kv_lens.device == q.device and tuple(kv_lens.shape) == (b,) and kv_lens.dtype in (torch.int32, torch.int64),
               "kv_lens must be int32 or int64 [B] on the inputs' device")
        kv_lens = kv_lens.contiguous()
    per_byte, per_scale = (1, 32) if qk_format == "mxfp8" else (2, 16)
    sqp, skp = _round_up_128(sq), _round_up_128(sk)
    dev = q.device
    u8 = dict(dtype=torch.uint8, device=dev)
    f32 = dict(dtype=torch.float32, device=dev)
    q_data = torch.empty(b, h, sqp, dp // per_byte, **u8)
    q_sf = torch.empty(b, h, sqp, dp // per_scale, **u8)
    k_data = torch.empty(b, hkv, skp, dp // per_byte, **u8)
    k_sf = torch.empty(b, hkv, skp, dp // per_scale, **u8)
    vt_data = torch.empty(b, hkv, dp, skp // 2, **u8)
    vt_sf = torch.empty(b, hkv, dp, skp // 16, **u8)
    q_mean = torch.empty(b, h, sqp // 128, dp, **f32)
    k_mean, v_mean, balance = (torch.empty(b, hkv, dp, **f32) for _ in range(3))
    q_scale = torch.empty(b, h, sqp // 128, **f32)
    k_scale, v_scale = torch.empty(b, hkv, **f32), torch.empty(b, hkv, **f32)
    q_dot_km = torch.empty(b, h, sq, **f32)
    partial = torch.empty(abi.workspace_floats(b, hkv, sk, dp), **f32)
    # One zeroed int32 buffer (one memset): the work counters, the non-finite flags, then (balance_qk)
    # the channel statistics of Q.
    n_counters = abi.workspace_counters(b, hkv)
    n_flags = b * hkv + b * h * (sqp // 128)
    n_q_stats = b * hkv * dp if balance_qk else 0
    counters = torch.zeros(n_counters + n_flags + n_q_stats, dtype=torch.int32, device=dev)
    nonfinite_kv = counters[n_counters:n_counters + b * hkv].view(b, hkv)
    nonfinite_q = counters[n_counters + b * hkv:n_counters + n_flags].view(b, h, sqp // 128)

    dtype = _DTYPES[q.dtype]
    p = abi.QuantizeQkvParams(
        q=_strided(q), k=_strided(k), v=_strided(v), dtype=abi.INPUT_DTYPES[dtype], kv_lens=_ptr(kv_lens),
        kv_lens_int64=kv_lens is not None and kv_lens.dtype == torch.int64,
        batch=b, heads_q=h, heads_kv=hkv, seq_q=sq, seq_k=sk, head_dim=d, head_dim_padded=dp,
        seq_q_padded=sqp, seq_k_padded=skp,
        q_data=q_data.data_ptr(), q_sf=q_sf.data_ptr(), k_data=k_data.data_ptr(), k_sf=k_sf.data_ptr(),
        vt_data=vt_data.data_ptr(), vt_sf=vt_sf.data_ptr(), q_mean=q_mean.data_ptr(), k_mean=k_mean.data_ptr(),
        v_mean=v_mean.data_ptr(), q_scale=q_scale.data_ptr(), k_scale=k_scale.data_ptr(), v_scale=v_scale.data_ptr(),
        balance=balance.data_ptr(), q_dot_km=q_dot_km.data_ptr(), balance_qk=bool(balance_qk),
        q_channel_amax=counters[n_counters + n_flags:].data_ptr() if balance_qk else None,
        nonfinite_kv=nonfinite_kv.data_ptr(), nonfinite_q_blocks=nonfinite_q.data_ptr(),
        k_partial_sums=partial.data_ptr(), work_counters=counters.data_ptr())

    vector = all(_vector_loads(t, dp) for t in (q, k, v))
    stream = _stream(dev)
    kv_tiles = b * hkv * (skp // 128)
    q_tiles = b * h * (sqp // 128)
    with torch.cuda.device(dev):
        if balance_qk:  # the balance needs every row of Q before any K or Q tile
            _check(q_tiles <= _MAX_GRID_X, "too many Q tiles for one launch")
            _kernel(dev, abi.balance_statistics_entry(dtype, dp, vector)).launch(
                (q_tiles,), abi.QUANTIZE_THREADS, [p], stream)
        first = b * hkv * abi.STAT_TENSORS * abi.k_chunks(sk)
        second = 2 * kv_tiles + q_tiles
        _check(first <= _MAX_GRID_X and second <= _MAX_GRID_X, "too many tiles for one launch")
        _kernel(dev, abi.key_stats_entry(dtype, dp, vector)).launch((first,), abi.QUANTIZE_THREADS, [p], stream)
        tiles = _kernel(dev, abi.quantize_tiles_entry(dtype, dp, vector, qk_format))
        resident = _sms(dev) * tiles.blocks_per_sm(abi.QUANTIZE_THREADS)
        tiles.launch((second,), abi.QUANTIZE_THREADS, [p, ctypes.c_int64(abi.PREFETCH_WAVES * resident)], stream)
    return [q_data, q_sf, k_data, k_sf, vt_data, vt_sf, q_mean, k_mean, v_mean, q_scale, k_scale, v_scale, balance,
            q_dot_km, nonfinite_q, nonfinite_kv]


# ---------------------------------------------------------------------------------------------
# The correction term
# ---------------------------------------------------------------------------------------------

def correction(q_mean: torch.Tensor, k: torch.Tensor, k_mean: torch.Tensor, q_scale: torch.Tensor,
               k_scale: torch.Tensor, kv_lens: Optional[torch.Tensor], block_begin: int, out: torch.Tensor) -> None:
    """delta = qm . (k - km)^T / (q_scale k_scale) for Q blocks [block_begin, block_begin + out.shape[2])
    into ``out`` [B, H, n, Skp] fp32 (last dim contiguous), in one launch."""
    for name, t in (("q_mean", q_mean), ("k", k), ("k_mean", k_mean), ("q_scale", q_scale), ("k_scale", k_scale),
                    ("out", out)):
        _check(t.is_cuda and t.device == q_mean.device, "{} must be a CUDA tensor on q_mean's device", name)
    _check(q_mean.dtype == k_mean.dtype == out.dtype == torch.float32, "q_mean, k_mean and out must be float32")
    _check(q_mean.dim() == 4 and q_mean.is_contiguous(), "q_mean must be contiguous [B, H, nblk, Dp]")
    _check(k.dim() == 4 and k.dtype in _DTYPES, "k must be a bf16/fp16/fp32 4-D [B, Hkv, Sk, D] tensor")
    _check(k_mean.dim() == 3 and k_mean.is_contiguous(), "k_mean must be contiguous [B, Hkv, Dp]")
    _check(out.dim() == 4 and out.stride(3) == 1, "out must be [B, H, n, Skp] with a contiguous last dim")
    b, h, nblk, dp = q_mean.shape
    hkv, sk, d = k.shape[1:]
    skp = _round_up_128(sk)
    _check(dp == fmt.padded_head_dim(d), "q_mean's head dim {} does not match k's {}", dp, d)
    _check(k.shape[0] == b and hkv > 0 and h % hkv == 0 and tuple(k_mean.shape) == (b, hkv, dp),
           "shape mismatch between q_mean, k and k_mean")
    _check(out.shape[0] == b and out.shape[1] == h and out.shape[3] == skp, "out must be [B, H, n, {}]", skp)
    rows = out.shape[2]
    _check(0 <= block_begin and block_begin + rows <= nblk, "blocks [{}, {}) outside [0, {})", block_begin,
           block_begin + rows, nblk)
    _check(q_scale.dtype == torch.float32 and q_scale.is_contiguous() and tuple(q_scale.shape) == (b, h, nblk),
           "q_scale must be contiguous float32 [B, H, nblk]")
    _check(k_scale.dtype == torch.float32 and k_scale.is_contiguous() and tuple(k_scale.shape) == (b, hkv),
           "k_scale must be contiguous float32 [B, Hkv]")
    if kv_lens is not None:
        _check(kv_lens.device == q_mean.device and tuple(kv_lens.shape) == (b,) and kv_lens.dtype in (torch.int32, torch.int64),
               "kv_lens must be int32 or int64 [B] on the inputs' device")
        kv_lens = kv_lens.contiguous()
    if rows == 0:
        return
    _check(b * h <= _MAX_GRID_YZ, "too many batches x heads for one correction launch")
    dp_index = abi.head_dim_index(dp)
    smem = abi.CORRECTION_SMEM_BYTES[dp_index]
    vec_store = out.data_ptr() % 8 == 0 and all(s % 2 == 0 for s in out.stride()[:3])
    name = abi.correction_entry(_DTYPES[k.dtype], dp, _vector_loads(k, dp), vec_store)
    kernel = _kernel(q_mean.device, name)
    # A CTA converts its 128 keys once and walks the Q blocks; the blocks are split over grid.y only
    # as far as needed to give every SM its resident CTAs.
    key_tiles, m_tiles = skp // abi.CORRECTION_TILE_N, -(-rows // abi.CORRECTION_TILE_M)
    resident = _sms(q_mean.device) * kernel.blocks_per_sm(abi.CORRECTION_THREADS, smem)
    grid = (key_tiles, min(m_tiles, max(1, -(-resident // (key_tiles * b * h))), _MAX_GRID_YZ), b * h)
    p = abi.CorrectionParams(
        q_mean=q_mean.data_ptr(), k=_strided(k), dtype=abi.INPUT_DTYPES[_DTYPES[k.dtype]], kv_lens=_ptr(kv_lens),
        kv_lens_int64=kv_lens is not None and kv_lens.dtype == torch.int64, k_mean=k_mean.data_ptr(),
        q_scale=q_scale.data_ptr(), k_scale=k_scale.data_ptr(), delta=out.data_ptr(),
        delta_stride_b=out.stride(0), delta_stride_h=out.stride(1), delta_stride_blk=out.stride(2),
        batch=b, heads_q=h, heads_kv=hkv, seq_k=sk, seq_k_padded=skp, head_dim=d, head_dim_padded=dp,
        num_q_blocks=nblk, block_begin=block_begin, block_end=block_begin + rows)
    with torch.cuda.device(q_mean.device):
        kernel.launch(grid, abi.CORRECTION_THREADS, [p], _stream(q_mean.device), smem)


# ---------------------------------------------------------------------------------------------
# The attention kernel
# ---------------------------------------------------------------------------------------------

def _check_plane(t: torch.Tensor, name: str, device: torch.device) -> None:
    _check(t.is_cuda and t.device == device, "{} must be a CUDA tensor on {}", name, device)
    _check(t.dtype == torch.uint8 and t.dim() == 4 and t.is_contiguous(), "{} must be a contiguous 4-D uint8 tensor", name)


def _check_f32(t: torch.Tensor, name: str, shape: tuple, device: torch.device) -> None:
    _check(t.is_cuda and t.device == device and t.dtype == torch.float32 and t.is_contiguous() and tuple(t.shape) == shape,
           "{} must be a contiguous float32 CUDA tensor of shape {}, got {} {}", name, list(shape), t.dtype, t.shape)


def attention_fwd(q_data, q_sf, k_data, k_sf, vt_data, vt_sf, delta, q_dot_km, q_scale, k_scale, v_scale, v_mean,
                  kv_lens: Optional[torch.Tensor], out: torch.Tensor, lse: Optional[torch.Tensor], seq_q: int,
                  seq_k: int, q_block_begin: int, q_block_end: int, scale: float, causal: bool, native: bool,
                  qk_format: str) -> None:
    """Run the attention kernel over Q blocks [q_block_begin, q_block_end), writing those rows of
    ``out`` [B, H, Sq, D] (any batch/head/row strides, bf16/fp16) and of ``lse`` [B, H, Sq] fp32."""
    _check(qk_format in fmt.QK_FORMATS, "qk_format must be one of {}, got {!r}", fmt.QK_FORMATS, qk_format)
    per_byte, per_scale = (2, 16) if qk_format == "nvfp4" else (1, 32)
    device = q_data.device
    for name, t in (("q_data", q_data), ("q_sf", q_sf), ("k_data", k_data), ("k_sf", k_sf), ("vt_data", vt_data),
                    ("vt_sf", vt_sf)):
        _check_plane(t, name, device)
    b, h, sqp, dp = q_data.shape[0], q_data.shape[1], q_data.shape[2], q_data.shape[3] * per_byte
    hkv, skp = k_data.shape[1], k_data.shape[2]
    _check(dp in fmt.SUPPORTED_HEAD_DIMS, "padded head dim {} has no kernel instantiation", dp)
    _check(sqp % 128 == 0 and skp % 128 == 0, "sequences must be padded to multiples of 128")
    _check(hkv > 0 and h % hkv == 0, "q heads {} not a multiple of kv heads {}", h, hkv)
    for name, t, shape in (("q_sf", q_sf, (b, h, sqp, dp // per_scale)), ("k_data", k_data, (b, hkv, skp, dp // per_byte)),
                           ("k_sf", k_sf, (b, hkv, skp, dp // per_scale)), ("vt_data", vt_data, (b, hkv, dp, skp // 2)),
                           ("vt_sf", vt_sf, (b, hkv, dp, skp // 16))):
        _check(tuple(t.shape) == shape, "{} has shape {}, expected {}", name, t.shape, list(shape))
    _check(0 < seq_q <= sqp and 0 < seq_k <= skp, "bad seq_q/seq_k {}/{}", seq_q, seq_k)
    _check(0 <= q_block_begin < q_block_end and q_block_end * 128 <= sqp,
           "q block range [{}, {}) out of range", q_block_begin, q_block_end)
    nblk = q_block_end - q_block_begin
    _check(delta.is_cuda and delta.device == device and delta.dtype == torch.float32 and delta.dim() == 4,
           "delta must be a float32 4-D CUDA tensor on q's device")
    _check(delta.shape[0] == b and delta.shape[1] == h and delta.shape[2] in (nblk, 1) and delta.shape[3] == skp,
           "delta shape {}, expected [{}, {}, {}, {}]", delta.shape, b, h, nblk, skp)
    _check(delta.stride(3) == 1 and all(s % 4 == 0 for s in delta.stride()[:3]) and delta.data_ptr() % 16 == 0,
           "delta rows must be contiguous and 16-byte aligned")
    _check(q_dot_km.is_cuda and q_dot_km.dtype == torch.float32 and q_dot_km.dim() == 3 and q_dot_km.shape[0] == b
           and q_dot_km.shape[1] == h and q_dot_km.shape[2] >= seq_q and q_dot_km.stride(2) == 1,
           "q_dot_km must be float32 [B, H, Sq] with a contiguous last dim")
    _check_f32(q_scale, "q_scale", (b, h, sqp // 128), device)
    _check_f32(k_scale, "k_scale", (b, hkv), device)
    _check_f32(v_scale, "v_scale", (b, hkv), device)
    _check_f32(v_mean, "v_mean", (b, hkv, dp), device)
    _check(out.is_cuda and out.device == device and out.dim() == 4 and out.dtype in (torch.bfloat16, torch.float16),
           "out must be a bf16/fp16 4-D CUDA tensor [B, H, Sq, D] (any batch/head/seq strides)")
    _check(out.shape[0] == b and out.shape[1] == h and out.shape[2] == seq_q and out.shape[3] <= dp and out.stride(3) == 1,
           "out shape {} / strides {}", out.shape, out.stride())
    if kv_lens is not None:
        _check(kv_lens.is_cuda and kv_lens.dtype == torch.int32 and tuple(kv_lens.shape) == (b,) and kv_lens.is_contiguous(),
               "kv_lens must be int32 [B] contiguous on the GPU")
    if lse is not None:
        _check(lse.is_cuda and lse.dtype == torch.float32 and lse.dim() == 3 and tuple(lse.shape) == (b, h, seq_q)
               and lse.stride(2) == 1, "lse must be float32 [B, H, Sq] with a contiguous last dim")
    p = abi.AttentionFwdParams(
        q_data=q_data.data_ptr(), q_sf=q_sf.data_ptr(), k_data=k_data.data_ptr(), k_sf=k_sf.data_ptr(),
        vt_data=vt_data.data_ptr(), vt_sf=vt_sf.data_ptr(),
        q_stride_b=q_data.stride(0), q_stride_h=q_data.stride(1), qsf_stride_b=q_sf.stride(0), qsf_stride_h=q_sf.stride(1),
        k_stride_b=k_data.stride(0), k_stride_h=k_data.stride(1), ksf_stride_b=k_sf.stride(0), ksf_stride_h=k_sf.stride(1),
        vt_stride_b=vt_data.stride(0), vt_stride_h=vt_data.stride(1),
        vtsf_stride_b=vt_sf.stride(0), vtsf_stride_h=vt_sf.stride(1),
        delta=delta.data_ptr(), delta_stride_b=delta.stride(0), delta_stride_h=delta.stride(1),
        delta_stride_blk=0 if delta.shape[2] == 1 else delta.stride(2),
        q_dot_km=q_dot_km.data_ptr(), qdk_stride_b=q_dot_km.stride(0), qdk_stride_h=q_dot_km.stride(1),
        q_scale=q_scale.data_ptr(), k_scale=k_scale.data_ptr(), v_scale=v_scale.data_ptr(), v_mean=v_mean.data_ptr(),
        kv_lens=_ptr(kv_lens), out=out.data_ptr(), out_stride_b=out.stride(0), out_stride_h=out.stride(1),
        out_stride_s=out.stride(2), lse=_ptr(lse),
        lse_stride_b=lse.stride(0) if lse is not None else 0, lse_stride_h=lse.stride(1) if lse is not None else 0,
        batch=b, heads=h, kv_heads=hkv, seq_q=seq_q, seq_k=seq_k, seq_q_pad=sqp, seq_k_pad=skp,
        head_dim_out=out.shape[3], q_block_begin=q_block_begin, q_block_end=q_block_end,
        scale=float(scale), scale_log2=float(scale * 1.4426950408889634), causal=int(bool(causal)),
        out_bf16=int(out.dtype == torch.bfloat16),
        out_vec2=int(all(s % 2 == 0 for s in out.stride()[:3]) and out.data_ptr() % 4 == 0))
    kind = "native" if native else "emulated"
    smem = abi.ATTENTION_SMEM_BYTES[fmt.QK_FORMATS.index(qk_format)][abi.head_dim_index(dp)]
    with torch.cuda.device(device):
        kernel = _kernel(device, abi.attention_entry(kind, qk_format, dp, lse is not None))
        per_sm = kernel.blocks_per_sm(abi.ATTENTION_THREADS, smem)
        p.grid_size = min(b * h * nblk, max(per_sm, 1) * _sms(device))
        kernel.launch((p.grid_size,), abi.ATTENTION_THREADS, [p], _stream(device), smem)


# ---------------------------------------------------------------------------------------------
# The single-MMA probes (tests, the self-test)
# ---------------------------------------------------------------------------------------------

def _mma_probe(probe: str, combination: int, a, b, sfa, sfb, c, native: bool) -> torch.Tensor:
    for name, t, dtype, shape in (("a", a, torch.int32, (32, 4)), ("b", b, torch.int32, (32, 2)),
                                  ("sfa", sfa, torch.int32, (32,)), ("sfb", sfb, torch.int32, (32,)),
                                  ("c", c, torch.float32, (32, 4))):
        _check(t.is_cuda and t.dtype == dtype and tuple(t.shape) == shape and t.is_contiguous(),
               "{} must be a contiguous CUDA {} tensor of shape {}", name, dtype, list(shape))
    d = torch.empty(32, 4, dtype=torch.float32, device=c.device)
    args = [ctypes.c_void_p(t.data_ptr()) for t in (a, b, sfa, sfb, c, d)]
    with torch.cuda.device(c.device):
        _kernel(c.device, abi.probe_entry(probe, "native" if native else "emulated", combination)).launch(
            (1,), abi.PROBE_THREADS, args, _stream(c.device))
    return d


def mma_nvfp4_probe(a, b, sfa, sfb, c, tid_a: int, tid_b: int, native: bool) -> torch.Tensor:
    """One warp runs one m16n8k64 block-scaled FP4 MMA (scale_vec::4X) with these per-lane registers:
    a [32, 4], b [32, 2], sfa, sfb [32] int32, c [32, 4] fp32; returns d [32, 4]."""
    _check(tid_a in (0, 1), "thread-id-a must be 0 or 1, got {}", tid_a)
    _check(tid_b in (0, 1, 2, 3), "thread-id-b must be in 0..3, got {}", tid_b)
    return _mma_probe("nvfp4", 4 * tid_a + tid_b, a, b, sfa, sfb, c, native)


def mma_mxfp8_probe(a, b, sfa, sfb, c, tid_a: int, tid_b: int, byte_id: int, native: bool) -> torch.Tensor:
    """The same for one m16n8k32 8-bit MMA (kind::mxf8f6f4, e4m3, ue8m0 scale_vec::1X) with byte-id."""
    _check(tid_a in (0, 1), "thread-id-a must be 0 or 1, got {}", tid_a)
    _check(tid_b in (0, 1, 2, 3), "thread-id-b must be in 0..3, got {}", tid_b)
    _check(byte_id in (0, 1, 2, 3), "byte-id must be in 0..3, got {}", byte_id)
    return _mma_probe("mxfp8", 16 * tid_a + 4 * tid_b + byte_id, a, b, sfa, sfb, c, native)
