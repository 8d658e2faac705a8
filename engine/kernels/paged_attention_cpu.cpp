// Decode attention that reads K/V from the paged pool in place (CPU).
//
// Registered as torch.ops.pdserve.paged_decode_attention; engine/kernels/__init__.py builds and
// loads it (torch.utils.cpp_extension), engine/attention.py calls it. One query token per
// sequence; every query head of a KV head's group is computed against each key as it is read,
// so K/V heads are never repeated for GQA and nothing of size [batch, context] is copied.
//
//   query   [B, H, D]                         (fp32 or bf16, contiguous)
//   pool    [blocks, layers, 2, bs, Hkv, D]   (the engine's block-major KV pool, same dtype)
//   tables  [B, max_blocks] int64             (block tables, padded; only the first
//                                              ceil(len / bs) entries of a row are read)
//   lens    [B] int64                         (context length of each sequence, new token included)
//   window  int                               (0: every key; W > 0: a sliding-window layer, each
//                                              query attends its last W keys, itself included)
//   -> out  [B, H * D]                        (same dtype as query)
// Softmax in fp32: the max as the scores are stored, then exp (kernel_common.h exp16) and sum.
//
// Head size 64, 128 or 256 (Gemma 3) on AVX512-BF16 (`attend_avx`, bf16 and fp32): one work item per
// (sequence, KV head), so a single sequence's heads spread over the threads. Scores come 16
// keys at a time: each key's dot product with a query head (bf16: `vdpbf16ps`, exact products;
// fp32: FMA; sums in fp32) left in a vector of 16 partial sums, and the 16 vectors reduced together by a transpose
// (about 3 instructions per key instead of 10 for a reduction each); the scale is applied to the
// scores, and each head's maximum taken as they are stored. The output sums p * v with up to 24
// accumulators in registers (query heads of the group in chunks of a compile-time size): in fp32
// one FMA per token and 16 dims; in bf16 two tokens per `vdpbf16ps` against p rounded to bf16
// (`ValuesBf16`). Keys are prefetched 32-48 tokens ahead, values 64 (the pool's blocks lie
// anywhere in memory), and the next two items' first 64 tokens while an item computes. Measured against the generic loop below on SmolLM2's shapes (9
// heads, 3 KV heads, 64 dims, bf16, 2 threads; benchmarks/attention_bench.py): per layer
// 1.2x at 1 x 64 tokens, 2.2-2.9x from 8 x 256 to 64 x 2048 (the real model's decode step at
// 64 x 2048: 419 -> 180 ms); fp32, 1 thread: 1.4x at 1 x 64, 2.5-2.9x from 1 x 1024 to 64 x 2048.
// Session 10 (bf16 pairs in step 3, its accumulators out of the stack, the max with the scores,
// values 64 tokens ahead; the README's attention section has the table): bf16 per cold layer
// (`attention_bench.py --layers`) 0.70-0.87x on 1 thread, 0.78-0.98x on 2, from 1 x 1024 to 64 x 2048.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "kernel_common.h"

