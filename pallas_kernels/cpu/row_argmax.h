// The index of a row's largest value, as jnp.argmax gives it: the first index of the
// maximum, a NaN counting as the maximum (the first NaN's index). Shared by the argmax kernel
// (argmax.cc) and the greedy head (dense_matmul.cc).
//
// The row is read once for its maximum at memory speed, then again from cache for the first
// index that holds it.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>

namespace xlaserve {

inline int32_t RowArgmax(const float* x, int64_t V) {
  int64_t i = 0;
  float best = -INFINITY;
  if (V >= 32) {
    __m256 m0 = _mm256_set1_ps(-INFINITY), m1 = m0, m2 = m0, m3 = m0;
    __m256 nan = _mm256_setzero_ps();  // lanes that saw a NaN are all ones
    for (; i + 32 <= V; i += 32) {
      const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
      const __m256 c = _mm256_loadu_ps(x + i + 16), d = _mm256_loadu_ps(x + i + 24);
      nan = _mm256_or_ps(nan, _mm256_or_ps(_mm256_cmp_ps(a, b, _CMP_UNORD_Q),
                                           _mm256_cmp_ps(c, d, _CMP_UNORD_Q)));
      m0 = _mm256_max_ps(m0, a), m1 = _mm256_max_ps(m1, b);
      m2 = _mm256_max_ps(m2, c), m3 = _mm256_max_ps(m3, d);
    }
    if (_mm256_movemask_ps(nan) != 0) {  // rare: the first NaN wins
      for (int64_t j = 0; j < V; ++j)
        if (std::isnan(x[j])) return static_cast<int32_t>(j);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, _mm256_max_ps(_mm256_max_ps(m0, m1), _mm256_max_ps(m2, m3)));
    for (float l : lanes) best = l > best ? l : best;
  }
  for (int64_t j = i; j < V; ++j) {
    if (std::isnan(x[j])) return static_cast<int32_t>(j);  // none before: checked above
    best = x[j] > best ? x[j] : best;
  }
  const __m256 target = _mm256_set1_ps(best);
  int64_t j = 0;
  for (; j + 8 <= V; j += 8) {
    const int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + j), target, _CMP_EQ_OQ));
    if (mask != 0) return static_cast<int32_t>(j + __builtin_ctz(mask));
  }
  for (; j < V; ++j)
    if (x[j] == best) return static_cast<int32_t>(j);
  return 0;  // a row of -inf only: index 0, as jnp.argmax
}

}  // namespace xlaserve
