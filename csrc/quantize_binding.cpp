// The torch binding: the only place in csrc/ that sees at::Tensor for the quantize ops.
//
// Owns the op namespace (TORCH_LIBRARY(nvfp4_dit_cuda)); other TUs add their ops with
// TORCH_LIBRARY_FRAGMENT. Checks here are last-line guards (TORCH_CHECK); the Python wrappers in
// nvfp4_dit/cuda_quantize.py raise the user-facing ValueError/TypeError first.
#include <cstdlib>
#include <string>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>
#include <torch/types.h>

#include "quantize/quantize.cuh"

namespace {

using nvfp4_dit::InputDtype;
using nvfp4_dit::StridedInput;

InputDtype input_dtype(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kBFloat16: return InputDtype::kBFloat16;
    case at::kHalf: return InputDtype::kFloat16;
    case at::kFloat: return InputDtype::kFloat32;
    default: TORCH_CHECK(false, "nvfp4_dit_cuda: inputs must be bfloat16, float16 or float32, got ", t.scalar_type());
  }
}

// A logical [B, H, S, D] view (HND order; NHD callers pass a transposed view, no copy).
StridedInput strided(const at::Tensor& t) {
  return StridedInput{t.data_ptr(), t.stride(0), t.stride(1), t.stride(2), t.stride(3)};
}

int64_t checked_padded_head_dim(int64_t d) {
  const int64_t dp = nvfp4_dit::padded_head_dim(d);
  TORCH_CHECK(dp > 0, "nvfp4_dit_cuda: head dim must be in [1, ", nvfp4_dit::kMaxHeadDim, "], got ", d);
  return dp;
}

// kv_lens as the kernels read it: [B] int32/int64 on the device, contiguous (undefined if absent).
at::Tensor checked_kv_lens(const std::optional<at::Tensor>& kv_lens, int64_t batch, const at::Device& device,
                           const char* op) {
  if (!kv_lens.has_value()) return at::Tensor();
  const at::Tensor& lens = *kv_lens;
  TORCH_CHECK(lens.device() == device, "nvfp4_dit_cuda::", op, ": kv_lens must be on the inputs' device");
  TORCH_CHECK(lens.dim() == 1 && lens.size(0) == batch, "nvfp4_dit_cuda::", op, ": kv_lens must be [B]");
  TORCH_CHECK(lens.scalar_type() == at::kInt || lens.scalar_type() == at::kLong,
              "nvfp4_dit_cuda::", op, ": kv_lens must be int32 or int64");
  return lens.contiguous();
}

int64_t round_up_128(int64_t n) { return (std::max<int64_t>(n, 1) + 127) / 128 * 128; }

// NVFP4_DIT_QUANTIZE_KERNEL: unset or "auto" (the streaming kernel where it applies, else the tile
// kernel), "tiles" or "stream" (force one; tests and scripts/bench_quantize.py run each).
nvfp4_dit::QuantizeKernel quantize_kernel_choice() {
  const char* env = std::getenv("NVFP4_DIT_QUANTIZE_KERNEL");
  const std::string value = env == nullptr ? "" : env;
  if (value.empty() || value == "auto") return nvfp4_dit::QuantizeKernel::kAuto;
  if (value == "tiles") return nvfp4_dit::QuantizeKernel::kTiles;
  if (value == "stream") return nvfp4_dit::QuantizeKernel::kStream;
  TORCH_CHECK(false, "NVFP4_DIT_QUANTIZE_KERNEL must be auto, tiles or stream, not '", value, "'");
}

