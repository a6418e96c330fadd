// AVX2 helpers for the attention kernel: reading and writing its dtypes as float32,
// horizontal reductions, and a vector exp.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "xla/ffi/api/ffi.h"

namespace xlaserve {

namespace ffi = xla::ffi;

// float8_e4m3fn: bias 7, no infinities, S.1111.111 is NaN.
struct Fp8Table {
  float v[256];
  Fp8Table() {
    for (int b = 0; b < 256; ++b) {
      int e = (b >> 3) & 15, m = b & 7;
      float x = e == 0 ? std::ldexp(m / 8.0f, -6) : std::ldexp(1.0f + m / 8.0f, e - 7);
      if (e == 15 && m == 7) x = std::numeric_limits<float>::quiet_NaN();
      v[b] = (b & 128) ? -x : x;
    }
  }
};
inline const Fp8Table kFp8;

// 8 elements of type dt at src, as float32.
template <ffi::DataType dt>
inline __m256 Load8(const char* src) {
  if constexpr (dt == ffi::DataType::F32) {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(src));
  } else if constexpr (dt == ffi::DataType::BF16) {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)src));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  } else if constexpr (dt == ffi::DataType::F16) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)src));
  } else if constexpr (dt == ffi::DataType::S8) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)src)));
  } else {  // F8E4M3FN
    __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)src));
    return _mm256_i32gather_ps(kFp8.v, bytes, 4);
  }
}

// One element of type dt at src, as float32.
template <ffi::DataType dt>
inline float Load1(const char* src) {
  if constexpr (dt == ffi::DataType::F32) {
    float x;
    std::memcpy(&x, src, 4);
    return x;
  } else if constexpr (dt == ffi::DataType::BF16 || dt == ffi::DataType::F16) {
    uint16_t h;
    std::memcpy(&h, src, 2);
    if constexpr (dt == ffi::DataType::F16) return _cvtsh_ss(h);
    const uint32_t u = uint32_t{h} << 16;
    float x;
    std::memcpy(&x, &u, 4);
    return x;
  } else if constexpr (dt == ffi::DataType::S8) {
    return float(*reinterpret_cast<const int8_t*>(src));
  } else {
    return kFp8.v[*reinterpret_cast<const uint8_t*>(src)];
  }
}

template <ffi::DataType dt>
inline void ConvertAs(const char* src, int64_t n, float scale, float* dst) {
  constexpr size_t width = ffi::ByteWidth(dt);
  const __m256 sc = _mm256_set1_ps(scale);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_mul_ps(Load8<dt>(src + i * width), sc));
  for (; i < n; ++i) dst[i] = Load1<dt>(src + i * width) * scale;
}

// dst[0..n) = the n elements of the float type dt at src, as float32, times scale.
inline void Convert(ffi::DataType dt, const char* src, int64_t n, float scale, float* dst) {
  switch (dt) {
    case ffi::DataType::BF16: return ConvertAs<ffi::DataType::BF16>(src, n, scale, dst);
    case ffi::DataType::F16: return ConvertAs<ffi::DataType::F16>(src, n, scale, dst);
    default: return ConvertAs<ffi::DataType::F32>(src, n, scale, dst);  // callers pass floats
  }
}

inline void FromF32(ffi::DataType dt, const float* src, int64_t n, char* dst) {
  auto* half = reinterpret_cast<uint16_t*>(dst);
  for (int64_t i = 0; i < n; ++i) {
    if (dt == ffi::DataType::F32) {
      std::memcpy(dst + 4 * i, src + i, 4);
    } else if (dt == ffi::DataType::F16) {
      half[i] = _cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT);
    } else {  // BF16, rounded to nearest even as XLA's convert rounds
      uint32_t u;
      std::memcpy(&u, src + i, 4);
      half[i] = std::isnan(src[i]) ? 0x7FC0 : uint16_t((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
    }
  }
}

inline float HSum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

inline float HMax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// Lane j of the result is the sum of the lanes of a[j].
inline __m256 HSum8(const __m256 a[8]) {
  __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
  __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
  __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
  // s0123 = [0 1 2 3 | 0 1 2 3] halves of the 128-bit lanes; likewise s4567.
  __m256 lo = _mm256_permute2f128_ps(s0123, s4567, 0x20);
  __m256 hi = _mm256_permute2f128_ps(s0123, s4567, 0x31);
  return _mm256_add_ps(lo, hi);
}

// exp on 8 lanes (Cephes' expf: ~1 ulp); arguments of -88 and below (-inf too) give 0.
inline __m256 Exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.0f)), _mm256_set1_ps(-88.0f));
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504089f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
  // 2^n through the exponent field; n = -127 makes the bits 0, i.e. exactly 0.
  __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  e = _mm256_slli_epi32(e, 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

}  // namespace xlaserve
