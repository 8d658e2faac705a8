// Dense GEMVs: y = x @ w.T (+ bias) for a few rows x of an unquantized linear; engine.linear
// calls them for decode steps of at most `DENSE_SMALL_ROWS[dtype]` rows.
//
//   fp32_gemv(x [R, K] fp32, w [N, K] fp32, bias [N] fp32?) -> [R, N] fp32
//       the linear's own row-major weight, read in place (no second copy)
//   bf16_gemv(x [R, K] bf16, w [N/16, ceil(K/2), 32] bf16, bias [n] bf16?, n) -> [R, n] bf16
//       the weight in blocks of 16 output channels and pairs of inputs (int8_gemv's layout, in
//       bf16: element 2c + e of w[b, j] is channel 16b + c's weight at input 2j + e)
//   gemv_vectorized() -> bool: built with AVX512 (F, BW, VL, BF16) or AVX2 + FMA; engine.linear
//       uses these kernels only then (the scalar fallback is slower than oneDNN / MKL). On AVX2
//       (no bf16 dot product) bf16 widens 16 weights at a time by shifts and multiplies in fp32
//       (`bf16_block8`; from 10 rows widened once a block into a buffer for a GEMM micro-kernel,
//       `packed_rows`), fp32 runs 8-lane dot products (`fp32_channels8`). Measured on an AVX2 AMD
//       EPYC (Zen 3, 1 thread, benchmarks/linear_bench.py, the step's linears at 1 / 8 / 32 rows):
//       bf16 30.8 / 53.6 / 166.8 ms where torch's bf16 F.linear took 45.5 / 292.1 / 1083.1 (no
//       native bf16: emulated), fp32 52.9 / 69.8 / 235.2 against MKL's 71.8 / 163.6 / 266.8.
//
// Why: at batch 1 a decode step reads every weight once, so its linears are bound by memory
// bandwidth; oneDNN's bf16 and MKL's fp32 small-row paths stream weights at 0.75x and 0.3-0.45x
// of these kernels' speed on this project's CPU (benchmarks/linear_bench.py), and each call
// carries microseconds of set-up that 30 layers x 4 linears multiply. Both kernels stream each
// weight once per call for up to kMaxRows rows; more rows (up to a decode batch of 64) take
// passes of kMaxRows over L2-sized chunks (gemv_cpu.h), where they still beat oneDNN's packed bf16
// GEMM 1.1-1.5x and MKL's fp32 one ~2x.
//
// fp32 (the exact mode): each output channel is a dot product over its weight row (llama.cpp's
// scheme), 4 channels side by side (4 memory streams; 2 and 8 measured slower at 1-4 rows), each
// against every row of x from L1, with the rows two groups ahead prefetched (1.2-1.5x at 2-8
// rows). Products and sums in fp32: 16 lanes of partial sums per (channel, row) over K in order,
// then one fixed tree reduction, then the bias. A row's result therefore does not depend on the
// other rows or on the thread split (batch-invariant).
// bf16: gemv_cpu.h's pair kernel, as int8_gemv without the conversion: the blocked layout reads
// one contiguous stream per thread half, 1.25x faster than row-major dot products measured at
// 1-4 rows; 9-16 rows (and the first 16 of more) take one pass of one stream that fetches ahead
// (gemv_cpu.h `kWideFirst`). Products and sums in fp32, rounded to bf16 once, bias included.
// Where the CPU has AMX-BF16 (Intel Xeon from Sapphire Rapids; amx_bf16_cpu.cpp), 2 rows and more
// (inputs a multiple of 32) run on AMX tiles instead, on the same blocked weight: measured on a
// 2-core AMX Xeon (benchmarks/linear_bench.py, the step's linears, 2 threads) 11.0 / 15.3 / 19.1 /
// 101 ms at 8 / 32 / 64 / 512 rows against this kernel's 26.3 / 43.4 / 85.0 / 656 (oneDNN's
// packed bf16: 13.7 / 16.6 / 18.9 / 158); at 2 rows 10.1 against 11.4-11.8, at 1 row 10.5 against
// 10.1-10.5 (so 1 row stays here).
#include "amx_bf16.h"
#include "gemv_cpu.h"

