// A Llama-shaped decoder layer's small operations, each one call instead of the 6-12 PyTorch operations that
// transformers' modules run for it (app/engine/model/fused_forward.py): on a 1-row step each PyTorch operation
// costs its dispatch (about 10 us on the 2-core machine) for a few hundred floats of arithmetic.
//
// The arithmetic is transformers' own, operation for operation and rounding for rounding, so the outputs are the
// plain forward's bits. RMSNorm's one sum, the mean of squares, is PyTorch's own: a float32 sum in another order
// (or in float64) moved the embedded int4 SmolLM2's logprobs by up to 4.6e-4, since the int4 kernel rounds its
// inputs to int16 per group and an ulp can cross a rounding step. Where PyTorch's CPU capability is AVX2 or AVX512
// its sum's order is reproduced here (``torch_sum_of_squares``: ATen's cascade over 8-lane vectors; ATen's sum has
// no AVX-512 variant, so its AVX2 kernel serves both); elsewhere ``x.pow(2).mean(-1)`` is called from here as
// transformers calls it (about 12 us of a reduction's set-up).
// Every row is computed from its own inputs only, so a row's outputs are the same bits whatever rows come with it. -ffp-contract=off (cpu_kernels.FLAGS): no product is fused into a sum.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>

namespace {

// transformers' LlamaRMSNorm for one row, given its mean of squares: w * (x * rsqrt(variance + eps)), rsqrt as
// PyTorch's (1 / sqrt, each correctly rounded).
inline void norm_row(const float* x, float variance, const float* w, float eps, int64_t D, float* out) {
  const float r = 1.0f / std::sqrt(variance + eps);
  for (int64_t i = 0; i < D; ++i) out[i] = w[i] * (x[i] * r);
}

inline __m256 squares8(const float* p) {
  const __m256 v = _mm256_loadu_ps(p);
  return _mm256_mul_ps(v, v);
}

// The float32 sum of x[i] * x[i] over a row of D, in the order of ATen's sum of a contiguous row with 8-lane
// vectors (its CPU capability AVX2): the row's whole vectors taken 4 at a time (4 accumulators) and added up in a
// cascade of 4 levels of 16, the leftover vectors into the first accumulator, the 4 accumulators summed in order,
// then the leftover elements and the 8 lanes added one by one to a scalar. Checked to the bit against
// ``x.pow(2).mean(-1)`` under each capability (tests/unit/test_instruction_sets.py, tests/engine/test_fused_forward.py).
float torch_sum_of_squares(const float* x, int64_t D) {
  constexpr int LEVELS = 4, ILP = 4;
  const int64_t vectors = D / 8, rows = vectors / ILP;
  int64_t log2 = 1;  // c10's CeilLog2: at least 1
  while ((int64_t(1) << log2) < rows) ++log2;
  const int64_t power = std::max<int64_t>(4, log2 / LEVELS), step = int64_t(1) << power, mask = step - 1;
  __m256 acc[LEVELS][ILP];
  for (auto& level : acc)
    for (auto& a : level) a = _mm256_setzero_ps();
  int64_t i = 0;
  while (i + step <= rows) {
    for (int64_t j = 0; j < step; ++j, ++i)
      for (int k = 0; k < ILP; ++k) acc[0][k] = _mm256_add_ps(acc[0][k], squares8(x + (i * ILP + k) * 8));
    for (int j = 1; j < LEVELS; ++j) {
      for (int k = 0; k < ILP; ++k) {
        acc[j][k] = _mm256_add_ps(acc[j][k], acc[j - 1][k]);
        acc[j - 1][k] = _mm256_setzero_ps();
      }
      if ((i & (mask << (j * power))) != 0) break;
    }
  }
  for (; i < rows; ++i)
    for (int k = 0; k < ILP; ++k) acc[0][k] = _mm256_add_ps(acc[0][k], squares8(x + (i * ILP + k) * 8));
  for (int j = 1; j < LEVELS; ++j)
    for (int k = 0; k < ILP; ++k) acc[0][k] = _mm256_add_ps(acc[0][k], acc[j][k]);
  for (int64_t v = rows * ILP; v < vectors; ++v) acc[0][0] = _mm256_add_ps(acc[0][0], squares8(x + v * 8));
  for (int k = 1; k < ILP; ++k) acc[0][0] = _mm256_add_ps(acc[0][0], acc[0][k]);
  float total = 0.0f;
  for (int64_t e = vectors * 8; e < D; ++e) {
    const float square = x[e] * x[e];
    total += square;
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc[0][0]);
  for (float lane : lanes) total += lane;
  return total;
}

// Each row's mean of squares as PyTorch computes ``x.pow(2).mean(-1)``: reproduced (``in_order``, its capability
// AVX2 or AVX512) or called.
torch::Tensor mean_squares(const torch::Tensor& x, bool in_order) {
  if (!in_order) return x.pow(2).mean(-1).contiguous();
  const int64_t T = x.size(0), D = x.size(1);
  auto out = torch::empty({T}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) op[t] = torch_sum_of_squares(xp + t * D, D) / static_cast<float>(D);
  return out;
}

void check_rows(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x (T, D) float32");
  TORCH_CHECK(w.dim() == 1 && w.scalar_type() == at::kFloat && w.size(0) == x.size(1), "weight (D,) float32");
}

}  // namespace

