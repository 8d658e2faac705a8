// Prompt-chunk attention that reads K/V from the paged pool in place (CPU, bf16; AVX512-BF16 or AVX2).
//
// Registered as torch.ops.pdserve.paged_prefill_attention; engine/attention.py calls it for the
// prompt chunks of a bf16 engine on CPU (engine.model_runner decides which: `prefill_kernel`).
//
//   query  [n, H, D] bf16      the chunk's queries, at positions past .. past + n - 1 (rows may
//                              be strided, as a slice of the fused QKV output; heads and dims not)
//   pool   [blocks, layers, 2, bs, Hkv, D] bf16, the chunk's own K/V already stored
//   table  [>= ceil((past + n) / bs)] int64, the sequence's block table
//   past   tokens before the chunk (0: a fresh prompt)
//   window 0, or W > 0 for a sliding-window layer: query i attends only its last W keys
//   softcap 0, or C > 0: scores capped to C * tanh(scale * s / C) before the softmax (Gemma 2)
//   sinks  None, or [H] fp32: gpt-oss's attention sinks, a logit per query head in each row's
//                              softmax with a zero value (exp(sink - max) in the sum, the max
//                              taken over the sink too)
//   -> out [n, H * D] bf16     query i attends keys 0 .. past + i (causal; with a window from
//                              past + i - W + 1 on), GQA without repeats
//
// Why: sdpa's CPU flash attention ran 31-62 GFLOP/s on one thread here in bf16 (128-1024 tokens;
// 41 at 512, where it was 43 % of a prefill), far from the 470 of the bf16 matmul; and a chunk
// after a past needed its whole context gathered out of the pool first.
//
// How, per call:
//   1. K and V of the context are laid out once into the pairs `vdpbf16ps` multiplies: K per
//      tile of 16 keys as [D/2][16 keys x 2 dims], V per pair of keys as [D][2 keys]; one work
//      item per (KV head, tile). Keys past the context are zeros.
//   2. One work item per (KV head, 16 query positions), in an order that alternates long and
//      short items (causal: later positions see more keys) so that threads get equal work:
//      a. scores S = Q K^T for the item's rows (the group's query heads x 16 positions) in
//         register tiles of up to 8 rows x 32 keys: a broadcast query pair times 16 keys' pairs;
//      b. softmax per row in fp32 over its causal keys (the scale applied inside the exp, the
//         inline exp16 of kernel_common.h),
//         the probabilities rounded to bf16 (as GPU flash attention's P), their sum in fp32;
//      c. O = P V in register tiles of up to 4 rows (D = 64; 2 for 128, 1 for 256) x D, over pairs of keys,
//         divided by the row's sum, rounded to bf16 once.
// With a window, an item starts at the key tile of its first row's first key (steps a and c skip
// the tiles before it, step 1 those no row of the call sees) and step b zeroes a row's keys
// before its window.
// Head size 64, 128 or 256 (Gemma 3); elsewhere (another size, neither AVX512-BF16 nor AVX2) the op
// refuses and the engine keeps sdpa (engine.model_runner checks `prefill_attention_supported` first).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <vector>

#include "kernel_common.h"

