// y[T, N] = x[T, K] @ W[K, N] for 8-bit codes (float8_e4m3fn; int8 and float8_e5m2 alike)
// with one float32 scale per block of `block` inputs and output column (DeepSeek-V3's fp8
// weights with 128 x 128 block scales, their output blocks repeated per column), float32
// rows, every output in one fixed order whatever T is:
//   partial_b = fma(x[k1 - 1], W[k1 - 1, n], ... fma(x[k0], W[k0, n], 0))   k in block b ascending
//   y[r, n]   = fma(partial_B-1, s[B-1, n], ... fma(partial_0, s[0, n], 0))  blocks ascending
// (the last block may hold fewer than `block` inputs). A row's result is then independent of
// its batch, as dense_matmul.cc's is; with one block it is dense_matmul's with a channel scale.
//
// The codes come packed as dense_matmul.cc packs them (dense_panels.h: panels of 16 output
// columns, the narrow last panel N % 16 wide), the scales float32[ceil(K / block), N]. Tiles of
// up to 6 rows (AVX2: 12 accumulators, their running totals in y) or 12 (AVX-512: totals in
// registers too) share each weight load; the same FMAs either way, so the same bits.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "dense_panels.h"
#include "groups.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using xlaserve::dense::kE4M3Unit;
using xlaserve::dense::kMaxTile;
using xlaserve::dense::kNR;
using xlaserve::dense::Load;
using xlaserve::dense::LoadNarrow;
using xlaserve::dense::Weights;

// The `width` scales of one block at `s` (a row of the scales, at the panel's first column)
// times `unit` (what the summed codes are in units of), zero-padded to 16.
inline void BlockScales(const float* s, int64_t width, float unit, float* out) {
  for (int64_t j = 0; j < kNR; ++j) out[j] = j < width ? s[j] * unit : 0.0f;
}

