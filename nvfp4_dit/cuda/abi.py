"""The launch interface of the CUDA kernels, mirrored from ``csrc/`` for the host launcher.

The one C++ definition of each structure is in ``csrc/attention/params.h`` and
``csrc/quantize/params.h`` (the launch constants in ``csrc/common/launch.h``); these ``ctypes``
structures repeat them field for field, and tests/test_kernel_abi.py compiles those headers with
the host compiler and checks every field's offset, every struct's size and every constant against
this module. Names follow the C++ ones.
"""

from __future__ import annotations

import ctypes
from ctypes import c_bool, c_float, c_int, c_int32, c_int64, c_void_p

# csrc/common/launch.h
ATTENTION_THREADS = 256
# [Q·Kᵀ format index (format.QK_FORMATS)][head dim 64, 128]
ATTENTION_SMEM_BYTES = ((53760, 90624), (69120, 91008))
PROBE_THREADS = 32
QUANTIZE_THREADS = 256
SMOOTHING_BASIS_SMEM_BYTES = (29568, 90752)   # [head dim 64, 128]
BLOCK_LISTS_THREADS = 256
BLOCK_LISTS_MAX_TILES = 4096
BLOCK_MAP_WARP_MAX_TILES = 1024  # block_map_rows_by_warp: a warp per map row of at most this many tiles
BLOCK_LIST_ROWS_PER_CTA = 4    # block_list_rows: a warp per map row

# csrc/quantize/params.h
TILE_ROWS = 128
STATISTICS_TILES = 16
STAT_TENSORS = 2
STAT_VECTORS = 3
INPUT_DTYPES = {"bf16": 0, "fp16": 1, "fp32": 2}   # InputDtype


def head_dim_index(head_dim_padded: int) -> int:
    return (64, 128).index(head_dim_padded)


class TokenOrder(ctypes.Structure):
    _fields_ = [("begin", c_int64), ("end", c_int64), ("t", c_int32), ("h", c_int32), ("w", c_int32),
                ("tile_t", c_int32), ("tile_h", c_int32), ("reserved", c_int32)]


class AttentionFwdParams(ctypes.Structure):
    _fields_ = [
        ("q_data", c_void_p), ("q_sf", c_void_p), ("k_data", c_void_p), ("k_sf", c_void_p),
        ("vt_data", c_void_p), ("vt_sf", c_void_p),
        ("q_stride_b", c_int64), ("q_stride_h", c_int64),
        ("qsf_stride_b", c_int64), ("qsf_stride_h", c_int64),
        ("k_stride_b", c_int64), ("k_stride_h", c_int64),
        ("ksf_stride_b", c_int64), ("ksf_stride_h", c_int64),
        ("vt_stride_b", c_int64), ("vt_stride_h", c_int64),
        ("vtsf_stride_b", c_int64), ("vtsf_stride_h", c_int64),
        ("key_proj", c_void_p), ("key_proj_factor", c_void_p), ("q_coeff", c_void_p),
        ("block_offsets", c_void_p), ("block_tiles", c_void_p), ("work_order", c_void_p),
        ("q_dot_km", c_void_p), ("qdk_stride_b", c_int64), ("qdk_stride_h", c_int64),
        ("q_scale", c_void_p), ("k_scale", c_void_p), ("v_scale", c_void_p), ("v_mean", c_void_p),
        ("kv_lens", c_void_p),
        ("out", c_void_p), ("out_stride_b", c_int64), ("out_stride_h", c_int64), ("out_stride_s", c_int64),
        ("lse", c_void_p), ("lse_stride_b", c_int64), ("lse_stride_h", c_int64),
        ("nonfinite_q_blocks", c_void_p), ("nonfinite_kv", c_void_p),
        ("batch", c_int), ("heads", c_int), ("kv_heads", c_int),
        ("seq_q", c_int), ("seq_k", c_int), ("seq_q_pad", c_int), ("seq_k_pad", c_int),
        ("head_dim_out", c_int), ("q_block_begin", c_int), ("q_block_end", c_int),
        ("scale", c_float), ("scale_log2", c_float),
        ("causal", c_int), ("out_bf16", c_int), ("out_vec2", c_int), ("grid_size", c_int),
        ("out_order", TokenOrder),
    ]


