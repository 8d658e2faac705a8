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
//   softcap float                             (0: none; C > 0: scores capped to C * tanh(s / C) before
//                                              the softmax, Gemma 2's attn_logit_softcapping)
//   sinks   [H] fp32 or None                  (gpt-oss's attention sinks: a logit per query head that
//                                              joins the softmax with a zero value, adding exp(sink -
//                                              max) to its denominator; the max includes the sink)
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
//
// On AVX2 + FMA without AVX-512 (`attend_avx2`, session 20): the same gathering and prefetching in
// 8 fp32 lanes (bf16 rows widened exactly as they are loaded), with work items of a sequence and
// all its KV heads (from 2 sequences a thread; fewer: one KV head, as above) whose key and value
// tiles are taken for every head before the next, as the pool lies. Against the generic loop
// (SmolLM2's shapes, per cold layer, 1 x 1024 to 64 x 2048, two alternated runs): bf16 1.2-2.4x on
// 2 threads and 1.3-1.6x on 1, fp32 (1 thread) 1.0-1.17x; the real model's bf16 decode step at
// 32 x 512 0.83x on 2 threads, 0.86x on 1 (the README's "An AVX2-only CPU" has the runs).
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

namespace {

using namespace pdserve_cpu;

// How far ahead (tokens) the value rows are fetched during step 3, and the keys during step 1:
// values 16 -> 64 measured 0.90-0.97x per cold layer (8 x 256 to 64 x 2048, 1 thread; 32: between)
constexpr int64_t kValuesAhead = 64, kKeysAhead = 32;   // step 1 starts with keys 16-47 (kKeysAhead 32)

// s[0 .. len) <- softmax(s), in fp32: the max, then exp and sum, then the scaling; with a `sink`
// (gpt-oss) one more score in the max and the sum, whose probability is dropped
inline void softmax_in_place(float* s, int64_t len, const float* sink) {
  float m = sink ? *sink : std::numeric_limits<float>::lowest();
  for (int64_t j = 0; j < len; ++j) m = std::max(m, s[j]);
  float sum = sink ? std::exp(*sink - m) : 0.f;
  for (int64_t j = 0; j < len; ++j) { s[j] = std::exp(s[j] - m); sum += s[j]; }
  const float inv = 1.f / sum;
  for (int64_t j = 0; j < len; ++j) s[j] *= inv;
}

#if defined(PDSERVE_AVX512) || defined(PDSERVE_AVX2)
// keys[t], values[t] <- the K and V rows of positions first + t (t < last - first) of one sequence
// (`table`) and one KV head (`pool` offset to that head's columns), block by block
template <typename T>
void gather_rows(const T* pool, const int64_t* table, int64_t first, int64_t last, int64_t block_size,
                 int64_t block_stride, int64_t token_stride, int64_t k_offset, int64_t v_offset,
                 std::vector<const T*>& keys, std::vector<const T*>& values) {
  keys.resize(last - first);
  values.resize(last - first);
  for (int64_t pos = first, t = 0; pos < last; ) {
    const T* row = pool + table[pos / block_size] * block_stride + (pos % block_size) * token_stride;
    for (const int64_t stop = std::min(last, (pos / block_size + 1) * block_size); pos < stop;
         ++pos, ++t, row += token_stride) {
      keys[t] = row + k_offset;
      values[t] = row + v_offset;
    }
  }
}

// The first 64 keys and values of a work item (a sequence of `len` tokens; `pool` offset to the
// columns of its first KV head, `row_bytes` of each K and V row from there: one head's on AVX512,
// the item's heads side by side on AVX2), fetched from memory while the item before it computes: a step's pool
// rows are cold (the weights streamed through the caches since the last layer), and an item alone
// prefetches only within itself. At 32 x 48 tokens a cold layer took 128-149 -> 72-74 us, 64 x 48
// 247-261 -> 140, 32 x 256 503-533 -> 464-477 (AVX512, one thread, weights streamed between calls,
// alternated twice; /tmp script). Whole bf16 decode steps, rebuilt and alternated twice: batch 64
// 57.7, 62.0 -> 54.1, 52.9 ms, batch 8 and 32 within the noise (the last block of each sequence is
// warm from the K/V store)
template <typename T>
void prefetch_item_start(const T* pool, const int64_t* table, int64_t len, int64_t window, int64_t block_size,
                         int64_t block_stride, int64_t token_stride, int64_t k_offset, int64_t v_offset,
                         int64_t row_bytes) {
  const int64_t from = first_key(len, window), ahead = std::min<int64_t>(len, from + 64);
  for (int64_t pos = from; pos < ahead; ) {                  // block by block
    const T* row = pool + table[pos / block_size] * block_stride + (pos % block_size) * token_stride;
    for (const int64_t stop = std::min(ahead, (pos / block_size + 1) * block_size); pos < stop;
         ++pos, row += token_stride)
      for (int64_t j = 0; j < row_bytes; j += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(row + k_offset) + j, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(row + v_offset) + j, _MM_HINT_T0);
      }
  }
}
#endif

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
                int64_t window, float softcap, const float* sinks) {
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
      gather_rows(pool + h * kDim, table, first, lens[b], block_size, block_stride, token_stride, k_offset,
                  v_offset, keys, values);
      scores.resize(group * padded);
      // the next two items' first 64 keys and values, from memory, while this one computes
      for (int64_t next = item + 1; next < std::min(end, item + 3); ++next)
        prefetch_item_start(pool + (next % kv_heads) * kDim, tables + next / kv_heads * max_blocks,
                            lens[next / kv_heads], window, block_size, block_stride, token_stride, k_offset,
                            v_offset, kRowBytes);
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
        if (softcap > 0.f) {          // Gemma 2: capped scores (tanh is monotonic: the max's cap is theirs)
          softcap16(scores.data() + g * padded, len, softcap);
          maxes[g] = softcap1(maxes[g], softcap);
        }
        const float sink = sinks ? sinks[h * group + g] : 0.f;
        if (sinks) maxes[g] = std::max(maxes[g], sink);
        inv[g] = 1.f / (exp_and_sum(scores.data() + g * padded, len, maxes[g], 1.f) +
                        (sinks ? std::exp(sink - maxes[g]) : 0.f));
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

#ifdef PDSERVE_AVX2
// AVX2 + FMA: the AVX512 path's gathering and prefetching in 8 fp32 lanes (there is no bf16
// arithmetic: bf16 rows are widened exactly as they are loaded, every product and sum in fp32). A
// work item is a sequence and `span` of its KV heads (all of them from 2 sequences a thread, else
// one: a single sequence's heads spread over the threads), and each tile of keys or values is
// taken for all of the item's heads before the next: a token's rows of those heads lie side by
// side, so the pool is read as it lies. One KV head an item at a time over all its keys (a
// third of each row, strided) was 5-20 % slower per cold bf16 layer from 8 x 256 to 64 x 2048,
// and key-major tiles took step 1 alone on a cold fp32 pool at 64 x 1024 from 5.0-5.5 to 3.1 ms.
inline __m256 row8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 row8(const bf16* p) { return load8(p); }
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(bf16* p, __m256 v) { round_store8(p, v); }

// [sum of v[0]'s 8 lanes, ..., sum of v[7]'s]: two rounds of horizontal adds leave each vector's
// sums of lanes 0-3 and 4-7 side by side, one add of the two 128-bit halves finishes
inline __m256 reduce8(const __m256 v[8]) {
  const __m256 e = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 f = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(e, f, 0x20), _mm256_permute2f128_ps(e, f, 0x31));
}