// R <= 6 rows of x (stride K) against one panel `width` wide -> R x width of y (stride ldy).
// The running totals live in `acc` (stride lda): y itself for a full panel, a buffer for the
// narrow one; each takes one load, FMA and store per block.
template <Weights W, int R>
void Tile(const float* x, int64_t K, int64_t block, const void* panel, int64_t width,
          const float* scale, int64_t N, float* y, int64_t ldy) {
  static_assert(R >= 1 && R <= kMaxTile);
  constexpr float unit = W == Weights::kE4M3 ? kE4M3Unit : 1.0f;
  alignas(32) float narrow[kMaxTile * kNR];
  float* acc = width == kNR ? y : narrow;
  const int64_t lda = width == kNR ? ldy : kNR;
  for (int r = 0; r < R; ++r) std::memset(acc + r * lda, 0, sizeof(float) * kNR);
  const __m256 z = _mm256_setzero_ps();
  for (int64_t k0 = 0, b = 0; k0 < K; k0 += block, ++b) {
    const int64_t k1 = std::min(K, k0 + block);
    __m256 a00 = z, a01 = z, a10 = z, a11 = z, a20 = z, a21 = z, a30 = z, a31 = z, a40 = z,
           a41 = z, a50 = z, a51 = z;
#define XLASERVE_ROW(r)                                   \
  if constexpr (R > r) {                                  \
    const __m256 v = _mm256_broadcast_ss(x + r * K + k);  \
    a##r##0 = _mm256_fmadd_ps(v, w0, a##r##0);            \
    a##r##1 = _mm256_fmadd_ps(v, w1, a##r##1);            \
  }
    for (int64_t k = k0; k < k1; ++k) {
      __m256 w0, w1;
      if (width == kNR) {
        Load<W>(panel, k, w0, w1);
      } else {
        LoadNarrow<W>(panel, k, width, w0, w1);
      }
      XLASERVE_ROW(0) XLASERVE_ROW(1) XLASERVE_ROW(2) XLASERVE_ROW(3) XLASERVE_ROW(4)
      XLASERVE_ROW(5)
    }
#undef XLASERVE_ROW
    alignas(32) float s[kNR];
    BlockScales(scale + b * N, width, unit, s);
    const __m256 s0 = _mm256_load_ps(s), s1 = _mm256_load_ps(s + 8);
#define XLASERVE_TOTAL(r)                                                            \
  if constexpr (R > r) {                                                             \
    float* t = acc + r * lda;                                                        \
    _mm256_storeu_ps(t, _mm256_fmadd_ps(a##r##0, s0, _mm256_loadu_ps(t)));           \
    _mm256_storeu_ps(t + 8, _mm256_fmadd_ps(a##r##1, s1, _mm256_loadu_ps(t + 8)));   \
  }
    XLASERVE_TOTAL(0) XLASERVE_TOTAL(1) XLASERVE_TOTAL(2) XLASERVE_TOTAL(3) XLASERVE_TOTAL(4)
    XLASERVE_TOTAL(5)
#undef XLASERVE_TOTAL
  }
  if (width != kNR)
    for (int r = 0; r < R; ++r) std::memcpy(y + r * ldy, narrow + r * kNR, sizeof(float) * width);
}

template <Weights W>
void TileOf(int64_t rows, const float* x, int64_t K, int64_t block, const void* panel,
            int64_t width, const float* scale, int64_t N, float* y, int64_t ldy) {
  switch (rows) {
    case 6: Tile<W, 6>(x, K, block, panel, width, scale, N, y, ldy); break;
    case 5: Tile<W, 5>(x, K, block, panel, width, scale, N, y, ldy); break;
    case 4: Tile<W, 4>(x, K, block, panel, width, scale, N, y, ldy); break;
    case 3: Tile<W, 3>(x, K, block, panel, width, scale, N, y, ldy); break;
    case 2: Tile<W, 2>(x, K, block, panel, width, scale, N, y, ldy); break;
    default: Tile<W, 1>(x, K, block, panel, width, scale, N, y, ldy); break;
  }
}

#ifdef __AVX512F__
using xlaserve::dense::kMaxTile512;
using xlaserve::dense::Load16;
using xlaserve::dense::LoadNarrow16;
using xlaserve::dense::Store16;

// R <= 12 rows against one panel: 12 partial sums, 12 totals, a weight and a broadcast, all
// in registers.
template <Weights W, int R>
void Tile512(const float* x, int64_t K, int64_t block, const void* panel, int64_t width,
             const float* scale, int64_t N, float* y, int64_t ldy) {
  static_assert(R >= 1 && R <= kMaxTile512);
  constexpr float unit = W == Weights::kE4M3 ? kE4M3Unit : 1.0f;
  __m512 t[R], a[R];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) t[r] = _mm512_setzero_ps();
  for (int64_t k0 = 0, b = 0; k0 < K; k0 += block, ++b) {
    const int64_t k1 = std::min(K, k0 + block);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) a[r] = _mm512_setzero_ps();
    for (int64_t k = k0; k < k1; ++k) {
      const __m512 w = width == kNR ? Load16<W>(panel, k) : LoadNarrow16<W>(panel, k, width);
#pragma GCC unroll 12
      for (int r = 0; r < R; ++r) a[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * K + k]), w, a[r]);
    }
    alignas(64) float s[kNR];
    BlockScales(scale + b * N, width, unit, s);
    const __m512 sv = _mm512_load_ps(s);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) t[r] = _mm512_fmadd_ps(a[r], sv, t[r]);
  }
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) Store16(y + r * ldy, t[r], width, nullptr, 1.0f);
}

template <Weights W, int R = kMaxTile512>
void TileOf512(int64_t rows, const float* x, int64_t K, int64_t block, const void* panel,
               int64_t width, const float* scale, int64_t N, float* y, int64_t ldy) {
  if constexpr (R > 1) {
    if (rows < R) return TileOf512<W, R - 1>(rows, x, K, block, panel, width, scale, N, y, ldy);
  }
  Tile512<W, R>(x, K, block, panel, width, scale, N, y, ldy);
}
#endif  // __AVX512F__

