// saker's CPU attention over the block pool, in float32, in a fixed order (built by app/engine/cpu_kernels.py).
//
// Every query row (one query head of one token) computes its scores, softmax and weighted sum over its own
// positions [lo, hi) in an order that depends on nothing but those positions: which other queries share its
// tile, how many rows the step has, and whether the token is a decode row, part of a prompt's chunk or a plain
// forward's query make no difference. So a position's output is the same, to the bit, on every path that computes
// it (app/engine/attention.py says why saker needs that).
//
//   scores   s[p] = sum_d (q[d] * scale) * k[p][d]: lane l of an 8-wide fused multiply-add accumulates d = l, l + 8,
//            ...; the 8 lanes are summed in one fixed tree (reduce8). Positions go 8 at a time, in groups aligned
//            to absolute positions.
//   softmax  the row's max, then e[p] = exp(s[p] - max) (exp8: one polynomial for every lane; a masked position is
//            exactly 0), summed in 8 lanes (p - lo = lane, lane + 8, ...) in ascending order, then the same tree.
//   output   o[d] = (sum_p e[p] * v[p][d]) / sum: fused multiply-adds over p ascending, for each d.
//
// Queries that share a table row (a prompt's chunk) go in tiles of up to TILE, so each key and value is read once
// per tile; tiles x kv heads are shared among the threads. Keys and values are read in place from the pool: slot
// (block * BLOCK + offset), then kv head, then head dim.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "lanes.h"

using saker::exp8;
using saker::max8;
using saker::reduce8;
using saker::sum8;