inline float max8(__m256 v) {
  const __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 q = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(q, _mm_movehdup_ps(q)));
}

// Step 1 for 8 keys (t0 .. t0 + 7; those from len on score 0) and H query heads of each of `span`
// KV heads (`q`: head h's queries at q + h * q_stride, [H][kDim] fp32; `keys[t] + h * kDim`: its K
// row): scores[h * s_stride + g * padded + t0 + i] = scale * q . k, and most[h * m_stride + g] the
// running maximum of the valid scores. Key by key, each KV head in turn: a token's rows of the
// item's heads lie side by side and are read in order. Each is widened 32 dims at a time into 4
// registers and meets every query head from L1 (a memory operand of the FMA: H x kDim / 8 query
// vectors do not fit 16 registers), in two sums a head (half the FMA latency chain); the 8
// partial-sum vectors of a head (`part`: [span][H][8 keys][8 lanes]) are reduced together (reduce8).
template <typename T, int64_t kDim>
struct ScoresAvx2 {
  template <int H>
  struct Heads {
    static void run(const float* q, int64_t q_stride, const T* const* keys, int64_t span, int64_t t0, int64_t len,
                    int64_t padded, int64_t s_stride, float scale, float* scores, float* most, int64_t m_stride,
                    float* part) {
      const T* k[8];                  // past len: the last key again (its scores are masked to 0 below)
      for (int i = 0; i < 8; ++i) k[i] = keys[std::min(t0 + i, len - 1)];
      for (int i = 0; i < 8; ++i)
        for (int64_t h = 0; h < span; ++h) {
          __m256 acc[H][2];
          PDSERVE_UNROLL
          for (int g = 0; g < H; ++g) acc[g][0] = acc[g][1] = _mm256_setzero_ps();
          const T* kh = k[i] + h * kDim;
          const float* qh = q + h * q_stride;
          for (int d = 0; d < kDim; d += 32) {
            __m256 kv[4];
            PDSERVE_UNROLL
            for (int j = 0; j < 4; ++j) kv[j] = row8(kh + d + 8 * j);
            PDSERVE_UNROLL
            for (int g = 0; g < H; ++g)
              PDSERVE_UNROLL
              for (int j = 0; j < 4; ++j)
                acc[g][j & 1] = _mm256_fmadd_ps(kv[j], _mm256_loadu_ps(qh + g * kDim + d + 8 * j), acc[g][j & 1]);
          }
          PDSERVE_UNROLL
          for (int g = 0; g < H; ++g) _mm256_storeu_ps(part + ((h * H + g) * 8 + i) * 8, _mm256_add_ps(acc[g][0], acc[g][1]));
        }
      const __m256 valid = _mm256_castsi256_ps(lanes8(len - t0));
      const __m256 none = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
      for (int64_t h = 0; h < span; ++h)
        PDSERVE_UNROLL
        for (int g = 0; g < H; ++g) {
          __m256 sums[8];
          for (int i = 0; i < 8; ++i) sums[i] = _mm256_loadu_ps(part + ((h * H + g) * 8 + i) * 8);
          const __m256 sc = _mm256_and_ps(_mm256_mul_ps(reduce8(sums), _mm256_set1_ps(scale)), valid);
          _mm256_storeu_ps(scores + h * s_stride + g * padded + t0, sc);
          float& m = most[h * m_stride + g];
          m = std::max(m, max8(_mm256_blendv_ps(none, sc, valid)));
        }
    }
  };
};

