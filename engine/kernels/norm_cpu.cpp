// RMSNorm for the decoder's bf16 path on CPU (torch.ops.pdserve.rms_norm / add_rms_norm).
//
// At small batch a decode step is dominated by per-op cost, and aten's rms_norm on bf16 runs
// several ops per call (tens of microseconds for one 576-wide row). These do one pass:
//   rms_norm(x [T, H], w [H], eps)            -> x * rsqrt(mean(x^2) + eps) * w
//   add_rms_norm(x [T, H], d [T, H], w, eps)  -> (x + d, rms_norm(x + d, w, eps))
// Math as F.rms_norm(x, (H,), w, eps) on bf16: accumulate in fp32, scale by the weight in fp32,
// round once; the residual sum is rounded to the input dtype first, as torch's `x + d` is. The
// weight is in x's dtype or, for bf16 x, float32 (Gemma's 1 + weight, which bf16 would round).
// bf16 with AVX512-BF16: 16 elements at a time (bf16 -> fp32 exactly, round-to-nearest-even back,
// as the scalar cast); a prompt chunk's 128 x 576 add + norm measured ~100 us scalar here. With
// AVX2 8 at a time, the same math.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <cmath>
#include <tuple>
#include <type_traits>
#include <vector>

#include "kernel_common.h"

namespace {

using namespace pdserve_cpu;

#ifdef PDSERVE_AVX512
inline __m512 load_weight16(const bf16* w, __mmask16 m) { return load16(w, m); }
inline __m512 load_weight16(const float* w, __mmask16 m) { return _mm512_maskz_loadu_ps(m, w); }

// one row: sum_out = bf16(x + delta) when delta is given; out = bf16(v * inv * w)
template <typename W>
void norm_row_vec(const bf16* x, const bf16* delta, bf16* sum_out, const W* w, bf16* out, int64_t hidden,
                  float eps) {
  __m512 ss = _mm512_setzero_ps();
  for (int64_t i = 0; i < hidden; i += 16) {
    const __mmask16 m = lanes16(hidden - i);
    __m512 v = load16(x + i, m);
    if (delta != nullptr) {
      const __m256i rounded = round16(_mm512_add_ps(v, load16(delta + i, m)));
      _mm256_mask_storeu_epi16(sum_out + i, m, rounded);
      v = widen16(rounded);
    }
    ss = _mm512_fmadd_ps(v, v, ss);
  }
  const float inv = 1.f / std::sqrt(_mm512_reduce_add_ps(ss) / static_cast<float>(hidden) + eps);
  const bf16* v_src = delta != nullptr ? sum_out : x;      // the (rounded) row again, from L1
  for (int64_t i = 0; i < hidden; i += 16) {
    const __mmask16 m = lanes16(hidden - i);
    const __m512 o = _mm512_mul_ps(_mm512_mul_ps(load16(v_src + i, m), _mm512_set1_ps(inv)), load_weight16(w + i, m));
    _mm256_mask_storeu_epi16(out + i, m, round16(o));
  }
}
#endif

#ifdef PDSERVE_AVX2
inline __m256 load_weight8(const bf16* w) { return load8(w); }
inline __m256 load_weight8(const float* w) { return _mm256_loadu_ps(w); }

// the same on 8 lanes (AVX2): vectors of 8, then the row's last hidden % 8 elements one by one
template <typename W>
void norm_row_vec(const bf16* x, const bf16* delta, bf16* sum_out, const W* w, bf16* out, int64_t hidden,
                   float eps) {
  const int64_t whole = hidden / 8 * 8;
  __m256 ss = _mm256_setzero_ps();
  for (int64_t i = 0; i < whole; i += 8) {
    __m256 v = load8(x + i);
    if (delta != nullptr) {
      round_store8(sum_out + i, _mm256_add_ps(v, load8(delta + i)));
      v = load8(sum_out + i);
    }
    ss = _mm256_fmadd_ps(v, v, ss);
  }
  float tail = 0.f;
  for (int64_t i = whole; i < hidden; ++i) {
    float v = static_cast<float>(x[i]);
    if (delta != nullptr) {
      sum_out[i] = static_cast<bf16>(v + static_cast<float>(delta[i]));
      v = static_cast<float>(sum_out[i]);
    }
    tail += v * v;
  }
  const float inv = 1.f / std::sqrt((sum8(ss) + tail) / static_cast<float>(hidden) + eps);
  const bf16* v_src = delta != nullptr ? sum_out : x;
  for (int64_t i = 0; i < whole; i += 8)
    round_store8(out + i, _mm256_mul_ps(_mm256_mul_ps(load8(v_src + i), _mm256_set1_ps(inv)), load_weight8(w + i)));
  for (int64_t i = whole; i < hidden; ++i)
    out[i] = static_cast<bf16>(static_cast<float>(v_src[i]) * inv * static_cast<float>(w[i]));
}
#endif

template <typename T, typename W>
void norm_rows(const T* x, const T* delta, T* sum_out, const W* w, T* out, int64_t rows, int64_t hidden, float eps) {
#if defined(PDSERVE_AVX512) || defined(PDSERVE_AVX2)
  if constexpr (std::is_same_v<T, bf16>) {
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        norm_row_vec(x + r * hidden, delta ? delta + r * hidden : nullptr, sum_out ? sum_out + r * hidden : nullptr,
                     w, out + r * hidden, hidden, eps);
    });
    return;
  }
