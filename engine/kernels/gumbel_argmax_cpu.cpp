// Sampling's draw from whole rows (torch.ops.pdserve.gumbel_argmax_rows), CPU fp32:
//
//   gumbel_argmax_rows(logits [B, V] fp32, keys [B] int64) -> [B] int64
//
// Row r's token: the argmax over t of logits[r, t] + G(keys[r], t), the Gumbel-max trick, where
// G = -log(-log(u)) and u = ((splitmix64(key + (t + 1) * golden) >> 11) + 0.5) * 2^-53 is uniform
// in (0, 1), all in double: engine.sampler's `_noise`, which its torch path adds to the logits
// (the two agree but at near ties: the logs here are a polynomial within a few units of the last
// place). The draw is softmax(logits)'s categorical distribution; the noise depends on the key
// and the token only. A NaN logit gives the first NaN's index, a row of -inf index 0 (the caller
// checks the chosen logit is finite). torch.multinomial's draw took 1.2 ms per 49,152-wide row here
// (one thread), and the same hashed noise in torch ops 0.7-1.0; one pass here takes ~0.03 (exact
// noise only for the few dozen tokens of a row whose bound, below, reaches the best so far) on 8
// lanes of AVX512; on AVX2's 4 lanes 0.08 where the scalar loop took 0.22 (a Zen 3 EPYC).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

#include "kernel_common.h"