// Where step 3 reads token t's value row of one KV head: fp32 rows staged in L1 (a fixed stride)
// or bf16 rows in the pool (one pointer a token, widened as they are loaded)
struct StagedRows {
  const float* base;
  int64_t stride;
  const float* operator()(int64_t t) const { return base + t * stride; }
};
struct PoolRows {
  const bf16* const* rows;
  int64_t offset;
  const bf16* operator()(int64_t t) const { return rows[t] + offset; }
};

// Step 3 for H query heads of one KV head over tokens [t0, t1): acc[g * kDim + d] += sum_t
// p[g * padded + t] v_t[d], v_t at rows(t). 24 dims at a time (the last 8 or 16 of a head size of
// 64, 128 or 256 in a pass of their own): at H = 3, 9 accumulators, 3 value vectors loaded once
// for the heads and a broadcast probability, 13 of the 16 registers, 2 loads per 3 FMAs.
template <int64_t kDim>
struct ValuesAvx2 {
  template <int W, int H, typename Rows>
  static void pass(const float* probs, int64_t padded, Rows rows, int64_t d, int64_t t0, int64_t t1, float* acc) {
    __m256 a[H][W];
    PDSERVE_UNROLL
    for (int g = 0; g < H; ++g)
      PDSERVE_UNROLL
      for (int j = 0; j < W; ++j) a[g][j] = _mm256_loadu_ps(acc + g * kDim + d + 8 * j);
    for (int64_t t = t0; t < t1; ++t) {
      __m256 v[W];
      PDSERVE_UNROLL
      for (int j = 0; j < W; ++j) v[j] = row8(rows(t) + d + 8 * j);
      PDSERVE_UNROLL
      for (int g = 0; g < H; ++g) {
        const __m256 p = _mm256_broadcast_ss(probs + g * padded + t);
        PDSERVE_UNROLL
        for (int j = 0; j < W; ++j) a[g][j] = _mm256_fmadd_ps(p, v[j], a[g][j]);
      }
    }
    PDSERVE_UNROLL
    for (int g = 0; g < H; ++g)
      PDSERVE_UNROLL
      for (int j = 0; j < W; ++j) _mm256_storeu_ps(acc + g * kDim + d + 8 * j, a[g][j]);
  }
  template <int H>
  struct Heads {
    template <typename Rows>
    static void run(const float* probs, int64_t padded, Rows rows, int64_t t0, int64_t t1, float* acc) {
      constexpr int64_t kWide = kDim / 24 * 24;
      for (int64_t d = 0; d < kWide; d += 24) pass<3, H>(probs, padded, rows, d, t0, t1, acc);
      if constexpr (kDim - kWide == 8) pass<1, H>(probs, padded, rows, kWide, t0, t1, acc);
      if constexpr (kDim - kWide == 16) pass<2, H>(probs, padded, rows, kWide, t0, t1, acc);
    }
  };
};