namespace {

using namespace pdserve_cpu;

#if defined(PDSERVE_AVX512) || defined(PDSERVE_AVX2)
// Gemma 2's soft cap over a row's n raw scores s = q . k: s <- cap * tanh(scale * s / cap), and the
// scale the softmax's exp then applies (1: the scores are scaled already); without a cap (0) the
// scores stay raw and the exp scales them
inline float capped(float* s, int64_t n, float scale, float softcap) {
  if (softcap <= 0.f) return scale;
  for (int64_t k = 0; k < n; ++k) s[k] *= scale;
#ifdef PDSERVE_AVX512
  softcap16(s, n, softcap);
#else
  softcap8(s, n, softcap);
#endif
  return 1.f;
}

// A row's softmax max `m` over raw scores that exp scales by `exp_scale`, raised to the row's sink
// where there is one (in raw units), and the sink's term of the sum at that max
inline float with_sink(float& m, const float* sink, float exp_scale) {
  if (!sink) return 0.f;
  m = std::max(m, *sink / exp_scale);
  return std::exp(*sink - m * exp_scale);
}

struct Context {              // where one KV head's keys live, and the call's shapes
  const bf16* pool;
  const int64_t* table;
  int64_t block_size, block_stride, k_offset, v_offset, token_stride;
  const bf16* row(int64_t pos, int64_t h, int64_t dim) const {
    return pool + table[pos / block_size] * block_stride + (pos % block_size) * token_stride + h * dim;
  }
};
#endif

#ifdef PDSERVE_AVX512

// 2a. S[r, 16 t .. 16 t + 16) = q_r . k for key tiles [t0, t0 + NT) and R rows; `q[r]` the rows'
// queries as pairs, `kp` the head's key tiles (kPairs vectors of 16 keys each)
template <int kPairs, int R, int NT>
inline void score_tiles(const int32_t* const* q, const int32_t* kp, int64_t t0, float* s, int64_t width) {
  __m512 acc[R][NT];
  for (int r = 0; r < R; ++r) for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_setzero_ps();
  const int32_t* k = kp + t0 * kPairs * 16;
#pragma GCC unroll 4
  for (int j = 0; j < kPairs; ++j) {
    __m512bh kv[NT];
    for (int t = 0; t < NT; ++t) kv[t] = (__m512bh)_mm512_loadu_si512(k + (t * kPairs + j) * 16);
    for (int r = 0; r < R; ++r) {
      const __m512bh qb = (__m512bh)_mm512_set1_epi32(q[r][j]);
      for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], qb, kv[t]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) _mm512_storeu_ps(s + r * width + (t0 + t) * 16, acc[r][t]);
}

template <int kPairs, int R>
void score_rows(const int32_t* const* q, const int32_t* kp, int64_t t_begin, int64_t tiles, float* s, int64_t width) {
  int64_t t = t_begin;
  for (; t + 2 <= tiles; t += 2) score_tiles<kPairs, R, 2>(q, kp, t, s, width);
  if (t < tiles) score_tiles<kPairs, R, 1>(q, kp, t, s, width);
}

// 2c. out rows = P V / sum for R rows over `pairs` key pairs; `p[r]` the rows' probabilities as
// pairs, `vp` the head's value pairs ([pair][D] of 2 keys each)
template <int kDim, int R>
void value_rows(const int32_t* const* p, const int32_t* vp, int64_t pairs, const float* inv_sum, bf16* const* out) {
  constexpr int kVecs = kDim / 16;
  __m512 acc[R][kVecs];
  for (int r = 0; r < R; ++r) for (int c = 0; c < kVecs; ++c) acc[r][c] = _mm512_setzero_ps();
#pragma GCC unroll 2
  for (int64_t i = 0; i < pairs; ++i) {
    __m512bh v[kVecs];
    for (int c = 0; c < kVecs; ++c) v[c] = (__m512bh)_mm512_loadu_si512(vp + i * kDim + 16 * c);
    for (int r = 0; r < R; ++r) {
      const __m512bh pb = (__m512bh)_mm512_set1_epi32(p[r][i]);
      for (int c = 0; c < kVecs; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pb, v[c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kVecs; ++c)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out[r] + 16 * c),
                          round16(_mm512_mul_ps(acc[r][c], _mm512_set1_ps(inv_sum[r]))));
}

template <int kPairs> struct ScoreRows {
  template <int R> struct Rows {
    template <typename... A> static void run(A... a) { score_rows<kPairs, R>(a...); }
  };
};
template <int kDim> struct ValueRows {
  template <int R> struct Rows {
    template <typename... A> static void run(A... a) { value_rows<kDim, R>(a...); }
  };
};

template <int kDim>
void prefill_avx(const bf16* query, int64_t q_stride, const Context& ctx, int64_t n, int64_t past, int64_t heads,
                 int64_t kv_heads, float scale, int64_t window, float softcap, const float* sinks, bf16* out) {
  constexpr int kPairs = kDim / 2, kValueRows = kDim == 64 ? 4 : kDim == 128 ? 2 : 1;
  const int64_t group = heads / kv_heads, len = past + n, tiles = (len + 15) / 16;
  const int64_t seen_tile = first_key(past + 1, window) / 16;        // no row sees a key before it
  // 1. K as [head][tile][pair j][16 keys], V as [head][key pair][dim] (2 keys' bf16 each)
  // (uninitialized: every element of the tiles from seen_tile is written below, keys past the context as zeros)
  std::unique_ptr<int32_t[]> kp(new int32_t[kv_heads * tiles * kPairs * 16]), vp(new int32_t[kv_heads * tiles * 8 * kDim]);
  at::parallel_for(0, kv_heads * tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / tiles, t = item % tiles;
      if (t < seen_tile) continue;
      int32_t* kd = kp.get() + item * kPairs * 16;
      uint16_t* vd = reinterpret_cast<uint16_t*>(vp.get() + (h * tiles + t) * 8 * kDim);
      for (int i = 0; i < 16; ++i) {
        const int64_t pos = t * 16 + i;
        if (pos >= len) {
          for (int j = 0; j < kPairs; ++j) kd[j * 16 + i] = 0;
          for (int d = 0; d < kDim; ++d) vd[(i / 2) * 2 * kDim + 2 * d + i % 2] = 0;
          continue;
        }
        const bf16* row = ctx.row(pos, h, kDim);
        int32_t k32[kPairs];
        uint16_t v16[kDim];
        std::memcpy(k32, row + ctx.k_offset, sizeof(k32));
        std::memcpy(v16, row + ctx.v_offset, sizeof(v16));
        for (int j = 0; j < kPairs; ++j) kd[j * 16 + i] = k32[j];
        for (int d = 0; d < kDim; ++d) vd[(i / 2) * 2 * kDim + 2 * d + i % 2] = v16[d];
      }
    }
  });
  // 2. items (head, 16 query positions)
  const int64_t qtiles = (n + 15) / 16;
  at::parallel_for(0, kv_heads * qtiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s;
    std::vector<int32_t> probs;          // bf16 pairs
    std::vector<float> inv_sum;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item % kv_heads, z = item / kv_heads;
      const int64_t qt = z % 2 == 0 ? z / 2 : qtiles - 1 - z / 2;     // 0, last, 1, last - 1, ...
      const int64_t i0 = qt * 16, i1 = std::min(n, i0 + 16), rows = (i1 - i0) * group;
      const int64_t width = (past + i1 + 15) / 16 * 16;               // keys of the item's last row
      const int64_t ft = first_key(past + i0 + 1, window) / 16;        // the tile of its first row's first key
      s.resize(rows * width);
      probs.resize(rows * width / 2);
      inv_sum.resize(rows);
      const int32_t* kph = kp.get() + h * tiles * kPairs * 16;
      const int32_t* vph = vp.get() + h * tiles * 8 * kDim;
      // rows are position-major: row r is position i0 + r / group, query head h * group + r % group
      auto q_of = [&](int64_t r) {
        return reinterpret_cast<const int32_t*>(query + (i0 + r / group) * q_stride + (h * group + r % group) * kDim);
      };
      auto keys_of = [&](int64_t r) { return past + i0 + r / group + 1; };   // causal length
      // a. scores, 8 rows at a time over the key tiles their last row sees
      for (int64_t r0 = 0; r0 < rows; r0 += 8) {
        const int rr = static_cast<int>(std::min<int64_t>(8, rows - r0));
        const int32_t* q[8];
        for (int r = 0; r < rr; ++r) q[r] = q_of(r0 + r);
        with_rows<ScoreRows<kPairs>::template Rows>(rr, q, kph, ft, (keys_of(r0 + rr - 1) + 15) / 16,
                                                    s.data() + r0 * width, width);
      }
      // b. softmax per row: exp(scale (s - max)) over its keys lo .. keys - 1, zeros around them
      // (from the item's first tile), as bf16 pairs
      for (int64_t r = 0; r < rows; ++r) {
        float* sr = s.data() + r * width;
        const int64_t keys = keys_of(r), lo = first_key(keys, window);
        const float exp_scale = capped(sr + lo, keys - lo, scale, softcap);
        float m = std::numeric_limits<float>::lowest();
        for (int64_t k = lo; k < keys; ++k) m = std::max(m, sr[k]);
        const float sink = with_sink(m, sinks ? sinks + h * group + r % group : nullptr, exp_scale);
        inv_sum[r] = 1.f / (exp_and_sum(sr + lo, keys - lo, m, exp_scale) + sink);   // kernel_common.h (exp16, inline)
        for (int64_t k = ft * 16; k < lo; ++k) sr[k] = 0.f;      // before the window
        for (int64_t k = keys; k < width; ++k) sr[k] = 0.f;      // later rows of a tile read these
        uint16_t* pr = reinterpret_cast<uint16_t*>(probs.data() + r * width / 2);
        int64_t k = ft * 16;
        for (; k + 32 <= width; k += 32)
          _mm512_storeu_si512(pr + k, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(sr + k + 16), _mm512_loadu_ps(sr + k)));
        if (k < width)                  // width is a multiple of 16
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + k), round16(_mm512_loadu_ps(sr + k)));
      }
      // c. out = P V / sum, kValueRows rows at a time over the key pairs their last row sees
      for (int64_t r0 = 0; r0 < rows; r0 += kValueRows) {
        const int rr = static_cast<int>(std::min<int64_t>(kValueRows, rows - r0));
        const int32_t* p[kValueRows];
        bf16* o[kValueRows];
        for (int r = 0; r < rr; ++r) {
          p[r] = probs.data() + (r0 + r) * width / 2 + ft * 8;
          o[r] = out + ((i0 + (r0 + r) / group) * heads + h * group + (r0 + r) % group) * kDim;
        }
        with_rows<ValueRows<kDim>::template Rows, kValueRows>(rr, p, vph + ft * 8 * kDim,
                                                            (keys_of(r0 + rr - 1) + 1) / 2 - ft * 8,
                                                            inv_sum.data() + r0, o);
      }
    }
  });
}
#endif

