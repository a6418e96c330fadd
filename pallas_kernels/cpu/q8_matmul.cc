// y[T, N] = x[T, K] @ W[K, N] * scale[N], W int8 with one float scale per output channel.
//
// XLA:CPU turns an int8 weight into float32 in memory before its dot (0.6 GB/s on AVX2),
// so an int8 model ran slower than a float32 one. Here the int8 values are widened in
// registers, and a decode step reads a quarter of float32's bytes.
//
// W comes packed in panels of 16 output channels, panel[p][k][j] = W[k][16p + j], so the
// 16 weights one step of k needs are one contiguous 16-byte load. Panels are split over
// XLA's intra-op threads. Few rows (decode): every row block widens the int8 weights itself
// and keeps KU partial sums per output to cover the FMA latency. More rows: each panel is
// widened once into a float32 buffer, then 6-row tiles run from it.
#include <immintrin.h>

#include <cstdint>
#include <vector>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kNR = 16;           // output channels per panel: two AVX2 registers
constexpr int64_t kDirectRows = 4;    // up to this many rows, widen in registers per tile

inline void LoadW(const int8_t* p, __m256& w0, __m256& w1) {
  __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
}

// MR rows of x (row stride K) against one int8 panel -> MR x 16 of y.
template <int MR, int KU>
void Tile(const float* x, int64_t K, const int8_t* panel, const float* scale, float* y,
          int64_t N) {
  // acc0 / acc1: output columns 0-7 / 8-15; index u * MR + r. Two flat arrays, not one
  // [KU][MR][2]: GCC keeps these in registers, but spilled the larger one on every step.
  __m256 acc0[KU * MR], acc1[KU * MR];
  for (int i = 0; i < KU * MR; ++i) acc0[i] = acc1[i] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += KU) {  // K % KU == 0: the caller checks K % 4
#pragma GCC unroll 4
    for (int u = 0; u < KU; ++u) {
      __m256 w0, w1;
      LoadW(panel + (k + u) * kNR, w0, w1);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        __m256 xb = _mm256_broadcast_ss(x + r * K + k + u);
        acc0[u * MR + r] = _mm256_fmadd_ps(xb, w0, acc0[u * MR + r]);
        acc1[u * MR + r] = _mm256_fmadd_ps(xb, w1, acc1[u * MR + r]);
      }
    }
  }
  __m256 s0 = _mm256_loadu_ps(scale), s1 = _mm256_loadu_ps(scale + 8);
  for (int r = 0; r < MR; ++r) {
    __m256 a0 = acc0[r], a1 = acc1[r];
    for (int u = 1; u < KU; ++u) {
      a0 = _mm256_add_ps(a0, acc0[u * MR + r]);
      a1 = _mm256_add_ps(a1, acc1[u * MR + r]);
    }
    _mm256_storeu_ps(y + r * N, _mm256_mul_ps(a0, s0));
    _mm256_storeu_ps(y + r * N + 8, _mm256_mul_ps(a1, s1));
  }
}

// R <= 6 rows against a widened float32 panel, accumulators in named variables: the
// BLIS-style 6x16 tile (per k two weight loads and R broadcasts feed 2R FMAs). GCC spills an
// accumulator array this large to the stack on every step of k, so no array here.
template <int R>
void WideTile(const float* x, int64_t K, const float* panel, const float* scale, float* y,
              int64_t N) {
  static_assert(R >= 1 && R <= 6);
  __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00,
         a30 = a00, a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00;
#define XLASERVE_ROW(r)                                        \
  if constexpr (R > r) {                                       \
    const __m256 b = _mm256_broadcast_ss(x + r * K + k);       \
    a##r##0 = _mm256_fmadd_ps(b, w0, a##r##0);                 \
    a##r##1 = _mm256_fmadd_ps(b, w1, a##r##1);                 \
  }
  for (int64_t k = 0; k < K; ++k) {
    const __m256 w0 = _mm256_loadu_ps(panel + k * kNR);
    const __m256 w1 = _mm256_loadu_ps(panel + k * kNR + 8);
    XLASERVE_ROW(0) XLASERVE_ROW(1) XLASERVE_ROW(2) XLASERVE_ROW(3) XLASERVE_ROW(4)
    XLASERVE_ROW(5)
  }
#undef XLASERVE_ROW
  const __m256 s0 = _mm256_loadu_ps(scale), s1 = _mm256_loadu_ps(scale + 8);
  const __m256 acc[6][2] = {{a00, a01}, {a10, a11}, {a20, a21},
                            {a30, a31}, {a40, a41}, {a50, a51}};
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(y + r * N, _mm256_mul_ps(acc[r][0], s0));
    _mm256_storeu_ps(y + r * N + 8, _mm256_mul_ps(acc[r][1], s1));
  }
}