#endif
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(hidden);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * hidden;
      float ss = 0.f;
      for (int64_t i = 0; i < hidden; ++i) {
        float v = static_cast<float>(xr[i]);
        if (delta != nullptr) {
          const T rounded = static_cast<T>(v + static_cast<float>(delta[r * hidden + i]));
          sum_out[r * hidden + i] = rounded;
          v = static_cast<float>(rounded);
        }
        row[i] = v;
        ss += v * v;
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(hidden) + eps);
      T* o = out + r * hidden;
      for (int64_t i = 0; i < hidden; ++i) o[i] = static_cast<T>(row[i] * inv * static_cast<float>(w[i]));
    }
  });
}

void check(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous(), "x: a contiguous [rows, hidden] CPU tensor");
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(1) && w.is_contiguous() &&
              (w.scalar_type() == x.scalar_type() || w.scalar_type() == at::kFloat),
              "w: [hidden] in x's dtype or float32");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "float32 or bfloat16");
}

// f(x's element, w's element) for the (x, w) dtypes `check` lets through
template <typename F>
void dispatch(const at::Tensor& x, const at::Tensor& w, F&& f) {
  if (x.scalar_type() == at::kFloat) f(float{}, float{});
  else if (w.scalar_type() == at::kFloat) f(c10::BFloat16{}, float{});
  else f(c10::BFloat16{}, c10::BFloat16{});
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check(x, w);
  at::Tensor out = at::empty_like(x);
  dispatch(x, w, [&](auto tag, auto w_tag) {
    using T = decltype(tag);
    using W = decltype(w_tag);
    norm_rows<T, W>(x.data_ptr<T>(), nullptr, nullptr, w.data_ptr<W>(), out.data_ptr<T>(), x.size(0), x.size(1),
                    static_cast<float>(eps));
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& w,
                                                double eps) {
  check(x, w);
  TORCH_CHECK(delta.sizes() == x.sizes() && delta.scalar_type() == x.scalar_type(), "delta: x's shape and dtype");
  at::Tensor d = delta.contiguous();
  at::Tensor sum = at::empty_like(x), out = at::empty_like(x);
  dispatch(x, w, [&](auto tag, auto w_tag) {
    using T = decltype(tag);
    using W = decltype(w_tag);
    norm_rows<T, W>(x.data_ptr<T>(), d.data_ptr<T>(), sum.data_ptr<T>(), w.data_ptr<W>(), out.data_ptr<T>(),
                    x.size(0), x.size(1), static_cast<float>(eps));
  });
  return {sum, out};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor delta, Tensor w, float eps) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
}
