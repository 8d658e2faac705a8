// Weight-only int8 / int4 GEMV for a few rows of bf16 activations (CPU):
// torch.ops.pdserve.int8_gemv and torch.ops.pdserve.int4_gemv; engine/linear.py packs the
// weights and calls them for steps of at most `small_rows` rows.
//
// At batch 1 a decode step reads every weight once, so these kernels stream the weight bytes
// once per call for up to kMaxRows rows (every row is computed against each weight as it is
// read; more rows take one pass per kMaxRows) and keep all arithmetic in registers. Products
// and sums in fp32; the output is rounded to bf16 once, bias included. Threads split the
// output channels (at::parallel_for, torch's thread count).
//
// Both take the weight in blocks of 16 output channels (N: n rounded up to 16, padded with
// zeros), so a thread reads one contiguous stretch of memory:
//   int8_gemv(x [R, K] bf16, q [N/16, ceil(K/2), 32] int8, scale [N] fp32, bias [n] bf16?, n)
//       -> [R, n] bf16      y[r, n] = scale[n] * sum_k x[r, k] * q[n, k] + bias[n]
//     Byte 2c + e of q[b, j] is channel 16b + c's q at input 2j + e (odd K: a zero column added).
//   int4_gemv(x [R, K] bf16, packed [N/16, K/32, 256] uint8, sz [N/16, K/32, 2, 16] bf16,
//             bias [n] bf16?, n) -> [R, n] bf16                                       (K % 32 == 0)
//       y[r, n] = sum_g sum_{k in g} x[r, k] * ((q[n, k] - 8) * s[n, g] + z[n, g]) + bias[n]
//     A block of 16 output channels and one group of 32 inputs is 8 steps of 32 bytes; in step t,
//     byte 2c + e holds channel c's q at input 4t + e (low nibble) and 4t + 2 + e (high nibble).
//     sz[b, g, 0, c] and sz[b, g, 1, c] are channel 16b + c's scale s and zero z of group g.
//
// AVX512 (F, BW, VL, BF16): the weights become bf16 numbers, exactly, and meet broadcast pairs
// of inputs in `vdpbf16ps` across 16 channels (fp32 products and sums). int8 goes through fp32
// (|q| <= 127 fits bf16's 8 significant bits); an int4 nibble q becomes the bf16 number 128 + q
// by OR-ing in 128's exponent, so per group
//   y += s * dot(x, 128 + q) + (z - 136 s) * sum(x).
// Elsewhere a scalar loop computes the same sums from the same layouts.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define PDSERVE_AVX512 1
#endif
#define PDSERVE_UNROLL _Pragma("GCC unroll 16")

namespace {

using bf16 = c10::BFloat16;
constexpr int64_t kMaxRows = 8;
constexpr int64_t kGroup = 32;

inline float bias_at(const bf16* bias, int64_t n) { return bias ? static_cast<float>(bias[n]) : 0.f; }

#ifdef PDSERVE_AVX512
// y[n .. n + 16) = v + bias, rounded to bf16; only the channels below N are written
inline void store16(bf16* y, const bf16* bias, int64_t N, int64_t n, __m512 v) {
  const __mmask16 valid = N - n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (N - n)) - 1);
  if (bias)
    v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(valid, bias + n)), 16)));
  _mm256_mask_storeu_epi16(y + n, valid, (__m256i)_mm512_cvtneps_pbh(v));
}

inline __m512 bf16x16(const bf16* p) {      // 16 bf16 -> fp32 (exact)
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
#endif

// ---- int8: x [R][K] bf16, K even -------------------------------------------------------------

template <int R>
void int8_block(const bf16* x, int64_t K, const int8_t* q, const float* scale, const bf16* bias, bf16* y,
                int64_t N, int64_t b) {
  const int8_t* p = q + b * K * 16;
#ifdef PDSERVE_AVX512
  constexpr int A = R == 1 ? 4 : (R <= 4 ? 2 : 1);      // independent dot-product chains per row
  __m512 acc[A][R];
  PDSERVE_UNROLL
  for (int a = 0; a < A; ++a) for (int r = 0; r < R; ++r) acc[a][r] = _mm512_setzero_ps();
  auto step = [&](int64_t k, int a) {                    // inputs k, k + 1 of the 16 channels
    const __m128i* w = reinterpret_cast<const __m128i*>(p + k * 16);
    const __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(w)));       // channels 0-7
    const __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(w + 1)));   // channels 8-15
    const __m512bh wp = _mm512_cvtne2ps_pbh(w1, w0);     // exact: |q| <= 127 fits bf16's 8 bits
    PDSERVE_UNROLL
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * K + k, 4);
      acc[a][r] = _mm512_dpbf16_ps(acc[a][r], (__m512bh)_mm512_set1_epi32(pair), wp);
    }
  };
  int64_t k = 0;
  for (; k + 2 * A <= K; k += 2 * A) {
    PDSERVE_UNROLL
    for (int a = 0; a < A; ++a) step(k + 2 * a, a);
  }
  for (; k < K; k += 2) step(k, 0);
  const __m512 s = _mm512_loadu_ps(scale + b * 16);
  PDSERVE_UNROLL
  for (int r = 0; r < R; ++r) {
    __m512 sum = acc[0][r];
    PDSERVE_UNROLL
    for (int a = 1; a < A; ++a) sum = _mm512_add_ps(sum, acc[a][r]);
    store16(y + r * N, bias, N, b * 16, _mm512_mul_ps(sum, s));
  }
