// y[T, N] = x[T, K] @ W[K, N] with W 4-bit in groups of 32 along k: for k in group g,
// W[k][n] = d[g][n] * c[k][n] + m[g][n], codes c in 0..15 and d, m per group and column,
// both float16 or both float32. This is GGUF's Q4_1, so a Q4_1 checkpoint runs on its own
// weights, and a decode step reads 0.625 bytes a weight where int8 reads 1. float32 scales
// are for formats whose per-group scales float16 cannot hold exactly (Q4_K's are products
// of a float16 and a 6-bit integer); a float16 scale gives the same bits either way.
//
// Each row of x is rounded to int16 per group of 32 (x ~ dx[r][g] * xq[r][k], |xq| <= 32767:
// the activations keep 16 bits, where int8 ones, llama.cpp's Q8_1, flip greedy answers of
// small models), so a group's 32 products are one exact integer sum
// s = sum_k xq[r][k] * c[k][n] (at most 32 * 15 * 32767, well inside int32), summed with
// vpdpwssd (pairs of int16 products a lane) where the CPU has AVX-512 VNNI, else vpmaddwd.
// Then, group by group in a fixed order and with one rounding per FMA,
//   y += float(s) * (d[g][n] * dx[r][g]);  y += m[g][n] * (dx[r][g] * sum_k xq[r][k])
// A row's result depends only on the row: not on the rows beside it, nor the tile.
//
// W comes packed in panels of 16 columns, 256 bytes per panel and group: byte
// [h][j][i] (h < 4, j < 16, i < 4) holds the code of k = 4h + i in its low nibble and of
// k = 16 + 4h + i in its high one, column j. One 64-byte load, four shifts and a mask give
// four operands of 16 columns x a pair of k each: k = (4h, 4h + 2), (4h + 1, 4h + 3), and
// the same plus 16 (kPairK). d and m are [panel][group][16].
//
// Functions templated on S take the scales' storage: uint16_t (float16 bits) or float.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "group_quant.h"
#include "groups.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define XLASERVE_Q4_VNNI 1
#else
#define XLASERVE_Q4_VNNI 0
#endif

namespace {

constexpr int64_t kNR = 16;     // columns per panel
constexpr int64_t kGroup = 32;  // values of k per scale
constexpr int64_t kPairs = kGroup / 2;  // int16 pairs of x per group
constexpr int64_t kPanelGroupBytes = kNR * kGroup / 2;
#if XLASERVE_Q4_VNNI
constexpr int64_t kMaxTile = 12;  // rows per tile: 12 integer + 12 float sums in 32 registers
#else
constexpr int64_t kMaxTile = 4;
#endif

// The first k of pair p = 4h + q of a group (q: which of the load's four operands); the
// second is 2 further on.
constexpr int64_t PairK(int64_t p) { return (p % 4 >= 2 ? 16 : 0) + 4 * (p / 4) + p % 2; }

// Rows [r0, r1) of x [T, K] rounded per group into the tile layout the tiles read: for the
// tile of n rows starting at t0, xq as int32 pairs of int16 (the lower k in the low half),
// pair-major (xt[t0 * K / 2 + (g * 16 + p) * n + r - t0]), and per group dx and
// dx * sum(xq) (at t0 * G + g * n + r - t0). A row holding an inf or a NaN gets dx = NaN, so
// its outputs are NaN as a float product's would be; a group of zeros gets dx = 0.
void QuantizeRows(const float* x, int64_t r0, int64_t r1, int64_t T, int64_t K,
                  int32_t* xt, float* dx, float* xsum) {
  const int64_t G = K / kGroup;
  xlaserve::EvenTiles(T, kMaxTile, [&](int64_t t0, int64_t n) {
    for (int64_t r = std::max(r0, t0); r < std::min(r1, t0 + n); ++r) {
      const float* xr = x + r * K;
      const bool finite = xlaserve::RowFinite(xr, K);
      int32_t* pairs = xt + t0 * (K / 2) + (r - t0);
      for (int64_t g = 0; g < G; ++g) {
        __m256i q8[4];
        const float amax = xlaserve::QuantizeGroup(xr + g * kGroup, finite, q8);
        int32_t q[kGroup];
        for (int i = 0; i < 4; ++i)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 8 * i), q8[i]);
        int32_t sum = 0;
        for (int64_t k = 0; k < kGroup; ++k) sum += q[k];
        for (int64_t p = 0; p < kPairs; ++p) {
          const int64_t k = PairK(p);
          pairs[(g * kPairs + p) * n] = static_cast<int32_t>(
              static_cast<uint16_t>(q[k]) | (static_cast<uint32_t>(static_cast<uint16_t>(q[k + 2])) << 16));
        }
        const float d = xlaserve::GroupScale(amax, finite);
        dx[t0 * G + g * n + (r - t0)] = d;
        xsum[t0 * G + g * n + (r - t0)] = d * static_cast<float>(sum);
      }
    }
  });
}

