// What the kernels with weights in groups of 32 values of k (q4_matmul.cc, q8_0_matmul.cc)
// share: each row of x rounded to int16 per group of 32 with a scale of its own, and the
// weights' per-group scales read as float32 from float16 or float32.
//
// The scales' two types take one code path: a float16 scale is widened exactly, so the
// float32 arithmetic after the load, and so the result, is the same to the bit whether a
// float16 scale comes as float16 or already widened to float32.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace xlaserve {

constexpr int64_t kQuantGroup = 32;  // values of k per activation scale and weight scale
constexpr float kGroupQMax = 32767.0f;  // |xq| <= 32767: the int16 range, symmetric

// True when x[0, K) (K a multiple of 8) holds no inf and no NaN.
inline bool RowFinite(const float* x, int64_t K) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 bad = _mm256_setzero_ps();  // lanes that met an inf or a NaN
  for (int64_t k = 0; k < K; k += 8) {
    const __m256 v = _mm256_andnot_ps(sign, _mm256_loadu_ps(x + k));
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(v, _mm256_set1_ps(INFINITY), _CMP_NLT_UQ));
  }
  return _mm256_movemask_ps(bad) == 0;
}

// The 32 values at v rounded to int16, held as int32: q[i] has values 8i .. 8i + 7, with
// v ~ amax / 32767 * q, rounded to nearest, ties to even (as jnp.round). Returns amax, the
// largest |v|; a row that is not `finite` is read as zeros (its scale is the caller's NaN).
inline float QuantizeGroup(const float* v, bool finite, __m256i q[4]) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 a[4];
  __m256 amax8 = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    a[i] = finite ? _mm256_loadu_ps(v + 8 * i) : _mm256_setzero_ps();
    amax8 = _mm256_max_ps(amax8, _mm256_andnot_ps(sign, a[i]));
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, amax8);
  float amax = 0.0f;
  for (float l : lanes) amax = std::max(amax, l);
  const __m256 inv = _mm256_set1_ps(amax > 0.0f ? kGroupQMax / amax : 0.0f);
  for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(a[i], inv));
  return amax;
}

// A row's scale for a group of largest magnitude amax: NaN for a row holding an inf or a
// NaN, so its outputs are NaN as a float product's would be; 0 for a group of zeros.
inline float GroupScale(float amax, bool finite) {
  return finite ? amax / kGroupQMax : NAN;
}

// Weight scales: float16 (held as its bits, uint16_t) or float32.
template <typename S>
inline __m256 LoadScales8(const S* p) {
  if constexpr (sizeof(S) == 2) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  } else {
    return _mm256_loadu_ps(p);
  }
}

#ifdef __AVX512F__
template <typename S>
inline __m512 LoadScales16(const S* p) {
  if constexpr (sizeof(S) == 2) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  } else {
    return _mm512_loadu_ps(p);
  }
}
#endif

// fn(S{}) with S the C++ type of the scales' element type dt (uint16_t for float16, float
// for float32); any other type is the caller's InvalidArgument with `message`.
template <typename F>
xla::ffi::Error WithScaleType(xla::ffi::DataType dt, const char* message, F&& fn) {
  switch (dt) {
    case xla::ffi::DataType::F16: return fn(uint16_t{});
    case xla::ffi::DataType::F32: return fn(float{});
    default: return xla::ffi::Error::InvalidArgument(message);
  }
}

}  // namespace xlaserve