#else
  for (int64_t c = 0; c < 16 && b * 16 + c < N; ++c)
    for (int r = 0; r < R; ++r) {
      float acc = 0.f;
      for (int64_t k = 0; k < K; ++k)
        acc += static_cast<float>(x[r * K + k]) * static_cast<float>(p[(k / 2) * 32 + 2 * c + k % 2]);
      y[r * N + b * 16 + c] = static_cast<bf16>(acc * scale[b * 16 + c] + bias_at(bias, b * 16 + c));
    }
#endif
}

// ---- int4: x [R][K] stays bf16; xsum [R][groups] in fp32 -------------------------------------

template <int R>
void int4_block(const bf16* x, const float* xsum, int64_t K, const uint8_t* packed, const bf16* sz,
                const bf16* bias, bf16* y, int64_t N, int64_t b) {
  const int64_t groups = K / kGroup;
#ifdef PDSERVE_AVX512
  constexpr int A = R == 1 ? 4 : (R == 2 ? 2 : 1);      // independent dot-product chains per row and half
  const __m512i nibble = _mm512_set1_epi16(0x000F), magic = _mm512_set1_epi16(0x4300);   // bf16 128.0
  __m512 acc[R];
  PDSERVE_UNROLL
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* p = packed + (b * groups + g) * 256;
    __m512 lo[A][R], hi[A][R];
    PDSERVE_UNROLL
    for (int a = 0; a < A; ++a) for (int r = 0; r < R; ++r) lo[a][r] = hi[a][r] = _mm512_setzero_ps();
    PDSERVE_UNROLL
    for (int t = 0; t < 8; ++t) {
      const int64_t k = g * kGroup + 4 * t;
      const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * t)));
      const __m512bh wl = (__m512bh)_mm512_ternarylogic_epi32(w, nibble, magic, 0xEA);   // (w & 15) | magic
      const __m512bh wh = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(w, 4), magic);
      PDSERVE_UNROLL
      for (int r = 0; r < R; ++r) {
        int32_t pair_lo, pair_hi;                        // inputs (k, k + 1) and (k + 2, k + 3)
        std::memcpy(&pair_lo, x + r * K + k, 4);
        std::memcpy(&pair_hi, x + r * K + k + 2, 4);
        lo[t % A][r] = _mm512_dpbf16_ps(lo[t % A][r], (__m512bh)_mm512_set1_epi32(pair_lo), wl);
        hi[t % A][r] = _mm512_dpbf16_ps(hi[t % A][r], (__m512bh)_mm512_set1_epi32(pair_hi), wh);
      }
    }
    const __m512 s = bf16x16(sz + (b * groups + g) * 32), z = bf16x16(sz + (b * groups + g) * 32 + 16);
    const __m512 m = _mm512_fmadd_ps(_mm512_set1_ps(-136.f), s, z);
    PDSERVE_UNROLL
    for (int r = 0; r < R; ++r) {
      __m512 dot = _mm512_add_ps(lo[0][r], hi[0][r]);
      PDSERVE_UNROLL
      for (int a = 1; a < A; ++a) dot = _mm512_add_ps(dot, _mm512_add_ps(lo[a][r], hi[a][r]));
      acc[r] = _mm512_fmadd_ps(s, dot, acc[r]);
      acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xsum[r * groups + g]), acc[r]);
    }
  }
  PDSERVE_UNROLL
  for (int r = 0; r < R; ++r) store16(y + r * N, bias, N, b * 16, acc[r]);
#else
  for (int c = 0; c < 16 && b * 16 + c < N; ++c)
    for (int r = 0; r < R; ++r) {
      float acc = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* p = packed + (b * groups + g) * 256;
        float dot = 0.f;
        for (int t = 0; t < 8; ++t)
          for (int e = 0; e < 2; ++e) {
            const uint8_t byte = p[32 * t + 2 * c + e];
            const bf16* xk = x + r * K + g * kGroup + 4 * t + e;
            dot += static_cast<float>(xk[0]) * (byte & 15) + static_cast<float>(xk[2]) * (byte >> 4);
          }
        const bf16* s16 = sz + (b * groups + g) * 32;
        const float s = s16[c], z = s16[16 + c];
        acc += s * dot + (z - 8 * s) * xsum[r * groups + g];
      }
      y[r * N + b * 16 + c] = static_cast<bf16>(acc + bias_at(bias, b * 16 + c));
    }
#endif
}

// ---- ops ------------------------------------------------------------------------------------

