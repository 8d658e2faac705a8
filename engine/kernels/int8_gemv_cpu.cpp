// int8 GEMV with int8 activations (torch.ops.pdserve.int8_gemv): weights symmetric int8 per output
// channel (the engine.linear `_int8` quantization), the rows of x quantized on the fly to int8 in
// groups of 32 inputs, each with its own scale (what llama.cpp's Q8_0 dot products do), and the
// products summed in int32 by AVX512-VNNI's `vpdpbusd` (64 multiply-adds an instruction, twice
// `vdpbf16ps`'s 32, and no int8 -> bf16 widening of the weights on the way).
//
//   int8_gemv(x [R, K] bf16, q [N/16, Kp/4, 64] uint8, scale [N] fp32, bias [n] bf16?, n) -> [R, n] bf16
//     Kp: K rounded up to 32. Byte 4c + e of q[b, j] is channel 16b + c's weight at input 4j + e,
//     plus 128 (so 1..255; padding, past n or K, is 128: a zero weight).
//     Per row r and group g of 32 inputs (zeros past K): s = max |x| / 127, xq = round(x * 127 /
//     max) (to nearest even; a group of zeros: s = 0, xq = 0). Then
//     y[r, n] = scale[n] * sum_g s[r, g] * sum_{k in g} q[n, k] xq[r, k] + bias[n]
//     each group's sum exact in int32 (`vpdpbusd` multiplies the unsigned q + 128 by the signed xq:
//     the sum starts at -128 * sum_{k in g} xq[r, k] instead of 0), the rest in fp32, rounded to
//     bf16 once.
//   vnni() -> bool: this and int4_gemv built with AVX512-VNNI (kernel_common.h PDSERVE_VNNI).
//   int_gemv_vectorized() -> bool: built with VNNI or AVX2 (`int8_avx2`: `vpmaddubsw` +
//     `vpmaddwd`, llama.cpp's AVX2 scheme); engine.linear then runs these kernels at every row
//     count. Elsewhere a scalar loop computes the same sums, slower than oneDNN's bf16 GEMM above
//     a few rows, so engine.linear keeps a bf16 copy for steps of more rows (`quantized_small_rows`).
//     On an AVX2 AMD EPYC (Zen 3, 1 thread, benchmarks/linear_bench.py, the step's linears at 1 /
//     8 / 32 rows): the scalar loop took 344.6 / 3975.6 / 13290.0 ms, aten's weight-only int8 44.3 /
//     99.2 / 333.3, int8_avx2 19.5-21.1 / 49.1-70.5 / 159.3-235.6 (int4: 120.0 / 955.7 / 3708.1
//     scalar, 11.7 / 42.1 / 118.5 AVX2).
// Why: the weight-only kernel before it (bf16 activations, the weights widened to bf16 for
// `vdpbf16ps`) was compute-bound from a few rows on: at 32 rows it was slower than bf16's own
// kernel. This one, the step's linears (benchmarks/linear_bench.py, 1 thread, builds alternated
// twice): 1 row 4.6-4.7 -> 4.6-5.7 ms (memory-bound either way), 8 / 16 / 32 rows 9.6-9.9 /
// 12.2-12.9 / 22.6-23.2 -> 5.1-5.4 / 8.1-8.2 / 14.7-14.9; 64 rows 27.9 against oneDNN's bf16 GEMM
// 43.9; 128-512 rows 0.8-1.1x oneDNN's time (two runs, 1 and 2 threads). Quality (benchmarks/format_quality.py's text, activations
// rounded in torch before the weight-only kernel, prompt in 16-token chunks): mean log-likelihood
// -3.1511 weight-only; groups of 32 -3.1478, of 64 -3.1598, one scale a row -3.2344 (int4's cost).
//
// Rows: a first pass of up to 16 (gemv_cpu.h `kWideFirst`), later ones of 8, over L2-sized chunks
// (`passes_in_chunks`); one weight stream fetched kAhead bytes ahead. Within a group the int32
// sums of up to 8 rows are live at once (16 rows: the group's 512 weight bytes are read again from
// L1 for rows 8-15); with fewer than 4 rows they are split over independent chains.
//
// On AMX (a CPU with AMX-INT8, amx_bf16.h `int8_available()`), calls of kAmxFrom rows and more
// whose Kp is a multiple of 64 run on AMX-INT8 tiles instead (amx_int8_cpu.cpp): q as `tdpbsud`'s
// B tiles as it is, each row of x split into two int8 limbs on one scale (15 bits a row; the
// groups of 32 above would need the accumulators rescaled every 32 inputs):
//     y[r, n] = scale[n] * s[r] * sum_k v[r, k] (q[n, k] - 128) + bias[n],  x ~ s v, |v| <= 16383
//   int8_gemm_amx(x, q, scale, bias, n): that path at every row count (tests, benchmarks; refused
//     without AMX-INT8 or when Kp % 64 != 0); int8_gemv_amx_from() -> int: kAmxFrom.
// Why: from a few dozen rows the VNNI kernel is bound by its multiply-adds (64 a `vpdpbusd`); a
// tile product does 16 x 16 x 64. Session 25's path before this one widened q to bf16 a chunk at a
// time for the bf16 AMX GEMM (x unrounded, from 32 rows); the widening cost what the VNNI kernel
// did at ~30 rows. On a 2-core AMX Xeon (linear_bench.py, the step's linears, the widened path /
// AMX-INT8, each at every row count, runs of one session): 2 threads 32 rows 11.3-12.2 / 8.7-9.5
// ms, 64 15.5-18.6 / 12.3-13.9; 1 thread 32 21.1-26.6 / 16.5-17.7, 64 28.3-30.0 / 23.3-26.6; from
// 128 rows two alternated runs: 2 threads 128 21.7, 24.2 / 22.3, 23.5, 512 81.1, 88.3 / 81.7, 88.1;
// 1 thread 128 46.4, 43.5 / 41.8, 39.3, 512 171.2, 159.8 / 134.5, 137.2. The VNNI kernel at 16
// rows 7.3 (2 threads) and 13.0 (1) against AMX-INT8's 6.5-7.4 and 10.9: hence kAmxFrom. A row's
// numbers differ between a call below kAmxFrom and one from it (the log-likelihood of
// format_quality.py's text through prompt chunks of 8 tokens -3.1603, of 64 -3.1561; fp32
// -3.1559); within a call each row is independent of the others.
#include "amx_bf16.h"
#include "gemv_cpu.h"

