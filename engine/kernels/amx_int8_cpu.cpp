// int8 GEMM on AMX-INT8 tiles: int8_gemv's calls of a few dozen rows (a decode batch) where the CPU
// has AMX-INT8 (amx_bf16.h `int8_gemm`, `int8_available`).
//
//   (the op on its own, int8_gemm_amx, is int8_gemv_cpu.cpp's: it parses int8_gemv's arguments;
//   amx_int8_available() amx_bf16_cpu.cpp's, beside the tiles' other checks)
//
// Why: from a few dozen rows int8_gemv's VNNI kernel is bound by its multiply-adds (64 a
// `vpdpbusd`), and widening its weight to bf16 for the bf16 AMX GEMM (session 25's path, about 8
// vector ops a 64-byte vector, once a call) cost what the VNNI kernel does at ~30 rows.
// `tdpbsud` multiplies 16 x 16 x 64 bytes and takes int8_gemv's weight layout (16 channels, quads
// of inputs, 64 bytes a quad row, + 128) as its B tiles as it is: nothing widened.
//
// What it computes: the VNNI kernel's activation groups of 32 (one scale each) would need the
// int32 accumulators stored and rescaled every 32 inputs (a tile store and an fp32 pass per
// group); one int8 scale a row costs quality (format_quality.py, as int8_gemv_cpu.cpp's header
// gives: -3.23 against groups' -3.15). So each row is split into two int8 limbs on one scale,
//     x ~ s (128 hi + lo),  v = round(x / s) in [-16383, 16383],  hi = v >> 7,  lo = v & 127,
// s = max |x| / 16383 (15 bits a row: a rounding error of at most max |x| / 32766, below bf16's
// own for every value above 1/64 of the row's largest), and both limbs are multiplied by the same
// B tiles:
//     y[r, n] = scale[n] s[r] (128 (H - 128 sum hi) + (L - 128 sum lo)) + bias[n]
// with H, L the tiles' exact int32 sums of hi and lo times q + 128 (the weight's offset removed
// through the limbs' sums), the rest in fp32, rounded to bf16 once. Each row is independent of
// the rows beside it; a row holding a NaN gets s = NaN (all its outputs NaN).
//
// A pass: one tile of 16 rows (its hi and lo: A tiles 4, 5) against two blocks (B tiles 6, 7),
// four accumulators (hi and lo for each block): as many tile loads a multiply-add as the bf16 GEMM's
// 2 x 2 pass, at half the weight bytes. Rows past 16 walk the thread's blocks again in L2-sized
// chunks. Times against the widened path: int8_gemv_cpu.cpp.
#include "amx_bf16.h"
#include "gemv_cpu.h"            // the GEMVs' bias-and-round store

#include <algorithm>
#include <limits>
#include <vector>

namespace pdserve_amx {

#ifdef PDSERVE_AMX
using pdserve_cpu::bf16;

namespace {

// x's rows split into limbs: hi, lo [Mp, Kp] (zeros past K and M), per row s and 128 * the sums of
// its hi and lo. The calling thread's buffers, reused call to call.
struct Limbs {
  std::vector<int8_t> hi, lo;
  std::vector<float> s;
  std::vector<int32_t> c_hi, c_lo;
};

void split_row(const bf16* xr, int64_t K, int8_t* hi, int8_t* lo, float* s, int32_t* c_hi, int32_t* c_lo) {
  using pdserve_cpu::lanes16;
  using pdserve_cpu::load16;
  __m512 m = _mm512_setzero_ps();
  __mmask16 nan = 0;
  for (int64_t k = 0; k < K; k += 16) {
    const __m512 v = load16(xr + k, lanes16(K - k));
    nan |= pdserve_cpu::nan16(v);
    m = _mm512_max_ps(m, _mm512_abs_ps(v));
  }
  const float mx = _mm512_reduce_max_ps(m);
  // a NaN makes the row's outputs NaN, as in a bf16 product (the vector max drops NaNs, and a NaN
  // would round to an integer)
  *s = nan ? std::numeric_limits<float>::quiet_NaN() : mx / 16383.f;
  const __m512 inv = _mm512_set1_ps(mx > 0.f ? 16383.f / mx : 0.f);
  const __m512i low7 = _mm512_set1_epi32(127);
  __m512i sh = _mm512_setzero_si512(), sl = _mm512_setzero_si512();
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 valid = lanes16(K - k);
    const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(load16(xr + k, valid), inv));    // to nearest even
    const __m512i h = _mm512_srai_epi32(v, 7), l = _mm512_and_si512(v, low7);
    sh = _mm512_add_epi32(sh, h);
    sl = _mm512_add_epi32(sl, l);
    _mm_mask_storeu_epi8(hi + k, valid, _mm512_cvtepi32_epi8(h));
    _mm_mask_storeu_epi8(lo + k, valid, _mm512_cvtepi32_epi8(l));
  }
  *c_hi = 128 * _mm512_reduce_add_epi32(sh);
  *c_lo = 128 * _mm512_reduce_add_epi32(sl);
}

