// Block-quantized matmuls for the CPU (AVX2, FMA, F16C; the code products with VNNI's
// vpdpbusd where the CPU has it, chosen at load): y[M, N] = x[M, K] @ W^T with W in
// GGUF-style blocks of 32 inputs, the activations quantized to int8 per block of 32.
//
//   Q4_1 weights: per block a scale d and a min m (fp16) and 4-bit codes c, w = c * d + m.
//   Q8_0 weights: per block a scale d (fp16) and int8 codes c, w = c * d.
//   Activations: per block a scale s = amax / 127 and codes q = round(x * 127 / amax).
//
// A row's blocks are stored in pieces: whole groups of 8 blocks, then the rest as 4, 2 and
// 1 blocks. Within a piece the codes are interleaved 4 bytes at a time so that each of a
// vector's 8 int32 lanes holds inputs of one block (lane L of a t-block piece: block
// L / (8 / t)), weights and activations alike. A piece's code products then add up per
// lane without any horizontal step: for Q4_1 in int16 (at most 8 * 2 * 15 * 127 < 2^15)
// before one madd to int32, or with VNNI in int32 at once, for Q8_0 in int32 after each
// madd (or VNNI's add). Per piece the lanes are scaled in float32 by their block's d * s
// (the scales are stored once per lane):
//   Q4_1: y += sum over lanes (d * s) * sum(c * q) + m * (s * sum(q))
//   Q8_0: y += sum over lanes (d * s) * sum(c * q)
// Every output row is computed by the same instruction sequence whatever M is and whichever
// rows share its tile (batch-invariant): a decode step of one row and a verify of several
// give each row the same bits. kestrel_kernels/cpu_q4.py holds the layout and the torch
// reference.
#include <immintrin.h>

#include "cpu_kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;
constexpr int kMaxTile = 4;  // activation rows computed together (registers)
constexpr int64_t kLanes = 8;  // per piece: 8 scale slots, one per int32 lane
// How far ahead of a Q4_1 piece its row's codes (and, half as far, scales) are prefetched:
// a decode step reads the weights from memory, and 512 bytes ahead left a 30-layer
// forward 1.5x slower at one row (2-core Xeon, docs/benchmarks.md).
constexpr int64_t kCodesAhead = 2048;

// Blocks in the piece that starts with `left` blocks to go: 8, else the largest power of two.
inline int piece_blocks(int64_t left) {
  return left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
}

inline int64_t pieces(int64_t nb) {
  int64_t p = 0;
  for (int64_t b = 0; b < nb; b += piece_blocks(nb - b)) ++p;
  return p;
}

// A call's quantized activations, in buffers the calling thread reuses (no allocation per
// call: a decode step makes a few hundred calls).
struct QuantRows {
  std::vector<int8_t> q;     // [M, K] in the pieces' interleaved order
  std::vector<float> scale;  // [M, P * 8]: s of each lane's block
  std::vector<float> qsum;   // [M, P * 8]: s * sum(q) of the piece's blocks, then zeros
  int64_t np = 0;            // P * 8
};