// A decode step's few rows leave the loads too little arithmetic to hide behind: ask for the
// codes and scales kAhead groups on (into the next panel near a panel's end, which the same
// thread usually takes next; a prefetch past the weights' end is dropped, never a fault).
constexpr int64_t kAhead = 8;
template <typename S>
inline void Prefetch(const uint8_t* w, const S* dp, const S* mp) {
  for (int i = 0; i < 4; ++i) _mm_prefetch((const char*)(w + kAhead * kPanelGroupBytes + 64 * i),
                                           _MM_HINT_T0);
  _mm_prefetch((const char*)(dp + kAhead * kNR), _MM_HINT_T0);
  _mm_prefetch((const char*)(mp + kAhead * kNR), _MM_HINT_T0);
}

#if XLASERVE_Q4_VNNI
// R rows against one panel. Each vpdpwssd waits for the one before it on the same sums, so
// a tile of few rows keeps C sets of integer sums (one per operand of a load, or per pair of
// them) and adds them at the end of the group.
template <int R, typename S>
void Tile(const int32_t* xt, const float* dx, const float* xsum, int64_t K,
          const uint8_t* codes, const S* dp, const S* mp, float* y, int64_t N) {
  constexpr int C = R >= 8 ? 1 : R >= 4 ? 2 : 4;
  const int64_t G = K / kGroup;
  const __m512i mask = _mm512_set1_epi32(0x000F000F);
  __m512 acc[R];
  __m512i s[C][R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
#pragma GCC unroll 16
    for (int i = 0; i < C * R; ++i) s[i / R][i % R] = _mm512_setzero_si512();
    const uint8_t* w = codes + g * kPanelGroupBytes;
    const int32_t* xp = xt + g * kPairs * R;
    if constexpr (R < 4) Prefetch(w, dp + g * kNR, mp + g * kNR);
#pragma GCC unroll 4
    for (int h = 0; h < 4; ++h) {
      const __m512i v = _mm512_loadu_si512(w + h * 64);
      const __m512i op[4] = {_mm512_and_si512(v, mask),
                             _mm512_and_si512(_mm512_srli_epi32(v, 8), mask),
                             _mm512_and_si512(_mm512_srli_epi32(v, 4), mask),
                             _mm512_and_si512(_mm512_srli_epi32(v, 12), mask)};
#pragma GCC unroll 4
      for (int q = 0; q < 4; ++q) {
        const int c = C == 4 ? q : C == 2 ? q % 2 : 0;
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r)
          s[c][r] = _mm512_dpwssd_epi32(s[c][r], op[q],
                                        _mm512_set1_epi32(xp[(4 * h + q) * R + r]));
      }
    }
    const __m512 d = xlaserve::LoadScales16(dp + g * kNR);
    const __m512 m = xlaserve::LoadScales16(mp + g * kNR);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      __m512i t = s[0][r];
#pragma GCC unroll 4
      for (int c = 1; c < C; ++c) t = _mm512_add_epi32(t, s[c][r]);
      const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(dx[g * R + r]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), scale, acc[r]);
      acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xsum[g * R + r]), acc[r]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * N, acc[r]);
}
#else
// AVX2: 8 columns at a time, vpmaddwd on the same operands: the same integer sums.
template <int R, typename S>
void HalfTile(const int32_t* xt, const float* dx, const float* xsum, int64_t K,
              const uint8_t* codes, const S* dp, const S* mp, float* y, int64_t N,
              int half) {
  const int64_t G = K / kGroup;
  const __m256i mask = _mm256_set1_epi32(0x000F000F);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m256i s[R];
    for (int r = 0; r < R; ++r) s[r] = _mm256_setzero_si256();
    const uint8_t* w = codes + g * kPanelGroupBytes + half * 32;
    const int32_t* xp = xt + g * kPairs * R;
    for (int h = 0; h < 4; ++h) {
      const __m256i v = _mm256_loadu_si256((const __m256i*)(w + h * 64));
      const __m256i op[4] = {_mm256_and_si256(v, mask),
                             _mm256_and_si256(_mm256_srli_epi32(v, 8), mask),
                             _mm256_and_si256(_mm256_srli_epi32(v, 4), mask),
                             _mm256_and_si256(_mm256_srli_epi32(v, 12), mask)};
      for (int q = 0; q < 4; ++q)
        for (int r = 0; r < R; ++r)
          s[r] = _mm256_add_epi32(s[r], _mm256_madd_epi16(
                                            op[q], _mm256_set1_epi32(xp[(4 * h + q) * R + r])));
    }
    const __m256 d = xlaserve::LoadScales8(dp + g * kNR + half * 8);
    const __m256 m = xlaserve::LoadScales8(mp + g * kNR + half * 8);
    for (int r = 0; r < R; ++r) {
      const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(dx[g * R + r]));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r]), scale, acc[r]);
      acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(xsum[g * R + r]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * N + half * 8, acc[r]);
}

