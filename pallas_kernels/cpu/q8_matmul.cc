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
#include <type_traits>
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

inline void LoadW(const float* p, __m256& w0, __m256& w1) {
  w0 = _mm256_loadu_ps(p);
  w1 = _mm256_loadu_ps(p + 8);
}

// MR rows of x (row stride K) against one panel (int8 or widened float32) -> MR x 16 of y.
template <int MR, int KU, typename W>
void Tile(const float* x, int64_t K, const W* panel, const float* scale, float* y,
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

// Six rows against a widened float32 panel with twelve named accumulators: the BLIS-style
// 6x16 tile (per k two weight loads and six broadcasts feed twelve FMAs). Written out by
// hand because GCC spills an accumulator array this large to the stack on every step.
void Tile6(const float* x, int64_t K, const float* panel, const float* scale, float* y,
           int64_t N) {
  __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00,
         a30 = a00, a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00;
  const float *x0 = x, *x1 = x + K, *x2 = x + 2 * K, *x3 = x + 3 * K, *x4 = x + 4 * K,
              *x5 = x + 5 * K;
  for (int64_t k = 0; k < K; ++k) {
    const __m256 w0 = _mm256_loadu_ps(panel + k * kNR), w1 = _mm256_loadu_ps(panel + k * kNR + 8);
    __m256 b = _mm256_broadcast_ss(x0 + k);
    a00 = _mm256_fmadd_ps(b, w0, a00);
    a01 = _mm256_fmadd_ps(b, w1, a01);
    b = _mm256_broadcast_ss(x1 + k);
    a10 = _mm256_fmadd_ps(b, w0, a10);
    a11 = _mm256_fmadd_ps(b, w1, a11);
    b = _mm256_broadcast_ss(x2 + k);
    a20 = _mm256_fmadd_ps(b, w0, a20);
    a21 = _mm256_fmadd_ps(b, w1, a21);
    b = _mm256_broadcast_ss(x3 + k);
    a30 = _mm256_fmadd_ps(b, w0, a30);
    a31 = _mm256_fmadd_ps(b, w1, a31);
    b = _mm256_broadcast_ss(x4 + k);
    a40 = _mm256_fmadd_ps(b, w0, a40);
    a41 = _mm256_fmadd_ps(b, w1, a41);
    b = _mm256_broadcast_ss(x5 + k);
    a50 = _mm256_fmadd_ps(b, w0, a50);
    a51 = _mm256_fmadd_ps(b, w1, a51);
  }
  const __m256 s0 = _mm256_loadu_ps(scale), s1 = _mm256_loadu_ps(scale + 8);
  const __m256 acc[6][2] = {{a00, a01}, {a10, a11}, {a20, a21},
                            {a30, a31}, {a40, a41}, {a50, a51}};
  for (int r = 0; r < 6; ++r) {
    _mm256_storeu_ps(y + r * N, _mm256_mul_ps(acc[r][0], s0));
    _mm256_storeu_ps(y + r * N + 8, _mm256_mul_ps(acc[r][1], s1));
  }
}

// Rows [0, rows) against one panel. Tiles keep at most 8 accumulators: GCC spills larger
// accumulator arrays to the stack on every step of k.
template <typename W>
void Panel(const float* x, int64_t rows, int64_t K, const W* panel, const float* scale,
           float* y, int64_t N) {
  int64_t r = 0;
  if constexpr (std::is_same_v<W, float>) {
    for (; r + 6 <= rows; r += 6) Tile6(x + r * K, K, panel, scale, y + r * N, N);
  }
  for (; r + 4 <= rows; r += 4) Tile<4, 1>(x + r * K, K, panel, scale, y + r * N, N);
  switch (rows - r) {
    case 3: Tile<3, 1>(x + r * K, K, panel, scale, y + r * N, N); break;
    case 2: Tile<2, 2>(x + r * K, K, panel, scale, y + r * N, N); break;
    case 1: Tile<1, 4>(x + r * K, K, panel, scale, y + r * N, N); break;
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
    std::vector<float> wide;
    if (T > kDirectRows) wide.resize(K * kNR);
    for (int64_t p = begin; p < end; ++p) {
      const int8_t* panel = wp + p * K * kNR;
      const float* s = sp + p * kNR;
      float* out = yp + p * kNR;
      if (T <= kDirectRows) {
        Panel(xp, T, K, panel, s, out, N);
        continue;
      }
      for (int64_t i = 0; i < K * kNR; i += 16) {
        __m256 w0, w1;
        LoadW(panel + i, w0, w1);
        _mm256_storeu_ps(wide.data() + i, w0);
        _mm256_storeu_ps(wide.data() + i + 8, w1);
      }
      Panel(xp, T, K, wide.data(), s, out, N);
    }
  }, /*grain=*/T > kDirectRows ? 1 : 4);
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
