// x @ (w * scales).T with float32 outputs for an int8 weight per output channel (built by app/engine/cpu_kernels.py).
//
// PyTorch's weight-only int8 kernel takes and returns bfloat16: a model's LM head then gives logits on bfloat16's
// grid (steps of 0.25-0.5 at SmolLM2's logit sizes), so logprobs move in such steps and two tokens often tie
// exactly. Here each output is sum_k x[m][k] * w[n][k] in float32 (x as given, not rounded): 8-lane fused
// multiply-adds over k (lane l takes k = l, l + 8, ...), the lanes summed in one fixed tree, then the tail of k
// in order, then times the channel's scale. The order depends on k alone, so a row's outputs are the same bits
// however many rows come with it. Rows go up to 8 at a time over each weight row (each weight converted once per 8).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>

#include "lanes.h"

namespace {

inline __m256 weights8(const int8_t* w) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w))));
}

template <int R>
void rows(const float* x, const int8_t* w, const float* scales, float* out, int64_t m0, int64_t n0, int64_t n1,
          int64_t K, int64_t N) {
  const int64_t body = K / 8 * 8;
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* wn = w + n * K;
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t k = 0; k < body; k += 8) {
      const __m256 wv = weights8(wn + k);
      for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + (m0 + r) * K + k), wv, acc[r]);
    }
    for (int r = 0; r < R; ++r) {
      float sum = saker::sum8(acc[r]);
      for (int64_t k = body; k < K; ++k) sum = std::fma(x[(m0 + r) * K + k], static_cast<float>(wn[k]), sum);
      out[(m0 + r) * N + n] = sum * scales[n];
    }
  }
}

}  // namespace

// x (M, K) float32; w (N, K) int8; scales (N,) float32. Returns (M, N) float32.
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor w, torch::Tensor scales) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x (M, K), w (N, K)");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kChar, "float32 x, int8 w");
  x = x.contiguous();
  w = w.contiguous();
  scales = scales.to(at::kFloat).contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto out = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* op = out.data_ptr<float>();
  saker::over_columns(N, 256, [&](int64_t n0, int64_t n1) {
    for (int64_t m = 0; m < M; m += 8) {
      switch (std::min<int64_t>(8, M - m)) {
        case 8: rows<8>(xp, wp, sp, op, m, n0, n1, K, N); break;
        case 7: rows<7>(xp, wp, sp, op, m, n0, n1, K, N); break;
        case 6: rows<6>(xp, wp, sp, op, m, n0, n1, K, N); break;
        case 5: rows<5>(xp, wp, sp, op, m, n0, n1, K, N); break;
        case 4: rows<4>(xp, wp, sp, op, m, n0, n1, K, N); break;
        case 3: rows<3>(xp, wp, sp, op, m, n0, n1, K, N); break;
        case 2: rows<2>(xp, wp, sp, op, m, n0, n1, K, N); break;
        default: rows<1>(xp, wp, sp, op, m, n0, n1, K, N);
      }
    }
  });
  return out;
}
