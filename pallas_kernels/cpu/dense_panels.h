// The dense kernels' tiles (dense_matmul.cc, dense_argmax.cc): float32 rows against
// weights packed in panels, every output summed in one fixed order, k ascending, whatever
// the number of rows.
//
// W comes packed in panels of 16 output channels: panel[p][k][j] = W[k][16p + j], so the 16
// weights one k needs are one contiguous load (64 bytes in float32, 32 in 16-bit formats,
// widened in registers; 16 bytes of 8-bit codes); when 16 does not divide N, the last panel is
// N % 16 wide. bfloat16 panels hold their k in pairs instead (dense_bf16_pairs.h). Panels
// are split over XLA's intra-op threads; within a panel, tiles of up to 6 rows share each
// weight load (12 accumulators, 2 weights, 1 broadcast), 12 rows with AVX-512.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "dense_bf16_pairs.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace xlaserve::dense {

constexpr int64_t kNR = 16;      // output channels per panel: two AVX2 registers
constexpr int64_t kMaxTile = 6;  // rows per tile

enum class Weights { kF32, kBF16, kF16, kI8, kE4M3, kE5M2 };

template <Weights W>
constexpr bool kEightBit = W == Weights::kI8 || W == Weights::kE4M3 || W == Weights::kE5M2;

// float8_e4m3fn's exponent and mantissa bits, placed as a float16's top bits, give a float16
// of exactly 2^-8 times the fp8 value, normal or subnormal alike: the kernel sums those and
// multiplies the channel scales by 256 (exact). The NaN codes 0x7f / 0xff come out as +-480
// (quantized weights never hold them).
constexpr float kE4M3Unit = 256.0f;

inline uint16_t E4M3AsHalf(uint8_t c) {
  return static_cast<uint16_t>((c & 0x80) << 8 | (c & 0x7f) << 7);
}

// 8 codes (the low 8 bytes of `b`) as float32.
template <Weights W>
inline __m256 Widen8(__m128i b) {
  if constexpr (W == Weights::kI8) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  } else if constexpr (W == Weights::kE4M3) {
    const __m128i x = _mm_cvtepu8_epi16(b);
    const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(x, _mm_set1_epi16(0x80)), 8),
                                   _mm_slli_epi16(_mm_and_si128(x, _mm_set1_epi16(0x7f)), 7));
    return _mm256_cvtph_ps(h);
  } else {  // float8_e5m2 is the top byte of a float16
    return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(b), 8));
  }
}

// One weight of the narrow panel as float32.
template <Weights W>
inline float Scalar(const void* panel, int64_t i) {
  if constexpr (W == Weights::kF32) {
    return static_cast<const float*>(panel)[i];
  } else if constexpr (W == Weights::kBF16 || W == Weights::kF16) {
    const uint16_t h = static_cast<const uint16_t*>(panel)[i];
    if constexpr (W == Weights::kF16) return _cvtsh_ss(h);
    const uint32_t bits = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  } else {
    const uint8_t c = static_cast<const uint8_t*>(panel)[i];
    if constexpr (W == Weights::kI8) return float(static_cast<int8_t>(c));
    if constexpr (W == Weights::kE4M3) return _cvtsh_ss(E4M3AsHalf(c));
    return _cvtsh_ss(static_cast<uint16_t>(c << 8));
  }
}