namespace {

using namespace pdserve_cpu;

// How far ahead (tokens) the value rows are fetched during step 3, and the keys during step 1:
// values 16 -> 64 measured 0.90-0.97x per cold layer (8 x 256 to 64 x 2048, 1 thread; 32: between)
constexpr int64_t kValuesAhead = 64, kKeysAhead = 32;   // step 1 starts with keys 16-47 (kKeysAhead 32)

// s[0 .. len) <- softmax(s), in fp32: the max, then exp and sum, then the scaling
inline void softmax_in_place(float* s, int64_t len) {
  float m = std::numeric_limits<float>::lowest();
  for (int64_t j = 0; j < len; ++j) m = std::max(m, s[j]);
  float sum = 0.f;
  for (int64_t j = 0; j < len; ++j) { s[j] = std::exp(s[j] - m); sum += s[j]; }
  const float inv = 1.f / sum;
  for (int64_t j = 0; j < len; ++j) s[j] *= inv;
}

#ifdef PDSERVE_AVX512
// out[i] = sum of the 16 lanes of v[i], for 16 vectors: three halving steps across and within
// 128-bit lanes, after which lane 4r + c holds the sum of v[r + 4c]; one permute restores order
inline __m512 reduce16(__m512 v[16]) {
  __m512 c[8], e[4], g[2];
  for (int i = 0; i < 8; ++i)      // [v2i's 8 partial sums, v2i+1's 8]
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)      // quarter r: v4i+r's 4 partial sums
    e[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)      // quarter r: v8i+r's 2 partial sums, then v8i+4+r's
    g[i] = _mm512_add_ps(_mm512_shuffle_ps(e[2 * i], e[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(e[2 * i], e[2 * i + 1], 0xEE));
  const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(g[0], g[1], 0x88), _mm512_shuffle_ps(g[0], g[1], 0xDD));
  const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  return _mm512_permutexvar_ps(order, sums);
}

// Per element type: a query head held in registers (bf16: pairs for `vdpbf16ps`), one key's dot
// product with it added to 16 lanes of partial sums, a value row as fp32, an output row stored
template <typename T, int64_t kDim> struct Elems;
template <int64_t kDim> struct Elems<bf16, kDim> {
  static constexpr int kQ = kDim / 32;
  using Q = __m512bh;
  static Q load_q(const bf16* p, int i) { return (__m512bh)_mm512_loadu_si512(p + 32 * i); }
  static __m512 dot(__m512 acc, const Q* q, const bf16* k) {
    for (int j = 0; j < kQ; ++j) acc = _mm512_dpbf16_ps(acc, q[j], (__m512bh)_mm512_loadu_si512(k + 32 * j));
    return acc;
  }
  static __m512 row16(const bf16* p) { return load16(p); }
  static void store16(bf16* o, __m512 v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), round16(v));
  }
};
template <int64_t kDim> struct Elems<float, kDim> {
  static constexpr int kQ = kDim / 16;
  using Q = __m512;
  static Q load_q(const float* p, int i) { return _mm512_loadu_ps(p + 16 * i); }
  static __m512 dot(__m512 acc, const Q* q, const float* k) {
    for (int j = 0; j < kQ; ++j) acc = _mm512_fmadd_ps(q[j], _mm512_loadu_ps(k + 16 * j), acc);
    return acc;
  }
  static __m512 row16(const float* p) { return _mm512_loadu_ps(p); }
  static void store16(float* o, __m512 v) { _mm512_storeu_ps(o, v); }
};

// Step 3 in fp32 (fp32 pools): out_g = sum_t p[g, t] v_t with one FMA per value vector, in token
// order. H (the query heads of this chunk) is a compile-time count so that the H x kDim / 16
// accumulators stay in registers (with a runtime count the compiler kept them on the stack).
template <int64_t kDim>
struct ValuesFp32 {
  template <int H>
  struct Heads {
    static void run(const float* probs, const float* const* values, int64_t len, int64_t padded, float* out) {
      constexpr int kVecs = kDim / 16, kRowBytes = kDim * 4;
      __m512 acc[H][kVecs];
      PDSERVE_UNROLL
      for (int g = 0; g < H; ++g) for (int j = 0; j < kVecs; ++j) acc[g][j] = _mm512_setzero_ps();
      for (int64_t t = 0; t < len; ++t) {
        if (t + kValuesAhead < len)
          for (int j = 0; j < kRowBytes; j += 64) _mm_prefetch(reinterpret_cast<const char*>(values[t + kValuesAhead]) + j, _MM_HINT_T0);
        __m512 v[kVecs];
        PDSERVE_UNROLL
        for (int j = 0; j < kVecs; ++j) v[j] = _mm512_loadu_ps(values[t] + 16 * j);
        PDSERVE_UNROLL
        for (int g = 0; g < H; ++g) {
          const __m512 p = _mm512_set1_ps(probs[g * padded + t]);
          PDSERVE_UNROLL
          for (int j = 0; j < kVecs; ++j) acc[g][j] = _mm512_fmadd_ps(p, v[j], acc[g][j]);
        }
      }
      PDSERVE_UNROLL
      for (int g = 0; g < H; ++g)
        for (int j = 0; j < kVecs; ++j) _mm512_storeu_ps(out + g * kDim + 16 * j, acc[g][j]);
    }
  };
};

template <int64_t kDim, int kHeadChunk>
void values_fp32(const float* probs, const float* const* values, int64_t len, int64_t padded, int64_t group,
                 float* out) {
  for (int64_t g0 = 0; g0 < group; g0 += kHeadChunk)
    with_rows<ValuesFp32<kDim>::template Heads, kHeadChunk>(std::min<int64_t>(kHeadChunk, group - g0),
        probs + g0 * padded, values, len, padded, out + g0 * kDim);
}