std::vector<at::Tensor> quantize_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                     const std::optional<at::Tensor>& kv_lens, bool balance_qk, bool qk_mxfp8) {
  // Q and K: e2m1 (2 per byte, a scale per 16) or e4m3 (1 per byte, a scale per 32).
  const int64_t qk_per_byte = qk_mxfp8 ? 1 : 2, qk_per_scale = qk_mxfp8 ? 32 : 16;
  TORCH_CHECK(q.is_cuda() && k.is_cuda() && v.is_cuda(), "nvfp4_dit_cuda::quantize_qkv: q, k, v must be CUDA tensors");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "nvfp4_dit_cuda::quantize_qkv: q, k, v must be 4-D [B, H, S, D]");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "nvfp4_dit_cuda::quantize_qkv: q, k, v must share a dtype");
  TORCH_CHECK(k.device() == q.device() && v.device() == q.device(), "nvfp4_dit_cuda::quantize_qkv: q, k, v on one device");
  const int64_t b = q.size(0), h = q.size(1), sq = q.size(2), d = q.size(3);
  const int64_t hkv = k.size(1), sk = k.size(2);
  TORCH_CHECK(k.size(0) == b && v.size(0) == b && v.size(1) == hkv && v.size(2) == sk && k.size(3) == d && v.size(3) == d,
              "nvfp4_dit_cuda::quantize_qkv: shape mismatch between q, k, v");
  TORCH_CHECK(hkv > 0 && h % hkv == 0, "nvfp4_dit_cuda::quantize_qkv: heads of q must be a multiple of heads of k");
  const int64_t dp = checked_padded_head_dim(d);
  const int64_t sqp = round_up_128(sq), skp = round_up_128(sk);
  const c10::cuda::CUDAGuard guard(q.device());
  const auto u8 = q.options().dtype(at::kByte);
  const auto f32 = q.options().dtype(at::kFloat);

  at::Tensor q_data = at::empty({b, h, sqp, dp / qk_per_byte}, u8);
  at::Tensor q_sf = at::empty({b, h, sqp, dp / qk_per_scale}, u8);
  at::Tensor k_data = at::empty({b, hkv, skp, dp / qk_per_byte}, u8);
  at::Tensor k_sf = at::empty({b, hkv, skp, dp / qk_per_scale}, u8);
  at::Tensor vt_data = at::empty({b, hkv, dp, skp / 2}, u8);
  at::Tensor vt_sf = at::empty({b, hkv, dp, skp / 16}, u8);
  at::Tensor q_mean = at::empty({b, h, sqp / 128, dp}, f32);
  at::Tensor k_mean = at::empty({b, hkv, dp}, f32);
  at::Tensor v_mean = at::empty({b, hkv, dp}, f32);
  at::Tensor q_scale = at::empty({b, h, sqp / 128}, f32);
  at::Tensor k_scale = at::empty({b, hkv}, f32);
  at::Tensor v_scale = at::empty({b, hkv}, f32);
  at::Tensor balance = at::empty({b, hkv, dp}, f32);
  at::Tensor q_dot_km = at::empty({b, h, sq}, f32);
  const nvfp4_dit::QuantizeKernel kernel = quantize_kernel_choice();
  const bool streaming = kernel != nvfp4_dit::QuantizeKernel::kTiles;  // may run the streaming kernel
  at::Tensor partial = at::empty({nvfp4_dit::quantize_qkv_workspace_floats(b, hkv, sk, dp, streaming)}, f32);
  // One zeroed int32 buffer (one memset): the work counters, the non-finite flags, then (balance_qk)
  // the channel statistics of Q.
  const int64_t n_counters = nvfp4_dit::quantize_qkv_workspace_counters(b, hkv, sk);
  const int64_t n_flags = b * hkv + b * h * (sqp / 128);
  const int64_t n_q_stats = balance_qk ? b * hkv * dp : 0;
  at::Tensor counters = at::zeros({n_counters + n_flags + n_q_stats}, q.options().dtype(at::kInt));
  at::Tensor nonfinite_kv = counters.narrow(0, n_counters, b * hkv).view({b, hkv});
  at::Tensor nonfinite_q = counters.narrow(0, n_counters + b * hkv, b * h * (sqp / 128)).view({b, h, sqp / 128});

  const at::Tensor lens = checked_kv_lens(kv_lens, b, q.device(), "quantize_qkv");

  nvfp4_dit::QuantizeQkvParams p{};
  p.q = strided(q);
  p.k = strided(k);
  p.v = strided(v);
  p.dtype = input_dtype(q);
  p.kv_lens = lens.defined() ? lens.data_ptr() : nullptr;
  p.kv_lens_int64 = lens.defined() && lens.scalar_type() == at::kLong;
  p.batch = b;
  p.heads_q = h;
  p.heads_kv = hkv;
  p.seq_q = sq;
  p.seq_k = sk;
  p.head_dim = d;
  p.head_dim_padded = dp;
  p.seq_q_padded = sqp;
  p.seq_k_padded = skp;
  p.q_data = q_data.data_ptr<uint8_t>();
  p.q_sf = q_sf.data_ptr<uint8_t>();
  p.k_data = k_data.data_ptr<uint8_t>();
  p.k_sf = k_sf.data_ptr<uint8_t>();
  p.vt_data = vt_data.data_ptr<uint8_t>();
  p.vt_sf = vt_sf.data_ptr<uint8_t>();
  p.q_mean = q_mean.data_ptr<float>();
  p.k_mean = k_mean.data_ptr<float>();
  p.v_mean = v_mean.data_ptr<float>();
  p.q_scale = q_scale.data_ptr<float>();
  p.k_scale = k_scale.data_ptr<float>();
  p.v_scale = v_scale.data_ptr<float>();
  p.balance = balance.data_ptr<float>();
  p.q_dot_km = q_dot_km.data_ptr<float>();
  p.balance_qk = balance_qk;
  p.qk_mxfp8 = qk_mxfp8;
  p.q_channel_amax = balance_qk
      ? reinterpret_cast<const uint32_t*>(counters.narrow(0, n_counters + n_flags, n_q_stats).data_ptr<int32_t>())
      : nullptr;
  p.k_partial_sums = partial.data_ptr<float>();
  p.work_counters = reinterpret_cast<uint32_t*>(counters.data_ptr<int32_t>());
  p.nonfinite_kv = reinterpret_cast<uint32_t*>(nonfinite_kv.data_ptr<int32_t>());
  p.nonfinite_q_blocks = reinterpret_cast<uint32_t*>(nonfinite_q.data_ptr<int32_t>());
  p.kernel = kernel;
  const cudaError_t err = nvfp4_dit::launch_quantize_qkv(p, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err != cudaErrorNotSupported || p.kernel != nvfp4_dit::QuantizeKernel::kStream,
              "nvfp4_dit_cuda::quantize_qkv: NVFP4_DIT_QUANTIZE_KERNEL=stream, but the streaming kernel needs "
              "bf16/fp16 inputs with contiguous 16-byte-aligned rows, D of 64 or 128, and an sm_90+ device");
  TORCH_CHECK(err == cudaSuccess, "nvfp4_dit_cuda::quantize_qkv: launch failed: ", cudaGetErrorString(err));
  return {q_data, q_sf, k_data, k_sf, vt_data, vt_sf, q_mean, k_mean, v_mean, q_scale, k_scale, v_scale, balance,
          q_dot_km, nonfinite_q, nonfinite_kv};
}

