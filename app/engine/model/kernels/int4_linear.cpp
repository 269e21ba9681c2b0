// x @ W.T for int4 weights in groups of 32 (w = q * scale + min, q in 0..15), with float32 inputs and outputs
// (built by app/engine/model/cpu_kernels.py; the CPU layout of quantize.Int4Linear).
//
// Integer dot products: each row of x is quantized per group of 32 inputs to int16 (d = max |x| / 32767,
// xq = round-half-even(x * 32767 / max |x|), so x ~ d * xq, within 2^-16 of the group's largest input), then for
// each group
//   sum_k x_k w_k  ~  d * scale * sum_k xq_k q_k + d * sum_k xq_k * min,
// where sum_k xq_k q_k is exact in integers (_mm256_madd_epi16: 0..15 x -32767..32767 pairs into int32 lanes) and
// so is its float (|sum| <= 32 * 15 * 32767 < 2^24).
// int8 inputs (llama.cpp's Q8_1, _mm256_maddubs_epi16) ran 6-21 % faster here but moved the embedded SmolLM2's
// logprobs 2.4x further from its float32 ones (0.116 against 0.049; PyTorch's bfloat16 inputs 0.075); int16
// inputs are finer than bfloat16's 8 bits.
//
// Lanes over outputs: a vector holds 8 outputs (a tile), so a group's whole integer dot of each output ends in its
// own lane and the float work per group (the conversion, d * scale, the min term) is shared by 8 outputs. Float
// rounding happens only there: output (m, n) = fma over groups g in order of (dot_g * (d_g * scale_g)) then
// (d_g * sum(xq_g)) * min_g, an order that depends on K alone, so a row's outputs are the same bits however many
// rows come with it. Rows go 4 at a time over a tile (its codes unpacked once per 4). Against lanes over inputs
// (each output's group split over 8 lanes, summed at the end) this took 0.61-0.78x the time at 1-32 rows.
//
// Weight layout, (N / 8, K / 32, 8, 16) bytes (stored as (N, K / 2)): tile t, group g, chunk c, byte 2 * o + e
// holds q[8t + o][32g + 2c + e] in its low nibble and q[8t + o][32g + 2c + 16 + e] in its high one, so one
// 16-byte load widened to int16 gives the codes of input pairs c and c + 8 for the tile's 8 outputs, each pair
// against one broadcast pair of xq in _mm256_madd_epi16. Scales and mins (N / 8, K / 32, 8) float32 (stored as
// (N, K / 32)): tile t, group g, output o.

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

// A chunk's 32 codes as two vectors of 16 int16: input pairs c (the low nibbles) and c + 8 (the high ones), each
// as (output 0: inputs 2c, 2c + 1), (output 1: ...), ..., (output 7: ...).
struct Codes {
  __m256i low, high;
};

inline Codes unpack(const uint8_t* w) {
  // each byte widened to 16 bits (both its codes in one lane), then the low nibble masked and the high one shifted
  const __m256i both = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
  return {_mm256_and_si256(both, _mm256_set1_epi16(0x0F)), _mm256_srli_epi16(both, 4)};
}

// Two int16 inputs (a pair) in every 32-bit lane.
inline __m256i pair(const int16_t* x) { return _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(x)); }

