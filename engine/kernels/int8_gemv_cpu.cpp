// Weight-only int8 GEMV (torch.ops.pdserve.int8_gemv): symmetric int8 per output channel, the
// engine.linear `_int8` quantization. See gemv_cpu.h for what the GEMV kernels share.
//
//   int8_gemv(x [R, K] bf16, q [N/16, ceil(K/2), 32] int8, scale [N] fp32, bias [n] bf16?, n)
//       -> [R, n] bf16      y[r, n] = scale[n] * sum_k x[r, k] * q[n, k] + bias[n]
//     Byte 2c + e of q[b, j] is channel 16b + c's q at input 2j + e (odd K: a zero column added).
// AVX512: q goes through fp32 to bf16 (exact: |q| <= 127 fits bf16's 8 significant bits).
// 9-16 rows (and the first 16 of more) take one pass of one stream that fetches ahead
// (gemv_cpu.h `kWideFirst`).
#include "gemv_cpu.h"

namespace {

using namespace pdserve_gemv;

#ifdef PDSERVE_AVX512
template <int R, int NB>
void int8_avx(const bf16* x, int64_t K, const int8_t* q, const float* scale, const bf16* bias, bf16* y,
              int64_t N, const int64_t* blocks) {
  pair_dots<R, NB>(x, K,
      [&](int j, int64_t k) {                              // inputs k, k + 1 of block j's 16 channels
        const __m128i* w = reinterpret_cast<const __m128i*>(q + blocks[j] * K * 16 + k * 16);
        if constexpr (R > kMaxRows) _mm_prefetch(reinterpret_cast<const char*>(w) + kAhead, _MM_HINT_T0);
        const __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(w)));       // channels 0-7
        const __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(w + 1)));   // channels 8-15
        return _mm512_cvtne2ps_pbh(w1, w0);                // exact: |q| <= 127 fits bf16's 8 bits
      },
      [&](int j, int r, __m512 sum) {
        store16(y + r * N, bias, N, blocks[j] * 16, _mm512_mul_ps(sum, _mm512_loadu_ps(scale + blocks[j] * 16)));
      });
}
#endif

template <int R>
void int8_block(const bf16* x, int64_t K, const int8_t* q, const float* scale, const bf16* bias, bf16* y,
                int64_t N, int64_t b) {
  const int8_t* p = q + b * K * 16;
  for (int64_t c = 0; c < 16 && b * 16 + c < N; ++c)
    for (int r = 0; r < R; ++r)
      y[r * N + b * 16 + c] = static_cast<bf16>(pair_dot_scalar(x + r * K, K, p, c) * scale[b * 16 + c] +
                                                bias_at(bias, b * 16 + c));
}
template <int R>
void int8_range(const bf16* x, int64_t K, const int8_t* q, const float* scale, const bf16* bias, bf16* y,
                int64_t N, int64_t b0, int64_t b1) {
  over_blocks<R, 8>(b0, b1,
      [&](auto nb, const int64_t* blocks) {
#ifdef PDSERVE_AVX512
        int8_avx<R, decltype(nb)::value>(x, K, q, scale, bias, y, N, blocks);
#endif
      },
      [&](int64_t b) { int8_block<R>(x, K, q, scale, bias, y, N, b); });
}

template <int R> struct Int8Range {
  template <typename... A> static void run(A... a) { int8_range<R>(a...); }
};

at::Tensor int8_gemv(const at::Tensor& x_in, const at::Tensor& q, const at::Tensor& scale,
                     const std::optional<at::Tensor>& bias, int64_t n) {
  check_x(x_in);
  const int64_t rows = x_in.size(0), K = x_in.size(1) + x_in.size(1) % 2, blocks = (n + 15) / 16;
  TORCH_CHECK(q.scalar_type() == at::kChar && q.is_contiguous() &&
              q.sizes() == at::IntArrayRef({blocks, K / 2, 32}), "q: [ceil(out/16), ceil(in/2), 32] int8");
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
  // Rows past kMaxRows take more passes over the weights, chunk by chunk (gemv_cpu.h; measured
  // faster than re-reading each block from L1 for them)
  at::parallel_for(0, blocks, 4, [&](int64_t b0, int64_t b1) {
    passes_in_chunks<kWideFirst>(rows, b0, b1, K * 16, 2, [&](int64_t r0, int64_t r, int64_t c0, int64_t c1) {
      with_rows<Int8Range, kWideFirst>(r, xp + r0 * K, K, qp, sp, b, yp + r0 * n, n, c0, c1);
    });
  });
  return y;
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("int8_gemv(Tensor x, Tensor q, Tensor scale, Tensor? bias, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) {
  m.impl("int8_gemv", &int8_gemv);
}