// Step 3 in bf16: the probabilities rounded to bf16 (`probs`, as the prefill kernel's P) and two
// tokens at a time in `vdpbf16ps`: their value rows interleaved (unpacklo/hi by 16 bits: the pairs
// of dims 8l .. 8l + 3, then 8l + 4 .. 8l + 7, of each 128-bit lane) meet a broadcast pair of
// probabilities, so a token pair costs one instruction per 16 outputs instead of two FMAs and the
// bf16 -> fp32 widening of both rows; the lane order is undone once at the end. H (the query heads
// of this chunk) is a compile-time count so that the H x kDim / 16 accumulators stay in registers.
template <int64_t kDim>
struct ValuesBf16 {
  template <int H>
  struct Heads {
    static void run(const bf16* probs, const bf16* const* values, int64_t len, int64_t padded, bf16* out) {
      constexpr int kHalves = kDim / 32, kRowBytes = kDim * 2;   // 512-bit vectors per value row
      const __m512i first = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
      const __m512i second = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
      __m512 acc[H][2 * kHalves];
      PDSERVE_UNROLL
      for (int g = 0; g < H; ++g) for (int j = 0; j < 2 * kHalves; ++j) acc[g][j] = _mm512_setzero_ps();
      for (int64_t t = 0; t < len; t += 2) {
        if (t + kValuesAhead + 1 < len)
          for (int j = 0; j < kRowBytes; j += 64) {
            _mm_prefetch(reinterpret_cast<const char*>(values[t + kValuesAhead]) + j, _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(values[t + kValuesAhead + 1]) + j, _MM_HINT_T0);
          }
        const bf16* va = values[t];
        const bf16* vb = t + 1 < len ? values[t + 1] : va;   // its probability is 0
        __m512bh lo[kHalves], hi[kHalves];
        PDSERVE_UNROLL
        for (int j = 0; j < kHalves; ++j) {
          const __m512i a = _mm512_loadu_si512(va + 32 * j), b = _mm512_loadu_si512(vb + 32 * j);
          lo[j] = (__m512bh)_mm512_unpacklo_epi16(a, b);
          hi[j] = (__m512bh)_mm512_unpackhi_epi16(a, b);
        }
        PDSERVE_UNROLL
        for (int g = 0; g < H; ++g) {
          int32_t two;
          std::memcpy(&two, probs + g * padded + t, 4);
          const __m512bh p = (__m512bh)_mm512_set1_epi32(two);
          PDSERVE_UNROLL
          for (int j = 0; j < kHalves; ++j) {
            acc[g][2 * j] = _mm512_dpbf16_ps(acc[g][2 * j], p, lo[j]);
            acc[g][2 * j + 1] = _mm512_dpbf16_ps(acc[g][2 * j + 1], p, hi[j]);
          }
        }
      }
      PDSERVE_UNROLL
      for (int g = 0; g < H; ++g)
        for (int j = 0; j < kHalves; ++j) {
          bf16* o = out + g * kDim + 32 * j;
          const __m512 l = acc[g][2 * j], h = acc[g][2 * j + 1];
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), round16(_mm512_permutex2var_ps(l, first, h)));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 16), round16(_mm512_permutex2var_ps(l, second, h)));
        }
    }
  };
};

// `scores`: step 2's exp(s - max) per query head (0 past len), `inv`: 1 / their sums. p = exp * inv
// rounded to bf16 into `probs`, then the query heads in chunks of kHeadChunk.
template <int64_t kDim, int kHeadChunk>
void values_bf16(const float* scores, const float* inv, std::vector<bf16>& probs, const bf16* const* values,
                 int64_t len, int64_t padded, int64_t group, bf16* out) {
  probs.resize(group * padded);
  for (int64_t g = 0; g < group; ++g) {
    const __m512 scale = _mm512_set1_ps(inv[g]);
    for (int64_t t = 0; t < padded; t += 16) {             // past len: 0, so pairs end in 0
      const __mmask16 valid = lanes16(len - t);
      const __m512 p = _mm512_maskz_mul_ps(valid, _mm512_loadu_ps(scores + g * padded + t), scale);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(probs.data() + g * padded + t), round16(p));
    }
  }
  for (int64_t g0 = 0; g0 < group; g0 += kHeadChunk)
    with_rows<ValuesBf16<kDim>::template Heads, kHeadChunk>(std::min<int64_t>(kHeadChunk, group - g0),
        static_cast<const bf16*>(probs.data() + g0 * padded), values, len, padded, out + g0 * kDim);
}