// Rows [0, T) of x against panels [p0, p1) of w (N columns) -> y (stride ldy), panel p0's
// columns first; row tiles as even as can be, each through every panel before the next.
template <Weights W>
void Panels(int64_t T, const float* x, int64_t K, int64_t block, const uint8_t* w, int64_t p0,
            int64_t p1, int64_t N, const float* scale, float* y, int64_t ldy) {
  auto tile = [&](int64_t r, int64_t n) {
    for (int64_t p = p0; p < p1; ++p) {
      const uint8_t* panel = w + p * K * kNR;
      const int64_t width = std::min(kNR, N - p * kNR);
      float* out = y + r * ldy + (p - p0) * kNR;
#ifdef __AVX512F__
      TileOf512<W>(n, x + r * K, K, block, panel, width, scale + p * kNR, N, out, ldy);
#else
      TileOf<W>(n, x + r * K, K, block, panel, width, scale + p * kNR, N, out, ldy);
#endif
    }
  };
#ifdef __AVX512F__
  xlaserve::EvenTiles(T, kMaxTile512, tile);
#else
  xlaserve::EvenTiles(T, kMaxTile, tile);
#endif
}

template <Weights W>
void Run(ffi::ThreadPool& pool, int64_t T, int64_t K, int64_t N, int64_t block,
         const float* x, const uint8_t* w, const float* scale, float* y) {
  const int64_t panels = (N + kNR - 1) / kNR;
  const int64_t per = xlaserve::dense::PanelsPerChunk(K, N, 1, pool.num_threads());
  xlaserve::ParallelFor(pool, (panels + per - 1) / per, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c)
      Panels<W>(T, x, K, block, w, c * per, std::min(panels, (c + 1) * per), N, scale,
                y + c * per * kNR, N);
  });
}

// The grouped form (a mixture of experts): group e's rows against expert e's codes (w holds
// E weights of K * N codes) and scales (E of [ceil(K / block), N]); rows past the groups are
// zeros. Each row goes through the single kernel's tiles and order. Work items are (expert,
// panel) pairs.
template <Weights W>
void RunGrouped(ffi::ThreadPool& pool, int64_t E, const int64_t* start, const int32_t* sizes,
                int64_t K, int64_t N, int64_t block, const float* x, const uint8_t* w,
                const float* scale, float* y) {
  const int64_t panels = (N + kNR - 1) / kNR;
  const int64_t blocks = (K + block - 1) / block;
  xlaserve::ParallelFor(pool, E * panels, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t e = i / panels, p = i % panels;
      if (sizes[e] == 0) continue;
      Panels<W>(sizes[e], x + start[e] * K, K, block, w + e * K * N, p, p + 1, N,
                scale + e * blocks * N, y + start[e] * N + p * kNR, N);
    }
  });
}

// Checks what both forms share: 8-bit codes, a positive block and scales for every block.
ffi::Error CheckOperands(const char* name, int64_t weights, int64_t K, int64_t N,
                         ffi::AnyBuffer& w, ffi::Buffer<ffi::F32>& scale, int64_t block) {
  if (block <= 0)
    return ffi::Error::InvalidArgument(std::string(name) + ": block must be positive");
  if (ffi::ByteWidth(w.element_type()) != 1)
    return ffi::Error::InvalidArgument(std::string(name) +
                                       ": weights are 8-bit codes (float8_e4m3fn, float8_e5m2 "
                                       "or int8)");
  if (static_cast<int64_t>(w.element_count()) != weights * K * N)
    return ffi::Error::InvalidArgument(std::string(name) +
                                       ": w must hold K * N codes a weight, in panels of 16");
  if (static_cast<int64_t>(scale.element_count()) != weights * ((K + block - 1) / block) * N)
    return ffi::Error::InvalidArgument(std::string(name) +
                                       ": scale must be [ceil(K / block), N] a weight");
  return ffi::Error::Success();
}

