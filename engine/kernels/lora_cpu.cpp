// A LoRA adapter's update of one linear, added in place (torch.ops.pdserve.lora_add_), for a
// bf16 model's steps of few rows on CPU (engine/lora.py's LoraBatch.add):
//
//   lora_add_(out [N, W] bf16 or fp32, x [N, in] same dtype, a [R, in] fp32, b_t [R, W] fp32,
//             rows [n] int64 or None)
//
// for each row r of `rows` (every row when None): out[r] += (a x[r]) b_t, in fp32 and rounded once
// where it is added: what `out.index_add_(0, rows, (F.linear(x[rows].float(), a) @ b_t).to(out))`
// computes (up to the order of the fp32 sums), in one op instead of four or five, row by row (each
// row reads `a` and `b_t` again: from 16 rows torch's products, which reuse them, are the faster;
// engine/lora.py calls this below KERNEL_BELOW rows). At one row, SmolLM2's q/k/v update at rank 16:
// 7.0 against 14.4 us through torch's ops; at 8 rows about equal, at 32 rows 93 against 55. `b_t`
// holds the adapter's B matrices block-diagonally (each part of a fused linear its own columns,
// zeros elsewhere), scaled.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <vector>

namespace {

using bf16 = c10::BFloat16;

// one row: t = a x (R dot products), then out += t b_t, kChunk columns at a time
template <typename T>
void lora_row(const T* x, int64_t in, const float* a, int64_t rank, const float* bt, int64_t width, T* out) {
  std::vector<float> xf(in), t(rank);
  for (int64_t i = 0; i < in; ++i) xf[i] = static_cast<float>(x[i]);
  for (int64_t k = 0; k < rank; ++k) {
    const float* ak = a + k * in;
    float s = 0.f;
    for (int64_t i = 0; i < in; ++i) s += ak[i] * xf[i];
    t[k] = s;
  }
  constexpr int64_t kChunk = 256;
  float acc[kChunk];
  for (int64_t w0 = 0; w0 < width; w0 += kChunk) {
    const int64_t n = std::min(kChunk, width - w0);
    std::fill(acc, acc + n, 0.f);
    for (int64_t k = 0; k < rank; ++k) {
      const float tk = t[k];
      const float* bk = bt + k * width + w0;
      for (int64_t w = 0; w < n; ++w) acc[w] += tk * bk[w];
    }
    for (int64_t w = 0; w < n; ++w) out[w0 + w] = static_cast<T>(static_cast<float>(out[w0 + w]) + acc[w]);
  }
}

template <typename T>
void lora_rows(at::Tensor& out, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b_t,
               const int64_t* rows, int64_t n) {
  const int64_t in = x.size(1), rank = a.size(0), width = out.size(1);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const float* ap = a.data_ptr<float>();
  const float* bp = b_t.data_ptr<float>();
  // a row costs rank * (in + width) multiply-adds: threads only for several rows
  at::parallel_for(0, n, 4, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const int64_t r = rows ? rows[j] : j;
      lora_row<T>(xp + r * in, in, ap, rank, bp, width, op + r * width);
    }
  });
}

void lora_add_(at::Tensor out, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b_t,
               const c10::optional<at::Tensor>& rows) {
  TORCH_CHECK(out.device().is_cpu() && out.dim() == 2 && out.is_contiguous(), "out: a contiguous [N, W] CPU tensor");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(0) == out.size(0) && x.scalar_type() == out.scalar_type(),
              "x: a contiguous [N, in] tensor of out's dtype");
  TORCH_CHECK(out.scalar_type() == at::kBFloat16 || out.scalar_type() == at::kFloat, "out: bf16 or fp32");
  TORCH_CHECK(a.scalar_type() == at::kFloat && b_t.scalar_type() == at::kFloat && a.is_contiguous() &&
              b_t.is_contiguous() && a.dim() == 2 && b_t.dim() == 2, "a, b_t: contiguous fp32 matrices");
  TORCH_CHECK(a.size(1) == x.size(1) && b_t.size(0) == a.size(0) && b_t.size(1) == out.size(1),
              "a [R, in], b_t [R, W] must fit x [N, in] and out [N, W]");
  const int64_t* rp = nullptr;
  int64_t n = out.size(0);
  at::Tensor idx;
  if (rows.has_value()) {
    idx = rows->contiguous();
    TORCH_CHECK(idx.scalar_type() == at::kLong && idx.dim() == 1, "rows: int64 indices");
    rp = idx.data_ptr<int64_t>();
    n = idx.size(0);
    for (int64_t j = 0; j < n; ++j) TORCH_CHECK(rp[j] >= 0 && rp[j] < out.size(0), "rows: index out of range");
  }
  if (out.scalar_type() == at::kBFloat16) {
    lora_rows<bf16>(out, x, a, b_t, rp, n);
  } else {
    lora_rows<float>(out, x, a, b_t, rp, n);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("lora_add_(Tensor(a!) out, Tensor x, Tensor a, Tensor b_t, Tensor? rows) -> ()");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) {
  m.impl("lora_add_", &lora_add_);
}