#ifdef PDSERVE_AVX2
// The same steps on AVX2 + FMA (no bf16 products): K and V widened to fp32 in step 1 (K per tile
// of 8 keys as [D][8 keys], V as [key][D]), the item's queries widened once, scores in register
// tiles of up to 4 rows x 16 keys (a broadcast query element times 8 keys' elements), the
// probabilities kept in fp32 (not rounded to bf16 as on AVX512), O = P V in tiles of up to 3 rows x
// 32 dims summed into fp32 rows; the output rounded to bf16 once. Keys and dims in groups of 8
// instead of 16. Steps a and c run the item's rows over one block of keys at a time (16 KB of K or
// V in fp32, so it stays in L1 while every row reads it): fp32 K and V of a long context do not fit
// in L2 (2048 keys of one head: 512 KB each), and without the blocks 2048-token chunks ran at sdpa's
// speed.

// 2a. S[r, 8 t .. 8 t + 8) = q_r . k for key tiles [t0, t0 + NT) and R rows (fp32 queries)
template <int kDim, int R, int NT>
inline void score_tiles8(const float* const* q, const float* kp, int64_t t0, float* s, int64_t width) {
  __m256 acc[R][NT];
  PDSERVE_UNROLL for (int r = 0; r < R; ++r) PDSERVE_UNROLL for (int t = 0; t < NT; ++t) acc[r][t] = _mm256_setzero_ps();
  const float* k = kp + t0 * kDim * 8;
#pragma GCC unroll 4
  for (int d = 0; d < kDim; ++d) {
    __m256 kv[NT];
    PDSERVE_UNROLL for (int t = 0; t < NT; ++t) kv[t] = _mm256_loadu_ps(k + (t * kDim + d) * 8);
    PDSERVE_UNROLL for (int r = 0; r < R; ++r) {
      const __m256 qb = _mm256_broadcast_ss(q[r] + d);
      PDSERVE_UNROLL for (int t = 0; t < NT; ++t) acc[r][t] = _mm256_fmadd_ps(qb, kv[t], acc[r][t]);
    }
  }
  PDSERVE_UNROLL for (int r = 0; r < R; ++r)
    PDSERVE_UNROLL for (int t = 0; t < NT; ++t) _mm256_storeu_ps(s + r * width + (t0 + t) * 8, acc[r][t]);
}