namespace {

using pdserve_cpu::nan1;

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull, kMix1 = 0xBF58476D1CE4E5B9ull,
                   kMix2 = 0x94D049BB133111EBull;

// natural log of a positive normal double (the scalar path's; log8 below the vector path's):
// x = 2^e * m with m in [sqrt(1/2), sqrt(2)), log m = 2 atanh(f), f = (m - 1) / (m + 1), as a
// series in f^2 (|f| <= 0.1716: its terms fall below 1e-17 of the sum by f^22)
inline double log_pos(double x) {
  uint64_t bits;
  std::memcpy(&bits, &x, 8);
  int64_t e = int64_t(bits >> 52) - 1023;
  uint64_t mbits = (bits & 0x000FFFFFFFFFFFFFull) | 0x3FF0000000000000ull;
  double m;
  std::memcpy(&m, &mbits, 8);
  const bool high = m > 1.4142135623730951;
  m = high ? m * 0.5 : m;
  e += high;
  const double f = (m - 1.0) / (m + 1.0), s = f * f;
  double p = 1.0 / 23;
  p = p * s + 1.0 / 21;
  p = p * s + 1.0 / 19;
  p = p * s + 1.0 / 17;
  p = p * s + 1.0 / 15;
  p = p * s + 1.0 / 13;
  p = p * s + 1.0 / 11;
  p = p * s + 1.0 / 9;
  p = p * s + 1.0 / 7;
  p = p * s + 1.0 / 5;
  p = p * s + 1.0 / 3;
  p = p * s + 1.0;
  return double(e) * 0.6931471805599453 + 2.0 * f * p;
}

#if defined(PDSERVE_AVX512) && defined(__AVX512DQ__) && defined(__AVX512CD__)
#define PDSERVE_GUMBEL8 1
// log_pos on 8 lanes: the exponent and mantissa by getexp / getmant, 1 / (m + 1) by rcp14 and two
// Newton steps (a division's throughput is a fifth of theirs)
inline __m512d log8(__m512d x) {
  const __m512d one = _mm512_set1_pd(1.0), two = _mm512_set1_pd(2.0);
  __m512d e = _mm512_getexp_pd(x), m = _mm512_getmant_pd(x, _MM_MANT_NORM_1_2, _MM_MANT_SIGN_src);
  const __mmask8 high = _mm512_cmp_pd_mask(m, _mm512_set1_pd(1.4142135623730951), _CMP_GT_OQ);
  m = _mm512_mask_mul_pd(m, high, m, _mm512_set1_pd(0.5));
  e = _mm512_mask_add_pd(e, high, e, one);
  const __m512d den = _mm512_add_pd(m, one);
  __m512d r = _mm512_rcp14_pd(den);
  r = _mm512_mul_pd(r, _mm512_fnmadd_pd(den, r, two));
  r = _mm512_mul_pd(r, _mm512_fnmadd_pd(den, r, two));
  const __m512d f = _mm512_mul_pd(_mm512_sub_pd(m, one), r), s = _mm512_mul_pd(f, f);
  __m512d p = _mm512_set1_pd(1.0 / 23);
  for (const double c : {1.0 / 21, 1.0 / 19, 1.0 / 17, 1.0 / 15, 1.0 / 13, 1.0 / 11, 1.0 / 9, 1.0 / 7,
                         1.0 / 5, 1.0 / 3, 1.0})
    p = _mm512_fmadd_pd(p, s, _mm512_set1_pd(c));
  return _mm512_fmadd_pd(e, _mm512_set1_pd(0.6931471805599453), _mm512_mul_pd(_mm512_add_pd(f, f), p));
}
#elif defined(PDSERVE_AVX2)
#define PDSERVE_GUMBEL4 1
// a * c mod 2^64 on 4 lanes (AVX2 has no 64-bit multiply): three 32 x 32 -> 64-bit products
inline __m256i mullo64(__m256i a, uint64_t c) {
  const __m256i lo = _mm256_set1_epi64x(int64_t(c & 0xFFFFFFFFu)), hi = _mm256_set1_epi64x(int64_t(c >> 32));
  const __m256i cross = _mm256_add_epi64(_mm256_mul_epu32(_mm256_srli_epi64(a, 32), lo), _mm256_mul_epu32(a, hi));
  return _mm256_add_epi64(_mm256_mul_epu32(a, lo), _mm256_slli_epi64(cross, 32));
}
#endif

// the first NaN's index (the row has one)
int64_t first_nan(const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (nan1(x[i])) return i;
  return 0;
}

// An upper bound of a token's score from its hash z and logit v, without a log: the noise
// -log(-log u) <= -log(1 - u), and 1 - u >= 2^-(k + 1) where z has k leading one bits (k < 53; all
// 53 of u's bits ones: 1 - u = 2^-54), so the score is at most v + (min(k, 52) + 2) ln 2 (a whole
// ln 2 to spare for rounding). A token whose bound is below the row's best so far cannot win, and
// the bound passes only ~4 e^(v - best): a row's scan takes exact logs for a few dozen tokens.
constexpr double kLn2 = 0.6931471805599453;

inline uint64_t mix(uint64_t z) {
  z = (z ^ (z >> 30)) * kMix1;
  z = (z ^ (z >> 27)) * kMix2;
  return z ^ (z >> 31);
}

// Token t against the best so far: its bound, then (rarely) its exact score; false at a NaN logit
inline bool take(const float* x, int64_t t, uint64_t key, double& best, int64_t& result) {
  if (nan1(x[t])) return false;
  const uint64_t z = mix(key + uint64_t(t + 1) * kGolden);
  const int k = ~z == 0 ? 64 : __builtin_clzll(~z);
  if (double(x[t]) + (std::min(k, 52) + 2) * kLn2 < best) return true;
  const double score = double(x[t]) - log_pos(-log_pos((double(z >> 11) + 0.5) * 0x1p-53));
  if (score > best) { best = score; result = t; }
  return true;
}

int64_t draw_row(const float* x, int64_t n, uint64_t key) {
  double best = std::numeric_limits<double>::lowest();      // a row of -inf never beats it: index 0
  int64_t result = 0, t0 = 0;
#ifdef PDSERVE_GUMBEL8
  if (n >= 8) {
    const __m512i idx = _mm512_setr_epi64(1, 2, 3, 4, 5, 6, 7, 8), ones = _mm512_set1_epi64(-1),
                  golden8 = _mm512_set1_epi64(int64_t(8 * kGolden)), mix1 = _mm512_set1_epi64(int64_t(kMix1)),
                  mix2 = _mm512_set1_epi64(int64_t(kMix2)), cap = _mm512_set1_epi64(52), two = _mm512_set1_epi64(2);
    __m512i z0 = _mm512_add_epi64(_mm512_set1_epi64(int64_t(key)),
                                  _mm512_mullo_epi64(idx, _mm512_set1_epi64(int64_t(kGolden))));
    const __m512d ln2 = _mm512_set1_pd(kLn2), half = _mm512_set1_pd(0.5), scale = _mm512_set1_pd(0x1p-53);
    __m512d best8 = _mm512_set1_pd(best);
    __mmask8 nan = 0;
    for (; t0 + 8 <= n; t0 += 8) {
      __m512i z = _mm512_mullo_epi64(_mm512_xor_si512(z0, _mm512_srli_epi64(z0, 30)), mix1);
      z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 27)), mix2);
      z = _mm512_xor_si512(z, _mm512_srli_epi64(z, 31));
      z0 = _mm512_add_epi64(z0, golden8);
      const __m512d v = _mm512_cvtps_pd(_mm256_loadu_ps(x + t0));
      nan |= _mm512_fpclass_pd_mask(v, 0x81);                // QNaN | SNaN
      const __m512i k = _mm512_add_epi64(_mm512_min_epu64(_mm512_lzcnt_epi64(_mm512_xor_si512(z, ones)), cap), two);
      if (!_mm512_cmp_pd_mask(_mm512_fmadd_pd(_mm512_cvtepi64_pd(k), ln2, v), best8, _CMP_GE_OQ)) continue;
      const __m512d u = _mm512_mul_pd(_mm512_add_pd(_mm512_cvtepu64_pd(_mm512_srli_epi64(z, 11)), half), scale);
      const __m512d score = _mm512_sub_pd(v, log8(_mm512_sub_pd(_mm512_setzero_pd(), log8(u))));
      const double top = _mm512_reduce_max_pd(score);
      if (top > best) {                // the first lane holding it: the smallest index
        best = top;
        best8 = _mm512_set1_pd(top);
        result = t0 + __builtin_ctz(_mm512_cmp_pd_mask(score, best8, _CMP_EQ_OQ));
      }
    }
    if (nan) return first_nan(x, n);
  }
