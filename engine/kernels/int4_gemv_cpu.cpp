// int4 GEMV with int8 activations (torch.ops.pdserve.int4_gemv): asymmetric int4 weights in groups
// of 32 inputs, a bf16 scale s and zero z each (the engine.linear `_int4` quantization,
// gpt-fast/torchao's scheme); the rows of x rounded to int8 in the same groups of 32 (gemv_cpu.h
// `quantize_rows`, as int8_gemv does; llama.cpp's Q4 dot products do the same), and the nibbles
// multiplied by them in int32 by AVX512-VNNI's `vpdpbusd`.
//
//   int4_gemv(x [R, K] bf16, packed [N/16, K/32, 256] uint8, sz [N/16, K/32, 2, 16] bf16,
//             bias [n] bf16?, n) -> [R, n] bf16                                       (K % 32 == 0)
//     A block of 16 output channels and one group of 32 inputs is 4 vectors of 64 bytes; in
//     vector v, byte 4c + e holds channel c's q at input 8v + e (low nibble) and 8v + 4 + e (high).
//     sz[b, g, 0, c] and sz[b, g, 1, c] are channel 16b + c's scale s and zero z of group g.
//     With xs[r, g] the scale of row r's group g and xq its int8 values (quantize_rows):
//     y[r, n] = sum_g xs[r, g] * (s[n, g] * sum_{k in g} q[n, k] xq[r, k]
//                                 + (z[n, g] - 8 s[n, g]) * sum_{k in g} xq[r, k]) + bias[n]
//     = sum_k ((q - 8) s + z)[n, k] * xs xq[r, k]: the dequantized weight times the rounded x;
//     each group's integer sums exact in int32, the rest in fp32, rounded to bf16 once.
// Why: the weight-only kernel before it turned every nibble into a bf16 number for `vdpbf16ps` and
// was bound by that conversion (about 25-33 GB/s of int4 weights, 2-2.3x its memory bound at one
// row, and slower than the bf16 copy from 64 rows on).
//
// Rows: passes of up to 8 (gemv_cpu.h `passes_in_chunks`): the group's 8 unpacked nibble vectors,
// its scales and the rows' sums and outputs fill the registers; with fewer than 4 rows the sums are
// split over independent chains. One weight stream fetched kAhead bytes ahead.
//
// On AMX (a CPU with AMX-BF16), calls of kAmxFrom rows and more go to the bf16 AMX GEMM: each
// weight widened to bf16 as (q - 8) s + z (fp32, rounded to bf16 once) a chunk of blocks at a time
// (`int4_widen`), x NOT rounded to int8, y = x @ w.T + bias in fp32 sums, bf16 once.
//   int4_gemm_amx(x, packed, sz, bias, n): that path at every row count (tests, benchmarks);
//   int4_gemv_amx_from() -> int: kAmxFrom.
// On a 2-core AMX Xeon (linear_bench.py, the step's linears, VNNI -> AMX from 24 rows), 2 threads:
// 32 rows 19.1 -> 11.6 ms, 64 28.1 -> 16.0, 512 237 -> 99; 1 thread 26.9 -> 20.6, 52.7 -> 28.3,
// 412 -> 169; at 16 rows VNNI wins (1 thread 14.2 against 16.8), at 24 about even. (int8 runs on
// AMX-INT8 tiles instead; int4's per-32 group scale and zero would need its accumulators rescaled
// every 32 inputs there.)
#include "amx_bf16.h"
#include "gemv_cpu.h"