template <int kDim, int R>
void score_rows8(const float* const* q, const float* kp, int64_t t_begin, int64_t tiles, float* s, int64_t width) {
  int64_t t = t_begin;
  for (; t + 2 <= tiles; t += 2) score_tiles8<kDim, R, 2>(q, kp, t, s, width);
  if (t < tiles) score_tiles8<kDim, R, 1>(q, kp, t, s, width);
}

// 2c. o[r] += P V for R rows over `keys` keys (o: the rows' fp32 sums, [D] each); `p[r]` the rows'
// probabilities from the block's first key, `vp` the block's values ([key][D] fp32)
template <int kDim, int R>
void value_rows8(const float* const* p, const float* vp, int64_t keys, float* const* o) {
  for (int c0 = 0; c0 < kDim; c0 += 32) {
    __m256 acc[R][4];
    PDSERVE_UNROLL for (int r = 0; r < R; ++r) PDSERVE_UNROLL for (int c = 0; c < 4; ++c) acc[r][c] = _mm256_loadu_ps(o[r] + c0 + 8 * c);
#pragma GCC unroll 2
    for (int64_t i = 0; i < keys; ++i) {      // 3 x 4 accumulators, 3 broadcasts and one V vector: 16 registers
      __m256 pb[R];
      PDSERVE_UNROLL for (int r = 0; r < R; ++r) pb[r] = _mm256_broadcast_ss(p[r] + i);
      PDSERVE_UNROLL for (int c = 0; c < 4; ++c) {
        const __m256 v = _mm256_loadu_ps(vp + i * kDim + c0 + 8 * c);
        PDSERVE_UNROLL for (int r = 0; r < R; ++r) acc[r][c] = _mm256_fmadd_ps(pb[r], v, acc[r][c]);
      }
    }
    PDSERVE_UNROLL for (int r = 0; r < R; ++r) PDSERVE_UNROLL for (int c = 0; c < 4; ++c) _mm256_storeu_ps(o[r] + c0 + 8 * c, acc[r][c]);
  }
}

