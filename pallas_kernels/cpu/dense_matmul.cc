// y[T, N] = x[T, K] @ W[K, N] for float weights (float32, bfloat16 or float16) or 8-bit
// codes (int8, float8_e4m3fn, float8_e5m2) with one scale per output channel, and float32
// rows, with every output summed in one fixed order: y[r, n] = fma(x[r, K-1], W[K-1, n],
// ... fma(x[r, 1], W[1, n], x[r, 0] * W[0, n])), k ascending, whatever T is and whichever
// rows share the call, then times scale[n] for 8-bit codes (weight-only, as XLA's
// `x @ convert(W) * scale`). A row's result is then independent of its batch: XLA:CPU's dot picks
// other kernels and blockings for other row counts (every row of a 1-row float32 dot
// differed in its last bits from the same row of a 64-row one).
//
// W comes packed in panels of 16 output channels: panel[p][k][j] = W[k][16p + j], so the 16
// weights one k needs are one contiguous load (64 bytes in float32, 32 in 16-bit formats,
// widened in registers; 16 bytes of 8-bit codes); when 16 does not divide N, the last panel is N % 16 wide. Panels
// are split over XLA's intra-op threads; within a panel, tiles of up to 6 rows share each
// weight load (12 accumulators, 2 weights, 1 broadcast).
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "groups.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

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

// Rows [0, T) against one panel, in tiles of at most 6 rows as even as can be.
template <Weights W>
void Panel(int64_t T, const float* x, int64_t K, const void* panel, int64_t width,
           const float* scale, float* y, int64_t N) {
  xlaserve::EvenTiles(T, kMaxTile, [&](int64_t r, int64_t n) {
    TileOf<W>(n, x + r * K, K, panel, width, scale, y + r * N, N);
  });
}

// scale: float32[N], or null for float weights.
template <Weights W>
void Run(ffi::ThreadPool& pool, int64_t T, int64_t K, int64_t N, const float* x,
         const char* w, size_t bytes, const float* scale, float* y) {
  xlaserve::ParallelFor(pool, (N + kNR - 1) / kNR, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      Panel<W>(T, x, K, w + p * K * kNR * bytes, std::min(kNR, N - p * kNR),
               scale ? scale + p * kNR : nullptr, y + p * kNR, N);
  }, /*grain=*/4);
}

// scale: float32[N] for 8-bit codes, float32[0] for float weights.
ffi::Error DenseMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                       ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  auto yd = y->dimensions();
  if (xd.size() != 2 || yd.size() != 2 || xd[0] != yd[0])
    return ffi::Error::InvalidArgument("dense_matmul: x must be [T, K] and y [T, N]");
  const int64_t T = xd[0], K = xd[1], N = yd[1];
  if (static_cast<int64_t>(w.element_count()) != K * N)
    return ffi::Error::InvalidArgument(
        "dense_matmul: w must hold K * N values in panels of 16 columns");
  const bool eight_bit = ffi::ByteWidth(w.element_type()) == 1;
  if (static_cast<int64_t>(scale.element_count()) != (eight_bit ? N : 0))
    return ffi::Error::InvalidArgument(
        "dense_matmul: scale must be [N] for 8-bit weights and [0] for float ones");
  if (T == 0) return ffi::Error::Success();
  const char* wp = static_cast<const char*>(w.untyped_data());
  const float* xp = x.typed_data();
  const float* sp = eight_bit ? scale.typed_data() : nullptr;
  float* yp = y->typed_data();
  switch (w.element_type()) {
    case ffi::DataType::F32: Run<Weights::kF32>(pool, T, K, N, xp, wp, 4, sp, yp); break;
    case ffi::DataType::BF16: Run<Weights::kBF16>(pool, T, K, N, xp, wp, 2, sp, yp); break;
    case ffi::DataType::F16: Run<Weights::kF16>(pool, T, K, N, xp, wp, 2, sp, yp); break;
    case ffi::DataType::S8: Run<Weights::kI8>(pool, T, K, N, xp, wp, 1, sp, yp); break;
    case ffi::DataType::F8E4M3FN: Run<Weights::kE4M3>(pool, T, K, N, xp, wp, 1, sp, yp); break;
    case ffi::DataType::F8E5M2: Run<Weights::kE5M2>(pool, T, K, N, xp, wp, 1, sp, yp); break;
    default:
      return ffi::Error::InvalidArgument(
          "dense_matmul: weights float32, bfloat16, float16, int8, float8_e4m3fn or "
          "float8_e5m2");
  }
  return ffi::Error::Success();
}

