// Shared by the GEMV kernels on blocks of 16 output channels (bf16_gemv in dense_gemv_cpu.cpp,
// int8_gemv_cpu.cpp, int4_gemv_cpu.cpp): y = x @ w.T (+ bias) for a few rows x of bf16
// activations, registered as torch.ops.pdserve.bf16_gemv, int8_gemv and int4_gemv; engine/linear.py
// packs the weights and calls them.
//
// At batch 1 a decode step reads every weight once, so these kernels stream the weight bytes
// once per call for up to kMaxRows rows (bf16 and int8: kWideFirst; every row is computed against
// each weight as it is read; more rows take more passes, over L2-sized chunks:
// `passes_in_chunks`) and keep all arithmetic in registers. The output is rounded to bf16 once,
// bias included. Threads split the output channels (at::parallel_for, torch's thread count). All
// take the weight in blocks of 16 output channels (N: n rounded up to 16, padded with zeros), so a
// thread reads contiguous memory. bf16: with AVX512 (F, BW, VL, BF16) the weights meet broadcast
// pairs of inputs in `vdpbf16ps` across 16 channels (`pair_dots`), products and sums in fp32.
// int8 and int4: the activations rounded to int8 first (`quantize_rows`), then with AVX512-VNNI
// broadcast quads of them meet the weights in `vpdpbusd`, each group's sum exact in int32. Elsewhere
// scalar loops compute the same sums from the same layouts.
#pragma once

#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include "kernel_common.h"

namespace pdserve_gemv {

using namespace pdserve_cpu;
constexpr int64_t kMaxRows = 8;

inline float bias_at(const bf16* bias, int64_t n) { return bias ? static_cast<float>(bias[n]) : 0.f; }

#ifdef PDSERVE_AVX512
// y[n .. n + 16) = v + bias, rounded to bf16; only the channels below N are written
inline void store16(bf16* y, const bf16* bias, int64_t N, int64_t n, __m512 v) {
  const __mmask16 valid = lanes16(N - n);
  if (bias) v = _mm512_add_ps(v, load16(bias + n, valid));
  _mm256_mask_storeu_epi16(y + n, valid, round16(v));
}
#endif

#ifdef PDSERVE_AVX512
// int4's weight widened for the AMX GEMM (amx_bf16.h `Weights::dequantize`): one vector of its quads
// layout (16 channels x 4 inputs, f[i] holding channels 4i .. 4i + 3 as element 4c + e, already
// fp32) as two rows of bf16_gemv's pairs layout (16 channels x 2 inputs, 32 bf16 each: inputs 0-1,
// then 2-3), rounded to bf16
inline void quads_to_pairs(const __m512 f[4], bf16* out) {
  const __m512i first = _mm512_setr_epi32(0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29);
  const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(2));
  for (int h = 0; h < 2; ++h) {                    // _mm512_cvtne2ps_pbh(a, b): b's 16 first, then a's
    const __m512i pick = h ? second : first;
    const __m512bh row = _mm512_cvtne2ps_pbh(_mm512_permutex2var_ps(f[2], pick, f[3]),
                                             _mm512_permutex2var_ps(f[0], pick, f[1]));
    _mm512_storeu_si512(out + 32 * h, (__m512i)row);
  }
}
// How far ahead of the widening the quantized weight is prefetched: from memory the widening
// (~8 vector ops a 64-byte vector) does not overlap the stream by itself (a 2-core AMX Xeon, one
// thread widening 135 MiB of int8, when int8 was widened too: 21 ms, 14 with this; reading alone
// 10, widening in L2 7.5)
constexpr int kWidenAhead = 2048;
// 16 unsigned bytes as fp32
inline __m512 bytes16(__m128i v) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v)); }
#endif

#ifdef PDSERVE_AVX2
// y[n .. n + 8) = v + bias, rounded to bf16 (nearest even); only the channels below N are written
inline void store8(bf16* y, const bf16* bias, int64_t N, int64_t n, __m256 v) {
  if (n + 8 <= N) return round_store8(y + n, bias ? _mm256_add_ps(v, load8(bias + n)) : v);
  alignas(32) float t[8];
  _mm256_store_ps(t, v);
  for (int c = 0; c < 8 && n + c < N; ++c) y[n + c] = static_cast<bf16>(t[c] + bias_at(bias, n + c));
}
// The AVX2 kernels take a block's rows in groups of up to 4 (their accumulators fit 16 registers;
// the block's weights come again from L1/L2 for each group): f(integral_constant<int, S>, r0)
template <int R, typename F>
inline void in_fours(F&& f) {
  int r0 = 0;
  for (; r0 + 4 <= R; r0 += 4) f(std::integral_constant<int, 4>{}, r0);
  if constexpr (R % 4 != 0) f(std::integral_constant<int, R % 4>{}, r0);
}
#endif

