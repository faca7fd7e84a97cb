// What the host launcher (nvfp4_dit/cuda/launch.py) needs to start each kernel: the extern "C" entry
// points' names, block sizes and dynamic shared memory. nvfp4_dit/cuda/abi.py mirrors these
// constants and tests/test_kernel_abi.py checks the mirror against this header (compiled with the
// host compiler); the kernel translation units static_assert that their traits agree with it.
//
// Entry points (extern "C", so that the launcher finds them by name in a cubin):
//   attention/attention_fwd_{native,emulated}[_mxfp8]_d{64,128}.cu:
//     nvfp4_dit_attention_fwd_{native,emulated}_{nvfp4,mxfp8}_d{64,128}[_sparse](AttentionFwdParams)
//         dense or block-sparse; each writes the LSE where AttentionFwdParams::lse is set
//   attention/mma_probe.cu:
//     nvfp4_dit_mma_probe_nvfp4_{native,emulated}_{4 * thread-id-a + thread-id-b}(a, b, sfa, sfb, c, d)
//     nvfp4_dit_mma_probe_mxfp8_{native,emulated}_{16 * thread-id-a + 4 * thread-id-b + byte-id}(...)
//   quantize/quantize_tiles.cu, every input read as 16-byte vectors (D == Dp, unit stride, 16-byte
//   rows: the host copies any other), through a video call's tile order where
//   QuantizeQkvParams::order is active; the statistics per padded head dim d{64,128} (any input
//   dtype, QuantizeQkvParams::dtype), the tiles per input {bf16,fp16,fp32} and padded head dim:
//     nvfp4_dit_balance_statistics_d<DP>(QuantizeQkvParams)                    launch 0 (balance_qk)
//     nvfp4_dit_key_stats_d<DP>(QuantizeQkvParams)                             launch 1
//     nvfp4_dit_q_means_<dtype>_d<DP>(QuantizeQkvParams)                     launch 2 (a CTA per Q tile)
//     (quantize/smoothing_basis.cu) nvfp4_dit_smoothing_basis_d<DP>(QuantizeQkvParams)
//         launch 3 (a CTA per query head, kSmoothingBasisSmemBytes of dynamic shared memory)
//     nvfp4_dit_quantize_tiles_<dtype>_d<DP>_{nvfp4,mxfp8}(QuantizeQkvParams, int32 fix_up)
//         the K tiles (and their key projections) and the Q tiles: launch 4 (fix_up 0: one CTA per
//         tile), launch 6 (fix_up 1: the K tiles to their heads' scales)
//     nvfp4_dit_quantize_v_tiles_<dtype>_d<DP>(QuantizeQkvParams, int32 fix_up)
//         the V^T tiles: launch 5 (fix_up 0), launch 7 (fix_up 1)
//   quantize/block_lists.cu:
//     nvfp4_dit_block_map_rows(BlockListsParams)          grid (rows, B * H)
//     nvfp4_dit_block_map_rows_by_warp(BlockListsParams)  grid (ceil(rows / warps), B * H)
//     nvfp4_dit_block_list_rows(BlockListsParams)         grid (ceil(rows / 4), B * H)
#pragma once

namespace nvfp4_dit {
namespace launch {

// Attention: one persistent CTA of 8 warps per 128-row Q block at a time; dynamic shared memory
// per [Q·Kᵀ format: nvfp4, mxfp8][padded head dim: 64, 128] (AttentionTraits::kSmemBytes).
constexpr int kAttentionThreads = 256;
constexpr int kAttentionSmemBytes[2][2] = {{53760, 90624}, {69120, 91008}};

// The MMA probes: one warp.
constexpr int kProbeThreads = 32;

// The tile quantiser: one CTA per work item. The smoothing basis: one CTA per query head, dynamic
// shared memory per padded head dim 64, 128 (quantize/smoothing.cuh, BasisStorage).
constexpr int kQuantizeThreads = 256;
constexpr int kSmoothingBasisSmemBytes[2] = {29568, 90752};

// The block map and its lists: the threads that estimate a map row hold its tile masses in
// registers, 32 per thread in a warp per row (block_map_rows_by_warp: rows of at most
// kBlockMapWarpMaxTiles tiles, 131,072 keys), 16 per thread in a CTA per row (block_map_rows), so
// a row has at most kBlockListsMaxTiles tiles (524,288 keys); longer rows use the PyTorch
// estimate. block_list_rows takes a warp per map row.
constexpr int kBlockListsThreads = 256;
constexpr int kBlockListsMaxTiles = 4096;
constexpr int kBlockMapWarpMaxTiles = 1024;
constexpr int kBlockListRowsPerCta = 4;

}  // namespace launch
}  // namespace nvfp4_dit