// Rows m0 .. m0 + R of the outputs of tiles [t0, t1): per tile and group, each row's 8 exact integer dots (one per
// output) in an int32 accumulator, then converted and fused into the row's float accumulator (see the top).
// Tiles of 2 at a time and unrolling the chunks were slower here (registers run out: 16 on AVX2).
template <int R>
void rows(const int16_t* xq, const float* d, const float* dsum, const uint8_t* w, const float* scales,
          const float* mins, float* out, int64_t m0, int64_t t0, int64_t t1, int64_t K, int64_t N) {
  const int64_t G = K / GROUP;
  const bool further = N / 8 > t1;  // the next tile lies beyond these (the thread's next item reads it)
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* wt = w + t * G * 128;
    const float* st = scales + t * G * 8;
    const float* mt = mins + t * G * 8;
    const bool ahead = (t + 1 < t1 || further);
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      if (ahead) {  // the next tile's group g: its codes, scales and mins (short runs the hardware's prefetch misses)
        const char* next = reinterpret_cast<const char*>(wt + G * 128 + g * 128);
        _mm_prefetch(next, _MM_HINT_T0);
        _mm_prefetch(next + 64, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(st + G * 8 + g * 8), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(mt + G * 8 + g * 8), _MM_HINT_T0);
      }
      __m256i dot[R];
      for (int r = 0; r < R; ++r) dot[r] = _mm256_setzero_si256();
      for (int c = 0; c < 8; ++c) {
        const Codes q = unpack(wt + (g * 8 + c) * 16);
        for (int r = 0; r < R; ++r) {
          const int16_t* xm = xq + (m0 + r) * K + g * GROUP + 2 * c;
          const __m256i pairs = _mm256_add_epi32(_mm256_madd_epi16(q.low, pair(xm)), _mm256_madd_epi16(q.high, pair(xm + 16)));
          dot[r] = _mm256_add_epi32(dot[r], pairs);
        }
      }
      const __m256 sc = _mm256_loadu_ps(st + g * 8), mn = _mm256_loadu_ps(mt + g * 8);
      for (int r = 0; r < R; ++r) {
        const int64_t m = m0 + r;
        const __m256 dm = _mm256_broadcast_ss(d + m * G + g);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]), _mm256_mul_ps(dm, sc), acc[r]);
        acc[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(dsum + m * G + g), mn, acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + (m0 + r) * N + t * 8, acc[r]);
  }
}


// The same arithmetic with AVX-512 (VNNI), where the CPU has it: a 512-bit vector holds two tiles (16 outputs), the
// pair products and their sum in one _mm512_dpwssd_epi32 (exact in int32, as _mm256_madd_epi16 then adds), and the
// float work per group the same operations lane by lane (conversion, d * scale, the two fused multiply-adds in the
// same order). So every output is the same bits as the AVX2 path's, on every CPU. 32 registers take 8 rows at a time.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vnni")

inline __m512 two_tiles(const float* a, const float* b) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(a)), _mm256_loadu_ps(b), 1);
}

// Rows m0 .. m0 + R of tiles t, t + 1 for each even t in [t0, t1) (t1 - t0 even).
template <int R>
void rows_wide(const int16_t* xq, const float* d, const float* dsum, const uint8_t* w, const float* scales,
               const float* mins, float* out, int64_t m0, int64_t t0, int64_t t1, int64_t K, int64_t N) {
  const int64_t G = K / GROUP;
  const __m512i nibble = _mm512_set1_epi16(0x0F);
  const bool further = N / 8 > t1 + 1;  // the next pair lies beyond this item (the thread's next one reads it)
  for (int64_t t = t0; t < t1; t += 2) {
    const uint8_t* wa = w + t * G * 128;
    const uint8_t* wb = wa + G * 128;
    const float* sa = scales + t * G * 8;
    const float* ma = mins + t * G * 8;
    const bool ahead = (t + 3 < t1 || further);
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      if (ahead) {  // the next pair's group g: its codes, scales and mins (short runs the hardware's prefetch misses)
        const char* next = reinterpret_cast<const char*>(wa + 2 * G * 128 + g * 128);
        _mm_prefetch(next, _MM_HINT_T0);
        _mm_prefetch(next + 64, _MM_HINT_T0);
        _mm_prefetch(next + G * 128, _MM_HINT_T0);
        _mm_prefetch(next + G * 128 + 64, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(sa + 2 * G * 8 + g * 8), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(sa + 3 * G * 8 + g * 8), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(ma + 2 * G * 8 + g * 8), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(ma + 3 * G * 8 + g * 8), _MM_HINT_T0);
      }
      __m512i dot[R];
      for (int r = 0; r < R; ++r) dot[r] = _mm512_setzero_si512();
      for (int c = 0; c < 8; ++c) {
        const int64_t at = (g * 8 + c) * 16;
        const __m256i bytes = _mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wa + at))),
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + at)), 1);
        const __m512i both = _mm512_cvtepu8_epi16(bytes);
        const __m512i low = _mm512_and_si512(both, nibble), high = _mm512_srli_epi16(both, 4);
        for (int r = 0; r < R; ++r) {
          const int16_t* xm = xq + (m0 + r) * K + g * GROUP + 2 * c;
          dot[r] = _mm512_dpwssd_epi32(dot[r], low, _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(xm)));
          dot[r] = _mm512_dpwssd_epi32(dot[r], high, _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(xm + 16)));
        }
      }
      const __m512 sc = two_tiles(sa + g * 8, sa + (G + g) * 8), mn = two_tiles(ma + g * 8, ma + (G + g) * 8);
      for (int r = 0; r < R; ++r) {
        const int64_t m = m0 + r;
        const __m512 dm = _mm512_set1_ps(d[m * G + g]);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), _mm512_mul_ps(dm, sc), acc[r]);
        acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(dsum[m * G + g]), mn, acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + (m0 + r) * N + t * 8, acc[r]);
  }
}