// The 16 weights of row k of a full panel as two float32 registers.
template <Weights W>
inline void Load(const void* panel, int64_t k, __m256& w0, __m256& w1) {
  if constexpr (kEightBit<W>) {
    const __m128i b = _mm_loadu_si128(
        reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(panel) + k * kNR));
    w0 = Widen8<W>(b);
    w1 = Widen8<W>(_mm_srli_si128(b, 8));
  } else if constexpr (W == Weights::kF32) {
    const float* p = static_cast<const float*>(panel) + k * kNR;
    w0 = _mm256_loadu_ps(p);
    w1 = _mm256_loadu_ps(p + 8);
  } else {
    const __m256i h = _mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(panel) + k * kNR));
    const __m128i lo = _mm256_castsi256_si128(h), hi = _mm256_extracti128_si256(h, 1);
    if constexpr (W == Weights::kBF16) {  // bfloat16 is the top half of a float32
      w0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(lo), 16));
      w1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(hi), 16));
    } else {
      w0 = _mm256_cvtph_ps(lo);
      w1 = _mm256_cvtph_ps(hi);
    }
  }
}

// The `width` < 16 weights of row k of the last, narrow panel, zero-padded to 16.
template <Weights W>
inline void LoadNarrow(const void* panel, int64_t k, int64_t width, __m256& w0, __m256& w1) {
  alignas(32) float w[kNR] = {};
  for (int64_t j = 0; j < width; ++j) w[j] = Scalar<W>(panel, k * width + j);
  w0 = _mm256_load_ps(w);
  w1 = _mm256_load_ps(w + 8);
}

// A row's `width` outputs, times the channels' scales when there are scales.
// unit: what the summed codes are in units of (kE4M3Unit for float8_e4m3fn, else 1).
inline void Store(float* y, __m256 a0, __m256 a1, int64_t width, const float* scale,
                  float unit) {
  if (scale != nullptr) {
    alignas(32) float s[kNR] = {};
    for (int64_t j = 0; j < width; ++j) s[j] = scale[j] * unit;
    a0 = _mm256_mul_ps(a0, _mm256_load_ps(s));
    a1 = _mm256_mul_ps(a1, _mm256_load_ps(s + 8));
  }
  if (width == kNR) {
    _mm256_storeu_ps(y, a0);
    _mm256_storeu_ps(y + 8, a1);
    return;
  }
  alignas(32) float t[kNR];
  _mm256_store_ps(t, a0);
  _mm256_store_ps(t + 8, a1);
  std::memcpy(y, t, width * sizeof(float));
}