namespace {

using namespace pdserve_gemv;
// From this many rows int8_gemv runs on AMX-INT8 tiles where the CPU has them (amx_int8_cpu.cpp)
constexpr int64_t kAmxFrom = 16;

#ifdef PDSERVE_VNNI
// Block b's 16 channels for R rows of x: sums in fp32 over the groups, the group's int32 sums of up
// to 8 rows at a time (A chains each where rows are few)
template <int R>
void int8_vnni(RoundedView x, int64_t Kp, const uint8_t* q, const float* scale, const bf16* bias, bf16* y, int64_t N,
               int64_t b) {
  constexpr int kSub = R < 8 ? R : 8;
  constexpr int A = R <= 2 ? 4 : (R <= 4 ? 2 : 1);
  constexpr int kQuads = kQGroup / 4;                       // 64-byte weight vectors a group
  const int64_t groups = Kp / kQGroup;
  const uint8_t* w = q + b * Kp * 16;
  __m512 acc[R];
  PDSERVE_UNROLL
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g, w += kQGroup * 16) {
    PDSERVE_UNROLL
    for (int i = 0; i < kQuads; ++i) _mm_prefetch(reinterpret_cast<const char*>(w + 64 * i) + kAhead, _MM_HINT_T0);
    PDSERVE_UNROLL
    for (int r0 = 0; r0 < R; r0 += kSub) {
      __m512i sum[A][kSub];
      PDSERVE_UNROLL
      for (int a = 0; a < A; ++a)
        for (int r = 0; r < kSub; ++r) sum[a][r] = a ? _mm512_setzero_si512() : _mm512_set1_epi32(-128 * x.sum(r0 + r, g));
      PDSERVE_UNROLL
      for (int i = 0; i < kQuads; ++i) {
        const __m512i wv = _mm512_loadu_si512(w + 64 * i);
        const int8_t* quads = x.quad(r0, g, i);
        PDSERVE_UNROLL
        for (int r = 0; r < kSub; ++r) {
          int32_t four;
          std::memcpy(&four, quads + 4 * r, 4);
          sum[i % A][r] = _mm512_dpbusd_epi32(sum[i % A][r], wv, _mm512_set1_epi32(four));
        }
      }
      PDSERVE_UNROLL
      for (int r = 0; r < kSub; ++r) {
        __m512i total = sum[0][r];
        PDSERVE_UNROLL
        for (int a = 1; a < A; ++a) total = _mm512_add_epi32(total, sum[a][r]);
        acc[r0 + r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), _mm512_set1_ps(x.scale(r0 + r, g)), acc[r0 + r]);
      }
    }
  }
  const __m512 sc = _mm512_loadu_ps(scale + b * 16);
  PDSERVE_UNROLL
  for (int r = 0; r < R; ++r)
    store16(y + r * N, bias, N, b * 16, _mm512_mul_ps(sc, acc[r]));
}
#endif

