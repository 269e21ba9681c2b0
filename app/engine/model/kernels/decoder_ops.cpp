// A Llama-shaped decoder layer's small operations, each one call instead of the 6-12 PyTorch operations that
// transformers' modules run for it (app/engine/model/fused_forward.py): on a 1-row step each PyTorch operation
// costs its dispatch (about 10 us on the 2-core machine) for a few hundred floats of arithmetic.
//
// The arithmetic is transformers' own, operation for operation and rounding for rounding, so the outputs are the
// plain forward's bits. RMSNorm's one sum, the mean of squares, is PyTorch's own (``x.pow(2).mean(-1)`` called
// from here, as transformers calls it): a float32 sum in another order (or in float64) moved the embedded int4
// SmolLM2's logprobs by up to 4.6e-4, since the int4 kernel rounds its inputs to int16 per group and an ulp can
// cross a rounding step. Every row is computed from its own inputs only, so a row's outputs are the same bits
// whatever rows come with it. -ffp-contract=off (cpu_kernels.FLAGS): no product is fused into a sum.

#include <torch/extension.h>
#include <ATen/Parallel.h>

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

// Each row's mean of squares, by PyTorch as transformers computes it.
torch::Tensor mean_squares(const torch::Tensor& x) { return x.pow(2).mean(-1).contiguous(); }

void check_rows(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x (T, D) float32");
  TORCH_CHECK(w.dim() == 1 && w.scalar_type() == at::kFloat && w.size(0) == x.size(1), "weight (D,) float32");
}

}  // namespace

// x (T, D), weight (D,) float32 -> (T, D): each row RMS-normalised and scaled by weight.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_rows(x, weight);
  x = x.contiguous();
  weight = weight.contiguous();
  auto out = torch::empty_like(x);
  const int64_t T = x.size(0), D = x.size(1);
  const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const auto variance = mean_squares(x);
  const float* vp = variance.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) norm_row(xp + t * D, vp[t], wp, e, D, op + t * D);
  });
  return out;
}

// The residual stream's step between two sublayers: sum = residual + x, then (rms_norm(sum), sum).
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight,
                                                      double eps) {
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
  const auto variance = mean_squares(sum);
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
