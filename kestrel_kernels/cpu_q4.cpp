// Block-quantized matmuls for the CPU (AVX2, FMA, F16C): y[M, N] = x[M, K] @ W^T with W in
// GGUF-style blocks of 32 inputs, the activations quantized to int8 per block of 32.
//
//   Q4_1 weights: per block a scale d and a min m (fp16) and 4-bit codes c, w = c * d + m.
//   Q8_0 weights: per block a scale d (fp16) and int8 codes c, w = c * d.
//   Activations: per block a scale s = amax / 127 and codes q = round(x * 127 / amax).
//
// Per block the code products are summed exactly in integers, then scaled in float32:
//   Q4_1: y += (d * s) * sum(c * q) + m * (s * sum(q))
//   Q8_0: y += (d * s) * sum(c * q)
// Every output row is computed by the same instruction sequence whatever M is and whichever
// rows share its tile (batch-invariant): a decode step of one row and a verify of several
// give each row the same bits. kestrel_kernels/cpu_q4.py holds the torch reference.
#include <immintrin.h>

#include "cpu_kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;
constexpr int kMaxTile = 4;  // activation rows computed together (registers)
// The activations' per-block arrays (scale, qsum) are padded with zeros to whole groups of
// kGroup blocks: per group the kernels load kGroup weight scales at once.
constexpr int64_t kGroup = 8;

inline int64_t groups(int64_t nb) { return (nb + kGroup - 1) / kGroup; }

// A call's quantized activations, in buffers the calling thread reuses (no allocation per
// call: a decode step makes a few hundred calls).
struct QuantRows {
  std::vector<int8_t> q;     // [M, K]
  std::vector<float> scale;  // [M, P]: s, P = K/32 padded to whole groups with zeros
  std::vector<float> qsum;   // [M, P]: s * sum(q), the min term's factor
  int64_t np = 0;
};

inline float hsum8(__m256 v) {
  // A fixed order: lanes (0+4, 1+5, 2+6, 3+7), then pairs, then the last two.
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

void quantize_row(const float* x, int64_t K, int8_t* q, float* scale, float* qsum) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const float* xb = x + b * kBlock;
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      v[j] = _mm256_loadu_ps(xb + 8 * j);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float a = _mm_cvtss_f32(m4);
    const float inv = a > 0.0f ? 127.0f / a : 0.0f;
    const __m256 vinv = _mm256_set1_ps(inv);
    __m256i i32[4];
    for (int j = 0; j < 4; ++j) {
      // Round half to even, as torch.round.
      __m256 r = _mm256_round_ps(_mm256_mul_ps(v[j], vinv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      i32[j] = _mm256_cvtps_epi32(r);
    }
    __m256i sum = _mm256_add_epi32(_mm256_add_epi32(i32[0], i32[1]), _mm256_add_epi32(i32[2], i32[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    // Pack 32 int32 to 32 int8 in order: packs interleave 128-bit lanes, a permute undoes it.
    __m256i p16a = _mm256_packs_epi32(i32[0], i32[1]);
    __m256i p16b = _mm256_packs_epi32(i32[2], i32[3]);
    __m256i p8 = _mm256_packs_epi16(p16a, p16b);
    p8 = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * kBlock), p8);
    const float s = a / 127.0f;
    scale[b] = s;
    qsum[b] = s * static_cast<float>(_mm_cvtsi128_si32(s4));
  }
}

const QuantRows& quantize_rows(const torch::Tensor& x) {
  thread_local QuantRows r;
  const int64_t M = x.size(0), K = x.size(1), np = groups(K / kBlock) * kGroup;
  r.np = np;
  r.q.resize(M * K);
  r.scale.assign(M * np, 0.0f);
  r.qsum.assign(M * np, 0.0f);
  const float* xp = x.data_ptr<float>();
  for (int64_t i = 0; i < M; ++i)
    quantize_row(xp + i * K, K, r.q.data() + i * K, r.scale.data() + i * np, r.qsum.data() + i * np);
  return r;
}

torch::Tensor checked_x(const torch::Tensor& x_in) {
  const torch::Tensor x = x_in.is_contiguous() ? x_in : x_in.contiguous();
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_cpu(), "x must be a float32 [M, K] CPU tensor");
  TORCH_CHECK(x.size(1) % kBlock == 0, "K must be a multiple of 32");
  return x;
}

inline __m256 load_halves(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Four blocks' 16 code products per int16 lane pair (maddubs), folded by two horizontal
// adds and a madd into int32 lanes [b0, b1, b2, b3, b0, b1, b2, b3] (exact: at most
// 8 * 15 * 127 per int16 lane), so one convert and one FMA scale four blocks.
inline __m256i q4_1_dot4(const __m256i c[4], const int8_t* q, int64_t nblocks) {
  __m256i p[4];
  for (int j = 0; j < 4; ++j)
    p[j] = j < nblocks ? _mm256_maddubs_epi16(c[j], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + j * kBlock)))
                       : _mm256_setzero_si256();
  const __m256i h = _mm256_hadd_epi16(_mm256_hadd_epi16(p[0], p[1]), _mm256_hadd_epi16(p[2], p[3]));
  return _mm256_madd_epi16(h, _mm256_set1_epi16(1));
}