namespace {

using namespace pdserve_gemv;
constexpr int64_t kGroup = kQGroup;          // the weights' groups are the activations' groups
// From this many rows int4_gemv runs on AMX tiles where the CPU has them (amx_bf16_cpu.cpp)
constexpr int64_t kAmxFrom = 24;

#ifdef PDSERVE_VNNI
template <int R>
void int4_vnni(RoundedView x, int64_t K, const uint8_t* packed, const bf16* sz, const bf16* bias, bf16* y, int64_t N,
               int64_t b) {
  constexpr int A = R <= 2 ? 4 : (R <= 4 ? 2 : 1);
  const int64_t groups = K / kGroup;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __m512 acc[R];
  PDSERVE_UNROLL
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* p = packed + (b * groups + g) * 256;
    __m512i w[8];                                     // w[j]: inputs 4j .. 4j + 3 of the group
    PDSERVE_UNROLL
    for (int v = 0; v < 4; ++v) {
      _mm_prefetch(reinterpret_cast<const char*>(p + 64 * v) + kAhead, _MM_HINT_T0);
      const __m512i raw = _mm512_loadu_si512(p + 64 * v);
      w[2 * v] = _mm512_and_si512(raw, nibble);
      w[2 * v + 1] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble);
    }
    const bf16* s16 = sz + (b * groups + g) * 32;
    const __m512 s = load16(s16), m = _mm512_fmadd_ps(_mm512_set1_ps(-8.f), s, load16(s16 + 16));   // z - 8 s
    __m512i sum[A][R];
    PDSERVE_UNROLL
    for (int a = 0; a < A; ++a) for (int r = 0; r < R; ++r) sum[a][r] = _mm512_setzero_si512();
    PDSERVE_UNROLL
    for (int j = 0; j < 8; ++j) {
      const int8_t* quads = x.quad(0, g, j);
      PDSERVE_UNROLL
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, quads + 4 * r, 4);
        sum[j % A][r] = _mm512_dpbusd_epi32(sum[j % A][r], w[j], _mm512_set1_epi32(four));
      }
    }
    PDSERVE_UNROLL
    for (int r = 0; r < R; ++r) {
      __m512i total = sum[0][r];
      PDSERVE_UNROLL
      for (int a = 1; a < A; ++a) total = _mm512_add_epi32(total, sum[a][r]);
      const float scale = x.scale(r, g);
      const __m512 t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), s,
                                       _mm512_mul_ps(_mm512_set1_ps(static_cast<float>(x.sum(r, g))), m));
      acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(scale), t, acc[r]);
    }
  }
  PDSERVE_UNROLL
  for (int r = 0; r < R; ++r) store16(y + r * N, bias, N, b * 16, acc[r]);
}
#endif

#ifdef PDSERVE_AVX2
// The same sums on AVX2: the nibbles (0..15, unsigned) meet the int8 inputs in `vpmaddubsw`, which
// adds pairs in int16; a group's 16 pairs of a lane add up in int16 (at most 16 * 15 * 127 = 30480:
// no overflow), then `vpmaddwd` by ones into int32. Rows r0 .. r0 + S - 1 (S <= 4, r0 a multiple of
// 4), channels 8h .. 8h + 7 of block b (half h of each 64-byte vector).
template <int S>
void int4_avx2_rows(RoundedView x, int r0, int64_t K, const uint8_t* packed, const bf16* sz, const bf16* bias,
                    bf16* y, int64_t N, int64_t b) {
  const int64_t groups = K / kGroup, stride = 4 * x.block;
  const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  PDSERVE_UNROLL
  for (int h = 0; h < 2; ++h) {
    __m256 acc[S];
    PDSERVE_UNROLL
    for (int r = 0; r < S; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* p = packed + (b * groups + g) * 256 + 32 * h;
      const int8_t* quads = x.quad(r0, g, 0);
      __m256i pairs[S];
      PDSERVE_UNROLL
      for (int r = 0; r < S; ++r) pairs[r] = _mm256_setzero_si256();
      _Pragma("GCC unroll 2")
      for (int v = 0; v < 4; ++v, quads += 2 * stride) {
        if (h == 0) _mm_prefetch(reinterpret_cast<const char*>(p + 64 * v) + kAhead, _MM_HINT_T0);
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * v));
        const __m256i lo = _mm256_and_si256(raw, nibble), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
        PDSERVE_UNROLL
        for (int r = 0; r < S; ++r) {
          int32_t first, second;
          std::memcpy(&first, quads + 4 * r, 4);
          std::memcpy(&second, quads + stride + 4 * r, 4);
          pairs[r] = _mm256_add_epi16(pairs[r], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(first)));
          pairs[r] = _mm256_add_epi16(pairs[r], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(second)));
        }
      }
      const bf16* s16 = sz + (b * groups + g) * 32 + 8 * h;
      const __m256 s = load8(s16), m = _mm256_fmadd_ps(_mm256_set1_ps(-8.f), s, load8(s16 + 16));   // z - 8 s
      PDSERVE_UNROLL
      for (int r = 0; r < S; ++r) {
        const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs[r], ones));
        const __m256 t = _mm256_fmadd_ps(dot, s, _mm256_mul_ps(_mm256_set1_ps(static_cast<float>(x.sum(r0 + r, g))), m));
        acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(x.scale(r0 + r, g)), t, acc[r]);
      }
    }
    PDSERVE_UNROLL
    for (int r = 0; r < S; ++r) store8(y + (r0 + r) * N, bias, N, b * 16 + 8 * h, acc[r]);
  }
}

