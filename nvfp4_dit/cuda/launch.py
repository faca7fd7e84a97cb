"""The CUDA kernels as launches: per-device kernel handles, one workspace per call, parameter structs.

The host side of ``csrc/``. A call's preparation and attention use one device allocation, the
:class:`Workspace` (its layout, :func:`workspace_layout`, depends on the shapes alone and is
computed once per shape), whose counters and flags one stream-ordered memset clears. Each launch
fills its kernel's parameter struct (:mod:`nvfp4_dit.cuda.abi`) with raw pointers into it and goes
to the driver (:mod:`nvfp4_dit.cuda.driver`) on torch's current stream. Nothing here synchronises
or copies to the host, so a call can be captured into a CUDA graph.

The arguments were validated once, at the public op (or at the functions of
:mod:`nvfp4_dit.cuda.quantize` that tests call); these launchers keep only the checks that protect
memory (grid limits). The kernels must be loaded for the device first
(:func:`nvfp4_dit.cuda.build.unavailable_reason`).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from typing import Optional

import torch

from .. import format as fmt
from .. import smoothing
from . import abi, build, driver

DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
_MAX_GRID_X = 0x7FFFFFFF
_MAX_GRID_YZ = 65535
_ALIGN = 256   # every workspace region starts on a 256-byte boundary (16-byte vector accesses)

# torch's current stream as a raw handle (what torch.compile's generated code reads); the public
# torch.cuda.current_stream builds a Stream object on every call.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_stream(index: int) -> int:
    return _raw_stream(index) if _raw_stream is not None else torch.cuda.current_stream(index).cuda_stream


class DeviceKernels:
    """The kernels of one device, looked up once: its library, SM count, MMA kind."""

    def __init__(self, index: int):
        self.index = index
        self.library = build.library_for(torch.device("cuda", index))
        self.native = build.is_native(build.device_capability(index))
        self.kind = "native" if self.native else "emulated"
        self.sms = driver.device_attribute(index, "MULTIPROCESSOR_COUNT")
        self._kernels: dict[str, driver.Kernel] = {}

    def kernel(self, name: str) -> driver.Kernel:
        found = self._kernels.get(name)
        if found is None:
            with torch.cuda.device(self.index):
                found = self._kernels[name] = self.library.kernel(name, self.index)
        return found


_device_kernels: dict[int, DeviceKernels] = {}


def device_kernels(device: torch.device) -> DeviceKernels:
    """The :class:`DeviceKernels` of a CUDA device (its kernels loaded on first use)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    found = _device_kernels.get(index)
    if found is None:
        found = _device_kernels[index] = DeviceKernels(index)
    return found


def ensure_current(index: int) -> None:
    """Make ``index`` the current device (the driver launches into the current context)."""
    if torch.cuda.current_device() != index:
        torch.cuda.set_device(index)


# ---------------------------------------------------------------------------------------------
# The workspace of one call
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Region:
    offset: int
    shape: tuple
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class WorkspaceLayout:
    """Where each output of the quantiser and its scratch lie in one buffer."""

    regions: dict
    zeroed_bytes: int   # the counters, flags and channel statistics at the start: cleared per call
    total_bytes: int


