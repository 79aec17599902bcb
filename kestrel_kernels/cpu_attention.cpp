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

constexpr int kRows = 4;  // query rows of one request that share each key's loads

// Scores p[j] = (q . k_j) * scale for keys [from, n) of `slots`, four keys at a time (four
// independent FMA chains, each key's the same operations as alone); returns their maximum
// with `top`.
float scores_alone(const float* q, const float* kc, int64_t stride, const int64_t* slots, int64_t from, int64_t n,
                   int64_t D, float scale, float* p, float top) {
  int64_t j = from;
  for (; j + 4 <= n; j += 4) {
    const float *k0 = kc + slots[j] * stride, *k1 = kc + slots[j + 1] * stride,
                *k2 = kc + slots[j + 2] * stride, *k3 = kc + slots[j + 3] * stride;
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 qd = _mm256_loadu_ps(q + d);
      a0 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k0 + d), a0);
      a1 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k1 + d), a1);
      a2 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k2 + d), a2);
      a3 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k3 + d), a3);
    }
    p[j] = hsum8(a0) * scale;
    p[j + 1] = hsum8(a1) * scale;
    p[j + 2] = hsum8(a2) * scale;
    p[j + 3] = hsum8(a3) * scale;
    top = std::max(std::max(std::max(top, p[j]), std::max(p[j + 1], p[j + 2])), p[j + 3]);
  }
  for (; j < n; ++j) {
    const float* k = kc + slots[j] * stride;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d), acc);
    p[j] = hsum8(acc) * scale;
    top = std::max(top, p[j]);
  }
  return top;
}

// p[j] <- e^(p[j] - top) over [0, n), the padding lanes to n rounded up to 8 zeroed; returns
// the lanes' sums.
__m256 exponentiate(float* p, int64_t n, float top) {
  __m256 sum = _mm256_setzero_ps();
  const __m256 vtop = _mm256_set1_ps(top);
  for (int64_t j = 0; j < n; j += 8) {
    __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(p + j), vtop));
    if (n - j < 8) {  // the tail's padding lanes hold -inf: zero them, not 2^-126
      const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
      e = _mm256_and_ps(e, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(int(n - j)), lane)));
    }
    _mm256_storeu_ps(p + j, e);
    sum = _mm256_add_ps(sum, e);
  }
  return sum;
}

// One query head for R rows of one request: row r's q [D] over its keys slots[r] (rows of
// [*, D] with row stride `stride`) -> out[r] [D]. The first `shared` keys are every row's
// own first keys (a verify's prefix): each is loaded once for all R rows. A row's output
// takes the same operations in the same order as the row alone (R = 1, shared = 0), so it
// does not depend on which rows it is grouped with.
template <int R>
void attend(const float* const* q, float* const* out, const std::vector<int64_t>* const* slots, int64_t shared,
            const float* kc, const float* vc, int64_t stride, int64_t D, float scale, std::vector<float>* p) {
  float top[R];
  for (int r = 0; r < R; ++r) {
    p[r].assign(((static_cast<int64_t>(slots[r]->size()) + 7) / 8) * 8, -INFINITY);
    top[r] = -INFINITY;
  }
  const int64_t* common = slots[0]->data();
  for (int64_t j = 0; j < shared; ++j) {
    const float* k = kc + common[j] * stride;
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 kd = _mm256_loadu_ps(k + d);
      for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(q[r] + d), kd, acc[r]);
    }
    for (int r = 0; r < R; ++r) {
      p[r][j] = hsum8(acc[r]) * scale;
      top[r] = std::max(top[r], p[r][j]);
    }
  }
  __m256 inv[R];
  for (int r = 0; r < R; ++r) {
    const int64_t n = static_cast<int64_t>(slots[r]->size());
    top[r] = scores_alone(q[r], kc, stride, slots[r]->data(), shared, n, D, scale, p[r].data(), top[r]);
    inv[r] = _mm256_set1_ps(1.0f / hsum8(exponentiate(p[r].data(), n, top[r])));
  }
  // Weighted values, 16 columns at a time: each row's column sums run over its keys in
  // order, the shared keys' value rows loaded once.
  for (int64_t d = 0; d < D; d += 16) {
    const bool two = d + 8 < D;
    __m256 a0[R], a1[R];
    for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm256_setzero_ps();
    for (int64_t j = 0; j < shared; ++j) {
      const float* v = vc + common[j] * stride + d;
      const __m256 v0 = _mm256_loadu_ps(v), v1 = two ? _mm256_loadu_ps(v + 8) : v0;
      for (int r = 0; r < R; ++r) {
        const __m256 w = _mm256_set1_ps(p[r][j]);
        a0[r] = _mm256_fmadd_ps(w, v0, a0[r]);
        a1[r] = _mm256_fmadd_ps(w, v1, a1[r]);
      }
    }
    for (int r = 0; r < R; ++r) {
      const int64_t n = static_cast<int64_t>(slots[r]->size());
      const int64_t* own = slots[r]->data();
      for (int64_t j = shared; j < n; ++j) {
        const float* v = vc + own[j] * stride + d;
        const __m256 w = _mm256_set1_ps(p[r][j]);
        a0[r] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v), a0[r]);
        if (two) a1[r] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8), a1[r]);
      }
      _mm256_storeu_ps(out[r] + d, _mm256_mul_ps(a0[r], inv[r]));
      if (two) _mm256_storeu_ps(out[r] + d + 8, _mm256_mul_ps(a1[r], inv[r]));
    }
  }
}

}  // namespace