// Outputs of tiles [t0, t1) for all M rows, 8 rows at a time; an odd last tile by the AVX2 path (the same bits).
void columns_wide(const int16_t* xq, const float* d, const float* dsum, const uint8_t* w, const float* scales,
                  const float* mins, float* out, int64_t M, int64_t t0, int64_t t1, int64_t K, int64_t N) {
  const int64_t even = t0 + (t1 - t0) / 2 * 2;
  for (int64_t m = 0; m < M; m += 8) {
    switch (std::min<int64_t>(8, M - m)) {
      case 8: rows_wide<8>(xq, d, dsum, w, scales, mins, out, m, t0, even, K, N); break;
      case 7: rows_wide<7>(xq, d, dsum, w, scales, mins, out, m, t0, even, K, N); break;
      case 6: rows_wide<6>(xq, d, dsum, w, scales, mins, out, m, t0, even, K, N); break;
      case 5: rows_wide<5>(xq, d, dsum, w, scales, mins, out, m, t0, even, K, N); break;
      case 4: rows_wide<4>(xq, d, dsum, w, scales, mins, out, m, t0, even, K, N); break;
      case 3: rows_wide<3>(xq, d, dsum, w, scales, mins, out, m, t0, even, K, N); break;
      case 2: rows_wide<2>(xq, d, dsum, w, scales, mins, out, m, t0, even, K, N); break;
      default: rows_wide<1>(xq, d, dsum, w, scales, mins, out, m, t0, even, K, N);
    }
  }
  if (even < t1)
    for (int64_t m = 0; m < M; ++m) rows<1>(xq, d, dsum, w, scales, mins, out, m, even, t1, K, N);
}

#pragma GCC pop_options

}  // namespace