template <int R, typename S>
void Tile(const int32_t* xt, const float* dx, const float* xsum, int64_t K,
          const uint8_t* codes, const S* dp, const S* mp, float* y, int64_t N) {
  HalfTile<R, S>(xt, dx, xsum, K, codes, dp, mp, y, N, 0);
  HalfTile<R, S>(xt, dx, xsum, K, codes, dp, mp, y, N, 1);
}
#endif

template <int R, typename S>
void TileOf(int64_t rows, const int32_t* xt, const float* dx, const float* xsum, int64_t K,
            const uint8_t* codes, const S* dp, const S* mp, float* y, int64_t N) {
  if constexpr (R > 1) {
    if (rows < R) return TileOf<R - 1, S>(rows, xt, dx, xsum, K, codes, dp, mp, y, N);
  }
  Tile<R, S>(xt, dx, xsum, K, codes, dp, mp, y, N);
}

// Rows [0, T) against one panel, in tiles of at most kMaxTile rows as even as can be.
template <typename S>
void Panel(int64_t T, const int32_t* xt, const float* dx, const float* xsum, int64_t K,
           const uint8_t* codes, const S* dp, const S* mp, float* y, int64_t N) {
  const int64_t G = K / kGroup;
  xlaserve::EvenTiles(T, kMaxTile, [&](int64_t r, int64_t n) {
    TileOf<kMaxTile, S>(n, xt + r * (K / 2), dx + r * G, xsum + r * G, K, codes, dp, mp,
                        y + r * N, N);
  });
}

// Rows of x laid out as the tiles read them, in the calling thread's buffers (read by the
// pool's threads until the call returns).
struct Quantized {
  const int32_t* xt;
  const float* dx;
  const float* xsum;
};