#ifdef PDSERVE_AVX512
// The kernels on weights in pairs of inputs (int8, bf16): R rows x NB blocks of 16 output
// channels over K inputs (K even). `pair(j, k)` gives block j's weights at inputs k and k + 1 as
// 32 bf16 (channel c's two at lanes 2c, 2c + 1), the layout `vdpbf16ps` multiplies with a
// broadcast pair of inputs; `out(j, r, sums)` takes the 16 fp32 sums of row r and block j. A
// independent chains per accumulator hide the dot product's latency where few rows and blocks
// give too few.
template <int R, int NB, typename Pair, typename Out>
inline void pair_dots(const bf16* x, int64_t K, Pair&& pair, Out&& out) {
  constexpr int A = R * NB <= 2 ? 4 : (R <= 4 ? 2 : 1);
  __m512 acc[NB][A][R];
  PDSERVE_UNROLL
  for (int j = 0; j < NB; ++j)
    for (int a = 0; a < A; ++a) for (int r = 0; r < R; ++r) acc[j][a][r] = _mm512_setzero_ps();
  auto step = [&](int j, int64_t k, int a) {
    const __m512bh wp = pair(j, k);
    PDSERVE_UNROLL
    for (int r = 0; r < R; ++r) {
      int32_t two;
      std::memcpy(&two, x + r * K + k, 4);
      acc[j][a][r] = _mm512_dpbf16_ps(acc[j][a][r], (__m512bh)_mm512_set1_epi32(two), wp);
    }
  };
  int64_t k = 0;
  for (; k + 2 * A <= K; k += 2 * A) {
    PDSERVE_UNROLL
    for (int a = 0; a < A; ++a) {
      PDSERVE_UNROLL
      for (int j = 0; j < NB; ++j) step(j, k + 2 * a, a);
    }
  }
  for (; k < K; k += 2)
    for (int j = 0; j < NB; ++j) step(j, k, 0);
  PDSERVE_UNROLL
  for (int j = 0; j < NB; ++j) {
    PDSERVE_UNROLL
    for (int r = 0; r < R; ++r) {
      __m512 sum = acc[j][0][r];
      PDSERVE_UNROLL
      for (int a = 1; a < A; ++a) sum = _mm512_add_ps(sum, acc[j][a][r]);
      out(j, r, sum);
    }
  }
}
#endif

// The scalar loop's sum of one row x [K] against channel c of one block in pairs layout
template <typename W>
inline float pair_dot_scalar(const bf16* x, int64_t K, const W* block, int64_t c) {
  float acc = 0.f;
  for (int64_t k = 0; k < K; ++k) acc += static_cast<float>(x[k]) * static_cast<float>(block[(k / 2) * 32 + 2 * c + k % 2]);
  return acc;
}

// The bf16 kernel computes the R rows of NB blocks of 16 channels, whose weights it reads side by
// side: two stretches of a thread's blocks at once. Two memory streams measured 15-18 % faster
// than one for the (then weight-only) int8 kernel up to 4 rows on this project's CPU
// (benchmarks/linear_bench.py's shapes), and at 5-8 rows, where one broadcast input pair then
// serves two blocks, 1.2-1.5x (bf16 at 8 rows, 1 thread: 13.4 -> 8.9 ms a step's linears). The
// int8 and int4 kernels (VNNI) read one stream fetched kAhead bytes ahead.

