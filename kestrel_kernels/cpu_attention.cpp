// Attention over the paged KV cache on the CPU, batch-invariant: each query attends to the
// keys its mask allows, in the order of its request's kv_index, by a fixed sequence of
// float32 operations, so its output does not depend on the other queries of the batch, on
// how many there are, or on the padding of kv_index: a verify's rows and a one-row decode
// step give a token the same bits. The torch reference is actors/attention/torch_native.py's
// SDPA path (kestrel_kernels/cpu_attention.py).
#include <immintrin.h>

#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

#include "cpu_kernels.h"

namespace {

constexpr int kMaxHeadDim = 256;

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// e^x for x <= 0 (scores less their maximum): 2^n * e^r with |r| <= ln2 / 2, e^r by its
// Taylor polynomial to r^6 (relative error ~2e-7); below -87 it returns 2^-126.
inline __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// One query head q [D] over keys/values at `slots` (rows of [*, D] with row stride `stride`).
void attend(const float* q, const float* kc, const float* vc, int64_t stride, const std::vector<int64_t>& slots,
            int64_t D, float scale, std::vector<float>& p, float* out) {
  const int64_t n = static_cast<int64_t>(slots.size());
  p.assign(((n + 7) / 8) * 8, -INFINITY);
  float top = -INFINITY;
  for (int64_t j = 0; j < n; ++j) {
    const float* k = kc + slots[j] * stride;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d), acc);
    p[j] = hsum8(acc) * scale;
    top = std::max(top, p[j]);
  }
  __m256 sum = _mm256_setzero_ps();
  const __m256 vtop = _mm256_set1_ps(top);
  for (int64_t j = 0; j < n; j += 8) {
    __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(&p[j]), vtop));
    if (n - j < 8) {  // the tail's padding lanes hold -inf: zero them, not 2^-126
      const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
      e = _mm256_and_ps(e, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(int(n - j)), lane)));
    }
    _mm256_storeu_ps(&p[j], e);
    sum = _mm256_add_ps(sum, e);
  }
  __m256 acc[kMaxHeadDim / 8];
  for (int64_t d = 0; d < D / 8; ++d) acc[d] = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const float* v = vc + slots[j] * stride;
    const __m256 w = _mm256_set1_ps(p[j]);
    for (int64_t d = 0; d < D / 8; ++d) acc[d] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8 * d), acc[d]);
  }
  const __m256 inv = _mm256_set1_ps(1.0f / hsum8(sum));
  for (int64_t d = 0; d < D / 8; ++d) _mm256_storeu_ps(out + 8 * d, _mm256_mul_ps(acc[d], inv));
}

}  // namespace

torch::Tensor paged_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                              const torch::Tensor& kv_index, const torch::Tensor& mask,
                              const torch::Tensor& q_batch, const torch::Tensor& q_slot, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat32 && q.is_contiguous(), "q must be contiguous float32 [T, H, D]");
  TORCH_CHECK(k_cache.scalar_type() == torch::kFloat32 && v_cache.scalar_type() == torch::kFloat32 &&
                  k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 3,
              "the K/V caches must be contiguous float32 [slots, Hkv, D]");
  TORCH_CHECK(kv_index.scalar_type() == torch::kInt64 && mask.scalar_type() == torch::kBool &&
                  kv_index.is_contiguous() && mask.is_contiguous(),
              "kv_index: contiguous int64 [B, L]; mask: contiguous bool [B, 1, Q, L]");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), Hkv = k_cache.size(1);
  const int64_t L = kv_index.size(1), Q = mask.size(2);
  TORCH_CHECK(D % 8 == 0 && D <= kMaxHeadDim && k_cache.size(2) == D && H % Hkv == 0, "unsupported head sizes");
  TORCH_CHECK(q_batch.scalar_type() == torch::kInt64 && q_slot.scalar_type() == torch::kInt64 &&
                  q_batch.is_contiguous() && q_slot.is_contiguous(),
              "q_batch and q_slot must be contiguous int64 [T]");
  const auto& qb = q_batch;
  const auto& qs = q_slot;
  auto o = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float *kp = k_cache.data_ptr<float>(), *vp = v_cache.data_ptr<float>();
  const int64_t* idx = kv_index.data_ptr<int64_t>();
  const bool* mk = mask.data_ptr<bool>();
  const int64_t *bp = qb.data_ptr<int64_t>(), *sp = qs.data_ptr<int64_t>();
  float* op = o.data_ptr<float>();
  const int64_t group = H / Hkv, stride = Hkv * D;
  at::parallel_for(0, T * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> slots;
    std::vector<float> p;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t = task / Hkv, g = task % Hkv, b = bp[t];
      const bool* row = mk + (b * Q + sp[t]) * L;
      slots.clear();
      for (int64_t j = 0; j < L; ++j)
        if (row[j]) slots.push_back(idx[b * L + j]);
      for (int64_t h = g * group; h < (g + 1) * group; ++h)
        attend(qp + (t * H + h) * D, kp + g * D, vp + g * D, stride, slots, D, static_cast<float>(scale), p,
               op + (t * H + h) * D);
    }
  });
  return o;
}