AttentionKeys attention_keys(const torch::Tensor& kv_index, const torch::Tensor& mask, const torch::Tensor& q_batch,
                             const torch::Tensor& q_slot) {
  TORCH_CHECK(kv_index.scalar_type() == torch::kInt64 && mask.scalar_type() == torch::kBool &&
                  kv_index.is_contiguous() && mask.is_contiguous(),
              "kv_index: contiguous int64 [B, L]; mask: contiguous bool [B, 1, Q, L]");
  TORCH_CHECK(q_batch.scalar_type() == torch::kInt64 && q_slot.scalar_type() == torch::kInt64 &&
                  q_batch.is_contiguous() && q_slot.is_contiguous(),
              "q_batch and q_slot must be contiguous int64 [T]");
  const int64_t T = q_batch.numel(), B = kv_index.size(0), L = kv_index.size(1), Q = mask.size(2);
  const int64_t* idx = kv_index.data_ptr<int64_t>();
  const bool* mk = mask.data_ptr<bool>();
  const int64_t *bp = q_batch.data_ptr<int64_t>(), *sp = q_slot.data_ptr<int64_t>();
  AttentionKeys keys{std::vector<std::vector<int64_t>>(B), std::vector<std::vector<int64_t>>(T)};
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(bp[t] >= 0 && bp[t] < B && sp[t] >= 0 && sp[t] < Q, "q_batch or q_slot out of range");
    keys.rows_of[bp[t]].push_back(t);
    const bool* row = mk + (bp[t] * Q + sp[t]) * L;
    const int64_t* slots = idx + bp[t] * L;
    for (int64_t j = 0; j < L; ++j)
      if (row[j]) keys.slots[t].push_back(slots[j]);
  }
  return keys;
}

torch::Tensor paged_attention_over(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                                   const AttentionKeys& keys, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat32 && q.is_contiguous(), "q must be contiguous float32 [T, H, D]");
  TORCH_CHECK(k_cache.scalar_type() == torch::kFloat32 && v_cache.scalar_type() == torch::kFloat32 &&
                  k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 3,
              "the K/V caches must be contiguous float32 [slots, Hkv, D]");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), Hkv = k_cache.size(1);
  const int64_t B = static_cast<int64_t>(keys.rows_of.size());
  TORCH_CHECK(D % 8 == 0 && D <= kMaxHeadDim && k_cache.size(2) == D && H % Hkv == 0, "unsupported head sizes");
  TORCH_CHECK(static_cast<int64_t>(keys.slots.size()) == T, "q has ", T, " tokens, the attention metadata ",
              keys.slots.size());
  auto o = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float *kp = k_cache.data_ptr<float>(), *vp = v_cache.data_ptr<float>();
  float* op = o.data_ptr<float>();
  const int64_t group = H / Hkv, stride = Hkv * D;
  // The query heads that read one KV head share each key's loads, kRows (row, head) pairs
  // at a time: a request's pairs for a KV head, a row's heads together (they see the same
  // keys), then the rows in order (a verify's rows share their prefix), cut into chunks of
  // nearly equal size, one task each. Each pair's output is what it alone would give
  // (attend's contract), whatever chunk it lands in.
  struct Chunk { int64_t b, g, first, count; };
  std::vector<Chunk> chunks;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = static_cast<int64_t>(keys.rows_of[b].size()) * group;
    const int64_t parts = (n + kRows - 1) / kRows;
    for (int64_t g = 0; g < Hkv; ++g)
      for (int64_t c = 0; c < parts; ++c) {
        const int64_t lo = n * c / parts, hi = n * (c + 1) / parts;
        chunks.push_back({b, g, lo, hi - lo});
      }
  }
  at::parallel_for(0, static_cast<int64_t>(chunks.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> p[kRows];
    for (int64_t c = begin; c < end; ++c) {
      const Chunk& ch = chunks[c];
      const std::vector<int64_t>& rows = keys.rows_of[ch.b];
      const int R = static_cast<int>(ch.count);
      const float* qr[kRows];
      float* outr[kRows];
      const std::vector<int64_t>* sr[kRows];
      for (int r = 0; r < R; ++r) {
        const int64_t i = ch.first + r, t = rows[i / group], h = ch.g * group + i % group;
        qr[r] = qp + (t * H + h) * D;
        outr[r] = op + (t * H + h) * D;
        sr[r] = &keys.slots[t];
      }
      int64_t shared = static_cast<int64_t>(sr[0]->size());  // the keys every pair sees first
      for (int r = 1; r < R; ++r) {
        if (sr[r] == sr[0]) continue;  // the same row: all of its keys
        int64_t j = 0;
        const int64_t n = std::min<int64_t>(shared, static_cast<int64_t>(sr[r]->size()));
        while (j < n && (*sr[r])[j] == (*sr[0])[j]) ++j;
        shared = j;
      }
      const float* kc = kp + ch.g * D;
      const float* vc = vp + ch.g * D;
      const float sc = static_cast<float>(scale);
      switch (R) {
        case 1: attend<1>(qr, outr, sr, 0, kc, vc, stride, D, sc, p); break;
        case 2: attend<2>(qr, outr, sr, shared, kc, vc, stride, D, sc, p); break;
        case 3: attend<3>(qr, outr, sr, shared, kc, vc, stride, D, sc, p); break;
        default: attend<4>(qr, outr, sr, shared, kc, vc, stride, D, sc, p); break;
      }
    }
  });
  return o;
}

torch::Tensor paged_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                              const torch::Tensor& kv_index, const torch::Tensor& mask,
                              const torch::Tensor& q_batch, const torch::Tensor& q_slot, double scale) {
  return paged_attention_over(q, k_cache, v_cache, attention_keys(kv_index, mask, q_batch, q_slot), scale);
}