// R <= 6 rows of x (stride K) against one panel `width` wide -> R x width of y (stride N).
template <Weights W, int R>
void Tile(const float* x, int64_t K, const void* panel, int64_t width, const float* scale,
          float* y, int64_t N) {
  static_assert(R >= 1 && R <= kMaxTile);
  const __m256 z = _mm256_setzero_ps();
  constexpr float unit = W == Weights::kE4M3 ? kE4M3Unit : 1.0f;
  __m256 a00 = z, a01 = z, a10 = z, a11 = z, a20 = z, a21 = z, a30 = z, a31 = z, a40 = z,
         a41 = z, a50 = z, a51 = z;
#define XLASERVE_ROW(r)                                        \
  if constexpr (R > r) {                                       \
    const __m256 b = _mm256_broadcast_ss(x + r * K + k);       \
    a##r##0 = _mm256_fmadd_ps(b, w0, a##r##0);                 \
    a##r##1 = _mm256_fmadd_ps(b, w1, a##r##1);                 \
  }
#define XLASERVE_STORE(r) \
  if constexpr (R > r) Store(y + r * N, a##r##0, a##r##1, width, scale, unit);
  if (width == kNR) {
    for (int64_t k = 0; k < K; ++k) {
      __m256 w0, w1;
      Load<W>(panel, k, w0, w1);
      XLASERVE_ROW(0) XLASERVE_ROW(1) XLASERVE_ROW(2) XLASERVE_ROW(3) XLASERVE_ROW(4)
      XLASERVE_ROW(5)
    }
  } else {  // the same FMAs, on zero-padded weights
    for (int64_t k = 0; k < K; ++k) {
      __m256 w0, w1;
      LoadNarrow<W>(panel, k, width, w0, w1);
      XLASERVE_ROW(0) XLASERVE_ROW(1) XLASERVE_ROW(2) XLASERVE_ROW(3) XLASERVE_ROW(4)
      XLASERVE_ROW(5)
    }
  }
  XLASERVE_STORE(0) XLASERVE_STORE(1) XLASERVE_STORE(2) XLASERVE_STORE(3) XLASERVE_STORE(4)
  XLASERVE_STORE(5)
#undef XLASERVE_ROW
#undef XLASERVE_STORE
}

template <Weights W>
void TileOf(int64_t rows, const float* x, int64_t K, const void* panel, int64_t width,
            const float* scale, float* y, int64_t N) {
  switch (rows) {
    case 6: Tile<W, 6>(x, K, panel, width, scale, y, N); break;
    case 5: Tile<W, 5>(x, K, panel, width, scale, y, N); break;
    case 4: Tile<W, 4>(x, K, panel, width, scale, y, N); break;
    case 3: Tile<W, 3>(x, K, panel, width, scale, y, N); break;
    case 2: Tile<W, 2>(x, K, panel, width, scale, y, N); break;
    default: Tile<W, 1>(x, K, panel, width, scale, y, N); break;
  }
}

#ifdef __AVX512F__
// With AVX-512 a panel's 16 weights of one k are one register: tiles of up to 12 rows share
// each weight load (12 accumulators, 1 weight, 1 broadcast). Each output still takes one
// FMA per k in the same order, so the bits are those of the AVX2 tiles above.
constexpr int64_t kMaxTile512 = 12;

// The 16 weights of row k of a full panel.
template <Weights W>
inline __m512 Load16(const void* panel, int64_t k) {
  if constexpr (W == Weights::kF32) {
    return _mm512_loadu_ps(static_cast<const float*>(panel) + k * kNR);
  } else if constexpr (W == Weights::kBF16 || W == Weights::kF16) {
    const __m256i h = _mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(panel) + k * kNR));
    if constexpr (W == Weights::kF16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else {
    const __m128i b = _mm_loadu_si128(
        reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(panel) + k * kNR));
    if constexpr (W == Weights::kI8) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
    const __m256i x = _mm256_cvtepu8_epi16(b);
    if constexpr (W == Weights::kE4M3) {
      return _mm512_cvtph_ps(_mm256_or_si256(
          _mm256_slli_epi16(_mm256_and_si256(x, _mm256_set1_epi16(0x80)), 8),
          _mm256_slli_epi16(_mm256_and_si256(x, _mm256_set1_epi16(0x7f)), 7)));
    }
    return _mm512_cvtph_ps(_mm256_slli_epi16(x, 8));
  }
}

// The `width` < 16 weights of row k of the narrow panel, zero-padded.
template <Weights W>
inline __m512 LoadNarrow16(const void* panel, int64_t k, int64_t width) {
  alignas(64) float w[kNR] = {};
  for (int64_t j = 0; j < width; ++j) w[j] = Scalar<W>(panel, k * width + j);
  return _mm512_load_ps(w);
}

inline void Store16(float* y, __m512 a, int64_t width, const float* scale, float unit) {
  const __mmask16 mask = static_cast<__mmask16>((1u << width) - 1);
  if (scale != nullptr)
    a = _mm512_mul_ps(a, _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, scale),
                                       _mm512_set1_ps(unit)));
  _mm512_mask_storeu_ps(y, mask, a);
}

// R <= 12 rows of x (stride K) against one panel `width` wide -> R x width of y (stride N).
template <Weights W, int R>
void Tile512(const float* x, int64_t K, const void* panel, int64_t width, const float* scale,
             float* y, int64_t N) {
  static_assert(R >= 1 && R <= kMaxTile512);
  constexpr float unit = W == Weights::kE4M3 ? kE4M3Unit : 1.0f;
  __m512 a[R];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) a[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m512 w = width == kNR ? Load16<W>(panel, k) : LoadNarrow16<W>(panel, k, width);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) a[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * K + k]), w, a[r]);
  }
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) Store16(y + r * N, a[r], width, scale, unit);
}