namespace {

using namespace pdserve_gemv;

// From this many rows bf16_gemv runs on AMX tiles where the CPU has them (amx_bf16_cpu.cpp)
constexpr int64_t kAmxFrom = 2;

// ---- fp32, row-major ----------------------------------------------------------------------------

#ifdef PDSERVE_AVX512
// Channels [n, n + C) for R rows: C * R accumulators, the R rows of x reloaded from L1 per step;
// `prefetch`: channels [n + 2C, n + 3C) exist and are fetched into cache on the way
template <int R, int C>
void fp32_channels(const float* x, int64_t K, const float* w, const float* bias, float* y, int64_t N,
                   int64_t n, bool prefetch) {
  __m512 acc[C][R];
  PDSERVE_UNROLL
  for (int c = 0; c < C; ++c) for (int r = 0; r < R; ++r) acc[c][r] = _mm512_setzero_ps();
  const float* wn = w + n * K;
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 m = lanes16(K - k);
    __m512 xv[R];
    PDSERVE_UNROLL
    for (int r = 0; r < R; ++r) xv[r] = _mm512_maskz_loadu_ps(m, x + r * K + k);
    PDSERVE_UNROLL
    for (int c = 0; c < C; ++c) {
      if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(wn + (2 * C + c) * K + k), _MM_HINT_T0);
      const __m512 wv = _mm512_maskz_loadu_ps(m, wn + c * K + k);
      PDSERVE_UNROLL
      for (int r = 0; r < R; ++r) acc[c][r] = _mm512_fmadd_ps(xv[r], wv, acc[c][r]);
    }
  }
  PDSERVE_UNROLL
  for (int c = 0; c < C; ++c) {
    const float b = bias ? bias[n + c] : 0.f;
    PDSERVE_UNROLL
    for (int r = 0; r < R; ++r) y[r * N + n + c] = _mm512_reduce_add_ps(acc[c][r]) + b;
  }
}
#endif

#ifdef PDSERVE_AVX2
// The same on 8 lanes (AVX2 + FMA): partial sums of 8 lanes per (channel, row) over K in order,
// then sum8's fixed tree; x is read from L1 by each FMA (16 registers hold only the accumulators)
template <int R, int C>
void fp32_channels8(const float* x, int64_t K, const float* w, const float* bias, float* y, int64_t N,
                    int64_t n, bool prefetch) {
  __m256 acc[C][R];
  PDSERVE_UNROLL
  for (int c = 0; c < C; ++c) for (int r = 0; r < R; ++r) acc[c][r] = _mm256_setzero_ps();
  const float* wn = w + n * K;
  int64_t k = 0;
  auto step = [&](int64_t k, auto load) {
    PDSERVE_UNROLL
    for (int c = 0; c < C; ++c) {
      if (prefetch && k % 16 == 0) _mm_prefetch(reinterpret_cast<const char*>(wn + (2 * C + c) * K + k), _MM_HINT_T0);
      const __m256 wv = load(wn + c * K + k);
      PDSERVE_UNROLL
      for (int r = 0; r < R; ++r) acc[c][r] = _mm256_fmadd_ps(load(x + r * K + k), wv, acc[c][r]);
    }
  };
  for (; k + 8 <= K; k += 8) step(k, [](const float* p) { return _mm256_loadu_ps(p); });
  if (k < K) {
    const __m256i m = lanes8(K - k);
    step(k, [m](const float* p) { return _mm256_maskload_ps(p, m); });
  }
  PDSERVE_UNROLL
  for (int c = 0; c < C; ++c) {
    const float b = bias ? bias[n + c] : 0.f;
    PDSERVE_UNROLL
    for (int r = 0; r < R; ++r) y[r * N + n + c] = sum8(acc[c][r]) + b;
  }
}
#endif

