// x @ (w * scales).T with float32 outputs for an int8 weight per output channel (built by app/engine/cpu_kernels.py).
//
// PyTorch's weight-only int8 kernel takes and returns bfloat16: a model's LM head then gives logits on bfloat16's
// grid (steps of 0.25-0.5 at SmolLM2's logit sizes), so logprobs move in such steps and two tokens often tie
// exactly. Here each output is sum_k x[m][k] * w[n][k] in float32 (x as given, not rounded): 8-lane fused
// multiply-adds over k (lane l takes k = l, l + 8, ...), the lanes summed in one fixed tree, then the tail of k
// in order, then times the channel's scale. The order depends on k alone, so a row's outputs are the same bits
// however many rows come with it. Rows go up to 8 at a time over each weight row (each weight converted once per 8),
// and fewer rows over several outputs at a time (``rows``).

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

// Rows m0 .. m0 + R against outputs [n0, n1), O outputs at a time: R x O independent accumulator chains, so that
// few rows still keep the fused multiply-adds' pipeline full (one row's single chain waited 4 cycles per 8 inputs
// on each add's latency: the LM head at 1 row took twice its bandwidth floor). Each output's arithmetic is the same
// whatever R and O are. SmolLM2's head (49,152 x 576), 2 threads, 2-core AMD EPYC (2026-11-28), one output at a
// time against these O: 2.38 -> 1.38 ms at 1 row (O = 4: its bandwidth floor, 1.42 ms at 20 GB/s; O = 2 and 8 were
// slower), 2.84 -> 1.79 at 2 rows, 3.47 -> 3.04 at 4, 32 rows unchanged (21.3 ms), the same bits at every width.
template <int R, int O>
void rows(const float* x, const int8_t* w, const float* scales, float* out, int64_t m0, int64_t n0, int64_t n1,
          int64_t K, int64_t N) {
  const int64_t body = K / 8 * 8;
  int64_t n = n0;
  for (; n + O <= n1; n += O) {
    __m256 acc[O][R];
    for (int o = 0; o < O; ++o)
      for (int r = 0; r < R; ++r) acc[o][r] = _mm256_setzero_ps();
    // the next O outputs' weights asked for (O rows read side by side are O streams, which the hardware's
    // prefetch follows poorly: without this, 4 outputs at a time at 1 row took 1.7x the time of 1 at a time)
    const char* next = reinterpret_cast<const char*>(w + (n + O) * K);
    const bool ahead = O > 1 && n + 2 * O <= n1;
    for (int64_t k = 0; k < body; k += 8) {
      if (ahead) _mm_prefetch(next + k * O, _MM_HINT_T0);
      __m256 xv[R];
      for (int r = 0; r < R; ++r) xv[r] = _mm256_loadu_ps(x + (m0 + r) * K + k);
      for (int o = 0; o < O; ++o) {
        const __m256 wv = weights8(w + (n + o) * K + k);
        for (int r = 0; r < R; ++r) acc[o][r] = _mm256_fmadd_ps(xv[r], wv, acc[o][r]);
      }
    }
    for (int o = 0; o < O; ++o) {
      const int8_t* wn = w + (n + o) * K;
      for (int r = 0; r < R; ++r) {
        float sum = saker::sum8(acc[o][r]);
        for (int64_t k = body; k < K; ++k) sum = std::fma(x[(m0 + r) * K + k], static_cast<float>(wn[k]), sum);
        out[(m0 + r) * N + n + o] = sum * scales[n + o];
      }
    }
  }
  if (n < n1) rows<R, 1>(x, w, scales, out, m0, n, n1, K, N);  // the last outputs one at a time
}


// The same arithmetic with AVX-512, where the CPU has it: a 512-bit vector holds two outputs' 8 lanes side by side
// (lane l of each half takes k = l, l + 8, ... as above), each half summed by the same tree, so every output is the
// AVX2 path's bits. P pairs of outputs at a time, R rows.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vnni")

inline __m512 weights16(const int8_t* a, const int8_t* b) {
  const __m128i both = _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(a)),
                                          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b)));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(both));
}