inline void prefetch_rows(const void* row, int64_t bytes) {
  for (int64_t j = 0; j < bytes; j += 64) _mm_prefetch(static_cast<const char*>(row) + j, _MM_HINT_T0);
}

template <typename T, int64_t kDim>
void attend_avx2(const T* query, const T* pool, const int64_t* tables, const int64_t* lens, T* out,
                 int64_t batch, int64_t heads, int64_t kv_heads, int64_t max_blocks, int64_t block_size,
                 int64_t block_stride, int64_t k_offset, int64_t v_offset, int64_t token_stride, float scale,
                 int64_t window, float softcap, const float* sinks) {
  constexpr int kScoreHeads = 8, kValueHeads = 3;   // query heads a pass of step 1 / step 3 takes
  const int64_t group = heads / kv_heads;
  const int64_t threads = at::get_num_threads();
  const int64_t span = threads > 1 && batch < 2 * threads ? 1 : kv_heads, parts = kv_heads / span;
  const int64_t row = span * kDim, row_bytes = row * sizeof(T);   // an item's K (or V) of one token
  // tokens a block of step 3 stages: 16 KB of fp32 rows (32 tokens of SmolLM2's 3 KV heads), 8-64
  const int64_t block = std::clamp<int64_t>(4096 / row, 8, 64);
  at::parallel_for(0, batch * parts, 1, [&](int64_t begin, int64_t end) {
    const int64_t rows = span * group;                   // the item's query heads
    std::vector<float> q(rows * kDim), acc(rows * kDim), scores, maxes(rows);
    std::vector<const T*> keys, values;
    std::vector<float> part(span * kScoreHeads * 8 * 8);
    std::vector<float> staged(block * row);
    for (int64_t item = begin; item < end; ++item) {
      // as attend_avx: key t is position first + t, `len` their count; KV heads h0 .. h0 + span - 1
      const int64_t b = item / parts, h0 = item % parts * span, first = first_key(lens[b], window);
      const int64_t len = lens[b] - first, padded = (len + 7) / 8 * 8;
      gather_rows(pool + h0 * kDim, tables + b * max_blocks, first, lens[b], block_size, block_stride, token_stride,
                  k_offset, v_offset, keys, values);
      scores.resize(rows * padded);
      for (int64_t next = item + 1; next < std::min(end, item + 3); ++next)
        prefetch_item_start(pool + next % parts * span * kDim, tables + next / parts * max_blocks, lens[next / parts],
                            window, block_size, block_stride, token_stride, k_offset, v_offset, row_bytes);
      const T* q0 = query + (b * heads + h0 * group) * kDim;
      for (int64_t i = 0; i < rows * kDim; i += 8) _mm256_storeu_ps(q.data() + i, row8(q0 + i));
      // 1. scores[r, t] = scale * q_r . k_t and their maxima, 8 keys at a time for every head
      std::fill(maxes.begin(), maxes.end(), -std::numeric_limits<float>::infinity());
      for (int64_t t0 = 0; t0 < len; t0 += 8) {
        // keys 32-40 ahead (the first tile: 8-40) while these 8 are summed
        for (int64_t t = t0 == 0 ? 8 : t0 + kKeysAhead; t < std::min(len, t0 + kKeysAhead + 8); ++t)
          prefetch_rows(keys[t], row_bytes);
        for (int64_t g0 = 0; g0 < group; g0 += kScoreHeads)
          with_rows<ScoresAvx2<T, kDim>::template Heads, kScoreHeads>(std::min<int64_t>(kScoreHeads, group - g0),
              static_cast<const float*>(q.data() + g0 * kDim), group * kDim, static_cast<const T* const*>(keys.data()),
              span, t0, len, padded, group * padded, scale, scores.data() + g0 * padded, maxes.data() + g0, group,
              part.data());
      }
      // 2. e[r, t] = exp(s - max) in place; 1 / their sum (in maxes) scales step 3's output
      for (int64_t r = 0; r < rows; ++r) {
        if (softcap > 0.f) {          // Gemma 2: capped scores, as attend_avx
          softcap8(scores.data() + r * padded, len, softcap);
          maxes[r] = softcap1(maxes[r], softcap);
        }
        const float sink = sinks ? sinks[h0 * group + r] : 0.f;        // row r: query head h0 * group + r
        if (sinks) maxes[r] = std::max(maxes[r], sink);
        maxes[r] = 1.f / (exp_and_sum8(scores.data() + r * padded, len, maxes[r], 1.f) +
                          (sinks ? std::exp(sink - maxes[r]) : 0.f));
      }
      // 3. out_r = (sum_t e[r, t] v_t) / sum, `block` tokens at a time, every query head's passes
      // over them. fp32 rows are first copied into `staged` in the order they lie: the passes
      // read a head's 24 dims of every token, an order the cold pool streamed from memory slowly
      // (values alone 4.4 -> 3.1 ms at 64 x 1024, 2 threads); bf16 rows, half the bytes, are
      // read in place (staged, the copy cost more than it saved)
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t0 = 0; t0 < len; t0 += block) {
        const int64_t t1 = std::min(len, t0 + block);
        for (int64_t t = t0; t < t1; ++t) {
          if (t + kValuesAhead < len) prefetch_rows(values[t + kValuesAhead], row_bytes);
          if constexpr (std::is_same_v<T, float>) std::memcpy(staged.data() + (t - t0) * row, values[t], row_bytes);
        }
        for (int64_t h = 0; h < span; ++h)
          for (int64_t g0 = 0; g0 < group; g0 += kValueHeads) {
            const int64_t r = h * group + g0, heads_now = std::min<int64_t>(kValueHeads, group - g0);
            const float* probs = scores.data() + r * padded;
            float* sums = acc.data() + r * kDim;
            if constexpr (std::is_same_v<T, float>)
              with_rows<ValuesAvx2<kDim>::template Heads, kValueHeads>(heads_now, probs + t0, padded,
                  StagedRows{staged.data() + h * kDim, row}, int64_t(0), t1 - t0, sums);
            else
              with_rows<ValuesAvx2<kDim>::template Heads, kValueHeads>(heads_now, probs, padded,
                  PoolRows{values.data(), h * kDim}, t0, t1, sums);
          }
      }
      T* o = out + (b * heads + h0 * group) * kDim;
      for (int64_t r = 0; r < rows; ++r) {
        const __m256 inv = _mm256_set1_ps(maxes[r]);
        for (int64_t d = 0; d < kDim; d += 8)
          store8(o + r * kDim + d, _mm256_mul_ps(_mm256_loadu_ps(acc.data() + r * kDim + d), inv));
      }
    }
  });
}
#endif