namespace {

constexpr int64_t BLOCK = 16;  // positions per block (app/engine/blocks.py BLOCK)
constexpr int64_t TILE = 16;   // queries of one table row computed together
// How many groups of 8 positions ahead the scores ask for their keys (and the weighted sums for the next block's
// values). The pool is read a head's row at a time at a stride of all heads' rows, block by block in the table's
// order, which the hardware's prefetch follows poorly: at 512-2048 positions (32 decode rows, SmolLM2's heads) the
// kernel read about 8 GB/s of 19.5 from memory, and took 0.75 ms a call with the same blocks in cache against
// 3.1 ms from memory. Asking ahead made it 0.89-0.92x the time there (1-4 groups ahead alike; nothing at 80).
constexpr int64_t AHEAD = 2;

// The cache lines of one head's row (D floats) asked for.
template <int64_t D>
inline void prefetch_row(const float* row) {
  for (int64_t c = 0; c < D; c += 16) _mm_prefetch(reinterpret_cast<const char*>(row + c), _MM_HINT_T0);
}

template <int ND>  // head dim / 8
void attend_tile(const float* q, const float* keys, const float* values, const int64_t* table, const int64_t* lo,
                 const int64_t* hi, float* out, int64_t a, int64_t b, int64_t kvh, int64_t Hq, int64_t Hkv,
                 float scale) {
  constexpr int64_t D = ND * 8;
  const int64_t group = Hq / Hkv, m = (b - a) * group, stride = Hkv * D;
  int64_t first = INT64_MAX, last = 0;
  for (int64_t i = a; i < b; ++i) {
    if (hi[i] > lo[i]) {
      first = std::min(first, lo[i]);
      last = std::max(last, hi[i]);
    }
  }
  for (int64_t r = 0; r < m; ++r) {  // rows with no position: zeros
    const int64_t i = a + r / group;
    if (hi[i] <= lo[i]) std::fill_n(out + (i * Hq + kvh * group + r % group) * D, D, 0.f);
  }
  if (first >= last) return;
  const int64_t base = first / 8 * 8, width = (last + 7) / 8 * 8 - base;
  const int64_t row = width + 8;  // a row's scores, and room for its last group of 8 counted from its lo
  std::vector<float> qs(m * D), s(m * row), acc(m * D, 0.f), total(m);
  for (int64_t r = 0; r < m; ++r) {
    const float* src = q + ((a + r / group) * Hq + kvh * group + r % group) * D;
    for (int64_t d = 0; d < D; ++d) qs[r * D + d] = src[d] * scale;
  }
  // scores, 8 positions at a time
  for (int64_t g = base; g < base + width; g += 8) {
    const float* k[8];
    const int64_t slot = table[g / BLOCK] * BLOCK + g % BLOCK;
    for (int t = 0; t < 8; ++t) k[t] = keys + (slot + t) * stride + kvh * D;
    if (g + 8 * AHEAD < base + width) {  // the keys AHEAD groups on, asked for now (see AHEAD)
      const int64_t next = g + 8 * AHEAD, ahead = table[next / BLOCK] * BLOCK + next % BLOCK;
      for (int t = 0; t < 8; ++t) prefetch_row<D>(keys + (ahead + t) * stride + kvh * D);
    }
    for (int64_t r = 0; r < m; ++r) {
      const int64_t i = a + r / group;
      if (g >= hi[i] || g + 8 <= lo[i]) continue;
      __m256 sums[8];
      for (int t = 0; t < 8; ++t) sums[t] = _mm256_setzero_ps();
      const float* qr = qs.data() + r * D;
      for (int c = 0; c < ND; ++c) {
        const __m256 qv = _mm256_loadu_ps(qr + c * 8);
        for (int t = 0; t < 8; ++t) sums[t] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[t] + c * 8), sums[t]);
      }
      _mm256_storeu_ps(s.data() + r * row + (g - base), reduce8(sums));
    }
  }
  // softmax weights (unnormalised) and their sums
  const __m256 ninf = _mm256_set1_ps(-INFINITY);
  const __m256 lanes = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t r = 0; r < m; ++r) {
    const int64_t i = a + r / group;
    if (hi[i] <= lo[i]) continue;
    // groups of 8 from the row's own first position (so the sum's order does not move with where the row's
    // positions start: a left-padded plain forward sums as the engine does)
    const int64_t g0 = lo[i], g1 = hi[i];
    float* sr = s.data() + r * row - base;
    __m256 mx = ninf;
    for (int64_t g = g0; g < g1; g += 8) {
      const __m256 p = _mm256_add_ps(lanes, _mm256_set1_ps(static_cast<float>(g)));
      const __m256 keep = _mm256_cmp_ps(p, _mm256_set1_ps(static_cast<float>(hi[i])), _CMP_LT_OQ);
      const __m256 v = _mm256_blendv_ps(ninf, _mm256_loadu_ps(sr + g), keep);
      _mm256_storeu_ps(sr + g, v);
      mx = _mm256_max_ps(mx, v);
    }
    const __m256 top = _mm256_set1_ps(max8(mx));
    __m256 sum = _mm256_setzero_ps();
    for (int64_t g = g0; g < g1; g += 8) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sr + g), top));
      _mm256_storeu_ps(sr + g, e);
      sum = _mm256_add_ps(sum, e);
    }
    total[r] = sum8(sum);
  }
  // weighted sums of the values, a block at a time
  for (int64_t blk = first / BLOCK; blk * BLOCK < last; ++blk) {
    const int64_t p0 = blk * BLOCK;
    const float* vb = values + table[blk] * BLOCK * stride + kvh * D;
    if ((blk + 1) * BLOCK < last) {  // the next block's values, asked for now
      const float* vn = values + table[blk + 1] * BLOCK * stride + kvh * D;
      for (int64_t p = 0; p < BLOCK; ++p) prefetch_row<D>(vn + p * stride);
    }
    for (int64_t r = 0; r < m; ++r) {
      const int64_t i = a + r / group;
      const int64_t from = std::max(p0, lo[i]), to = std::min(p0 + BLOCK, hi[i]);
      if (from >= to) continue;
      __m256 o[ND];
      float* ar = acc.data() + r * D;
      for (int c = 0; c < ND; ++c) o[c] = _mm256_loadu_ps(ar + c * 8);
      const float* wr = s.data() + r * row - base;
      for (int64_t p = from; p < to; ++p) {
        const __m256 w = _mm256_set1_ps(wr[p]);
        const float* v = vb + (p - p0) * stride;
        for (int c = 0; c < ND; ++c) o[c] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + c * 8), o[c]);
      }
      for (int c = 0; c < ND; ++c) _mm256_storeu_ps(ar + c * 8, o[c]);
    }
  }
  for (int64_t r = 0; r < m; ++r) {
    const int64_t i = a + r / group;
    if (hi[i] <= lo[i]) continue;
    const __m256 inv = _mm256_set1_ps(1.f / total[r]);
    float* dst = out + (i * Hq + kvh * group + r % group) * D;
    for (int c = 0; c < ND; ++c) _mm256_storeu_ps(dst + c * 8, _mm256_mul_ps(_mm256_loadu_ps(acc.data() + r * D + c * 8), inv));
  }
}