// R activation rows (at most kMaxTile) against one output row of Q4_1 weights; every row
// gets the same sequence whatever R is.
template <int R>
void q4_1_tile(const int8_t* q, const float* scale, const float* qsum, int64_t K,
               const uint8_t* cn, const uint16_t* dmn, float* y, int64_t N) {
  const int64_t nb = K / kBlock, np = groups(nb) * kGroup;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  __m256 acc[R], macc[R];
  for (int i = 0; i < R; ++i) acc[i] = macc[i] = _mm256_setzero_ps();
  alignas(32) float ds[R][kGroup];
  for (int64_t g = 0; g < nb; g += kGroup) {
    const __m256 d = load_halves(dmn + 2 * g), m = load_halves(dmn + 2 * g + kGroup);
    for (int i = 0; i < R; ++i) {
      _mm256_store_ps(ds[i], _mm256_mul_ps(d, _mm256_loadu_ps(scale + i * np + g)));
      macc[i] = _mm256_fmadd_ps(m, _mm256_loadu_ps(qsum + i * np + g), macc[i]);
    }
    for (int64_t b = g; b < std::min(nb, g + kGroup); b += 4) {
      const int64_t n4 = std::min<int64_t>(4, nb - b);
      _mm_prefetch(reinterpret_cast<const char*>(cn + b * 16 + 512), _MM_HINT_T0);
      __m256i c[4];
      for (int j = 0; j < 4; ++j) {
        // Byte k of a block holds inputs k (low nibble) and k + 16 (high nibble).
        const __m128i raw = j < n4 ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(cn + (b + j) * 16))
                                   : _mm_setzero_si128();
        c[j] = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), low4);
      }
      for (int i = 0; i < R; ++i) {
        const __m256i dot = q4_1_dot4(c, q + i * K + b * kBlock, n4);
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_broadcast_ps(reinterpret_cast<const __m128*>(&ds[i][b - g])), acc[i]);
      }
    }
  }
  for (int i = 0; i < R; ++i) y[i * N] = hsum8(_mm256_add_ps(acc[i], macc[i]));
}

// R activation rows against one output row of Q8_0 weights, as q4_1_tile.
template <int R>
void q8_0_tile(const int8_t* q, const float* scale, int64_t K, const int8_t* cn, const uint16_t* dn,
               float* y, int64_t N) {
  const int64_t nb = K / kBlock, np = groups(nb) * kGroup;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R][2];
  for (int i = 0; i < R; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  alignas(32) float ds[R][kGroup];
  for (int64_t g = 0; g < nb; g += kGroup) {
    const __m256 d = load_halves(dn + g);
    for (int i = 0; i < R; ++i) _mm256_store_ps(ds[i], _mm256_mul_ps(d, _mm256_loadu_ps(scale + i * np + g)));
    const int64_t end = std::min(nb, g + kGroup);
    for (int64_t b = g; b < end; ++b) {
      _mm_prefetch(reinterpret_cast<const char*>(cn + b * kBlock + 1024), _MM_HINT_T0);
      const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cn + b * kBlock));
      // maddubs multiplies unsigned by signed bytes: |c| times q with c's sign.
      const __m256i cabs = _mm256_sign_epi8(c, c);
      for (int i = 0; i < R; ++i) {
        const __m256i qv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + i * K + b * kBlock));
        const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(cabs, _mm256_sign_epi8(qv, c)), ones);
        acc[i][b & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_broadcast_ss(&ds[i][b - g]), acc[i][b & 1]);
      }
    }
  }
  for (int i = 0; i < R; ++i) y[i * N] = hsum8(_mm256_add_ps(acc[i][0], acc[i][1]));
}

// Output rows split over torch's threads; per output row, the activation rows in tiles of
// up to kMaxTile, so the row's weights come from memory once and from L1 for later tiles.
template <typename Tile>
void over_rows(int64_t M, int64_t N, const Tile& tile) {
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t r = 0; r < M; r += kMaxTile) tile(n, r, std::min<int64_t>(kMaxTile, M - r));
  });
}

}  // namespace

