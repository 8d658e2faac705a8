// Weight-only int4 GEMV (torch.ops.pdserve.int4_gemv): asymmetric int4 in groups of 32 inputs,
// a bf16 scale s and zero z each, the engine.linear `_int4` quantization (gpt-fast/torchao's
// scheme). See gemv_cpu.h for what the GEMV kernels share.
//
//   int4_gemv(x [R, K] bf16, packed [N/16, K/32, 256] uint8, sz [N/16, K/32, 2, 16] bf16,
//             bias [n] bf16?, n) -> [R, n] bf16                                       (K % 32 == 0)
//       y[r, n] = sum_g sum_{k in g} x[r, k] * ((q[n, k] - 8) * s[n, g] + z[n, g]) + bias[n]
//     A block of 16 output channels and one group of 32 inputs is 8 steps of 32 bytes; in step t,
//     byte 2c + e holds channel c's q at input 4t + e (low nibble) and 4t + 2 + e (high nibble).
//     sz[b, g, 0, c] and sz[b, g, 1, c] are channel 16b + c's scale s and zero z of group g.
// AVX512: a nibble q becomes the bf16 number 128 + q by OR-ing in 128's exponent, so per group
//   y += s * dot(x, 128 + q) + (z - 136 s) * sum(x).
#include "gemv_cpu.h"

namespace {

using namespace pdserve_gemv;
constexpr int64_t kGroup = 32;

// x [R][K] stays bf16; xsum [R][groups] in fp32
#ifdef PDSERVE_AVX512
template <int R, int NB>
void int4_avx(const bf16* x, const float* xsum, int64_t K, const uint8_t* packed, const bf16* sz,
              const bf16* bias, bf16* y, int64_t N, const int64_t* blocks) {
  const int64_t groups = K / kGroup;
  constexpr int A = R * NB == 1 ? 4 : (R * NB == 2 ? 2 : 1);   // independent dot-product chains per row and half
  const __m512i nibble = _mm512_set1_epi16(0x000F), magic = _mm512_set1_epi16(0x4300);   // bf16 128.0
  __m512 acc[NB][R];
  PDSERVE_UNROLL
  for (int j = 0; j < NB; ++j) for (int r = 0; r < R; ++r) acc[j][r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512 lo[NB][A][R], hi[NB][A][R];
    PDSERVE_UNROLL
    for (int j = 0; j < NB; ++j)
      for (int a = 0; a < A; ++a) for (int r = 0; r < R; ++r) lo[j][a][r] = hi[j][a][r] = _mm512_setzero_ps();
    PDSERVE_UNROLL
    for (int t = 0; t < 8; ++t) {
      const int64_t k = g * kGroup + 4 * t;
      PDSERVE_UNROLL
      for (int j = 0; j < NB; ++j) {
        const uint8_t* p = packed + (blocks[j] * groups + g) * 256 + 32 * t;
        const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
        const __m512bh wl = (__m512bh)_mm512_ternarylogic_epi32(w, nibble, magic, 0xEA);   // (w & 15) | magic
        const __m512bh wh = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(w, 4), magic);
        PDSERVE_UNROLL
        for (int r = 0; r < R; ++r) {
          int32_t pair_lo, pair_hi;                      // inputs (k, k + 1) and (k + 2, k + 3)
          std::memcpy(&pair_lo, x + r * K + k, 4);
          std::memcpy(&pair_hi, x + r * K + k + 2, 4);
          lo[j][t % A][r] = _mm512_dpbf16_ps(lo[j][t % A][r], (__m512bh)_mm512_set1_epi32(pair_lo), wl);
          hi[j][t % A][r] = _mm512_dpbf16_ps(hi[j][t % A][r], (__m512bh)_mm512_set1_epi32(pair_hi), wh);
        }
      }
    }
    PDSERVE_UNROLL
    for (int j = 0; j < NB; ++j) {
      const bf16* s16 = sz + (blocks[j] * groups + g) * 32;
      const __m512 s = load16(s16), m = _mm512_fmadd_ps(_mm512_set1_ps(-136.f), s, load16(s16 + 16));
      PDSERVE_UNROLL
      for (int r = 0; r < R; ++r) {
        __m512 dot = _mm512_add_ps(lo[j][0][r], hi[j][0][r]);
        PDSERVE_UNROLL
        for (int a = 1; a < A; ++a) dot = _mm512_add_ps(dot, _mm512_add_ps(lo[j][a][r], hi[j][a][r]));
        acc[j][r] = _mm512_fmadd_ps(s, dot, acc[j][r]);
        acc[j][r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xsum[r * groups + g]), acc[j][r]);
      }
    }
  }
  PDSERVE_UNROLL
  for (int j = 0; j < NB; ++j)
    for (int r = 0; r < R; ++r) store16(y + r * N, bias, N, blocks[j] * 16, acc[j][r]);
}
#endif

template <int R>
void int4_block(const bf16* x, const float* xsum, int64_t K, const uint8_t* packed, const bf16* sz,
                const bf16* bias, bf16* y, int64_t N, int64_t b) {
  const int64_t groups = K / kGroup;
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
}

template <int R>
void int4_range(const bf16* x, const float* xsum, int64_t K, const uint8_t* packed, const bf16* sz,
                const bf16* bias, bf16* y, int64_t N, int64_t b0, int64_t b1) {
  over_blocks<R, 0>(b0, b1,
      [&](auto nb, const int64_t* blocks) {
#ifdef PDSERVE_AVX512
        int4_avx<R, decltype(nb)::value>(x, xsum, K, packed, sz, bias, y, N, blocks);
#endif
      },
      [&](int64_t b) { int4_block<R>(x, xsum, K, packed, sz, bias, y, N, b); });
}

template <int R> struct Int4Range {
  template <typename... A> static void run(A... a) { int4_range<R>(a...); }
};

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
    passes_in_chunks(rows, b0, b1, K * 8 + groups * 64, 2, [&](int64_t r0, int64_t r, int64_t c0, int64_t c1) {
      with_rows<Int4Range>(r, xp + r0 * K, xs + r0 * groups, K, pp, szp, b,
                           yp + r0 * n, n, c0, c1);
    });
  });
  return y;
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("int4_gemv(Tensor x, Tensor packed, Tensor sz, Tensor? bias, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) {
  m.impl("int4_gemv", &int4_gemv);
}