// 4 channels side by side up to 4 rows, 2 above (the C x R accumulators and R rows of x fit the
// 32 vector registers); on AVX2's 16: 4 channels up to 2 rows, 2 up to 4, 1 above
template <int R> constexpr int kChannels = R <= 4 ? 4 : 2;
template <int R> constexpr int kChannels8 = R <= 2 ? 4 : (R <= 4 ? 2 : 1);

template <int R>
void fp32_range(const float* x, int64_t K, const float* w, const float* bias, float* y, int64_t N,
                int64_t n0, int64_t n1) {
#ifdef PDSERVE_AVX512
  constexpr int C = kChannels<R>;
  int64_t n = n0;
  for (; n + C <= n1; n += C) fp32_channels<R, C>(x, K, w, bias, y, N, n, n + 3 * C <= n1);
  for (; n < n1; ++n) fp32_channels<R, 1>(x, K, w, bias, y, N, n, false);
#elif defined(PDSERVE_AVX2)
  constexpr int C = kChannels8<R>;
  int64_t n = n0;
  for (; n + C <= n1; n += C) fp32_channels8<R, C>(x, K, w, bias, y, N, n, n + 3 * C <= n1);
  for (; n < n1; ++n) fp32_channels8<R, 1>(x, K, w, bias, y, N, n, false);
#else
  for (int64_t n = n0; n < n1; ++n)
    for (int r = 0; r < R; ++r) {
      float acc = 0.f;
      for (int64_t k = 0; k < K; ++k) acc += x[r * K + k] * w[n * K + k];
      y[r * N + n] = acc + (bias ? bias[n] : 0.f);
    }
#endif
}

template <int R> struct Fp32Range {
  template <typename... A> static void run(A... a) { fp32_range<R>(a...); }
};

at::Tensor fp32_gemv(const at::Tensor& x_in, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x_in.device().is_cpu() && x_in.dim() == 2 && x_in.scalar_type() == at::kFloat,
              "x: a [rows, in] fp32 CPU tensor");
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.dim() == 2 && w.size(1) == x_in.size(1) && w.is_contiguous(),
              "w: a contiguous fp32 [out, in] weight");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->numel() == w.size(0) &&
                                    bias->is_contiguous()), "bias: [out] contiguous fp32");
  at::Tensor x = x_in.contiguous();
  const int64_t rows = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor y = at::empty({rows, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  // shares of at least 64 channels (a thread's share outweighs its start-up); rows past kMaxRows
  // take more passes, chunk by chunk (gemv_cpu.h)
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    passes_in_chunks(rows, n0, n1, K * 4, 16, [&](int64_t r0, int64_t r, int64_t c0, int64_t c1) {
      with_rows<Fp32Range>(r, xp + r0 * K, K, wp, bp, yp + r0 * N, N, c0, c1);
    });
  });
  return y;
}

// ---- bf16, blocks of 16 channels ----------------------------------------------------------------

template <int R>
void bf16_range(const bf16* x, int64_t K, const bf16* w, const bf16* bias, bf16* y, int64_t N,
                int64_t b0, int64_t b1) {
  over_blocks<R, 8>(b0, b1,
      [&](auto nb, const int64_t* blocks) {
#ifdef PDSERVE_AVX512
        pair_dots<R, decltype(nb)::value>(x, K,
            [&](int j, int64_t k) {
              const bf16* p = w + blocks[j] * K * 16 + k * 16;
              if constexpr (R > kMaxRows) _mm_prefetch(reinterpret_cast<const char*>(p) + kAhead, _MM_HINT_T0);
              return (__m512bh)_mm512_loadu_si512(p);
            },
            [&](int j, int r, __m512 sum) { store16(y + r * N, bias, N, blocks[j] * 16, sum); });
#endif
      },
      [&](int64_t b) {
        const bf16* p = w + b * K * 16;
        for (int64_t c = 0; c < 16 && b * 16 + c < N; ++c)
          for (int r = 0; r < R; ++r)
            y[r * N + b * 16 + c] = static_cast<bf16>(pair_dot_scalar(x + r * K, K, p, c) + bias_at(bias, b * 16 + c));
      });
}