// Blocks [b0, b1) of R rows: with AVX512, as two streams (the first and second half of the
// range side by side) for R <= kTwoUpTo, else one; elsewhere the scalar loop, block by block.
template <int R, int kTwoUpTo, typename Avx, typename Scalar>
void over_blocks(int64_t b0, int64_t b1, Avx&& avx, Scalar&& scalar) {
#ifdef PDSERVE_AVX512
  int64_t b = b0;
  if constexpr (R <= kTwoUpTo) {
    const int64_t half = (b1 - b0) / 2;
    for (; b < b0 + half; ++b) {
      const int64_t two[2] = {b, b + half};
      avx(std::integral_constant<int, 2>{}, two);
    }
    b += half;
  }
  for (; b < b1; ++b) avx(std::integral_constant<int, 1>{}, &b);
#else
  for (int64_t b = b0; b < b1; ++b) scalar(b);
#endif
}
// A thread's share of the weight [u0, u1) (u: a block of 16 channels, or one channel for fp32;
// `unit_bytes` of weight each) for `rows` rows: `pass(r0, r, c0, c1)` computes rows [r0, r0 + r)
// on units [c0, c1). The first pass takes up to kFirst rows (kMaxRows, or `kWideFirst` for a
// kernel with a wider first pass), each later one up to kMaxRows; no rows, no pass. One pass
// covers the whole share; more walk it in chunks of about kChunkBytes so that the passes after
// the first read a chunk from L2, not memory: measured on this project's CPU (bf16, SmolLM2's
// linears, 1 thread) 12-32 rows took 0.76-0.81x the time of passes over the whole share, and
// 12-64 rows 0.80-0.90x oneDNN's packed bf16 GEMM (2 threads, 16-64: 0.85-0.87x); 512 KiB
// chunks beat 128-256 and 1024 (the core's L2 is 1 MiB).
constexpr int64_t kChunkBytes = 512 * 1024;

template <int64_t kFirst = kMaxRows, typename Pass>
void passes_in_chunks(int64_t rows, int64_t u0, int64_t u1, int64_t unit_bytes, int64_t min_units, Pass&& pass) {
  if (rows <= 0) return;
  const int64_t first = std::min(rows, kFirst);
  const int64_t step = rows == first ? u1 - u0 : std::max<int64_t>(min_units, kChunkBytes / unit_bytes);
  for (int64_t c0 = u0; c0 < u1; c0 += step) {
    const int64_t c1 = std::min(u1, c0 + step);
    pass(0, first, c0, c1);
    for (int64_t r0 = first; r0 < rows; r0 += kMaxRows) pass(r0, std::min(kMaxRows, rows - r0), c0, c1);
  }
}

// A first pass wider than kMaxRows (bf16 and int8: up to 16 rows, one weight stream, R
// accumulators) does twice the arithmetic per weight byte streamed from memory, which at 8 rows
// leaves the vector units idle most of the time; but then the hardware prefetcher alone no longer
// keeps enough of the stream in flight, so such a pass fetches its weights kAhead bytes ahead.
// Measured (benchmarks/linear_bench.py's whole step, against 8-row passes, builds alternated),
// at 12 / 16 / 24 / 32 / 64 rows: bf16 1 thread 0.78x / 0.84x / 0.92x / 0.91x / 0.97x, 2 threads
// 0.80x / 0.86x / 0.92x / 0.94x / 0.97x; int8 1 thread 0.65x / 0.75x / 0.84x / 0.87x / 0.92x,
// 2 threads (to 32) 0.68-0.76x / 0.76-0.77x / 0.85x / 0.87-0.89x. 4-8 KiB ahead beat 0.5-2 KiB
// (int8: 3 and 6 KiB alike); without fetching ahead the 16-row bf16 pass took 1.6x the two
// 8-row passes. (The int8 numbers are the weight-only kernel's, before its VNNI one.) int4 keeps
// 8 rows: its group's unpacked nibbles, scales, sums and outputs fill the registers at 8.
constexpr int64_t kWideFirst = 16;
constexpr int64_t kAhead = 6144;

// The int8 activations of the int8 and int4 kernels: each row's groups of kQGroup inputs rounded to
// int8 by 127 / their max (llama.cpp's Q8_0 scheme).
constexpr int64_t kQGroup = 32;