// x (T, D), weight (D,) float32 -> (T, D): each row RMS-normalised and scaled by weight; ``in_order``: PyTorch's sum
// reproduced (its CPU capability is AVX2), else called.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps, bool in_order) {
  check_rows(x, weight);
  x = x.contiguous();
  weight = weight.contiguous();
  auto out = torch::empty_like(x);
  const int64_t T = x.size(0), D = x.size(1);
  const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const auto variance = mean_squares(x, in_order);
  const float* vp = variance.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) norm_row(xp + t * D, vp[t], wp, e, D, op + t * D);
  });
  return out;
}

// The residual stream's step between two sublayers: sum = residual + x, then (rms_norm(sum), sum).
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight,
                                                      double eps, bool in_order) {
  check_rows(x, weight);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == at::kFloat, "residual like x");
  x = x.contiguous();
  residual = residual.contiguous();
  weight = weight.contiguous();
  auto sum = torch::empty_like(x);
  auto out = torch::empty_like(x);
  const int64_t T = x.size(0), D = x.size(1);
  const float *xp = x.data_ptr<float>(), *rp = residual.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float *sp = sum.data_ptr<float>(), *op = out.data_ptr<float>();
  for (int64_t i = 0; i < T * D; ++i) sp[i] = rp[i] + xp[i];
  const auto variance = mean_squares(sum, in_order);
  const float* vp = variance.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) norm_row(sp + t * D, vp[t], wp, e, D, op + t * D);
  });
  return {out, sum};
}

namespace {

// transformers' apply_rotary_pos_emb for one head: x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1).
inline void rotate(const float* x, const float* c, const float* s, int64_t D, float* out) {
  const int64_t h = D / 2;
  for (int64_t i = 0; i < h; ++i) out[i] = x[i] * c[i] + (-x[i + h]) * s[i];
  for (int64_t i = h; i < D; ++i) out[i] = x[i] * c[i] + x[i - h] * s[i];
}

}  // namespace

// q (T, Hq, D), k and v (T, Hkv, D) float32 of one layer's step; cos, sin (T, D) float32; keys and values that
// layer's block pool (slots, Hkv, D) float32; write (T,) int64 each token's pool slot. Rotates q and k by their
// positions' angles, writes the rotated k and v at their slots (the pool's index_copy_) and returns the rotated q.
torch::Tensor rotary_write(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor cos, torch::Tensor sin,
                           torch::Tensor keys, torch::Tensor values, torch::Tensor write) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes(), "q (T, Hq, D), k and v (T, Hkv, D)");
  const int64_t T = q.size(0), Hq = q.size(1), Hkv = k.size(1), D = q.size(2);
  TORCH_CHECK(k.size(0) == T && k.size(2) == D && D % 2 == 0, "q, k and v: the same tokens and an even head dim");
  for (const auto& t : {q, k, v, cos, sin, keys, values})
    TORCH_CHECK(t.scalar_type() == at::kFloat, "float32 q, k, v, cos, sin and pool");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.size(0) == T && cos.size(1) == D, "cos and sin (T, D)");
  TORCH_CHECK(keys.dim() == 3 && keys.size(1) == Hkv && keys.size(2) == D && values.sizes() == keys.sizes(),
              "keys and values (slots, Hkv, D)");
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous(), "a contiguous pool (written in place)");
  TORCH_CHECK(write.dim() == 1 && write.size(0) == T && write.scalar_type() == at::kLong, "write (T,) int64");
  q = q.contiguous();
  k = k.contiguous();
  v = v.contiguous();
  cos = cos.contiguous();
  sin = sin.contiguous();
  write = write.contiguous();
  const int64_t slots = keys.size(0);
  const int64_t* wp = write.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(wp[t] >= 0 && wp[t] < slots, "a write slot outside the pool");
  auto out = torch::empty_like(q);
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  float *op = out.data_ptr<float>(), *keys_p = keys.data_ptr<float>(), *values_p = values.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float *c = cp + t * D, *s = sp + t * D;
      for (int64_t h = 0; h < Hq; ++h) rotate(qp + (t * Hq + h) * D, c, s, D, op + (t * Hq + h) * D);
      float* kslot = keys_p + wp[t] * Hkv * D;
      for (int64_t h = 0; h < Hkv; ++h) rotate(kp + (t * Hkv + h) * D, c, s, D, kslot + h * D);
      std::copy(vp + t * Hkv * D, vp + (t + 1) * Hkv * D, values_p + wp[t] * Hkv * D);
    }
  });
  return out;
}