template <int R, int P>
void rows_wide(const float* x, const int8_t* w, const float* scales, float* out, int64_t m0, int64_t n0, int64_t n1,
               int64_t K, int64_t N) {
  constexpr int O = 2 * P;
  const int64_t body = K / 8 * 8;
  int64_t n = n0;
  for (; n + O <= n1; n += O) {
    __m512 acc[P][R];
    for (int p = 0; p < P; ++p)
      for (int r = 0; r < R; ++r) acc[p][r] = _mm512_setzero_ps();
    const char* next = reinterpret_cast<const char*>(w + (n + O) * K);
    const bool ahead = n + 2 * O <= n1;
    for (int64_t k = 0; k < body; k += 8) {
      if (ahead) _mm_prefetch(next + k * O, _MM_HINT_T0);
      __m512 xv[R];
      for (int r = 0; r < R; ++r) xv[r] = _mm512_broadcast_f32x8(_mm256_loadu_ps(x + (m0 + r) * K + k));
      for (int p = 0; p < P; ++p) {
        const __m512 wv = weights16(w + (n + 2 * p) * K + k, w + (n + 2 * p + 1) * K + k);
        for (int r = 0; r < R; ++r) acc[p][r] = _mm512_fmadd_ps(xv[r], wv, acc[p][r]);
      }
    }
    for (int p = 0; p < P; ++p)
      for (int r = 0; r < R; ++r) {
        const __m256 halves[2] = {_mm512_castps512_ps256(acc[p][r]), _mm512_extractf32x8_ps(acc[p][r], 1)};
        for (int h = 0; h < 2; ++h) {
          const int64_t o = n + 2 * p + h;
          const int8_t* wn = w + o * K;
          float sum = saker::sum8(halves[h]);
          for (int64_t k = body; k < K; ++k) sum = std::fma(x[(m0 + r) * K + k], static_cast<float>(wn[k]), sum);
          out[(m0 + r) * N + o] = sum * scales[o];
        }
      }
  }
  if (n < n1) rows<R, 1>(x, w, scales, out, m0, n, n1, K, N);  // an odd last output by the AVX2 path
}

// Rows [0, M) against outputs [n0, n1). Two pairs of outputs at a time at 5-8 rows too: 16 independent chains keep
// both FMA ports busy (SmolLM2's head at 8 / 16 / 32 rows: 0.92 / 0.91 / 0.90 the time of one pair, same process,
// AVX-512 Intel Xeon, 2026-11-28); the same bits, as every R and P give.
void columns_wide(const float* x, const int8_t* w, const float* scales, float* out, int64_t M, int64_t n0,
                  int64_t n1, int64_t K, int64_t N) {
  for (int64_t m = 0; m < M; m += 8) {
    switch (std::min<int64_t>(8, M - m)) {
      case 8: rows_wide<8, 2>(x, w, scales, out, m, n0, n1, K, N); break;
      case 7: rows_wide<7, 2>(x, w, scales, out, m, n0, n1, K, N); break;
      case 6: rows_wide<6, 2>(x, w, scales, out, m, n0, n1, K, N); break;
      case 5: rows_wide<5, 2>(x, w, scales, out, m, n0, n1, K, N); break;
      case 4: rows_wide<4, 2>(x, w, scales, out, m, n0, n1, K, N); break;
      case 3: rows_wide<3, 2>(x, w, scales, out, m, n0, n1, K, N); break;
      case 2: rows_wide<2, 2>(x, w, scales, out, m, n0, n1, K, N); break;
      default: rows_wide<1, 2>(x, w, scales, out, m, n0, n1, K, N);
    }
  }
}

#pragma GCC pop_options

}  // namespace

// x (M, K) float32; w (N, K) int8; scales (N,) float32; wide: the AVX-512 path (only where
// saker::wide_supported()), the same bits. Returns (M, N) float32.
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor w, torch::Tensor scales, bool wide) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x (M, K), w (N, K)");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kChar, "float32 x, int8 w");
  TORCH_CHECK(!wide || saker::wide_supported(), "the AVX-512 path on a CPU without AVX-512 VNNI");
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
    if (wide) return columns_wide(xp, wp, sp, op, M, n0, n1, K, N);
    for (int64_t m = 0; m < M; m += 8) {
      switch (std::min<int64_t>(8, M - m)) {
        case 8: rows<8, 1>(xp, wp, sp, op, m, n0, n1, K, N); break;
        case 7: rows<7, 1>(xp, wp, sp, op, m, n0, n1, K, N); break;
        case 6: rows<6, 1>(xp, wp, sp, op, m, n0, n1, K, N); break;
        case 5: rows<5, 1>(xp, wp, sp, op, m, n0, n1, K, N); break;
        case 4: rows<4, 2>(xp, wp, sp, op, m, n0, n1, K, N); break;
        case 3: rows<3, 2>(xp, wp, sp, op, m, n0, n1, K, N); break;
        case 2: rows<2, 4>(xp, wp, sp, op, m, n0, n1, K, N); break;
        default: rows<1, 4>(xp, wp, sp, op, m, n0, n1, K, N);
      }
    }
  });
  return out;
}