ffi::Error Fp8BlockMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                          ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::F32> y,
                          int64_t block) {
  auto xd = x.dimensions();
  auto yd = y->dimensions();
  if (xd.size() != 2 || yd.size() != 2 || xd[0] != yd[0])
    return ffi::Error::InvalidArgument("fp8_block_matmul: x must be [T, K] and y [T, N]");
  const int64_t T = xd[0], K = xd[1], N = yd[1];
  if (auto e = CheckOperands("fp8_block_matmul", 1, K, N, w, scale, block); e.failure())
    return e;
  if (T == 0) return ffi::Error::Success();
  const auto* wp = static_cast<const uint8_t*>(w.untyped_data());
  const float *xp = x.typed_data(), *sp = scale.typed_data();
  float* yp = y->typed_data();
  switch (w.element_type()) {
    case ffi::DataType::F8E4M3FN: Run<Weights::kE4M3>(pool, T, K, N, block, xp, wp, sp, yp); break;
    case ffi::DataType::F8E5M2: Run<Weights::kE5M2>(pool, T, K, N, block, xp, wp, sp, yp); break;
    case ffi::DataType::S8: Run<Weights::kI8>(pool, T, K, N, block, xp, wp, sp, yp); break;
    default:
      return ffi::Error::InvalidArgument(
          "fp8_block_matmul: weights float8_e4m3fn, float8_e5m2 or int8");
  }
  return ffi::Error::Success();
}

ffi::Error Fp8BlockMatmulGrouped(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                                 ffi::Buffer<ffi::S32> group_sizes, ffi::AnyBuffer w,
                                 ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::F32> y,
                                 int64_t block) {
  auto xd = x.dimensions();
  auto yd = y->dimensions();
  if (xd.size() != 2 || yd.size() != 2 || xd[0] != yd[0])
    return ffi::Error::InvalidArgument(
        "fp8_block_matmul_grouped: x must be [M, K] and y [M, N]");
  const int64_t M = xd[0], K = xd[1], N = yd[1];
  const int64_t E = static_cast<int64_t>(group_sizes.element_count());
  if (auto e = CheckOperands("fp8_block_matmul_grouped", E, K, N, w, scale, block);
      e.failure())
    return e;
  std::vector<int64_t> bounds;  // group e: rows [bounds[e], bounds[e + 1])
  if (auto e = xlaserve::GroupBounds("fp8_block_matmul_grouped", group_sizes, M, bounds);
      e.failure())
    return e;
  float* yp = y->typed_data();
  xlaserve::ZeroRowsPast(yp, bounds[E], M, N);
  if (bounds[E] == 0) return ffi::Error::Success();
  const int32_t* sizes = group_sizes.typed_data();
  const auto* wp = static_cast<const uint8_t*>(w.untyped_data());
  const float *xp = x.typed_data(), *sp = scale.typed_data();
  const int64_t* st = bounds.data();
  switch (w.element_type()) {
    case ffi::DataType::F8E4M3FN:
      RunGrouped<Weights::kE4M3>(pool, E, st, sizes, K, N, block, xp, wp, sp, yp); break;
    case ffi::DataType::F8E5M2:
      RunGrouped<Weights::kE5M2>(pool, E, st, sizes, K, N, block, xp, wp, sp, yp); break;
    case ffi::DataType::S8:
      RunGrouped<Weights::kI8>(pool, E, st, sizes, K, N, block, xp, wp, sp, yp); break;
    default:
      return ffi::Error::InvalidArgument(
          "fp8_block_matmul_grouped: weights float8_e4m3fn, float8_e5m2 or int8");
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(xlaserve_fp8_block_matmul, Fp8BlockMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("block"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(xlaserve_fp8_block_matmul_grouped, Fp8BlockMatmulGrouped,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("block"));