void correction(const at::Tensor& q_mean, const at::Tensor& k, const at::Tensor& k_mean, const at::Tensor& q_scale,
                const at::Tensor& k_scale, const std::optional<at::Tensor>& kv_lens, int64_t block_begin, at::Tensor& out) {
  TORCH_CHECK(q_mean.is_cuda() && k.is_cuda() && k_mean.is_cuda() && out.is_cuda(),
              "nvfp4_dit_cuda::correction: all tensors must be CUDA tensors");
  TORCH_CHECK(q_mean.scalar_type() == at::kFloat && k_mean.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "nvfp4_dit_cuda::correction: q_mean, k_mean and out must be float32");
  TORCH_CHECK(q_mean.dim() == 4 && q_mean.is_contiguous(), "nvfp4_dit_cuda::correction: q_mean must be contiguous [B, H, nblk, Dp]");
  TORCH_CHECK(k.dim() == 4, "nvfp4_dit_cuda::correction: k must be 4-D [B, Hkv, Sk, D]");
  TORCH_CHECK(k_mean.dim() == 3 && k_mean.is_contiguous(), "nvfp4_dit_cuda::correction: k_mean must be contiguous [B, Hkv, Dp]");
  TORCH_CHECK(out.dim() == 4 && out.stride(3) == 1, "nvfp4_dit_cuda::correction: out must be [B, H, n, Skp], last dim contiguous");
  const int64_t b = q_mean.size(0), h = q_mean.size(1), nblk = q_mean.size(2), dp = q_mean.size(3);
  const int64_t hkv = k.size(1), sk = k.size(2), d = k.size(3);
  const int64_t skp = round_up_128(sk);
  TORCH_CHECK(dp == checked_padded_head_dim(d), "nvfp4_dit_cuda::correction: q_mean head dim ", dp, " does not match k's ", d);
  TORCH_CHECK(k.size(0) == b && hkv > 0 && h % hkv == 0 && k_mean.size(0) == b && k_mean.size(1) == hkv && k_mean.size(2) == dp,
              "nvfp4_dit_cuda::correction: shape mismatch between q_mean, k, k_mean");
  TORCH_CHECK(out.size(0) == b && out.size(1) == h && out.size(3) == skp,
              "nvfp4_dit_cuda::correction: out must be [B, H, n, Skp] with Skp = ", skp);
  TORCH_CHECK(block_begin >= 0 && block_begin + out.size(2) <= nblk, "nvfp4_dit_cuda::correction: blocks [", block_begin,
              ", ", block_begin + out.size(2), ") outside [0, ", nblk, ")");
  const at::Tensor lens = checked_kv_lens(kv_lens, b, q_mean.device(), "correction");
  const c10::cuda::CUDAGuard guard(q_mean.device());
  nvfp4_dit::CorrectionParams p{};
  p.kv_lens = lens.defined() ? lens.data_ptr() : nullptr;
  p.kv_lens_int64 = lens.defined() && lens.scalar_type() == at::kLong;
  p.q_mean = q_mean.data_ptr<float>();
  p.k = strided(k);
  p.dtype = input_dtype(k);
  p.k_mean = k_mean.data_ptr<float>();
  TORCH_CHECK(q_scale.is_cuda() && q_scale.scalar_type() == at::kFloat && q_scale.is_contiguous() &&
                  q_scale.sizes() == at::IntArrayRef({b, h, nblk}),
              "nvfp4_dit_cuda::correction: q_scale must be contiguous float32 [B, H, nblk]");
  TORCH_CHECK(k_scale.is_cuda() && k_scale.scalar_type() == at::kFloat && k_scale.is_contiguous() &&
                  k_scale.sizes() == at::IntArrayRef({b, hkv}),
              "nvfp4_dit_cuda::correction: k_scale must be contiguous float32 [B, Hkv]");
  p.q_scale = q_scale.data_ptr<float>();
  p.k_scale = k_scale.data_ptr<float>();
  p.delta = out.data_ptr<float>();
  p.delta_stride_b = out.stride(0);
  p.delta_stride_h = out.stride(1);
  p.delta_stride_blk = out.stride(2);
  p.batch = b;
  p.heads_q = h;
  p.heads_kv = hkv;
  p.seq_k = sk;
  p.seq_k_padded = skp;
  p.head_dim = d;
  p.head_dim_padded = dp;
  p.num_q_blocks = nblk;
  p.block_begin = block_begin;
  p.block_end = block_begin + out.size(2);
  const cudaError_t err = nvfp4_dit::launch_correction(p, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == cudaSuccess, "nvfp4_dit_cuda::correction: launch failed: ", cudaGetErrorString(err));
}

}  // namespace

TORCH_LIBRARY(nvfp4_dit_cuda, m) {
  m.def("quantize_qkv(Tensor q, Tensor k, Tensor v, Tensor? kv_lens, bool balance_qk, bool qk_mxfp8) -> Tensor[]");
  m.def("correction(Tensor q_mean, Tensor k, Tensor k_mean, Tensor q_scale, Tensor k_scale, Tensor? kv_lens, "
        "int block_begin, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(nvfp4_dit_cuda, CUDA, m) {
  m.impl("quantize_qkv", &quantize_qkv);
  m.impl("correction", &correction);
}
