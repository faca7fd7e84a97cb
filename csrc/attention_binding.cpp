// Thin torch binding of the NVFP4 attention kernel: checks tensors, fills AttentionFwdParams,
// launches. Ops join the nvfp4_dit_cuda library (the TORCH_LIBRARY block is csrc/quantize_binding.cpp).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cmath>

#include "attention/api.h"
#include "common/config.h"

namespace {

using nvfp4_dit::AttentionFwdParams;

void check_plane(const at::Tensor& t, const char* name, const at::Tensor& like) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
  TORCH_CHECK(t.device() == like.device(), name, " is on ", t.device(), ", expected ", like.device());
  TORCH_CHECK(t.scalar_type() == at::kByte, name, " must be uint8, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 4, name, " must be 4-D, got ", t.dim(), "-D");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

void attention_fwd(const at::Tensor& q_data, const at::Tensor& q_sf, const at::Tensor& k_data,
                   const at::Tensor& k_sf, const at::Tensor& vt_data, const at::Tensor& vt_sf,
                   const at::Tensor& delta, const at::Tensor& q_dot_km, const at::Tensor& q_scale,
                   const at::Tensor& k_scale, const at::Tensor& v_scale, const at::Tensor& v_mean,
                   const std::optional<at::Tensor>& kv_lens,
                   const at::Tensor& out, const std::optional<at::Tensor>& lse, int64_t seq_q, int64_t seq_k,
                   int64_t q_block_begin, int64_t q_block_end, double scale, bool causal, bool native,
                   int64_t qk_format) {
  TORCH_CHECK(qk_format == 0 || qk_format == 1, "qk_format must be 0 (nvfp4) or 1 (mxfp8), got ", qk_format);
  // Q and K: e2m1 (2 per byte, a scale per 16) or e4m3 (1 per byte, a scale per 32).
  const int64_t per_byte = qk_format == 0 ? 2 : 1, per_scale = qk_format == 0 ? 16 : 32;
  check_plane(q_data, "q_data", q_data);
  check_plane(q_sf, "q_sf", q_data);
  check_plane(k_data, "k_data", q_data);
  check_plane(k_sf, "k_sf", q_data);
  check_plane(vt_data, "vt_data", q_data);
  check_plane(vt_sf, "vt_sf", q_data);
  const int64_t B = q_data.size(0), H = q_data.size(1), sqp = q_data.size(2), dp = q_data.size(3) * per_byte;
  const int64_t hkv = k_data.size(1), skp = k_data.size(2);
  TORCH_CHECK(nvfp4_dit::padded_head_dim(dp) == dp, "padded head dim ", dp, " has no kernel instantiation");
  TORCH_CHECK(sqp % 128 == 0 && skp % 128 == 0, "sequences must be padded to multiples of 128");
  TORCH_CHECK(hkv > 0 && H % hkv == 0, "q heads ", H, " not a multiple of kv heads ", hkv);
  TORCH_CHECK(q_sf.sizes() == at::IntArrayRef({B, H, sqp, dp / per_scale}), "q_sf shape ", q_sf.sizes());
  TORCH_CHECK(k_data.sizes() == at::IntArrayRef({B, hkv, skp, dp / per_byte}), "k_data shape ", k_data.sizes());
  TORCH_CHECK(k_sf.sizes() == at::IntArrayRef({B, hkv, skp, dp / per_scale}), "k_sf shape ", k_sf.sizes());
  TORCH_CHECK(vt_data.sizes() == at::IntArrayRef({B, hkv, dp, skp / 2}), "vt_data shape ", vt_data.sizes());
  TORCH_CHECK(vt_sf.sizes() == at::IntArrayRef({B, hkv, dp, skp / 16}), "vt_sf shape ", vt_sf.sizes());
  TORCH_CHECK(0 < seq_q && seq_q <= sqp && 0 < seq_k && seq_k <= skp, "bad seq_q/seq_k ", seq_q, "/", seq_k);
  TORCH_CHECK(0 <= q_block_begin && q_block_begin < q_block_end && q_block_end * 128 <= sqp,
              "q block range [", q_block_begin, ", ", q_block_end, ") out of range");
  const int64_t nblk = q_block_end - q_block_begin;

  TORCH_CHECK(delta.is_cuda() && delta.device() == q_data.device() && delta.scalar_type() == at::kFloat &&
                  delta.dim() == 4, "delta must be a float32 4-D CUDA tensor on q's device");
  TORCH_CHECK(delta.size(0) == B && delta.size(1) == H && (delta.size(2) == nblk || delta.size(2) == 1) &&
                  delta.size(3) == skp, "delta shape ", delta.sizes(), " expected [", B, ", ", H, ", ", nblk, ", ", skp, "]");
  TORCH_CHECK(delta.stride(3) == 1 && delta.stride(0) % 4 == 0 && delta.stride(1) % 4 == 0 &&
                  delta.stride(2) % 4 == 0 && reinterpret_cast<uintptr_t>(delta.data_ptr()) % 16 == 0,
              "delta rows must be contiguous and 16-byte aligned");
  TORCH_CHECK(q_dot_km.is_cuda() && q_dot_km.scalar_type() == at::kFloat && q_dot_km.dim() == 3 &&
                  q_dot_km.size(0) == B && q_dot_km.size(1) == H && q_dot_km.size(2) >= seq_q && q_dot_km.stride(2) == 1,
              "q_dot_km must be float32 [B, H, Sq] with a contiguous last dim");
  auto check_f32 = [&](const at::Tensor& t, const char* name, at::IntArrayRef shape) {
    TORCH_CHECK(t.is_cuda() && t.device() == q_data.device() && t.scalar_type() == at::kFloat && t.is_contiguous() &&
                    t.sizes() == shape, name, " must be a contiguous float32 CUDA tensor of shape ", shape, ", got ",
                t.sizes());
  };
  check_f32(q_scale, "q_scale", {B, H, sqp / 128});
  check_f32(k_scale, "k_scale", {B, hkv});
  check_f32(v_scale, "v_scale", {B, hkv});
  check_f32(v_mean, "v_mean", {B, hkv, dp});
  TORCH_CHECK(out.is_cuda() && out.device() == q_data.device() && out.dim() == 4 &&
                  (out.scalar_type() == at::kBFloat16 || out.scalar_type() == at::kHalf),
              "out must be a bf16/fp16 4-D CUDA tensor [B, H, Sq, D] (any batch/head/seq strides)");
  TORCH_CHECK(out.size(0) == B && out.size(1) == H && out.size(2) == seq_q && out.size(3) <= dp && out.stride(3) == 1,
              "out shape ", out.sizes(), " / strides ", out.strides());
  if (kv_lens.has_value()) {
    TORCH_CHECK(kv_lens->is_cuda() && kv_lens->scalar_type() == at::kInt && kv_lens->dim() == 1 &&
                    kv_lens->size(0) == B && kv_lens->is_contiguous(), "kv_lens must be int32 [B] contiguous on the GPU");
  }
  if (lse.has_value()) {
    TORCH_CHECK(lse->is_cuda() && lse->scalar_type() == at::kFloat && lse->dim() == 3 && lse->size(0) == B &&
                    lse->size(1) == H && lse->size(2) == seq_q && lse->stride(2) == 1,
                "lse must be float32 [B, H, Sq] with a contiguous last dim");
  }

  AttentionFwdParams p{};
  p.q_data = q_data.data_ptr<uint8_t>();
  p.q_sf = q_sf.data_ptr<uint8_t>();
  p.k_data = k_data.data_ptr<uint8_t>();
  p.k_sf = k_sf.data_ptr<uint8_t>();
  p.vt_data = vt_data.data_ptr<uint8_t>();
  p.vt_sf = vt_sf.data_ptr<uint8_t>();
  p.q_stride_b = q_data.stride(0); p.q_stride_h = q_data.stride(1);
  p.qsf_stride_b = q_sf.stride(0); p.qsf_stride_h = q_sf.stride(1);
  p.k_stride_b = k_data.stride(0); p.k_stride_h = k_data.stride(1);
  p.ksf_stride_b = k_sf.stride(0); p.ksf_stride_h = k_sf.stride(1);
  p.vt_stride_b = vt_data.stride(0); p.vt_stride_h = vt_data.stride(1);
  p.vtsf_stride_b = vt_sf.stride(0); p.vtsf_stride_h = vt_sf.stride(1);
  p.delta = delta.data_ptr<float>();
  p.delta_stride_b = delta.stride(0); p.delta_stride_h = delta.stride(1);
  p.delta_stride_blk = delta.size(2) == 1 ? 0 : delta.stride(2);
  p.q_dot_km = q_dot_km.data_ptr<float>();
  p.qdk_stride_b = q_dot_km.stride(0); p.qdk_stride_h = q_dot_km.stride(1);
  p.q_scale = q_scale.data_ptr<float>();
  p.k_scale = k_scale.data_ptr<float>();
  p.v_scale = v_scale.data_ptr<float>();
  p.v_mean = v_mean.data_ptr<float>();
  p.kv_lens = kv_lens.has_value() ? kv_lens->data_ptr<int32_t>() : nullptr;
  p.out = out.data_ptr();
  p.out_stride_b = out.stride(0); p.out_stride_h = out.stride(1); p.out_stride_s = out.stride(2);
  p.lse = lse.has_value() ? lse->data_ptr<float>() : nullptr;
  if (lse.has_value()) { p.lse_stride_b = lse->stride(0); p.lse_stride_h = lse->stride(1); }
  p.batch = int(B); p.heads = int(H); p.kv_heads = int(hkv);
  p.seq_q = int(seq_q); p.seq_k = int(seq_k); p.seq_q_pad = int(sqp); p.seq_k_pad = int(skp);
  p.head_dim_out = int(out.size(3));
  p.q_block_begin = int(q_block_begin); p.q_block_end = int(q_block_end);
  p.scale = float(scale);
  p.scale_log2 = float(scale * 1.4426950408889634);
  p.causal = causal ? 1 : 0;
  p.out_bf16 = out.scalar_type() == at::kBFloat16 ? 1 : 0;
  p.out_vec2 = (out.stride(0) % 2 == 0 && out.stride(1) % 2 == 0 && out.stride(2) % 2 == 0 &&
                reinterpret_cast<uintptr_t>(out.data_ptr()) % 4 == 0) ? 1 : 0;

  const c10::cuda::CUDAGuard guard(q_data.device());
  const cudaError_t err = nvfp4_dit::attention_fwd(p, int(dp), lse.has_value(), native,
                                                    static_cast<nvfp4_dit::QkFormat>(qk_format),
                                                    at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "nvfp4 attention launch failed: ", cudaGetErrorString(err));
}

// One warp's registers of a probe MMA: a [32, 4], b [32, 2], sfa, sfb [32] int32, c [32, 4] fp32.
void check_probe_registers(const at::Tensor& a, const at::Tensor& b, const at::Tensor& sfa, const at::Tensor& sfb,
                           const at::Tensor& c, int64_t tid_a, int64_t tid_b) {
  TORCH_CHECK(tid_a >= 0 && tid_a <= 1, "thread-id-a must be 0 or 1, got ", tid_a);
  TORCH_CHECK(tid_b >= 0 && tid_b <= 3, "thread-id-b must be in 0..3, got ", tid_b);
  auto chk = [](const at::Tensor& t, at::ScalarType st, std::vector<int64_t> shape, const char* name) {
    TORCH_CHECK(t.is_cuda() && t.scalar_type() == st && t.sizes() == at::IntArrayRef(shape) && t.is_contiguous(),
                name, " must be a contiguous CUDA ", st, " tensor of shape ", at::IntArrayRef(shape));
  };
  chk(a, at::kInt, {32, 4}, "a");
  chk(b, at::kInt, {32, 2}, "b");
  chk(sfa, at::kInt, {32}, "sfa");
  chk(sfb, at::kInt, {32}, "sfb");
  chk(c, at::kFloat, {32, 4}, "c");
}

const uint32_t* words(const at::Tensor& t) { return reinterpret_cast<const uint32_t*>(t.data_ptr<int32_t>()); }

at::Tensor mma_fp4_probe(const at::Tensor& a, const at::Tensor& b, const at::Tensor& sfa, const at::Tensor& sfb,
                         const at::Tensor& c, int64_t tid_a, int64_t tid_b, bool native) {
  check_probe_registers(a, b, sfa, sfb, c, tid_a, tid_b);
  const c10::cuda::CUDAGuard guard(a.device());
  at::Tensor d = at::empty({32, 4}, c.options());
  const cudaError_t err = nvfp4_dit::mma_fp4_probe(words(a), words(b), words(sfa), words(sfb), c.data_ptr<float>(),
                                                   d.data_ptr<float>(), int(tid_a), int(tid_b), native,
                                                   at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "mma probe launch failed: ", cudaGetErrorString(err));
  return d;
}

at::Tensor mma_mxf8_probe(const at::Tensor& a, const at::Tensor& b, const at::Tensor& sfa, const at::Tensor& sfb,
                          const at::Tensor& c, int64_t tid_a, int64_t tid_b, int64_t byte_id, bool native) {
  check_probe_registers(a, b, sfa, sfb, c, tid_a, tid_b);
  TORCH_CHECK(byte_id >= 0 && byte_id <= 3, "byte-id must be in 0..3, got ", byte_id);
  const c10::cuda::CUDAGuard guard(a.device());
  at::Tensor d = at::empty({32, 4}, c.options());
  const cudaError_t err = nvfp4_dit::mma_mxf8_probe(words(a), words(b), words(sfa), words(sfb), c.data_ptr<float>(),
                                                    d.data_ptr<float>(), int(tid_a), int(tid_b), int(byte_id), native,
                                                    at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "mma probe launch failed: ", cudaGetErrorString(err));
  return d;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(nvfp4_dit_cuda, m) {
  m.def(
      "attention_fwd(Tensor q_data, Tensor q_sf, Tensor k_data, Tensor k_sf, Tensor vt_data, Tensor vt_sf, "
      "Tensor delta, Tensor q_dot_km, Tensor q_scale, Tensor k_scale, Tensor v_scale, Tensor v_mean, Tensor? kv_lens, "
      "Tensor(a!) out, Tensor(b!)? lse, int seq_q, int seq_k, "
      "int q_block_begin, int q_block_end, float scale, bool causal, bool native, int qk_format) -> ()");
  m.def(
      "mma_fp4_probe(Tensor a, Tensor b, Tensor sfa, Tensor sfb, Tensor c, int tid_a, int tid_b, bool native) "
      "-> Tensor");
  m.def(
      "mma_mxf8_probe(Tensor a, Tensor b, Tensor sfa, Tensor sfb, Tensor c, int tid_a, int tid_b, int byte_id, "
      "bool native) -> Tensor");
}

TORCH_LIBRARY_IMPL(nvfp4_dit_cuda, CUDA, m) {
  m.impl("attention_fwd", &attention_fwd);
  m.impl("mma_fp4_probe", &mma_fp4_probe);
  m.impl("mma_mxf8_probe", &mma_mxf8_probe);
}