#ifdef PDSERVE_AVX2
// The same sums on AVX2 (llama.cpp's scheme for its Q8_0 dot products there): the weights made
// signed again (q ^ 0x80), `vpmaddubsw` multiplies their magnitudes (unsigned) by the inputs
// carrying the weights' signs (`vpsignb`) and adds pairs in int16 (at most 2 * 127 * 127: no
// saturation), `vpmaddwd` by ones adds those pairs into each channel's int32 sum of 4 inputs.
// Rows r0 .. r0 + S - 1 of block b (S <= 4, r0 a multiple of 4: one block of rows in the
// RoundedView), both 8-channel halves of each 64-byte weight vector at once: the block streams
// from memory in one walk, each line as it arrives, and a row's broadcast quad serves both halves.
// (Until session 22 a walk took one half and the block was walked twice: the first walk stalled on
// memory while the second, from L1, left memory idle. The step's linears, 1 thread, alternated 3x:
// 1 / 2 / 3 / 4 rows 0.85x / ~0.85x / 0.75x / 0.78x, 7-8 rows ~0.9x. At 4 rows GCC keeps four of
// the eight int32 sums on the stack, and it still measured faster.)
template <int S>
void int8_avx2_rows(RoundedView x, int r0, int64_t Kp, const uint8_t* w, const float* scale, const bf16* bias, bf16* y,
                    int64_t N, int64_t b) {
  static_assert(1 <= S && S <= 4, "in_fours' groups");
  const int64_t groups = Kp / kQGroup, stride = 4 * x.block;
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi16(1);
  __m256 acc[2][S];
  PDSERVE_UNROLL
  for (int h = 0; h < 2; ++h) for (int r = 0; r < S; ++r) acc[h][r] = _mm256_setzero_ps();
  const uint8_t* wg = w;
  for (int64_t g = 0; g < groups; ++g, wg += kQGroup * 16) {
    __m256i sum[2][S];
    PDSERVE_UNROLL
    for (int h = 0; h < 2; ++h) for (int r = 0; r < S; ++r) sum[h][r] = _mm256_setzero_si256();
    const int8_t* quads = x.quad(r0, g, 0);           // row r0 + r's quad i: 4 r + 4 block i further
    // unrolled 2 (the two-walk kernel before it, unrolled further, kept every product of the group
    // live and spilled them; not tried again here)
    _Pragma("GCC unroll 2")
    for (int i = 0; i < kQGroup / 4; ++i, quads += stride) {
      _mm_prefetch(reinterpret_cast<const char*>(wg + 64 * i) + kAhead, _MM_HINT_T0);
      __m256i wv[2], mag[2];
      PDSERVE_UNROLL
      for (int h = 0; h < 2; ++h) {
        wv[h] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + 64 * i + 32 * h)), flip);
        mag[h] = _mm256_abs_epi8(wv[h]);
      }
      PDSERVE_UNROLL
      for (int r = 0; r < S; ++r) {
        int32_t four;
        std::memcpy(&four, quads + 4 * r, 4);
        const __m256i xb = _mm256_set1_epi32(four);
        PDSERVE_UNROLL
        for (int h = 0; h < 2; ++h) {
          const __m256i pairs = _mm256_maddubs_epi16(mag[h], _mm256_sign_epi8(xb, wv[h]));
          sum[h][r] = _mm256_add_epi32(sum[h][r], _mm256_madd_epi16(pairs, ones));
        }
      }
    }
    PDSERVE_UNROLL
    for (int r = 0; r < S; ++r) {
      const __m256 xs = _mm256_set1_ps(x.scale(r0 + r, g));
      PDSERVE_UNROLL
      for (int h = 0; h < 2; ++h) acc[h][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[h][r]), xs, acc[h][r]);
    }
  }
  PDSERVE_UNROLL
  for (int h = 0; h < 2; ++h) {
    const __m256 ws = _mm256_loadu_ps(scale + b * 16 + 8 * h);
    PDSERVE_UNROLL
    for (int r = 0; r < S; ++r) store8(y + (r0 + r) * N, bias, N, b * 16 + 8 * h, _mm256_mul_ps(ws, acc[h][r]));
  }
}