template <int kDim> struct ScoreRows8 {
  template <int R> struct Rows {
    template <typename... A> static void run(A... a) { score_rows8<kDim, R>(a...); }
  };
};
template <int kDim> struct ValueRows8 {
  template <int R> struct Rows {
    template <typename... A> static void run(A... a) { value_rows8<kDim, R>(a...); }
  };
};

template <int kDim>
void prefill_avx2(const bf16* query, int64_t q_stride, const Context& ctx, int64_t n, int64_t past, int64_t heads,
                  int64_t kv_heads, float scale, int64_t window, float softcap, const float* sinks, bf16* out) {
  constexpr int64_t kTileBlock = 512 / kDim;     // key tiles whose K (or V) take 16 KB in fp32
  const int64_t group = heads / kv_heads, len = past + n, tiles = (len + 7) / 8;
  const int64_t seen_tile = first_key(past + 1, window) / 8;         // no row sees a key before it
  // 1. K as [head][tile][dim][8 keys], V as [head][key][dim], fp32 (tiles from seen_tile written
  // below, keys past the context as zeros)
  std::unique_ptr<float[]> kp(new float[kv_heads * tiles * 8 * kDim]), vp(new float[kv_heads * tiles * 8 * kDim]);
  at::parallel_for(0, kv_heads * tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / tiles, t = item % tiles;
      if (t < seen_tile) continue;
      float* kd = kp.get() + item * 8 * kDim;
      float* vd = vp.get() + item * 8 * kDim;          // keys t * 8 .. t * 8 + 7 of head h
      for (int i = 0; i < 8; ++i) {
        const int64_t pos = t * 8 + i;
        if (pos >= len) {
          for (int d = 0; d < kDim; ++d) kd[d * 8 + i] = 0.f;
          std::memset(vd + i * kDim, 0, kDim * sizeof(float));
          continue;
        }
        const bf16* row = ctx.row(pos, h, kDim);
        PDSERVE_UNROLL for (int d = 0; d < kDim; d += 8) {
          alignas(32) float k8[8];
          _mm256_store_ps(k8, load8(row + ctx.k_offset + d));
          for (int e = 0; e < 8; ++e) kd[(d + e) * 8 + i] = k8[e];
          _mm256_storeu_ps(vd + i * kDim + d, load8(row + ctx.v_offset + d));
        }
      }
    }
  });
  // 2. items (head, 16 query positions), long and short alternating
  const int64_t qtiles = (n + 15) / 16;
  at::parallel_for(0, kv_heads * qtiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s, qf, inv_sum, acc;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item % kv_heads, z = item / kv_heads;
      const int64_t qt = z % 2 == 0 ? z / 2 : qtiles - 1 - z / 2;     // 0, last, 1, last - 1, ...
      const int64_t i0 = qt * 16, i1 = std::min(n, i0 + 16), rows = (i1 - i0) * group;
      const int64_t width = (past + i1 + 7) / 8 * 8;                  // keys of the item's last row
      const int64_t ft = first_key(past + i0 + 1, window) / 8;         // the tile of its first row's first key
      s.resize(rows * width);
      qf.resize(rows * kDim);
      acc.resize(rows * kDim);
      inv_sum.resize(rows);
      const float* kph = kp.get() + h * tiles * 8 * kDim;
      const float* vph = vp.get() + h * tiles * 8 * kDim;
      // rows are position-major: row r is position i0 + r / group, query head h * group + r % group
      for (int64_t r = 0; r < rows; ++r) {
        const bf16* q = query + (i0 + r / group) * q_stride + (h * group + r % group) * kDim;
        PDSERVE_UNROLL for (int d = 0; d < kDim; d += 8) _mm256_storeu_ps(qf.data() + r * kDim + d, load8(q + d));
      }
      auto keys_of = [&](int64_t r) { return past + i0 + r / group + 1; };   // causal length
      // a. scores per block of kTileBlock key tiles (their K stays in L1), 4 rows at a time over the
      // block's tiles their last row sees
      const int64_t last_tile = (keys_of(rows - 1) + 7) / 8;
      for (int64_t tb = ft; tb < last_tile; tb += kTileBlock) {
        for (int64_t r0 = 0; r0 < rows; r0 += 4) {
          const int rr = static_cast<int>(std::min<int64_t>(4, rows - r0));
          const int64_t te = std::min(tb + kTileBlock, (keys_of(r0 + rr - 1) + 7) / 8);
          if (te <= tb) continue;
          const float* q[4];
          for (int r = 0; r < rr; ++r) q[r] = qf.data() + (r0 + r) * kDim;
          with_rows<ScoreRows8<kDim>::template Rows, 4>(rr, q, kph, tb, te, s.data() + r0 * width, width);
        }
      }
      // b. softmax per row over its keys lo .. keys - 1, zeros around them (from the item's first tile)
      for (int64_t r = 0; r < rows; ++r) {
        float* sr = s.data() + r * width;
        const int64_t keys = keys_of(r), lo = first_key(keys, window);
        const float exp_scale = capped(sr + lo, keys - lo, scale, softcap);
        __m256 mv = _mm256_set1_ps(std::numeric_limits<float>::lowest());
        int64_t k = lo;
        for (; k + 8 <= keys; k += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(sr + k));
        alignas(32) float m8[8];
        _mm256_store_ps(m8, mv);
        float m = *std::max_element(m8, m8 + 8);
        for (; k < keys; ++k) m = std::max(m, sr[k]);
        const float sink = with_sink(m, sinks ? sinks + h * group + r % group : nullptr, exp_scale);
        inv_sum[r] = 1.f / (exp_and_sum8(sr + lo, keys - lo, m, exp_scale) + sink);   // kernel_common.h (exp8, inline)
        for (int64_t j = ft * 8; j < lo; ++j) sr[j] = 0.f;      // before the window
        for (int64_t j = keys; j < width; ++j) sr[j] = 0.f;     // later rows of a tile read these
      }
      // c. out = P V / sum: per block of kTileBlock x 8 keys (their V stays in L1), 3 rows at a time
      // over the block's keys their last row sees, summed in fp32 rows; then scaled and rounded once
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t kb = ft * 8; kb < keys_of(rows - 1); kb += kTileBlock * 8) {
        for (int64_t r0 = 0; r0 < rows; r0 += 3) {
          const int rr = static_cast<int>(std::min<int64_t>(3, rows - r0));
          const int64_t ke = std::min(kb + kTileBlock * 8, keys_of(r0 + rr - 1));
          if (ke <= kb) continue;
          const float* p[3];
          float* o[3];
          for (int r = 0; r < rr; ++r) {
            p[r] = s.data() + (r0 + r) * width + kb;
            o[r] = acc.data() + (r0 + r) * kDim;
          }
          with_rows<ValueRows8<kDim>::template Rows, 3>(rr, p, vph + kb * kDim, ke - kb, o);
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        bf16* o = out + ((i0 + r / group) * heads + h * group + r % group) * kDim;
        const __m256 inv = _mm256_set1_ps(inv_sum[r]);
        PDSERVE_UNROLL for (int d = 0; d < kDim; d += 8)
          round_store8(o + d, _mm256_mul_ps(_mm256_loadu_ps(acc.data() + r * kDim + d), inv));
      }
    }
  });
}
#endif