// The same sums for S <= 2 rows, both halves of each 64-byte vector at once (as int8_gemv_cpu.cpp's
// int8_avx2_rows: one walk over the block from memory instead of two, a row's broadcasts shared by
// both halves); the same sums in the same order as int4_avx2_rows (batch-invariant across both).
// At 3-4 rows (their sums and accumulators would not fit the registers) it measured mixed against
// int4_avx2_rows, which keeps those.
template <int S>
void int4_avx2_both(RoundedView x, int r0, int64_t K, const uint8_t* packed, const bf16* sz, const bf16* bias,
                    bf16* y, int64_t N, int64_t b) {
  static_assert(S <= 2, "the sums of both halves fill the registers at 2 rows");
  const int64_t groups = K / kGroup, stride = 4 * x.block;
  const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc[2][S];
  PDSERVE_UNROLL
  for (int h = 0; h < 2; ++h) for (int r = 0; r < S; ++r) acc[h][r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* p = packed + (b * groups + g) * 256;
    const int8_t* quads = x.quad(r0, g, 0);
    __m256i pairs[2][S];
    PDSERVE_UNROLL
    for (int h = 0; h < 2; ++h) for (int r = 0; r < S; ++r) pairs[h][r] = _mm256_setzero_si256();
    _Pragma("GCC unroll 2")
    for (int v = 0; v < 4; ++v, quads += 2 * stride) {
      _mm_prefetch(reinterpret_cast<const char*>(p + 64 * v) + kAhead, _MM_HINT_T0);
      __m256i lo[2], hi[2];
      PDSERVE_UNROLL
      for (int h = 0; h < 2; ++h) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * v + 32 * h));
        lo[h] = _mm256_and_si256(raw, nibble);
        hi[h] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
      }
      PDSERVE_UNROLL
      for (int r = 0; r < S; ++r) {
        int32_t first, second;
        std::memcpy(&first, quads + 4 * r, 4);
        std::memcpy(&second, quads + stride + 4 * r, 4);
        const __m256i xf = _mm256_set1_epi32(first), xs = _mm256_set1_epi32(second);
        PDSERVE_UNROLL
        for (int h = 0; h < 2; ++h) {
          pairs[h][r] = _mm256_add_epi16(pairs[h][r], _mm256_maddubs_epi16(lo[h], xf));
          pairs[h][r] = _mm256_add_epi16(pairs[h][r], _mm256_maddubs_epi16(hi[h], xs));
        }
      }
    }
    PDSERVE_UNROLL
    for (int h = 0; h < 2; ++h) {
      const bf16* s16 = sz + (b * groups + g) * 32 + 8 * h;
      const __m256 s = load8(s16), m = _mm256_fmadd_ps(_mm256_set1_ps(-8.f), s, load8(s16 + 16));   // z - 8 s
      PDSERVE_UNROLL
      for (int r = 0; r < S; ++r) {
        const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs[h][r], ones));
        const __m256 t = _mm256_fmadd_ps(dot, s, _mm256_mul_ps(_mm256_set1_ps(static_cast<float>(x.sum(r0 + r, g))), m));
        acc[h][r] = _mm256_fmadd_ps(_mm256_set1_ps(x.scale(r0 + r, g)), t, acc[h][r]);
      }
    }
  }
  PDSERVE_UNROLL
  for (int h = 0; h < 2; ++h)
    for (int r = 0; r < S; ++r) store8(y + (r0 + r) * N, bias, N, b * 16 + 8 * h, acc[h][r]);
}
#endif

