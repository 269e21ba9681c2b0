// The sampler's choice of each row's next token, one call for the whole batch (built by
// app/engine/cpu_kernels.py; app/engine/sampling/sampler.py says what each parameter means).
//
// In: the rows' scores after masks, biases and penalties (float32), and per row: greedy, temperature, top_k (0:
// none), top_p (1: none), log(min_p) (-inf: none), and the draw's seed and counter. Out: each row's token.
//
// A greedy row takes the first index of its largest score. A sampled row, over s = score / temperature (float32,
// as PyTorch divides) and m = max(s):
//   weights   w = exp(s - m) in float32 (``exp8``, the log-softmax kernel's; -inf gives exactly 0);
//   top-k     the k-th largest s is a threshold (tokens tied with it all stay);
//   top-p     the largest s first, a token stays while the weight above it is under top_p of the kept weight (the
//             top k's, or the whole row's; float64): with top-k, walked over the top k sorted; without, a
//             histogram of the scores by their top 12 bits finds the bucket where the nucleus ends (each bucket's
//             weight summed), and only that bucket's scores are sorted and walked;
//   min-p     s below m + log(min_p) goes;
//   draw      u = the row's counter-based uniform (``uniforms`` in sampler.py, to the bit); the kept weights summed
//             in float64 in vocabulary order, 8 at a time (each block in one fixed tree), and the first token
//             whose running sum reaches u x the total.
// Every sum is in a fixed order and per row, so a row's token depends on its own scores, parameters, seed and
// counter only: never on the other rows, the batch's size or the number of threads.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#include "lanes.h"

namespace {

// splitmix64's finalizer over seed * golden + step * 0xD1B54A32D192ED03 (wrapping), its top 52 bits as a number
// in (0, 1): sampler.uniforms, to the bit
double uniform(int64_t seed, int64_t step) {
  uint64_t z = static_cast<uint64_t>(seed) * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(step) * 0xD1B54A32D192ED03ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return (static_cast<double>(z >> 12) + 0.5) * (1.0 / 4503599627370496.0);
}

// e^x of one value by the 8-lane polynomial (the same bits as exp8 gives that value in any lane)
inline float exp1(float x) {
  alignas(32) float out[8];
  _mm256_store_ps(out, saker::exp8(_mm256_set1_ps(x)));
  return out[0];
}

// The first index of the row's largest value, as torch.argmax gives it: the first NaN where there is one. Two
// passes of 8 lanes: the maximum (exact in any order), then the first lane equal to it.
int64_t first_max(const float* x, int64_t V) {
  const int64_t body = V / 32 * 32;
  __m256 m[4], nan = _mm256_setzero_ps();
  for (int j = 0; j < 4; ++j) m[j] = _mm256_set1_ps(-INFINITY);
  for (int64_t i = 0; i < body; i += 32)
    for (int j = 0; j < 4; ++j) {
      const __m256 v = _mm256_loadu_ps(x + i + 8 * j);
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      m[j] = _mm256_max_ps(m[j], v);
    }
  float top = saker::max8(_mm256_max_ps(_mm256_max_ps(m[0], m[1]), _mm256_max_ps(m[2], m[3])));
  bool any_nan = _mm256_movemask_ps(nan) != 0;
  for (int64_t i = body; i < V; ++i) {
    any_nan = any_nan || std::isnan(x[i]);
    top = std::max(top, x[i]);
  }
  if (any_nan) {
    for (int64_t i = 0; i < V; ++i)
      if (std::isnan(x[i])) return i;
  }
  const __m256 tv = _mm256_set1_ps(top);
  int64_t i = 0;
  for (; i + 8 <= V; i += 8) {
    const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), tv, _CMP_EQ_OQ));
    if (hit) return i + __builtin_ctz(hit);
  }
  for (; i < V; ++i)
    if (x[i] == top) return i;
  return 0;  // not reached
}

// a float's bits as an unsigned integer in the same order (larger float, larger key; NaN aside)
inline uint32_t order_key(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return bits ^ ((bits >> 31) ? 0xFFFFFFFFu : 0x80000000u);
}

constexpr int BUCKET_BITS = 12;  // top-p's histogram: the top 12 bits of a score's order key

struct Buffers {  // one thread's
  std::vector<float> s, w, sorted;
  std::vector<double> blocks;
  std::vector<int32_t> counts;
  std::vector<double> weights;
};

