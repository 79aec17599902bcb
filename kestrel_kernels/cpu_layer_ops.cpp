// A decoder layer's elementwise ops on the CPU, each one pass in place of several torch ops
// (float32, rows independent of each other, so batch-invariant). The torch references are
// kestrel_kernels/rmsnorm.py, rope.py and activation.py (kestrel_kernels/cpu_layer_ops.py).
#include <immintrin.h>

#include <ATen/Parallel.h>

#include <cmath>

#include "cpu_kernels.h"

namespace {

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.scalar_type() == torch::kFloat32 && t.stride(1) == 1 && t.is_cpu(), name,
              " must be a float32 [T, H] CPU tensor with contiguous rows");
}

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

}  // namespace

std::vector<torch::Tensor> add_rmsnorm(const torch::Tensor& x, const c10::optional<torch::Tensor>& residual,
                                       const torch::Tensor& weight, double eps) {
  check_rows(x, "x");
  const int64_t T = x.size(0), H = x.size(1);
  TORCH_CHECK(H % 8 == 0 && weight.is_contiguous() && weight.numel() == H && weight.scalar_type() == torch::kFloat32,
              "weight must be float32 [H], H a multiple of 8");
  if (residual) check_rows(*residual, "residual");
  auto out = torch::empty({T, H}, x.options());
  auto sum = residual ? torch::empty({T, H}, x.options()) : x;
  const float* w = weight.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    const float* xr = x.data_ptr<float>() + t * x.stride(0);
    const float* src = xr;
    if (residual) {
      const float* rr = residual->data_ptr<float>() + t * residual->stride(0);
      float* sr = sum.data_ptr<float>() + t * H;
      for (int64_t h = 0; h < H; h += 8)
        _mm256_storeu_ps(sr + h, _mm256_add_ps(_mm256_loadu_ps(xr + h), _mm256_loadu_ps(rr + h)));
      src = sr;
    }
    __m256 sq = _mm256_setzero_ps();
    for (int64_t h = 0; h < H; h += 8) {
      const __m256 v = _mm256_loadu_ps(src + h);
      sq = _mm256_fmadd_ps(v, v, sq);
    }
    const float inv = 1.0f / std::sqrt(hsum8(sq) / static_cast<float>(H) + static_cast<float>(eps));
    const __m256 vinv = _mm256_set1_ps(inv);
    float* o = out.data_ptr<float>() + t * H;
    for (int64_t h = 0; h < H; h += 8)
      _mm256_storeu_ps(o + h, _mm256_mul_ps(_mm256_loadu_ps(w + h), _mm256_mul_ps(_mm256_loadu_ps(src + h), vinv)));
  }
  return {out, sum};
}

// x [T, heads, D] (rows of a wider tensor allowed) rotated in HF's rotate_half layout by
// cos, sin [T, D]: out_i = x_i cos_i - x_{i+D/2} sin_i for i < D/2, x_i cos_i + x_{i-D/2} sin_i
// after; each product rounded, then the sum, as the torch reference does.
torch::Tensor rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == torch::kFloat32 && x.stride(2) == 1, "x must be float32 [T, heads, D]");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == torch::kFloat32 &&
                  sin.scalar_type() == torch::kFloat32,
              "cos and sin must be contiguous float32 [T, D]");
  const int64_t T = x.size(0), heads = x.size(1), D = x.size(2), half = D / 2;
  TORCH_CHECK(half % 8 == 0 && cos.size(0) == T && cos.size(1) == D, "unsupported rotary sizes");
  auto out = torch::empty({T, heads, D}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    const float *c = cos.data_ptr<float>() + t * D, *s = sin.data_ptr<float>() + t * D;
    for (int64_t h = 0; h < heads; ++h) {
      const float* xr = xp + t * x.stride(0) + h * x.stride(1);
      float* o = op + (t * heads + h) * D;
      for (int64_t i = 0; i < half; i += 8) {
        const __m256 a = _mm256_loadu_ps(xr + i), b = _mm256_loadu_ps(xr + half + i);
        _mm256_storeu_ps(o + i, _mm256_sub_ps(_mm256_mul_ps(a, _mm256_loadu_ps(c + i)),
                                              _mm256_mul_ps(b, _mm256_loadu_ps(s + i))));
        _mm256_storeu_ps(o + half + i, _mm256_add_ps(_mm256_mul_ps(b, _mm256_loadu_ps(c + half + i)),
                                                     _mm256_mul_ps(a, _mm256_loadu_ps(s + half + i))));
      }
    }
  }
  return out;
}

// gate_up [T, 2I] (gate, then up) -> silu(gate) * up [T, I], silu(g) = g / (1 + e^-g).
torch::Tensor silu_and_mul(const torch::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  auto out = torch::empty({T, I}, gate_up.options());
  for (int64_t t = 0; t < T; ++t) {
    const float* g = gate_up.data_ptr<float>() + t * gate_up.stride(0);
    float* o = out.data_ptr<float>() + t * I;
    for (int64_t i = 0; i < I; ++i) o[i] = g[i] / (1.0f + std::exp(-g[i])) * g[I + i];
  }
  return out;
}