// The rounded rows as the kernels read them: rows in blocks of 8 (a pass's rows: every pass starts
// at a multiple of 8; fewer rows, one block of them all), and within a block the rows' quads (4
// inputs) side by side, so that row r's quad sits at a fixed offset 4 (r % 8) from its block's first
// row's (an immediate in the kernels' broadcasts, not a pointer register a row) and a pass reads
// its rows' quads as one contiguous stream; the groups' scales and sums row by row within a group.
//   quad(r, g, i): row r's inputs 32g + 4i .. 32g + 4i + 3 (int8)
//     at xq[((r / 8) * quads + 8g + i) * 4 * block + 4 (r % 8)]   (quads = Kp / 4, block = min(rows, 8))
//   scale(r, g), sum(r, g): max / 127 and sum(xq) of row r's group g at [g * rows + r]
// `at(r0)` is the view of rows r0.. (a later pass's rows; r0 a multiple of 8).
constexpr int64_t kRowBlock = 8;
struct RoundedView {
  const int8_t* xq;
  const float* scales;
  const int32_t* sums;
  int64_t rows;            // of the whole x: the stride between groups' scales and sums
  int64_t quads;           // Kp / 4: the quads of a row
  int64_t block;           // rows in a block: min(rows, kRowBlock)
  int64_t offset(int64_t r, int64_t g, int64_t i) const {
    return ((r / kRowBlock) * quads + g * (kQGroup / 4) + i) * 4 * block + 4 * (r % kRowBlock);
  }
  const int8_t* quad(int64_t r, int64_t g, int64_t i) const { return xq + offset(r, g, i); }
  float scale(int64_t r, int64_t g) const { return scales[g * rows + r]; }
  int32_t sum(int64_t r, int64_t g) const { return sums[g * rows + r]; }
  RoundedView at(int64_t r0) const {
    TORCH_INTERNAL_ASSERT(r0 % kRowBlock == 0, "a pass starts at a block of rows");
    return {xq + offset(r0, 0, 0), scales + r0, sums + r0, rows, quads, block};
  }
};

// One row's group of kQGroup inputs from k0 (zeros past K) rounded: its 8 quads into `four` (32 int8),
// its scale max / 127 and sum(xq). Built without -ffast-math: xq must be round(x * (127 / max))
// exactly as written (a reassociated (x * 127) / max rounds 1 in about 3000 elements of bf16 inputs
// the other way). A group holding a NaN gets a NaN scale, so the outputs it feeds are NaN, as a bf16
// product's would be (the vector max drops NaNs, and a NaN would round to the integer 0).
__attribute__((optimize("no-fast-math")))
inline void round_group(const bf16* row, int64_t K, int64_t k0, int32_t* four, float& scale, int32_t& sum) {
  float amax = 0.f;
  bool nan = false;
#ifdef PDSERVE_AVX512
  const __m512 v0 = load16(row + k0, lanes16(K - k0)), v1 = load16(row + k0 + 16, lanes16(K - k0 - 16));
  amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
  nan = nan16(v0) | nan16(v1);
  const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv));    // to nearest even
  const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(four), _mm512_cvtepi32_epi8(q0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(four + 4), _mm512_cvtepi32_epi8(q1));
  sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
#else
#ifdef PDSERVE_AVX2
  // a whole group: the scalar loop's numbers (the same product, rounded to nearest even by the
  // conversion). The loop ran at ~10 ns an input: an int8 call at one row, 576 / 1536 inputs, took
  // 9.3 / 19.2 us against bf16_gemv's 3.8 / 4.6; with this 4.0 / 5.2 (session 22, 1 thread, hot)
  if (k0 + kQGroup <= K) {
    const __m256i magnitude = _mm256_set1_epi32(0x7FFFFFFF), inf = _mm256_set1_epi32(0x7F800000);
    __m256 v[4];
    __m256 m = _mm256_setzero_ps();
    __m256i bad = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
      v[j] = load8(row + k0 + 8 * j);
      const __m256i bits = _mm256_and_si256(_mm256_castps_si256(v[j]), magnitude);
      bad = _mm256_or_si256(bad, _mm256_cmpgt_epi32(bits, inf));
      m = _mm256_max_ps(m, _mm256_castsi256_ps(bits));
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
    nan = !_mm256_testz_si256(bad, bad);
    const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    __m256i q[4];
    __m256i total = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
      q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv));    // to nearest even
      total = _mm256_add_epi32(total, q[j]);
    }
    // |q| <= 127: the packs do not saturate; they interleave 4-lane pieces, which the permute undoes
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(four),
                        _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
    sum = _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1)));
    scale = nan ? std::numeric_limits<float>::quiet_NaN() : amax / 127.f;
    return;
  }
#endif
  float v[kQGroup];
  for (int64_t i = 0; i < kQGroup; ++i) {
    v[i] = k0 + i < K ? static_cast<float>(row[k0 + i]) : 0.f;
    amax = std::max(amax, std::fabs(v[i]));
    nan = nan || nan1(v[i]);
  }
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  int8_t q[kQGroup];
  sum = 0;
  for (int64_t i = 0; i < kQGroup; ++i) {
    q[i] = static_cast<int8_t>(std::nearbyint(v[i] * inv));
    sum += q[i];
  }
  std::memcpy(four, q, kQGroup);