template <int R>
void int8_avx2(RoundedView x, int64_t Kp, const uint8_t* q, const float* scale, const bf16* bias, bf16* y, int64_t N,
               int64_t b) {
  in_fours<R>([&](auto s, int r0) {
    int8_avx2_rows<decltype(s)::value>(x, r0, Kp, q + b * Kp * 16, scale, bias, y, N, b);
  });
}
#endif

// the same sums, one channel at a time (CPUs without AVX512-VNNI or AVX2)
template <int R>
void int8_scalar(RoundedView x, int64_t Kp, const uint8_t* q, const float* scale, const bf16* bias, bf16* y, int64_t N,
                 int64_t b) {
  const int64_t groups = Kp / kQGroup;
  const uint8_t* w = q + b * Kp * 16;
  for (int64_t ch = 0; ch < 16 && b * 16 + ch < N; ++ch)
    for (int r = 0; r < R; ++r) {
      float acc = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        int32_t sum = -128 * x.sum(r, g);
        for (int64_t k = g * kQGroup; k < (g + 1) * kQGroup; ++k)
          sum += static_cast<int32_t>(w[(k / 4) * 64 + 4 * ch + k % 4]) * x.quad(r, g, (k % kQGroup) / 4)[k % 4];
        acc += static_cast<float>(sum) * x.scale(r, g);
      }
      y[r * N + b * 16 + ch] = static_cast<bf16>(scale[b * 16 + ch] * acc + bias_at(bias, b * 16 + ch));
    }
}

template <int R> struct Int8Range {
  static void run(RoundedView x, int64_t Kp, const uint8_t* q, const float* scale, const bf16* bias, bf16* y, int64_t N,
                  int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
#ifdef PDSERVE_VNNI
      int8_vnni<R>(x, Kp, q, scale, bias, y, N, b);
#elif defined(PDSERVE_AVX2)
      int8_avx2<R>(x, Kp, q, scale, bias, y, N, b);
#else
      int8_scalar<R>(x, Kp, q, scale, bias, y, N, b);
#endif
    }
  }
};

struct Int8Args {
  at::Tensor x;                 // contiguous
  int64_t rows, K, Kp;
  const uint8_t* q;
  const float* scale;
  const bf16* bias;
};