inline float hsum8(__m256 v) {
  // A fixed order: lanes (0+4, 1+5, 2+6, 3+7), then pairs, then the last two.
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// One row's codes, scales and s * sum(q) per block, in input order.
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

// A row quantized in input order (quantize_row) -> the pieces' layout: in a t-block piece,
// 4-byte word w of block j goes to vector w / (8 / t), lane j * (8 / t) + w % (8 / t).
void to_pieces(const int8_t* qn, const float* sn, const float* qsn, int64_t nb, int8_t* q, float* scale,
               float* qsum) {
  int64_t slot = 0;
  for (int64_t b = 0; b < nb; slot += kLanes) {
    const int t = piece_blocks(nb - b), per = kLanes / t;
    for (int j = 0; j < t; ++j) {
      for (int w = 0; w < 8; ++w)
        std::memcpy(q + (b + w / per) * kBlock + (j * per + w % per) * 4, qn + (b + j) * kBlock + w * 4, 4);
      for (int l = 0; l < per; ++l) scale[slot + j * per + l] = sn[b + j];
      qsum[slot + j] = qsn[b + j];
    }
    b += t;
  }
}

const QuantRows& quantize_rows(const torch::Tensor& x) {
  thread_local QuantRows r;
  thread_local std::vector<int8_t> qn;
  thread_local std::vector<float> sn, qsn;
  const int64_t M = x.size(0), K = x.size(1), nb = K / kBlock, np = pieces(nb) * kLanes;
  r.np = np;
  r.q.resize(M * K);
  r.scale.assign(M * np, 0.0f);
  r.qsum.assign(M * np, 0.0f);
  qn.resize(K);
  sn.resize(nb);
  qsn.resize(nb);
  const float* xp = x.data_ptr<float>();
  for (int64_t i = 0; i < M; ++i) {
    quantize_row(xp + i * K, K, qn.data(), sn.data(), qsn.data());
    to_pieces(qn.data(), sn.data(), qsn.data(), nb, r.q.data() + i * K, r.scale.data() + i * np,
              r.qsum.data() + i * np);
  }
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

inline __m256i load32(const int8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// A Q4_1 piece's code products, summed per int32 lane. AVX2 sums them in int16 and widens
// once: maddubs saturates its pair sums to int16 and the adds wrap, neither of which codes
// 0..15 times |q| <= 127 can reach (see above). VNNI's vpdpbusd adds a lane's four
// products straight into int32, in its VEX encoding (AVX-VNNI) or its EVEX one on 256-bit
// vectors (AVX512-VNNI with AVX512VL: CPUs that have AVX-512 but not AVX-VNNI, such as
// Cascade Lake, Ice Lake server and Zen 4). Each lane gets the same integer every way, so
// the kernel's output is the same bit for bit.
struct Avx2Dot {
  // acc (int16 lanes) + the products of lo with qlo and of hi with qhi
  static __m256i add(__m256i acc, __m256i lo, __m256i qlo, __m256i hi, __m256i qhi) {
    return _mm256_add_epi16(acc, _mm256_add_epi16(_mm256_maddubs_epi16(lo, qlo), _mm256_maddubs_epi16(hi, qhi)));
  }
  static __m256i one(__m256i c, __m256i q) { return _mm256_maddubs_epi16(c, q); }
  static __m256i lanes(__m256i acc) { return _mm256_madd_epi16(acc, _mm256_set1_epi16(1)); }  // -> int32
  // int32 acc + the products of u (unsigned) with s, pairs summed in int16 first
  static __m256i signed_add(__m256i acc, __m256i u, __m256i s) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
  }
};

struct VnniDot {
  __attribute__((target("avxvnni"))) static __m256i add(__m256i acc, __m256i lo, __m256i qlo, __m256i hi,
                                                        __m256i qhi) {
    return _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(acc, lo, qlo), hi, qhi);
  }
  __attribute__((target("avxvnni"))) static __m256i one(__m256i c, __m256i q) {
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), c, q);
  }
  static __m256i lanes(__m256i acc) { return acc; }
  __attribute__((target("avxvnni"))) static __m256i signed_add(__m256i acc, __m256i u, __m256i s) {
    return _mm256_dpbusd_avx_epi32(acc, u, s);
  }
};

struct Vnni512Dot {
  __attribute__((target("avx512vnni,avx512vl"))) static __m256i add(__m256i acc, __m256i lo, __m256i qlo,
                                                                    __m256i hi, __m256i qhi) {
    return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(acc, lo, qlo), hi, qhi);
  }
  __attribute__((target("avx512vnni,avx512vl"))) static __m256i one(__m256i c, __m256i q) {
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), c, q);
  }
  static __m256i lanes(__m256i acc) { return acc; }
  __attribute__((target("avx512vnni,avx512vl"))) static __m256i signed_add(__m256i acc, __m256i u, __m256i s) {
    return _mm256_dpbusd_epi32(acc, u, s);
  }
};

