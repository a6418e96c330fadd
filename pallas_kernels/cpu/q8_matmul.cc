// y[T, N] = x[T, K] @ W[K, N] * scale[N], W int8 with one float scale per output channel.
//
// XLA:CPU turns an int8 weight into float32 in memory before its dot (0.6 GB/s on AVX2),
// so an int8 model ran slower than a float32 one. Here the int8 values are widened in
// registers, and a decode step reads a quarter of float32's bytes.
//
// Each row of x is first rounded to int16 with a scale of its own (x ~ xs[r] * xq[r],
// |xq| <= 32767), and products are summed as integers by vpmaddwd: 16 multiply-adds per
// instruction where a float32 FMA does 8, and an exact sum, so a row's result does not
// depend on which other rows share the call. A sum of 512 products cannot overflow int32
// (512 * 32767 * 128 < 2^31), so every 512 values of k the sums go to float:
// y = sum over blocks of float(block sum) * (xs[r] * scale[n]).
//
// W comes packed in panels of 16 output channels, with pairs of k side by side:
// panel[p][k / 2][j][k % 2] = W[k][16p + j], so the 32 weights one pair of k needs are one
// contiguous load, and vpmaddwd multiplies them by a broadcast pair (x[k], x[k + 1]).
// Panels are split over XLA's intra-op threads; within a panel, tiles of up to 6 rows each
// widen the int8 weights to int16 in registers (as fast as reading a panel widened once
// into memory, which this kernel did before). Where the compiler targets AVX-512 VNNI
// (-march=native on such a CPU) the tiles are vpdpwssd ones of up to 16 rows (TileVnni),
// which give the same bits about 1.5x faster.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "groups.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define XLASERVE_Q8_VNNI 1
#else
#define XLASERVE_Q8_VNNI 0
#endif

namespace {

constexpr int64_t kNR = 16;          // output channels per panel: two AVX2 registers of int32
constexpr int64_t kMaxTile = 6;      // rows per tile: 12 accumulators, 2 weights, 1 broadcast
constexpr int64_t kBlock = 512;      // values of k summed as int32 before going to float
constexpr float kQMax = 32767.0f;    // int16 range of a quantized row

// x[r] ~ xs[r] * xq[r] for rows [r0, r1). A row of zeros has scale 0; a row holding an
// inf or a NaN has scale NaN, so its outputs are NaN as a float product's would be.
void QuantizeRows(const float* x, int64_t r0, int64_t r1, int64_t K, int16_t* xq,
                  float* xs) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t r = r0; r < r1; ++r) {
    const float* xr = x + r * K;
    __m256 m = _mm256_setzero_ps();
    bool finite = true;
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
      const __m256 v = _mm256_andnot_ps(sign, _mm256_loadu_ps(xr + k));
      finite &= _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)) == 0;
      m = _mm256_max_ps(m, v);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, m);
    float amax = 0.0f;
    for (float l : lanes) amax = std::max(amax, l);
    for (; k < K; ++k) {
      finite &= !std::isnan(xr[k]);
      amax = std::max(amax, std::fabs(xr[k]));
    }
    finite &= std::isfinite(amax);
    const float inv = (finite && amax > 0.0f) ? kQMax / amax : 0.0f;
    xs[r] = finite ? amax / kQMax : NAN;
    const __m256 iv = _mm256_set1_ps(inv);
    int16_t* q = xq + r * K;
    for (k = 0; k + 16 <= K; k += 16) {
      const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xr + k), iv));
      const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xr + k + 8), iv));
      // packs works within 128-bit lanes: put the halves back in order
      const __m256i p = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + k), p);
    }
    for (; k < K; ++k) q[k] = static_cast<int16_t>(std::lrintf(xr[k] * inv));  // same rounding
  }
}