template <typename T, int64_t kDim>
void attend_avx(const T* query, const T* pool, const int64_t* tables, const int64_t* lens, T* out,
                int64_t batch, int64_t heads, int64_t kv_heads, int64_t max_blocks, int64_t block_size,
                int64_t block_stride, int64_t k_offset, int64_t v_offset, int64_t token_stride, float scale,
                int64_t window) {
  using E = Elems<T, kDim>;
  constexpr int kVecs = kDim / 16, kRowBytes = kDim * sizeof(T);
  constexpr int kHeadChunk = 24 / kVecs;      // query heads whose outputs fit 24 registers
  const int64_t group = heads / kv_heads;
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, maxes(group), inv(group);
    std::vector<bf16> probs;
    std::vector<const T*> keys, values;
    for (int64_t item = begin; item < end; ++item) {
      // the item's keys are positions first .. lens[b] - 1 (all of them without a window); below,
      // key t is position first + t and `len` their count
      const int64_t b = item / kv_heads, h = item % kv_heads, first = first_key(lens[b], window);
      const int64_t len = lens[b] - first, padded = (len + 15) / 16 * 16;
      const int64_t* table = tables + b * max_blocks;
      keys.resize(len);
      values.resize(len);
      for (int64_t pos = first, t = 0; pos < lens[b]; ) {
        const T* row = pool + table[pos / block_size] * block_stride + (pos % block_size) * token_stride + h * kDim;
        for (const int64_t stop = std::min(lens[b], (pos / block_size + 1) * block_size); pos < stop;
             ++pos, ++t, row += token_stride) {
          keys[t] = row + k_offset;
          values[t] = row + v_offset;
        }
      }
      scores.resize(group * padded);
      // the next two items' first 64 keys and values, from memory, while this one computes: a
      // step's pool rows are cold (the weights streamed through the caches since the last
      // layer), and an item alone prefetches only within itself. At 32 x 48 tokens a cold
      // layer took 128-149 -> 72-74 us, 64 x 48 247-261 -> 140, 32 x 256 503-533 -> 464-477
      // (one thread, weights streamed between calls, alternated twice; /tmp script). Whole bf16
      // decode steps, rebuilt and alternated twice: batch 64 57.7, 62.0 -> 54.1, 52.9 ms, batch
      // 8 and 32 within the noise (the last block of each sequence is warm from the K/V store)
      for (int64_t next = item + 1; next < std::min(end, item + 3); ++next) {
        const int64_t nb = next / kv_heads, nh = next % kv_heads;
        const int64_t* nt = tables + nb * max_blocks;
        const int64_t from = first_key(lens[nb], window), ahead = std::min<int64_t>(lens[nb], from + 64);
        for (int64_t pos = from; pos < ahead; ) {                  // block by block
          const T* row = pool + nt[pos / block_size] * block_stride + (pos % block_size) * token_stride + nh * kDim;
          for (const int64_t stop = std::min(ahead, (pos / block_size + 1) * block_size); pos < stop;
               ++pos, row += token_stride)
            for (int j = 0; j < kRowBytes; j += 64) {
              _mm_prefetch(reinterpret_cast<const char*>(row + k_offset) + j, _MM_HINT_T0);
              _mm_prefetch(reinterpret_cast<const char*>(row + v_offset) + j, _MM_HINT_T0);
            }
        }
      }
      const T* q0 = query + (b * heads + h * group) * kDim;
      // 1. scores[g, t] = scale * q_g . k_t, 16 keys at a time
      for (int64_t g = 0; g < group; ++g) {
        typename E::Q q[E::kQ];
        for (int i = 0; i < E::kQ; ++i) q[i] = E::load_q(q0 + g * kDim, i);
        __m512 most = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
        for (int64_t t0 = 0; t0 < len; t0 += 16) {
          __m512 part[16];
          if (g == 0)                  // keys 32-48 ahead, from memory, while these 16 are summed
            for (int64_t t = t0 == 0 ? 16 : t0 + kKeysAhead; t < std::min(len, t0 + kKeysAhead + 16); ++t)
              for (int j = 0; j < kRowBytes; j += 64) _mm_prefetch(reinterpret_cast<const char*>(keys[t]) + j, _MM_HINT_T0);
          for (int i = 0; i < 16; ++i) {
            part[i] = _mm512_setzero_ps();
            if (t0 + i < len) part[i] = E::dot(part[i], q, keys[t0 + i]);
          }
          const __m512 sc = _mm512_mul_ps(reduce16(part), _mm512_set1_ps(scale));
          _mm512_storeu_ps(scores.data() + g * padded + t0, sc);     // 0 past len
          const __mmask16 valid = lanes16(len - t0);
          most = _mm512_mask_max_ps(most, valid, most, sc);
        }
        maxes[g] = _mm512_reduce_max_ps(most);
      }
      // 2. softmax per query head over the len scores: exp(s - max) and its sum here (the max came
      // with the scores), the division where step 3 reads them (bf16) or in place (fp32)
      for (int64_t g = 0; g < group; ++g) {
        inv[g] = 1.f / exp_and_sum(scores.data() + g * padded, len, maxes[g], 1.f);
        if constexpr (!std::is_same_v<T, bf16>)
          for (int64_t t = 0; t < len; ++t) scores[g * padded + t] *= inv[g];
      }
      // 3. out_g = sum_t p[g, t] v_t, kHeadChunk query heads at a time
      if constexpr (std::is_same_v<T, bf16>)
        values_bf16<kDim, kHeadChunk>(scores.data(), inv.data(), probs, values.data(), len, padded, group,
                                      out + (b * heads + h * group) * kDim);
      else
        values_fp32<kDim, kHeadChunk>(scores.data(), values.data(), len, padded, group,
                                      out + (b * heads + h * group) * kDim);
    }
  });
}
#endif