class StridedInput(ctypes.Structure):
    _fields_ = [("ptr", c_void_p), ("stride_b", c_int64), ("stride_h", c_int64), ("stride_s", c_int64),
                ("stride_d", c_int64)]


class QuantizeQkvParams(ctypes.Structure):
    _fields_ = [
        ("q", StridedInput), ("k", StridedInput), ("v", StridedInput),
        ("dtype", c_int32), ("kv_lens", c_void_p), ("kv_lens_int64", c_bool),
        ("batch", c_int64), ("heads_q", c_int64), ("heads_kv", c_int64), ("seq_q", c_int64), ("seq_k", c_int64),
        ("head_dim", c_int64), ("head_dim_padded", c_int64), ("seq_q_padded", c_int64), ("seq_k_padded", c_int64),
        ("q_data", c_void_p), ("q_sf", c_void_p), ("k_data", c_void_p), ("k_sf", c_void_p),
        ("vt_data", c_void_p), ("vt_sf", c_void_p),
        ("q_mean", c_void_p), ("k_mean", c_void_p), ("v_mean", c_void_p),
        ("q_scale", c_void_p), ("k_scale", c_void_p), ("v_scale", c_void_p),
        ("balance", c_void_p), ("q_dot_km", c_void_p), ("k_tile_mean", c_void_p), ("q_similarity", c_void_p),
        ("q_center", c_void_p), ("q_basis", c_void_p), ("q_basis_scale", c_void_p), ("q_coeff", c_void_p), ("q_smooth_mean", c_void_p),
        ("key_proj", c_void_p), ("key_proj_factor", c_void_p),
        ("key_bias", c_void_p), ("key_bias_stride_b", c_int64), ("key_bias_stride_h", c_int64), ("scale", c_float),
        ("balance_qk", c_bool), ("q_channel_amax", c_void_p),
        ("nonfinite_kv", c_void_p), ("nonfinite_q_blocks", c_void_p),
        ("k_partial_sums", c_void_p), ("work_counters", c_void_p), ("tile_records", c_void_p),
        ("order", TokenOrder),
    ]


class BlockListsParams(ctypes.Structure):
    _fields_ = [
        ("scores", c_void_p), ("q_similarity", c_void_p), ("log_weights", c_void_p),
        ("log_weights_stride_b", c_int64), ("log_weights_stride_h", c_int64),
        ("block_mask", c_void_p), ("block_mask_stride_b", c_int64), ("block_mask_stride_h", c_int64),
        ("block_mask_stride_q", c_int64), ("kv_lens", c_void_p),
        ("scale", c_float), ("keep_mass", c_float), ("similarity_threshold", c_float), ("causal", c_int),
        ("always_keep_begin", c_int64), ("always_keep_end", c_int64),
        ("batch", c_int64), ("heads", c_int64), ("seq_k", c_int64), ("num_q_blocks", c_int64),
        ("num_k_tiles", c_int64), ("words", c_int64), ("block_begin", c_int64), ("rows", c_int64),
        ("bits", c_void_p), ("row_counts", c_void_p), ("word_prefix", c_void_p), ("row_map", c_void_p),
        ("offsets", c_void_p), ("tiles", c_void_p), ("order", c_void_p),
    ]


STRUCTS = {"AttentionFwdParams": AttentionFwdParams, "StridedInput": StridedInput, "TokenOrder": TokenOrder,
           "QuantizeQkvParams": QuantizeQkvParams,
           "BlockListsParams": BlockListsParams}


# The workspace sizes (csrc/quantize/params.h; tests/test_kernel_abi.py compares them on many sizes).