// top-p over the whole row (no top-k): a histogram of the scores by their top bits, each bucket's weight summed
// (float64); the buckets from the largest down while the weight above stays under the limit, then the scores of
// the bucket where the nucleus ends, sorted, one by one. Returns the last kept score.
float nucleus_threshold(const float* s, const float* w, int64_t V, float m, float top_p, Buffers& b) {
  const int n = 1 << BUCKET_BITS;
  b.counts.assign(n, 0);
  b.weights.assign(n, 0.0);
  for (int64_t i = 0; i < V; ++i) {
    const uint32_t bucket = order_key(s[i]) >> (32 - BUCKET_BITS);
    b.counts[bucket] += 1;
    b.weights[bucket] += w[i];
  }
  double kept = 0.0;
  for (int k = n - 1; k >= 0; --k) kept += b.weights[k];
  const double limit = static_cast<double>(top_p) * kept;
  double above = 0.0;
  int edge = -1;
  for (int k = n - 1; k >= 0; --k) {
    if (b.counts[k] == 0) continue;
    if (above + b.weights[k] >= limit) {
      edge = k;
      break;
    }
    above += b.weights[k];
  }
  if (edge < 0) return -INFINITY;  // the whole row is under the limit (rounding): every token stays
  b.sorted.clear();
  for (int64_t i = 0; i < V; ++i)
    if (static_cast<int>(order_key(s[i]) >> (32 - BUCKET_BITS)) == edge) b.sorted.push_back(s[i]);
  std::sort(b.sorted.begin(), b.sorted.end(), std::greater<float>());
  size_t j = 0;  // a token stays while the weight above it is under the limit (the bucket's first one does)
  while (j < b.sorted.size() && above < limit) above += exp1(b.sorted[j++] - m);
  return b.sorted[std::max<size_t>(j, 1) - 1];
}

// top-k, then top-p over what it kept: the k largest found and sorted, the nucleus walked among them
float top_k_threshold(const float* s, int64_t V, float m, int64_t count, float top_p, Buffers& b) {
  b.sorted.assign(s, s + V);
  const auto largest_first = std::greater<float>();
  std::nth_element(b.sorted.begin(), b.sorted.begin() + (count - 1), b.sorted.end(), largest_first);
  if (top_p >= 1.0f) return b.sorted[count - 1];
  std::sort(b.sorted.begin(), b.sorted.begin() + count, largest_first);
  double kept = 0.0;
  for (int64_t j = 0; j < count; ++j) kept += exp1(b.sorted[j] - m);
  const double limit = static_cast<double>(top_p) * kept;
  double above = 0.0;
  int64_t j = 0;
  while (j < count && above < limit) above += exp1(b.sorted[j++] - m);
  return b.sorted[std::max<int64_t>(j, 1) - 1];
}

int64_t draw(const float* x, int64_t V, float temperature, int64_t top_k, float top_p, float log_min_p, double u,
             Buffers& b) {
  const int64_t P = (V + 7) / 8 * 8;  // padded: scores -inf, weights 0
  b.s.resize(P);
  b.w.resize(P);
  float* s = b.s.data();
  float* w = b.w.data();
  const __m256 t = _mm256_set1_ps(temperature);
  __m256 mx = _mm256_set1_ps(-INFINITY);
  const int64_t body = V / 8 * 8;
  for (int64_t k = 0; k < body; k += 8) {
    const __m256 v = _mm256_div_ps(_mm256_loadu_ps(x + k), t);
    _mm256_storeu_ps(s + k, v);
    mx = _mm256_max_ps(mx, v);
  }
  float m = saker::max8(mx);
  for (int64_t k = body; k < P; ++k) {
    s[k] = k < V ? x[k] / temperature : -INFINITY;
    m = std::max(m, s[k]);
  }
  if (!std::isfinite(m)) return first_max(s, V);  // nothing to draw from (every token masked, or inf/NaN)
  const __m256 mv = _mm256_set1_ps(m);
  for (int64_t k = 0; k < P; k += 8) _mm256_storeu_ps(w + k, saker::exp8(_mm256_sub_ps(_mm256_loadu_ps(s + k), mv)));
  const int64_t count = top_k > 0 ? std::min<int64_t>(top_k, V) : V;
  float keep = -INFINITY;
  if (count < V) {
    keep = top_k_threshold(s, V, m, count, top_p, b);
  } else if (top_p < 1.0f) {
    keep = nucleus_threshold(s, w, V, m, top_p, b);
  }
  if (log_min_p > -INFINITY) keep = std::max(keep, m + log_min_p);
  // the draw: the kept weights in vocabulary order, 8 at a time (each block's sum in one fixed tree), then token by
  // token within the block where the running sum reaches u x the total
  const int64_t blocks = P / 8;
  b.blocks.resize(blocks);
  const __m256 kv = _mm256_set1_ps(keep);
  double total = 0.0;
  for (int64_t k = 0; k < blocks; ++k) {
    const __m256 kept = _mm256_and_ps(_mm256_cmp_ps(_mm256_loadu_ps(s + 8 * k), kv, _CMP_GE_OQ),
                                      _mm256_loadu_ps(w + 8 * k));
    const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(kept));
    const __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(kept, 1));
    alignas(32) double d[4];
    _mm256_store_pd(d, _mm256_add_pd(lo, hi));
    b.blocks[k] = (d[0] + d[1]) + (d[2] + d[3]);
    total += b.blocks[k];
  }
  const double target = u * total;
  double run = 0.0;
  int64_t last = -1;
  for (int64_t k = 0; k < blocks; ++k) {
    if (run + b.blocks[k] < target) {
      run += b.blocks[k];
      continue;
    }
    for (int64_t i = 8 * k; i < 8 * k + 8; ++i) {
      if (!(s[i] >= keep) || w[i] == 0.0f) continue;
      run += w[i];
      last = i;
      if (run >= target) return i;
    }
    if (last >= 0) return last;  // the block's tokens one by one fell a rounding short of the block's sum
  }
  return last >= 0 ? last : first_max(s, V);  // not reached (u < 1 keeps the target within the total)
}

}  // namespace