template <typename T, int64_t kDim>
void attend(const T* query, const T* pool, const int64_t* tables, const int64_t* lens, T* out,
            int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim, int64_t max_blocks,
            int64_t block_size, int64_t block_stride, int64_t k_offset, int64_t v_offset,
            int64_t token_stride, float scale, int64_t window) {
  const int64_t group = heads / kv_heads;
  if (kDim > 0) dim = kDim;   // a compile-time head size lets the compiler unroll and vectorize
  // One sequence per work item; each token's K (then V) row of all KV heads is read once, in
  // pool order (a block's rows are contiguous), and used by every query head of its group.
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(heads * dim), acc(heads * dim), row(dim), scores;
    for (int64_t b = begin; b < end; ++b) {
      // keys: positions first .. lens[b] - 1; score j is position first + j
      const int64_t first = first_key(lens[b], window), len = lens[b] - first;
      const int64_t* table = tables + b * max_blocks;
      for (int64_t i = 0; i < heads * dim; ++i) q[i] = static_cast<float>(query[b * heads * dim + i]) * scale;
      scores.assign(heads * len, 0.f);
      // 1. scores[head, j] = q_head . k_j, a block at a time
      for (int64_t start = 0; start < len; ) {
        const int64_t pos = first + start, n = std::min(block_size - pos % block_size, len - start);
        const T* k = pool + table[pos / block_size] * block_stride + (pos % block_size) * token_stride + k_offset;
        for (int64_t t = 0; t < n; ++t, k += token_stride) {
          for (int64_t h = 0; h < kv_heads; ++h) {
            for (int64_t d = 0; d < dim; ++d) row[d] = static_cast<float>(k[h * dim + d]);
            for (int64_t g = 0; g < group; ++g) {
              const float* qh = q.data() + (h * group + g) * dim;
              float s = 0.f;
              for (int64_t d = 0; d < dim; ++d) s += qh[d] * row[d];
              scores[(h * group + g) * len + start + t] = s;
            }
          }
        }
        start += n;
      }
      // 2. softmax per query head
      for (int64_t head = 0; head < heads; ++head) softmax_in_place(scores.data() + head * len, len);
      // 3. out_head = sum_j p[head, j] v_j
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t start = 0; start < len; ) {
        const int64_t pos = first + start, n = std::min(block_size - pos % block_size, len - start);
        const T* v = pool + table[pos / block_size] * block_stride + (pos % block_size) * token_stride + v_offset;
        for (int64_t t = 0; t < n; ++t, v += token_stride) {
          for (int64_t h = 0; h < kv_heads; ++h) {
            for (int64_t d = 0; d < dim; ++d) row[d] = static_cast<float>(v[h * dim + d]);
            for (int64_t g = 0; g < group; ++g) {
              const float p = scores[(h * group + g) * len + start + t];
              float* a = acc.data() + (h * group + g) * dim;
              for (int64_t d = 0; d < dim; ++d) a[d] += p * row[d];
            }
          }
        }
        start += n;
      }
      for (int64_t i = 0; i < heads * dim; ++i) out[b * heads * dim + i] = static_cast<T>(acc[i]);
    }
  });
}