// Rows [0, rows) against a widened panel, in tiles of at most 6 rows as even as can be (16
// rows: 6 + 5 + 5), so no tile is left with a few rows' worth of FMAs per weight load.
void WidePanel(const float* x, int64_t rows, int64_t K, const float* panel,
               const float* scale, float* y, int64_t N) {
  const int64_t tiles = (rows + 5) / 6;
  int64_t r = 0;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t n = (rows - r) / (tiles - t) + ((rows - r) % (tiles - t) != 0);
    const float* xr = x + r * K;
    float* yr = y + r * N;
    switch (n) {
      case 6: WideTile<6>(xr, K, panel, scale, yr, N); break;
      case 5: WideTile<5>(xr, K, panel, scale, yr, N); break;
      case 4: WideTile<4>(xr, K, panel, scale, yr, N); break;
      case 3: WideTile<3>(xr, K, panel, scale, yr, N); break;
      case 2: WideTile<2>(xr, K, panel, scale, yr, N); break;
      default: WideTile<1>(xr, K, panel, scale, yr, N); break;
    }
    r += n;
  }
}

// Up to kDirectRows rows against an int8 panel, widened in registers. Tiles keep at most 8
// accumulators (GCC keeps those in registers); KU partial sums cover the FMA latency when
// there are few rows.
void DirectPanel(const float* x, int64_t rows, int64_t K, const int8_t* panel,
                 const float* scale, float* y, int64_t N) {
  switch (rows) {
    case 4: Tile<4, 1>(x, K, panel, scale, y, N); break;
    case 3: Tile<3, 1>(x, K, panel, scale, y, N); break;
    case 2: Tile<2, 2>(x, K, panel, scale, y, N); break;
    case 1: Tile<1, 4>(x, K, panel, scale, y, N); break;
    default: break;
  }
}

ffi::Error Q8Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> w,
                    ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  auto yd = y->dimensions();
  if (xd.size() != 2 || yd.size() != 2 || xd[0] != yd[0])
    return ffi::Error::InvalidArgument("q8_matmul: x must be [T, K] and y [T, N]");
  const int64_t T = xd[0], K = xd[1], N = yd[1];
  if (N % kNR != 0 || K % 4 != 0 || static_cast<int64_t>(w.element_count()) != K * N ||
      static_cast<int64_t>(scale.element_count()) != N)
    return ffi::Error::InvalidArgument(
        "q8_matmul: K % 4 == 0, N % 16 == 0, w K * N int8 values in panels of 16 "
        "columns, scale N floats");
  const float* xp = x.typed_data();
  const int8_t* wp = w.typed_data();
  const float* sp = scale.typed_data();
  float* yp = y->typed_data();
  xlaserve::ParallelFor(pool, N / kNR, [&](int64_t begin, int64_t end) {
    // One buffer per thread for the life of the process: allocating (and zeroing) it per
    // panel cost as much as the panel's FMAs at 16 rows.
    thread_local std::vector<float> wide;
    if (T > kDirectRows && wide.size() < static_cast<size_t>(K * kNR)) wide.resize(K * kNR);
    for (int64_t p = begin; p < end; ++p) {
      const int8_t* panel = wp + p * K * kNR;
      const float* s = sp + p * kNR;
      float* out = yp + p * kNR;
      if (T <= kDirectRows) {
        DirectPanel(xp, T, K, panel, s, out, N);
        continue;
      }
      for (int64_t i = 0; i < K * kNR; i += 16) {
        __m256 w0, w1;
        LoadW(panel + i, w0, w1);
        _mm256_storeu_ps(wide.data() + i, w0);
        _mm256_storeu_ps(wide.data() + i + 8, w1);
      }
      WidePanel(xp, T, K, wide.data(), s, out, N);
    }
  }, /*grain=*/8);  // 8 panels a claim: fewer than 4 shared cache lines between threads' y
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(xlaserve_q8_matmul, Q8Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
