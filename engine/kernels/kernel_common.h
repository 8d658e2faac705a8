// What the CPU kernels share: one test for the vector path (PDSERVE_AVX512: AVX512 F, BW, VL and
// BF16, which every kernel's vectorized code needs; -march=native decides), bf16 <-> fp32 for 16
// lanes, and the dispatch of a runtime row count to kernels compiled per row count.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define PDSERVE_AVX512 1
#endif
#define PDSERVE_UNROLL _Pragma("GCC unroll 16")

namespace pdserve_cpu {

using bf16 = c10::BFloat16;

#ifdef PDSERVE_AVX512
inline __m512 widen16(__m256i h) {          // 16 bf16 -> fp32 (exact)
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16(const bf16* p) { return widen16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline __m512 load16(const bf16* p, __mmask16 m) { return widen16(_mm256_maskz_loadu_epi16(m, p)); }   // off lanes 0
inline __m256i round16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }   // fp32 -> bf16, nearest even
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
