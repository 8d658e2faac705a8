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
// path rounds each product and the sum: this differs from it in the last bit at most).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <cstring>

namespace {

using bf16 = c10::BFloat16;

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
    for (int64_t t = begin; t < end; ++t) {
      const bf16* x = xp + t * width;
      const bf16* c = cp + t * D;
      const bf16* s = snp + t * D;
      bf16* k_dst = pp + (sp[t] + 2 * layer * bs) * row;
      for (int64_t h = 0; h < heads + kv_heads; ++h) {            // q heads, then k heads
        const bf16* in = x + h * D;
        bf16* o = h < heads ? qp + (t * heads + h) * D : k_dst + (h - heads) * D;
        for (int64_t i = 0; i < half; ++i) {
          const float a = static_cast<float>(in[i]), b = static_cast<float>(in[i + half]);
          o[i] = static_cast<bf16>(a * static_cast<float>(c[i]) - b * static_cast<float>(s[i]));
          o[i + half] = static_cast<bf16>(b * static_cast<float>(c[i + half]) + a * static_cast<float>(s[i + half]));
        }
      }
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