template <Weights W, int R = kMaxTile512>
void TileOf512(int64_t rows, const float* x, int64_t K, const void* panel, int64_t width,
               const float* scale, float* y, int64_t N) {
  if constexpr (R > 1) {
    if (rows < R) return TileOf512<W, R - 1>(rows, x, K, panel, width, scale, y, N);
  }
  Tile512<W, R>(x, K, panel, width, scale, y, N);
}
#endif  // __AVX512F__

// The rows as Panels<W> reads them: x itself, or for bfloat16 weights its pair words
// (dense_bf16_pairs.h), made once a call in the calling thread's buffer.
template <Weights W>
const void* TileRows(const float* x, int64_t T, int64_t K) {
  if constexpr (W == Weights::kBF16) {
    thread_local std::vector<uint32_t> pairs;
    PairRows(x, T, K, pairs);
    return pairs.data();
  }
  return x;
}

// Row r of what TileRows gives.
template <Weights W>
const void* RowAt(const void* rows, int64_t r, int64_t K) {
  if constexpr (W == Weights::kBF16) return static_cast<const uint32_t*>(rows) + r * ((K + 1) / 2);
  return static_cast<const float*>(rows) + r * K;
}

// Rows [0, T) (from TileRows) against panels [p0, p1) of W (N columns, `bytes` a weight) ->
// y (stride ldy), panel p0's columns first, in row tiles as even as can be, each tile
// through every panel before the next: a tile's rows are written in runs of (p1 - p0) * 16
// columns. (Panel by panel over all rows, the rows of a [256, 49152] float32 result sit
// 3 * 2^16 bytes apart, land in the same cache sets and were written at a tenth of memory
// speed.)
template <Weights W>
void Panels(int64_t T, const void* x, int64_t K, const char* w, size_t bytes, int64_t p0,
            int64_t p1, int64_t N, const float* scale, float* y, int64_t ldy) {
  auto tile = [&](int64_t r, int64_t n) {
    for (int64_t p = p0; p < p1; ++p) {
      const void* panel = w + p * K * kNR * bytes;
      const int64_t width = std::min(kNR, N - p * kNR);
      float* out = y + r * ldy + (p - p0) * kNR;
      if constexpr (W == Weights::kBF16) {
        PairTileOf(n, static_cast<const uint32_t*>(RowAt<W>(x, r, K)), K,
                   static_cast<const uint16_t*>(panel), width, out, ldy);
      } else {
        const float* rows = static_cast<const float*>(RowAt<W>(x, r, K));
        const float* s = scale ? scale + p * kNR : nullptr;
#ifdef __AVX512F__
        TileOf512<W>(n, rows, K, panel, width, s, out, ldy);
#else
        TileOf<W>(n, rows, K, panel, width, s, out, ldy);
#endif
      }
    }
  };
#ifdef __AVX512F__
  constexpr int64_t kRows = W == Weights::kBF16 ? kMaxPairTile : kMaxTile512;
#else
  constexpr int64_t kRows = W == Weights::kBF16 ? kMaxPairTile : kMaxTile;
#endif
  xlaserve::EvenTiles(T, kRows, tile);
}

// How many panels a chunk of work takes: their weights within ~256 KB (they are read again
// for every row tile), at least one, and at least two chunks a thread when there is work.
inline int64_t PanelsPerChunk(int64_t K, int64_t N, size_t bytes, int64_t threads) {
  const int64_t panels = (N + kNR - 1) / kNR;
  const int64_t fit = std::max<int64_t>((256 << 10) / (K * kNR * static_cast<int64_t>(bytes)), 1);
  const int64_t spread = std::max<int64_t>((panels + 2 * threads - 1) / (2 * threads), 1);
  return std::min(fit, spread);
}

}  // namespace xlaserve::dense