const Limbs& split_limbs(const bf16* x, int64_t M, int64_t K, int64_t Kp) {
  thread_local Limbs mine;
  Limbs& l = mine;                 // named in the lambda below, `mine` would be each pool thread's own
  const int64_t Mp = (M + kTileRows - 1) / kTileRows * kTileRows;
  l.hi.assign(Mp * Kp, 0);
  l.lo.assign(Mp * Kp, 0);
  l.s.assign(Mp, 0.f);
  l.c_hi.assign(Mp, 0);
  l.c_lo.assign(Mp, 0);
  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      split_row(x + r * K, K, &l.hi[r * Kp], &l.lo[r * Kp], &l.s[r], &l.c_hi[r], &l.c_lo[r]);
  });
  return l;
}

// 16 rows' limbs (hi, lo: rows Kp bytes apart) against NB <= 2 blocks (wb[j]): accumulator j the
// hi sums of block j, 2 + j the lo sums, into out[4][16][16]
template <int NB>
__attribute__((target("amx-tile,amx-int8"))) void limb_pass(const int8_t* hi, const int8_t* lo, int64_t Kp,
                                                            const uint8_t* const* wb, int32_t* out) {
  _tile_zero(0);
  _tile_zero(2);
  if constexpr (NB > 1) {
    _tile_zero(1);
    _tile_zero(3);
  }
  for (int64_t k = 0; k < Kp; k += 64) {
    _tile_loadd(6, wb[0] + k * 16, 64);              // quad rows k/4 .. k/4 + 15 of the block
    _tile_loadd(4, hi + k, Kp);
    _tile_dpbsud(0, 4, 6);
    _tile_loadd(5, lo + k, Kp);
    if constexpr (NB > 1) _tile_loadd(7, wb[1] + k * 16, 64);
    _tile_dpbsud(2, 5, 6);
    if constexpr (NB > 1) {
      _tile_dpbsud(1, 4, 7);
      _tile_dpbsud(3, 5, 7);
    }
  }
  _tile_stored(0, out, 64);
  _tile_stored(2, out + 512, 64);
  if constexpr (NB > 1) {
    _tile_stored(1, out + 256, 64);
    _tile_stored(3, out + 768, 64);
  }
}

// rows [m0, m0 + rows) of y's channels [16b, 16b + 16) from the hi and lo sums (out, out + 512)
void store_block(const int32_t* out, const Limbs& l, int64_t rows, const float* scale, const bf16* bias, bf16* y,
                 int64_t N, int64_t m0, int64_t b) {
  const __m512 sc = _mm512_loadu_ps(scale + 16 * b);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t row = m0 + r;
    const __m512i h = _mm512_sub_epi32(_mm512_load_si512(out + 16 * r), _mm512_set1_epi32(l.c_hi[row]));
    const __m512i o = _mm512_sub_epi32(_mm512_load_si512(out + 512 + 16 * r), _mm512_set1_epi32(l.c_lo[row]));
    const __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(h), _mm512_set1_ps(128.f), _mm512_cvtepi32_ps(o));
    pdserve_gemv::store16(y + row * N, bias, N, 16 * b, _mm512_mul_ps(v, _mm512_mul_ps(sc, _mm512_set1_ps(l.s[row]))));
  }
}

}  // namespace

void int8_gemm(const bf16* x, int64_t M, int64_t K, const uint8_t* q, int64_t Kp, const float* scale, const bf16* bias,
               bf16* y, int64_t N) {
  TORCH_INTERNAL_ASSERT(int8_available() && Kp % 64 == 0 && K <= Kp && M >= 0, "int8_gemm: AMX-INT8, Kp % 64 == 0");
  const Limbs& l = split_limbs(x, M, K, Kp);
  const int64_t blocks = (N + 15) / 16;
  const int64_t chunk = std::max<int64_t>(2, kChunkBytes / (Kp * 16) / 2 * 2);     // whole pairs of blocks
  at::parallel_for(0, blocks, 4, [&](int64_t b0, int64_t b1) {
    configure_tiles();
    alignas(64) int32_t out[4 * 256];
    for (int64_t c0 = b0; c0 < b1; c0 += chunk) {
      const int64_t c1 = std::min(b1, c0 + chunk);
      for (int64_t m0 = 0; m0 < M; m0 += kTileRows) {
        const int64_t rows = std::min(M - m0, kTileRows);
        const int8_t* hi = l.hi.data() + m0 * Kp;
        const int8_t* lo = l.lo.data() + m0 * Kp;
        for (int64_t b = c0; b < c1; b += 2) {
          const bool two = b + 1 < c1;
          const uint8_t* wb[2] = {q + b * Kp * 16, q + (two ? b + 1 : b) * Kp * 16};
          if (two) limb_pass<2>(hi, lo, Kp, wb, out); else limb_pass<1>(hi, lo, Kp, wb, out);
          for (int j = 0; j < (two ? 2 : 1); ++j)
            store_block(out + 256 * j, l, rows, scale, bias, y, N, m0, b + j);
        }
      }
    }
    release_tiles();
  });
}

#else

void int8_gemm(const pdserve_cpu::bf16*, int64_t, int64_t, const uint8_t*, int64_t, const float*,
               const pdserve_cpu::bf16*, pdserve_cpu::bf16*, int64_t) {
  TORCH_CHECK(false, "pdserve's AMX kernels are not built for this CPU");
}

#endif

}  // namespace pdserve_amx