// R activation rows (at most kMaxTile) against one output row of Q4_1 weights; every row
// gets the same sequence whatever R is. A t-block piece's t * 16 code bytes hold its first
// t / 2 vectors in the low nibbles and the others in the high nibbles (t = 1: one vector,
// bytes 0-15 low, 16-31 high). Inlined into rows_avx2 / rows_vnni / rows_vnni512, so that it
// compiles for the caller's instruction set (the VNNI steps only inline there).
template <int R, class Dot>
__attribute__((always_inline)) inline void q4_1_tile(const int8_t* q, const float* scale, const float* qsum,
                                                     int64_t K, int64_t np, const uint8_t* cn, const uint16_t* dmn,
                                                     float* y, int64_t N) {
  const int64_t nb = K / kBlock;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  __m256 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
  int64_t slot = 0;
  for (int64_t b = 0; b < nb; slot += kLanes) {
    const int t = piece_blocks(nb - b);
    const uint8_t* cp = cn + b * (kBlock / 2);
    const int8_t* qp = q + b * kBlock;
    _mm_prefetch(reinterpret_cast<const char*>(cp + kCodesAhead), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(cp + kCodesAhead + 64), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(dmn + 2 * slot) + kCodesAhead / 2, _MM_HINT_T0);
    __m256i dot[R];  // Dot's lanes: products of 2t inputs of one block each
    if (t == 1) {
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(cp));
      const __m256i c = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), low4);
      for (int i = 0; i < R; ++i) dot[i] = Dot::one(c, load32(qp + i * K));
    } else {
      const int h = t / 2;
      for (int i = 0; i < R; ++i) dot[i] = _mm256_setzero_si256();
      for (int j = 0; j < h; ++j) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cp + j * kBlock));
        const __m256i lo = _mm256_and_si256(raw, low4);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
        for (int i = 0; i < R; ++i) {
          const int8_t* qi = qp + i * K;
          dot[i] = Dot::add(dot[i], lo, load32(qi + j * kBlock), hi, load32(qi + (j + h) * kBlock));
        }
      }
    }
    const __m256 d = load_halves(dmn + 2 * slot), m = load_halves(dmn + 2 * slot + kLanes);
    for (int i = 0; i < R; ++i) {
      const __m256 ds = _mm256_mul_ps(d, _mm256_loadu_ps(scale + i * np + slot));
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(Dot::lanes(dot[i])), ds, acc[i]);
      acc[i] = _mm256_fmadd_ps(m, _mm256_loadu_ps(qsum + i * np + slot), acc[i]);
    }
    b += t;
  }
  for (int i = 0; i < R; ++i) y[i * N] = hsum8(acc[i]);
}

// R activation rows against one output row of Q8_0 weights, as q4_1_tile; a t-block piece
// is t vectors of codes. The products are |c| (unsigned) times q with c's sign: AVX2's
// maddubs sums them in int16 pairs (at most 2 * 127 * 127, below saturation), widened to
// int32 at once; VNNI's vpdpbusd adds a lane's four straight into int32: the same integers.
template <int R, class Dot>
__attribute__((always_inline)) inline void q8_0_tile(const int8_t* q, const float* scale, int64_t K, int64_t np,
                                                     const int8_t* cn, const uint16_t* dn, float* y, int64_t N) {
  const int64_t nb = K / kBlock;
  __m256 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
  int64_t slot = 0;
  for (int64_t b = 0; b < nb; slot += kLanes) {
    const int t = piece_blocks(nb - b);
    const int8_t* cp = cn + b * kBlock;
    const int8_t* qp = q + b * kBlock;
    __m256i dot[R];  // int32 lanes
    for (int i = 0; i < R; ++i) dot[i] = _mm256_setzero_si256();
    for (int j = 0; j < t; ++j) {
      _mm_prefetch(reinterpret_cast<const char*>(cp + j * kBlock + 1024), _MM_HINT_T0);
      const __m256i c = load32(cp + j * kBlock);
      const __m256i cabs = _mm256_sign_epi8(c, c);
      for (int i = 0; i < R; ++i)
        dot[i] = Dot::signed_add(dot[i], cabs, _mm256_sign_epi8(load32(qp + i * K + j * kBlock), c));
    }
    const __m256 d = load_halves(dn + slot);
    for (int i = 0; i < R; ++i)
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[i]), _mm256_mul_ps(d, _mm256_loadu_ps(scale + i * np + slot)), acc[i]);
    b += t;
  }
  for (int i = 0; i < R; ++i) y[i * N] = hsum8(acc[i]);
}