at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& pool, const at::Tensor& tables,
                                  const at::Tensor& lens, int64_t layer, double scale, int64_t window) {
  TORCH_CHECK(query.device().is_cpu() && pool.device().is_cpu(), "paged_decode_attention runs on CPU");
  TORCH_CHECK(window >= 0, "window: 0 (every key) or the number of keys each query attends");
  TORCH_CHECK(query.dim() == 3 && pool.dim() == 6, "query [B, H, D], pool [blocks, layers, 2, bs, Hkv, D]");
  TORCH_CHECK(query.scalar_type() == pool.scalar_type(), "query and pool dtypes differ");
  TORCH_CHECK(tables.scalar_type() == at::kLong && lens.scalar_type() == at::kLong, "tables and lens are int64");
  TORCH_CHECK(pool.is_contiguous() && tables.is_contiguous() && lens.is_contiguous(), "contiguous inputs");
  const int64_t batch = query.size(0), heads = query.size(1), dim = query.size(2);
  const int64_t layers = pool.size(1), block_size = pool.size(3), kv_heads = pool.size(4);
  TORCH_CHECK(pool.size(5) == dim && heads % kv_heads == 0, "head shapes do not match the pool");
  TORCH_CHECK(0 <= layer && layer < layers, "layer out of range");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == batch && lens.numel() == batch, "one table and length per row");
  at::Tensor q = query.contiguous();
  at::Tensor out = at::empty({batch, heads * dim}, query.options());
  const int64_t token_stride = kv_heads * dim;
  const int64_t half = block_size * token_stride;            // one of K or V of one layer in a block
  const int64_t block_stride = layers * 2 * half;
  const int64_t k_offset = layer * 2 * half, v_offset = k_offset + half;
  auto run = [&](auto tag, auto dim_tag) {
    using T = decltype(tag);
    constexpr int64_t kDim = decltype(dim_tag)::value;
    attend<T, kDim>(q.data_ptr<T>(), pool.data_ptr<T>(), tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(),
                    out.data_ptr<T>(), batch, heads, kv_heads, dim, tables.size(1), block_size, block_stride,
                    k_offset, v_offset, token_stride, static_cast<float>(scale), window);
  };
#ifdef PDSERVE_AVX512
  if (dim == 64 || dim == 128 || dim == 256) {
    auto fast = [&](auto tag) {
      using T = decltype(tag);
      auto kernel = dim == 64 ? attend_avx<T, 64> : dim == 128 ? attend_avx<T, 128> : attend_avx<T, 256>;
      kernel(q.data_ptr<T>(), pool.data_ptr<T>(), tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(),
             out.data_ptr<T>(), batch, heads, kv_heads, tables.size(1), block_size, block_stride, k_offset,
             v_offset, token_stride, static_cast<float>(scale), window);
    };
    if (query.scalar_type() == at::kBFloat16) { fast(bf16{}); return out; }
    if (query.scalar_type() == at::kFloat) { fast(float{}); return out; }
  }
#endif
  auto by_dim = [&](auto tag) {
    if (dim == 64) run(tag, std::integral_constant<int64_t, 64>{});
    else if (dim == 128) run(tag, std::integral_constant<int64_t, 128>{});
    else run(tag, std::integral_constant<int64_t, 0>{});
  };
  if (query.scalar_type() == at::kFloat) {
    by_dim(float{});
  } else if (query.scalar_type() == at::kBFloat16) {
    by_dim(c10::BFloat16{});
  } else {
    TORCH_CHECK(false, "paged_decode_attention supports float32 and bfloat16, got ", query.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(pdserve, m) {
  m.def("paged_decode_attention(Tensor query, Tensor pool, Tensor tables, Tensor lens, int layer, float scale, "
        "int window=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
}