// Rows [0, bounds[E]) of x, E runs of rows end to end (run e: rows [bounds[e], bounds[e + 1]),
// one expert's in the grouped form, all T in the single one), through QuantizeRows run by
// run: run e's tiles are the ones Panel cuts it into, laid out from xt + bounds[e] * K / 2,
// dx + bounds[e] * G and xsum + bounds[e] * G. Each row is rounded alone, so the same in any
// run.
Quantized QuantizeRuns(ffi::ThreadPool& pool, const float* x, int64_t E, const int64_t* bounds,
                       int64_t K) {
  const int64_t T = bounds[E], G = K / kGroup;
  thread_local std::vector<int32_t> xt;
  thread_local std::vector<float> dx, xsum;
  if (xt.size() < static_cast<size_t>(T * K / 2)) xt.resize(T * K / 2);
  if (dx.size() < static_cast<size_t>(T * G)) {
    dx.resize(T * G);
    xsum.resize(T * G);
  }
  int32_t* xtp = xt.data();
  float* dxp = dx.data();
  float* xsp = xsum.data();
  xlaserve::ParallelFor(pool, T, [&](int64_t r0, int64_t r1) {
    // the runs rows [r0, r1) meet, from the last one starting at or before r0
    for (int64_t e = std::upper_bound(bounds, bounds + E, r0) - bounds - 1;
         e < E && bounds[e] < r1; ++e) {
      const int64_t s = bounds[e];
      QuantizeRows(x + s * K, std::max(r0, s) - s, std::min(r1, bounds[e + 1]) - s,
                   bounds[e + 1] - s, K, xtp + s * (K / 2), dxp + s * G, xsp + s * G);
    }
  }, /*grain=*/std::max<int64_t>(1, 8192 / K));
  return {xtp, dxp, xsp};
}

// x [T, K] (T > 0) through QuantizeRuns, then the panels split over the pool's threads.
template <typename S>
void Run(ffi::ThreadPool& pool, const float* xp, int64_t T, int64_t K, int64_t N,
         const uint8_t* cp, const S* dp, const S* mp, float* yp) {
  const int64_t G = K / kGroup;
  const int64_t bounds[2] = {0, T};
  const Quantized q = QuantizeRuns(pool, xp, 1, bounds, K);
  xlaserve::ParallelFor(pool, N / kNR, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      Panel<S>(T, q.xt, q.dx, q.xsum, K, cp + p * K * kNR / 2, dp + p * G * kNR,
               mp + p * G * kNR, yp + p * kNR, N);
  }, /*grain=*/2);
}

ffi::Error Q4Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer codes,
                    ffi::AnyBuffer d, ffi::AnyBuffer m, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  auto yd = y->dimensions();
  if (xd.size() != 2 || yd.size() != 2 || xd[0] != yd[0])
    return ffi::Error::InvalidArgument("q4_matmul: x must be [T, K] and y [T, N]");
  const int64_t T = xd[0], K = xd[1], N = yd[1];
  constexpr const char* kShapes =
      "q4_matmul: K % 32 == 0, N % 16 == 0, K * N 4-bit codes in panels of 16 columns, "
      "d and m K / 32 * N values, both float16 or both float32";
  if (N % kNR != 0 || K % kGroup != 0 || codes.element_type() != ffi::DataType::U4 ||
      static_cast<int64_t>(codes.element_count()) != K * N ||
      static_cast<int64_t>(d.element_count()) != K / kGroup * N ||
      static_cast<int64_t>(m.element_count()) != K / kGroup * N ||
      d.element_type() != m.element_type())
    return ffi::Error::InvalidArgument(kShapes);
  return xlaserve::WithScaleType(d.element_type(), kShapes, [&](auto tag) {
    using S = decltype(tag);
    if (T > 0)
      Run<S>(pool, x.typed_data(), T, K, N, static_cast<const uint8_t*>(codes.untyped_data()),
             static_cast<const S*>(d.untyped_data()), static_cast<const S*>(m.untyped_data()),
             y->typed_data());
    return ffi::Error::Success();
  });
}