template <int R> struct Bf16Range {
  template <typename... A> static void run(A... a) { bf16_range<R>(a...); }
};

#ifdef PDSERVE_AVX2
// bf16_block8 reads its blocks as one stream, a cache line an iteration; fetching the line
// kAhead8 bytes on in the same iteration streamed a decode step's weights at one row 1.1-1.25x as
// fast as the hardware prefetcher alone on the AVX2 EPYC (a standalone loop over SmolLM2's
// weights, 1 thread: 17-19 -> 19-23 GB/s; a plain read of them 20-22); 0.5 and 2-6 KiB ahead, or
// a fetch every other line, measured slower.
constexpr int64_t kAhead8 = 1024;

// The same sums on AVX2 + FMA (no bf16 dot product there): x in fp32 (converted once a call),
// each 16 weights of a block (8 channels' pairs) widened by shifts into the two inputs' 8 channels,
// products and sums in fp32 (for up to 2 rows, even and odd inputs in separate accumulators)
template <int S>
void bf16_block8(const float* x, int64_t K, const bf16* block, const bf16* bias, bf16* y, int64_t N, int64_t n) {
  static_assert(1 <= S && S <= 4, "in_fours' groups");
  constexpr int E = S <= 2 ? 2 : 1;
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m256 acc[2][E][S];
  PDSERVE_UNROLL
  for (int h = 0; h < 2; ++h) for (int e = 0; e < E; ++e) for (int r = 0; r < S; ++r) acc[h][e][r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 2) {
    _mm_prefetch(reinterpret_cast<const char*>(block + k * 16) + kAhead8, _MM_HINT_T0);
    // both halves widened first, then row by row: a row's two broadcasts serve both halves.
    // (Halves outer, GCC kept all 2S broadcasts live across them, and at S = 4 that spilled two
    // accumulators to the stack inside the loop: a group of 4 rows cost about 3x one of 3.)
    __m256 even[2], odd[2];
    PDSERVE_UNROLL
    for (int h = 0; h < 2; ++h) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + k * 16 + 16 * h));
      even[h] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));     // input k of channels 8h..
      odd[h] = _mm256_castsi256_ps(_mm256_and_si256(v, high));     // input k + 1
    }
    PDSERVE_UNROLL
    for (int r = 0; r < S; ++r) {
      const __m256 xe = _mm256_broadcast_ss(x + r * K + k), xo = _mm256_broadcast_ss(x + r * K + k + 1);
      PDSERVE_UNROLL
      for (int h = 0; h < 2; ++h) {
        acc[h][0][r] = _mm256_fmadd_ps(even[h], xe, acc[h][0][r]);
        acc[h][E - 1][r] = _mm256_fmadd_ps(odd[h], xo, acc[h][E - 1][r]);
      }
    }
  }
  PDSERVE_UNROLL      // every index a constant: acc stays in registers (a loop here kept it on the stack,
  for (int r = 0; r < S; ++r) {     // stored back after every FMA)
    PDSERVE_UNROLL
    for (int h = 0; h < 2; ++h)
      store8(y + r * N, bias, N, n + 8 * h, E == 2 ? _mm256_add_ps(acc[h][0][r], acc[h][E - 1][r]) : acc[h][0][r]);
  }
}

template <int R> struct Bf16Range8 {
  static void run(const float* x, int64_t K, const bf16* w, const bf16* bias, bf16* y, int64_t N, int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      in_fours<R>([&](auto s, int r0) {
        bf16_block8<decltype(s)::value>(x + r0 * K, K, w + b * K * 16, bias, y + r0 * N, N, b * 16);
      });
  }
};