def statistics_stride(n_valid: int) -> int:
    tiles = -(-n_valid // TILE_ROWS) if n_valid > 0 else 0
    return 1 if tiles <= STATISTICS_TILES else -(-tiles // STATISTICS_TILES)


def workspace_floats(batch: int, heads_kv: int, head_dim_padded: int) -> int:
    return batch * heads_kv * STAT_TENSORS * STATISTICS_TILES * STAT_VECTORS * head_dim_padded


def workspace_counters(batch: int, heads_kv: int) -> int:
    return batch * heads_kv * (1 + STAT_TENSORS)


def workspace_records(batch: int, heads_kv: int, seq_k_padded: int) -> int:
    return STAT_TENSORS * batch * heads_kv * (seq_k_padded // TILE_ROWS) * 2


# Entry-point names (csrc/common/launch.h).

def attention_entry(kind: str, qk_format: str, head_dim_padded: int, sparse: bool = False) -> str:
    """Dense or block-sparse; both write the LSE where ``AttentionFwdParams.lse`` is set."""
    return f"nvfp4_dit_attention_fwd_{kind}_{qk_format}_d{head_dim_padded}" + ("_sparse" if sparse else "")


def probe_entry(probe: str, kind: str, combination: int) -> str:
    return f"nvfp4_dit_mma_probe_{probe}_{kind}_{combination}"


def balance_statistics_entry(head_dim_padded: int) -> str:
    """The balance statistics (any input dtype: QuantizeQkvParams.dtype)."""
    return f"nvfp4_dit_balance_statistics_d{head_dim_padded}"


def key_stats_entry(head_dim_padded: int) -> str:
    """The K and V statistics (any input dtype)."""
    return f"nvfp4_dit_key_stats_d{head_dim_padded}"


def q_means_entry(dtype: str, head_dim_padded: int) -> str:
    """The Q block means and similarities, a CTA per Q tile."""
    return f"nvfp4_dit_q_means_{dtype}_d{head_dim_padded}"


def smoothing_basis_entry(head_dim_padded: int) -> str:
    """The low-rank smoothing of each query head (center, basis, coefficients, smoothed means)."""
    return f"nvfp4_dit_smoothing_basis_d{head_dim_padded}"


def quantize_tiles_entry(dtype: str, head_dim_padded: int, qk_format: str) -> str:
    """The K and Q tiles (and the K tiles' fix-up pass) of one Q·Kᵀ format."""
    return f"nvfp4_dit_quantize_tiles_{dtype}_d{head_dim_padded}_{qk_format}"


def quantize_v_tiles_entry(dtype: str, head_dim_padded: int) -> str:
    """The V^T tiles and their fix-up pass (the same in both Q·Kᵀ formats)."""
    return f"nvfp4_dit_quantize_v_tiles_{dtype}_d{head_dim_padded}"


BLOCK_LISTS_ENTRIES = ("nvfp4_dit_block_map_rows", "nvfp4_dit_block_map_rows_by_warp", "nvfp4_dit_block_list_rows")


def launcher_entries(kind: str) -> set[str]:
    """Every entry point the launcher (nvfp4_dit/cuda/launch.py) may ask for on a target of MMA ``kind``."""
    formats, head_dims = ("nvfp4", "mxfp8"), (64, 128)
    names = {attention_entry(kind, f, d, sp) for f in formats for d in head_dims
             for sp in (False, True)}
    names |= {probe_entry(p, k, i) for p, n in (("nvfp4", 8), ("mxfp8", 32)) for k in ("native", "emulated")
              for i in range(n)}
    for dt in INPUT_DTYPES:
        for d in head_dims:
            names |= {balance_statistics_entry(d), key_stats_entry(d), quantize_v_tiles_entry(dt, d),
                      q_means_entry(dt, d), smoothing_basis_entry(d)}
            names |= {quantize_tiles_entry(dt, d, f) for f in formats}
    return names | set(BLOCK_LISTS_ENTRIES)
