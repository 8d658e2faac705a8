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
//   -> out  [B, H * D]                        (same dtype as query)
// Softmax in fp32, two passes over the scores (max, then exp-sum), as sdpa's math.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

template <typename T, int64_t kDim>
void attend(const T* query, const T* pool, const int64_t* tables, const int64_t* lens, T* out,
            int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim, int64_t max_blocks,
            int64_t block_size, int64_t block_stride, int64_t k_offset, int64_t v_offset,
            int64_t token_stride, float scale) {
  const int64_t group = heads / kv_heads;
  if (kDim > 0) dim = kDim;   // a compile-time head size lets the compiler unroll and vectorize
  // One sequence per work item; each token's K (then V) row of all KV heads is read once, in
  // pool order (a block's rows are contiguous), and used by every query head of its group.
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(heads * dim), acc(heads * dim), row(dim), scores;
    for (int64_t b = begin; b < end; ++b) {
      const int64_t len = lens[b];
      const int64_t* table = tables + b * max_blocks;
      for (int64_t i = 0; i < heads * dim; ++i) q[i] = static_cast<float>(query[b * heads * dim + i]) * scale;
      scores.assign(heads * len, 0.f);
      // 1. scores[head, j] = q_head . k_j, a block at a time
      for (int64_t start = 0; start < len; start += block_size) {
        const T* k = pool + table[start / block_size] * block_stride + k_offset;
        const int64_t n = std::min(block_size, len - start);
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
      }
      // 2. softmax per query head
      for (int64_t head = 0; head < heads; ++head) {
        float* s = scores.data() + head * len;
        float m = std::numeric_limits<float>::lowest();
        for (int64_t j = 0; j < len; ++j) m = std::max(m, s[j]);
        float sum = 0.f;
        for (int64_t j = 0; j < len; ++j) { s[j] = std::exp(s[j] - m); sum += s[j]; }
        const float inv = 1.f / sum;
        for (int64_t j = 0; j < len; ++j) s[j] *= inv;
      }
      // 3. out_head = sum_j p[head, j] v_j
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t start = 0; start < len; start += block_size) {
        const T* v = pool + table[start / block_size] * block_stride + v_offset;
        const int64_t n = std::min(block_size, len - start);
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
      }
      for (int64_t i = 0; i < heads * dim; ++i) out[b * heads * dim + i] = static_cast<T>(acc[i]);
    }
  });
}

at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& pool, const at::Tensor& tables,
                                  const at::Tensor& lens, int64_t layer, double scale) {
  TORCH_CHECK(query.device().is_cpu() && pool.device().is_cpu(), "paged_decode_attention runs on CPU");
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
                    k_offset, v_offset, token_stride, static_cast<float>(scale));
  };
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
  m.def("paged_decode_attention(Tensor query, Tensor pool, Tensor tables, Tensor lens, int layer, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
}
