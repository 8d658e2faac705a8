// What the CPU kernels share: one test for the vector path (PDSERVE_AVX512: AVX512 F, BW, VL and
// BF16, which every kernel's vectorized code needs; -march=native decides; else PDSERVE_AVX2 for
// 8-lane paths), bf16 <-> fp32 for 16 (8) lanes, and the dispatch of a runtime row count to
// kernels compiled per row count.
#pragma once

#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define PDSERVE_AVX512 1
#endif
// and AVX512-VNNI's `vpdpbusd` (u8 x s8 products summed in int32): the int8 and int4 kernels
#if defined(PDSERVE_AVX512) && defined(__AVX512VNNI__)
#define PDSERVE_VNNI 1
#endif
// Elsewhere on x86-64 with AVX2 and FMA (AMD Zen 1-3, Intel before Ice Lake's servers, most
// clients): 8-lane paths of the GEMVs, the norms, RoPE, argmax and both attention kernels
// (PDSERVE_AVX2)
#if !defined(PDSERVE_AVX512) && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PDSERVE_AVX2 1
#endif
#define PDSERVE_UNROLL _Pragma("GCC unroll 16")

namespace pdserve_cpu {

using bf16 = c10::BFloat16;

// A NaN by its bits (any CPU): the kernels build with -ffast-math, under which std::isnan and an
// unordered compare may be folded to false (nan16 below: the same test on 16 lanes)
inline bool nan1(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  return (bits & 0x7FFFFFFFu) > 0x7F800000u;
}

// The first key a query at position len - 1 attends: 0, or with a sliding window of W keys
// (transformers' `kv_idx > q_idx - W`) the W-th last
inline int64_t first_key(int64_t len, int64_t window) { return window > 0 && len > window ? len - window : 0; }

// Gemma 2's soft cap of one attention score, cap * tanh(s / cap) (softcap16 / softcap8: of many)
inline float softcap1(float s, float cap) { return cap * std::tanh(s / cap); }

#ifdef PDSERVE_AVX512
inline __m512 widen16(__m256i h) {          // 16 bf16 -> fp32 (exact)
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16(const bf16* p) { return widen16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline __m512 load16(const bf16* p, __mmask16 m) { return widen16(_mm256_maskz_loadu_epi16(m, p)); }   // off lanes 0
inline __m256i round16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }   // fp32 -> bf16, nearest even
// the first n of 16 lanes (a row's tail: n <= 0 none, n >= 16 all)
inline __mmask16 lanes16(int64_t n) {
  return n >= 16 ? __mmask16(0xFFFF) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1);
}

// The NaN lanes of v, found by their bits: the kernels build with -ffast-math, under which compares
// may assume there are none (a NaN's magnitude bits are above infinity's)
inline __mmask16 nan16(__m512 v) {
  return _mm512_cmpgt_epi32_mask(_mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0x7FFFFFFF)),
                                 _mm512_set1_epi32(0x7F800000));
}

// e^x for 16 lanes, inline: a call into glibc's vector expf makes the compiler save and restore
// every vector register live around it (the attention kernels' softmax loops). x = n ln 2 + r with
// n = round(x / ln 2) and r in [-ln 2 / 2, ln 2 / 2] (ln 2 in two parts, so r is exact to fp32),
// e^r by its Taylor polynomial to r^7 (truncation below 1e-8 relative), times 2^n by `vscalefps`
// (which underflows to 0 and overflows to inf). Within 2 ulp of e^x in fp32 for x in [-87, 88]
// (checked against double on a grid in the session that added it); x is clamped to [-104, 89]
// first (e^-104 is 0 in fp32, e^89 inf); NaN stays NaN.
inline __m512 exp16(__m512 x_in) {
  const __mmask16 nan = nan16(x_in);
  const __m512 x = _mm512_min_ps(_mm512_set1_ps(89.f), _mm512_max_ps(_mm512_set1_ps(-104.f), x_in));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);          // ln 2, high part
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682030941723212e-6f), r);          // ln 2, the rest
  __m512 p = _mm512_set1_ps(1.f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_mask_mov_ps(_mm512_scalef_ps(p, n), nan, x_in);
}

// A softmax's middle pass over s[0 .. n): s <- exp((s - max) * scale) (exp16, inline), returns their
// sum (the decode kernel: scale 1, it scaled the scores; the prefill kernel: its softmax scale)
inline float exp_and_sum(float* s, int64_t n, float max, float scale) {
  const __m512 m = _mm512_set1_ps(max), sc = _mm512_set1_ps(scale);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 valid = lanes16(n - j);
    const __m512 e = exp16(_mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(valid, s + j), m), sc));
    _mm512_mask_storeu_ps(s + j, valid, e);
    sum = _mm512_mask_add_ps(sum, valid, sum, e);
  }
  return _mm512_reduce_add_ps(sum);
}

