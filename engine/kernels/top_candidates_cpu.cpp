// Top-k / nucleus sampling's candidates (torch.ops.pdserve.top_candidates), CPU fp32:
//
//   top_candidates(logits [B, V] fp32, width) -> (values [B, width] fp32, ids [B, width] int64,
//                                                 log_total [B] fp32)
//
// Each row's `width` largest logits in descending order, equal ones by the smaller id first, and
// their ids: what `logits.topk(width)` gives (but for the order of ties, which torch leaves open);
// and the row's logsumexp (a nucleus's mass is a share of the whole row's). Passes over the row
// (in L2): its range; exp (kernel_common.h exp16 / exp8) summed; a few counting how many logits
// reach a threshold (`threshold`); those at or above it collected, then nth_element and a sort of
// the first `width` (a few hundred to ~4 x width entries). torch's topk of 256 took 0.15 ms a
// 49,152-wide row here (one thread) and the logsumexp 0.1; this 0.05, a row with 10 tokens above
// -inf (a grammar's mask) 0.1.
// A row with a NaN gives NaN values and log_total (the sampler's draw then finds no candidate, as
// it does after torch's topk); a row of -inf (+inf) logsumexp -inf (+inf), as torch's.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

#include "kernel_common.h"

namespace {

using pdserve_cpu::nan1;

struct Entry {
  float value;
  int64_t id;
};

// a ranks before b: larger, or equal with the smaller id
inline bool before(const Entry& a, const Entry& b) { return a.value > b.value || (a.value == b.value && a.id < b.id); }

// how many of x[0 .. n) are >= t
int64_t count_at_least(const float* x, int64_t n, float t) {
  int64_t count = 0, i = 0;
#ifdef PDSERVE_AVX512
  const __m512 t16 = _mm512_set1_ps(t);
  for (; i + 16 <= n; i += 16) count += __builtin_popcount(_mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), t16, _CMP_GE_OQ));
#endif
  for (; i < n; ++i) count += x[i] >= t;
  return count;
}

// the entries of x[0 .. n) >= t, in id order
void collect(const float* x, int64_t n, float t, std::vector<Entry>& out) {
  int64_t i = 0;
#ifdef PDSERVE_AVX512
  const __m512 t16 = _mm512_set1_ps(t);
  for (; i + 16 <= n; i += 16)
    for (__mmask16 up = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), t16, _CMP_GE_OQ); up; up &= up - 1) {
      const int lane = __builtin_ctz(up);
      out.push_back({x[i + lane], i + lane});
    }
#endif
  for (; i < n; ++i)
    if (x[i] >= t) out.push_back({x[i], i});
}

// A threshold t with at least `width` of x[0 .. n) >= t and, where the values allow, at most
// `cap`: t = max - c for c = 1, 2, 4, ... until enough, then halving back while too many (a pass
// of compares each, from L2). `lowest`: the row's smallest logit above -inf; where fewer than
// `width` are above -inf, it is t (the caller takes -inf logits for the rest).
float threshold(const float* x, int64_t n, float max, float lowest, int64_t width, int64_t cap) {
  float hi = max, t = max;                     // fewer than `width` at or above hi, enough at t
  int64_t count = count_at_least(x, n, max);
  if (count >= width) return max;
  for (float c = 1.f;; hi = t, c *= 2.f) {
    t = max - c;
    if (!(t > lowest)) {                         // every logit above -inf (NaN: c reached inf)
      t = lowest;
      count = count_at_least(x, n, t);
      break;
    }
    count = count_at_least(x, n, t);
    if (count >= width) break;
  }
  for (int step = 0; count > cap && step < 24; ++step) {
    const float mid = 0.5f * (t + hi);
    if (!(mid > t && mid < hi)) break;
    const int64_t at_mid = count_at_least(x, n, mid);
    if (at_mid >= width) t = mid, count = at_mid;
    else hi = mid;
  }
  return t;
}

// by its bits (-ffast-math folds std::isinf)
inline bool infinite(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  return (bits & 0x7FFFFFFFu) == 0x7F800000u;
}

struct Range {
  float max, lowest;        // the largest logit (NaN: the row holds one), the smallest above -inf
};

// row x[0 .. n)'s range (lowest: max where every logit is -inf)
Range row_range(const float* x, int64_t n) {
  constexpr float kInf = std::numeric_limits<float>::infinity(), kNaN = std::numeric_limits<float>::quiet_NaN();
  float m = -kInf, lo = kInf;
  int64_t i = 0;
#ifdef PDSERVE_AVX512
  __m512 m16 = _mm512_set1_ps(m), lo16 = _mm512_set1_ps(lo);
  const __m512 minus_inf = _mm512_set1_ps(-kInf);
  __mmask16 nan = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    nan |= pdserve_cpu::nan16(v);
    m16 = _mm512_max_ps(m16, v);
    lo16 = _mm512_mask_min_ps(lo16, _mm512_cmp_ps_mask(v, minus_inf, _CMP_GT_OQ), lo16, v);
  }
  if (nan) return {kNaN, kNaN};
  m = _mm512_reduce_max_ps(m16);
  lo = _mm512_reduce_min_ps(lo16);