Int8Args int8_args(const at::Tensor& x_in, const at::Tensor& q, const at::Tensor& scale,
                   const std::optional<at::Tensor>& bias, int64_t n) {
  check_x(x_in);
  const int64_t rows = x_in.size(0), K = x_in.size(1), Kp = (K + kQGroup - 1) / kQGroup * kQGroup;
  const int64_t blocks = (n + 15) / 16;
  TORCH_CHECK(q.scalar_type() == at::kByte && q.is_contiguous() &&
              q.sizes() == at::IntArrayRef({blocks, Kp / 4, 64}),
              "q: [ceil(out/16), ceil(in/32) * 8, 64] uint8 (int8 weights + 128)");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == blocks * 16 && scale.is_contiguous(),
              "scale: [ceil(out/16) * 16] fp32");
  return {x_in.contiguous(), rows, K, Kp, q.data_ptr<uint8_t>(), scale.data_ptr<float>(), bias_ptr(bias, n)};
}

// y = x @ ((q - 128) * scale).T (+ bias) on AMX-INT8 tiles, x in two int8 limbs a row: int8_gemv
// from kAmxFrom rows
at::Tensor int8_amx(const Int8Args& a, int64_t n) {
  at::Tensor y = at::empty({a.rows, n}, a.x.options());
  pdserve_amx::int8_gemm(a.x.data_ptr<bf16>(), a.rows, a.K, a.q, a.Kp, a.scale, a.bias, y.data_ptr<bf16>(), n);
  return y;
}

at::Tensor int8_gemm_amx(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                         const std::optional<at::Tensor>& bias, int64_t n) {
  TORCH_CHECK(pdserve_amx::int8_available(), "AMX-INT8 is not available here");
  const Int8Args a = int8_args(x, q, scale, bias, n);
  TORCH_CHECK(a.Kp % 64 == 0, "x: inputs (rounded up to 32) a multiple of 64 (whole tiles)");
  return int8_amx(a, n);
}

at::Tensor int8_gemv(const at::Tensor& x_in, const at::Tensor& q, const at::Tensor& scale,
                     const std::optional<at::Tensor>& bias, int64_t n) {
  const Int8Args a = int8_args(x_in, q, scale, bias, n);
  if (a.rows >= kAmxFrom && a.Kp % 64 == 0 && pdserve_amx::int8_available()) return int8_amx(a, n);
  const int64_t rows = a.rows, K = a.K, Kp = a.Kp, blocks = (n + 15) / 16;
  const bf16* b = a.bias;
  const at::Tensor& x = a.x;
  at::Tensor y = at::empty({rows, n}, x_in.options());
  const RoundedView rounded = rounded_rows(x.data_ptr<bf16>(), rows, K, Kp);
  const uint8_t* qp = a.q;
  const float* wsp = a.scale;
  bf16* yp = y.data_ptr<bf16>();
  // chunks of at least 4 blocks (64 channels x Kp bytes): a thread's share outweighs its start-up
  at::parallel_for(0, blocks, 4, [&](int64_t b0, int64_t b1) {
    passes_in_chunks<kWideFirst>(rows, b0, b1, Kp * 16, 4, [&](int64_t r0, int64_t r, int64_t c0, int64_t c1) {
      with_rows<Int8Range, kWideFirst>(r, rounded.at(r0), Kp, qp, wsp, b, yp + r0 * n, n, c0, c1);
    });
  });
  return y;
}

bool vnni() {
#ifdef PDSERVE_VNNI
  return true;
#else
  return false;
#endif
}

bool int_gemv_vectorized() {
#if defined(PDSERVE_VNNI) || defined(PDSERVE_AVX2)
  return true;
#else
  return false;
#endif
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("int8_gemv(Tensor x, Tensor q, Tensor scale, Tensor? bias, int n) -> Tensor");
  m.def("int8_gemm_amx(Tensor x, Tensor q, Tensor scale, Tensor? bias, int n) -> Tensor");
  m.def("int8_gemv_amx_from() -> int", [] { return kAmxFrom; });
  m.def("vnni() -> bool", &vnni);
  m.def("int_gemv_vectorized() -> bool", &int_gemv_vectorized);
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) {
  m.impl("int8_gemv", &int8_gemv);
  m.impl("int8_gemm_amx", &int8_gemm_amx);
}