template <typename T, int64_t kDim>
void attend(const T* query, const T* pool, const int64_t* tables, const int64_t* lens, T* out,
            int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim, int64_t max_blocks,
            int64_t block_size, int64_t block_stride, int64_t k_offset, int64_t v_offset,
            int64_t token_stride, float scale, int64_t window, float softcap, const float* sinks) {
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
      // 2. softmax per query head (of the capped scores: Gemma 2)
      if (softcap > 0.f)
        for (float& s : scores) s = softcap1(s, softcap);
      for (int64_t head = 0; head < heads; ++head)
        softmax_in_place(scores.data() + head * len, len, sinks ? sinks + head : nullptr);
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
                                  const at::Tensor& lens, int64_t layer, double scale, int64_t window,
                                  double softcap, const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(query.device().is_cpu() && pool.device().is_cpu(), "paged_decode_attention runs on CPU");
  TORCH_CHECK(window >= 0, "window: 0 (every key) or the number of keys each query attends");
  TORCH_CHECK(softcap >= 0, "softcap: 0 (none) or the cap C of C * tanh(score / C)");
  TORCH_CHECK(query.dim() == 3 && pool.dim() == 6, "query [B, H, D], pool [blocks, layers, 2, bs, Hkv, D]");
  TORCH_CHECK(query.scalar_type() == pool.scalar_type(), "query and pool dtypes differ");
  TORCH_CHECK(tables.scalar_type() == at::kLong && lens.scalar_type() == at::kLong, "tables and lens are int64");
  TORCH_CHECK(pool.is_contiguous() && tables.is_contiguous() && lens.is_contiguous(), "contiguous inputs");
  const int64_t batch = query.size(0), heads = query.size(1), dim = query.size(2);
  const int64_t layers = pool.size(1), block_size = pool.size(3), kv_heads = pool.size(4);
  TORCH_CHECK(pool.size(5) == dim && heads % kv_heads == 0, "head shapes do not match the pool");
  TORCH_CHECK(0 <= layer && layer < layers, "layer out of range");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == batch && lens.numel() == batch, "one table and length per row");
  TORCH_CHECK(!sinks || (sinks->scalar_type() == at::kFloat && sinks->numel() == heads && sinks->is_contiguous() &&
                         sinks->device().is_cpu()), "sinks: [H] float32, one per query head");
  const float* sink_ptr = sinks ? sinks->data_ptr<float>() : nullptr;
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
                    k_offset, v_offset, token_stride, static_cast<float>(scale), window, static_cast<float>(softcap),
                    sink_ptr);
  };
#if defined(PDSERVE_AVX512) || defined(PDSERVE_AVX2)
  if (dim == 64 || dim == 128 || dim == 256) {
    auto fast = [&](auto tag) {
      using T = decltype(tag);
#ifdef PDSERVE_AVX512
      auto kernel = dim == 64 ? attend_avx<T, 64> : dim == 128 ? attend_avx<T, 128> : attend_avx<T, 256>;
#else
      auto kernel = dim == 64 ? attend_avx2<T, 64> : dim == 128 ? attend_avx2<T, 128> : attend_avx2<T, 256>;
#endif
      kernel(q.data_ptr<T>(), pool.data_ptr<T>(), tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(),
             out.data_ptr<T>(), batch, heads, kv_heads, tables.size(1), block_size, block_stride, k_offset,
             v_offset, token_stride, static_cast<float>(scale), window, static_cast<float>(softcap), sink_ptr);
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
        "int window=0, float softcap=0.0, Tensor? sinks=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
}