// More rows (kPackedFrom and up: a large decode batch, a prompt chunk) on AVX2: a block's weights
// widened to fp32 once into `packed` [K][16] (L1/L2), then the rows in groups of 4-6 against it:
// per input two weight vectors from cache, S broadcasts and 2S FMAs (a GEMM micro-kernel), where
// bf16_block8 widens the weights again for every 4 rows and its shifts compete with the FMAs.
// Each (row, 8 channels) sums its products in input order in one accumulator, so a row's result
// does not depend on its group (under 4 rows, a pass's tail, leave FMA slots idle). Measured on
// the AVX2 EPYC against passes of bf16_block8 (the step's linears, one process alternating both
// per row count, medians of the paired ratios): 1 thread 0.80-0.87x at 12 rows, 0.69-0.82x at 16,
// 0.65-0.78x at 48, 0.72-0.84x at 128; 2 threads 0.76-0.82x from 12 to 128 rows; at 5-9 rows
// 1.0-1.2x (the widening costs more than it saves), hence kPackedFrom.
constexpr int64_t kPackedFrom = 10, kPackedPass = 48;

inline void widen_block(const bf16* block, int64_t K, float* packed) {
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t k = 0; k < K; k += 2)
    for (int h = 0; h < 2; ++h) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + k * 16 + 16 * h));
      _mm256_storeu_ps(packed + k * 16 + 8 * h, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
      _mm256_storeu_ps(packed + (k + 1) * 16 + 8 * h, _mm256_castsi256_ps(_mm256_and_si256(v, high)));
    }
}