@functools.lru_cache(maxsize=512)
def workspace_layout(b: int, h: int, hkv: int, sq: int, sk: int, dp: int, qk_format: str,
                     balance_qk: bool) -> WorkspaceLayout:
    """The layout of a call's workspace for these sizes."""
    per_byte, per_scale = (1, fmt.MX_BLOCK) if qk_format == "mxfp8" else (2, fmt.BLOCK)
    sqp, skp = fmt.round_up(max(sq, 1), fmt.SEQ_TILE), fmt.round_up(max(sk, 1), fmt.SEQ_TILE)
    nq = sqp // fmt.SEQ_TILE
    i32, f32, u8 = torch.int32, torch.float32, torch.uint8
    items = [
        # cleared per call: the statistics arrivals and head exponents, the NaN/inf flags, the
        # balance's Q statistics
        ("arrivals", (abi.workspace_counters(b, hkv),), i32),
        ("nonfinite_kv", (b, hkv), i32),
        ("nonfinite_q", (b, h, nq), i32),
        ("q_channel_amax", (b, hkv, dp) if balance_qk else (0,), i32),
        ("partial", (abi.workspace_floats(b, hkv, dp),), f32),
        ("tile_records", (abi.workspace_records(b, hkv, skp),), i32),
        ("q_mean", (b, h, nq, dp), f32), ("k_mean", (b, hkv, dp), f32), ("v_mean", (b, hkv, dp), f32),
        ("balance", (b, hkv, dp), f32), ("q_scale", (b, h, nq), f32), ("k_scale", (b, hkv), f32),
        ("v_scale", (b, hkv), f32), ("q_dot_km", (b, h, sq), f32),
        ("k_tile_mean", (b, hkv, skp // fmt.SEQ_TILE, dp), f32), ("q_similarity", (b, h, nq), f32),
        ("q_center", (b, h, dp), f32), ("q_basis", (b, h, smoothing.Q_BASIS_RANK, dp), f32),
        ("q_basis_scale", (b, h), f32),
        ("q_coeff", (b, h, nq, smoothing.Q_BASIS_RANK), f32), ("q_smooth_mean", (b, h, nq, dp), f32),
        ("key_proj", (b, h, skp, smoothing.KEY_PROJECTION_COLUMNS), torch.float16),
        ("key_proj_factor", (b, h, skp // fmt.SEQ_TILE), f32),
        ("q_data", (b, h, sqp, dp // per_byte), u8), ("q_sf", (b, h, sqp, dp // per_scale), u8),
        ("k_data", (b, hkv, skp, dp // per_byte), u8), ("k_sf", (b, hkv, skp, dp // per_scale), u8),
        ("vt_data", (b, hkv, dp, skp // 2), u8), ("vt_sf", (b, hkv, dp, skp // 16), u8),
    ]
    regions, offset, zeroed = {}, 0, 0
    for name, shape, dtype in items:
        region = Region(offset, shape, dtype)
        regions[name] = region
        offset = fmt.round_up(offset + region.nbytes, _ALIGN)
        if name == "q_channel_amax":
            zeroed = offset
    return WorkspaceLayout(regions, zeroed, max(offset, _ALIGN))


class Workspace:
    """One device buffer holding a call's preparation (``layout``); ``view(name)`` gives a region as
    a tensor, ``ptr(name)`` its address."""

    def __init__(self, layout: WorkspaceLayout, device: torch.device):
        self.layout = layout
        self.buffer = torch.empty(layout.total_bytes, dtype=torch.uint8, device=device)
        self.base = self.buffer.data_ptr()

    def ptr(self, name: str) -> int:
        return self.base + self.layout.regions[name].offset

    def view(self, name: str) -> torch.Tensor:
        r = self.layout.regions[name]
        return self.buffer[r.offset:r.offset + r.nbytes].view(r.dtype).view(r.shape)

    def clear(self, stream: int) -> None:
        driver.memset_d32(self.base, 0, self.layout.zeroed_bytes // 4, stream)


# ---------------------------------------------------------------------------------------------
# Quantisation of Q, K, V
# ---------------------------------------------------------------------------------------------

def _strided(t: torch.Tensor) -> abi.StridedInput:
    return abi.StridedInput(t.data_ptr(), *t.stride())


def vector_loads(t: torch.Tensor, head_dim_padded: int) -> bool:
    """Whether ``t`` [B, H, S, D] can be read as 16-byte vectors: D == Dp, unit stride along D and
    16-byte aligned rows (how the quantiser reads every input)."""
    per16 = 16 // t.element_size()
    b, h, s, d = t.stride()
    return (t.shape[3] == head_dim_padded and d == 1 and t.data_ptr() % 16 == 0
            and b % per16 == 0 and h % per16 == 0 and s % per16 == 0)


def vector_readable(t: torch.Tensor, head_dim_padded: int) -> torch.Tensor:
    """``t`` itself where the quantiser can read it (:func:`vector_loads`), else a contiguous copy with
    the head dim zero-padded to ``head_dim_padded`` (the zero columns the format pads with): head
    dims other than 64 and 128, a stride along D, unaligned rows."""
    if vector_loads(t, head_dim_padded):
        return t
    return torch.nn.functional.pad(t, (0, head_dim_padded - t.shape[3])).contiguous()


def _order_struct(order) -> abi.TokenOrder:
    """The kernels' ``TokenOrder`` (csrc/common/token_order.h) of a :class:`~nvfp4_dit.token_order.TokenOrder`."""
    (t, h, w), (tile_t, tile_h) = order.grid, order.tile
    return abi.TokenOrder(begin=order.span[0], end=order.span[1], t=t, h=h, w=w, tile_t=tile_t, tile_h=tile_h)


def inputs_in_order(order, qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, copy: bool = False):
    """``(qh, kh, vh, read_order)`` for quantising [B, H, S, D] inputs in a video call's tile
    ``order``: the inputs themselves and the order to read them through, or with ``copy`` (the
    torch quantiser, which cannot read through an order) permuted copies in tile order and None."""
    if order is None or not copy:
        return qh, kh, vh, order
    rows = order.source_rows(qh.shape[2], qh.device)
    return (*(t.index_select(2, rows) for t in (qh, kh, vh)), None)


def launch_quantize(dk: DeviceKernels, ws: Workspace, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    kv_lens: Optional[torch.Tensor], balance_qk: bool, qk_format: str, stream: int,
                    order=None, key_bias: Optional[torch.Tensor] = None, scale: float = 1.0) -> None:
    """Quantise logical [B, H, S, D] views (any strides) into ``ws`` (cleared by the caller): the
    balance statistics (``balance_qk``), the K and V statistics tiles, the Q block means, the
    smoothing basis of each query head, the tiles (with the key projections), then the fix-up
    passes that move each K and V tile to its head's tensor scale. Inputs the kernels cannot read as
    16-byte vectors are copied first (:func:`vector_readable`). ``order``: a video call's
    :class:`~nvfp4_dit.token_order.TokenOrder`, read through: the outputs are in tile order.
    ``key_bias`` (fp32 [B, H or 1, Sk] in the tiles' key order, last dim contiguous; units of the
    scaled scores) joins the key projections' first column divided by ``scale``."""
    b, h, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    dp = fmt.padded_head_dim(d)
    sqp, skp = fmt.round_up(max(sq, 1), fmt.SEQ_TILE), fmt.round_up(max(sk, 1), fmt.SEQ_TILE)
    dtype = DTYPE_NAMES[q.dtype]
    q, k, v = (vector_readable(t, dp) for t in (q, k, v))
    p = abi.QuantizeQkvParams(
        q=_strided(q), k=_strided(k), v=_strided(v), dtype=abi.INPUT_DTYPES[dtype],
        kv_lens=None if kv_lens is None else kv_lens.data_ptr(),
        kv_lens_int64=kv_lens is not None and kv_lens.dtype == torch.int64,
        batch=b, heads_q=h, heads_kv=hkv, seq_q=sq, seq_k=sk, head_dim=d, head_dim_padded=dp,
        seq_q_padded=sqp, seq_k_padded=skp,
        q_data=ws.ptr("q_data"), q_sf=ws.ptr("q_sf"), k_data=ws.ptr("k_data"), k_sf=ws.ptr("k_sf"),
        vt_data=ws.ptr("vt_data"), vt_sf=ws.ptr("vt_sf"), q_mean=ws.ptr("q_mean"), k_mean=ws.ptr("k_mean"),
        v_mean=ws.ptr("v_mean"), q_scale=ws.ptr("q_scale"), k_scale=ws.ptr("k_scale"), v_scale=ws.ptr("v_scale"),
        balance=ws.ptr("balance"), q_dot_km=ws.ptr("q_dot_km"), k_tile_mean=ws.ptr("k_tile_mean"),
        q_similarity=ws.ptr("q_similarity"), q_center=ws.ptr("q_center"), q_basis=ws.ptr("q_basis"),
        q_basis_scale=ws.ptr("q_basis_scale"),
        q_coeff=ws.ptr("q_coeff"), q_smooth_mean=ws.ptr("q_smooth_mean"), key_proj=ws.ptr("key_proj"),
        key_proj_factor=ws.ptr("key_proj_factor"),
        key_bias=None if key_bias is None else key_bias.data_ptr(),
        key_bias_stride_b=0 if key_bias is None else key_bias.stride(0),
        key_bias_stride_h=0 if key_bias is None or key_bias.shape[1] == 1 else key_bias.stride(1),
        scale=scale, balance_qk=balance_qk,
        q_channel_amax=ws.ptr("q_channel_amax") if balance_qk else None,
        nonfinite_kv=ws.ptr("nonfinite_kv"), nonfinite_q_blocks=ws.ptr("nonfinite_q"),
        k_partial_sums=ws.ptr("partial"), work_counters=ws.ptr("arrivals"), tile_records=ws.ptr("tile_records"),
        order=abi.TokenOrder() if order is None else _order_struct(order))
    kv_tiles = b * hkv * (skp // fmt.SEQ_TILE)
    q_tiles = b * h * (sqp // fmt.SEQ_TILE)
    statistics = b * hkv * abi.STAT_TENSORS * abi.STATISTICS_TILES
    if kv_tiles + q_tiles > _MAX_GRID_X:
        raise ValueError(f"too many tiles for one quantiser launch ({kv_tiles + q_tiles})")
    args = [p]
    if balance_qk:  # the balance needs the Q statistics before any K or Q tile
        dk.kernel(abi.balance_statistics_entry(dp)).launch(
            (b * h * abi.STATISTICS_TILES,), abi.QUANTIZE_THREADS, args, stream)
    dk.kernel(abi.key_stats_entry(dp)).launch((statistics,), abi.QUANTIZE_THREADS, args, stream)
    # the Q block means, then each query head's smoothing basis, before any K or Q tile reads it
    dk.kernel(abi.q_means_entry(dtype, dp)).launch((q_tiles,), abi.QUANTIZE_THREADS, args, stream)
    dk.kernel(abi.smoothing_basis_entry(dp)).launch((b * h,), abi.QUANTIZE_THREADS, args, stream,
                                                      abi.SMOOTHING_BASIS_SMEM_BYTES[abi.head_dim_index(dp)])
    qk_tiles = dk.kernel(abi.quantize_tiles_entry(dtype, dp, qk_format))
    v_tiles = dk.kernel(abi.quantize_v_tiles_entry(dtype, dp))
    qk_tiles.launch((kv_tiles + q_tiles,), abi.QUANTIZE_THREADS, [p, ctypes.c_int32(0)], stream)
    v_tiles.launch((kv_tiles,), abi.QUANTIZE_THREADS, [p, ctypes.c_int32(0)], stream)
    # the fix-up passes: every K and V tile to its head's tensor scale, a wave of CTAs looping over them
    for tiles in (qk_tiles, v_tiles):
        resident = dk.sms * tiles.blocks_per_sm(abi.QUANTIZE_THREADS)
        tiles.launch((min(kv_tiles, resident),), abi.QUANTIZE_THREADS, [p, ctypes.c_int32(1)], stream)


# ---------------------------------------------------------------------------------------------
# The attention kernel
# ---------------------------------------------------------------------------------------------

def launch_attention(dk: DeviceKernels, planes: dict, seq_q: int, seq_k: int, block_begin: int, block_end: int,
                     out: torch.Tensor, lse: Optional[torch.Tensor],
                     kv_lens: Optional[torch.Tensor], scale: float, causal: bool, qk_format: str,
                     stream: int, lists=None, out_order=None) -> None:
    """The attention kernel over Q blocks [block_begin, block_end), writing those rows of ``out``
    [B, H, Sq, D] (any batch/head/row strides, bf16/fp16, last dim contiguous) and of ``lse``
    [B, H, Sq] fp32 (last dim contiguous). ``planes`` maps each quantised operand to its
    ``(address, shape)`` (the :class:`Workspace` regions or tensors of the same layout); ``kv_lens``
    is int32 [B] or None; the planes ``q_coeff``, ``key_proj`` and ``key_proj_factor`` give the
    correction (low-rank smoothing, :mod:`nvfp4_dit.smoothing`). With ``lists`` (the
    :class:`nvfp4_dit.sparse.BlockLists` of exactly these Q blocks) each Q block visits only its
    listed key tiles.
    ``out_order``: a video call's :class:`~nvfp4_dit.token_order.TokenOrder`: the operands are in
    tile order and query row s is written to row ``source_row(s)`` of ``out`` and ``lse``."""
    qd, qd_shape = planes["q_data"]
    b, h, sqp = qd_shape[:3]
    kd, kd_shape = planes["k_data"]
    hkv, skp = kd_shape[1], kd_shape[2]
    per_byte, per_scale = (1, fmt.MX_BLOCK) if qk_format == "mxfp8" else (2, fmt.BLOCK)
    dp = qd_shape[3] * per_byte
    nblk = block_end - block_begin
    qrow, sf_row = dp // per_byte, dp // per_scale   # bytes of one Q/K row and of its scales
    p = abi.AttentionFwdParams(
        q_data=qd, q_sf=planes["q_sf"][0], k_data=kd, k_sf=planes["k_sf"][0], vt_data=planes["vt_data"][0],
        vt_sf=planes["vt_sf"][0],
        q_stride_b=h * sqp * qrow, q_stride_h=sqp * qrow, qsf_stride_b=h * sqp * sf_row, qsf_stride_h=sqp * sf_row,
        k_stride_b=hkv * skp * qrow, k_stride_h=skp * qrow, ksf_stride_b=hkv * skp * sf_row, ksf_stride_h=skp * sf_row,
        vt_stride_b=hkv * dp * (skp // 2), vt_stride_h=dp * (skp // 2),
        vtsf_stride_b=hkv * dp * (skp // 16), vtsf_stride_h=dp * (skp // 16),
        key_proj=planes["key_proj"][0], key_proj_factor=planes["key_proj_factor"][0], q_coeff=planes["q_coeff"][0],
        q_dot_km=planes["q_dot_km"][0], qdk_stride_b=h * seq_q, qdk_stride_h=seq_q,
        q_scale=planes["q_scale"][0], k_scale=planes["k_scale"][0], v_scale=planes["v_scale"][0],
        v_mean=planes["v_mean"][0], kv_lens=None if kv_lens is None else kv_lens.data_ptr(),
        out=out.data_ptr(), out_stride_b=out.stride(0), out_stride_h=out.stride(1), out_stride_s=out.stride(2),
        lse=None if lse is None else lse.data_ptr(), lse_stride_b=0 if lse is None else lse.stride(0),
        lse_stride_h=0 if lse is None else lse.stride(1),
        nonfinite_q_blocks=planes["nonfinite_q"][0], nonfinite_kv=planes["nonfinite_kv"][0],
        batch=b, heads=h, kv_heads=hkv, seq_q=seq_q, seq_k=seq_k, seq_q_pad=sqp, seq_k_pad=skp,
        head_dim_out=out.shape[3], q_block_begin=block_begin, q_block_end=block_end,
        scale=float(scale), scale_log2=float(scale * 1.4426950408889634), causal=int(causal),
        out_bf16=int(out.dtype == torch.bfloat16),
        out_vec2=int(out.stride(0) % 2 == 0 and out.stride(1) % 2 == 0 and out.stride(2) % 2 == 0
                     and out.data_ptr() % 4 == 0))
    if lists is not None:
        p.block_offsets, p.block_tiles, p.work_order = (t.data_ptr() for t in (lists.offsets, lists.tiles,
                                                                                 lists.order))
    if out_order is not None:
        p.out_order = _order_struct(out_order)
    smem = abi.ATTENTION_SMEM_BYTES[fmt.QK_FORMATS.index(qk_format)][abi.head_dim_index(dp)]
    kernel = dk.kernel(abi.attention_entry(dk.kind, qk_format, dp, lists is not None))
    work = b * h * nblk
    p.grid_size = min(work, max(kernel.blocks_per_sm(abi.ATTENTION_THREADS, smem), 1) * dk.sms)
    if p.grid_size > _MAX_GRID_X:
        raise ValueError("too many work items for one attention launch")
    kernel.launch((p.grid_size,), abi.ATTENTION_THREADS, [p], stream, smem)


# ---------------------------------------------------------------------------------------------
# The single-MMA probes (tests, the self-test)
# ---------------------------------------------------------------------------------------------

def _check_probe_registers(**registers) -> None:
    shapes = {"a": (torch.int32, (32, 4)), "b": (torch.int32, (32, 2)), "sfa": (torch.int32, (32,)),
              "sfb": (torch.int32, (32,)), "c": (torch.float32, (32, 4))}
    for name, t in registers.items():
        dtype, shape = shapes[name]
        if not (t.is_cuda and t.dtype == dtype and tuple(t.shape) == shape and t.is_contiguous()):
            raise ValueError(f"{name} must be a contiguous CUDA {dtype} tensor of shape {list(shape)}")


def _mma_probe(probe: str, combination: int, a, b, sfa, sfb, c, native: bool) -> torch.Tensor:
    _check_probe_registers(a=a, b=b, sfa=sfa, sfb=sfb, c=c)
    d = torch.empty(32, 4, dtype=torch.float32, device=c.device)
    args = [ctypes.c_void_p(t.data_ptr()) for t in (a, b, sfa, sfb, c, d)]
    dk = device_kernels(c.device)
    ensure_current(dk.index)
    dk.kernel(abi.probe_entry(probe, "native" if native else "emulated", combination)).launch(
        (1,), abi.PROBE_THREADS, args, current_stream(dk.index))
    return d


def mma_nvfp4_probe(a, b, sfa, sfb, c, tid_a: int, tid_b: int, native: bool) -> torch.Tensor:
    """One warp runs one m16n8k64 block-scaled FP4 MMA (scale_vec::4X) with these per-lane registers:
    a [32, 4], b [32, 2], sfa, sfb [32] int32, c [32, 4] fp32; returns d [32, 4]."""
    if tid_a not in (0, 1) or tid_b not in (0, 1, 2, 3):
        raise ValueError(f"thread-id-a must be 0 or 1 and thread-id-b in 0..3, got {tid_a}, {tid_b}")
    return _mma_probe("nvfp4", 4 * tid_a + tid_b, a, b, sfa, sfb, c, native)


def mma_mxfp8_probe(a, b, sfa, sfb, c, tid_a: int, tid_b: int, byte_id: int, native: bool) -> torch.Tensor:
    """The same for one m16n8k32 8-bit MMA (kind::mxf8f6f4, e4m3, ue8m0 scale_vec::1X) with byte-id."""
    if tid_a not in (0, 1) or tid_b not in (0, 1, 2, 3) or byte_id not in (0, 1, 2, 3):
        raise ValueError(f"thread-id-a must be 0 or 1, thread-id-b and byte-id in 0..3, got {tid_a}, {tid_b}, "
                         f"{byte_id}")
    return _mma_probe("mxfp8", 16 * tid_a + 4 * tid_b + byte_id, a, b, sfa, sfb, c, native)