// The 32 weights of one pair of k, widened to int16: columns 0-7 and 8-15, each (k, k + 1)
// adjacent.
inline void LoadPair(const int8_t* panel, int64_t k, __m256i& w0, __m256i& w1) {
  const int8_t* p = panel + k * kNR;
  w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
}

// One row's 16 block sums into y: the first block stores, later ones add. Always one FMA,
// so the rounding is the same in every tile, whatever GCC would contract on its own.
inline void Emit(float* y, __m256i a0, __m256i a1, float xs, __m256 s0, __m256 s1,
                 bool first) {
  const __m256 b = _mm256_set1_ps(xs);
  const __m256 y0 = first ? _mm256_setzero_ps() : _mm256_loadu_ps(y);
  const __m256 y1 = first ? _mm256_setzero_ps() : _mm256_loadu_ps(y + 8);
  _mm256_storeu_ps(y, _mm256_fmadd_ps(_mm256_cvtepi32_ps(a0), _mm256_mul_ps(b, s0), y0));
  _mm256_storeu_ps(y + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(a1), _mm256_mul_ps(b, s1), y1));
}

// a0 += pairwise products of b and w0 summed, a1 likewise with w1. Written out because
// GCC, left to itself, sent every sum through a spare register and then spilled
// accumulators: at 6 rows the 12 accumulators, two weights, the broadcast and one product
// take all 16 registers.
inline void MaddAdd(__m256i b, __m256i w0, __m256i w1, __m256i& a0, __m256i& a1) {
  __m256i t;
  __asm__("vpmaddwd %[w0], %[b], %[t]\n\t"
          "vpaddd %[t], %[a0], %[a0]\n\t"
          "vpmaddwd %[w1], %[b], %[t]\n\t"
          "vpaddd %[t], %[a1], %[a1]"
          : [a0] "+x"(a0), [a1] "+x"(a1), [t] "=&x"(t)
          : [b] "x"(b), [w0] "x"(w0), [w1] "x"(w1));
}