// The grouped form, a mixture-of-experts projection: rows sorted by expert, expert e's rows
// (bounds[e] to bounds[e + 1]) against its codes and scales (cp, dp and mp hold E weights,
// each packed as above). Each row is rounded and goes through the same tiles as in the
// single kernel, so it gets the same bits whatever its group's size. Work items are
// (expert, panel) pairs; experts without rows are skipped.
template <typename S>
void RunGrouped(ffi::ThreadPool& pool, const float* xp, int64_t E, const int64_t* bounds,
                int64_t K, int64_t N, const uint8_t* cp, const S* dp, const S* mp, float* yp) {
  const int64_t G = K / kGroup, panels = N / kNR;
  const Quantized q = QuantizeRuns(pool, xp, E, bounds, K);
  xlaserve::ParallelFor(pool, E * panels, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t e = i / panels, p = i % panels, s = bounds[e];
      if (bounds[e + 1] == s) continue;
      Panel<S>(bounds[e + 1] - s, q.xt + s * (K / 2), q.dx + s * G, q.xsum + s * G, K,
               cp + (e * K * N + p * K * kNR) / 2, dp + (e * G * N + p * G * kNR),
               mp + (e * G * N + p * G * kNR), yp + s * N + p * kNR, N);
    }
  });
}

// x [M, K], group_sizes [E], codes E * K * N, d and m E * K / 32 * N: group e's rows against
// expert e's weight; rows past the groups are zeros.
ffi::Error Q4MatmulGrouped(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                           ffi::Buffer<ffi::S32> group_sizes, ffi::AnyBuffer codes,
                           ffi::AnyBuffer d, ffi::AnyBuffer m, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  auto yd = y->dimensions();
  if (xd.size() != 2 || yd.size() != 2 || xd[0] != yd[0])
    return ffi::Error::InvalidArgument("q4_matmul_grouped: x must be [M, K] and y [M, N]");
  const int64_t M = xd[0], K = xd[1], N = yd[1];
  const int64_t E = static_cast<int64_t>(group_sizes.element_count());
  constexpr const char* kShapes =
      "q4_matmul_grouped: K % 32 == 0, N % 16 == 0, E weights of K * N 4-bit codes in panels "
      "of 16 columns, d and m E * K / 32 * N values, both float16 or both float32";
  if (N % kNR != 0 || K % kGroup != 0 || codes.element_type() != ffi::DataType::U4 ||
      static_cast<int64_t>(codes.element_count()) != E * K * N ||
      static_cast<int64_t>(d.element_count()) != E * (K / kGroup) * N ||
      static_cast<int64_t>(m.element_count()) != E * (K / kGroup) * N ||
      d.element_type() != m.element_type())
    return ffi::Error::InvalidArgument(kShapes);
  std::vector<int64_t> bounds;  // group e: rows [bounds[e], bounds[e + 1])
  if (auto error = xlaserve::GroupBounds("q4_matmul_grouped", group_sizes, M, bounds);
      error.failure())
    return error;
  return xlaserve::WithScaleType(d.element_type(), kShapes, [&](auto tag) {
    using S = decltype(tag);
    float* yp = y->typed_data();
    xlaserve::ZeroRowsPast(yp, bounds[E], M, N);
    if (bounds[E] > 0)
      RunGrouped<S>(pool, x.typed_data(), E, bounds.data(), K, N,
                    static_cast<const uint8_t*>(codes.untyped_data()),
                    static_cast<const S*>(d.untyped_data()),
                    static_cast<const S*>(m.untyped_data()), yp);
    return ffi::Error::Success();
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(xlaserve_q4_matmul, Q4Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(xlaserve_q4_matmul_grouped, Q4MatmulGrouped,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
