// x @ W.T for int4 weights in groups of 32 (w = q * scale + min, q in 0..15), with float32 inputs and outputs
// (built by app/engine/model/cpu_kernels.py; the CPU layout of quantize.Int4Linear).
//
// Integer dot products: each row of x is quantized per group of 32 inputs to int16 (d = max |x| / 32767,
// xq = round-half-even(x * 32767 / max |x|), so x ~ d * xq, within 2^-16 of the group's largest input), then for
// each group
//   sum_k x_k w_k  ~  d * scale * sum_k xq_k q_k + d * sum_k xq_k * min,
// where sum_k xq_k q_k is exact in integers (_mm256_madd_epi16: 0..15 x -32767..32767 pairs into int32 lanes).
// int8 inputs (llama.cpp's Q8_1, _mm256_maddubs_epi16) ran 6-21 % faster here but moved the embedded SmolLM2's
// logprobs 2.4x further from its float32 ones (0.116 against 0.049; PyTorch's bfloat16 inputs 0.075); int16
// inputs are finer than bfloat16's 8 bits. Float rounding happens only when the groups are summed (``rows``), in an order that
// depends on K alone, so a row's outputs are the same bits however many rows come with it. Rows go 4 at a time
// over each pair of weight rows (their codes unpacked once per 4).
//
// Weight layout: (N, K / 32, 16) bytes, byte j of a group holding q_j in its low nibble and q_{j+16} in its high one.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "lanes.h"

namespace {

constexpr int64_t GROUP = 32;
constexpr float LIMIT = 32767.0f;  // the int16 codes of a group span -LIMIT..LIMIT
// How far ahead a lone row's loop asks for its weights (bytes), and its scales and mins (a quarter as far in
// floats). The hardware's own prefetch left the 1-row products at 8-10 GB/s of about 20 from memory; prefetching
// 1 KiB ahead changed nothing, 4-16 KiB ahead a line per 4 groups made them 5-8 % faster (4 lines per 16
// groups: 3 %). Rows in tiles of 2-4 are not memory-bound and do not prefetch (7 % slower with it).
constexpr int64_t PREFETCH = 16384;

// Row m of x quantized per group: codes (K) int16, d (G) and d * sum(codes) (G) per group: x * (32767 / max |x|)
// rounded half to even (cvtps under the default rounding mode).
void quantize_row(const float* x, int64_t K, int16_t* codes, float* d, float* dsum) {
  const int64_t G = K / GROUP;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t g = 0; g < G; ++g) {
    const float* xg = x + g * GROUP;
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(xg + 8 * i);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    }
    const float top = saker::max8(amax);
    const __m256 inv = _mm256_set1_ps(top > 0.0f ? LIMIT / top : 0.0f);
    __m256i q[4];
    __m256i sum = _mm256_setzero_si256();
    for (int i = 0; i < 4; ++i) {
      q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
      q[i] = _mm256_max_epi32(_mm256_min_epi32(q[i], _mm256_set1_epi32(32767)), _mm256_set1_epi32(-32767));
      sum = _mm256_add_epi32(sum, q[i]);
    }
    for (int i = 0; i < 4; i += 2) {  // packs interleaves the 128-bit halves; permute4x64 puts them back in order
      const __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[i], q[i + 1]), 0xD8);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + g * GROUP + 8 * i), packed);
    }
    const __m128i half = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    const __m128i quarter = _mm_add_epi32(half, _mm_unpackhi_epi64(half, half));
    const int32_t total = _mm_cvtsi128_si32(_mm_add_epi32(quarter, _mm_shuffle_epi32(quarter, 1)));
    d[g] = top / LIMIT;
    dsum[g] = d[g] * static_cast<float>(total);
  }
}

// A group's 32 codes as two vectors of 16 int16: codes 0..15 (the low nibbles), codes 16..31 (the high ones).
struct Codes {
  __m256i low, high;
};

inline Codes unpack(const uint8_t* w) {
  // each byte widened to 16 bits (both its codes in one lane), then the low nibble masked and the high one shifted
  const __m256i both = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
  return {_mm256_and_si256(both, _mm256_set1_epi16(0x0F)), _mm256_srli_epi16(both, 4)};
}

// The 8 int32 partial sums of q x xq over one group (exact: |sum| <= 32 * 15 * 32767 < 2^24, so its float is too).
inline __m256i dot32(const Codes& q, const int16_t* xq) {
  const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
  const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 16));
  return _mm256_add_epi32(_mm256_madd_epi16(q.low, x0), _mm256_madd_epi16(q.high, x1));
}

// sum_g a[g] * b[g] in one fixed order: 8 lanes over g, the tree, then the tail in order.
inline float dot_groups(const float* a, const float* b, int64_t G) {
  const int64_t body = G / 8 * 8;
  __m256 acc = _mm256_setzero_ps();
  for (int64_t g = 0; g < body; g += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + g), _mm256_loadu_ps(b + g), acc);
  float sum = saker::sum8(acc);
  for (int64_t g = body; g < G; ++g) sum = std::fma(a[g], b[g], sum);
  return sum;
}

