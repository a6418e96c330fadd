// bfloat16 weights in the dense kernels (dense_panels.h): rows rounded to bfloat16 and
// multiplied two k at a time, as AVX512-BF16's `vdpbf16ps` does.
//
// A bfloat16 panel holds its k in pairs: panel[i][j][t] = W[2i + t][16p + j] for the K / 2
// whole pairs, then, when K is odd, the last k alone (panel[K - 1][j]), so one 64-byte load
// is the 16 columns' weights of two k. The rows are rounded to bfloat16 (to nearest even, a
// NaN kept a NaN) once per call and held two k to a 32-bit word, k even in the low half.
// Every product of two bfloat16 values is exact in float32, and each output is summed in
// one fixed order whatever the rows:
//   acc = (acc + x[2i + 1] * W[2i + 1]) + x[2i] * W[2i],  i ascending,
// then acc + x[K - 1] * W[K - 1] for an odd K, each sum rounded to nearest even: the order
// in which `vdpbf16ps` adds a pair. CPUs without AVX512-BF16 make the same two FMAs a pair
// from widened weights, so both builds give the same bits (but for subnormals, which
// `vdpbf16ps` flushes to zero). A model in bfloat16 hands the kernel rows that already are
// bfloat16 values: for it the rounding changes nothing.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace xlaserve::dense {

// A float32's bits rounded to bfloat16 (to nearest even, a NaN kept a quiet NaN).
inline uint16_t Bf16(uint32_t b) {
  if ((b & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((b >> 16) | 0x40u);
  return static_cast<uint16_t>((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

// The same for 8 lanes: each lane's bfloat16 in its low 16 bits.
inline __m256i Bf16x8(__m256 v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(
      _mm256_add_epi32(b, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x7fffffff)),
                                         _mm256_set1_epi32(0x7f800000));
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(0x40));
  return _mm256_blendv_epi8(rounded, quiet, nan);
}

// x [T, K] as the pair tiles read it, into `pairs`: T rows of (K + 1) / 2 words (a
// thread's buffer, kept from call to call).
inline void PairRows(const float* x, int64_t T, int64_t K, std::vector<uint32_t>& pairs) {
  const int64_t words = (K + 1) / 2;
  pairs.resize(T * words);
  for (int64_t r = 0; r < T; ++r) {
    const float* row = x + r * K;
    char* out = reinterpret_cast<char*>(pairs.data() + r * words);
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
      const __m256i packed = _mm256_packus_epi32(Bf16x8(_mm256_loadu_ps(row + k)),
                                                 Bf16x8(_mm256_loadu_ps(row + k + 8)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 2 * k),
                          _mm256_permute4x64_epi64(packed, 0xD8));
    }
    for (; k < K + K % 2; ++k) {
      uint32_t b = 0;
      if (k < K) std::memcpy(&b, row + k, sizeof b);
      const uint16_t h = k < K ? Bf16(b) : 0;
      std::memcpy(out + 2 * k, &h, sizeof h);
    }
  }
}

inline float HighHalf(uint32_t word) {
  const uint32_t bits = word & 0xffff0000u;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline float LowHalf(uint32_t word) {
  const uint32_t bits = word << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// The 16 words (pairs of weights) of pair i of a panel `width` wide, zero-padded.
inline void PairWords(const uint16_t* panel, int64_t i, int64_t width, uint32_t* words) {
  std::memset(words, 0, 16 * sizeof(uint32_t));
  std::memcpy(words, panel + i * 2 * width, width * sizeof(uint32_t));
}

// The odd K's last weights (after the pairs) of a panel `width` wide as float32, padded.
inline void TailWeights(const uint16_t* panel, int64_t K, int64_t width, float* w) {
  for (int64_t j = 0; j < 16; ++j)
    w[j] = j < width ? LowHalf(panel[(K - 1) * width + j]) : 0.0f;
}

#ifdef __AVX512F__
constexpr int64_t kMaxPairTile = 12;

// R <= 12 rows (x: pair words, stride (K + 1) / 2) against one bfloat16 panel.
template <int R>
void PairTile(const uint32_t* x, int64_t K, const uint16_t* panel, int64_t width, float* y,
                 int64_t N) {
  const int64_t pairs = K / 2, stride = (K + 1) / 2;
  __m512 a[R];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) a[r] = _mm512_setzero_ps();
  alignas(64) uint32_t narrow[16];
  for (int64_t i = 0; i < pairs; ++i) {
    __m512i w;
    if (width == 16) {
      w = _mm512_loadu_si512(panel + i * 32);
    } else {
      PairWords(panel, i, width, narrow);
      w = _mm512_load_si512(narrow);
    }
#ifdef __AVX512BF16__
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r)
      a[r] = _mm512_dpbf16_ps(a[r], (__m512bh)_mm512_set1_epi32(x[r * stride + i]),
                              (__m512bh)w);
#else
    const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(0xffff0000)));
    const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const uint32_t word = x[r * stride + i];
      a[r] = _mm512_fmadd_ps(_mm512_set1_ps(HighHalf(word)), odd, a[r]);
      a[r] = _mm512_fmadd_ps(_mm512_set1_ps(LowHalf(word)), even, a[r]);
    }
#endif
  }
  if (K % 2 == 1) {
    alignas(64) float tail[16];
    TailWeights(panel, K, width, tail);
    const __m512 w = _mm512_load_ps(tail);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r)
      a[r] = _mm512_fmadd_ps(_mm512_set1_ps(LowHalf(x[r * stride + pairs])), w, a[r]);
  }
  const __mmask16 mask = static_cast<__mmask16>((1u << width) - 1);
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * N, mask, a[r]);
}