using TileFn = void (*)(const float*, const float*, const float*, const int64_t*, const int64_t*, const int64_t*,
                        float*, int64_t, int64_t, int64_t, int64_t, int64_t, float);

TileFn tile_fn(int64_t head_dim) {
  switch (head_dim) {
    case 16: return attend_tile<2>;
    case 32: return attend_tile<4>;
    case 64: return attend_tile<8>;
    case 128: return attend_tile<16>;
    default: return nullptr;
  }
}

}  // namespace

bool attention_supports(int64_t head_dim) { return tile_fn(head_dim) != nullptr; }

// q (T, Hq, D); keys, values (slots, Hkv, D), slots in blocks of BLOCK; tables (R, B) block ids; which (T,) each
// query's table row; lo, hi (T,) the positions each query attends over, [lo, hi). Returns (T, Hq, D).
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor keys, torch::Tensor values, torch::Tensor tables,
                     torch::Tensor which, torch::Tensor lo, torch::Tensor hi, double scale) {
  TORCH_CHECK(q.dim() == 3 && keys.dim() == 3 && values.dim() == 3, "q, keys, values: (tokens|slots, heads, dim)");
  TORCH_CHECK(q.scalar_type() == at::kFloat && keys.scalar_type() == at::kFloat && values.scalar_type() == at::kFloat,
              "float32 only");
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous() && keys.sizes() == values.sizes(), "pool layout");
  q = q.contiguous();
  tables = tables.contiguous();
  which = which.contiguous();
  lo = lo.contiguous();
  hi = hi.contiguous();
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = keys.size(1), B = tables.size(1);
  TORCH_CHECK(keys.size(2) == D && Hq % Hkv == 0, "heads or head dim");
  const TileFn fn = tile_fn(D);
  TORCH_CHECK(fn != nullptr, "head dim ", D, " is not supported");
  auto out = torch::empty_like(q);
  const int64_t* wp = which.data_ptr<int64_t>();
  std::vector<std::pair<int64_t, int64_t>> tiles;
  for (int64_t i = 0; i < T;) {
    int64_t j = i + 1;
    while (j < T && j - i < TILE && wp[j] == wp[i]) ++j;
    tiles.emplace_back(i, j);
    i = j;
  }
  const int64_t items = static_cast<int64_t>(tiles.size()) * Hkv;
  const float* qp = q.data_ptr<float>();
  const float* kp = keys.data_ptr<float>();
  const float* vp = values.data_ptr<float>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lo.data_ptr<int64_t>();
  const int64_t* hp = hi.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), items));
#pragma omp parallel for schedule(dynamic, 1) num_threads(std::max(threads, 1))
  for (int64_t item = 0; item < items; ++item) {
    const auto [a, b] = tiles[item / Hkv];
    fn(qp, kp, vp, tp + wp[a] * B, lp, hp, op, a, b, item % Hkv, Hq, Hkv, sc);
  }
  return out;
}