// Output (m, n) = sum over groups of d * scale * dot + d * sum(xq) * min. Each group's 8 exact integer partial dots
// are converted to floats and fused into the output's 8-lane accumulator times d * scale, group after group; then
// its lanes are summed in one fixed tree and the min terms (``dot_groups``) added. The order depends on K alone.
// Two weight rows go together (N is even: whole groups of 16 outputs), so R rows x 2 outputs make 2R independent
// chains and each row's codes serve both.
template <int R>
void rows(const int16_t* xq, const float* d, const float* dsum, const uint8_t* w, const float* scales,
          const float* mins, float* out, int64_t m0, int64_t n0, int64_t n1, int64_t K, int64_t N) {
  const int64_t G = K / GROUP;
  constexpr int64_t BYTES = GROUP / 2;
  for (int64_t n = n0; n < n1; n += 2) {
    const uint8_t* w0 = w + n * G * BYTES;
    const uint8_t* w1 = w0 + G * BYTES;
    const float* s0 = scales + n * G;
    const float* s1 = s0 + G;
    __m256 acc[2][R];
    for (int r = 0; r < R; ++r) acc[0][r] = acc[1][r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      if (R == 1 && (g & 3) == 0) {  // a lone row streams its weights: ask for them PREFETCH ahead, a line at a time
        _mm_prefetch(reinterpret_cast<const char*>(w0 + g * BYTES + PREFETCH), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(w1 + g * BYTES + PREFETCH), _MM_HINT_T0);
      }
      if (R == 1 && (g & 15) == 0) {
        _mm_prefetch(reinterpret_cast<const char*>(s0 + g + PREFETCH / 4), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(s1 + g + PREFETCH / 4), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(mins + n * G + g + PREFETCH / 4), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(mins + (n + 1) * G + g + PREFETCH / 4), _MM_HINT_T0);
      }
      const Codes q0 = unpack(w0 + g * BYTES), q1 = unpack(w1 + g * BYTES);
      const __m256 sc0 = _mm256_broadcast_ss(s0 + g), sc1 = _mm256_broadcast_ss(s1 + g);
      for (int r = 0; r < R; ++r) {
        const int64_t m = m0 + r;
        const int16_t* xm = xq + m * K + g * GROUP;
        const __m256 dm = _mm256_broadcast_ss(d + m * G + g);
        acc[0][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32(q0, xm)), _mm256_mul_ps(dm, sc0), acc[0][r]);
        acc[1][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32(q1, xm)), _mm256_mul_ps(dm, sc1), acc[1][r]);
      }
    }
    for (int r = 0; r < R; ++r) {
      const int64_t m = m0 + r;
      for (int c = 0; c < 2; ++c)
        out[m * N + n + c] = saker::sum8(acc[c][r]) + dot_groups(dsum + m * G, mins + (n + c) * G, G);
    }
  }
}

}  // namespace

// x (M, K) float32, K a multiple of 32; w (N, K / 2) uint8 in the layout above; scales, mins (N, K / 32) float32.
// Returns (M, N) float32.
torch::Tensor int4_linear(torch::Tensor x, torch::Tensor w, torch::Tensor scales, torch::Tensor mins) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) % GROUP == 0 && w.size(1) * 2 == x.size(1),
              "x (M, K) with K in groups of 32, w (N, K / 2)");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kByte, "float32 x, uint8 w");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && mins.scalar_type() == at::kFloat, "float32 scales and mins");
  x = x.contiguous();
  w = w.contiguous();
  scales = scales.contiguous();
  mins = mins.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), G = K / GROUP;
  TORCH_CHECK(scales.numel() == N * G && mins.numel() == N * G, "scales and mins (N, K / 32)");
  TORCH_CHECK(N % 2 == 0, "an even number of outputs");
  auto out = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  std::vector<int16_t> xq(M * K);
  std::vector<float> d(M * G), dsum(M * G);
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) quantize_row(xp + m * K, K, &xq[m * K], &d[m * G], &dsum[m * G]);
  });
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* mp = mins.data_ptr<float>();
  float* op = out.data_ptr<float>();
  saker::over_columns(N, 32, [&](int64_t n0, int64_t n1) {
    for (int64_t m = 0; m < M; m += 4) {
      switch (std::min<int64_t>(4, M - m)) {
        case 4: rows<4>(xq.data(), d.data(), dsum.data(), wp, sp, mp, op, m, n0, n1, K, N); break;
        case 3: rows<3>(xq.data(), d.data(), dsum.data(), wp, sp, mp, op, m, n0, n1, K, N); break;
        case 2: rows<2>(xq.data(), d.data(), dsum.data(), wp, sp, mp, op, m, n0, n1, K, N); break;
        default: rows<1>(xq.data(), d.data(), dsum.data(), wp, sp, mp, op, m, n0, n1, K, N);
      }
    }
  });
  return out;
}