bool prefill_attention_supported(int64_t head_dim) {
#if defined(PDSERVE_AVX512) || defined(PDSERVE_AVX2)
  return head_dim == 64 || head_dim == 128 || head_dim == 256;
#else
  (void)head_dim;
  return false;
#endif
}

at::Tensor paged_prefill_attention(const at::Tensor& query, const at::Tensor& pool, const at::Tensor& table,
                                   int64_t past, int64_t layer, double scale, int64_t window, double softcap,
                                   const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(query.device().is_cpu() && pool.device().is_cpu(), "paged_prefill_attention runs on CPU");
  TORCH_CHECK(query.dim() == 3 && pool.dim() == 6, "query [n, H, D], pool [blocks, layers, 2, bs, Hkv, D]");
  TORCH_CHECK(query.scalar_type() == at::kBFloat16 && pool.scalar_type() == at::kBFloat16,
              "paged_prefill_attention takes a bfloat16 query and pool");
  TORCH_CHECK(table.scalar_type() == at::kLong && table.dim() == 1 && table.is_contiguous(), "table: [blocks] int64");
  TORCH_CHECK(pool.is_contiguous(), "a contiguous pool");
  TORCH_CHECK(window >= 0, "window: 0 (every key) or the number of keys each query attends");
  TORCH_CHECK(softcap >= 0, "softcap: 0 (none) or the cap C of C * tanh(score / C)");
  const int64_t n = query.size(0), heads = query.size(1), dim = query.size(2);
  const int64_t layers = pool.size(1), block_size = pool.size(3), kv_heads = pool.size(4);
  TORCH_CHECK(prefill_attention_supported(dim), "paged_prefill_attention: head size ", dim,
              " is not built here (64, 128 or 256 with AVX512-BF16 or AVX2)");
  TORCH_CHECK(pool.size(5) == dim && heads % kv_heads == 0, "head shapes do not match the pool");
  TORCH_CHECK(0 <= layer && layer < layers, "layer out of range");
  TORCH_CHECK(!sinks || (sinks->scalar_type() == at::kFloat && sinks->numel() == heads && sinks->is_contiguous() &&
                         sinks->device().is_cpu()), "sinks: [H] float32, one per query head");
  const float* sink_ptr = sinks ? sinks->data_ptr<float>() : nullptr;
  TORCH_CHECK(past >= 0 && n > 0 && table.numel() * block_size >= past + n, "the table does not cover the context");
  const int64_t nblocks = pool.size(0);
  const int64_t* tp = table.data_ptr<int64_t>();
  for (int64_t i = 0; i < (past + n + block_size - 1) / block_size; ++i)
    TORCH_CHECK(0 <= tp[i] && tp[i] < nblocks, "block ", tp[i], " is not in the pool");
  at::Tensor q = query.stride(2) == 1 && query.stride(1) == dim ? query : query.contiguous();
  at::Tensor out = at::empty({n, heads * dim}, query.options());
#ifdef PDSERVE_AVX512
  const int64_t token_stride = kv_heads * dim, half = block_size * token_stride;
  const Context ctx{reinterpret_cast<const bf16*>(pool.data_ptr<at::BFloat16>()), tp, block_size,
                    layers * 2 * half, layer * 2 * half, layer * 2 * half + half, token_stride};
  const bf16* qp = reinterpret_cast<const bf16*>(q.data_ptr<at::BFloat16>());
  bf16* op = reinterpret_cast<bf16*>(out.data_ptr<at::BFloat16>());
  auto kernel = dim == 64 ? prefill_avx<64> : dim == 128 ? prefill_avx<128> : prefill_avx<256>;
  kernel(qp, q.stride(0), ctx, n, past, heads, kv_heads, static_cast<float>(scale), window,
         static_cast<float>(softcap), sink_ptr, op);
#elif defined(PDSERVE_AVX2)
  const int64_t token_stride = kv_heads * dim, half = block_size * token_stride;
  const Context ctx{reinterpret_cast<const bf16*>(pool.data_ptr<at::BFloat16>()), tp, block_size,
                    layers * 2 * half, layer * 2 * half, layer * 2 * half + half, token_stride};
  const bf16* qp = reinterpret_cast<const bf16*>(q.data_ptr<at::BFloat16>());
  bf16* op = reinterpret_cast<bf16*>(out.data_ptr<at::BFloat16>());
  auto kernel = dim == 64 ? prefill_avx2<64> : dim == 128 ? prefill_avx2<128> : prefill_avx2<256>;
  kernel(qp, q.stride(0), ctx, n, past, heads, kv_heads, static_cast<float>(scale), window,
         static_cast<float>(softcap), sink_ptr, op);
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("paged_prefill_attention(Tensor query, Tensor pool, Tensor table, int past, int layer, float scale, "
        "int window=0, float softcap=0.0, Tensor? sinks=None) -> Tensor");
  m.def("prefill_attention_supported(int head_dim) -> bool", &prefill_attention_supported);
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) {
  m.impl("paged_prefill_attention", &paged_prefill_attention);
}