template <int S>
void packed_rows(const float* x, int64_t K, const float* packed, const bf16* bias, bf16* y, int64_t N, int64_t n,
                 const char* ahead) {
  __m256 acc[S][2];
  PDSERVE_UNROLL
  for (int r = 0; r < S; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    if (ahead != nullptr && k % 2 == 0) _mm_prefetch(ahead + k * 32, _MM_HINT_T1);
    __m256 w0 = _mm256_loadu_ps(packed + k * 16), w1 = _mm256_loadu_ps(packed + k * 16 + 8);
    // in registers: where GCC inlines this kernel (up to 4 rows) it otherwise folds the two loads
    // into every FMA, 2S + S loads a step where the load ports take 2 a cycle (4 rows 1.5x slower)
    asm("" : "+x"(w0), "+x"(w1));
    PDSERVE_UNROLL
    for (int r = 0; r < S; ++r) {
      const __m256 xb = _mm256_broadcast_ss(x + r * K + k);
      acc[r][0] = _mm256_fmadd_ps(w0, xb, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(w1, xb, acc[r][1]);
    }
  }
  PDSERVE_UNROLL      // every index a constant, as in bf16_block8
  for (int r = 0; r < S; ++r) {
    PDSERVE_UNROLL
    for (int h = 0; h < 2; ++h) store8(y + r * N, bias, N, n + 8 * h, acc[r][h]);
  }
}

template <int S> struct PackedRows {
  template <typename... A> static void run(A... a) { packed_rows<S>(a...); }
};

// Blocks [b0, b1) for `rows` rows: passes of up to kPackedPass rows (their fp32 x stays in L2), each
// block widened once a pass, its rows in groups of 4-6 (a pass under 4 rows: one group)
inline void packed_range(const float* x, int64_t rows, int64_t K, const bf16* w, const bf16* bias, bf16* y,
                         int64_t N, int64_t b0, int64_t b1) {
  thread_local std::vector<float> packed;
  packed.resize(K * 16);
  for (int64_t r0 = 0; r0 < rows; r0 += kPackedPass) {
    const int64_t r = std::min(kPackedPass, rows - r0);
    const int64_t groups = (r + 5) / 6;                      // r >= 1
    for (int64_t b = b0; b < b1; ++b) {
      widen_block(w + b * K * 16, K, packed.data());
      // the first group fetches the next block into L2 as it goes: the memory stream then goes
      // on while the groups compute (without, a pass of 8-16 rows alternated reading and computing)
      const char* next = b + 1 < b1 ? reinterpret_cast<const char*>(w + (b + 1) * K * 16) : nullptr;
      for (int64_t g = 0, g0 = r0; g < groups; ++g) {          // sizes as even as the groups allow
        const int64_t s = r / groups + (g < r % groups ? 1 : 0);
        with_rows<PackedRows, 6>(s, x + g0 * K, K, static_cast<const float*>(packed.data()), bias, y + g0 * N, N,
                                 b * 16, g == 0 ? next : nullptr);
        g0 += s;
      }
    }
  }
}
#endif

at::Tensor bf16_gemv(const at::Tensor& x_in, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                     int64_t n) {
  check_x(x_in);
  const int64_t rows = x_in.size(0), K = x_in.size(1) + x_in.size(1) % 2, blocks = (n + 15) / 16;
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.is_contiguous() &&
              w.sizes() == at::IntArrayRef({blocks, K / 2, 32}), "w: [ceil(out/16), ceil(in/2), 32] bf16");
  const bf16* b = bias_ptr(bias, n);
  // an odd input size meets the weight's zero column with a zero input
  at::Tensor x = K == x_in.size(1) ? x_in.contiguous() : at::constant_pad_nd(x_in, {0, 1});
  at::Tensor y = at::empty({rows, n}, x_in.options());
  const bf16* xp = x.data_ptr<bf16>();
  const bf16* wp = w.data_ptr<bf16>();
  bf16* yp = y.data_ptr<bf16>();
#ifdef PDSERVE_AVX2
  if (rows == 0) return y;
  // x in fp32, in the calling thread's buffer (the pool's threads only read it; it grows to the
  // largest call's, a prompt chunk's rows x inputs, and is kept: one allocation, not one a call)
  thread_local std::vector<float> xf;
  xf.resize(rows * K);
  for (int64_t i = 0; i < rows * K; ++i) xf[i] = static_cast<float>(xp[i]);
  const float* xfp = xf.data();
  if (rows >= kPackedFrom)
    at::parallel_for(0, blocks, 4, [&](int64_t b0, int64_t b1) { packed_range(xfp, rows, K, wp, b, yp, n, b0, b1); });
  else
    at::parallel_for(0, blocks, 4, [&](int64_t b0, int64_t b1) {
      passes_in_chunks(rows, b0, b1, K * 32, 2, [&](int64_t r0, int64_t r, int64_t c0, int64_t c1) {
        with_rows<Bf16Range8>(r, xfp + r0 * K, K, wp, b, yp + r0 * n, n, c0, c1);
      });
    });
#else
  if (rows >= kAmxFrom && K % 32 == 0 && pdserve_amx::available()) {   // K % 32 == 0: x not padded
    pdserve_amx::bf16_gemm(xp, rows, K, wp, b, yp, n);
    return y;
  }
  at::parallel_for(0, blocks, 4, [&](int64_t b0, int64_t b1) {     // as int8_gemv
    passes_in_chunks<kWideFirst>(rows, b0, b1, K * 32, 2, [&](int64_t r0, int64_t r, int64_t c0, int64_t c1) {
      with_rows<Bf16Range, kWideFirst>(r, xp + r0 * K, K, wp, b, yp + r0 * n, n, c0, c1);
    });
  });
#endif
  return y;
}

bool gemv_vectorized() {
#if defined(PDSERVE_AVX512) || defined(PDSERVE_AVX2)
  return true;
#else
  return false;
#endif
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("fp32_gemv(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("bf16_gemv(Tensor x, Tensor w, Tensor? bias, int n) -> Tensor");
  m.def("gemv_vectorized() -> bool", &gemv_vectorized);
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) {
  m.impl("fp32_gemv", &fp32_gemv);
  m.impl("bf16_gemv", &bf16_gemv);
}