// R <= 6 quantized rows (row stride K) against one panel -> R x 16 of y. Accumulators are
// named variables: GCC spills an array of this many to the stack on every step of k.
template <int R>
void Tile(const int16_t* xq, const float* xs, int64_t K, const int8_t* panel,
          const float* scale, float* y, int64_t N) {
  static_assert(R >= 1 && R <= kMaxTile);
  const __m256 s0 = _mm256_loadu_ps(scale), s1 = _mm256_loadu_ps(scale + 8);
  const __m256i z = _mm256_setzero_si256();
  __m256i a00 = z, a01 = z, a10 = z, a11 = z, a20 = z, a21 = z, a30 = z, a31 = z, a40 = z,
          a41 = z, a50 = z, a51 = z;
#define XLASERVE_ROW(r)                                                   \
  if constexpr (R > r) {                                                  \
    int32_t pair;                                                         \
    std::memcpy(&pair, xq + r * K + k, sizeof pair);                      \
    MaddAdd(_mm256_set1_epi32(pair), w0, w1, a##r##0, a##r##1);           \
  }
#define XLASERVE_EMIT(r)                                                  \
  if constexpr (R > r) {                                                  \
    Emit(y + r * N, a##r##0, a##r##1, xs[r], s0, s1, k0 == 0);            \
    a##r##0 = a##r##1 = z;                                                \
  }
  for (int64_t k0 = 0; k0 < K; k0 += kBlock) {
    const int64_t k1 = std::min(K, k0 + kBlock);
    for (int64_t k = k0; k < k1; k += 2) {
      __m256i w0, w1;
      LoadPair(panel, k, w0, w1);
      XLASERVE_ROW(0) XLASERVE_ROW(1) XLASERVE_ROW(2) XLASERVE_ROW(3) XLASERVE_ROW(4)
      XLASERVE_ROW(5)
    }
    XLASERVE_EMIT(0) XLASERVE_EMIT(1) XLASERVE_EMIT(2) XLASERVE_EMIT(3) XLASERVE_EMIT(4)
    XLASERVE_EMIT(5)
  }
#undef XLASERVE_ROW
#undef XLASERVE_EMIT
}

#if XLASERVE_Q8_VNNI
// With AVX-512 VNNI, one vpdpwssd does a row's vpmaddwd and vpaddd for all 16 columns of a
// panel, its pair of x broadcast from memory: one instruction per row and pair of k where
// the AVX2 tile issues five, so the multiply units, not the issue of the adds and
// broadcasts, set the pace. Tiles of up to 16 rows (measured faster than 12, 18, 20 or
// 24) let each widened weight serve almost three times as many rows. The integer sums are
// the same, and so is the float arithmetic after them (Emit, lane by lane): y is the same
// to the bit.
constexpr int64_t kMaxTileVnni = 16;

// xt: the tile's R rows as pairs of k, pair-major (xt[(k / 2) * R + r] holds row r's x[k]
// and x[k + 1]), so a step of k reads its R broadcasts at fixed offsets from one pointer.
// A vpdpwssd waits for the one before it on the same sums (4 cycles or more), so a tile of
// few rows keeps C sets of sums, each taking every C-th pair of k, and adds them at the end
// of a block: at least 8 chains in flight. Integer sums come out the same in any order.
template <int R>
void TileVnni(const int32_t* xt, const float* xs, int64_t K, const int8_t* panel,
              const float* scale, float* y, int64_t N) {
  constexpr int C = R >= 8 ? 1 : R >= 4 ? 2 : 4;
  const __m256 s0 = _mm256_loadu_ps(scale), s1 = _mm256_loadu_ps(scale + 8);
  __m512i acc[C][R];
  for (int64_t k0 = 0; k0 < K; k0 += kBlock) {
    const int64_t k1 = std::min(K, k0 + kBlock);
#pragma GCC unroll 16
    for (int i = 0; i < C * R; ++i) acc[i / R][i % R] = _mm512_setzero_si512();
    const int32_t* xp = xt + (k0 / 2) * R;
    int64_t k = k0;
    for (; k + 2 * C <= k1; k += 2 * C, xp += C * R) {
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) {
        const __m512i w = _mm512_cvtepi8_epi16(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + (k + 2 * c) * kNR)));
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r)
          acc[c][r] = _mm512_dpwssd_epi32(acc[c][r], w, _mm512_set1_epi32(xp[c * R + r]));
      }
    }
    for (; k < k1; k += 2, xp += R) {  // the pairs of k left over: into the first set
      const __m512i w = _mm512_cvtepi8_epi16(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + k * kNR)));
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r)
        acc[0][r] = _mm512_dpwssd_epi32(acc[0][r], w, _mm512_set1_epi32(xp[r]));
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      __m512i a = acc[0][r];
#pragma GCC unroll 4
      for (int c = 1; c < C; ++c) a = _mm512_add_epi32(a, acc[c][r]);
      Emit(y + r * N, _mm512_castsi512_si256(a), _mm512_extracti64x4_epi64(a, 1), xs[r], s0,
           s1, k0 == 0);
    }
  }
}

template <int R>
void TileVnniOf(int64_t rows, const int32_t* xt, const float* xs, int64_t K,
                const int8_t* panel, const float* scale, float* y, int64_t N) {
  if constexpr (R > 1) {
    if (rows < R) return TileVnniOf<R - 1>(rows, xt, xs, K, panel, scale, y, N);
  }
  TileVnni<R>(xt, xs, K, panel, scale, y, N);
}

