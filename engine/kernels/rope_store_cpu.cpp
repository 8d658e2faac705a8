// RoPE and the K/V store of a step in one pass (torch.ops.pdserve.rope_store), for the
// bf16 decoder on CPU; engine.attention.fused_attention calls it (steps whose attention all reads
// the pool in place: decode rows, and prompt chunks through the prefill kernel).
//
//   rope_store(qkv [T, (H + 2 Hkv) * D] bf16, cos [T, D], sin [T, D], pool, slots [T] int64,
//              layer, H, Hkv) -> q [T, H, D] bf16
//     q and k heads rotated (rotate-half RoPE: x * cos + rotate_half(x) * sin); the rotated k and
//     the v heads written into the pool (block-major [blocks, layers, 2, bs, Hkv, D], bf16) at
//     layer `layer`'s K and V rows of token slot `slots[t]` (the layer-0 K slot, see
//     engine.attention.token_slots); the rotated q returned.
//
// Why: at batch 1 the step's cost outside the linears is mostly per-op overhead, and RoPE plus
// the store were a dozen small ops per layer (slices, neg, cat, mul, add, two index_copy_) in
// place of this one. Math in fp32 from the bf16 inputs, rounded to bf16 once (the unfused bf16
// path rounds each product and the sum: this differs from it in the last bit at most). With
// AVX512 16 pairs at a time (the scalar loop did not vectorize through the bf16 conversions):
// SmolLM2's shapes (9 + 3 heads of 64), 1 / 32 / 256 tokens, 1 thread: 3.2 / 31 / 230 -> 2.3 / 3.9 /
// 17 us a call (/tmp micro-benchmark; 30 calls a step).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <cstring>
#include <vector>

#include "kernel_common.h"

namespace {

using namespace pdserve_cpu;

// One head's rotation: o[i] = a c[i] - b s[i], o[i + half] = b c[i + half] + a s[i + half] for
// a = in[i], b = in[i + half]. AVX512, half a multiple of 16: 16 pairs at a time from cos and sin
// already widened (`cw`, `sw`, fp32 [D]); AVX2 (half a multiple of 8) 8; the scalar loop elsewhere.
inline void rotate_head(const bf16* in, const float* cw, const float* sw, const bf16* c, const bf16* s, bf16* o,
                        int64_t half) {
#ifdef PDSERVE_AVX512
  if (half % 16 == 0) {
    for (int64_t i = 0; i < half; i += 16) {
      const __m512 a = load16(in + i), b = load16(in + half + i);
      const __m512 lo = _mm512_fmsub_ps(a, _mm512_loadu_ps(cw + i), _mm512_mul_ps(b, _mm512_loadu_ps(sw + i)));
      const __m512 hi = _mm512_fmadd_ps(b, _mm512_loadu_ps(cw + half + i), _mm512_mul_ps(a, _mm512_loadu_ps(sw + half + i)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + i), round16(lo));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + half + i), round16(hi));
    }
    return;
  }
#elif defined(PDSERVE_AVX2)
  if (half % 8 == 0) {                  // the same, 8 pairs at a time
    for (int64_t i = 0; i < half; i += 8) {
      const __m256 a = load8(in + i), b = load8(in + half + i);
      round_store8(o + i, _mm256_fmsub_ps(a, _mm256_loadu_ps(cw + i), _mm256_mul_ps(b, _mm256_loadu_ps(sw + i))));
      round_store8(o + half + i, _mm256_fmadd_ps(b, _mm256_loadu_ps(cw + half + i), _mm256_mul_ps(a, _mm256_loadu_ps(sw + half + i))));
    }
    return;
  }
#endif
  for (int64_t i = 0; i < half; ++i) {
    const float a = static_cast<float>(in[i]), b = static_cast<float>(in[i + half]);
    o[i] = static_cast<bf16>(a * static_cast<float>(c[i]) - b * static_cast<float>(s[i]));
    o[i + half] = static_cast<bf16>(b * static_cast<float>(c[i + half]) + a * static_cast<float>(s[i + half]));
  }
}

at::Tensor rope_store(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& pool,
                      const at::Tensor& slots, int64_t layer, int64_t heads, int64_t kv_heads) {
  TORCH_CHECK(qkv.device().is_cpu() && qkv.scalar_type() == at::kBFloat16 && qkv.dim() == 2 && qkv.is_contiguous(),
              "qkv: a contiguous [T, (H + 2 Hkv) * D] bf16 CPU tensor");
  TORCH_CHECK(pool.scalar_type() == at::kBFloat16 && pool.dim() == 6 && pool.is_contiguous(),
              "pool: the contiguous bf16 block-major pool [blocks, layers, 2, bs, Hkv, D]");
  const int64_t T = qkv.size(0), D = pool.size(5), bs = pool.size(3), layers = pool.size(1);
  TORCH_CHECK(heads > 0 && kv_heads == pool.size(4) && qkv.size(1) == (heads + 2 * kv_heads) * D && D % 2 == 0,
              "qkv's width is not (H + 2 Hkv) * D for the pool's heads");
  TORCH_CHECK(0 <= layer && layer < layers, "layer out of range");
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->is_contiguous() && t->numel() == T * D,
                "cos, sin: contiguous [T, D] bf16");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == T && slots.is_contiguous(), "slots: [T] int64");
  const int64_t rows = pool.numel() / (kv_heads * D);       // the pool as token rows of [Hkv, D]
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(0 <= sp[t] && sp[t] + (2 * layer + 1) * bs < rows, "slot out of the pool");
  at::Tensor q = at::empty({T, heads, D}, qkv.options());
  const bf16* xp = qkv.data_ptr<bf16>();
  const bf16* cp = cos.data_ptr<bf16>();
  const bf16* snp = sin.data_ptr<bf16>();
  bf16* qp = q.data_ptr<bf16>();
  bf16* pp = pool.data_ptr<bf16>();
  const int64_t width = qkv.size(1), half = D / 2, row = kv_heads * D;
  at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> cw(D), sw(D);                             // the token's cos and sin in fp32
    for (int64_t t = begin; t < end; ++t) {
      const bf16* x = xp + t * width;
      const bf16* c = cp + t * D;
      const bf16* s = snp + t * D;
      for (int64_t i = 0; i < D; ++i) { cw[i] = static_cast<float>(c[i]); sw[i] = static_cast<float>(s[i]); }
      bf16* k_dst = pp + (sp[t] + 2 * layer * bs) * row;
      for (int64_t h = 0; h < heads + kv_heads; ++h)              // q heads, then k heads
        rotate_head(x + h * D, cw.data(), sw.data(), c, s,
                    h < heads ? qp + (t * heads + h) * D : k_dst + (h - heads) * D, half);
      std::memcpy(k_dst + bs * row, x + (heads + kv_heads) * D, row * sizeof(bf16));   // v heads
    }
  });
  return q;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("rope_store(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) pool, Tensor slots, int layer, int heads, "
        "int kv_heads) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) {
  m.impl("rope_store", &rope_store);
}
