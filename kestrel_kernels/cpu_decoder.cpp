// The packed decoder stack's decode and verify forward as one call (model.cpu_weights=packed):
// per layer the same kernel calls, in the same order, as the Python modules make them
// (actors/models/packed_cpu_weights.py), so the same bits, without the few dozen Python
// and torch dispatches a layer costs there (as much CPU as the layer's matmuls at one row).
#include "cpu_kernels.h"

#include <cstring>

PackedStack::PackedStack(std::vector<torch::Tensor> layers, torch::Tensor final_norm, int64_t num_heads,
                         int64_t num_kv_heads, int64_t head_dim, double eps)
    : layers_(std::move(layers)), final_norm_(std::move(final_norm)), heads_(num_heads),
      kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(eps) {
  TORCH_CHECK(layers_.size() % kPerLayer == 0, "layers: ", kPerLayer, " tensors per layer");
}

std::vector<torch::Tensor> PackedStack::forward(const torch::Tensor& x_in, const torch::Tensor& cos,
                                                const torch::Tensor& sin, const torch::Tensor& k_all,
                                                const torch::Tensor& v_all, const torch::Tensor& loc_in,
                                                const torch::Tensor& kv_index, const torch::Tensor& mask,
                                                const torch::Tensor& q_batch, const torch::Tensor& q_slot, double scale,
                                                const std::vector<int64_t>& aux_layers) const {
  const int64_t L = static_cast<int64_t>(layers_.size()) / kPerLayer, T = x_in.size(0);
  const int64_t D = head_dim_, q_width = heads_ * D, kv_width = kv_heads_ * D;
  TORCH_CHECK(k_all.scalar_type() == torch::kFloat32 && v_all.scalar_type() == torch::kFloat32 &&
                  k_all.is_contiguous() && v_all.is_contiguous() && k_all.dim() == 4 && k_all.size(0) == L &&
                  k_all.size(2) == kv_heads_ && k_all.size(3) == D && v_all.sizes() == k_all.sizes(),
              "the K/V caches must be contiguous float32 [layers, slots, Hkv, D]");
  const torch::Tensor loc = loc_in.contiguous();
  TORCH_CHECK(loc.scalar_type() == torch::kInt64 && loc.numel() == T, "loc must be int64 [T]");
  const int64_t* lp = loc.data_ptr<int64_t>();
  const int64_t slots = k_all.size(1);
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(lp[t] >= 0 && lp[t] < slots, "a KV slot out of range");
  std::vector<torch::Tensor> captured(aux_layers.size());
  auto capture = [&](int64_t i, const torch::Tensor& x, const torch::Tensor& residual) {
    for (size_t j = 0; j < aux_layers.size(); ++j)
      if (aux_layers[j] == i) captured[j] = residual.defined() ? x + residual : x;
  };
  const AttentionKeys keys = attention_keys(kv_index, mask, q_batch, q_slot);  // the same at every layer
  torch::Tensor x = x_in, residual;
  for (int64_t l = 0; l < L; ++l) {
    const torch::Tensor* w = layers_.data() + l * kPerLayer;
    capture(l, x, residual);
    std::vector<torch::Tensor> n = add_rmsnorm(x, residual.defined() ? c10::optional<torch::Tensor>(residual)
                                                                     : c10::nullopt, w[0], eps_);
    residual = n[1];
    const torch::Tensor qkv = q4_1_linear(n[0], w[1], w[2]);  // [T, q + 2 kv]
    const torch::Tensor q = rope(qkv.narrow(1, 0, q_width).view({T, heads_, D}), cos, sin);  // [T, Hq, D]
    const torch::Tensor k = rope(qkv.narrow(1, q_width, kv_width).view({T, kv_heads_, D}), cos, sin);  // [T, Hkv, D]
    const torch::Tensor kc = k_all.select(0, l), vc = v_all.select(0, l);  // [slots, Hkv, D]
    float *kp = kc.data_ptr<float>(), *vp = vc.data_ptr<float>();
    const float *ks = k.data_ptr<float>(), *vs = qkv.data_ptr<float>() + q_width + kv_width;
    for (int64_t t = 0; t < T; ++t) {  // the backend's kv_pool.store
      std::memcpy(kp + lp[t] * kv_width, ks + t * kv_width, kv_width * sizeof(float));
      std::memcpy(vp + lp[t] * kv_width, vs + t * qkv.stride(0), kv_width * sizeof(float));
    }
    const torch::Tensor o = paged_attention_over(q, kc, vc, keys, scale);  // [T, Hq, D]
    const torch::Tensor a = q4_1_linear(o.view({T, q_width}), w[3], w[4]);  // [T, H]
    n = add_rmsnorm(a, residual, w[5], eps_);
    residual = n[1];
    x = q4_1_linear(silu_and_mul(q4_1_linear(n[0], w[6], w[7])), w[8], w[9]);  // [T, H]
  }
  std::vector<torch::Tensor> n = add_rmsnorm(x, residual, final_norm_, eps_);
  capture(L, n[1], torch::Tensor());
  std::vector<torch::Tensor> out{n[0]};
  out.insert(out.end(), captured.begin(), captured.end());
  return out;
}