// Rows [r0, r1) of xq [T, K] into xt, tile by tile (the tiles Panel cuts T into), each
// tile's rows pair-major: a tile reads its x as one contiguous stream.
void PairMajor(const int16_t* xq, int64_t r0, int64_t r1, int64_t T, int64_t K, int32_t* xt) {
  xlaserve::EvenTiles(T, kMaxTileVnni, [&](int64_t t0, int64_t n) {
    int32_t* tile = xt + t0 * (K / 2);
    for (int64_t r = std::max(r0, t0); r < std::min(r1, t0 + n); ++r) {
      const int16_t* q = xq + r * K;
      for (int64_t k = 0; k < K; k += 2) std::memcpy(tile + (k / 2) * n + (r - t0), q + k, 4);
    }
  });
}

// Rows [0, T) against one panel, in tiles of at most kMaxTileVnni rows as even as can be.
void Panel(int64_t T, const int32_t* xt, const float* xs, int64_t K, const int8_t* panel,
           const float* scale, float* y, int64_t N) {
  xlaserve::EvenTiles(T, kMaxTileVnni, [&](int64_t r, int64_t n) {
    TileVnniOf<kMaxTileVnni>(n, xt + r * (K / 2), xs + r, K, panel, scale, y + r * N, N);
  });
}
#else
void TileOf(int64_t rows, const int16_t* xq, const float* xs, int64_t K, const int8_t* panel,
            const float* scale, float* y, int64_t N) {
  switch (rows) {
    case 6: Tile<6>(xq, xs, K, panel, scale, y, N); break;
    case 5: Tile<5>(xq, xs, K, panel, scale, y, N); break;
    case 4: Tile<4>(xq, xs, K, panel, scale, y, N); break;
    case 3: Tile<3>(xq, xs, K, panel, scale, y, N); break;
    case 2: Tile<2>(xq, xs, K, panel, scale, y, N); break;
    default: Tile<1>(xq, xs, K, panel, scale, y, N); break;
  }
}

// Rows [0, T) against one panel, in tiles of at most kMaxTile rows as even as can be.
void Panel(int64_t T, const int16_t* xq, const float* xs, int64_t K, const int8_t* panel,
           const float* scale, float* y, int64_t N) {
  xlaserve::EvenTiles(T, kMaxTile, [&](int64_t r, int64_t n) {
    TileOf(n, xq + r * K, xs + r, K, panel, scale, y + r * N, N);
  });
}
#endif

#if XLASERVE_Q8_VNNI
using XWord = int32_t;  // what Panel reads x as: pairs of int16 values, tile by tile (PairMajor)
#else
using XWord = int16_t;  // the int16 values, row by row
#endif
constexpr int64_t kWordK = sizeof(XWord) / sizeof(int16_t);  // values of k per XWord

// Rows of x as Panel reads them, in the calling thread's buffers (read by the pool's threads
// until the call returns).
struct Quantized {
  const XWord* x;
  const float* xs;
};