// scores (B, V) float32; greedy (B,) bool; temperature, top_p, log_min_p (B,) float32; top_k, seeds, steps (B,)
// int64. Returns (B,) int64: each row's token.
torch::Tensor sample_tokens(torch::Tensor scores, torch::Tensor greedy, torch::Tensor temperature, torch::Tensor top_k,
                            torch::Tensor top_p, torch::Tensor log_min_p, torch::Tensor seeds, torch::Tensor steps) {
  TORCH_CHECK(scores.dim() == 2 && scores.scalar_type() == at::kFloat, "scores: (rows, vocabulary) float32");
  const int64_t B = scores.size(0), V = scores.size(1);
  TORCH_CHECK(V > 0, "an empty vocabulary");
  scores = scores.contiguous();
  auto g = greedy.to(at::kBool).contiguous();
  auto t = temperature.to(at::kFloat).contiguous();
  auto k = top_k.to(at::kLong).contiguous();
  auto p = top_p.to(at::kFloat).contiguous();
  auto mp = log_min_p.to(at::kFloat).contiguous();
  auto sd = seeds.to(at::kLong).contiguous();
  auto st = steps.to(at::kLong).contiguous();
  for (const auto& column : {g, t, k, p, mp, sd, st}) TORCH_CHECK(column.numel() == B, "one value per row");
  auto out = torch::empty({B}, scores.options().dtype(at::kLong));
  const float* x = scores.data_ptr<float>();
  const bool* gp = g.data_ptr<bool>();
  const float *tp = t.data_ptr<float>(), *pp = p.data_ptr<float>(), *mpp = mp.data_ptr<float>();
  const int64_t *kp = k.data_ptr<int64_t>(), *sdp = sd.data_ptr<int64_t>(), *stp = st.data_ptr<int64_t>();
  int64_t* op = out.data_ptr<int64_t>();
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), B)));
#pragma omp parallel num_threads(threads)
  {
    Buffers buffers;  // each thread's
#pragma omp for schedule(dynamic, 1)
    for (int64_t b = 0; b < B; ++b) {
      const float* row = x + b * V;
      op[b] = gp[b] ? first_max(row, V)
                    : draw(row, V, tp[b], kp[b], pp[b], mpp[b], uniform(sdp[b], stp[b]), buffers);
    }
  }
  return out;
}

// scores (B, V) float32. Returns (B,) int64: each row's first argmax (first_max), the rows shared by the threads.
torch::Tensor argmax_rows(torch::Tensor scores) {
  TORCH_CHECK(scores.dim() == 2 && scores.scalar_type() == at::kFloat, "scores: (rows, vocabulary) float32");
  const int64_t B = scores.size(0), V = scores.size(1);
  TORCH_CHECK(V > 0, "an empty vocabulary");
  scores = scores.contiguous();
  auto out = torch::empty({B}, scores.options().dtype(at::kLong));
  const float* x = scores.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), B)));
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t b = 0; b < B; ++b) op[b] = first_max(x + b * V, V);
  return out;
}
