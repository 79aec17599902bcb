// The CPU kernels' entry points (kestrel_kernels/cpu_*.cpp), bound to Python in cpu_module.cpp.
#pragma once

#include <torch/extension.h>

#include <vector>

// cpu_q4.cpp
torch::Tensor q4_1_linear(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& dm);
torch::Tensor q8_0_linear(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& d, int64_t rows);
std::vector<torch::Tensor> quantize_activations(const torch::Tensor& x);

// cpu_attention.cpp
torch::Tensor paged_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                              const torch::Tensor& kv_index, const torch::Tensor& mask,
                              const torch::Tensor& q_batch, const torch::Tensor& q_slot, double scale);

// cpu_layer_ops.cpp
std::vector<torch::Tensor> add_rmsnorm(const torch::Tensor& x, const c10::optional<torch::Tensor>& residual,
                                       const torch::Tensor& weight, double eps);
torch::Tensor rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);
torch::Tensor silu_and_mul(const torch::Tensor& gate_up);