// Rows [0, bounds[E]) of x, E runs of rows end to end (run e: rows [bounds[e], bounds[e + 1]),
// one expert's in the grouped form, all T in the single one), through QuantizeRows; run e's
// rows start at x + bounds[e] * K / kWordK and xs + bounds[e], and with VNNI are laid out by
// PairMajor in the tiles Panel cuts the run into. Each row is rounded alone, so the same in
// any run.
Quantized QuantizeRuns(ffi::ThreadPool& pool, const float* x, int64_t E, const int64_t* bounds,
                       int64_t K) {
  const int64_t T = bounds[E];
  thread_local std::vector<int16_t> xq;
  thread_local std::vector<float> xs;
  if (xq.size() < static_cast<size_t>(T * K)) xq.resize(T * K);
  if (xs.size() < static_cast<size_t>(T)) xs.resize(T);
  int16_t* xqp = xq.data();
  float* xsp = xs.data();
#if XLASERVE_Q8_VNNI
  thread_local std::vector<int32_t> xt;
  if (xt.size() < static_cast<size_t>(T * K / 2)) xt.resize(T * K / 2);
  XWord* xw = xt.data();
#else
  XWord* xw = xqp;
#endif
  xlaserve::ParallelFor(pool, T, [&](int64_t r0, int64_t r1) {
    QuantizeRows(x, r0, r1, K, xqp, xsp);
#if XLASERVE_Q8_VNNI
    // the runs rows [r0, r1) meet, from the last one starting at or before r0
    for (int64_t e = std::upper_bound(bounds, bounds + E, r0) - bounds - 1;
         e < E && bounds[e] < r1; ++e) {
      const int64_t s = bounds[e];
      PairMajor(xqp + s * K, std::max(r0, s) - s, std::min(r1, bounds[e + 1]) - s,
                bounds[e + 1] - s, K, xw + s * (K / 2));
    }
#endif
  }, /*grain=*/std::max<int64_t>(1, 8192 / K));
  return {xw, xsp};
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
  if (T == 0) return ffi::Error::Success();
  const int8_t* wp = w.typed_data();
  const float* sp = scale.typed_data();
  float* yp = y->typed_data();
  const int64_t bounds[2] = {0, T};
  const Quantized q = QuantizeRuns(pool, x.typed_data(), 1, bounds, K);
  xlaserve::ParallelFor(pool, N / kNR, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      Panel(T, q.x, q.xs, K, wp + p * K * kNR, sp + p * kNR, yp + p * kNR, N);
  }, /*grain=*/2);  // 2 panels a claim: 36-panel matmuls split evenly over two threads
  return ffi::Error::Success();
}

// The grouped form, a mixture-of-experts projection: rows sorted by expert, group e's rows
// (sizes[e] of them, after the groups before it) against expert e's panels (w holds E
// weights of K * N values, each packed as above) and channel scales (scale float32[E * N]).
// Each row is rounded and goes through the same tiles as in the single kernel, so it gets
// the same bits whatever its group's size; rows past the groups are zeros. Work items are
// (expert, panel) pairs; experts without rows are skipped.
ffi::Error Q8MatmulGrouped(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                           ffi::Buffer<ffi::S32> group_sizes, ffi::Buffer<ffi::S8> w,
                           ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  auto yd = y->dimensions();
  if (xd.size() != 2 || yd.size() != 2 || xd[0] != yd[0])
    return ffi::Error::InvalidArgument("q8_matmul_grouped: x must be [M, K] and y [M, N]");
  const int64_t M = xd[0], K = xd[1], N = yd[1];
  const int64_t E = static_cast<int64_t>(group_sizes.element_count());
  if (N % kNR != 0 || K % 4 != 0 || static_cast<int64_t>(w.element_count()) != E * K * N ||
      static_cast<int64_t>(scale.element_count()) != E * N)
    return ffi::Error::InvalidArgument(
        "q8_matmul_grouped: K % 4 == 0, N % 16 == 0, w E weights of K * N int8 values in "
        "panels of 16 columns, scale E * N floats");
  std::vector<int64_t> bounds;  // group e: rows [bounds[e], bounds[e + 1])
  if (auto error = xlaserve::GroupBounds("q8_matmul_grouped", group_sizes, M, bounds);
      error.failure())
    return error;
  float* yp = y->typed_data();
  xlaserve::ZeroRowsPast(yp, bounds[E], M, N);
  if (bounds[E] == 0) return ffi::Error::Success();
  const int8_t* wp = w.typed_data();
  const float* sp = scale.typed_data();
  const Quantized q = QuantizeRuns(pool, x.typed_data(), E, bounds.data(), K);
  const int64_t panels = N / kNR;
  xlaserve::ParallelFor(pool, E * panels, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t e = i / panels, p = i % panels, s = bounds[e];
      if (bounds[e + 1] == s) continue;
      Panel(bounds[e + 1] - s, q.x + s * (K / kWordK), q.xs + s, K,
            wp + (e * K * N + p * K * kNR), sp + (e * N + p * kNR), yp + s * N + p * kNR, N);
    }
  });
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(xlaserve_q8_matmul_grouped, Q8MatmulGrouped,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