// the same sums, one channel at a time (CPUs without AVX512-VNNI or AVX2)
template <int R>
void int4_scalar(RoundedView x, int64_t K, const uint8_t* packed, const bf16* sz, const bf16* bias, bf16* y, int64_t N,
                 int64_t b) {
  const int64_t groups = K / kGroup;
  for (int c = 0; c < 16 && b * 16 + c < N; ++c)
    for (int r = 0; r < R; ++r) {
      float acc = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* p = packed + (b * groups + g) * 256;
        int32_t dot = 0;
        for (int v = 0; v < 4; ++v)
          for (int e = 0; e < 4; ++e) {
            const uint8_t byte = p[64 * v + 4 * c + e];
            dot += (byte & 15) * x.quad(r, g, 2 * v)[e] + (byte >> 4) * x.quad(r, g, 2 * v + 1)[e];
          }
        const bf16* s16 = sz + (b * groups + g) * 32;
        const float s = s16[c], m = static_cast<float>(s16[16 + c]) - 8 * s;
        acc += x.scale(r, g) * (s * static_cast<float>(dot) + m * static_cast<float>(x.sum(r, g)));
      }
      y[r * N + b * 16 + c] = static_cast<bf16>(acc + bias_at(bias, b * 16 + c));
    }
}

template <int R> struct Int4Range {
  static void run(RoundedView x, int64_t K, const uint8_t* packed, const bf16* sz, const bf16* bias, bf16* y, int64_t N,
                  int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
#ifdef PDSERVE_VNNI
      int4_vnni<R>(x, K, packed, sz, bias, y, N, b);
#elif defined(PDSERVE_AVX2)
      in_fours<R>([&](auto s, int r0) {
        constexpr int S = decltype(s)::value;
        if constexpr (S <= 2)
          int4_avx2_both<S>(x, r0, K, packed, sz, bias, y, N, b);
        else
          int4_avx2_rows<S>(x, r0, K, packed, sz, bias, y, N, b);
      });
#else
      int4_scalar<R>(x, K, packed, sz, bias, y, N, b);
#endif
    }
  }
};

struct Int4Weights {
  const uint8_t* packed;
  const bf16* sz;
};

#ifdef PDSERVE_AVX512
// Blocks [c0, c1) in bf16_gemv's bf16 layout (amx_bf16.h `Weights::dequantize`; ctx: Int4Weights):
// each weight (q - 8) s + z of its group, rounded to bf16. A group's 4 vectors hold its 8 quad rows
// (vector v: inputs 8v .. 8v + 3 in the low nibbles, 8v + 4 .. 8v + 7 in the high ones); blocks'
// groups are contiguous.
void int4_widen(const void* ctx, int64_t c0, int64_t c1, int64_t K, bf16* out) {
  const Int4Weights& w = *static_cast<const Int4Weights*>(ctx);
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int64_t bg = c0 * (K / kGroup); bg < c1 * (K / kGroup); ++bg, out += 16 * kGroup) {
    const __m512 s = load16(w.sz + bg * 32), z = _mm512_fnmadd_ps(_mm512_set1_ps(8.f), s, load16(w.sz + bg * 32 + 16));
    __m512 s4[4], z4[4];                          // element 4c + e: channel 4i + c's s and z - 8 s
    PDSERVE_UNROLL
    for (int i = 0; i < 4; ++i) {
      const __m512i ch = _mm512_add_epi32(_mm512_set1_epi32(4 * i),
                                          _mm512_srli_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,
                                                                              12, 13, 14, 15), 2));
      s4[i] = _mm512_permutexvar_ps(ch, s);
      z4[i] = _mm512_permutexvar_ps(ch, z);
    }
    for (int v = 0; v < 4; ++v) {
      _mm_prefetch(reinterpret_cast<const char*>(w.packed + bg * 256 + 64 * v) + kWidenAhead, _MM_HINT_T0);
      const __m512i bytes = _mm512_loadu_si512(w.packed + bg * 256 + 64 * v);
      const __m512i halves[2] = {_mm512_and_si512(bytes, nibble), _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble)};
      for (int h = 0; h < 2; ++h) {
        __m512 f[4];
        f[0] = _mm512_fmadd_ps(bytes16(_mm512_extracti32x4_epi32(halves[h], 0)), s4[0], z4[0]);
        f[1] = _mm512_fmadd_ps(bytes16(_mm512_extracti32x4_epi32(halves[h], 1)), s4[1], z4[1]);
        f[2] = _mm512_fmadd_ps(bytes16(_mm512_extracti32x4_epi32(halves[h], 2)), s4[2], z4[2]);
        f[3] = _mm512_fmadd_ps(bytes16(_mm512_extracti32x4_epi32(halves[h], 3)), s4[3], z4[3]);
        quads_to_pairs(f, out + (2 * v + h) * 64);
      }
    }
  }
}
#else
// not built (no AVX512): never called, AMX's gemm refuses to run first
constexpr void (*int4_widen)(const void*, int64_t, int64_t, int64_t, bf16*) = nullptr;
#endif