// The grouped form, a mixture-of-experts projection: rows sorted by expert, group e's rows
// (sizes[e] of them, after the groups before it) against expert e's panels (w holds E
// weights of K * N values, each packed as above) and channel scales (scale float32[E * N]
// for 8-bit codes, [0] for float weights). Each row goes through the same tiles and FMA
// order as the single kernel's, so it gets the same bits whatever its group's size; rows
// past the groups are zeros. Work items are (expert, panel) pairs.
template <Weights W>
void RunGrouped(ffi::ThreadPool& pool, int64_t E, const int64_t* start, const int32_t* sizes,
                int64_t K, int64_t N, const float* x, const char* w, size_t bytes,
                const float* scale, float* y) {
  const int64_t panels = (N + kNR - 1) / kNR;
  xlaserve::ParallelFor(pool, E * panels, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t e = i / panels, p = i % panels;
      if (sizes[e] == 0) continue;
      Panel<W>(sizes[e], x + start[e] * K, K, w + (e * K * N + p * K * kNR) * bytes,
               std::min(kNR, N - p * kNR), scale ? scale + e * N + p * kNR : nullptr,
               y + start[e] * N + p * kNR, N);
    }
  });
}

ffi::Error DenseMatmulGrouped(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                              ffi::Buffer<ffi::S32> group_sizes, ffi::AnyBuffer w,
                              ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  auto yd = y->dimensions();
  if (xd.size() != 2 || yd.size() != 2 || xd[0] != yd[0])
    return ffi::Error::InvalidArgument("dense_matmul_grouped: x must be [M, K] and y [M, N]");
  const int64_t M = xd[0], K = xd[1], N = yd[1];
  const int64_t E = static_cast<int64_t>(group_sizes.element_count());
  if (static_cast<int64_t>(w.element_count()) != E * K * N)
    return ffi::Error::InvalidArgument(
        "dense_matmul_grouped: w must hold E weights of K * N values in panels");
  const bool eight_bit = ffi::ByteWidth(w.element_type()) == 1;
  if (static_cast<int64_t>(scale.element_count()) != (eight_bit ? E * N : 0))
    return ffi::Error::InvalidArgument(
        "dense_matmul_grouped: scale must be [E * N] for 8-bit weights and [0] for float ones");
  std::vector<int64_t> bounds;  // group e: rows [bounds[e], bounds[e + 1])
  if (auto error = xlaserve::GroupBounds("dense_matmul_grouped", group_sizes, M, bounds);
      error.failure())
    return error;
  float* yp = y->typed_data();
  xlaserve::ZeroRowsPast(yp, bounds[E], M, N);
  if (bounds[E] == 0) return ffi::Error::Success();
  const int32_t* sizes = group_sizes.typed_data();
  const char* wp = static_cast<const char*>(w.untyped_data());
  const float* xp = x.typed_data();
  const float* sp = eight_bit ? scale.typed_data() : nullptr;
  const int64_t* st = bounds.data();
  switch (w.element_type()) {
    case ffi::DataType::F32: RunGrouped<Weights::kF32>(pool, E, st, sizes, K, N, xp, wp, 4, sp, yp); break;
    case ffi::DataType::BF16: RunGrouped<Weights::kBF16>(pool, E, st, sizes, K, N, xp, wp, 2, sp, yp); break;
    case ffi::DataType::F16: RunGrouped<Weights::kF16>(pool, E, st, sizes, K, N, xp, wp, 2, sp, yp); break;
    case ffi::DataType::S8: RunGrouped<Weights::kI8>(pool, E, st, sizes, K, N, xp, wp, 1, sp, yp); break;
    case ffi::DataType::F8E4M3FN: RunGrouped<Weights::kE4M3>(pool, E, st, sizes, K, N, xp, wp, 1, sp, yp); break;
    case ffi::DataType::F8E5M2: RunGrouped<Weights::kE5M2>(pool, E, st, sizes, K, N, xp, wp, 1, sp, yp); break;
    default:
      return ffi::Error::InvalidArgument(
          "dense_matmul_grouped: weights float32, bfloat16, float16, int8, float8_e4m3fn or "
          "float8_e5m2");
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(xlaserve_dense_matmul_grouped, DenseMatmulGrouped,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(xlaserve_dense_matmul, DenseMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