// Output rows n0..n1-1 (a thread's share) against the M activation rows: per output row the
// activation rows in tiles of up to kMaxTile, so the row's weights come from memory once
// and from L1 for later tiles. Inlined, tile and all, into its caller (rows_vnni compiles
// it for AVX-VNNI).
template <typename Tile>
__attribute__((always_inline)) inline void tiles(int64_t n0, int64_t n1, int64_t M, const Tile& tile) {
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t r = 0; r < M; r += kMaxTile) tile(n, r, std::min<int64_t>(kMaxTile, M - r));
}

// f(std::integral_constant<int, R>{}) with R = rows (1 to kMaxTile): each row count compiles
// its own register tile. Inlined, as tiles is.
template <class F>
__attribute__((always_inline)) inline void with_rows(int64_t rows, const F& f) {
  switch (rows) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    default: f(std::integral_constant<int, kMaxTile>{}); break;
  }
}

// One call's operands, for either kernel.
struct BlockCall {
  const int8_t* q;  // the activations as QuantRows holds them
  const float *scale, *qsum;  // qsum: Q4_1 only
  const void* codes;          // Q4_1: uint8 [N, K/2]; Q8_0: int8 [N, K]
  const uint16_t* d;          // float16 bits: Q4_1 [N, P, 2, 8] (d, m); Q8_0 [N, P * 8]
  float* y;                   // [M, N]
  int64_t M, N, K, np;
};

// A kernel's tile of R activation rows (from r) against output row n of a call.
struct Q4_1Kernel {
  template <int R, class Dot>
  __attribute__((always_inline)) static void tile(const BlockCall& a, int64_t n, int64_t r) {
    q4_1_tile<R, Dot>(a.q + r * a.K, a.scale + r * a.np, a.qsum + r * a.np, a.K, a.np,
                      static_cast<const uint8_t*>(a.codes) + n * (a.K / 2), a.d + n * a.np * 2,
                      a.y + r * a.N + n, a.N);
  }
};

struct Q8_0Kernel {
  template <int R, class Dot>
  __attribute__((always_inline)) static void tile(const BlockCall& a, int64_t n, int64_t r) {
    q8_0_tile<R, Dot>(a.q + r * a.K, a.scale + r * a.np, a.K, a.np, static_cast<const int8_t*>(a.codes) + n * a.K,
                      a.d + n * a.np, a.y + r * a.N + n, a.N);
  }
};

// Output rows n0..n1-1 of a call, Kernel's tiles on Dot's code products.
template <class Kernel, class Dot>
__attribute__((always_inline)) inline void block_rows(const BlockCall& a, int64_t n0, int64_t n1) {
  tiles(n0, n1, a.M, [&](int64_t n, int64_t r, int64_t rows) __attribute__((always_inline)) {
    with_rows(rows, [&](auto R) __attribute__((always_inline)) {
      Kernel::template tile<decltype(R)::value, Dot>(a, n, r);
    });
  });
}

// One function per instruction set, compiled for it (the VNNI steps inline only there).
template <class Kernel>
void rows_avx2(const BlockCall& a, int64_t n0, int64_t n1) { block_rows<Kernel, Avx2Dot>(a, n0, n1); }

template <class Kernel>
__attribute__((target("avxvnni"))) void rows_vnni(const BlockCall& a, int64_t n0, int64_t n1) {
  block_rows<Kernel, VnniDot>(a, n0, n1);
}

template <class Kernel>
__attribute__((target("avx512vnni,avx512vl"))) void rows_vnni512(const BlockCall& a, int64_t n0, int64_t n1) {
  block_rows<Kernel, Vnni512Dot>(a, n0, n1);
}

enum class Q4Isa { kAvx2, kAvxVnni, kAvx512Vnni };

// The VEX encoding where the CPU has it, else the EVEX one: each faults where its own
// feature flag is missing, whatever the other says.
Q4Isa best_q4_isa() {
  __builtin_cpu_init();  // this runs among static initialisers, maybe before libgcc's
  if (__builtin_cpu_supports("avxvnni")) return Q4Isa::kAvxVnni;
  if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl")) return Q4Isa::kAvx512Vnni;
  return Q4Isa::kAvx2;
}

