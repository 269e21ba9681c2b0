// Raw logprobs: the log-softmax of float32 logits along each row, in one fixed order (built by
// app/engine/cpu_kernels.py).
//
// PyTorch's float32 log_softmax on the CPU sums exp(x - max) in the lanes of one vector, each lane adding its
// share of the row in turn (Vectorized<float>: 8 lanes on AVX2, 16 on AVX-512). Over a vocabulary of 49,152 a
// lane adds 6,144 terms on AVX2; once its sum holds the top token's 1.0, every term under half a float32 ulp of
// it (6e-8) is lost, so a peaked distribution's normaliser comes out short: on the embedded model's logits
// (2-core AVX2 EPYC) logprobs up to 3.7e-5 above the exact ones. How much depends on the lane count, so the
// numbers depend on the machine's instruction set, not only on the model.
//
// Here, per row:
//   max     the 8 lanes' maximum (exact, any order);
//   sum     e = exp(x - max) in float32 (exp8: one polynomial for every lane, a masked or -inf logit gives
//           exactly 0), each e widened to float64 and added to 8 float64 lanes (x = lane, lane + 8, ...), the
//           lanes summed in one fixed tree; the row's last partial group of 8 is padded with -inf (zeros);
//   output  lp = (x - max) - log(sum), computed in float64 and rounded once to float32.
// The error is that of exp8 (about an ulp per term, 1e-7 in the normaliser), the same on every CPU that runs
// it, and a row's result never depends on the other rows or on the number of threads. A row whose maximum is
// not finite (NaN, +inf, all -inf) is NaN, as PyTorch's is.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "lanes.h"

namespace {

// p[0 .. n) (n < 8) and -inf after it
inline __m256 load_tail(const float* p, int64_t n) {
  alignas(32) float buf[8];
  for (int64_t i = 0; i < 8; ++i) buf[i] = i < n ? p[i] : -INFINITY;
  return _mm256_load_ps(buf);
}

inline void add_wide(__m256 e, __m256d& lo, __m256d& hi) {
  lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
  hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
}

// the 8 lanes (lo: 0-3, hi: 4-7) as ((d0 + d4) + (d1 + d5)) + ((d2 + d6) + (d3 + d7))
inline double sum_wide(__m256d lo, __m256d hi) {
  alignas(32) double s[4];
  _mm256_store_pd(s, _mm256_add_pd(lo, hi));
  return (s[0] + s[1]) + (s[2] + s[3]);
}

void row(const float* x, float* out, int64_t V) {
  const int64_t body = V / 8 * 8;
  __m256 mx = _mm256_set1_ps(-INFINITY);
  __m256 nan = _mm256_setzero_ps();  // lanes that met a NaN
  for (int64_t k = 0; k < body; k += 8) {
    const __m256 v = _mm256_loadu_ps(x + k);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    mx = _mm256_max_ps(mx, v);
  }
  if (body < V) {
    const __m256 v = load_tail(x + body, V - body);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    mx = _mm256_max_ps(mx, v);
  }
  const float top = saker::max8(mx);
  if (_mm256_movemask_ps(nan) != 0 || !std::isfinite(top)) {
    std::fill_n(out, V, std::numeric_limits<float>::quiet_NaN());
    return;
  }
  const __m256 topv = _mm256_set1_ps(top);
  __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
  for (int64_t k = 0; k < body; k += 8) add_wide(saker::exp8(_mm256_sub_ps(_mm256_loadu_ps(x + k), topv)), lo, hi);
  if (body < V) add_wide(saker::exp8(_mm256_sub_ps(load_tail(x + body, V - body), topv)), lo, hi);
  const double top_d = top, lse = std::log(sum_wide(lo, hi));
  const __m256d topw = _mm256_set1_pd(top_d), lsew = _mm256_set1_pd(lse);
  for (int64_t k = 0; k < body; k += 8) {
    const __m256 v = _mm256_loadu_ps(x + k);
    const __m256d a = _mm256_sub_pd(_mm256_sub_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(v)), topw), lsew);
    const __m256d b = _mm256_sub_pd(_mm256_sub_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)), topw), lsew);
    _mm256_storeu_ps(out + k, _mm256_set_m128(_mm256_cvtpd_ps(b), _mm256_cvtpd_ps(a)));
  }
  for (int64_t k = body; k < V; ++k) out[k] = static_cast<float>((static_cast<double>(x[k]) - top_d) - lse);
}

}  // namespace

// x (M, V) float32. Returns (M, V) float32: each row's log-softmax.
torch::Tensor log_softmax(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x: (rows, vocabulary) float32");
  x = x.contiguous();
  const int64_t M = x.size(0), V = x.size(1);
  auto out = torch::empty_like(x);
  if (M == 0 || V == 0) return out;
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), M)));
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t m = 0; m < M; ++m) row(xp + m * V, op + m * V, V);
  return out;
}