#else
constexpr int64_t kMaxPairTile = 6;

// R <= 6 rows against one bfloat16 panel, 16 columns as two AVX2 registers.
template <int R>
void PairTile(const uint32_t* x, int64_t K, const uint16_t* panel, int64_t width, float* y,
                 int64_t N) {
  const int64_t pairs = K / 2, stride = (K + 1) / 2;
  __m256 a[R][2];
  for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = _mm256_setzero_ps();
  alignas(32) uint32_t words[16];
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  for (int64_t i = 0; i < pairs; ++i) {
    const uint32_t* src = reinterpret_cast<const uint32_t*>(panel + i * 32);
    if (width != 16) {
      PairWords(panel, i, width, words);
      src = words;
    }
    for (int h = 0; h < 2; ++h) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 8 * h));
      const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(w, high));
      const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
      for (int r = 0; r < R; ++r) {
        const uint32_t word = x[r * stride + i];
        a[r][h] = _mm256_fmadd_ps(_mm256_set1_ps(HighHalf(word)), odd, a[r][h]);
        a[r][h] = _mm256_fmadd_ps(_mm256_set1_ps(LowHalf(word)), even, a[r][h]);
      }
    }
  }
  if (K % 2 == 1) {
    alignas(32) float tail[16];
    TailWeights(panel, K, width, tail);
    for (int h = 0; h < 2; ++h) {
      const __m256 w = _mm256_load_ps(tail + 8 * h);
      for (int r = 0; r < R; ++r)
        a[r][h] = _mm256_fmadd_ps(_mm256_set1_ps(LowHalf(x[r * stride + pairs])), w, a[r][h]);
    }
  }
  for (int r = 0; r < R; ++r) {
    alignas(32) float t[16];
    _mm256_store_ps(t, a[r][0]);
    _mm256_store_ps(t + 8, a[r][1]);
    std::memcpy(y + r * N, t, width * sizeof(float));
  }
}

#endif  // __AVX512F__

// Up to kMaxPairTile rows against one bfloat16 panel.
template <int R = kMaxPairTile>
void PairTileOf(int64_t rows, const uint32_t* x, int64_t K, const uint16_t* panel,
                int64_t width, float* y, int64_t N) {
  if constexpr (R > 1) {
    if (rows < R) return PairTileOf<R - 1>(rows, x, K, panel, width, y, N);
  }
  PairTile<R>(x, K, panel, width, y, N);
}

}  // namespace xlaserve::dense