// Gemma 2's soft cap of attention scores over s[0 .. n): s <- cap * tanh(s / cap), tanh(u) as
// 1 - 2 / (e^{2u} + 1) with exp16 (e^{2u} overflowing to inf gives 1, underflowing to 0 gives -1)
inline void softcap16(float* s, int64_t n, float cap) {
  const __m512 c = _mm512_set1_ps(cap), to_2u = _mm512_set1_ps(2.f / cap), one = _mm512_set1_ps(1.f);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 valid = lanes16(n - j);
    const __m512 e = exp16(_mm512_mul_ps(_mm512_maskz_loadu_ps(valid, s + j), to_2u));
    const __m512 t = _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.f), _mm512_add_ps(e, one)));
    _mm512_mask_storeu_ps(s + j, valid, _mm512_mul_ps(c, t));
  }
}
#endif

#ifdef PDSERVE_AVX2
// The sum of 8 fp32 lanes, one fixed tree (batch-invariant)
inline float sum8(__m256 v) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}
inline __m256 load8(const bf16* p) {        // 8 bf16 -> fp32 (exact)
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
// The NaN lanes of v (all bits set), by their bits: nan16's test on 8 lanes
inline __m256i nan8(__m256 v) {
  return _mm256_cmpgt_epi32(_mm256_and_si256(_mm256_castps_si256(v), _mm256_set1_epi32(0x7FFFFFFF)),
                            _mm256_set1_epi32(0x7F800000));
}
inline void round_store8(bf16* p, __m256 v) {   // fp32 -> 8 bf16, nearest even as c10's cast (NaN: 0x7FC0)
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan8(v));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}
// The first n of 8 lanes as a maskload mask (n <= 0 none, n >= 8 all)
inline __m256i lanes8(int64_t n) {
  const int64_t k = n < 0 ? 0 : (n > 8 ? 8 : n);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(k)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// e^x for 8 lanes, inline: exp16's reduction and polynomial (above), 2^n built in the exponent bits
// (AVX2 has no `vscalefps`), so x is clamped to [-87, 88] first: below -87 it gives e^-87 (1.6e-38),
// not 0 (a softmax's x <= 0 and its sum >= 1 make that invisible), above 88 e^88, not inf; NaN
// stays NaN
inline __m256 exp8(__m256 x_in) {
  const __m256 nan = _mm256_castsi256_ps(nan8(x_in));
  const __m256 x = _mm256_min_ps(_mm256_set1_ps(88.f), _mm256_max_ps(_mm256_set1_ps(-87.f), x_in));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860682030941723212e-6f), r);
  __m256 p = _mm256_set1_ps(1.f / 5040);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 720));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  // n in [-126, 127]: 2^n is the float with biased exponent n + 127
  const __m256 two_n = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                                              _mm256_set1_epi32(127)), 23));
  return _mm256_blendv_ps(_mm256_mul_ps(p, two_n), x_in, nan);
}

// exp_and_sum on 8 lanes: s <- exp((s - max) * scale) over s[0 .. n), returns their sum
inline float exp_and_sum8(float* s, int64_t n, float max, float scale) {
  const __m256 m = _mm256_set1_ps(max), sc = _mm256_set1_ps(scale);
  __m256 sum = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 e = exp8(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(s + j), m), sc));
    _mm256_storeu_ps(s + j, e);
    sum = _mm256_add_ps(sum, e);
  }
  if (j < n) {
    const __m256i valid = lanes8(n - j);
    const __m256 e = _mm256_and_ps(exp8(_mm256_mul_ps(_mm256_sub_ps(_mm256_maskload_ps(s + j, valid), m), sc)),
                                   _mm256_castsi256_ps(valid));
    _mm256_maskstore_ps(s + j, valid, e);
    sum = _mm256_add_ps(sum, e);
  }
  return sum8(sum);
}

// softcap16 on 8 lanes (exp8 saturates at e^88: tanh is 1 there all the same)
inline void softcap8(float* s, int64_t n, float cap) {
  const __m256 c = _mm256_set1_ps(cap), to_2u = _mm256_set1_ps(2.f / cap), one = _mm256_set1_ps(1.f);
  for (int64_t j = 0; j < n; j += 8) {
    const __m256i valid = lanes8(n - j);
    const __m256 e = exp8(_mm256_mul_ps(_mm256_maskload_ps(s + j, valid), to_2u));
    const __m256 t = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.f), _mm256_add_ps(e, one)));
    _mm256_maskstore_ps(s + j, valid, _mm256_mul_ps(c, t));
  }
}
#endif

// Kernel<rows>::run(args...) for 1 <= rows <= kMax (a row count above kMax runs Kernel<kMax>);
// only Kernel<1 .. kMax> are instantiated
template <template <int> class Kernel, int kMax = 8, int R = 1, typename... Args>
void with_rows(int64_t rows, Args... args) {
  static_assert(1 <= R && R <= kMax && kMax <= 16);
  if constexpr (R == kMax) {
    Kernel<kMax>::run(args...);
  } else {
    if (rows == R) return Kernel<R>::run(args...);
    with_rows<Kernel, kMax, R + 1>(rows, args...);
  }
}

}  // namespace pdserve_cpu