torch::Tensor q4_1_linear(const torch::Tensor& x_in, const torch::Tensor& codes, const torch::Tensor& dm) {
  const torch::Tensor x = checked_x(x_in);
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0), nb = K / kBlock;
  TORCH_CHECK(codes.scalar_type() == torch::kUInt8 && codes.is_contiguous() && codes.size(1) == K / 2,
              "codes must be contiguous uint8 [N, K/2]");
  TORCH_CHECK(dm.scalar_type() == torch::kFloat16 && dm.is_contiguous() && dm.numel() == N * groups(nb) * 2 * kGroup,
              "dm must be contiguous float16 [N, G, 2, 8]");
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  const QuantRows& a = quantize_rows(x);
  const int8_t* q = a.q.data();
  const float* s = a.scale.data();
  const float* qs = a.qsum.data();
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const uint16_t* h = reinterpret_cast<const uint16_t*>(dm.data_ptr<at::Half>());
  float* yp = y.data_ptr<float>();
  const int64_t np = a.np;
  over_rows(M, N, [&](int64_t n, int64_t r, int64_t rows) {
    const int8_t* qr = q + r * K;
    const float *sr = s + r * np, *qsr = qs + r * np;
    const uint8_t* cn = c + n * (K / 2);
    const uint16_t* dmn = h + n * np * 2;
    float* yr = yp + r * N + n;
    switch (rows) {
      case 1: q4_1_tile<1>(qr, sr, qsr, K, cn, dmn, yr, N); break;
      case 2: q4_1_tile<2>(qr, sr, qsr, K, cn, dmn, yr, N); break;
      case 3: q4_1_tile<3>(qr, sr, qsr, K, cn, dmn, yr, N); break;
      default: q4_1_tile<4>(qr, sr, qsr, K, cn, dmn, yr, N); break;
    }
  });
  return y;
}

torch::Tensor q8_0_linear(const torch::Tensor& x_in, const torch::Tensor& codes, const torch::Tensor& d,
                          int64_t rows) {
  const torch::Tensor x = checked_x(x_in);
  const int64_t M = x.size(0), K = x.size(1), nb = K / kBlock;
  TORCH_CHECK(codes.scalar_type() == torch::kInt8 && codes.is_contiguous() && codes.size(1) == K,
              "codes must be contiguous int8 [N, K]");
  TORCH_CHECK(d.scalar_type() == torch::kFloat16 && d.is_contiguous() && d.numel() == codes.size(0) * groups(nb) * kGroup,
              "d must be contiguous float16 [N, G * 8]");
  TORCH_CHECK(rows >= 0 && rows <= codes.size(0), "rows must be within the weight's rows");
  const int64_t N = rows;
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  const QuantRows& a = quantize_rows(x);
  const int8_t* q = a.q.data();
  const float* s = a.scale.data();
  const int8_t* c = codes.data_ptr<int8_t>();
  const uint16_t* h = reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>());
  float* yp = y.data_ptr<float>();
  const int64_t np = a.np;
  over_rows(M, N, [&](int64_t n, int64_t r, int64_t rows) {
    const int8_t* qr = q + r * K;
    const float* sr = s + r * np;
    const int8_t* cn = c + n * K;
    const uint16_t* dn = h + n * np;
    float* yr = yp + r * N + n;
    switch (rows) {
      case 1: q8_0_tile<1>(qr, sr, K, cn, dn, yr, N); break;
      case 2: q8_0_tile<2>(qr, sr, K, cn, dn, yr, N); break;
      case 3: q8_0_tile<3>(qr, sr, K, cn, dn, yr, N); break;
      default: q8_0_tile<4>(qr, sr, K, cn, dn, yr, N); break;
    }
  });
  return y;
}

std::vector<torch::Tensor> quantize_activations(const torch::Tensor& x_in) {
  const torch::Tensor x = checked_x(x_in);
  const QuantRows& r = quantize_rows(x);
  const int64_t M = x.size(0), K = x.size(1), nb = K / kBlock;
  auto q = torch::from_blob(const_cast<int8_t*>(r.q.data()), {M, K}, torch::kInt8).clone();
  auto s = torch::from_blob(const_cast<float*>(r.scale.data()), {M, r.np}, torch::kFloat32).narrow(1, 0, nb).clone();
  auto qs = torch::from_blob(const_cast<float*>(r.qsum.data()), {M, r.np}, torch::kFloat32).narrow(1, 0, nb).clone();
  return {q, s, qs};
}