// x (M, K) float32, K a multiple of 32; specs: (w, scales, mins) per product, w (N, K / 2) uint8, scales and mins
// (N, K / 32) float32, in the layout above (N a multiple of 8); wide: the AVX-512 path (only where
// saker::wide_supported()), the same bits. Returns each product's (M, N) float32. Products of one input (a layer's
// q, k and v; its gate and up) share x's quantization and one parallel region: their items of 32 outputs are shared
// among the threads together. Each output is computed by one item, as a product alone computes it, so the bits are
// each product's alone (at 1 row a product's fixed costs, not its arithmetic, were most of the small ones' time).
std::vector<torch::Tensor> int4_linears(torch::Tensor x, const std::vector<torch::Tensor>& specs, bool wide) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % GROUP == 0 && x.scalar_type() == at::kFloat,
              "float32 x (M, K) with K in groups of 32");
  TORCH_CHECK(!specs.empty() && specs.size() % 3 == 0, "(w, scales, mins) per product");
  TORCH_CHECK(!wide || saker::wide_supported(), "the AVX-512 path on a CPU without AVX-512 VNNI");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), G = K / GROUP, P = static_cast<int64_t>(specs.size() / 3);
  struct Product {
    const uint8_t* w;
    const float *scales, *mins;
    float* out;
    int64_t N;
  };
  std::vector<torch::Tensor> held, outs;  // contiguous copies (where a spec was not), and the outputs
  std::vector<Product> products;
  std::vector<std::pair<int64_t, int64_t>> items;  // (product, first output) of each item of 32 outputs
  for (int64_t p = 0; p < P; ++p) {
    auto w = specs[3 * p].contiguous(), scales = specs[3 * p + 1].contiguous(), mins = specs[3 * p + 2].contiguous();
    TORCH_CHECK(w.dim() == 2 && w.size(1) * 2 == K && w.scalar_type() == at::kByte, "uint8 w (N, K / 2)");
    TORCH_CHECK(scales.scalar_type() == at::kFloat && mins.scalar_type() == at::kFloat, "float32 scales and mins");
    const int64_t N = w.size(0);
    TORCH_CHECK(scales.numel() == N * G && mins.numel() == N * G, "scales and mins (N, K / 32)");
    TORCH_CHECK(N % 8 == 0, "outputs in tiles of 8");
    outs.push_back(torch::empty({M, N}, x.options()));
    products.push_back({w.data_ptr<uint8_t>(), scales.data_ptr<float>(), mins.data_ptr<float>(),
                        outs.back().data_ptr<float>(), N});
    held.insert(held.end(), {w, scales, mins});
    for (int64_t n = 0; n < N; n += 32) items.emplace_back(p, n);
  }
  if (M == 0 || items.empty()) return outs;
  std::vector<int16_t> xq(M * K);
  std::vector<float> d(M * G), dsum(M * G);
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) quantize_row(xp + m * K, K, &xq[m * K], &d[m * G], &dsum[m * G]);
  });
  saker::over_columns(static_cast<int64_t>(items.size()), 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const Product& pr = products[items[i].first];
      const int64_t n0 = items[i].second, n1 = std::min(pr.N, n0 + 32), N = pr.N;
      if (wide) {
        columns_wide(xq.data(), d.data(), dsum.data(), pr.w, pr.scales, pr.mins, pr.out, M, n0 / 8, n1 / 8, K, N);
        continue;
      }
      for (int64_t m = 0; m < M; m += 4) {
        switch (std::min<int64_t>(4, M - m)) {
          case 4: rows<4>(xq.data(), d.data(), dsum.data(), pr.w, pr.scales, pr.mins, pr.out, m, n0 / 8, n1 / 8, K, N); break;
          case 3: rows<3>(xq.data(), d.data(), dsum.data(), pr.w, pr.scales, pr.mins, pr.out, m, n0 / 8, n1 / 8, K, N); break;
          case 2: rows<2>(xq.data(), d.data(), dsum.data(), pr.w, pr.scales, pr.mins, pr.out, m, n0 / 8, n1 / 8, K, N); break;
          default: rows<1>(xq.data(), d.data(), dsum.data(), pr.w, pr.scales, pr.mins, pr.out, m, n0 / 8, n1 / 8, K, N);
        }
      }
    }
  });
  return outs;
}

// One product: ``int4_linears`` with one spec. Returns (M, N) float32.
torch::Tensor int4_linear(torch::Tensor x, torch::Tensor w, torch::Tensor scales, torch::Tensor mins, bool wide) {
  return int4_linears(std::move(x), {std::move(w), std::move(scales), std::move(mins)}, wide)[0];
}