template <template <int> class Kernel, typename... Args>
void with_rows(int64_t rows, Args... args) {
  switch (rows) {
    case 1: Kernel<1>::run(args...); break;
    case 2: Kernel<2>::run(args...); break;
    case 3: Kernel<3>::run(args...); break;
    case 4: Kernel<4>::run(args...); break;
    case 5: Kernel<5>::run(args...); break;
    case 6: Kernel<6>::run(args...); break;
    case 7: Kernel<7>::run(args...); break;
    default: Kernel<8>::run(args...); break;
  }
}

template <int R> struct Int8Block {
  template <typename... A> static void run(A... a) { int8_block<R>(a...); }
};
template <int R> struct Int4Block {
  template <typename... A> static void run(A... a) { int4_block<R>(a...); }
};

void check_x(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == at::kBFloat16,
              "x: a [rows, in] bf16 CPU tensor");
}

const bf16* bias_ptr(const std::optional<at::Tensor>& bias, int64_t n) {
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->numel() == n && bias->is_contiguous(),
              "bias: [out] contiguous bf16");
  return bias->data_ptr<bf16>();
}

at::Tensor int8_gemv(const at::Tensor& x_in, const at::Tensor& q, const at::Tensor& scale,
                     const std::optional<at::Tensor>& bias, int64_t n) {
  check_x(x_in);
  const int64_t rows = x_in.size(0), K = x_in.size(1) + x_in.size(1) % 2, blocks = (n + 15) / 16;
  TORCH_CHECK(q.scalar_type() == at::kChar && q.is_contiguous() && q.sizes() == at::IntArrayRef({blocks, K / 2, 32}),
              "q: [ceil(out/16), ceil(in/2), 32] int8");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == blocks * 16 && scale.is_contiguous(),
              "scale: [ceil(out/16) * 16] fp32");
  const bf16* b = bias_ptr(bias, n);
  // an odd input size meets the weight's zero column with a zero input
  at::Tensor x = K == x_in.size(1) ? x_in.contiguous() : at::constant_pad_nd(x_in, {0, 1});
  at::Tensor y = at::empty({rows, n}, x_in.options());
  const bf16* xp = x.data_ptr<bf16>();
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  bf16* yp = y.data_ptr<bf16>();
  // chunks of at least 4 blocks (64 channels x K bytes): a thread's share outweighs its start-up.
  // Rows past kMaxRows take another pass over the weights (measured faster than re-reading each
  // block from L1 for them)
  at::parallel_for(0, blocks, 4, [&](int64_t b0, int64_t b1) {
    for (int64_t r0 = 0; r0 < rows; r0 += kMaxRows)
      for (int64_t blk = b0; blk < b1; ++blk)
        with_rows<Int8Block>(std::min(kMaxRows, rows - r0), xp + r0 * K, K, qp, sp, b, yp + r0 * n, n, blk);
  });
  return y;
}

at::Tensor int4_gemv(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& sz,
                     const std::optional<at::Tensor>& bias, int64_t n) {
  check_x(x_in);
  const int64_t rows = x_in.size(0), K = x_in.size(1), groups = K / kGroup, blocks = (n + 15) / 16;
  TORCH_CHECK(K % kGroup == 0, "int4: the input size must be a multiple of 32");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() &&
              packed.sizes() == at::IntArrayRef({blocks, groups, 256}), "packed: [ceil(out/16), in/32, 256] uint8");
  TORCH_CHECK(sz.scalar_type() == at::kBFloat16 && sz.is_contiguous() &&
              sz.sizes() == at::IntArrayRef({blocks, groups, 2, 16}), "sz: [ceil(out/16), in/32, 2, 16] bf16");
  const bf16* b = bias_ptr(bias, n);
  at::Tensor x = x_in.contiguous();
  at::Tensor y = at::empty({rows, n}, x_in.options());
  const bf16* xp = x.data_ptr<bf16>();
  std::vector<float> xsum(rows * groups, 0.f);     // each row's sum over each group of inputs
  for (int64_t i = 0; i < rows * K; ++i) xsum[i / kGroup] += static_cast<float>(xp[i]);
  const float* xs = xsum.data();
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  const bf16* szp = sz.data_ptr<bf16>();
  bf16* yp = y.data_ptr<bf16>();
  at::parallel_for(0, blocks, 4, [&](int64_t b0, int64_t b1) {     // as int8_gemv
    for (int64_t r0 = 0; r0 < rows; r0 += kMaxRows)
      for (int64_t blk = b0; blk < b1; ++blk)
        with_rows<Int4Block>(std::min(kMaxRows, rows - r0), xp + r0 * K, xs + r0 * groups, K, pp, szp, b,
                             yp + r0 * n, n, blk);
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("int8_gemv(Tensor x, Tensor q, Tensor scale, Tensor? bias, int n) -> Tensor");
  m.def("int4_gemv(Tensor x, Tensor packed, Tensor sz, Tensor? bias, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) {
  m.impl("int8_gemv", &int8_gemv);
  m.impl("int4_gemv", &int4_gemv);
}