// The Q4_1 and Q8_0 kernels' instruction set, chosen once when the extension loads;
// set_q4_isa("avx2") forces the AVX2 step (tests and benchmarks compare the two).
const Q4Isa kBestQ4Isa = best_q4_isa();
std::atomic<Q4Isa> q4_isa_now{kBestQ4Isa};

// A call's output rows over the threads, on the instruction set in use.
template <class Kernel>
void run_rows(const BlockCall& call) {
  const Q4Isa isa = q4_isa_now.load(std::memory_order_relaxed);
  const auto rows = isa == Q4Isa::kAvxVnni ? rows_vnni<Kernel> : isa == Q4Isa::kAvx512Vnni ? rows_vnni512<Kernel>
                                                                                           : rows_avx2<Kernel>;
  at::parallel_for(0, call.N, 16, [&](int64_t n0, int64_t n1) { rows(call, n0, n1); });
}

}  // namespace

torch::Tensor q4_1_linear(const torch::Tensor& x_in, const torch::Tensor& codes, const torch::Tensor& dm) {
  const torch::Tensor x = checked_x(x_in);
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0), nb = K / kBlock;
  TORCH_CHECK(codes.scalar_type() == torch::kUInt8 && codes.is_contiguous() && codes.size(1) == K / 2,
              "codes must be contiguous uint8 [N, K/2]");
  TORCH_CHECK(dm.scalar_type() == torch::kFloat16 && dm.is_contiguous() && dm.numel() == N * pieces(nb) * 2 * kLanes,
              "dm must be contiguous float16 [N, P, 2, 8]");
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  const QuantRows& a = quantize_rows(x);
  run_rows<Q4_1Kernel>({a.q.data(), a.scale.data(), a.qsum.data(), codes.data_ptr<uint8_t>(),
                        reinterpret_cast<const uint16_t*>(dm.data_ptr<at::Half>()), y.data_ptr<float>(), M, N, K, a.np});
  return y;
}

torch::Tensor q8_0_linear(const torch::Tensor& x_in, const torch::Tensor& codes, const torch::Tensor& d,
                          int64_t rows) {
  const torch::Tensor x = checked_x(x_in);
  const int64_t M = x.size(0), K = x.size(1), nb = K / kBlock;
  TORCH_CHECK(codes.scalar_type() == torch::kInt8 && codes.is_contiguous() && codes.size(1) == K,
              "codes must be contiguous int8 [N, K]");
  TORCH_CHECK(d.scalar_type() == torch::kFloat16 && d.is_contiguous() && d.numel() == codes.size(0) * pieces(nb) * kLanes,
              "d must be contiguous float16 [N, P * 8]");
  TORCH_CHECK(rows >= 0 && rows <= codes.size(0), "rows must be within the weight's rows");
  const int64_t N = rows;
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  const QuantRows& a = quantize_rows(x);
  run_rows<Q8_0Kernel>({a.q.data(), a.scale.data(), nullptr, codes.data_ptr<int8_t>(),
                        reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>()), y.data_ptr<float>(), M, N, K, a.np});
  return y;
}

void set_q4_isa(const std::string& isa) {
  TORCH_CHECK(isa == "avx2" || isa == "auto", "the block kernels' ISA: avx2 or auto, not ", isa);
  q4_isa_now = isa == "auto" ? kBestQ4Isa : Q4Isa::kAvx2;
}

std::string q4_isa() {
  switch (q4_isa_now.load()) {
    case Q4Isa::kAvxVnni: return "avxvnni";
    case Q4Isa::kAvx512Vnni: return "avx512vnni";
    default: return "avx2";
  }
}

std::vector<torch::Tensor> quantize_activations(const torch::Tensor& x_in) {
  const torch::Tensor x = checked_x(x_in);
  const int64_t M = x.size(0), K = x.size(1), nb = K / kBlock;
  auto q = torch::empty({M, K}, torch::kInt8);
  auto s = torch::empty({M, nb}, torch::kFloat32);
  auto qs = torch::empty({M, nb}, torch::kFloat32);
  for (int64_t i = 0; i < M; ++i)
    quantize_row(x.data_ptr<float>() + i * K, K, q.data_ptr<int8_t>() + i * K, s.data_ptr<float>() + i * nb,
                 qs.data_ptr<float>() + i * nb);
  return {q, s, qs};
}
