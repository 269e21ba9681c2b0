// Fixed-order 8-lane helpers shared by saker's CPU kernels (AVX2 + FMA): each result depends on its own inputs
// only, never on what else is computed beside it.
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>

namespace saker {

// e^x for 8 lanes (a Cephes-style polynomial after reduction by ln 2); lanes below -88.376 (masked ones: -inf)
// are exactly 0. Elementwise: a lane's result depends on its input only.
inline __m256 exp8(__m256 x) {
  const __m256 low = _mm256_set1_ps(-88.3762626647949f);
  const __m256 gone = _mm256_cmp_ps(x, low, _CMP_LT_OQ);
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)), low);
  __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  const __m256 z = _mm256_mul_ps(x, x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_add_ps(_mm256_fmadd_ps(y, z, x), _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(gone, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

// Lane t of the result: the 8 lanes of a[t] summed as ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7)).
inline __m256 reduce8(const __m256* a) {
  const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20), _mm256_permute2f128_ps(h0, h1, 0x31));
}

// The same tree for one vector's lanes: ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)).
inline float sum8(__m256 v) {
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(v, v), _mm256_hadd_ps(v, v));
  return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
}

inline float max8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// Whether this CPU runs the kernels' AVX-512 paths (``wide``: AVX-512 F, BW, DQ and VNNI, the OS saving their
// registers). Each such path gives every output the AVX2 path's bits: the same operations lane by lane, more lanes.
inline bool wide_supported() {
  static const bool supported = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vnni");
  }();
  return supported;
}

// body(n0, n1) over outputs [0, N) in items of ``columns`` outputs, the items shared statically by at most torch's
// threads (OpenMP). Each output is computed by one item only, so its numbers do not depend on the split.
template <typename Body>
inline void over_columns(int64_t N, int64_t columns, Body body) {
  const int64_t items = (N + columns - 1) / columns;
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items)));
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t item = 0; item < items; ++item) body(item * columns, std::min(N, (item + 1) * columns));
}

}  // namespace saker