#elif defined(PDSERVE_AVX2)
  __m256 m8 = _mm256_set1_ps(m), lo8 = _mm256_set1_ps(lo);
  const __m256 minus_inf = _mm256_set1_ps(-kInf);
  __m256i nan = _mm256_setzero_si256();
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    nan = _mm256_or_si256(nan, pdserve_cpu::nan8(v));
    m8 = _mm256_max_ps(m8, v);
    lo8 = _mm256_blendv_ps(lo8, _mm256_min_ps(lo8, v), _mm256_cmp_ps(v, minus_inf, _CMP_GT_OQ));
  }
  if (!_mm256_testz_si256(nan, nan)) return {kNaN, kNaN};
  alignas(32) float lane[8], low_lane[8];
  _mm256_store_ps(lane, m8);
  _mm256_store_ps(low_lane, lo8);
  for (int l = 0; l < 8; ++l) m = lane[l] > m ? lane[l] : m, lo = low_lane[l] < lo ? low_lane[l] : lo;
#endif
  for (; i < n; ++i) {
    if (nan1(x[i])) return {kNaN, kNaN};
    m = x[i] > m ? x[i] : m;
    lo = x[i] > -kInf && x[i] < lo ? x[i] : lo;
  }
  return {m, lo == kInf ? m : lo};
}

// exp(x - max) summed over x[0 .. n) (exp16 / exp8: within 2 ulp). Terms below e^-80 (of a sum
// of at least 1) are left out: computing them makes denormals, ~100 cycles of microcode each
// (a row of -inf but a grammar's few tokens took 0.3 ms, 0.06 without them).
float exp_sum(const float* x, int64_t n, float max) {
  constexpr float kFloor = -80.f;
  float sum = 0.f;
  int64_t i = 0;
#ifdef PDSERVE_AVX512
  const __m512 max16 = _mm512_set1_ps(max), floor16 = _mm512_set1_ps(kFloor);
  __m512 sum16 = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    const __m512 d = _mm512_sub_ps(_mm512_loadu_ps(x + i), max16);
    const __mmask16 kept = _mm512_cmp_ps_mask(d, floor16, _CMP_GT_OQ);
    sum16 = _mm512_mask_add_ps(sum16, kept, sum16, pdserve_cpu::exp16(_mm512_max_ps(d, floor16)));
  }
  sum = _mm512_reduce_add_ps(sum16);
#elif defined(PDSERVE_AVX2)
  const __m256 max8 = _mm256_set1_ps(max), floor8 = _mm256_set1_ps(kFloor);
  __m256 sum8 = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 d = _mm256_sub_ps(_mm256_loadu_ps(x + i), max8);
    const __m256 e = pdserve_cpu::exp8(_mm256_max_ps(d, floor8));
    sum8 = _mm256_add_ps(sum8, _mm256_and_ps(e, _mm256_cmp_ps(d, floor8, _CMP_GT_OQ)));
  }
  sum = pdserve_cpu::sum8(sum8);
#endif
  for (; i < n; ++i)
    if (x[i] - max > kFloor) sum += std::exp(x[i] - max);
  return sum;
}

constexpr int64_t kCapFactor = 4;     // collect at most this many times `width` where the values allow

void row_candidates(const float* x, int64_t n, int64_t width, float* values, int64_t* ids, float* log_total) {
  const auto [m, lowest] = row_range(x, n);
  if (nan1(m)) {
    for (int64_t i = 0; i < width; ++i) values[i] = m, ids[i] = i;
    *log_total = m;
    return;
  }
  *log_total = infinite(m) ? m : m + std::log(exp_sum(x, n, m));
  std::vector<Entry> found;
  found.reserve(kCapFactor * width);
  collect(x, n, threshold(x, n, m, lowest, width, kCapFactor * width), found);
  for (int64_t i = 0; int64_t(found.size()) < width; ++i)     // too few above -inf (a grammar's mask)
    if (infinite(x[i]) && x[i] < 0.f) found.push_back({x[i], i});
  std::nth_element(found.begin(), found.begin() + (width - 1), found.end(), before);
  std::sort(found.begin(), found.begin() + width, before);
  for (int64_t i = 0; i < width; ++i) values[i] = found[i].value, ids[i] = found[i].id;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> top_candidates(const at::Tensor& logits, int64_t width) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.scalar_type() == at::kFloat,
              "logits: a [rows, vocab] fp32 CPU tensor");
  TORCH_CHECK(width > 0 && width <= logits.size(1), "width: 1 to the vocabulary's size");
  const at::Tensor x = logits.contiguous();
  const int64_t rows = x.size(0), n = x.size(1);
  at::Tensor values = at::empty({rows, width}, x.options()), log_total = at::empty({rows}, x.options()),
             ids = at::empty({rows, width}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  float* vp = values.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  float* lp = log_total.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) row_candidates(xp + r * n, n, width, vp + r * width, ip + r * width, lp + r);
  });
  return {values, ids, log_total};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("top_candidates(Tensor logits, int width) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) {
  m.impl("top_candidates", &top_candidates);
}