#endif
  scale = nan ? std::numeric_limits<float>::quiet_NaN() : amax / 127.f;
}

// x [R, K] bf16 -> xq [ceil(R / 8), Kp / 4, min(R, 8), 4] int8 (Kp: K rounded up to kQGroup), and per
// group its scale [Kp / kQGroup, R] fp32 and sum(xq) [Kp / kQGroup, R] int32: the layout RoundedView
// reads, which it returns.
inline RoundedView quantize_rows(const bf16* x, int64_t R, int64_t K, int64_t Kp, int8_t* xq, float* s, int32_t* sums) {
  constexpr int kQuads = kQGroup / 4;
  const RoundedView view{xq, s, sums, R, Kp / 4, std::min(R, kRowBlock)};
  // threads split the groups, whose quads lie apart in every block of rows (split by rows, two
  // threads would write parts of the same cache lines)
  at::parallel_for(0, Kp / kQGroup, 64 / std::max<int64_t>(R, 1) + 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      int64_t r = 0;
#ifdef PDSERVE_AVX512
      for (; r + 4 <= R; r += 4) {            // 4 rows at once: their quad i is 16 contiguous bytes
        alignas(32) int32_t four[4][kQuads];
        for (int j = 0; j < 4; ++j) round_group(x + (r + j) * K, K, g * kQGroup, four[j], s[g * R + r + j], sums[g * R + r + j]);
        const __m256i a = _mm256_load_si256(reinterpret_cast<const __m256i*>(four[0]));
        const __m256i b = _mm256_load_si256(reinterpret_cast<const __m256i*>(four[1]));
        const __m256i c = _mm256_load_si256(reinterpret_cast<const __m256i*>(four[2]));
        const __m256i d = _mm256_load_si256(reinterpret_cast<const __m256i*>(four[3]));
        const __m256i ab0 = _mm256_unpacklo_epi32(a, b), ab1 = _mm256_unpackhi_epi32(a, b);   // a0 b0 a1 b1 | a4 b4 a5 b5
        const __m256i cd0 = _mm256_unpacklo_epi32(c, d), cd1 = _mm256_unpackhi_epi32(c, d);
        const __m256i t[4] = {_mm256_unpacklo_epi64(ab0, cd0), _mm256_unpackhi_epi64(ab0, cd0),   // a0 b0 c0 d0 | a4 ..
                              _mm256_unpacklo_epi64(ab1, cd1), _mm256_unpackhi_epi64(ab1, cd1)};
        for (int i = 0; i < 4; ++i) {
          _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + view.offset(r, g, i)), _mm256_castsi256_si128(t[i]));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + view.offset(r, g, i + 4)), _mm256_extracti128_si256(t[i], 1));
        }
      }
#endif
      for (; r < R; ++r) {
        int32_t four[kQuads];
        round_group(x + r * K, K, g * kQGroup, four, s[g * R + r], sums[g * R + r]);
        int8_t* quads = xq + view.offset(r, g, 0);            // quad i at quads + 4 * block * i
        for (int i = 0; i < kQuads; ++i) std::memcpy(quads + 4 * view.block * i, four + i, 4);
      }
    }
  });
  return view;
}

// The calling thread's buffers for quantize_rows' outputs, grown as needed and kept (the pool's
// workers only read them): a decode step makes about 120 int8/int4 calls, and three tensor
// allocations a call cost time: a 16 x 32 call took 2.8 us with them, 2.0-2.1 with these
// (1 thread, builds alternated twice).
struct RoundedRows {
  std::vector<int8_t> xq;
  std::vector<float> scale;
  std::vector<int32_t> sums;
};
inline RoundedView rounded_rows(const bf16* x, int64_t R, int64_t K, int64_t Kp) {
  thread_local RoundedRows rows;
  rows.xq.resize((R + kRowBlock - 1) / kRowBlock * std::min(R, kRowBlock) * Kp);
  rows.scale.resize(R * (Kp / kQGroup));
  rows.sums.resize(R * (Kp / kQGroup));
  return quantize_rows(x, R, K, Kp, rows.xq.data(), rows.scale.data(), rows.sums.data());
}

inline void check_x(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == at::kBFloat16,
              "x: a [rows, in] bf16 CPU tensor");
}

inline const bf16* bias_ptr(const std::optional<at::Tensor>& bias, int64_t n) {
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->numel() == n && bias->is_contiguous(),
              "bias: [out] contiguous bf16");
  return bias->data_ptr<bf16>();
}

}  // namespace pdserve_gemv