#elif defined(PDSERVE_GUMBEL4)
  // 4 tokens at a time: the hashes and the bounds on 4 lanes; a quad where a bound reaches the best
  // (a few dozen a row) goes through `take`, so the draw is the scalar loop's. k from the hash's
  // top bits (AVX2 has no vector lzcnt): (~z) >> 40 is exact in fp32, whose exponent e gives
  // k = 23 - e; a hash with 24 or more leading ones (0 there) gets a bound that always passes
  const __m256i golden4 = _mm256_set1_epi64x(int64_t(4 * kGolden)), ones = _mm256_set1_epi64x(-1),
                low32 = _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6);
  __m256i z0 = _mm256_add_epi64(_mm256_set1_epi64x(int64_t(key)),
                                _mm256_setr_epi64x(int64_t(kGolden), int64_t(2 * kGolden), int64_t(3 * kGolden),
                                                   int64_t(4 * kGolden)));
  const __m128i exp152 = _mm_set1_epi32(152), abs_mask = _mm_set1_epi32(0x7FFFFFFF), inf = _mm_set1_epi32(0x7F800000);
  const __m256d ln2 = _mm256_set1_pd(kLn2);
  __m256d best4 = _mm256_set1_pd(best);
  __m128i nan = _mm_setzero_si128();
  for (; t0 + 4 <= n; t0 += 4) {
    __m256i z = mullo64(_mm256_xor_si256(z0, _mm256_srli_epi64(z0, 30)), kMix1);
    z = mullo64(_mm256_xor_si256(z, _mm256_srli_epi64(z, 27)), kMix2);
    z = _mm256_xor_si256(z, _mm256_srli_epi64(z, 31));
    z0 = _mm256_add_epi64(z0, golden4);
    const __m128i v32 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + t0));
    nan = _mm_or_si128(nan, _mm_cmpgt_epi32(_mm_and_si128(v32, abs_mask), inf));
    const __m128i top = _mm256_castsi256_si128(
        _mm256_permutevar8x32_epi32(_mm256_srli_epi64(_mm256_xor_si256(z, ones), 40), low32));
    const __m128i k2 = _mm_sub_epi32(exp152, _mm_srli_epi32(_mm_castps_si128(_mm_cvtepi32_ps(top)), 23));   // k + 2
    const __m256d bound = _mm256_fmadd_pd(_mm256_cvtepi32_pd(k2), ln2, _mm256_cvtps_pd(_mm_castsi128_ps(v32)));
    if (!_mm256_movemask_pd(_mm256_cmp_pd(bound, best4, _CMP_GE_OQ))) continue;
    for (int64_t t = t0; t < t0 + 4; ++t)
      if (!take(x, t, key, best, result)) return first_nan(x, n);
    best4 = _mm256_set1_pd(best);
  }
  if (_mm_movemask_epi8(nan)) return first_nan(x, n);
#endif
  for (int64_t t = t0; t < n; ++t)        // what the vector loop left (all of it without one)
    if (!take(x, t, key, best, result)) return first_nan(x, n);
  return result;
}

at::Tensor gumbel_argmax_rows(const at::Tensor& logits, const at::Tensor& keys) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.scalar_type() == at::kFloat,
              "logits: a [rows, vocab] fp32 CPU tensor");
  TORCH_CHECK(keys.device().is_cpu() && keys.dim() == 1 && keys.scalar_type() == at::kLong &&
              keys.size(0) == logits.size(0), "keys: [rows] int64 on the CPU, one a row");
  TORCH_CHECK(logits.size(1) > 0, "logits: an empty row has no token to draw");
  const at::Tensor x = logits.contiguous(), k = keys.contiguous();
  const int64_t rows = x.size(0), n = x.size(1);
  at::Tensor out = at::empty({rows}, k.options());
  const float* xp = x.data_ptr<float>();
  const int64_t* kp = k.data_ptr<int64_t>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) op[r] = draw_row(xp + r * n, n, uint64_t(kp[r]));
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("gumbel_argmax_rows(Tensor logits, Tensor keys) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) {
  m.impl("gumbel_argmax_rows", &gumbel_argmax_rows);
}
