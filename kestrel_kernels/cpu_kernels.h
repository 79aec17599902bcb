// The CPU kernels' entry points (kestrel_kernels/cpu_*.cpp), bound to Python in cpu_module.cpp.
#pragma once

#include <torch/extension.h>

#include <string>
#include <vector>

// cpu_q4.cpp
torch::Tensor q4_1_linear(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& dm);
torch::Tensor q8_0_linear(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& d, int64_t rows);
std::vector<torch::Tensor> quantize_activations(const torch::Tensor& x);
// The Q4_1 and Q8_0 kernels' code products: "auto" (VNNI where the CPU has it) or "avx2".
void set_q4_isa(const std::string& isa);
std::string q4_isa();  // "avxvnni", "avx512vnni" or "avx2": the one the kernels use now

// cpu_attention.cpp
// Which keys each query token sees, read once from the attention metadata (kv_index [B, L],
// mask [B, 1, Q, L], q_batch and q_slot [T]): every layer of a forward reuses it.
struct AttentionKeys {
  std::vector<std::vector<int64_t>> rows_of;  // [B] each request's query tokens, in order
  std::vector<std::vector<int64_t>> slots;  // [T] each query token's key slots, in order
};
AttentionKeys attention_keys(const torch::Tensor& kv_index, const torch::Tensor& mask, const torch::Tensor& q_batch,
                             const torch::Tensor& q_slot);
torch::Tensor paged_attention_over(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                                   const AttentionKeys& keys, double scale);
// attention_keys, then paged_attention_over.
torch::Tensor paged_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                              const torch::Tensor& kv_index, const torch::Tensor& mask,
                              const torch::Tensor& q_batch, const torch::Tensor& q_slot, double scale);

// cpu_layer_ops.cpp
std::vector<torch::Tensor> add_rmsnorm(const torch::Tensor& x, const c10::optional<torch::Tensor>& residual,
                                       const torch::Tensor& weight, double eps);
torch::Tensor rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);
torch::Tensor silu_and_mul(const torch::Tensor& gate_up);

// cpu_decoder.cpp: a packed model's decoder layers, forwarded in one call.
class PackedStack {
 public:
  // Per layer, in order: input norm weight, qkv codes and dm, o codes and dm, post-attention
  // norm weight, gate_up codes and dm, down codes and dm.
  static constexpr int64_t kPerLayer = 10;
  PackedStack(std::vector<torch::Tensor> layers, torch::Tensor final_norm, int64_t num_heads, int64_t num_kv_heads,
              int64_t head_dim, double eps);
  // x [T, H] embeddings; cos, sin [T, D]; the caches [layers, slots, Hkv, D]; loc [T] the new
  // tokens' slots; the attention metadata as paged_attention takes it -> (final-normed
  // hidden [T, H], then the residual stream entering each of aux_layers (num_layers: the
  // last layer's output)).
  std::vector<torch::Tensor> forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                                     const torch::Tensor& k_all, const torch::Tensor& v_all, const torch::Tensor& loc,
                                     const torch::Tensor& kv_index, const torch::Tensor& mask,
                                     const torch::Tensor& q_batch, const torch::Tensor& q_slot, double scale,
                                     const std::vector<int64_t>& aux_layers) const;

 private:
  std::vector<torch::Tensor> layers_;
  torch::Tensor final_norm_;
  int64_t heads_, kv_heads_, head_dim_;
  double eps_;
};