struct Int4Args {
  at::Tensor x;                 // contiguous
  int64_t rows, K;
  Int4Weights w;
  const bf16* bias;
};

Int4Args int4_args(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& sz,
                   const std::optional<at::Tensor>& bias, int64_t n) {
  check_x(x_in);
  const int64_t rows = x_in.size(0), K = x_in.size(1), groups = K / kGroup, blocks = (n + 15) / 16;
  TORCH_CHECK(K % kGroup == 0, "int4: the input size must be a multiple of 32");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() &&
              packed.sizes() == at::IntArrayRef({blocks, groups, 256}), "packed: [ceil(out/16), in/32, 256] uint8");
  TORCH_CHECK(sz.scalar_type() == at::kBFloat16 && sz.is_contiguous() &&
              sz.sizes() == at::IntArrayRef({blocks, groups, 2, 16}), "sz: [ceil(out/16), in/32, 2, 16] bf16");
  return {x_in.contiguous(), rows, K, {packed.data_ptr<uint8_t>(), sz.data_ptr<bf16>()}, bias_ptr(bias, n)};
}

// y = x @ w.T (+ bias) on AMX tiles, w dequantized to bf16, x unrounded: int4_gemv from kAmxFrom rows
at::Tensor int4_amx(const Int4Args& a, int64_t n) {
  return pdserve_amx::gemm(a.x, {nullptr, int4_widen, &a.w}, a.bias, n);
}

at::Tensor int4_gemm_amx(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& sz,
                         const std::optional<at::Tensor>& bias, int64_t n) {
  TORCH_CHECK(pdserve_amx::available(), "AMX-BF16 is not available here");
  return int4_amx(int4_args(x, packed, sz, bias, n), n);
}

at::Tensor int4_gemv(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& sz,
                     const std::optional<at::Tensor>& bias, int64_t n) {
  const Int4Args a = int4_args(x_in, packed, sz, bias, n);
  if (a.rows >= kAmxFrom && pdserve_amx::available()) return int4_amx(a, n);
  const int64_t rows = a.rows, K = a.K, groups = K / kGroup, blocks = (n + 15) / 16;
  const bf16* b = a.bias;
  const at::Tensor& x = a.x;
  at::Tensor y = at::empty({rows, n}, x_in.options());
  const RoundedView rounded = rounded_rows(x.data_ptr<bf16>(), rows, K, K);
  const uint8_t* pp = a.w.packed;
  const bf16* szp = a.w.sz;
  bf16* yp = y.data_ptr<bf16>();
  at::parallel_for(0, blocks, 4, [&](int64_t b0, int64_t b1) {     // as int8_gemv
    passes_in_chunks(rows, b0, b1, K * 8 + groups * 64, 2, [&](int64_t r0, int64_t r, int64_t c0, int64_t c1) {
      with_rows<Int4Range>(r, rounded.at(r0), K, pp, szp, b, yp + r0 * n, n, c0, c1);
    });
  });
  return y;
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("int4_gemv(Tensor x, Tensor packed, Tensor sz, Tensor? bias, int n) -> Tensor");
  m.def("int4_gemm_amx(Tensor x, Tensor packed, Tensor sz, Tensor? bias, int n) -> Tensor");
  m.def("int4_gemv_amx_from() -> int", [] { return kAmxFrom; });
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) {
  m.impl("int4_gemv", &int4_gemv);
  m.impl("int4_gemm_amx", &int4_gemm_amx);
}
